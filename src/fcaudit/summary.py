"""From audits to the paper's evidence (`fcaudit summarize`), at two levels never mixed (paper §4.1): across a
family's checkpoints (training seeds are the units: bootstrap CIs, exact sign-flip tests, Holm across the three factor
effects), or, for a family of one checkpoint, window-level intervals labelled so everywhere. Pooled checkpoints must be
independent and audited alike; the prespecified criteria are read from each audit's config.json. Each family is a
`FamilyResult`, with the same `penalties()`, `factor_effects()` and `retention()` as an `AuditResult`; the summary's
files (summary.json, the CSV tables) are written from them and read back into them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterator, Sequence

import pandas as pd

from fcaudit.auditor.results import AuditResult, Replay
from fcaudit.errors import FcauditError
from fcaudit.io import OutDir, finite_json, read_json
from fcaudit.protocol import Criteria
from fcaudit.stats.levels import CheckpointStatistics, retained_name
from fcaudit.stats.results import WINDOW_LEVEL, FactorEffectsResult, PenaltiesResult, Results, RetentionResult

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

# The summary's tables (summary.json, conditions.csv, factors.csv, retention.csv): the family, then the result
# objects' `to_frame()` columns, then the level of the intervals and what else the table needs.
_COLUMNS = {
    "conditions": ["family", "condition", "label", "statistic", "ci_low", "ci_high", "pvalue", "n", "mc_se", "level",
                   "n_positive", "active"],
    "factors": ["family", "effect", "label", "statistic", "ci_low", "ci_high", "pvalue", "n", "mc_se", "level",
                "pvalue_holm", "n_positive"],
    "retention": ["family", "condition", "label", "statistic", "ci_low", "ci_high", "pvalue", "n", "level",
                  "reference", "reference_label", "delta_static", "delta_reference", "bound", "note"],
}
_TEXT = {"family", "condition", "label", "level", "effect", "reference", "reference_label", "note"}
COUNTS = ("n", "n_positive")  # counts, nan where undefined: float columns in pandas


def csv_frame(df: pd.DataFrame) -> pd.DataFrame:
    """`df` as its CSV is written: counts as integers (5, not 5.0; empty where undefined)."""
    return df.astype({c: "Int64" for c in COUNTS if c in df.columns})


def _frame(rows: list[dict] | pd.DataFrame, kind: str) -> pd.DataFrame:
    df = pd.DataFrame(rows).reindex(columns=_COLUMNS[kind])
    if "note" in df.columns:
        df["note"] = df["note"].fillna("").astype(str)
    # numbers stay numeric even when a column is all missing (JSON null) after a round trip
    return df.astype({c: "float64" for c in df.columns if c not in _TEXT and c != "n"})


@dataclass(eq=False)
class SavedStatistics:
    """A family's statistics as its summary.json holds them: read back, with no records to compute others from."""

    key: tuple[float, int]  # the (confidence, n_resamples) they were computed at
    labels: dict[str, str]
    pen: PenaltiesResult
    fx: FactorEffectsResult | None  # None: its audits lack the factorial conditions
    rets: tuple[RetentionResult, ...]

    def penalties(self) -> PenaltiesResult:
        return self.pen

    def mc_lines(self) -> list[str]:
        """None: a family's MC SE averages its audits' (each audit says its own)."""
        return []

    @property
    def has_factorial(self) -> bool:
        return self.fx is not None

    def factor_effects(self) -> FactorEffectsResult:
        if self.fx is None:
            raise FcauditError("this summary holds no factor effects: its audits lack the randomized conditions")
        return self.fx

    def retention(self, condition: str) -> RetentionResult:
        cond = retained_name(condition, self.pen.names, self.labels)
        return next(r for r in self.rets if r.condition == cond)

    def retentions(self) -> list[RetentionResult]:
        return list(self.rets)


@dataclass(frozen=True, eq=False, repr=False)
class FamilyResult(Results):
    """One model family of a summary: its checkpoints' results at checkpoint level (window level for one), with the
    same `penalties()`, `factor_effects()`, `retention()` and `verdicts()` as an `AuditResult`.

    Across checkpoints the penalties and factor effects carry two-sided sign-flip p-values (`pvalue`), the count
    of positive checkpoints (`n_positive`) and, for the three factor effects, Holm-adjusted p-values
    (`pvalue_holm`). `str()` is the family's part of the `fcaudit summarize` printout.

    Attributes
    ----------
    name : str
        The family (config.json's model.family).
    n_checkpoints : int
        Its audits, one per independently trained checkpoint.
    criteria : Criteria
        The prespecified criteria its audits fixed (`criteria_source`: where they were read, config.json).
    static : str
        The controller's own static condition, which `retention()` and the criteria judge.
    audit_dirs, replays, variation : tuple
        Its audits' directories, replay checks and coefficient variation (variation.json's content).
    execution : tuple
        Each audit's execution.json content (None: not measured; {"reason": ...}: fcaudit could not tell).
    audits : tuple of AuditResult
        The audits themselves (none for a summary read back from summary.json, whose statistics are those written).

    Examples
    --------
    With `result` from `fca.audit`'s example, a family of one checkpoint (window-level intervals):

    >>> fam = next(iter(fca.summarize([result]).values()))
    >>> fam.level, fam.n_checkpoints, fam.static
    ('window', 1, 'StaticProfile')
    >>> fam.penalties() is result.penalties()  # one checkpoint: its audit's statistics
    True
    >>> fam.verdicts()[0]["name"], fam.verdicts()[0]["fixed_in_advance"]
    ('practically small', True)
    """

    name: str
    n_checkpoints: int
    criteria: Criteria
    criteria_source: str
    criteria_fixed_at: str | None
    labels: dict[str, str]
    static: str
    partial: bool
    audit_dirs: tuple[str, ...]
    replays: tuple[Replay, ...]
    variation: tuple[dict, ...]
    execution: tuple[dict | None, ...]
    audits: tuple[AuditResult, ...] = ()
    saved: SavedStatistics | None = None
    _statistics: dict = field(default_factory=dict, init=False)

    @property
    def level(self) -> str:
        """The units of its intervals: "checkpoint", or "window" for a family of one checkpoint."""
        return "checkpoint" if self.n_checkpoints > 1 else "window"

    @property
    def note(self) -> str:
        """What its intervals describe, as the report says it."""
        n = self.n_checkpoints
        note = WINDOW_NOTE if n == 1 else CHECKPOINT_NOTE + (FEW_NOTE.format(n=n, p=2 / 2 ** n)
                                                             if n < FEW_CHECKPOINTS else "")
        return (PARTIAL_NOTE + " " if self.partial else "") + note

    @property
    def notices(self) -> tuple[str, ...]:
        """Its audits' notices, each once."""
        return tuple(dict.fromkeys(line for r in self.replays for line in r.notices))

    def _compute(self, confidence: float, n_resamples: int):
        if self.saved is not None:
            if (confidence, n_resamples) != self.saved.key:
                raise FcauditError(f"family {self.name!r} was read from summary.json, whose statistics are at "
                                   f"confidence {self.saved.key[0]:g} with {self.saved.key[1]} resamples; summarize "
                                   "its audits again for others")
            return self.saved
        if self.n_checkpoints == 1:
            return self.audits[0].statistics(confidence, n_resamples)
        return CheckpointStatistics(tuple(a.statistics(confidence, n_resamples) for a in self.audits),
                                    replace(self.criteria, confidence=confidence),
                                    n_resamples, self.name)

    def verdicts(self) -> list[dict]:
        """The criteria's two verdicts (see `AuditResult.verdicts`), with the family and where its criteria come
        from: criteria.json's rows."""
        return [{"family": self.name, **v, "criteria": self.criteria.to_dict(),
                 "fixed_in_advance": self.criteria_source == "config.json", "fixed_at": self.criteria_fixed_at,
                 "source": self.criteria_source} for v in super().verdicts()]

    def frames(self) -> dict[str, pd.DataFrame]:
        """Its rows of the summary's tables (conditions, factors, retention): a family column, the result objects'
        `to_frame()` columns, then the level of the intervals."""
        stats = self.statistics()
        parts = {"conditions": [stats.penalties().to_frame()],
                 "factors": [stats.factor_effects().to_frame()] if stats.has_factorial else [],
                 "retention": [r.to_frame() for r in stats.retentions()]}
        return {k: _frame(pd.concat(v).reset_index().assign(family=self.name, level=self.level) if v else [], k)
                for k, v in parts.items()}

    def group(self) -> dict:
        """summary.json's entry of the family: checkpoints, level, note, labels, its static condition, criteria's
        source, audits, replay checks, variation and execution."""
        return {"n_checkpoints": self.n_checkpoints, "level": self.level, "note": self.note, "labels": self.labels,
                "static": self.static, "partial": self.partial, "confidence": self.criteria.confidence,
                "criteria_source": self.criteria_source, "criteria_fixed_at": self.criteria_fixed_at,
                "audits": list(self.audit_dirs), "replay": [r.to_dict() for r in self.replays],
                "variation": list(self.variation), "execution": list(self.execution)}

    def _heading(self) -> list[str]:
        level = "checkpoint-level" if self.level == "checkpoint" else WINDOW_LEVEL
        return [f"{self.name}: {self.n_checkpoints} checkpoint(s), {level} intervals"
                + ("  [PARTIAL]" if self.partial else "")]

    def __str__(self) -> str:
        pen, lines = self._body()
        return "\n".join([*self._heading(), *(f"  {line}" for line in (*self.notices, *repr(pen).split("\n"),
                                                                       *lines))])

    def __repr__(self) -> str:
        return (f"FamilyResult({self.name!r}, {self.n_checkpoints} checkpoint(s), {self.level}-level intervals"
                f"{', PARTIAL' if self.partial else ''})")


class Summary(Mapping):
    """What `fca.summarize` returns: a Mapping from model family to its `FamilyResult`, checkpoint level (for one
    checkpoint, window level).

    `str(summary)` is what `fcaudit summarize` prints; `save(DIR)` writes summary.json, the CSV tables and
    criteria.json (which `fcaudit report` reads back with `Summary.load`). `conditions`, `factors` and `retention`
    are those tables (one row per family and quantity), `verdicts` each family's criteria verdicts.

    Examples
    --------
    With `result` from `fca.audit`'s example:

    >>> summary = fca.summarize([result])
    >>> list(summary)
    ['GatedLM ... params']
    >>> summary.conditions[["family", "condition", "n"]].head(1)
      family   condition  n
    0 GatedLM... CrossInput  4
    """

    def __init__(self, families: Sequence[FamilyResult]):
        self._families = {f.name: f for f in families}

    def __getitem__(self, name: str) -> FamilyResult:
        return self._families[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._families)

    def __len__(self) -> int:
        return len(self._families)

    __hash__ = object.__hash__

    def __eq__(self, other: object) -> bool:
        return self is other

    def __repr__(self) -> str:
        return f"Summary({', '.join(map(repr, self.values()))})"

    def __str__(self) -> str:
        return "\n".join(str(f) for f in self.values())

    def _repr_html_(self) -> str:
        return "".join(f._repr_html_() for f in self.values())

    def _table(self, kind: str) -> pd.DataFrame:
        return _frame(pd.concat([f.frames()[kind] for f in self.values()], ignore_index=True) if self else [], kind)

    @property
    def conditions(self) -> pd.DataFrame:
        """conditions.csv: every family's penalties (`FamilyResult.frames()`)."""
        return self._table("conditions")

    @property
    def factors(self) -> pd.DataFrame:
        """factors.csv: every family's factor effects."""
        return self._table("factors")

    @property
    def retention(self) -> pd.DataFrame:
        """retention.csv: every family's retention of each retained static condition."""
        return self._table("retention")

    @property
    def verdicts(self) -> list[dict]:
        """criteria.json: every family's two verdicts."""
        return [v for f in self.values() for v in f.verdicts()]

    def to_dict(self) -> dict:
        # full precision (to_json rounds to 10 digits), nan as None
        tables = {k: finite_json(self._table(k).to_dict(orient="records")) for k in _COLUMNS}
        return {"groups": {name: f.group() for name, f in self.items()}, **tables, "criteria": self.verdicts}

    def save(self, out: str | Path) -> Path:
        """Write summary.json, the CSV tables and criteria.json into `out`, a summary directory of fcaudit.io's
        rule (new, empty, or an earlier summary's)."""
        out = OutDir(out, "summary").claim()
        data = self.to_dict()
        out.write_json(out.root / "summary.json", data)
        for name in _COLUMNS:
            out.atomic_write(out.root / f"{name}.csv",
                             lambda p, df=self._table(name): csv_frame(df).to_csv(p, index=False))
        out.write_json(out.root / "criteria.json", data["criteria"])
        return out.root

    @classmethod
    def load(cls, path: str | Path) -> "Summary":
        """A summary directory read back: each family's statistics as its summary.json holds them."""
        path = Path(path)
        if not (path / "summary.json").is_file():
            raise FcauditError(f"{path} has no summary.json; create it with `fcaudit summarize AUDIT_DIR... --out {path}`")
        try:
            d = read_json(path / "summary.json")
            if any(set(_COLUMNS[k]) - set(row) for k in _COLUMNS for row in d[k]):  # another version's tables
                raise KeyError("columns")
            tables = {k: _frame(d[k], k) for k in _COLUMNS}
            names = dict.fromkeys([*tables["conditions"]["family"], *d["groups"]])
            return cls([_saved_family(name, d["groups"][name], tables, d["criteria"]) for name in names])
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise FcauditError(f"{path / 'summary.json'} is not a summary written by fcaudit (or by another version "
                               f"of it: {type(e).__name__}); recreate it with `fcaudit summarize AUDIT_DIR... --out "
                               f"{path}`") from None


def _saved_family(name: str, group: dict, tables: dict[str, pd.DataFrame], verdicts: list[dict]) -> FamilyResult:
    """A family as summary.json holds it (its group entry, its rows of the tables, its verdicts' criteria)."""
    level, confidence = group["level"], float(group["confidence"])
    rows = {k: t[t["family"] == name] for k, t in tables.items()}
    criteria = next((Criteria.from_dict(v["criteria"]) for v in verdicts if v.get("family") == name),
                    Criteria(confidence=confidence))
    pen = PenaltiesResult.from_frame(rows["conditions"], level, confidence)
    fx = FactorEffectsResult.from_frame(rows["factors"], level, confidence) if len(rows["factors"]) else None
    rets = tuple(RetentionResult.from_row(r, level, confidence) for r in rows["retention"].to_dict("records"))
    labels = dict(group["labels"])
    return FamilyResult(name, int(group["n_checkpoints"]), criteria, group["criteria_source"],
                        group["criteria_fixed_at"], labels, str(group["static"]), bool(group["partial"]),
                        tuple(group["audits"]), tuple(Replay.from_json(r) for r in group["replay"]),
                        tuple(group["variation"]), tuple(group["execution"]),
                        saved=SavedStatistics((confidence, 10000), labels, pen, fx, rets))


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
    if any(a.criteria != audits[0].criteria for a in audits):
        raise FcauditError(f"family {family!r}: audits were run with different criteria; audit all checkpoints with "
                           "the same criteria")
    stamps = [t for a in audits if (t := a.config["criteria"].get("fixed_at"))]
    return audits[0].criteria, max(stamps, default=None), "config.json"


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
        A Mapping from family to its `FamilyResult` (`penalties()`, `factor_effects()`, `retention()`, as an
        `AuditResult` has them); its `str()` is what `fcaudit summarize` prints; `.conditions`, `.factors` and
        `.retention` are the tables of all families.

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
      PenaltiesResult: mean ΔNLL vs Correct per condition (nats per predicted token), 95% bootstrap intervals ...
        condition ...  p  > 0 ...
        Cross-input ...
      ...
      retention StaticProfile vs GlobalMean: ...
      criterion 'practically small' (upper 95% bound of the StaticProfile ΔNLL < 0.002; checkpoint): ...
    >>> fam = summary[list(summary)[0]]  # the family's FamilyResult
    >>> fam.penalties()["CrossInput"].n, fam.retention().level
    (2, 'checkpoint')
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

    families = []
    for fam, members in by_family.items():
        crit, fixed_at, source = _criteria_of(members, fam)
        _check_pool(fam, members)
        families.append(FamilyResult(
            fam, len(members), crit, source, fixed_at, members[0].labels, members[0].static,
            any(a.partial for a in members),
            tuple(str(Path(a.path).resolve()) for a in members),  # absolute: a report run from elsewhere finds them
            tuple(a.replay for a in members), tuple(v.record for v in map(AuditResult.variation, members) if v),
            tuple(a.execution_record() for a in members), audits=tuple(members)))
    summary = Summary(families)
    for f in families:  # computed now: what does not pool (e.g. an audit lacking a condition) fails here
        f.frames()
    if out is not None:
        summary.save(out)
    return summary
