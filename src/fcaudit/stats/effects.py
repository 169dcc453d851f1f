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


def delta_nll(records: pd.DataFrame) -> pd.DataFrame:
    """The non-Correct rows with `delta`: their NLL minus the Correct NLL of the same example (the paired penalty
    ΔNLL). Every example must have exactly one Correct row (randomization 0)."""
    if missing := [c for c in ("example", "condition", "randomization", "nll") if c not in records.columns]:
        raise FcauditError(f"records lack columns {missing}: pass the frame from fcaudit.auditor.results.load_records(DIR)")
    if records.duplicated(["example", "condition", "randomization"]).any():
        raise FcauditError("records have duplicate (example, condition, randomization) rows: rerun the audit into a fresh directory")
    if not (finite := np.isfinite(records["nll"].to_numpy(dtype=np.float64))).all():
        bad = records[~finite].iloc[0]  # the audit refuses these as it runs: records edited or written elsewhere
        raise FcauditError(f"records contain non-finite NLL values (first: window {bad['example']}, "
                           f"{bad['condition']} r{bad['randomization']}): statistics need a finite NLL in every row; "
                           "audit the model with fcaudit.audit, which names the condition where its NLL is not finite")
    correct = records[records["condition"] == CORRECT]
    if correct.empty:
        raise FcauditError("records have no Correct rows: the audit must evaluate the Correct condition first")
    if (correct["randomization"] != 0).any():
        raise FcauditError("Correct rows must have randomization 0 only: rerun the audit into a fresh directory")
    rest = records[records["condition"] != CORRECT]
    if unpaired := sorted(set(rest["example"]) - set(correct["example"])):
        raise FcauditError(f"examples {unpaired[:5]} have no Correct row: rerun the audit so every example has one")
    base = correct.set_index("example")["nll"].loc[rest["example"]].to_numpy(np.float64)
    return rest.assign(delta=rest["nll"].to_numpy(np.float64) - base).reset_index(drop=True)


def mean_deltas(records: pd.DataFrame, by: str) -> pd.DataFrame:
    """ΔNLL (of records, or of `delta_nll`'s rows) averaged into a wide table [`by` x condition]: by "example", one
    observation per window (what a window bootstrap resamples), or by "randomization", the input of `mc_se`."""
    d = records if "delta" in records.columns else delta_nll(records)
    return d.groupby([by, "condition"])["delta"].mean().unstack("condition").sort_index()


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


def factorial_cells(records: pd.DataFrame, complete: bool = True) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The paired ΔNLL cells (DC, CS, DS), each [example (sorted), randomization], of the conditions registered with
    the roles input/token/both (CrossInput, TokenShuffle, CrossShuffle; CC is Correct, ΔNLL 0). The three must cover
    the same examples and randomizations (a complete, balanced design); with `complete=False` (a partial audit) only
    the examples all three have at every randomization are used."""
    d = records if "delta" in records.columns else delta_nll(records)
    roles = protocol.factorial()
    cells = {}
    for name in (roles["input"], roles["token"], roles["both"]):
        sub = d[d["condition"] == name]
        if sub.empty:
            raise FcauditError(f"records have no {name} rows: run the audit with the randomized conditions enabled")
        cells[name] = sub.pivot(index="example", columns="randomization", values="delta").sort_index().sort_index(axis=1)
    if not complete:
        rows = sorted(set.intersection(*(set(w.dropna(how="any").index) for w in cells.values())))
        cols = sorted(set.intersection(*(set(w.columns) for w in cells.values())))
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
    return tuple(w.to_numpy(np.float64) for w in cells.values())


def retention(delta_static, delta_reference):
    """Static retention 1 - ΔNLL(S)/ΔNLL(R) (Eq. 8), elementwise: the share of the Correct-to-R gap that S closes,
    nan where ΔNLL(R) <= 0 (no gap to retain). The formula only: `inference.retention_bootstrap` also requires the
    reference's interval above the practically-small bound. Report it beside the absolute ΔNLLs."""
    s, r = np.asarray(delta_static, dtype=np.float64), np.asarray(delta_reference, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        return _scalar_or_array(np.where(r > 0, 1.0 - s / r, np.nan))
