"""From audits to the paper's evidence (`fcaudit summarize`), at two levels never mixed (paper §4.1): across a
family's checkpoints (training seeds are the units: bootstrap CIs, exact sign-flip tests, Holm across the three factor
effects), or, for a family of one checkpoint, window-level intervals labelled so everywhere. Pooled checkpoints must be
independent and audited alike; the prespecified criteria are read from each audit's config.json.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pandas as pd

from fcaudit import protocol
from fcaudit.auditor.results import AuditResult, notice_lines, routing_lines
from fcaudit.errors import FcauditError
from fcaudit.io import atomic_write, claim_out, finite_json, read_json, write_json
from fcaudit.protocol import Criteria
from fcaudit.stats.effects import factor_effects
from fcaudit.stats.inference import checkpoint_bootstrap, holm, mc_se
from fcaudit.stats.results import (BOOT_SEED, FACTOR_LABELS as FACTORS, RetentionResult, WindowStatistics, retention_of,
                                   retention_value)

WINDOW_LEVEL = "window-level (one checkpoint)"

WINDOW_NOTE = ("n = 1 checkpoint: intervals are paired-window bootstrap intervals; they describe stability across "
               "evaluation windows (and MC SE the randomization error) for this checkpoint, not uncertainty across "
               "independently trained checkpoints.")
CHECKPOINT_NOTE = ("Training seeds are the units: intervals are percentile bootstrap CIs over checkpoints, p-values "
                   "two-sided sign-flip tests over checkpoints (exact up to 20 checkpoints, Monte Carlo above); MC SE "
                   "is the mean within-checkpoint randomization error.")
FEW_CHECKPOINTS = 5
FEW_NOTE = (" With {n} checkpoints the intervals are coarse (with 2, the range of the two) and no p-value can be "
            "below {p:.3g}: read the criteria with that in mind.")
PARTIAL_NOTE = "PARTIAL: at least one audit of this family is unfinished; its numbers cover only finished units."


def met_word(met: bool | None) -> str:
    """A criterion's verdict in words (None: the number it needs does not exist)."""
    return {True: "met", False: "not met"}.get(met, "not evaluable")


def _retention_rows(results: list[RetentionResult], family: str) -> list[dict]:
    return [{"family": family, "condition": r.condition, "label": r.label, "reference": r.reference,
             "reference_label": r.reference_label, "level": r.level, "n": r.n, "retention": float(r.statistic),
             "ci_low": float(r.confidence_interval.low), "ci_high": float(r.confidence_interval.high),
             "delta_nll": r.delta_static, "reference_delta_nll": r.delta_reference, "bound": r.bound, "note": r.note}
            for r in results]


_COLUMNS = {
    "conditions": ["family", "condition", "label", "level", "n", "mean", "ci_low", "ci_high", "pvalue", "n_positive",
                   "mc_se", "active"],
    "factors": ["family", "effect", "label", "level", "n", "mean", "ci_low", "ci_high", "pvalue", "pvalue_holm",
                "n_positive"],
    "retention": ["family", "condition", "label", "reference", "reference_label", "level", "n", "retention", "ci_low",
                  "ci_high", "delta_nll", "reference_delta_nll", "bound", "note"],
}
_TEXT = {"family", "condition", "label", "level", "effect", "reference", "reference_label", "note"}
COUNTS = ("n", "n_positive")  # counts, nan where undefined: float columns in pandas


def csv_frame(df: pd.DataFrame) -> pd.DataFrame:
    """`df` as its CSV is written: counts as integers (5, not 5.0; empty where undefined)."""
    return df.astype({c: "Int64" for c in COUNTS if c in df.columns})


def _frame(rows: list[dict], kind: str) -> pd.DataFrame:
    df = pd.DataFrame(rows, columns=_COLUMNS[kind])
    if "note" in df.columns:
        df["note"] = df["note"].fillna("").astype(str)
    # numbers stay numeric even when a column is all missing (JSON null) after a round trip
    return df.astype({c: "float64" for c in df.columns if c not in _TEXT and c != "n"})


def _window_level(stats: WindowStatistics, family: str):
    """(conditions, factors, retention) frames of one checkpoint's windows (no p-values: no units for a test)."""
    conds = stats.penalties().to_frame().assign(family=family, level="window")
    facs = pd.DataFrame()
    if stats.has_factorial:
        fe = stats.factor_effects().to_frame().reset_index()
        facs = fe.assign(family=family, label=fe["effect"].map(FACTORS), level="window")
    return (_frame(conds.to_dict("records"), "conditions"), _frame(facs.to_dict("records"), "factors"),
            _frame(_retention_rows(stats.retentions(), family), "retention"))


def _over_checkpoints(x: np.ndarray, confidence: float, **row) -> dict:
    """A table row of checkpoint-level inference on one value per checkpoint: bootstrap CI, exact sign-flip p."""
    est = checkpoint_bootstrap(x, confidence=confidence, seed=BOOT_SEED)
    return {**row, "level": "checkpoint", "n": len(x), "mean": float(x.mean()),
            "ci_low": float(est.confidence_interval.low), "ci_high": float(est.confidence_interval.high),
            "pvalue": float(est.pvalue), "n_positive": int((x > 0).sum())}


def _checkpoint_level(members: list[WindowStatistics], criteria: Criteria, family: str):
    """(conditions, factors, retention) frames of one family's checkpoints: each checkpoint's mean ΔNLL is one unit."""
    labels, confidence = members[0].labels, criteria.confidence
    means = pd.DataFrame([m.per_window.mean() for m in members]).reset_index(drop=True)  # checkpoints x conditions
    if means.isna().any().any():
        missing = means.columns[means.isna().any()].tolist()
        raise FcauditError(f"family {family!r}: some audits lack conditions {missing}; audit every checkpoint with "
                           "the same conditions")
    means = means[sorted(means.columns, key=protocol.order)]
    active = pd.concat([m.records for m in members]).groupby("condition")["active"].mean()
    conds = [_over_checkpoints(means[c].to_numpy(), confidence, family=family, condition=c, label=labels.get(c, c),
                               mc_se=float(pd.Series([mc_se(m.randomization_means[c]) for m in members]).mean()),
                               active=float(active.get(c, np.nan))) for c in means.columns]
    facs = []
    roles = protocol.factorial()
    if all(c in means.columns for c in roles.values()):
        dc, cs, ds = (means[roles[k]].to_numpy() for k in ("input", "token", "both"))
        fe = factor_effects(np.zeros_like(dc), dc, cs, ds)
        facs = [_over_checkpoints(np.asarray(getattr(fe, k), dtype=float), confidence, family=family, effect=k,
                                  label=name) for k, name in FACTORS.items()]
        for f, p in zip(facs, holm([f["pvalue"] for f in facs])):  # Holm across the three effects
            f["pvalue_holm"] = float(p)
    rets = []
    if protocol.structure_removed(means.columns) is not None:
        rets = _retention_rows([retention_of(means, c, labels, criteria, "checkpoint") for c in protocol.retained()
                                if c in means.columns], family)
    return _frame(conds, "conditions"), _frame(facs, "factors"), _frame(rets, "retention")


def verdicts(conditions: pd.DataFrame, retention: pd.DataFrame, criteria: Criteria, *, family: str,
             fixed_at: str | None, source: str) -> list[dict]:
    """The two prespecified verdicts for one family (None where the needed number does not exist)."""
    pct = f"{100 * criteria.confidence:g}%"
    out = []
    for name, table, quantity, side, threshold, rule in (
            ("practically small", conditions, "ΔNLL", "ci_high", criteria.small_upper,
             f"upper {pct} bound of the StaticProfile ΔNLL < {criteria.small_upper:g}"),
            ("high retention", retention, "retention", "ci_low", criteria.retention_lower,
             f"lower {pct} bound of the StaticProfile retention > {100 * criteria.retention_lower:g}%")):
        rows = table[table["condition"] == "StaticProfile"]
        row = rows.iloc[0] if len(rows) else {side: math.nan, "label": "StaticProfile", "level": None}
        bound, finite = float(row[side]), math.isfinite(row[side])
        out.append({"family": family, "name": name, "quantity": f"StaticProfile {quantity}", "label": row["label"],
                    "rule": rule, "threshold": threshold, "bound": bound if finite else None,
                    "met": (bound < threshold if side == "ci_high" else bound > threshold) if finite else None,
                    "level": WINDOW_LEVEL if row["level"] == "window" else row["level"],
                    "criteria": criteria.to_dict(), "fixed_in_advance": source == "config.json", "fixed_at": fixed_at,
                    "source": source})
    return out


def family_of(config: dict) -> str:
    """The family an audit's checkpoint belongs to (checkpoints of one family differ only by training seed): the
    model.family the audit wrote, else the model's class and size. The one reader of the family name."""
    model = config["model"]
    return str(model.get("family") or f"{model['class']} {model['n_params'] / 1e6:.3g}M params")


def _alike(config: dict) -> dict:
    """What every audit pooled into one family must share: windows, corpus, R, criteria, conditions."""
    corpus = config["model"].get("corpus") or {}
    return {"windows": config.get("windows") or {},
            "corpus": corpus.get("fingerprint", corpus) if isinstance(corpus, dict) else corpus,
            "randomizations": config.get("randomizations"),
            "criteria": {k: v for k, v in (config.get("criteria") or {}).items() if k != "fixed_at"},
            "conditions": config.get("conditions")}


def _one_audit_per_checkpoint(audits: list[AuditResult]) -> None:
    """Across all families: a checkpoint relabelled with another family is still the same checkpoint (audited
    through another controller, e.g. MoD's top-k router and its causal predictor, it is another model)."""
    seen: dict[tuple, Path] = {}
    for a in audits:
        if params := a.config["model"].get("params_sha256"):
            h = (params, str((a.config.get("controller") or {}).get("description")))
            if h in seen:
                raise FcauditError(f"{seen[h]} and {a.path} audit the same checkpoint (equal parameters, whatever "
                                   "their family labels): pass one audit per independently trained checkpoint")
            seen[h] = a.path


def _check_pool(family: str, members: list[AuditResult]) -> None:
    first = _alike(members[0].config)
    for a in members[1:]:
        if diff := sorted(k for k, v in _alike(a.config).items() if v != first[k]):
            raise FcauditError(f"family {family!r}: {members[0].path} and {a.path} were audited differently "
                               f"({', '.join(diff)}); audit every checkpoint of a family alike")


def _criteria_of(audits: list[AuditResult], family: str) -> tuple[Criteria, str | None, str]:
    """The family's criteria, when they were fixed (the latest stamp) and where they come from."""
    if all(a.config.get("criteria") is None for a in audits):
        return Criteria(), None, "defaults (not found in the audit config: NOT fixed in advance)"
    if any(a.config.get("criteria") is None or a.criteria != audits[0].criteria for a in audits):
        raise FcauditError(f"family {family!r}: audits were run with different criteria; audit all checkpoints with "
                           "the same criteria")
    stamps = [t for a in audits if (t := a.config["criteria"].get("fixed_at") or a.config.get("created_at"))]
    return audits[0].criteria, max(stamps, default=None), "config.json"


@dataclass
class Summary:
    """What `fca.summarize` returns: checkpoint-level (for n = 1, window-level) results of every model family.

    `str(summary)` is the table `fcaudit summarize` prints. `conditions`, `factors` and `retention` hold one row per
    family and quantity, `criteria` each family's verdicts, `groups` per family its checkpoints, the level of its
    intervals and its audits; `summary.family(name)` gathers one family's."""

    conditions: pd.DataFrame
    factors: pd.DataFrame
    retention: pd.DataFrame
    criteria: list[dict]
    groups: dict[str, dict]  # family -> n_checkpoints, level, note, labels, audits, variation, partial

    def family(self, name: str) -> dict:
        """One family's rows of each table and its group entries; "replay" holds the replay records that exist."""
        g = {"audits": [], "variation": [], "partial": False, "confidence": 0.95, **self.groups[name]}
        return {"conditions": self.conditions[self.conditions["family"] == name],
                "factors": self.factors[self.factors["family"] == name],
                "retention": self.retention[self.retention["family"] == name],
                "criteria": [c for c in self.criteria if c["family"] == name], **g,
                "replay": [r for r in g.get("replay", []) if isinstance(r, dict)]}

    def __str__(self) -> str:
        lines = []
        for fam in self.groups:
            g = self.family(fam)
            level = "checkpoint-level" if g["level"] == "checkpoint" else WINDOW_LEVEL
            lines.append(f"{fam}: {g['n_checkpoints']} checkpoint(s), {level} intervals"
                         + ("  [PARTIAL]" if g["partial"] else ""))
            # the audits' notices, and for routers the causality check above 0 and the token note, once per family
            lines += [f"  {line}" for line in dict.fromkeys(line for r in g["replay"]
                                                          for line in (*notice_lines(r), *routing_lines(r)))]
            lines += [f"  {r.label:<22} ΔNLL {r.mean:+.6g} [{r.ci_low:+.6g}, {r.ci_high:+.6g}]"
                      + ("" if pd.isna(r.pvalue) else f"  p={r.pvalue:.4g} ({int(r.n_positive)}/{int(r.n)} > 0)")
                      for r in g["conditions"].itertuples()]
            lines += [f"  retention {r.label} vs {r.reference_label}: "
                      f"{retention_value(r.retention, r.ci_low, r.ci_high, r.note)}; "
                      f"ΔNLL {r.delta_nll:.4g} vs {r.reference_delta_nll:.4g}" for r in g["retention"].itertuples()]
            lines += [f"  criterion '{v['name']}' ({v['rule']}; {v['level'] or 'no interval'}): {met_word(v['met'])}"
                      for v in g["criteria"]]
        return "\n".join(lines)

    def to_dict(self) -> dict:
        # full precision (to_json rounds to 10 digits), nan as None
        tables = {k: finite_json(getattr(self, k).to_dict(orient="records")) for k in _COLUMNS}
        return {"groups": self.groups, **tables, "criteria": self.criteria}

    def save(self, out: str | Path) -> Path:
        """Write summary.json, the CSV tables and criteria.json into `out`, a summary directory of fcaudit.io's
        rule (new, empty, or an earlier summary's)."""
        out = claim_out(out, "summary")
        write_json(out / "summary.json", self.to_dict())
        for name in _COLUMNS:
            atomic_write(out / f"{name}.csv", lambda p, df=getattr(self, name): csv_frame(df).to_csv(p, index=False))
        write_json(out / "criteria.json", self.criteria)
        return out

    @classmethod
    def load(cls, path: str | Path) -> "Summary":
        path = Path(path)
        if not (path / "summary.json").is_file():
            raise FcauditError(f"{path} has no summary.json; create it with `fcaudit summarize AUDIT_DIR... --out {path}`")
        try:
            d = read_json(path / "summary.json")
            return cls(*(_frame(d[k], k) for k in _COLUMNS), d["criteria"], d["groups"])
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise FcauditError(f"{path / 'summary.json'} is not a summary written by fcaudit ({type(e).__name__}); "
                               f"recreate it with `fcaudit summarize AUDIT_DIR... --out {path}`") from None


def summarize(audit_dirs: Sequence[Any], out: str | Path | None = None, allow_partial: bool = False) -> Summary:
    """The paper's evidence from several audits: checkpoint-level inference per model family.

    Audits are grouped by config.json's `model.family`; within a family the training seeds are the units (bootstrap
    intervals, exact sign-flip tests, Holm across the three factor effects), and each family is judged against its
    prespecified criteria. A family of one checkpoint falls back to window-level intervals and says so everywhere.

    Parameters
    ----------
    audit_dirs
        Audit directories or `AuditResult`s; each checkpoint once, those of one family audited alike (windows,
        corpus, randomizations, criteria).
    out
        Where to write summary.json, conditions.csv, factors.csv, retention.csv and criteria.json (atomically);
        None writes nothing.
    allow_partial
        Read unfinished audits (their results are marked partial) instead of refusing them.

    Returns
    -------
    Summary
        Its `str()` is the table `fcaudit summarize` prints; `.conditions`, `.factors` and `.retention` are
        DataFrames with a `family` column.

    Examples
    --------
    With `GatedLM`, `eval_w`, `calib_w` and `result` from `fca.audit`'s example, a second training seed:

    >>> seed1 = GatedLM().eval()
    >>> ctrl1 = fca.Controller.from_modules(seed1, "gates.*", layout="batch token")
    >>> other = fca.audit(seed1, ctrl1, eval_w, calib_w,
    ...                   randomizations=1, out=tempfile.mkdtemp(), quiet=True)
    >>> summary = fca.summarize([result, other])
    >>> print(summary)
    GatedLM ... params: 2 checkpoint(s), checkpoint-level intervals
      Cross-input            ΔNLL ...  p=... (.../2 > 0)
      ...
      retention StaticProfile vs GlobalMean: ...
      criterion 'practically small' (upper 95% bound of the StaticProfile ΔNLL < 0.002; checkpoint): ...
    >>> summary.conditions[["family", "condition", "n"]].head(1)
      family   condition  n
    0 GatedLM... CrossInput  2
    """
    audits = [a if isinstance(a, AuditResult) else AuditResult.load(a, allow_partial=allow_partial) for a in audit_dirs]
    if not audits:
        raise FcauditError("no audit directories given; pass one or more directories written by `fcaudit audit`")
    if len({Path(a.path).resolve() for a in audits}) != len(audits):
        raise FcauditError("the same audit directory was given twice; pass each checkpoint's audit once")
    _one_audit_per_checkpoint(audits)
    by_family: dict[str, list[AuditResult]] = {}
    for a in audits:
        by_family.setdefault(family_of(a.config), []).append(a)

    tables, criteria, groups = [], [], {}
    for fam, members in by_family.items():
        crit, fixed_at, source = _criteria_of(members, fam)
        _check_pool(fam, members)
        stats = [a.statistics() for a in members]  # each audit's own criteria: the family's, checked above
        if len(members) == 1:
            c, f, r = _window_level(stats[0], fam)
            level, note = "window", WINDOW_NOTE
        else:
            c, f, r = _checkpoint_level(stats, crit, fam)
            level, note = "checkpoint", CHECKPOINT_NOTE + (FEW_NOTE.format(n=len(members), p=2 / 2 ** len(members))
                                                           if len(members) < FEW_CHECKPOINTS else "")
        partial = any(a.partial for a in members)
        tables.append((c, f, r))
        criteria += verdicts(c, r, crit, family=fam, fixed_at=fixed_at, source=source)
        groups[fam] = {"n_checkpoints": len(members), "level": level,
                       "note": (PARTIAL_NOTE + " " if partial else "") + note, "labels": members[0].labels,
                       "partial": partial, "confidence": crit.confidence, "criteria_source": source,
                       "criteria_fixed_at": fixed_at,
                       # absolute: a report run from another directory finds them
                       "audits": [str(Path(a.path).resolve()) for a in members], "replay": [a.replay for a in members],
                       "variation": [v for v in (a.variation for a in members) if v is not None]}
    summary = Summary(*(pd.concat(dfs, ignore_index=True) for dfs in zip(*tables)), criteria, groups)
    if out is not None:
        summary.save(out)
    return summary
