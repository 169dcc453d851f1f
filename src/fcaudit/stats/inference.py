"""Inference for FCA penalties (paper section 4.1), at two levels never mixed: within one checkpoint, paired-window
bootstrap intervals and the Monte Carlo SE across randomizations (the stability of *that* checkpoint, not uncertainty
across trained models); across checkpoints (trained seeds are the units), percentile bootstrap CIs of the mean, the
exact two-sided sign-flip test, Holm correction across the three factorial effects, and retention intervals."""

import math
import warnings
from dataclasses import dataclass, replace
from typing import Callable, NamedTuple

import numpy as np
from scipy import stats
from statsmodels.stats.multitest import multipletests

from fcaudit.errors import FcauditError
from fcaudit.io import finite_json
from fcaudit.protocol import Criteria
from fcaudit.stats.effects import retention

# scipy materialises n_resamples x n values per batch; cap that so large window sets stay in memory
_MAX_BATCH_ELEMENTS = 1 << 22


class ConfidenceInterval(NamedTuple):
    low: float
    high: float


@dataclass(frozen=True)
class Estimate:
    """A point estimate with its interval, like scipy.stats result objects (prints usefully, converts to JSON).

    Its fields are the columns of every result table: `statistic`, `confidence_interval.low` / `.high` (`ci_low`,
    `ci_high`), `pvalue` (nan where there is no test) and `n` (the units resampled).

    Examples
    --------
    >>> from fcaudit.stats.inference import checkpoint_bootstrap
    >>> est = checkpoint_bootstrap([0.5, 0.7, 0.6, 0.8, 0.9], n_resamples=1000)
    >>> est.statistic, est.n, est.pvalue
    (0.7, 5, 0.0625)
    >>> sorted(est.to_dict())
    ['ci_high', 'ci_low', 'confidence_level', 'method', 'n', 'pvalue', 'statistic']
    """

    statistic: float
    confidence_interval: ConfidenceInterval
    pvalue: float = math.nan
    n: int = 0
    method: str = ""
    confidence_level: float = 0.95

    @property
    def has_interval(self) -> bool:
        return bool(np.isfinite(self.confidence_interval.low) and np.isfinite(self.confidence_interval.high))

    def to_dict(self) -> dict:
        """JSON-ready, with the result tables' names; nan becomes None."""
        low, high = self.confidence_interval
        return finite_json({"statistic": float(self.statistic), "ci_low": float(low), "ci_high": float(high),
                            "pvalue": float(self.pvalue), "n": int(self.n), "method": self.method,
                            "confidence_level": float(self.confidence_level)})

    def __str__(self) -> str:
        low, high = self.confidence_interval
        ci = f"[{low:.6g}, {high:.6g}] {self.confidence_level:.0%} CI" if self.has_interval else "no interval"
        p = f", p={self.pvalue:.4g}" if math.isfinite(self.pvalue) else ""
        return f"{self.statistic:.6g} {ci} (n={self.n}{p}; {self.method})"


def _sample(x, name: str = "x") -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    if x.ndim != 1 or x.size == 0:
        raise FcauditError(f"{name} must be a non-empty 1-D array of values (one per window or checkpoint), got shape {x.shape}")
    if not np.isfinite(x).all():
        raise FcauditError(f"{name} contains nan or inf: drop failed windows/checkpoints before inference")
    return x


def _percentile_bootstrap(data: tuple, statistic: Callable, confidence: float, n_resamples: int,
                          seed) -> ConfidenceInterval:
    """scipy.stats.bootstrap, percentile method, vectorized (the confidence is a Criteria's, checked there)."""
    res = stats.bootstrap(data, statistic, n_resamples=int(n_resamples), vectorized=True, paired=len(data) > 1,
                          batch=max(1, _MAX_BATCH_ELEMENTS // len(data[0])), confidence_level=confidence,
                          method="percentile", rng=np.random.default_rng(seed))  # a Generator passes through
    return ConfidenceInterval(float(res.confidence_interval.low), float(res.confidence_interval.high))


def _mean_estimate(x, confidence, n_resamples, seed, unit: str) -> Estimate:
    x = _sample(x)
    if x.size < 2:
        return Estimate(float(x.mean()), ConfidenceInterval(math.nan, math.nan), math.nan, 1,
                        f"single {unit}: no interval", confidence)
    ci = _percentile_bootstrap((x,), np.mean, confidence, n_resamples, seed)
    method = f"percentile bootstrap of the mean over {x.size} {unit}s ({n_resamples} resamples)"
    return Estimate(float(x.mean()), ci, math.nan, int(x.size), method, confidence)


def paired_bootstrap(x, confidence: float = 0.95, n_resamples: int = 10000, seed=0) -> Estimate:
    """Percentile bootstrap CI of the mean over evaluation windows of one checkpoint, `x` one paired ΔNLL (or factor
    effect) per window averaged over randomizations: descriptive of window stability only (Table 2 of the paper)."""
    return _mean_estimate(x, confidence, n_resamples, seed, "window")


def mc_se(randomization_means) -> float:
    """Monte Carlo SE of a randomized condition: sd (ddof=1) of the R randomization means / sqrt(R); nan for R < 2.
    nan entries are dropped: a deterministic condition's column of mean_deltas(..., "randomization") gives nan."""
    r = np.asarray(randomization_means, dtype=np.float64).ravel()
    r = r[~np.isnan(r)]
    return float(np.std(r, ddof=1) / math.sqrt(r.size)) if r.size >= 2 else math.nan


MC_ROUGH_BELOW = 10  # fewer randomizations: the MC SE rests on under 9 degrees of freedom and is itself rough
PAPER_RANDOMIZATIONS = 20  # the randomizations behind the paper's intervals


def mc_interval(randomization_means, confidence: float = 0.95) -> Estimate:
    """The mean over R randomizations with its Monte Carlo interval, mean ± t(R - 1) × MC SE: the t quantile, not
    the normal one, since the SE is itself estimated from R values (with R = 4, t = 3.18 against 1.96 at 95%). No
    interval for R < 2. It measures the randomizations' noise in *this* audit, not uncertainty across windows."""
    r = np.asarray(randomization_means, dtype=np.float64).ravel()
    r = r[~np.isnan(r)]
    if r.size < 2:
        return Estimate(float(r.mean()) if r.size else math.nan, ConfidenceInterval(math.nan, math.nan), math.nan,
                        int(r.size), "single randomization: no Monte Carlo interval", confidence)
    half = float(stats.t.ppf((1 + confidence) / 2, r.size - 1)) * mc_se(r)
    return Estimate(float(r.mean()), ConfidenceInterval(float(r.mean()) - half, float(r.mean()) + half), math.nan,
                    int(r.size), f"t interval over {r.size} randomizations ({r.size - 1} degrees of freedom)",
                    confidence)


def mc_note(randomizations: int, confidence: float = 0.95) -> str | None:
    """A notice for an audit of 2 to MC_ROUGH_BELOW - 1 randomizations: its MC SE is rough, and the interval it
    gives takes the t quantile of R - 1 degrees of freedom (None otherwise: with one there is no MC SE)."""
    if not 2 <= randomizations < MC_ROUGH_BELOW:
        return None
    t = float(stats.t.ppf((1 + confidence) / 2, randomizations - 1))
    return (f"note: R = {randomizations} randomizations: the MC SE rests on {randomizations - 1} degrees of freedom "
            f"and is rough (it can be several times off); a {confidence:.0%} Monte Carlo interval is ± {t:.2f} × MC "
            f"SE (t quantile), not ± {float(stats.norm.ppf((1 + confidence) / 2)):.2f} ×; the paper's intervals use "
            f"R = {PAPER_RANDOMIZATIONS} (--randomizations {PAPER_RANDOMIZATIONS})")


def checkpoint_bootstrap(x, confidence: float = 0.95, n_resamples: int = 10000, seed=0) -> Estimate:
    """Percentile bootstrap CI of the mean over independently trained checkpoints (the unit of inference), with the
    two-sided p-value of `sign_flip_test`. One checkpoint gives no interval and no p-value: one model says nothing
    about variation across seeds. With few, the interval is coarse: report n."""
    est = _mean_estimate(x, confidence, n_resamples, seed, "checkpoint")
    if est.n >= 2:
        est = replace(est, pvalue=sign_flip_test(x, seed=seed),
                      method=est.method + f"; {sign_flip_kind(est.n)} two-sided sign-flip p-value")
    return est


SIGN_FLIP_EXACT_MAX_N = 20  # up to 2^20 sign patterns are enumerated; beyond, a Monte Carlo sample of them


def sign_flip_kind(n: int) -> str:
    """How `sign_flip_test` computes the p-value of n checkpoints: "exact" or "Monte Carlo"."""
    return "exact" if n <= SIGN_FLIP_EXACT_MAX_N else "Monte Carlo"


def sign_flip_test(x, n_resamples: int = 100_000, seed=0) -> float:
    """Two-sided sign-flip (one-sample permutation) test of mean 0: the fraction of sign patterns whose |mean| >= the
    observed one (ties within a relative 1e-12 count). Exact over all 2^n patterns up to SIGN_FLIP_EXACT_MAX_N (7
    positive values give 2/128); above, n_resamples random patterns with p = (1 + hits) / (1 + n_resamples), as scipy
    does."""
    x = _sample(x)
    n = x.size
    observed = abs(x.sum())  # the sum orders patterns the same as the mean
    tol = 1e-12 * max(observed, np.abs(x).sum())
    exact = n <= SIGN_FLIP_EXACT_MAX_N
    if exact:  # the patterns are the bits of 0 .. 2^n - 1, 2^16 of them at a time
        total, bits, chunk = 1 << n, np.arange(n, dtype=np.int64), 1 << 16
        batches = (1.0 - 2.0 * ((np.arange(start, min(start + chunk, total), dtype=np.int64)[:, None] >> bits) & 1)
                   for start in range(0, total, chunk))
    else:
        rng, batch = np.random.default_rng(seed), max(1, _MAX_BATCH_ELEMENTS // n)
        batches = (rng.choice(np.array([-1.0, 1.0]), size=(min(batch, n_resamples - done), n))
                   for done in range(0, n_resamples, batch))
    hits = sum(int(np.count_nonzero(np.abs(signs @ x) >= observed - tol)) for signs in batches)
    return hits / total if exact else (1 + hits) / (1 + n_resamples)


def holm(pvalues) -> np.ndarray:
    """Holm-adjusted p-values (statsmodels multipletests, method="holm"); nan entries stay nan and are not counted."""
    p = np.asarray(pvalues, dtype=np.float64)
    out = np.full(p.shape, np.nan)
    ok = np.isfinite(p)
    if (p[ok] < 0).any() or (p[ok] > 1).any():
        raise FcauditError("p-values must lie in [0, 1]: pass raw p-values, not statistics")
    if ok.any():
        out[ok] = multipletests(p[ok], method="holm")[1]
    return out


def retention_bootstrap(delta_static, delta_reference, criteria: Criteria | None = None, n_resamples: int = 10000,
                        seed=0, unit: str = "checkpoint") -> Estimate:
    """Retention 1 - mean(S)/mean(R) (a fraction) with a percentile bootstrap CI, resampling the (ΔNLL(S), ΔNLL(R))
    pairs of `unit`s jointly: "checkpoint" (the primary analysis) or "window" (descriptive, like Table 2). Retention
    of the means: a mean of per-unit ratios explodes for units with a small reference gap.

    Eq. 8 means something only where removing the structure costs more than a negligible amount: unless the interval
    of the reference's mean ΔNLL (as its penalty's) lies above `criteria.small_upper` (and 0), retention is undefined:
    nan, with the reason in `method`. A single unit has no such interval, so its retention is undefined too."""
    criteria = criteria or Criteria()
    s, r = _sample(delta_static, "delta_static"), _sample(delta_reference, "delta_reference")
    if s.shape != r.shape:
        raise FcauditError(f"delta_static and delta_reference must pair the same {unit}s, got {s.size} and {r.size}")
    confidence, bound = criteria.confidence, max(criteria.small_upper, 0.0)
    nan = ConfidenceInterval(math.nan, math.nan)
    ref = _mean_estimate(r, confidence, n_resamples, seed, unit)
    lo, hi = ref.confidence_interval
    if not (ref.has_interval and lo > bound):
        why = (f"the reference ΔNLL {r.mean():.3g} has {100 * confidence:g}% interval [{lo:.3g}, {hi:.3g}], not above "
               f"the practically-small bound {bound:g}" if ref.has_interval
               else f"a single {unit} gives the reference ΔNLL no interval")
        return Estimate(math.nan, nan, math.nan, int(s.size), why, confidence)
    point = float(retention(s.mean(), r.mean()))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        ci = _percentile_bootstrap((s, r), lambda a, b, axis=-1: retention(a.mean(axis), b.mean(axis)), confidence,
                                   n_resamples, seed)
    level = "checkpoints" if unit == "checkpoint" else "windows (paired)"
    method = f"percentile bootstrap of the retention of means over {s.size} {level} ({n_resamples} resamples)"
    if not (np.isfinite(ci.low) and np.isfinite(ci.high)):  # a resample with mean reference <= 0
        ci, method = nan, method + "; interval undefined: some resamples have a reference ΔNLL <= 0"
    return Estimate(point, ci, math.nan, int(s.size), method, confidence)
