"""The two levels of inference, never mixed (paper §4.1): one checkpoint's window-level statistics
(`WindowStatistics`: paired-window bootstrap intervals, the Monte Carlo SE across randomizations) and a family's
checkpoint-level ones (`CheckpointStatistics`: trained checkpoints are the units). Both give the same result objects
(fcaudit.stats.results), each computed once."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from functools import cached_property
from typing import ClassVar, Iterable

import numpy as np
import pandas as pd

from fcaudit import protocol
from fcaudit.errors import FcauditError
from fcaudit.protocol import Criteria
from fcaudit.stats.effects import delta_nll, factor_effects, factorial_cells, mean_deltas
from fcaudit.stats.inference import (Estimate, checkpoint_bootstrap, holm, mc_note, mc_se, paired_bootstrap,
                                     retention_bootstrap)
from fcaudit.stats.results import FACTOR_LABELS, FactorEffectsResult, PenaltiesResult, RetentionResult

BOOT_SEED = 0  # bootstrap resampling seed: same records, same intervals


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


def retained_name(name: str, ran: Iterable[str], labels: dict[str, str]) -> str:
    """The retained static condition `name` (or its label) names among the conditions `ran`; a clear error where it
    is none, or where the records have no structure-removed reference."""
    ran = list(ran)
    have = [c for c in protocol.retained() if c in ran]
    cond = name if name in protocol.REGISTRY else {v: k for k, v in labels.items() if k in ran}.get(name, name)
    reference = protocol.structure_removed(ran)
    if cond not in have or reference is None:
        named = ", ".join(f"{c} ({labels.get(c, c)})" for c in have) or "none in these records"
        raise FcauditError(f"retention is defined for the static conditions {named} against "
                           f"{reference or 'a structure-removed reference'}, not {name!r}")
    return cond


def _nan(n: int) -> np.ndarray:
    return np.full(n, math.nan)


class _Level:
    """What both levels share, from their table of ΔNLL per unit (rows: windows or checkpoints) and condition."""

    level: ClassVar[str]
    labels: dict[str, str]
    criteria: Criteria
    n_resamples: int

    @property
    def units(self) -> pd.DataFrame:
        raise NotImplementedError

    @property
    def has_factorial(self) -> bool:
        return all(c in self.units.columns for c in protocol.factorial().values())

    @cached_property
    def _retentions(self) -> dict[str, RetentionResult]:
        return {}

    def retention(self, condition: str) -> RetentionResult:
        """`condition`: a retained static condition (StaticProfile, LayerPositionMean, StaticTopK) or its label."""
        cond = retained_name(condition, self.units.columns, self.labels)
        if cond not in self._retentions:
            self._retentions[cond] = retention_of(self.units, cond, self.labels, self.criteria, self.level,
                                                  self.n_resamples)
        return self._retentions[cond]

    def mc_lines(self) -> list[str]:
        """Lines on the Monte Carlo SE under the penalties' table (none by default)."""
        return []

    def retentions(self) -> list[RetentionResult]:
        """Retention of every retained static condition in the records (none without the reference)."""
        if protocol.structure_removed(self.units.columns) is None:
            return []
        return [self.retention(c) for c in protocol.retained() if c in self.units.columns]


@dataclass(eq=False)
class WindowStatistics(_Level):
    """One checkpoint's penalties, factor effects and retention from its records, with paired-window bootstrap
    intervals (a window's ΔNLL averaged over randomizations is one unit): stability across evaluation windows, not
    uncertainty across trained checkpoints. Each is computed once. `complete=False`: a partial audit's records."""

    records: pd.DataFrame
    labels: dict[str, str] = field(default_factory=protocol.default_labels)
    criteria: Criteria = field(default_factory=Criteria)
    complete: bool = True
    n_resamples: int = 10000
    level: ClassVar[str] = "window"

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

    def mc_lines(self) -> list[str]:
        """The note on a rough MC SE where a randomized condition has 2 to 9 randomizations (`mc_note`)."""
        counts = self.randomization_means.notna().sum()
        note = mc_note(int(counts.max()) if len(counts) else 0, self.criteria.confidence)
        return [note] if note else []

    @cached_property
    def active(self) -> pd.Series:
        """Mean active sources (experts) per token of each condition."""
        return self.records.groupby("condition")["active"].mean()

    def _bootstrap(self, x) -> Estimate:
        return paired_bootstrap(x, confidence=self.criteria.confidence, n_resamples=self.n_resamples, seed=BOOT_SEED)

    def penalties(self) -> PenaltiesResult:
        return self._penalties

    @cached_property
    def _penalties(self) -> PenaltiesResult:
        rand, names = self.randomization_means, tuple(self.per_window.columns)
        return PenaltiesResult(
            names, tuple(self.labels.get(c, c) for c in names),
            tuple(self._bootstrap(self.per_window[c].dropna().to_numpy()) for c in names),
            np.array([mc_se(rand[c]) for c in names], dtype=float), _nan(len(names)), self.level,
            np.array([float(self.active.get(c, math.nan)) for c in names], dtype=float))

    @property
    def units(self) -> pd.DataFrame:
        return self.per_window

    @cached_property
    def factor_pairs(self) -> dict[str, np.ndarray]:
        """Each factor effect per (window, randomization) pair of cells: the input of its interval and MC SE."""
        return asdict(factor_effects(0.0, *factorial_cells(self._deltas, complete=self.complete)))

    def factor_mc_se(self) -> np.ndarray:
        """The MC SE of each factor effect across randomizations (no bootstrap)."""
        return np.array([mc_se(self.factor_pairs[k].mean(axis=0)) for k in FACTOR_LABELS], dtype=float)

    def factor_effects(self) -> FactorEffectsResult:
        return self._factor_effects

    @cached_property
    def _factor_effects(self) -> FactorEffectsResult:
        names = tuple(FACTOR_LABELS)
        return FactorEffectsResult(
            names, tuple(FACTOR_LABELS.values()),
            tuple(self._bootstrap(self.factor_pairs[k].mean(axis=1)) for k in names), self.factor_mc_se(),
            _nan(3), self.level, _nan(3))



@dataclass(eq=False)
class CheckpointStatistics(_Level):
    """A family's penalties, factor effects and retention across its checkpoints: each checkpoint's mean ΔNLL is one
    unit (percentile bootstrap intervals, two-sided sign-flip p-values, Holm across the three factor effects); the
    MC SE is the mean within-checkpoint one. Each is computed once."""

    members: tuple[WindowStatistics, ...]
    criteria: Criteria
    n_resamples: int = 10000
    family: str = "this family"
    level: ClassVar[str] = "checkpoint"

    @property
    def labels(self) -> dict[str, str]:
        return self.members[0].labels

    @property
    def units(self) -> pd.DataFrame:
        return self.per_checkpoint

    @cached_property
    def per_checkpoint(self) -> pd.DataFrame:
        """Mean ΔNLL per checkpoint (rows) and condition (columns, registry order)."""
        means = pd.DataFrame([m.per_window.mean() for m in self.members]).reset_index(drop=True)
        if means.isna().any().any():
            missing = means.columns[means.isna().any()].tolist()
            raise FcauditError(f"family {self.family!r}: some audits lack conditions {missing}; audit every checkpoint "
                               "with the same conditions")
        return means[sorted(means.columns, key=protocol.order)]

    def _bootstrap(self, x: np.ndarray) -> Estimate:
        return checkpoint_bootstrap(x, confidence=self.criteria.confidence, n_resamples=self.n_resamples,
                                    seed=BOOT_SEED)

    def penalties(self) -> PenaltiesResult:
        return self._penalties

    @cached_property
    def _penalties(self) -> PenaltiesResult:
        means, names = self.per_checkpoint, tuple(self.per_checkpoint.columns)
        records = pd.concat([m.records for m in self.members])
        active = (records.groupby("condition")["active"].mean() if "active" in records else pd.Series(dtype=float))
        return PenaltiesResult(
            names, tuple(self.labels.get(c, c) for c in names),
            tuple(self._bootstrap(means[c].to_numpy()) for c in names),
            np.array([pd.Series([mc_se(m.randomization_means[c]) for m in self.members]).mean() for c in names],
                     dtype=float),
            np.array([(means[c].to_numpy() > 0).sum() for c in names], dtype=float), self.level,
            np.array([float(active.get(c, np.nan)) for c in names], dtype=float))

    def factor_effects(self) -> FactorEffectsResult:
        return self._factor_effects

    @cached_property
    def _factor_effects(self) -> FactorEffectsResult:
        means, roles = self.per_checkpoint, protocol.factorial()
        dc, cs, ds = (means[roles[k]].to_numpy() for k in ("input", "token", "both"))
        fe = factor_effects(np.zeros_like(dc), dc, cs, ds)
        per = [np.asarray(getattr(fe, k), dtype=float) for k in FACTOR_LABELS]
        estimates = tuple(self._bootstrap(x) for x in per)
        return FactorEffectsResult(
            tuple(FACTOR_LABELS), tuple(FACTOR_LABELS.values()), estimates,
            pd.DataFrame([m.factor_mc_se() for m in self.members]).mean().to_numpy(dtype=float),
            np.array([(x > 0).sum() for x in per], dtype=float), self.level,
            holm([e.pvalue for e in estimates]))  # Holm across the three effects
