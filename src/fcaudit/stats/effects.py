"""Intervention penalties (ΔNLL), the factorial effects of Eq. 5-7 and static retention (Eq. 8), from the audit's
records: one row per (example, condition, randomization) with the window's mean NLL per predicted token (randomization
0 only for a deterministic condition). The factorial cells are the conditions registered as input (DC), token (CS)
and both (DS); DS r reuses DC r's donors and CS r's permutations, so cells pair by (example, randomization)."""

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
    """The non-Correct rows with `delta`: their NLL minus the Correct NLL of the same example (the paired penalty
    ΔNLL). Every example must have exactly one Correct row (randomization 0)."""
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
    """Wide table [example x condition] of ΔNLL (from records or `delta_nll`'s rows) averaged over randomizations:
    each window is one observation, so a window bootstrap resamples windows, not (window, randomization) pairs."""
    d = _deltas(records)
    return d.groupby(["example", "condition"])["delta"].mean().unstack("condition").sort_index()


def randomization_means(records: pd.DataFrame) -> pd.DataFrame:
    """Wide table [randomization x condition] of ΔNLL averaged over examples: the input of `mc_se` (deterministic
    conditions have randomization 0 only)."""
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
    """E_input, E_token, E_interaction (Eq. 5-7), elementwise: cc correct input and tokens (ΔNLL 0), dc another input's
    (CrossInput), cs shuffled tokens (TokenShuffle), ds both (CrossShuffle)."""
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
    """Static retention 1 - ΔNLL(S)/ΔNLL(R) (Eq. 8), elementwise: the share of the Correct-to-R gap that S closes,
    nan where ΔNLL(R) <= 0 (no gap to retain). The formula only: `inference.retention_bootstrap` also requires the
    reference's interval above the practically-small bound. Report it beside the absolute ΔNLLs."""
    s = np.asarray(delta_static, dtype=np.float64)
    r = np.asarray(delta_reference, dtype=np.float64)
    s, r = np.broadcast_arrays(s, r)
    bad = ~(r > 0)
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.where(bad, np.nan, 1.0 - s / np.where(bad, 1.0, r))
    return _scalar_or_array(out)
