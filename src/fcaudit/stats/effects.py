"""Intervention penalties (ΔNLL), the factorial effects of Eq. 5-7 and static retention (Eq. 8).

Records are the audit's long table (fcaudit.protocol.RECORD_COLUMNS): one row per (example, condition,
randomization) with the mean NLL per predicted token of that window. Deterministic conditions (Correct, the static
profiles, the reference) have randomization 0 only; randomized conditions have randomizations 0..R-1. The factorial
cells are the conditions whose registered role is input (DC), token (CS) and both (DS); randomization r of DS reuses
the donor mapping of DC r and the permutations of CS r (paired sampling), so cells pair by (example, randomization).
"""

from dataclasses import dataclass

import numpy as np
import pandas as pd

from fcaudit import protocol
from fcaudit.errors import FcauditError

CORRECT = "Correct"
RECORD_COLUMNS = ("example", "condition", "randomization", "nll")  # the columns the statistics read


def _check_records(records: pd.DataFrame) -> None:
    missing = [c for c in RECORD_COLUMNS if c not in records.columns]
    if missing:
        raise FcauditError(f"records lack columns {missing}: pass the frame from fcaudit.auditor.results.load_records(DIR)")
    if records.duplicated(["example", "condition", "randomization"]).any():
        raise FcauditError("records have duplicate (example, condition, randomization) rows: rerun the audit into a fresh directory")
    if not np.isfinite(records["nll"].to_numpy(dtype=np.float64)).all():
        raise FcauditError("records contain non-finite NLL values: check the model's dtype (use float32) and rerun the audit")


def delta_nll(records: pd.DataFrame) -> pd.DataFrame:
    """Each row's NLL minus the Correct NLL of the same example (the paired penalty ΔNLL).

    Returns the non-Correct rows with the original columns plus `delta`; Correct rows are dropped (their ΔNLL is 0
    by definition). Every example must have exactly one Correct row (randomization 0).
    """
    _check_records(records)
    correct = records[records["condition"] == CORRECT]
    if correct.empty:
        raise FcauditError("records have no Correct rows: the audit must evaluate the Correct condition first")
    if (correct["randomization"] != 0).any():
        raise FcauditError("Correct rows must have randomization 0 only: rerun the audit into a fresh directory")
    rest = records[records["condition"] != CORRECT]
    unpaired = sorted(set(rest["example"]) - set(correct["example"]))
    if unpaired:
        raise FcauditError(f"examples {unpaired[:5]} have no Correct row: rerun the audit so every example has one")
    base = correct.set_index("example")["nll"]
    out = rest.copy()
    out["delta"] = out["nll"].to_numpy(np.float64) - base.loc[out["example"]].to_numpy(np.float64)
    return out.reset_index(drop=True)


def _deltas(records: pd.DataFrame) -> pd.DataFrame:
    return records if "delta" in records.columns else delta_nll(records)


def per_example_deltas(records: pd.DataFrame) -> pd.DataFrame:
    """Wide table [example x condition] of ΔNLL averaged over randomizations: the unit for window bootstraps.

    Accepts raw records or the output of `delta_nll`. Averaging over randomizations first makes each window one
    observation, so a window bootstrap resamples windows, not (window, randomization) pairs.
    """
    d = _deltas(records)
    return d.groupby(["example", "condition"])["delta"].mean().unstack("condition").sort_index()


def randomization_means(records: pd.DataFrame) -> pd.DataFrame:
    """Wide table [randomization x condition] of ΔNLL averaged over examples: the input of `mc_se`.

    Deterministic conditions have a value at randomization 0 only (nan below it)."""
    d = _deltas(records)
    return d.groupby(["randomization", "condition"])["delta"].mean().unstack("condition").sort_index()


@dataclass(frozen=True)
class FactorEffects:
    """Paired factorial contrasts (Eq. 5-7); factorial contrasts, not an additive split into mechanisms."""

    input: float | np.ndarray
    token: float | np.ndarray
    interaction: float | np.ndarray


def _scalar_or_array(x: np.ndarray):
    return float(x) if np.ndim(x) == 0 else x


def factor_effects(cc, dc, cs, ds) -> FactorEffects:
    """E_input, E_token, E_interaction (Eq. 5-7), elementwise on scalars or broadcastable arrays.

    cc: correct input and tokens (ΔNLL 0 when the cells are ΔNLLs), dc: changed input donor (CrossInput),
    cs: shuffled tokens (TokenShuffle), ds: both (CrossShuffle).
    """
    cc, dc, cs, ds = (np.asarray(v, dtype=np.float64) for v in (cc, dc, cs, ds))
    e_input = 0.5 * ((dc - cc) + (ds - cs))
    e_token = 0.5 * ((cs - cc) + (ds - dc))
    e_inter = ds - dc - cs + cc
    return FactorEffects(*(_scalar_or_array(e) for e in (e_input, e_token, e_inter)))


@dataclass(frozen=True)
class FactorialCells:
    """Paired CC/DC/CS/DS ΔNLL cells, each [n_examples, R], rows in the order of `examples`."""

    examples: np.ndarray
    cc: np.ndarray
    dc: np.ndarray
    cs: np.ndarray
    ds: np.ndarray

    def effects(self) -> FactorEffects:
        """Per-(example, randomization) factor effects, each [n_examples, R]."""
        return factor_effects(self.cc, self.dc, self.cs, self.ds)


def factorial_cells(records: pd.DataFrame, complete: bool = True) -> FactorialCells:
    """Build paired CC/DC/CS/DS arrays from records: CC = Correct (ΔNLL 0), DC/CS/DS = the conditions registered with
    the roles input/token/both (CrossInput, TokenShuffle, CrossShuffle), paired by example and randomization. The
    three must cover the same examples and the same randomizations (complete, balanced design); with
    `complete=False` (a partial audit) only the (example, randomization) pairs all three have are used."""
    d = _deltas(records)
    roles = protocol.factorial()
    cells = {}
    for name in (roles["input"], roles["token"], roles["both"]):
        sub = d[d["condition"] == name]
        if sub.empty:
            raise FcauditError(f"records have no {name} rows: run the audit with the randomized conditions enabled")
        cells[name] = sub.pivot(index="example", columns="randomization", values="delta").sort_index().sort_index(axis=1)
    if not complete:
        rows = sorted(set.intersection(*(set(w.dropna(how="any").index) for w in cells.values())))
        cols = sorted(set.intersection(*(set(w.dropna(how="any", axis=0).columns) for w in cells.values())))
        cells = {k: w.reindex(index=rows, columns=cols) for k, w in cells.items()}
        if not rows or not cols:
            raise FcauditError("the partial records hold no (example, randomization) pair of all three factorial "
                               "conditions; rerun the audit to finish it")
    ref = cells[roles["input"]]
    for name, wide in cells.items():
        if not (wide.index.equals(ref.index) and wide.columns.equals(ref.columns)) or wide.isna().any().any():
            raise FcauditError(
                f"{name} does not cover the same examples and randomizations as {roles['input']}: "
                "rerun the audit so all randomized conditions are complete"
            )
    dc, cs, ds = (w.to_numpy(np.float64) for w in cells.values())
    return FactorialCells(examples=ref.index.to_numpy(), cc=np.zeros_like(dc), dc=dc, cs=cs, ds=ds)


def retention(delta_static, delta_reference):
    """Static retention 1 - ΔNLL(S)/ΔNLL(R) (Eq. 8), elementwise; 1 = the static profile keeps all performance
    that removing the structure (reference R) loses.

    A reference with ΔNLL(R) <= 0 gives nan: retention is the share of the Correct-to-R gap that S closes, and with
    no positive gap there is nothing to retain; the ratio would be undefined (0) or flip sign (< 0). This is the
    formula only: the estimates (stats.inference.retention_bootstrap) also require the reference's interval to lie
    above the criteria's practically-small bound. Always report retention beside the absolute ΔNLL, and only within
    one model and evaluation set.
    """
    s = np.asarray(delta_static, dtype=np.float64)
    r = np.asarray(delta_reference, dtype=np.float64)
    s, r = np.broadcast_arrays(s, r)
    bad = ~(r > 0)
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.where(bad, np.nan, 1.0 - s / np.where(bad, 1.0, r))
    return _scalar_or_array(out)
