"""The report's headline: per model family one line for each of the paper's three questions (variation, functional
dependence, execution). Each restates numbers found elsewhere in the report; where a question has no data, it says
which command provides them."""

from __future__ import annotations

from pathlib import Path

from fcaudit import protocol
from fcaudit.controllers.findings import LATER_TOKENS
from fcaudit.io import read_json
from fcaudit.report.figures import VARIANCE_TERMS
from fcaudit.report.tables import fmt_g, fmt_pct, missing
from fcaudit.stats.results import met_word
from fcaudit.summary import FamilyResult


def variation_line(variations: list[dict], fractions: dict[str, float] | None) -> str:
    if not variations:
        return "no variation.json in its audits (rerun `fcaudit audit`)"
    if not fractions:
        return ("none: the coefficients are the same for every input, token and layer (variance 0, nothing to "
                "decompose)")
    layer = fractions.get("layer", 0.0)
    rest = sum(fractions.get(t, 0.0) for t in VARIANCE_TERMS if t != "layer")
    if rest <= 1e-12:
        return f"across layers only: layer identity explains {fmt_pct(layer, 1)} of the coefficient variance"
    return (f"layer identity explains {fmt_pct(layer, 1)} of the coefficient variance; input, token and their "
            f"interactions {fmt_pct(rest, 1)} (balanced ANOVA, descriptive)")


def dependence_line(fam: FamilyResult) -> str:
    pen = fam.penalties()
    labels = dict(zip(pen.names, pen.labels))
    parts = []
    assignment = [c for c in ("CrossInput", "TokenShuffle") if c in pen]
    if assignment:
        parts.append(", ".join(f"{labels.get(c, c)} ΔNLL {fmt_g(pen[c].statistic)}" for c in assignment))
    # the controller's own static condition (routers: StaticTopK) against Eq. 8's R
    reference = protocol.structure_removed(pen.names)
    if fam.static in pen.names:
        s = pen[fam.static]
        text = (f"{labels.get(fam.static, fam.static)} {fmt_g(s.statistic)} [{fmt_g(s.confidence_interval.low)}, "
                f"{fmt_g(s.confidence_interval.high)}]")
        if reference is not None:
            text += f" vs {labels.get(reference, reference)} {fmt_g(pen[reference].statistic)}"
        if (r := {r.condition: r for r in fam.statistics().retentions()}.get(fam.static)) is not None:
            value = (f"undefined ({r.note or 'no clear gap to retain'})" if missing(r.statistic)
                     else fmt_pct(r.statistic, 1))
            low, high = r.confidence_interval
            ci = "" if missing(low) or missing(high) else f" [{fmt_pct(low, 1)}, {fmt_pct(high, 1)}]"
            text += f", retention {value}{ci}"
        parts.append(text)
    crit = "; ".join(f"{c['name']}: {met_word(c['met'])}" for c in fam.verdicts())
    flips = [r.later_token_flips for r in fam.replays if r.later_token_flips]
    if flips:
        parts.append(f"{LATER_TOKENS} ({', '.join(map(str, flips))} decisions at earlier positions changed with the "
                     "last quarter of the probe windows: the Correct baseline uses future tokens)")
    line = "; ".join(parts) if parts else "no intervention results"
    return line + (f" — criteria: {crit}" if crit else "")


def _resolved(p: str | None) -> str:
    return str(Path(p).resolve()) if p else ""


def audited_checkpoints(fam: FamilyResult) -> set[str]:
    """The checkpoints the family's audits ran on (from each audit's config.json)."""
    configs = [read_json(cfg) for a in fam.audit_dirs if (cfg := Path(a) / "config.json").is_file()]
    return {_resolved(ckpt) for c in configs if (ckpt := c["model"].get("checkpoint"))}


def execution_line(rows: list[dict], checkpoints: set[str]) -> str:
    mine = [r for r in rows if _resolved(r.get("checkpoint")) in checkpoints]
    if not mine:
        return "not measured for these checkpoints (run `fcaudit execution` on them, with a Dense one)"
    r = mine[0]
    skipped = r["n_blocks"] - r["executed_blocks"]
    pairs = r.get("token_block_fraction")
    text = (f"{r['executed_blocks']}/{r['n_blocks']} blocks run"
            + (" (no block skipped)" if skipped == 0 else f" ({skipped} skipped)"))
    if not missing(pairs):  # token routers: blocks run on the tokens chosen
        text += (f", but the routed blocks run {fmt_pct(r['token_fraction'], 1)} of the tokens: "
                 f"{fmt_pct(pairs, 1)} of the token x block pairs run, {fmt_pct(1 - float(pairs), 1)} skipped")
    if ratios := [(n, r[c]) for n, c in (("FLOPs", "flops_vs_dense"), ("latency", "latency_vs_dense"))
                  if not missing(r.get(c))]:
        text += "; " + ", ".join(f"{n} {float(v):.2f}x" for n, v in ratios) + " Dense's"
    else:
        text += "; no Dense model of the same architecture measured for ratios"
    if r.get("latency_noisy"):
        text += " (latency noisy: spread over repetitions exceeds the median)"
    if not missing(r.get("experts_per_token")):
        text += (f"; {float(r['experts_per_token']):.3g} experts per token run, "
                 f"{fmt_pct(r['active_expert_fraction'], 1)} of the expert FLOPs of running all")
    text += "; " + decoding_words(r)
    return text + (f" ({len(mine)} checkpoints measured; the first shown)" if len(mine) > 1 else "")


def layers_run(fraction) -> str:
    """The share of (layer, token) pairs that ran; "no layer skipped" where every one did."""
    return "—" if missing(fraction) else "no layer skipped" if float(fraction) == 1.0 else fmt_pct(fraction, 1)


def decoding_words(r: dict) -> str:
    """What decoding with a KV cache runs: the share of (layer, token) pairs ("no layer skipped" where every block
    runs), FLOPs and latency per token vs Dense; or why the model does not decode."""
    fraction = r.get("executed_layer_fraction")
    if missing(fraction):
        note = r.get("decode_note")
        return f"decoding: not measured ({note})" if isinstance(note, str) and note else "decoding: not measured"
    text = "decoding: " + layers_run(fraction) + ("" if float(fraction) == 1.0 else " of the (layer, token) pairs run")
    ratios = [(n, r.get(c)) for n, c in (("FLOPs", "decode_flops_vs_dense"), ("latency", "decode_latency_vs_dense"))]
    if shown := [f"{n} {float(v):.2f}x" for n, v in ratios if not missing(v)]:
        text += ", " + ", ".join(shown) + " Dense's per token"
    return text + (" (latency noisy)" if r.get("decode_noisy") else "")
