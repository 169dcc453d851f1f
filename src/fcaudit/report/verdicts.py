"""The report's headline: per model family one line for each of the paper's three questions (variation, functional
dependence, execution). Each restates numbers found elsewhere in the report; where a question has no data, it says
which command provides them."""

from __future__ import annotations

from pathlib import Path

from fcaudit import protocol
from fcaudit.auditor.results import LATER_TOKENS, later_flips
from fcaudit.io import read_json
from fcaudit.report.figures import VARIANCE_TERMS
from fcaudit.report.tables import fmt_g, fmt_pct, missing
from fcaudit.summary import met_word


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


def dependence_line(fam: dict) -> str:
    conds, rets = fam["conditions"].set_index("condition"), fam["retention"].set_index("condition")
    parts = []
    assignment = [c for c in ("CrossInput", "TokenShuffle") if c in conds.index]
    if assignment:
        parts.append(", ".join(f"{conds.loc[c, 'label']} ΔNLL {fmt_g(conds.loc[c, 'mean'])}" for c in assignment))
    # the static profile (token routers: StaticTopK, the static condition they are offered) against Eq. 8's R
    static = next((c for c in ("StaticProfile", "StaticTopK") if c in conds.index), None)
    reference = protocol.structure_removed(conds.index)
    if static is not None:
        s = conds.loc[static]
        text = f"{s['label']} {fmt_g(s['mean'])} [{fmt_g(s['ci_low'])}, {fmt_g(s['ci_high'])}]"
        if reference is not None:
            text += f" vs {conds.loc[reference, 'label']} {fmt_g(conds.loc[reference, 'mean'])}"
        if static in rets.index:
            r = rets.loc[static]
            value = (f"undefined ({r['note'] or 'no clear gap to retain'})" if missing(r["retention"])
                     else fmt_pct(r["retention"], 1))
            ci = "" if missing(r["ci_low"]) or missing(r["ci_high"]) else \
                f" [{fmt_pct(r['ci_low'], 1)}, {fmt_pct(r['ci_high'], 1)}]"
            text += f", retention {value}{ci}"
        parts.append(text)
    crit = "; ".join(f"{c['name']}: {met_word(c['met'])}" for c in fam["criteria"])
    flips = [later_flips(r) for r in fam["replay"] if later_flips(r)]
    if flips:
        parts.append(f"{LATER_TOKENS} ({', '.join(map(str, flips))} decisions at earlier positions changed with the "
                     "last quarter of the probe windows: the Correct baseline uses future tokens)")
    line = "; ".join(parts) if parts else "no intervention results"
    return line + (f" — criteria: {crit}" if crit else "")


def _resolved(p: str | None) -> str:
    return str(Path(p).resolve()) if p else ""


def audited_checkpoints(fam: dict) -> set[str]:
    """The checkpoints the family's audits ran on (from each audit's config.json)."""
    configs = [read_json(cfg) for a in fam["audits"] if (cfg := Path(a) / "config.json").is_file()]
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
    return text + (f" ({len(mine)} checkpoints measured; the first shown)" if len(mine) > 1 else "")
