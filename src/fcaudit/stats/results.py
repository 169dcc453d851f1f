"""One checkpoint's window-level statistics (`WindowStatistics`, shared by `AuditResult` and `fcaudit summarize`) and
their result objects in the scipy style: statistic, confidence_interval and pvalue, a repr that prints a table of
numbers already computed (no I/O), and `to_frame()`."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from functools import cached_property
from typing import ClassVar

import numpy as np
import pandas as pd

from fcaudit import protocol
from fcaudit.errors import FcauditError
from fcaudit.protocol import Criteria
from fcaudit.stats.effects import delta_nll, factor_effects, factorial_cells, mean_deltas
from fcaudit.stats.inference import ConfidenceInterval, Estimate, mc_se, paired_bootstrap, retention_bootstrap

BOOT_SEED = 0  # bootstrap resampling seed: same records, same intervals
FACTOR_LABELS = {"input": "E_input", "token": "E_token", "interaction": "E_interaction"}


def _signed(x: float) -> str:
    return "nan" if not math.isfinite(x) else f"{x:+.4g}"


def _interval(ci: ConfidenceInterval) -> str:
    return (f"[{_signed(ci.low)}, {_signed(ci.high)}]" if math.isfinite(ci.low) and math.isfinite(ci.high)
            else "no interval")


@dataclass(frozen=True, repr=False, eq=False)
class _Estimates:
    """Estimates of named quantities in order: scipy-style arrays over them, and one `Estimate` per name."""

    names: tuple[str, ...]
    labels: tuple[str, ...]
    estimates: tuple[Estimate, ...]
    mc_se: np.ndarray  # Monte Carlo SE across randomizations; nan where there is none

    @property
    def statistic(self) -> np.ndarray:
        return np.array([e.statistic for e in self.estimates], dtype=float)

    @property
    def confidence_interval(self) -> ConfidenceInterval:
        return ConfidenceInterval(np.array([e.confidence_interval.low for e in self.estimates], dtype=float),
                                  np.array([e.confidence_interval.high for e in self.estimates], dtype=float))

    @property
    def pvalue(self) -> np.ndarray:
        """nan throughout: windows of one checkpoint are not independent units for a test."""
        return np.full(len(self.estimates), math.nan)

    @property
    def n(self) -> np.ndarray:
        return np.array([e.n for e in self.estimates], dtype=np.int64)

    @property
    def confidence_level(self) -> float:
        return self.estimates[0].confidence_level if self.estimates else math.nan

    def __getitem__(self, name: str) -> Estimate:
        """The estimate of one quantity, by name (CrossInput, input) or display label (LayerMean, E_input)."""
        for n, label, e in zip(self.names, self.labels, self.estimates):
            if name in (n, label):
                return e
        raise KeyError(f"{name!r} is not one of {list(self.names)}")

    def __repr__(self) -> str:
        windows = "/".join(map(str, sorted(set(self.n.tolist())))) or "0"
        width = max((len(label) for label in self.labels), default=0)
        return "\n".join([f"{type(self).__name__}: {self._what}, {100 * self.confidence_level:g}% paired-window "
                          f"bootstrap intervals over {windows} windows",
                          *[(f"  {label:<{width}}  {_signed(e.statistic):>11} {_interval(e.confidence_interval):<26}"
                             + ("" if not math.isfinite(se) else f"  MC SE {se:.2g}")).rstrip()
                            for label, e, se in zip(self.labels, self.estimates, self.mc_se)]])


@dataclass(frozen=True, repr=False, eq=False)
class PenaltiesResult(_Estimates):
    """Mean ΔNLL vs Correct per condition (Eq. 4), with paired-window bootstrap intervals and MC SE.

    What `AuditResult.penalties()` returns: arrays over the conditions (`statistic`, `confidence_interval`, `pvalue`,
    `n`, `mc_se`), one `Estimate` per condition by name or label, and `to_frame()`. `pvalue` is nan throughout:
    windows of one checkpoint are not independent units for a test (`fca.summarize` tests across checkpoints).

    Attributes
    ----------
    names, labels : tuple of str
        The conditions, in registry order, and their display labels.
    mc_se : numpy.ndarray
        Monte Carlo SE across randomizations (nan for a condition that is not randomized).
    randomizations : tuple of int
        Randomizations each condition's mean is over.
    active : numpy.ndarray
        Mean active sources (experts) per token under each condition.

    Examples
    --------
    >>> pen = result.penalties()
    >>> low, high = pen.confidence_interval  # arrays over pen.names
    >>> pen.names[:2], low.shape == pen.statistic.shape
    (('CrossInput', 'TokenShuffle'), True)
    >>> pen["CrossInput"].confidence_level
    0.95
    """

    randomizations: tuple[int, ...] = ()
    active: np.ndarray = field(default_factory=lambda: np.array([]))
    _what: ClassVar[str] = "mean ΔNLL vs Correct per condition (nats per predicted token)"

    def to_frame(self) -> pd.DataFrame:
        """One row per condition: label, n, mean, ci_low, ci_high, mc_se, randomizations, active."""
        low, high = self.confidence_interval
        return pd.DataFrame({"condition": list(self.names), "label": list(self.labels), "n": self.n,
                             "mean": self.statistic, "ci_low": low, "ci_high": high, "mc_se": self.mc_se,
                             "randomizations": np.array(self.randomizations, dtype=np.int64), "active": self.active})


@dataclass(frozen=True, repr=False, eq=False)
class FactorEffectsResult(_Estimates):
    """E_input, E_token, E_interaction (Eq. 5-7): factorial contrasts, not an additive split into mechanisms.

    What `AuditResult.factor_effects()` returns, shaped like `PenaltiesResult`: arrays over the three effects, one
    `Estimate` per effect by name ("input") or label ("E_input"), and `to_frame()`.

    Examples
    --------
    >>> fx = result.factor_effects()
    >>> fx.labels
    ('E_input', 'E_token', 'E_interaction')
    >>> fx["E_input"].n  # windows its interval is over
    4
    """

    _what: ClassVar[str] = "factor effects (ΔNLL, paired CC/DC/CS/DS cells)"

    def to_frame(self) -> pd.DataFrame:
        """One row per effect (index input, token, interaction): mean, ci_low, ci_high, mc_se, n."""
        low, high = self.confidence_interval
        return pd.DataFrame({"effect": list(self.names), "mean": self.statistic, "ci_low": low, "ci_high": high,
                             "mc_se": self.mc_se, "n": self.n}).set_index("effect")


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

    What `AuditResult.retention(...)` returns. Undefined (statistic nan, the reason in `reason`) unless the
    reference's interval lies above the criteria's practically-small bound (`bound`): below it, removing all
    structure is itself negligible and the ratio says nothing.

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
    >>> ret = result.retention("StaticProfile")
    >>> ret.level, ret.bound
    ('window', 0.002)
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
    def pvalue(self) -> None:
        return None  # retention is reported with its interval, not tested

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

    def to_frame(self) -> pd.DataFrame:
        """One row: retention, its interval, both ΔNLLs, the reference, n and the note column of the tables."""
        low, high = self.confidence_interval
        return pd.DataFrame([{"condition": self.condition, "label": self.label, "retention": self.statistic,
                              "ci_low": low, "ci_high": high, "delta_static": self.delta_static,
                              "delta_reference": self.delta_reference, "reference": self.reference_label,
                              "n": self.n, "note": self.note}])


def retention_of(table: pd.DataFrame, condition: str, labels: dict[str, str], criteria: Criteria, unit: str,
                 n_resamples: int = 10000) -> RetentionResult:
    """Retention of `condition` against the structure-removed reference, over the units (rows of `table`: windows or
    checkpoints) that have both conditions' ΔNLL."""
    reference = protocol.structure_removed(table.columns)  # the callers check that there is one
    pair = table[[condition, reference]].dropna()
    s, r = pair[condition].to_numpy(), pair[reference].to_numpy()
    est = retention_bootstrap(s, r, criteria, n_resamples, BOOT_SEED, unit)
    return RetentionResult(condition, labels.get(condition, condition), reference, labels.get(reference, reference),
                           est, float(s.mean()), float(r.mean()), max(float(criteria.small_upper), 0.0), unit)


@dataclass(eq=False)
class WindowStatistics:
    """One checkpoint's penalties, factor effects and retention from its records, with paired-window bootstrap
    intervals (a window's ΔNLL averaged over randomizations is one unit): stability across evaluation windows, not
    uncertainty across trained checkpoints. `complete=False`: a partial audit's records."""

    records: pd.DataFrame
    labels: dict[str, str] = field(default_factory=protocol.default_labels)
    criteria: Criteria = field(default_factory=Criteria)
    complete: bool = True
    n_resamples: int = 10000

    @cached_property
    def _deltas(self) -> pd.DataFrame:
        d = delta_nll(self.records)
        if d.empty:
            raise FcauditError("the audit records hold no intervention conditions; rerun `fcaudit audit` to complete it")
        return d

    @cached_property
    def per_window(self) -> pd.DataFrame:
        """ΔNLL per window (rows) and condition (columns, registry order), averaged over randomizations."""
        wide = mean_deltas(self._deltas, "example")
        return wide[sorted(wide.columns, key=protocol.order)]

    @cached_property
    def randomization_means(self) -> pd.DataFrame:
        """ΔNLL per randomization (rows) and condition, averaged over windows: the input of the MC SE."""
        return mean_deltas(self._deltas, "randomization")

    @cached_property
    def active(self) -> pd.Series:
        """Mean active sources (experts) per token of each condition; empty for records from before the column."""
        return (self.records.groupby("condition")["active"].mean() if "active" in self.records
                else pd.Series(dtype=float))

    def _bootstrap(self, x) -> Estimate:
        return paired_bootstrap(x, confidence=self.criteria.confidence, n_resamples=self.n_resamples, seed=BOOT_SEED)

    def penalties(self) -> PenaltiesResult:
        rand, names = self.randomization_means, tuple(self.per_window.columns)
        return PenaltiesResult(
            names, tuple(self.labels.get(c, c) for c in names),
            tuple(self._bootstrap(self.per_window[c].dropna().to_numpy()) for c in names),
            np.array([mc_se(rand[c]) for c in names], dtype=float),
            tuple(int(rand[c].notna().sum()) for c in names),
            np.array([float(self.active.get(c, math.nan)) for c in names], dtype=float))

    @property
    def has_factorial(self) -> bool:
        return all(c in self.per_window.columns for c in protocol.factorial().values())

    def factor_effects(self) -> FactorEffectsResult:
        per_pair = asdict(factor_effects(0.0, *factorial_cells(self._deltas, complete=self.complete)))  # [example, r]
        names = tuple(FACTOR_LABELS)
        return FactorEffectsResult(
            names, tuple(FACTOR_LABELS.values()),
            tuple(self._bootstrap(per_pair[k].mean(axis=1)) for k in names),
            np.array([mc_se(per_pair[k].mean(axis=0)) for k in names], dtype=float))

    def retention(self, condition: str) -> RetentionResult:
        """`condition`: a retained static condition (StaticProfile, LayerPositionMean, StaticTopK) or its label."""
        by_label = {v: k for k, v in self.labels.items()}
        cond = by_label.get(condition, condition)
        have = [c for c in protocol.retained() if c in self.per_window.columns]
        reference = protocol.structure_removed(self.per_window.columns)
        if cond not in have or reference is None:
            named = ", ".join(f"{c} ({self.labels.get(c, c)})" for c in have) or "none in these records"
            raise FcauditError(f"retention is defined for the static conditions {named} against "
                               f"{reference or 'a structure-removed reference'}, not {condition!r}")
        return retention_of(self.per_window, cond, self.labels, self.criteria, "window", self.n_resamples)

    def retentions(self) -> list[RetentionResult]:
        """Retention of every retained static condition in the records (none without the reference)."""
        if protocol.structure_removed(self.per_window.columns) is None:
            return []
        return [self.retention(c) for c in protocol.retained() if c in self.per_window.columns]
