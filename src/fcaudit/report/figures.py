"""The paper's figures 2-5 as PNG files (matplotlib, Agg backend), each written atomically from a summary's result
objects and tables: nothing is computed here beyond placing numbers, so each figure shows exactly what the CSVs
hold. Figure 2 is the penalties' own `.plot()`."""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from fcaudit import protocol  # noqa: E402
from fcaudit.io import atomic_write  # noqa: E402
from fcaudit.report.tables import retention_undefined  # noqa: E402
from fcaudit.stats.plots import error_bars  # noqa: E402
from fcaudit.stats.results import PenaltiesResult  # noqa: E402
from fcaudit.stats.variance import TERMS as VARIANCE_TERMS  # noqa: E402

plt.rcParams.update({"font.size": 10, "axes.titlesize": 11, "axes.labelsize": 10, "figure.dpi": 110})

_TERM_COLORS = dict(zip(VARIANCE_TERMS, ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860",
                                         "#da8bc3")))
_FAMILY_COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#17becf", "#7f7f7f")
GENERIC = {k: v for k, v in protocol.default_labels().items() if k != "Correct"}  # registry order


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    atomic_write(path, lambda p: fig.savefig(p, format="png", dpi=130, bbox_inches="tight"))
    plt.close(fig)
    return path


def penalties_figure(penalties: PenaltiesResult, path: str | Path, title: str) -> Path:
    """Figure 2: `penalties.plot()` (mean ΔNLL per condition with intervals; the structure-removed reference on its
    own panel with its own linear scale: it is orders of magnitude larger), titled and written."""
    fig = penalties.plot().figure
    intervals = ("CI across checkpoints" if penalties.level == "checkpoint" else
                 "paired-window bootstrap intervals, one checkpoint")
    fig.suptitle(f"{title}: intervention penalties ({100 * penalties.confidence_level:g}% {intervals})")
    return _save(fig, Path(path))


def variance_figure(fractions: dict[str, dict[str, float]], path: str | Path) -> Path:
    """Figure 3: stacked bars of the variance decomposition (fractions of the total) per model."""
    models = list(fractions)
    fig, ax = plt.subplots(figsize=(max(4.5, 1.6 * len(models) + 3), 4.2))
    bottom = np.zeros(len(models))
    for term in VARIANCE_TERMS:
        v = np.nan_to_num(np.array([fractions[m].get(term, np.nan) for m in models], dtype=float))
        bars = ax.bar(models, v, bottom=bottom, label=term, color=_TERM_COLORS[term], width=0.6)
        for b, val, b0 in zip(bars, v, bottom):
            if val >= 0.04:  # label the big terms; small ones are in the legend and the CSV
                ax.text(b.get_x() + b.get_width() / 2, b0 + val / 2, f"{100 * val:.1f}%", ha="center",
                        va="center", fontsize=8, color="white")
        bottom += v
    ax.set_ylim(0, 1)
    ax.set_ylabel("fraction of coefficient variance")
    ax.set_title("Coefficient variance decomposition (balanced functional ANOVA)")
    ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8, title="term")
    plt.setp(ax.get_xticklabels(), rotation=15, ha="right")
    return _save(fig, Path(path))


def retention_figure(retention: pd.DataFrame, path: str | Path) -> Path:
    """Figure 4: static retention with intervals per model family, the absolute ΔNLL written beside each."""
    df = retention.iloc[::-1]
    fig, ax = plt.subplots(figsize=(10, 0.6 * max(len(df), 2) + 1.6))
    y = np.arange(len(df))
    pct = df[["statistic", "ci_low", "ci_high"]].astype(float) * 100
    fams = list(dict.fromkeys(retention["family"]))
    ax.set_yticks(y, [f"{r.family}\n{r.label} vs {r.reference_label}" for r in df.itertuples()], fontsize=8)
    # the numbers sit in a column right of the axes, so they never collide with points or each other
    ax.text(1.02, len(df) - 0.45, "retention [interval]\nΔNLL(S) vs ΔNLL(R), n", transform=ax.get_yaxis_transform(),
            fontsize=8, va="bottom", ha="left", weight="bold")
    for yi, r, x, l, h in zip(y, df.itertuples(), pct["statistic"], *error_bars(*pct.to_numpy().T)):
        c = _FAMILY_COLORS[fams.index(r.family) % len(_FAMILY_COLORS)]
        ax.errorbar([x], [yi], xerr=[[l], [h]], fmt="o", color=c, ecolor=c, capsize=4)
        unit = "checkpoints" if r.level == "checkpoint" else "windows"
        ci = ("" if not (np.isfinite(r.ci_low) and np.isfinite(r.ci_high))
              else f" [{100 * r.ci_low:.2f}%, {100 * r.ci_high:.2f}%]")
        ret = f"{100 * r.statistic:.2f}%" if np.isfinite(r.statistic) else retention_undefined(r)
        ax.text(1.02, yi, f"{ret}{ci}\n{r.delta_static:.4g} vs {r.delta_reference:.4g}, "
                f"n={int(r.n)} {unit}", transform=ax.get_yaxis_transform(), fontsize=8, va="center", ha="left")
    finite = pct.to_numpy()[np.isfinite(pct.to_numpy())]
    if finite.size:
        span = max(finite.max() - finite.min(), 1.0)
        ax.set_xlim(finite.min() - 0.25 * span, min(finite.max() + 0.25 * span, 100 + 0.25 * span))
    ax.set_ylim(-0.6, len(df) - 0.4)
    ax.axvline(100, color="#999999", lw=0.8, ls="--")
    ax.set_xlabel("retention = 1 − ΔNLL(S)/ΔNLL(R)  (%)")
    # left-aligned and lifted above the numbers column's heading, which it would otherwise run into
    ax.set_title("Static retention (interpret within a family only: references differ)", loc="left", pad=30)
    ax.grid(axis="x", alpha=0.3)
    return _save(fig, Path(path))


def log_penalties_figure(conditions: pd.DataFrame, path: str | Path) -> Path:
    """Figure 5: absolute penalties on a log axis across model families. Means <= 0 cannot sit on a log axis:
    they are drawn at the left edge as open markers labelled "<= 0" (never dropped); interval ends <= 0 are
    drawn to the edge with an arrow."""
    fams = list(dict.fromkeys(conditions["family"]))
    conds = [c for c in GENERIC if c in set(conditions["condition"])]
    conds += sorted(set(conditions["condition"]) - set(conds))
    pos = conditions[["statistic", "ci_low", "ci_high"]].to_numpy(dtype=float)
    pos = pos[np.isfinite(pos) & (pos > 0)]
    floor = 10 ** math.floor(math.log10(pos.min()) - 1) if pos.size else 1e-6
    top = 10 ** math.ceil(math.log10(pos.max()) + 0.3) if pos.size else 1.0
    fig, ax = plt.subplots(figsize=(9, 0.6 * len(conds) + 1.8))
    width = 0.7 / max(len(fams), 1)
    for i, fam in enumerate(fams):
        color = _FAMILY_COLORS[i % len(_FAMILY_COLORS)]
        for r in conditions[conditions["family"] == fam].itertuples():
            yy = len(conds) - 1 - conds.index(r.condition) + (i - (len(fams) - 1) / 2) * width
            m, lo, hi = float(r.statistic), float(r.ci_low), float(r.ci_high)
            if m > 0:
                lo_d = lo if np.isfinite(lo) and lo > 0 else floor
                hi_d = hi if np.isfinite(hi) else m
                ax.errorbar([m], [yy], xerr=[[m - lo_d], [max(hi_d - m, 0)]], fmt="o", color=color, capsize=3)
                if np.isfinite(lo) and lo <= 0:
                    ax.annotate("", (floor, yy), (m, yy), arrowprops={"arrowstyle": "->", "color": color})
            else:
                ax.plot([floor], [yy], marker="o", mfc="white", color=color, ls="none")
                ax.annotate(f"≤ 0 ({m:.2g})", (floor, yy), textcoords="offset points", xytext=(8, -3),
                            fontsize=8, color=color)
    # one legend entry per family, drawn by hand (a family's points may all be the '<= 0' kind)
    handles = [plt.Line2D([], [], marker="o", color=_FAMILY_COLORS[i % len(_FAMILY_COLORS)], ls="none", label=f)
               for i, f in enumerate(fams)]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8, title="family")
    ax.set_xscale("log")
    ax.set_xlim(floor * 0.7, top)
    extra = {c: sorted({str(v) for v in conditions.loc[conditions["condition"] == c, "label"]} - {GENERIC.get(c, c)})
             for c in conds}  # the families' own names of a condition, under the generic one
    ax.set_yticks(np.arange(len(conds))[::-1], [GENERIC.get(c, c) + (f"\n({' / '.join(extra[c])})" if extra[c] else "")
                                                for c in conds], fontsize=8)
    ax.set_xlabel("ΔNLL vs Correct (nats/token, log scale; open markers at the edge: mean ≤ 0)")
    ax.set_title("Absolute intervention penalties across model families")
    ax.grid(axis="x", which="major", alpha=0.3)
    return _save(fig, Path(path))
