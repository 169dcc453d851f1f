"""`fcaudit report`: find the summaries, audits, training runs (metrics.json, table1.csv) and execution results under
the inputs and render them as Markdown and one self-contained HTML page (figures embedded as data URIs); every number
shown is also written as CSV/JSON beside it."""

from __future__ import annotations

import base64
import html
import json
import os
import re
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
import pandas as pd

from fcaudit.auditor.directory import MARKER
from fcaudit.auditor.results import Replay
from fcaudit.controllers.findings import CAUSALITY, TOKEN_ROUTING
from fcaudit.errors import FcauditError
from fcaudit.execution.decided import ExecutionResult
from fcaudit.io import OutDir, read_json, valid_path
from fcaudit.provenance import provenance
from fcaudit.report import figures, tables, verdicts
from fcaudit.stats.inference import sign_flip_kind
from fcaudit.stats.results import NOT_MEASURED, VariationResult, answer, three_questions
from fcaudit.summary import FamilyResult, Summary, csv_frame, summarize

TABLE1_COLUMNS = ("setting", "method", "n", "byte_ppl_mean", "byte_ppl_sd", "gate_mass")


@dataclass
class Found:
    summaries: list[tuple[Path, Summary]] = field(default_factory=list)
    audits: list[Path] = field(default_factory=list)
    training: list[dict] = field(default_factory=list)
    table1: list[pd.DataFrame] = field(default_factory=list)
    execution: list[Path] = field(default_factory=list)


def _read(f: Path) -> Any:
    """A JSON or CSV input of the report; one that does not parse is an error naming the file."""
    try:
        return pd.read_csv(f) if f.suffix == ".csv" else read_json(f)
    except ValueError as e:  # so are UnicodeDecodeError and pandas' ParserError and EmptyDataError
        what = "a readable CSV table" if f.suffix == ".csv" else "valid JSON"
        raise FcauditError(f"{f} is not {what} ({type(e).__name__}): rewrite it with the fcaudit command that made "
                           "it, or leave its directory out") from None


def _candidates(inp: Path) -> list[Path]:
    """The files of directory `inp` and of its direct subdirectories (a demo's runs/NAME/metrics.json): a bounded
    look, so `report /` reads two levels, not the whole filesystem. Unreadable directories and links to directories
    are passed over."""
    out: list[Path] = []
    for d in (inp, *_entries(inp, dirs=True)):
        out += _entries(d, dirs=False)
    return sorted(out)


def _entries(d: Path, dirs: bool) -> list[Path]:
    try:
        with os.scandir(d) as it:
            return [Path(e.path) for e in it if not e.name.startswith(".") and not e.is_symlink()
                    and (e.is_dir() if dirs else e.is_file())]
    except OSError:
        return []


def discover(inputs: Sequence[str | Path]) -> Found:
    if not isinstance(inputs, (list, tuple)):  # a str would be read as one input per character
        raise FcauditError(f"inputs must be a list of directories, got {type(inputs).__name__}: e.g. [result.path]")
    found = Found()
    for inp in (valid_path(i, "a report input") for i in inputs):
        if not inp.exists():
            raise FcauditError(f"{inp} does not exist; pass summary, audit or training-run directories")
        files = [inp] if inp.is_file() else _candidates(inp)
        for f in files:
            if f.name == "summary.json":
                found.summaries.append((f.parent, Summary.load(f.parent)))
            elif f.name == "config.json" and any((f.parent / n).exists() for n in ("records", MARKER)):
                found.audits.append(f.parent)  # an unfinished one too: its reader says what it lacks
            elif f.name == "metrics.json" and isinstance(m := _read(f), dict) and "byte_ppl" in m:
                found.training.append(m)  # a training run's (other metrics.json are not Table 1)
            elif f.name == "table1.csv":
                t = _read(f)
                if missing := [c for c in TABLE1_COLUMNS if c not in t.columns]:
                    raise FcauditError(f"{f} lacks columns {missing}; write it with fcaudit.report.tables.training_table")
                found.table1.append(t[list(TABLE1_COLUMNS)])
            elif (f.name == "execution.json" and not (f.parent / MARKER).is_file()  # an audit's: read with it
                  or f.name == "execution.csv" and not (f.parent / "execution.json").is_file()):
                found.execution.append(f)  # execution.json holds the csv's rows plus settings: read it alone
    # audits already covered by a summary given alongside them are not summarized twice
    covered = {Path(a).resolve() for _, s in found.summaries for fam in s.values() for a in fam.audit_dirs}
    found.audits = sorted({a.resolve() for a in found.audits} - covered)
    if not (found.summaries or found.audits or found.training or found.table1 or found.execution):
        raise FcauditError("found no summary.json, audit directory, training metrics.json or table1.csv under "
                           f"{[str(i) for i in inputs]}; pass the directories written by fcaudit")
    return found


@dataclass
class Doc:
    """The report being written, each block kept as Markdown and as HTML."""

    out: OutDir
    blocks: list[tuple[str, str]] = field(default_factory=list)  # (Markdown, HTML)
    csvs: list[str] = field(default_factory=list)
    pngs: list[str] = field(default_factory=list)

    def h(self, level: int, text: str):
        self.blocks.append(("#" * level + " " + text, f"<h{level}>{html.escape(text)}</h{level}>"))

    def p(self, text: str):
        self.blocks.append((text, f"<p>{_inline(text)}</p>"))

    def ul(self, items: list[str]):
        self.blocks.append(("\n".join(f"- {item}" for item in items),
                            "<ul>" + "".join(f"<li>{_inline(item)}</li>" for item in items) + "</ul>"))

    def csv(self, name: str, frame: pd.DataFrame):
        self.out.atomic_write(self.out.root / name, lambda p: frame.to_csv(p, index=False))
        self.csvs.append(name)

    def table(self, display: pd.DataFrame, raw: pd.DataFrame, name: str, caption: str = ""):
        """A table shown formatted, with its unformatted numbers written to NAME.csv."""
        self.csv(f"{name}.csv", csv_frame(raw))
        cap = f"{caption} " if caption else ""
        self.blocks.append((f"{tables.to_markdown(display)}\n\n*{cap}(numbers: [{name}.csv]({name}.csv))*",
                            f"<figure class='tbl'>{tables.to_html(display)}<figcaption>{html.escape(cap)}(numbers: "
                            f"{html.escape(name)}.csv)</figcaption></figure>"))

    def img(self, png: Path, caption: str):
        self.pngs.append(png.name)
        data = base64.b64encode(png.read_bytes()).decode("ascii")
        self.blocks.append((f"![{caption}]({png.name})\n\n*{caption}*",
                            f"<figure><img alt='{html.escape(caption, quote=True)}' src='data:image/png;base64,{data}'>"
                            f"<figcaption>{html.escape(caption)}</figcaption></figure>"))

    def markdown(self) -> str:
        return "\n\n".join(m for m, _ in self.blocks) + "\n"

    def html(self, title: str) -> str:
        body = "\n".join(h for _, h in self.blocks)
        return (f"<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
                f"<style>{_CSS}</style></head><body><main>\n{body}\n</main></body></html>\n")


_CSS = """
body{font-family:system-ui,-apple-system,'Segoe UI',sans-serif;color:#222;background:#fff;margin:0}
main{max-width:1000px;margin:0 auto;padding:1.5rem 2rem 4rem;line-height:1.45}
h1{border-bottom:2px solid #ddd;padding-bottom:.3rem}h2{margin-top:2.2rem;border-bottom:1px solid #eee}
table{border-collapse:collapse;margin:.6rem 0;font-size:.88rem}
th,td{border:1px solid #ccc;padding:.25rem .6rem;text-align:left}th{background:#f3f5f7}
td{font-variant-numeric:tabular-nums}tr:nth-child(even) td{background:#fafafa}
figure{margin:1rem 0}figure.tbl{overflow-x:auto}figure img{max-width:100%;border:1px solid #eee}
figcaption{font-size:.85rem;color:#555;margin-top:.3rem}code{background:#f3f3f3;padding:0 .2rem}
span.nw{white-space:nowrap}li{margin:.15rem 0}
@media (max-width:820px){main{padding:1rem .7rem 3rem}table{font-size:.74rem}th,td{padding:.2rem .3rem}}
"""


def _inline(text: str) -> str:
    """The little Markdown used in paragraphs: **bold** and `code`."""
    t = html.escape(text)
    t = re.sub(r"\*\*(.+?)\*\*", r"<strong>\1</strong>", t)
    return re.sub(r"`(.+?)`", r"<code>\1</code>", t)


def _families(summaries: list[Summary]) -> Iterator[tuple[str, FamilyResult]]:
    """(name, FamilyResult) in the order the families were summarized."""
    for s in summaries:
        yield from s.items()


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-").lower() or "model"


def _training_section(doc: Doc, found: Found) -> pd.DataFrame | None:
    parts = [tables.training_table(found.training)] if found.training else []
    parts += found.table1
    if not parts:
        return None
    t1 = pd.concat(parts, ignore_index=True)
    doc.h(2, "Training comparison (Table 1)")
    doc.p("Lower Byte-PPL is better. Values are the mean ± sd across training seeds (n per row); gate mass is the "
          "mean gate value (— for models without a gate).")
    doc.table(tables.training_display(t1), t1, "table1")
    return t1


def _verdicts_section(doc: Doc, summaries: list[Summary], fracs: dict, executions: list[Execution]) -> list[dict]:
    """The headline: per audited family one line for each of the three questions, with its numbers."""
    rows = [r for e in executions for r in e.rows.to_dict(orient="records")]
    out = []
    for fam, g in _families(summaries):
        lines = {"variation": verdicts.variation_line(g.variation, fracs.get(fam)),
                 "functional dependence": verdicts.dependence_line(g),
                 "execution": verdicts.execution_line(rows, verdicts.audited_checkpoints(g))}
        if (audited := family_execution(g)[0]) is not None and not rows:  # no `fcaudit execution` to say more
            lines["execution"] = f"{audited.verdict}, on the audit's first evaluation batch"
        if not out:
            doc.h(2, "Verdicts: the three questions per model family")
        doc.p(f"**{fam}** ({g.n_checkpoints} checkpoint(s), {g.level}-level intervals)"
              + (" **[PARTIAL: from unfinished audits]**" if g.partial else ""))
        doc.ul([f"**{q.capitalize()}**: {text}" for q, text in lines.items()])
        out.append({"family": fam, **lines})
    return out


def family_variation(g: FamilyResult, fractions: dict[str, float] | None) -> VariationResult | None:
    """The family's variation as one result: its checkpoints' mean shares (`_fractions`); constant coefficients
    (every share nan) where its audits have variation but nothing to decompose; None where none has variation."""
    if not g.variation:
        return None
    shares = fractions or dict.fromkeys(figures.VARIANCE_TERMS[:3], None)
    return VariationResult.from_json({"decomposition": shares, "layers": []})


def family_execution(g: FamilyResult) -> tuple[ExecutionResult | None, str]:
    """The execution its audits measured (the first checkpoint's that has it), or why none is shown."""
    measured = [e for e in g.execution if e is not None and "reason" not in e]
    if measured:
        return ExecutionResult.from_json(measured[0]), ""
    reasons = [e["reason"] for e in g.execution if e is not None]
    return None, f"not measured: {reasons[0]}" if reasons else NOT_MEASURED


def _questions_section(doc: Doc, summaries: list[Summary], fracs: dict) -> list[dict]:
    """The report opens with the three questions, one row per audited model (a family of checkpoints): what share
    layer, input and token explain; the controller's own static condition, CrossInput and retention; decided
    against executed work, where the audits measured it."""
    rows, raw = [], []
    for fam, g in _families(summaries):
        execution, why_not = family_execution(g)
        variation, pen = family_variation(g, fracs.get(fam)), g.penalties()
        retention = {r.condition: r for r in g.statistics().retentions()}.get(g.static)
        cells = three_questions(variation, pen, retention, g.static, execution, why_not)
        if execution is not None and sum(e is not None and "reason" not in e for e in g.execution) < g.n_checkpoints:
            cells["execution"]["verdict"] += " (measured on one checkpoint)"
        rows.append({"model": fam, **{q: answer(q, part) for q, part in cells.items()}})
        # the CSV's numbers: what the cells show, unformatted
        raw.append({"model": fam, **(variation.main() if variation is not None else {}), "static": g.static,
                    "static_delta_nll": pen[g.static].statistic if g.static in pen else None,
                    "cross_input_delta_nll": pen["CrossInput"].statistic if "CrossInput" in pen else None,
                    "retention": retention.statistic if retention is not None else None,
                    **({"decided": execution.decided, "executed": execution.executed,
                        "flops_per_token": execution["live"].flops_per_token,
                        "flops_per_token_replayed": execution["replayed"].flops_per_token}
                       if execution is not None else {"execution_note": why_not})})
    if rows:
        doc.h(2, "The three questions, per model")
        frame = pd.DataFrame(rows)
        doc.table(frame.rename(columns=str.capitalize), pd.DataFrame(raw), "three_questions",
                  "Variation: shares of the coefficient variance (balanced ANOVA, mean over checkpoints). Dependence: "
                  "mean ΔNLL vs Correct of the controller's own static condition and of CrossInput with their "
                  "intervals, and retention (Eq. 8). Execution: on the audit's first evaluation batch, the share of "
                  "the governed work the controller decided and the share the forward pass computed, observed.")
    return rows


ROUTER_CHECKS = (CAUSALITY, TOKEN_ROUTING)  # said with the replay check; every other notice has its own paragraph


def _replay_line(replays: tuple[Replay, ...]) -> str:
    if not replays:
        return "Exact replay: no replay record found in the audit directories."
    passed = sum(bool(r.passed) for r in replays)
    worst = max(np.nan if r.max_abs_dlogit is None else float(r.max_abs_dlogit) for r in replays)
    routing = list(dict.fromkeys(f.line for r in replays for f in r.findings if f.check in ROUTER_CHECKS and f.line))
    if any(r.later_token_flips == 0 for r in replays):
        routing.insert(0, "Causality check: no routing decision at an earlier position changed when the last quarter "
                          "of the probe windows did.")
    return (f"Exact replay (controller disabled, cached coefficients replayed unchanged): passed for {passed}/"
            f"{len(replays)} checkpoint(s); largest max |Δlogit| = {worst:.3g}."
            + "".join(f" {line[0].upper()}{line[1:]}{'' if line.endswith('.') else '.'}" for line in routing))


def _family_section(doc: Doc, fam: str, g: FamilyResult):
    slug, n, crit = _slug(fam), g.n_checkpoints, g.verdicts()
    frames = g.frames()
    conds, facs, rets = frames["conditions"], frames["factors"], frames["retention"]
    doc.h(2, f"Functional dependence (FCA): {fam}" + (" [PARTIAL]" if g.partial else ""))
    doc.p(f"**{n} checkpoint(s).** {g.note}")
    doc.p(_replay_line(g.replays))
    for notice in dict.fromkeys(f.line for r in g.replays for f in r.findings
                                if f.check not in ROUTER_CHECKS and f.line and not f.refusal):
        doc.p(notice)
    doc.h(3, "Intervention penalties (Table 2 style)")
    doc.table(tables.fca_display(conds, rets), conds, f"fca_{slug}",
              "Mean ΔNLL vs Correct (nats per predicted token); retention = 1 − ΔNLL(S)/ΔNLL(R) against "
              f"{rets['reference_label'].iloc[0] if len(rets) else 'the structure-removed reference'}, "
              "within this family only; undefined unless the interval of ΔNLL(R) lies above the practically-small "
              "bound of the criteria (removing the structure must itself cost something).")
    if len(rets):
        doc.csv(f"retention_{slug}.csv", rets)
    if len(facs):
        doc.h(3, "Factor effects (Eq. 5-7)")
        holm_note = (f"p-values: {sign_flip_kind(n)} two-sided sign-flip tests over checkpoints, Holm-adjusted "
                     "across the three effects." if g.level == "checkpoint" else
                     "No p-values: with one checkpoint there are no independent units for a test.")
        doc.table(tables.factors_display(facs), facs, f"factors_{slug}",
                  "Factorial contrasts, not an additive split into mechanisms. " + holm_note)
    doc.h(3, "Prespecified criteria")
    doc.p(f"Both criteria were fixed in advance: written into the audit configuration ({crit[0]['source']}) "
          f"before the audit ran ({crit[0]['fixed_at'] or 'time not recorded'}).")
    if g.level == "window":
        doc.p("The bounds are window-level (one checkpoint), not checkpoint-level intervals.")
    doc.table(tables.criteria_display(crit), pd.DataFrame(crit).drop(columns=["criteria"]), f"criteria_{slug}")


def _fractions(summaries: list[Summary]) -> dict[str, dict[str, float]]:
    """Per family the variance-decomposition fractions (mean over checkpoints); families whose coefficients have
    no variance (or no variation.json) are absent."""
    fracs = {}
    for fam, g in _families(summaries):
        decs = [{k: float(v) for k, v in var["decomposition"].items() if k in figures.VARIANCE_TERMS and v is not None}
                for var in g.variation]
        if decs := [d for d in decs if d]:
            fracs[fam] = pd.DataFrame(decs).mean().to_dict()
    return fracs


def _variation_section(doc: Doc, summaries: list[Summary], fracs: dict[str, dict[str, float]]) -> None:
    # per layer its scalar columns (layer, mean, sd, site); nested per-slice lists stay in report.json
    profiles = [pd.DataFrame([{k: x for k, x in r.items() if isinstance(x, (int, float, str))} for r in v["layers"]])
                .assign(family=fam, checkpoint=i)
                for fam, g in _families(summaries) for i, v in enumerate(g.variation)]
    if not fracs and not profiles:
        return
    doc.h(2, "Coefficient variation (question 1)")
    doc.p("Descriptive only: how the coefficients spread over inputs, layers and tokens. It does not say whether "
          "the frozen model uses that spread; the interventions above test that.")
    if fracs:
        raw = pd.DataFrame(fracs).T.reindex(columns=list(figures.VARIANCE_TERMS)).rename_axis("family")
        doc.table(raw.map(tables.fmt_pct).reset_index(), raw.reset_index(), "variance_decomposition",
                  "Fractions of the total coefficient variance (balanced functional ANOVA; mean over checkpoints).")
    if profiles:
        prof = pd.concat(profiles, ignore_index=True)
        keys = [c for c in prof.columns if c not in ("mean", "sd", "min", "max", "checkpoint")]
        per_layer = prof.groupby(keys, sort=False)[["mean", "sd"]].mean().reset_index()
        doc.csv("coefficient_profile.csv", prof)
        if len(per_layer) <= 64:
            shown = per_layer.assign(**{c: per_layer[c].map(lambda x: tables.fmt(x, 4)) for c in ("mean", "sd")})
            doc.table(shown, per_layer, "coefficient_profile_mean",
                      "Per-layer coefficient mean and sd across inputs and tokens (mean over checkpoints).")
        else:
            doc.p(f"Per-layer coefficient mean and sd ({len(per_layer)} rows) are in coefficient_profile.csv.")


def _figures(doc: Doc, summaries: list[Summary], fracs: dict) -> None:
    conds = pd.concat([s.conditions for s in summaries], ignore_index=True) if summaries else pd.DataFrame()
    rets = pd.concat([s.retention for s in summaries], ignore_index=True) if summaries else pd.DataFrame()
    if conds.empty and not fracs:
        return
    doc.h(2, "Figures")
    for fam, g in _families(summaries):
        if len(pen := g.penalties()):
            doc.img(figures.penalties_figure(pen, doc.out.root / f"fig2_penalties_{_slug(fam)}.png", fam),
                    f"Figure 2 ({fam}): mean ΔNLL per intervention with intervals; the structure-removed reference "
                    "on its own linear scale.")
    if fracs:
        missing = [f"{fam} ({verdicts.variation_line(g.variation, None)})"
                   for fam, g in _families(summaries) if fam not in fracs]
        doc.img(figures.variance_figure(fracs, doc.out.root / "fig3_variance.png"),
                "Figure 3: variance decomposition of the controller coefficients per model."
                + (f" Not shown: {'; '.join(missing)}." if missing else ""))
    if not rets.empty:
        doc.img(figures.retention_figure(rets, doc.out.root / "fig4_retention.png"),
                "Figure 4: static retention with intervals, absolute ΔNLL beside each; references differ between "
                "families, so compare within a family only.")
    if not conds.empty:
        doc.img(figures.log_penalties_figure(conds, doc.out.root / "fig5_log_penalties.png"),
                "Figure 5: absolute penalties on a log axis across model families (means ≤ 0 marked at the left "
                "edge, not dropped).")


@dataclass
class Execution:
    """One execution.json (or execution.csv) as the report reads it."""

    source: Path
    data: Any
    rows: pd.DataFrame
    settings: dict | None = None
    thresholding: pd.DataFrame | None = None
    conditions: pd.DataFrame | None = None  # routed models under Correct and each static condition


def _read_execution(f: Path) -> Execution:
    data = _read(f)
    if f.suffix == ".csv":
        return Execution(f, json.loads(data.to_json(orient="records")), data)
    d = data if isinstance(data, dict) else {"rows": data}
    if not isinstance(d.get("rows"), list):
        raise FcauditError(f"{f} has no list of rows; rewrite it with `fcaudit execution`")
    tables_of = {k: pd.DataFrame(d[k]) if d.get(k) else None for k in ("thresholding", "conditions")}
    return Execution(f, data, pd.json_normalize(d["rows"]), d.get("settings"), **tables_of)


def _threshold_note(sweep: pd.DataFrame, settings: dict | None) -> str:
    """What the Byte-PPL column measures, and why it is not Table 1's."""
    plain = sweep.groupby("model", sort=False).agg(plain_nll=("plain_nll", "first"), windows=("windows", "first"))
    per_model = ", ".join(f"{m} {np.exp(r.plain_nll):.4g}" for m, r in plain.iterrows())
    window = (settings or {}).get("window")
    where = f"{int(plain['windows'].iloc[0])} test windows" + (f" of {window} tokens" if window else "")
    return ("Post-training thresholding of scalar gates: gates below the threshold are set to 0 by replay. Byte-PPL "
            f"is measured on the first {where}; threshold 0 sets no gate to 0, so its row is the unmodified model "
            f"(unthresholded Byte-PPL: {per_model}). It differs from Table 1's Byte-PPL, which the training run "
            "measured on its own test windows (more of them, of the model's block size). A zeroed gate still "
            "executes its block here, so skippable blocks are potential, not realised, savings.")


def _execution_section(doc: Doc, executions: list[Execution]) -> list:
    """Only data that exist: each execution file's rows (and settings, thresholding sweep) as tables."""
    doc.h(2, "Execution (question 3)")
    doc.p("Measured execution (executed blocks, FLOPs, latency, throughput) as written by `fcaudit execution`; "
          "gate values are not a compute measure, so only these measurements speak to skipped work. Decided is the "
          "share of the governed work the controller's decisions select; Executed the share the forward pass "
          "computed, observed (rows into the governed blocks' weights; an MoE's expert FLOPs). Latency is the "
          "median over repetitions, all models measured round-robin; IQR is its interquartile range.")
    out = []
    for i, e in enumerate(executions):
        name = "execution" if len(executions) == 1 else f"execution_{i}"
        out.append({"source": str(e.source), "data": e.data})
        if e.settings:
            doc.p("Settings: " + ", ".join(f"{k} = {v}" for k, v in e.settings.items() if v not in (None, [], ""))
                  + ".")
        rows = e.rows  # shown with blocks run as k/n and a noisy latency marked with *
        if {"executed_blocks", "n_blocks"} <= set(rows.columns):
            rows = rows.assign(blocks_run=[f"{x}/{n}" for x, n in zip(rows["executed_blocks"], rows["n_blocks"])])
        shown = _shown(rows, _EXECUTION_COLUMNS)
        noisy = rows["latency_noisy"].astype(bool) if "latency_noisy" in rows.columns else pd.Series(False, rows.index)
        if "ms/batch" in shown.columns:
            shown["ms/batch"] = [f"{v}*" if n else v for v, n in zip(shown["ms/batch"], noisy)]
        doc.table(shown, e.rows, name, f"From {e.source}; every column is in the CSV."
                  + (" * noisy latency: spread above the median, rerun with --threads 1 on a quieter machine before "
                     "quoting its ratio." if noisy.any() else ""))
        if "executed_layer_fraction" in rows.columns:
            decoding = rows.assign(layers_run=rows["executed_layer_fraction"].map(verdicts.layers_run))
            doc.table(_shown(decoding, _DECODING_COLUMNS), e.rows, f"{name}_decoding",
                      "Decoding one text window token by token with a KV cache, where per-token early exit saves "
                      "work (scoring computes every position at every block): the (layer, token) pairs that ran, "
                      "FLOPs and time per token, each vs Dense.")
        if e.thresholding is not None:
            shown = e.thresholding.assign(frac_below=e.thresholding["frac_below"].map(tables.fmt_pct))  # as printed
            doc.table(_shown(shown, _THRESHOLD_COLUMNS), e.thresholding, f"{name}_thresholding",
                      _threshold_note(e.thresholding, e.settings))
        if e.conditions is not None:
            doc.table(_shown(e.conditions, _CONDITION_COLUMNS), e.conditions, f"{name}_conditions",
                      "Routed models under Correct and the audit's conditions, replayed. Top-k routers (Correct: "
                      "the live router; each static condition): experts actually run per token, their FLOPs as a "
                      "share of running every expert, and latency; a static profile is a computational shortcut "
                      "only if it stays sparse. Token routers (Correct, StaticTopK, RandomRoute, all replayed): the "
                      "fraction of tokens the routed blocks run, FLOPs and latency vs Correct.")
            if line := _token_conditions_line(e.conditions):
                doc.p(line)
    return out


def _token_conditions_line(conds: pd.DataFrame) -> str:
    """Whether the token routers' equal budgets gave equal FLOPs, and whether latency agrees (within its IQR)."""
    if "token_fraction" not in conds.columns:
        return ""
    lines = []
    for model, g in conds.dropna(subset=["token_fraction"]).groupby("model", sort=False):
        flops = g["flops_vs_correct"].to_numpy(dtype=float)
        lat = g["latency_vs_correct"].to_numpy(dtype=float)
        spread = float((g["latency_iqr_ms"] / g["latency_ms"]).max())
        agree = bool(np.all(np.abs(lat - 1) <= max(spread, 0.05)))
        lines.append(f"{model}: FLOPs under {', '.join(g['label'][1:])} are "
                     f"{' and '.join(f'{x:.3g}x' for x in flops[1:])} Correct's "
                     + ("(equal budgets, equal work)" if np.allclose(flops, 1.0) else "(NOT equal: check the budgets)")
                     + f"; latency {' and '.join(f'{x:.3g}x' for x in lat[1:])} Correct's, which "
                     + ("agrees within the timing spread" if agree else "differs beyond the timing spread (IQR)") + ".")
    return " ".join(lines)


# What a reader compares (the CSV keeps every measured column).
_EXECUTION_COLUMNS = {"model": "Model", "decided": "Decided", "executed": "Executed (observed)",
                      "blocks_run": "Blocks run", "token_block_fraction": "Token×block pairs run",
                      "flops_per_token": "FLOPs/token",
                      "flops_vs_dense": "FLOPs vs Dense", "latency_ms": "ms/batch", "latency_iqr_ms": "IQR ms",
                      "latency_vs_dense": "Latency vs Dense", "tokens_per_s": "Tokens/s", "byte_ppl": "Byte-PPL"}
_DECODING_COLUMNS = {"model": "Model", "layers_run": "Layer×token pairs run",
                     "decode_flops_per_token": "FLOPs/token", "decode_flops_vs_dense": "FLOPs vs Dense",
                     "decode_ms_per_token": "ms/token", "decode_latency_vs_dense": "Latency vs Dense"}
_CONDITION_COLUMNS = {"model": "Model", "label": "Condition", "experts_per_token": "Experts/token",
                      "active_expert_fraction": "FLOPs of all experts", "expert_flops_per_token": "Expert FLOPs/token",
                      "token_fraction": "Tokens run (routed blocks)", "token_block_fraction": "Token×block pairs run",
                      "flops_vs_correct": "FLOPs vs Correct", "latency_ms": "ms/batch",
                      "latency_vs_correct": "Latency vs Correct"}
_THRESHOLD_COLUMNS = {"model": "Model", "threshold": "Threshold", "frac_below": "Gates below",
                      "skippable_blocks": "Skippable blocks / window", "n_layers": "Blocks", "byte_ppl": "Byte-PPL",
                      "delta_nll": "ΔNLL"}


def _shown(df: pd.DataFrame, columns: dict[str, str]) -> pd.DataFrame:
    """The columns a reader compares, renamed, floats to 4 significant digits; the CSV keeps full precision."""
    present = [c for c in columns if c in df.columns]
    df = df[present].rename(columns=columns) if present else df
    return df.map(lambda v: "—" if v is None or (isinstance(v, float) and v != v)
                  else f"{v:.4g}" if isinstance(v, float) else v)


def build_report(inputs: Sequence[str | Path], out: str | Path, allow_partial: bool = False) -> Path:
    """Write the study's report: report.md, a self-contained report.html, its figures and every number as CSV/JSON.

    It answers the paper's three questions (coefficient variation, functional dependence, execution) separately
    for whatever `inputs` hold, with each family's criteria and the level of its intervals, as `fcaudit report` does.

    Parameters
    ----------
    inputs
        Audit directories, `fcaudit summarize`, `fcaudit execution` and `fcaudit train` outputs (summary.json,
        execution.json, metrics.json, table1.csv), or directories holding them (each directory and its direct
        subdirectories are searched).
    out
        The report directory (new, empty, or an earlier report's, which is replaced).
    allow_partial
        Include unfinished audits (marked partial) instead of refusing them.

    Returns
    -------
    pathlib.Path
        report.html.

    Examples
    --------
    With `result` from `fca.audit`'s example:

    >>> html = fca.build_report([result.path], tempfile.mkdtemp())
    >>> html.name, (html.parent / "report.md").is_file()
    ('report.html', True)
    """
    out = OutDir(out, "report").check()
    found = discover(inputs)
    sources = [(str(d), s) for d, s in found.summaries]
    made = summarize(found.audits, allow_partial=allow_partial) if found.audits else None
    if made is not None:
        sources.append(("the audit directories given", made))
    _one_source_per_family(sources)
    out.claim()
    _remove_earlier_report(out)
    if made is not None:
        made.save(out.root / "summary")
    summaries = [s for _, s in sources]
    doc = Doc(out)
    prov = provenance()
    doc.h(1, "fcaudit report")
    doc.p(f"Generated {datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M UTC')} by fcaudit "
          f"{prov['versions'].get('fcaudit')} (git {prov['git_hash'] or 'unknown'}) from: "
          + ", ".join(f"`{p}`" for p in inputs) + ".")
    doc.p("Three separate questions: coefficient variation (does the controller vary?), functional dependence "
          "(does the frozen model need each coefficient at its own input and token? — the Frozen-Controller Audit), "
          "and execution (is work actually skipped?). Each section below answers only one of them.")
    fracs = _fractions(summaries)
    executions = [_read_execution(f) for f in found.execution]
    numbers: dict[str, Any] = {"provenance": prov, "inputs": [str(p) for p in inputs],
                               "three_questions": _questions_section(doc, summaries, fracs),
                               "verdicts": _verdicts_section(doc, summaries, fracs, executions)}
    if (t1 := _training_section(doc, found)) is not None:
        numbers["table1"] = json.loads(t1.to_json(orient="records"))
    for fam, g in _families(summaries):
        _family_section(doc, fam, g)
    numbers["summaries"] = [s.to_dict() for s in summaries]
    _variation_section(doc, summaries, fracs)
    numbers["variance_decomposition"] = fracs

    _figures(doc, summaries, fracs)
    if executions:
        numbers["execution"] = _execution_section(doc, executions)
    doc.h(2, "Files")
    doc.p("Every number above is also in: " + ", ".join(f"`{c}`" for c in doc.csvs + ["report.json"])
          + ("; figures: " + ", ".join(f"`{p}`" for p in doc.pngs) if doc.pngs else "") + ".")
    summary_files = ([f"summary/{f.name}" for f in sorted((out.root / "summary").glob("[!.]*"))]
                     if made is not None else [])
    numbers["files"] = [*doc.csvs, *doc.pngs, *summary_files, "report.md", "report.html"]
    out.write_json(out.root / "report.json", numbers)
    out.write_text(out.root / "report.md", doc.markdown())
    return out.write_text(out.root / "report.html", doc.html("fcaudit report"))


def _remove_earlier_report(out: OutDir) -> None:
    """Every file an earlier report into the claimed `out` wrote (as its and its summary/'s markers record them), so
    that none stays beside this one (e.g. a family this report does not cover); nothing else is touched."""
    for f in [*out.recorded(), *OutDir(out.root / "summary", "summary").recorded()]:
        out.remove_file(f)


def _one_source_per_family(sources: list[tuple[str, Summary]]) -> None:
    """A family's checkpoints are pooled in one summary: from two sources it would get two sets of statistics."""
    seen: dict[str, str] = {}
    for where, s in sources:
        for fam, _ in _families([s]):
            if fam in seen:
                raise FcauditError(f"model family {fam!r} is in {seen[fam]} and in {where}: summarize all of its audits "
                                   "together (fcaudit summarize AUDIT_DIR... --out DIR) and pass that summary")
            seen[fam] = where
