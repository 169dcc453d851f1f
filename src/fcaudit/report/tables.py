"""The paper's tables as DataFrames (Table 1 from training runs' metrics.json; the FCA table, factor effects and
criteria from a `fcaudit.summary.Summary`'s tables) and their Markdown/HTML rendering."""

from __future__ import annotations

import html
import math
from typing import Any

import numpy as np
import pandas as pd

from fcaudit.errors import FcauditError
from fcaudit.stats.results import WINDOW_LEVEL, met_word

# Display names of the training variants (Table 1 "Method" column).
METHOD_NAMES = {
    "featuregate": "FeatureGate",
    "dense": "Dense",
    "uniform": "Uniform",
    "layerstatic": "LayerStatic",
    "uniform-fixed": "Uniform-Fixed",  # the fixed value is in the gate-mass column
    "uniform-matched": "Uniform-Matched",
    "fixeddepth": "FixedDepth",
    "mudd": "MUDD",
    "moe": "MoE (Mixtral)",  # the byte-level Mixtral of `fcaudit train --model moe`
    "mod": "MoD (Mixture-of-Depths)",
}


def training_table(metrics: list[dict]) -> pd.DataFrame:
    """Table 1: per (setting, method) the number of seeds, Byte-PPL mean and sd across seeds, mean gate mass."""
    if not metrics:
        raise FcauditError("no training metrics given; point the report at directories containing metrics.json")
    rows = []
    for m in metrics:
        if not (method := m.get("method") or m.get("variant") or m.get("model")):
            raise FcauditError("a training metrics.json has no 'variant' or 'method' key; re-run `fcaudit train` to "
                               "rewrite it")
        if "byte_ppl" not in m:
            raise FcauditError("a training metrics.json has no 'byte_ppl'; re-run `fcaudit train` to rewrite it")
        gate = m.get("gate_mass")
        setting = " ".join(str(m[k]) for k in ("corpus", "preset") if m.get(k) not in (None, "")) or "default"
        rows.append({"setting": setting, "method": METHOD_NAMES.get(str(method).lower(), str(method)),
                     "seed": m.get("seed"), "byte_ppl": float(m["byte_ppl"]),
                     "gate_mass": np.nan if gate is None else float(gate)})
    runs = pd.DataFrame(rows)
    if runs.dropna(subset=["seed"]).duplicated(["setting", "method", "seed"]).any():
        raise FcauditError("two training runs share setting, method and seed; pass each run directory once")
    table = runs.groupby(["setting", "method"], sort=False).agg(
        n=("byte_ppl", "size"), byte_ppl_mean=("byte_ppl", "mean"), byte_ppl_sd=("byte_ppl", "std"),
        gate_mass=("gate_mass", "mean")).reset_index()
    # Within a setting, best (lowest) Byte-PPL first, as in the paper.
    return table.sort_values(["setting", "byte_ppl_mean"], kind="stable").reset_index(drop=True)


def missing(x: Any) -> bool:
    """None or not finite: shown as '—' everywhere."""
    return x is None or not math.isfinite(float(x))


def fmt(x: Any, digits: int = 6) -> str:
    """A number for a table: fixed decimals."""
    if missing(x):
        return "—"
    x = float(x)
    if x != 0 and abs(x) < 10 ** -(digits - 2):  # tiny values keep their significant digits instead of "-0.000000"
        return f"{x:.3e}"
    return f"{x:.{digits}f}"


def fmt_g(x: Any) -> str:
    """A number for a sentence: 3 significant digits."""
    return "—" if missing(x) else f"{float(x):.3g}"


def fmt_p(p: Any) -> str:
    return "—" if missing(p) else f"{p:.4f}" if p >= 1e-4 else f"{p:.1e}"


def fmt_interval(lo: Any, hi: Any) -> str:
    return "—" if missing(lo) or missing(hi) else f"[{fmt(float(lo))}, {fmt(float(hi))}]"


def fmt_pct(x: Any, decimals: int = 2) -> str:
    return "—" if missing(x) else f"{100 * float(x):.{decimals}f}%"


def training_display(table: pd.DataFrame) -> pd.DataFrame:
    return pd.DataFrame({
        "Setting": table["setting"], "Method": table["method"], "n": table["n"].astype(int),
        "Byte-PPL": [f"{m:.4f} ± {s:.4f}" if math.isfinite(s) else f"{m:.4f} (one seed)"
                     for m, s in zip(table["byte_ppl_mean"], table["byte_ppl_sd"])],
        "Gate mass": [fmt(g, 4) for g in table["gate_mass"]],
    })


def fca_display(conditions: pd.DataFrame, retention: pd.DataFrame) -> pd.DataFrame:
    """Paper Table 2 style: condition, mean ΔNLL, interval, MC SE, retention (with its interval)."""
    ret = {r.condition: r for r in retention.itertuples()}
    return pd.DataFrame([{
        "Condition": r.label, "Mean ΔNLL": fmt(r.statistic), "95% interval": fmt_interval(r.ci_low, r.ci_high),
        "MC SE": fmt(r.mc_se), "Positive": "—" if pd.isna(r.n_positive) else f"{int(r.n_positive)}/{int(r.n)}",
        "p (sign-flip)": fmt_p(r.pvalue), "Retention": _retention_cell(ret.get(r.condition)),
    } for r in conditions.itertuples()])


def retention_undefined(rt) -> str:
    """Why a retention row has no value, in a few words (the CSV's note has the interval)."""
    if not pd.isna(rt.n) and int(rt.n) < 2:
        return "undefined (one unit: no interval for ΔNLL(R))"
    return f"undefined (ΔNLL(R) interval not above {float(rt.bound):g})"


def _retention_cell(rt) -> str:
    if rt is None:
        return "—"
    if pd.isna(rt.statistic):  # Eq. 8 needs the reference's interval above the practically-small bound
        return retention_undefined(rt)
    return f"{fmt_pct(rt.statistic)} [{fmt_pct(rt.ci_low)}, {fmt_pct(rt.ci_high)}]"


def factors_display(factors: pd.DataFrame) -> pd.DataFrame:
    return pd.DataFrame({
        "Effect": factors["label"], "Estimate": [fmt(x) for x in factors["statistic"]],
        "95% interval": [fmt_interval(a, b) for a, b in zip(factors["ci_low"], factors["ci_high"])],
        "p (raw)": [fmt_p(p) for p in factors["pvalue"]], "p (Holm)": [fmt_p(p) for p in factors["pvalue_holm"]],
    })


def criteria_display(criteria: list[dict]) -> pd.DataFrame:
    return pd.DataFrame([{
        "Criterion": c["name"], "Rule (fixed in advance)": c["rule"],
        "Bound": fmt(c["bound"]) if c["name"] == "practically small" else fmt_pct(c["bound"]),
        "Level": "checkpoints" if c["level"] == "checkpoint" else
        WINDOW_LEVEL if c["level"] in ("window", WINDOW_LEVEL) else "—",
        "Verdict": met_word(c["met"]),
    } for c in criteria])


def to_markdown(df: pd.DataFrame) -> str:
    """A GitHub-flavoured Markdown table (numbers right-aligned)."""
    head, *body = ["| " + " | ".join(str(v).replace("|", "\\|").replace("\n", " ") for v in row) + " |"
                   for row in [df.columns, *df.itertuples(index=False)]]
    align = "|" + "|".join("---:" if pd.api.types.is_numeric_dtype(df[c]) else "---" for c in df.columns) + "|"
    return "\n".join([head, align, *body])


def _cell(v: Any) -> str:
    """A cell that wraps only at spaces (never inside a number such as 1.5e-07 or -0.25)."""
    return " ".join(f"<span class='nw'>{html.escape(w)}</span>" if w else "" for w in str(v).split(" "))


def to_html(df: pd.DataFrame) -> str:
    head = "".join(f"<th>{_cell(c)}</th>" for c in df.columns)
    body = "".join("<tr>" + "".join(f"<td>{_cell(v)}</td>" for v in r) + "</tr>"
                   for r in df.itertuples(index=False))
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"
