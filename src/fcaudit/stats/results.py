"""The result objects, one vocabulary from one audit to a family of checkpoints: per-condition results are Mappings
from name to `Estimate` (scipy's style: `statistic`, `confidence_interval`, `pvalue`, `n`), whose `to_frame()` has
the columns `label, statistic, ci_low, ci_high, pvalue, n` (then `mc_se` and what the table adds); they print a
table of numbers already computed (no I/O), show themselves in notebooks and plot. `Results` is what one audit and
a summary's family share: `penalties()`, `factor_effects()`, `retention()` and the prespecified criteria's verdicts,
each computed once per (confidence, resamples) from the window-level (`WindowStatistics`) or checkpoint-level
(`CheckpointStatistics`, fcaudit.stats.levels) statistics. `VariationResult` is question 1 in the same vocabulary, and
`three_questions` the one table of a model's three answers that an audit's printout and the report open with."""

from __future__ import annotations

import html
import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, ClassVar, Iterable, Iterator

import numpy as np
import pandas as pd

from fcaudit.protocol import Criteria
from fcaudit.stats import plots
from fcaudit.stats.inference import ConfidenceInterval, Estimate
from fcaudit.stats.variance import TERMS

FACTOR_LABELS = {"input": "E_input", "token": "E_token", "interaction": "E_interaction"}
VOCABULARY = ("label", "statistic", "ci_low", "ci_high", "pvalue", "n")  # every result table's first columns
WINDOW_LEVEL = "window-level (one checkpoint)"


# ---- display -----------------------------------------------------------------------------------------------------

def _signed(x: float) -> str:
    return "nan" if not math.isfinite(x) else f"{x:+.4g}"


def _interval(low: float, high: float) -> str:
    return f"[{_signed(low)}, {_signed(high)}]" if math.isfinite(low) and math.isfinite(high) else "no interval"


def _blank(x: float, spec: str) -> str:
    return "" if not math.isfinite(x) else format(x, spec)


def text_table(header: list[str], rows: list[list[str]], indent: str = "  ") -> list[str]:
    """Columns padded to their widest cell: the first left-aligned (a name), the others right-aligned (numbers)."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return [(indent + "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
            .rstrip() for r in [header, *rows]]


def html_table(header: list[str], rows: list[list[str]], caption: str = "") -> str:
    cap = f"<caption style='text-align:left'>{html.escape(caption)}</caption>" if caption else ""
    head = "".join(f"<th>{html.escape(c)}</th>" for c in header)
    body = "".join("<tr>" + "".join(f"<td{'' if i == 0 else ' style=text-align:right'}>{html.escape(c)}</td>"
                                    for i, c in enumerate(r)) + "</tr>" for r in rows)
    return f"<table>{cap}<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def html_lines(lines: Iterable[str]) -> str:
    items = "".join(f"<li>{html.escape(line)}</li>" for line in lines)
    return f"<ul>{items}</ul>" if items else ""


# ---- per-quantity results ------------------------------------------------------------------------------------------

@dataclass(frozen=True, repr=False, eq=False)
class Estimates(Mapping):
    """Estimates of named quantities in order: a Mapping from name to `Estimate` (a display label works in `[...]`
    too), scipy-style arrays over them (`statistic`, `confidence_interval`, `pvalue`, `n`), `to_frame()`, `plot()`.

    Results compare by identity; `dict(result)` gives the name -> Estimate pairs."""

    names: tuple[str, ...]
    labels: tuple[str, ...]
    estimates: tuple[Estimate, ...]
    mc_se: np.ndarray  # Monte Carlo SE across randomizations; nan where there is none
    n_positive: np.ndarray  # checkpoints with a value above 0 (checkpoint level); nan at window level
    level: str  # the units resampled: "window" (one audit) or "checkpoint" (a summary's family)

    _index: ClassVar[str] = "name"
    _what: ClassVar[str] = ""
    __hash__ = object.__hash__

    def __eq__(self, other: object) -> bool:
        return self is other

    def __getitem__(self, name: str) -> Estimate:
        """The estimate of one quantity, by name (CrossInput, input) or display label (LayerMean, E_input)."""
        for key in (self.names, self.labels):
            if name in key:
                return self.estimates[key.index(name)]
        raise KeyError(f"{name!r} is not one of {list(self.names)}")

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)

    @property
    def statistic(self) -> np.ndarray:
        return np.array([e.statistic for e in self.estimates], dtype=float)

    @property
    def confidence_interval(self) -> ConfidenceInterval:
        return ConfidenceInterval(np.array([e.confidence_interval.low for e in self.estimates], dtype=float),
                                  np.array([e.confidence_interval.high for e in self.estimates], dtype=float))

    @property
    def pvalue(self) -> np.ndarray:
        """Two-sided sign-flip p-values over checkpoints; nan at window level (windows of one checkpoint are not
        independent units for a test)."""
        return np.array([e.pvalue for e in self.estimates], dtype=float)

    @property
    def n(self) -> np.ndarray:
        return np.array([e.n for e in self.estimates], dtype=np.int64)

    @property
    def confidence_level(self) -> float:
        return self.estimates[0].confidence_level if self.estimates else math.nan

    def _extra(self) -> dict[str, np.ndarray]:
        """The columns after mc_se that this result's table adds."""
        return {}

    def to_frame(self) -> pd.DataFrame:
        """One row per quantity, indexed by name: label, statistic, ci_low, ci_high, pvalue, n, mc_se, then the
        columns of this result (see its class)."""
        low, high = self.confidence_interval
        return pd.DataFrame({"label": list(self.labels), "statistic": self.statistic, "ci_low": low, "ci_high": high,
                             "pvalue": self.pvalue, "n": self.n, "mc_se": self.mc_se, **self._extra()},
                            index=pd.Index(list(self.names), name=self._index))

    @classmethod
    def from_frame(cls, frame: pd.DataFrame, level: str, confidence: float) -> "Estimates":
        """The result `to_frame()` wrote (indexed by name, or with the name as a column), e.g. read back from a
        summary's JSON (there without the estimates' `method`)."""
        f = frame.set_index(cls._index) if cls._index in frame.columns else frame
        estimates = tuple(Estimate(float(r.statistic), ConfidenceInterval(float(r.ci_low), float(r.ci_high)),
                                   float(r.pvalue), int(r.n), "", confidence) for r in f.itertuples())
        own = {k.name: f[k.name].to_numpy(dtype=float) for k in fields(cls)[len(fields(Estimates)):]}
        return cls(tuple(f.index), tuple(f["label"]), estimates, f["mc_se"].to_numpy(dtype=float),
                   f["n_positive"].to_numpy(dtype=float), level, **own)

    def _title(self) -> str:
        pct, units = f"{100 * self.confidence_level:g}%", "/".join(map(str, sorted(set(self.n.tolist())))) or "0"
        how = (f"{pct} bootstrap intervals over {units} checkpoints, two-sided sign-flip p-values"
               if self.level == "checkpoint" else f"{pct} paired-window bootstrap intervals over {units} windows")
        return f"{type(self).__name__}: {self._what}, {how}"

    def _cells(self) -> tuple[list[str], list[list[str]]]:
        """The table's header and rows, as the repr and the notebook show them (columns without values left out)."""
        low, high = self.confidence_interval
        extra = self._extra()
        cols = {self._index: list(self.labels), "ΔNLL": [_signed(x) for x in self.statistic],
                f"{100 * self.confidence_level:g}% interval": [_interval(a, b) for a, b in zip(low, high)],
                "p": [_blank(x, ".4g") for x in self.pvalue],
                "p (Holm)": [_blank(x, ".4g") for x in extra.get("pvalue_holm", ())],
                "> 0": ["" if not math.isfinite(k) else f"{int(k)}/{n}" for k, n in zip(self.n_positive, self.n)],
                "MC SE": [_blank(x, ".2g") for x in self.mc_se],
                "active": [_blank(x, ".3g") for x in extra.get("active", ())]}
        cols = {k: v for k, v in cols.items() if k == self._index or any(v)}
        return list(cols), [list(r) for r in zip(*cols.values())]

    def __repr__(self) -> str:
        header, rows = self._cells()
        return "\n".join([self._title(), *text_table(header, rows)])

    def _repr_html_(self) -> str:
        return html_table(*self._cells(), caption=self._title())


@dataclass(frozen=True, repr=False, eq=False)
class PenaltiesResult(Estimates):
    """Mean ΔNLL vs Correct per condition (Eq. 4), with intervals, Monte Carlo SE and the active sources.

    What `penalties()` returns, for one audit (paired-window bootstrap intervals) and for a summary's family
    (percentile bootstrap intervals over checkpoints, two-sided sign-flip p-values and the count of positive
    checkpoints). A Mapping from condition name to `Estimate` (a label works in `[...]`), with arrays over the
    conditions and `to_frame()`: label, statistic, ci_low, ci_high, pvalue, n, mc_se, n_positive, active.

    Attributes
    ----------
    names, labels : tuple of str
        The conditions, in registry order, and their display labels.
    mc_se : numpy.ndarray
        Monte Carlo SE across randomizations (nan for a condition that is not randomized); across checkpoints the
        mean within-checkpoint one.
    n_positive : numpy.ndarray
        Checkpoints with a positive mean ΔNLL (nan at window level).
    active : numpy.ndarray
        Mean active sources (experts; token routers: the fraction of tokens chosen) per token of each condition.
    level : str
        "window" or "checkpoint".

    Examples
    --------
    >>> pen = result.penalties()
    >>> list(pen)[:2], "StaticProfile" in pen, len(pen)
    (['CrossInput', 'TokenShuffle'], True, 7)
    >>> low, high = pen.confidence_interval  # arrays over the conditions
    >>> pen["CrossInput"].confidence_level, low.shape == pen.statistic.shape
    (0.95, True)
    >>> pen.to_frame().columns.tolist()
    ['label', 'statistic', 'ci_low', 'ci_high', 'pvalue', 'n', 'mc_se', 'n_positive', 'active']
    >>> ax = pen.plot()  # Figure 2: points with intervals, the reference on its own scale
    """

    active: np.ndarray
    _index: ClassVar[str] = "condition"
    _what: ClassVar[str] = "mean ΔNLL vs Correct per condition (nats per predicted token)"

    def _extra(self) -> dict[str, np.ndarray]:
        return {"n_positive": self.n_positive, "active": self.active}

    def plot(self, ax=None, *, reference_ax=None):
        """Figure 2: each condition's mean ΔNLL with its interval; the structure-removed reference on its own
        linear scale, on `reference_ax` (default: a panel beside `ax`, or a new figure of both).

        Returns
        -------
        matplotlib.axes.Axes
            The conditions' panel.
        """
        return plots.penalties(self, ax, reference_ax)


@dataclass(frozen=True, repr=False, eq=False)
class FactorEffectsResult(Estimates):
    """E_input, E_token, E_interaction (Eq. 5-7): factorial contrasts, not an additive split into mechanisms.

    What `factor_effects()` returns, shaped like `PenaltiesResult`: a Mapping from effect ("input", "token",
    "interaction"; or its label "E_input", ...) to `Estimate`, and `to_frame()`: label, statistic, ci_low, ci_high,
    pvalue, n, mc_se, pvalue_holm (Holm across the three effects, checkpoint level), n_positive.

    Examples
    --------
    >>> fx = result.factor_effects()
    >>> list(fx), fx.labels
    (['input', 'token', 'interaction'], ('E_input', 'E_token', 'E_interaction'))
    >>> fx["E_input"].n  # windows its interval is over
    4
    >>> ax = fx.plot()
    """

    pvalue_holm: np.ndarray
    _index: ClassVar[str] = "effect"
    _what: ClassVar[str] = "factor effects (ΔNLL, paired CC/DC/CS/DS cells)"

    def _extra(self) -> dict[str, np.ndarray]:
        return {"pvalue_holm": self.pvalue_holm, "n_positive": self.n_positive}

    def plot(self, ax=None):
        """The three effects with their intervals on one axis.

        Returns
        -------
        matplotlib.axes.Axes
        """
        return plots.effects(self, ax)


def retention_value(retention: float, low: float, high: float, note: str) -> str:
    """Retention as the terminal prints it: '98.70% [97.10%, 99.20%]', or 'undefined (why)'. A negative one says in
    words that the condition costs more than removing the structure, which is no degree of retention."""
    if not math.isfinite(retention):
        return f"undefined ({note})"
    worse = ", below 0: costs more than the structure-removed reference" if retention < 0 else ""
    if math.isfinite(low) and math.isfinite(high):
        return f"{100 * retention:.2f}% [{100 * low:.2f}%, {100 * high:.2f}%]{worse}"
    return f"{100 * retention:.2f}% ({note.split('; ')[-1]}){worse}"


@dataclass(frozen=True, repr=False, eq=False)
class RetentionResult:
    """Retention(S) = 1 - ΔNLL(S)/ΔNLL(R) (Eq. 8) with its paired interval, beside both absolute ΔNLLs.

    What `retention(...)` returns. Undefined (statistic nan, the reason in `reason`) unless the reference's interval
    lies above the criteria's practically-small bound (`bound`): below it, removing all structure is itself
    negligible and the ratio says nothing. `to_frame()`: label, statistic, ci_low, ci_high, pvalue (nan: retention is
    not tested), n, reference, reference_label, delta_static, delta_reference, bound, note.

    Attributes
    ----------
    condition, label : str
        The static condition and its display label.
    reference, reference_label : str
        The structure-removed reference R and its label.
    delta_static, delta_reference : float
        The two mean ΔNLLs the ratio is of.
    bound : float
        The practically-small bound the reference's interval must lie above.
    level : str
        The units resampled: "window" (one audit) or "checkpoint" (`fca.summarize`).

    Examples
    --------
    >>> ret = result.retention()  # the controller's own static condition
    >>> ret.condition, ret.level, ret.bound
    ('StaticProfile', 'window', 0.002)
    >>> ret.defined or ret.reason != ""  # a number, or the reason there is none
    True
    """

    condition: str
    label: str
    reference: str
    reference_label: str
    estimate: Estimate
    delta_static: float
    delta_reference: float
    bound: float
    level: str

    @property
    def statistic(self) -> float:
        return self.estimate.statistic

    @property
    def confidence_interval(self) -> ConfidenceInterval:
        return self.estimate.confidence_interval

    @property
    def pvalue(self) -> float:
        return math.nan  # retention is reported with its interval, not tested

    @property
    def n(self) -> int:
        return self.estimate.n

    @property
    def defined(self) -> bool:
        return math.isfinite(self.statistic)

    @property
    def reason(self) -> str:
        """Why retention is undefined ('' where it is defined)."""
        return "" if self.defined else self.estimate.method

    @property
    def note(self) -> str:
        """What the tables' note column holds: why the retention or its interval is missing ('' if neither is)."""
        return "" if self.estimate.has_interval else self.estimate.method

    def line(self) -> str:
        """One line: retention, its interval and both ΔNLLs, as the CLI prints it."""
        low, high = self.confidence_interval
        return (f"retention {self.label} vs {self.reference_label}: "
                f"{retention_value(self.statistic, low, high, self.note)}; "
                f"ΔNLL {self.delta_static:.6g} vs {self.delta_reference:.6g}")

    def __repr__(self) -> str:
        return f"RetentionResult({self.line()}; n={self.n} {self.level}s)"

    def _repr_html_(self) -> str:
        return f"<p>{html.escape(repr(self))}</p>"

    def to_frame(self) -> pd.DataFrame:
        """One row, indexed by the condition: the result tables' columns, then the reference, both ΔNLLs, the bound
        and the note."""
        low, high = self.confidence_interval
        return pd.DataFrame([{"label": self.label, "statistic": self.statistic, "ci_low": low, "ci_high": high,
                              "pvalue": self.pvalue, "n": self.n, "reference": self.reference,
                              "reference_label": self.reference_label, "delta_static": self.delta_static,
                              "delta_reference": self.delta_reference, "bound": self.bound, "note": self.note}],
                            index=pd.Index([self.condition], name="condition"))

    @classmethod
    def from_row(cls, row: Mapping, level: str, confidence: float) -> "RetentionResult":
        """A row of `to_frame()` (with its condition), e.g. read back from a summary's JSON."""
        est = Estimate(float(row["statistic"]), ConfidenceInterval(float(row["ci_low"]), float(row["ci_high"])),
                       math.nan, int(row["n"]), str(row["note"] or ""), confidence)
        return cls(row["condition"], row["label"], row["reference"], row["reference_label"], est,
                   float(row["delta_static"]), float(row["delta_reference"]), float(row["bound"]), level)


# ---- question 1: coefficient variation -------------------------------------------------------------------------

def share(x: float) -> str:
    return "nan" if not math.isfinite(x) else f"{100 * x:.1f}%"


@dataclass(frozen=True, repr=False, eq=False)
class VariationResult(Mapping):
    """Coefficient variation (question 1): the balanced variance decomposition of the evaluation coefficients, a
    Mapping from component (layer, input, token and their interactions) to its share of the total, beside each
    layer's coefficient profile. Descriptive: it says how the coefficients spread, not whether the model uses that
    spread (the conditions test that). Shares are nan where the coefficients are constant.

    What `AuditResult.variation()` returns (variation.json, as the audit wrote it, in `record`). `to_frame()`: one
    row per component (share); `profile()`: one row per layer (site, shape, mean, sd).

    Attributes
    ----------
    shares : dict
        Component -> share of the total sum of squares (they sum to 1).
    layers : tuple of dict
        Each layer's profile: layer, site, shape [stream, source], mean, sd, stream_source_mean.
    decomposed : str
        What was decomposed (a scalar per (input, layer, token), or each (stream, source) slice pooled).
    windows_decomposed, windows : int
        The (first) windows decomposed, of the evaluation windows profiled.

    Examples
    --------
    >>> var = result.variation()
    >>> list(var)[:3], round(sum(var.values()), 9)
    (['layer', 'input', 'token'], 1.0)
    >>> var.to_frame().columns.tolist(), var.profile()["site"].tolist()
    (['label', 'share'], ['gates.0', 'gates.1'])
    >>> var.line()
    'layer ...%, input ...%, token ...%, interactions ...% of the coefficient variance'
    >>> ax = var.plot()
    """

    shares: dict
    layers: tuple
    decomposed: str
    windows_decomposed: int | None
    windows: int | None
    record: dict

    @classmethod
    def from_json(cls, var: dict) -> VariationResult:
        """variation.json's content (`fcaudit.stats.variance.variation`'s)."""
        got = var["decomposition"]
        shares = {t: math.nan if got[t] is None else float(got[t]) for t in (*TERMS, *got) if t in got}
        return cls(shares, tuple(var["layers"]), str(var.get("decomposed", "")), var.get("windows_decomposed"),
                   var.get("windows"), dict(var))

    def __getitem__(self, name: str) -> float:
        return self.shares[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.shares)

    def __len__(self) -> int:
        return len(self.shares)

    __hash__ = object.__hash__

    def __eq__(self, other: object) -> bool:
        return self is other

    @property
    def constant(self) -> bool:
        """The coefficients do not vary at all: nothing to decompose (every share nan)."""
        return not any(math.isfinite(v) for v in self.shares.values())

    def main(self) -> dict[str, float]:
        """The shares of layer, input and token alone, and of all their interactions together."""
        mains = {t: self.shares.get(t, math.nan) for t in TERMS[:3]}
        rest = math.nan if self.constant else sum(v for t, v in self.shares.items() if t not in mains)
        return {**mains, "interactions": rest}

    def line(self) -> str:
        """One line: the main shares and the interactions', or that the coefficients are constant."""
        if self.constant:
            return "none: the coefficients are the same for every input, token and layer (variance 0)"
        return ", ".join(f"{t} {share(v)}" for t, v in self.main().items()) + " of the coefficient variance"

    def to_frame(self) -> pd.DataFrame:
        """One row per component, indexed by it: its label and share of the total."""
        return pd.DataFrame({"label": list(self.shares), "share": list(self.shares.values())},
                            index=pd.Index(list(self.shares), name="component"))

    def profile(self) -> pd.DataFrame:
        """One row per layer: its site, the [stream, source] shape, mean and sd over inputs and tokens."""
        return pd.DataFrame([{k: (tuple(v) if k == "shape" else v) for k, v in layer.items()
                              if k in ("layer", "site", "shape", "mean", "sd")} for layer in self.layers])

    def _title(self) -> str:
        return (f"VariationResult: shares of the coefficient variance (balanced ANOVA over {self.windows_decomposed} "
                f"of {self.windows} windows; descriptive)")

    def _cells(self) -> tuple[list[str], list[list[str]]]:
        return ["component", "share"], [[t, share(v)] for t, v in self.shares.items()]

    def __repr__(self) -> str:
        return "\n".join([self._title(), *text_table(*self._cells())])

    def _repr_html_(self) -> str:
        return html_table(*self._cells(), caption=self._title())

    def plot(self, ax=None):
        """The shares as horizontal bars (the report's Figure 3 shows them stacked, per model).

        Returns
        -------
        matplotlib.axes.Axes
        """
        if ax is None:
            import matplotlib.pyplot as plt

            _, ax = plt.subplots(figsize=(5, 0.35 * max(len(self), 3) + 1.2))
        ax.barh(list(self.shares)[::-1], np.nan_to_num(list(self.shares.values()))[::-1], color="#4c72b0")
        ax.set_xlim(0, 1)
        ax.set_xlabel("share of the coefficient variance")
        return ax


# ---- the three questions, one model ------------------------------------------------------------------------------

NOT_MEASURED = "not measured: pass execution=True to fca.audit (fcaudit audit --execution)"


def _with_interval(e: Estimate) -> str:
    low, high = e.confidence_interval
    return f"{_signed(e.statistic)}" + (f" {_interval(low, high)}" if e.has_interval else "")


def three_questions(variation: VariationResult | None, penalties: PenaltiesResult, retention: RetentionResult | None,
                    static: str, execution: Any = None, why_not: str = NOT_MEASURED) -> dict[str, dict[str, str]]:
    """One model's answers to the paper's three questions, as cells {question: {column: text}}: variation (the
    shares of layer, input, token and interactions), dependence (the controller's own static condition's ΔNLL,
    CrossInput's, retention or why undefined) and execution (decided, executed and the verdict of an object that has
    them, e.g. an ExecutionResult; `why_not` where there is none)."""
    if variation is None:
        var = {"variation": "not recorded (an unfinished audit)"}
    elif variation.constant:
        var = {"variation": "none (constant coefficients)"}
    else:
        var = {t: share(v) for t, v in variation.main().items()}
    labels = dict(zip(penalties.names, penalties.labels))
    dep = {f"{labels.get(static, static)} ΔNLL": _with_interval(penalties[static]) if static in penalties else "—"}
    if "CrossInput" in penalties:
        dep[f"{labels['CrossInput']} ΔNLL"] = _with_interval(penalties["CrossInput"])
    if retention is not None:
        low, high = retention.confidence_interval
        dep["retention"] = retention_value(retention.statistic, low, high, retention.note)
    if execution is None:
        ex = {"execution": why_not}
    else:
        ex = {"decided": share(execution.decided), "executed": f"{share(execution.executed)} (observed)",
              "controller FLOPs": f"x{execution.controller_flops:.3f} of its decisions replayed without it",
              "verdict": execution.verdict.split(": ", 1)[-1]}
    return {"variation": var, "dependence": dep, "execution": ex}


def answer(question: str, part: dict[str, str], sep: str = " ") -> str:
    """One question's cells as text: 'name value' pairs; a cell named as its question is its text alone, and a
    verdict follows a colon."""
    said = ", ".join(v if k == question else f"{k}{sep}{v}" for k, v in part.items() if k != "verdict")
    return said + (f": {part['verdict']}" if "verdict" in part else "")


def questions_lines(cells: dict[str, dict[str, str]]) -> list[str]:
    """The three questions as text: one row per question, its columns as 'name value' pairs."""
    width = max(map(len, cells))
    return ["three questions:", *(f"  {q.ljust(width)}  {answer(q, p)}" for q, p in cells.items())]


def questions_html(cells: dict[str, dict[str, str]]) -> str:
    rows = [[q, answer(q, p, ": ")] for q, p in cells.items()]
    return html_table(["question", "answer"], rows, caption="The three questions")


# ---- the prespecified criteria ---------------------------------------------------------------------------------

def met_word(met: bool | None) -> str:
    """A criterion's verdict in words (None: the number it needs does not exist)."""
    return {True: "met", False: "not met"}.get(met, "not evaluable")


def judge(penalties: PenaltiesResult, retention: RetentionResult | None, criteria: Criteria,
          static: str) -> list[dict]:
    """The two prespecified verdicts on the controller's own static condition `static`: is its ΔNLL practically
    small (its interval's upper bound below the criteria's bound), and is its retention high (the lower bound above
    the criteria's)? `met` is None where the needed bound does not exist."""
    pct, ran = f"{100 * criteria.confidence:g}%", static in penalties.names
    label = penalties.labels[penalties.names.index(static)] if ran else static
    out = []
    for name, quantity, bound, level, threshold, shown, above in (
            ("practically small", "ΔNLL", penalties[static].confidence_interval.high if ran else math.nan,
             penalties.level if ran else None, criteria.small_upper, f"{criteria.small_upper:g}", False),
            ("high retention", "retention", retention.confidence_interval.low if retention else math.nan,
             retention.level if retention else None, criteria.retention_lower,
             f"{100 * criteria.retention_lower:g}%", True)):
        finite = math.isfinite(bound)
        out.append({"name": name, "quantity": f"{static} {quantity}", "label": label,
                    "rule": f"{'lower' if above else 'upper'} {pct} bound of the {static} {quantity} "
                            f"{'>' if above else '<'} {shown}",
                    "threshold": threshold, "bound": float(bound) if finite else None,
                    "met": (bound > threshold if above else bound < threshold) if finite else None,
                    "level": WINDOW_LEVEL if level == "window" else level})
    return out


def verdict_line(v: dict) -> str:
    return f"criterion '{v['name']}' ({v['rule']}; {v['level'] or 'no interval'}): {met_word(v['met'])}"


# ---- what an audit and a family of audits share ----------------------------------------------------------------

class Results:
    """The statistics of one audit (`AuditResult`) or of one family of audits (a summary's `FamilyResult`), under the
    same names: `penalties()`, `factor_effects()`, `retention()`, the criteria's `verdicts()`, a printout
    (`str()`) and a notebook display. Each is computed once per (confidence, resamples).

    A subclass provides `criteria`, `labels`, `static` (its controller's own static condition), `notices`,
    `_heading()` (its first lines) and `_compute(confidence, n_resamples)` (its statistics)."""

    criteria: Criteria
    labels: dict[str, str]
    static: str
    notices: tuple[str, ...]
    _statistics: dict

    def _compute(self, confidence: float, n_resamples: int) -> Any:
        raise NotImplementedError

    def _heading(self) -> list[str]:
        raise NotImplementedError

    def _caption(self) -> list[str]:
        """Lines between the notices and the penalties' table."""
        return []

    def statistics(self, confidence: float | None = None, n_resamples: int = 10000):
        """The statistics that penalties, factor effects and retention are computed from, once per (confidence,
        n_resamples): `WindowStatistics` for one checkpoint (ΔNLL per window in `.per_window`),
        `CheckpointStatistics` for several (`.per_checkpoint`).

        Parameters
        ----------
        confidence
            The intervals' level; None takes the criteria's.
        n_resamples
            Bootstrap resamples of the units (windows or checkpoints).

        Examples
        --------
        >>> stats = result.statistics()
        >>> stats.per_window.shape  # ΔNLL per window (rows) and condition (columns)
        (4, 7)
        >>> result.statistics() is stats  # computed once
        True
        """
        key = (self.criteria.confidence if confidence is None else float(confidence), int(n_resamples))
        if key not in self._statistics:
            self._statistics[key] = self._compute(*key)
        return self._statistics[key]

    def penalties(self, confidence: float | None = None, n_resamples: int = 10000) -> PenaltiesResult:
        """The cost of each condition: mean ΔNLL vs Correct per condition (Eq. 4), with its interval.

        Each condition replaces the coefficients (e.g. CrossInput: another input's; StaticProfile: a fixed profile
        from the calibration windows); its penalty is how much worse the frozen model predicts. Also the Monte
        Carlo SE across randomizations and the mean active sources (experts) per token; across checkpoints the
        sign-flip p-values and the count of positive checkpoints.

        Parameters
        ----------
        confidence
            The intervals' level; None takes the criteria's.
        n_resamples
            Bootstrap resamples of the units (windows or checkpoints).

        Returns
        -------
        PenaltiesResult
            A Mapping condition -> Estimate; prints a table; `.statistic`, `.confidence_interval`, `.to_frame()`.

        Examples
        --------
        >>> pen = result.penalties()
        >>> pen.to_frame()[["label", "statistic", "ci_low", "ci_high"]].columns.tolist()
        ['label', 'statistic', 'ci_low', 'ci_high']
        >>> pen["StaticProfile"].n  # windows the interval is over
        4
        >>> result.penalties() is pen  # computed once
        True
        """
        return self.statistics(confidence, n_resamples).penalties()

    def factor_effects(self, confidence: float | None = None, n_resamples: int = 10000) -> FactorEffectsResult:
        """The factorial contrasts E_input, E_token and E_interaction (Eq. 5-7), with their intervals.

        From the paired cells CC (Correct), DC (CrossInput), CS (TokenShuffle) and DS (CrossShuffle) of each
        window and randomization: contrasts, not an additive split into mechanisms. Across checkpoints their
        p-values are Holm-adjusted as a family of three.

        Parameters
        ----------
        confidence
            The intervals' level; None takes the criteria's.
        n_resamples
            Bootstrap resamples of the units (windows or checkpoints).

        Returns
        -------
        FactorEffectsResult
            A Mapping effect -> Estimate; `fx["E_input"]`, `.statistic`, `.confidence_interval`, `.to_frame()`.

        Examples
        --------
        >>> fx = result.factor_effects()
        >>> fx.to_frame().index.tolist()
        ['input', 'token', 'interaction']
        """
        return self.statistics(confidence, n_resamples).factor_effects()

    def retention(self, name: str | None = None, confidence: float | None = None,
                  n_resamples: int = 10000) -> RetentionResult:
        """How much of the input-dependent structure's value a static condition keeps (Eq. 8).

        Retention(S) = 1 - ΔNLL(S) / ΔNLL(StructureRemoved), with its interval, reported beside both absolute
        ΔNLLs. Undefined (statistic nan, with the reason) unless the reference's interval lies above the criteria's
        practically-small bound.

        Parameters
        ----------
        name
            A retained static condition (StaticProfile, LayerPositionMean, StaticTopK) or its display label (e.g.
            LayerMean); None: the controller's own static condition (`static`: StaticTopK for routers, else
            StaticProfile), the one the criteria judge.
        confidence
            The interval's level; None takes the criteria's.
        n_resamples
            Bootstrap resamples of the units (windows or checkpoints).

        Returns
        -------
        RetentionResult
            `.statistic`, `.confidence_interval`, `.defined`, `.reason`, `.line()`, `.to_frame()`.

        Examples
        --------
        >>> ret = result.retention()
        >>> ret.condition, ret.reference_label, ret.n
        ('StaticProfile', 'GlobalMean', 4)
        >>> ret.line()
        'retention StaticProfile vs GlobalMean: ...; ΔNLL ... vs ...'
        """
        return self.statistics(confidence, n_resamples).retention(self.static if name is None else name)

    def retention_lines(self) -> list[str]:
        """One line per retained condition: retention, its interval and the two absolute ΔNLLs (or why undefined).

        Examples
        --------
        >>> for line in result.retention_lines():
        ...     print(line)
        retention Layer×PositionMean vs GlobalMean: ...
        retention StaticProfile vs GlobalMean: ...; ΔNLL ... vs ...
        """
        return [r.line() for r in self.statistics().retentions()]

    def verdicts(self) -> list[dict]:
        """The prespecified criteria's two verdicts on the controller's own static condition (`static`): is its ΔNLL
        practically small, is its retention high? Each names its rule, the bound it judged and `met` (None: not
        evaluable, the bound does not exist).

        Examples
        --------
        >>> [(v["name"], v["quantity"]) for v in result.verdicts()]
        [('practically small', 'StaticProfile ΔNLL'), ('high retention', 'StaticProfile retention')]
        """
        stats = self.statistics()
        has = {r.condition: r for r in stats.retentions()}
        return judge(stats.penalties(), has.get(self.static), self.criteria, self.static)

    def _body(self) -> tuple[PenaltiesResult, list[str]]:
        """The penalties and the lines under them: a rough MC SE's note, retention, then the criteria's verdicts."""
        return self.penalties(), (self.statistics().mc_lines() + self.retention_lines()
                                  + [verdict_line(v) for v in self.verdicts()])

    def __str__(self) -> str:
        pen, lines = self._body()
        return "\n".join([*self._heading(), *self.notices, *self._caption(), repr(pen), *lines])

    def _repr_html_(self) -> str:
        pen, lines = self._body()
        head = "".join(f"<p>{html.escape(line)}</p>" for line in [*self._heading(), *self.notices, *self._caption()])
        return f"<div>{head}{pen._repr_html_()}{html_lines(lines)}</div>"

