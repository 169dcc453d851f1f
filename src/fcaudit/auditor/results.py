"""The one reader of audit directories, `AuditResult` (the Python API, `fcaudit summarize` and `fcaudit report` use
it): records, replay report, variation and the window-level statistics of fcaudit.stats.results."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import numpy as np
import pandas as pd
import pyarrow.parquet as pq

from fcaudit import protocol
from fcaudit.auditor import files
from fcaudit.auditor.directory import MARKER, AuditDir, record_keys
from fcaudit.errors import FcauditError
from fcaudit.protocol import Criteria
from fcaudit.stats.results import FactorEffectsResult, PenaltiesResult, RetentionResult, WindowStatistics

LATER_TOKENS = "routing depends on later tokens"


def routing_lines(replay: dict) -> list[str]:
    """What the CLI and the report say about routers: the causality check's count above 0, the token note."""
    lines = []
    if (flips := replay.get("later_token_flips")):
        lines.append(f"{LATER_TOKENS}: changing only the last quarter of {replay.get('causality_windows')} windows "
                     f"changed {flips} routing decisions at earlier positions (fine for training; this router "
                     "cannot decode autoregressively as it is)")
    if replay.get("routing_note"):
        lines.append(replay["routing_note"])
    return lines


def _damaged(e: files.Damaged, root: Path) -> FcauditError:
    return FcauditError(f"{e.path} is damaged ({e.why}); rerun the audit command on {root} to recompute it")


def _read_json(read: Callable[[], dict], root: Path) -> dict | None:
    """replay.json or variation.json (AuditDir's checked `read`), None when it is missing; a damaged one is an
    error."""
    try:
        return read()
    except FileNotFoundError:
        return None
    except files.Damaged as e:
        raise _damaged(e, root) from None


def load_records(path: str | os.PathLike, partial: bool = False) -> pd.DataFrame:
    """The records of an audit directory, sorted by condition (registry order), randomization, example. With
    `partial`, also the finished units of (condition, randomization) pairs that are not complete yet. Only the
    audit's own files are read: each is checked as the engine checks it before reuse (what it would recompute, this
    refuses), and a records or part file that is not the audit's is refused by name."""
    adir = AuditDir(path)
    frames = []
    try:
        config = adir.config()
        n, batch = config["windows"]["n_eval"], config["batch_size"]
        adir.check_strays(config)
        for c, r in record_keys(config):
            if adir.records(c, r).is_file():
                frames.append(adir.read_records(c, r, n))
                continue
            seen: set[int] = set()
            for f in sorted(adir.parts(c, r).glob("b*.safetensors")) if partial else ():
                tensors = adir.read_part(f, c, r, n, batch, seen)
                frames.append(pd.DataFrame({"example": tensors["example"].numpy(), "condition": c,
                                            "randomization": np.int64(r), "nll": tensors["nll"].numpy(),
                                            "tokens": np.int64(-1), "active": tensors["active"].numpy().reshape(
                                                len(tensors["nll"]), -1)[:, 0]}))
    except files.Damaged as e:
        raise _damaged(e, adir.root) from None
    if not frames:
        raise FcauditError(f"{path} has no records; run `fcaudit audit ... --out {path}` first")
    df = pd.concat(frames, ignore_index=True).sort_values(
        ["condition", "randomization", "example"], ignore_index=True,
        key=lambda s: s.map(protocol.order) if s.name == "condition" else s)
    if "active" not in df.columns:  # records written before they carried it
        df["active"] = np.nan
    # then a codec's execution counts, where it has them (Codec.counts: a capacity router's experts and drops)
    return df[list(protocol.RECORD_COLUMNS) + [c for c in df.columns if c not in protocol.RECORD_COLUMNS]]


def missing_records(adir: AuditDir, config: dict) -> list[str]:
    """The (condition, randomization) records files of a finished audit of `config` that are absent or short, from
    their Parquet metadata only (the records are read, and their hashes checked, when used)."""
    missing = []
    for c, r in record_keys(config):
        path = adir.records(c, r)
        try:
            rows = pq.read_metadata(path).num_rows if path.is_file() else None
        except Exception as e:
            raise _damaged(files.Damaged(path, f"unreadable ({type(e).__name__})"), adir.root) from None
        if rows != config["windows"]["n_eval"]:
            missing.append(f"{c} r{r}")
    return missing


@dataclass(repr=False)
class AuditResult:
    """One audit read back from its directory: records, replay check, variation and the paper's statistics.

    `fca.audit(...)` returns one, and `fca.AuditResult.load(dir)` reads any audit directory (`fcaudit audit`
    writes the same). The records are read (and their content hashes checked) when first used.

    Attributes
    ----------
    path : pathlib.Path
        The audit directory.
    config : dict
        Its config.json: windows, randomizations, seed, conditions, labels, criteria, controller, model and
        provenance.
    replay : dict
        The exact replay check (replay.json): `passed`, `max_abs_dlogit`, `delta_nll`, `bit_equal`, `tolerance`.
    partial : bool
        True for an unfinished audit loaded with `allow_partial=True`; every summary of it then says so.

    Examples
    --------
    With `out`, the directory of `fca.audit`'s example:

    >>> result = fca.AuditResult.load(out)
    >>> result
    AuditResult('...', 4 windows, R=1, replay passed=True max|Δlogit|=0.0)
    >>> result.penalties().to_frame()[["label", "mean", "ci_low", "ci_high"]]
                   label  mean  ci_low  ci_high
    0        Cross-input  ...
    6         GlobalMean  ...

    The examples of its methods, and of the result objects they return, use this `result`.
    """

    path: Path
    config: dict
    replay: dict
    partial: bool = False
    _records: pd.DataFrame | None = None

    @property
    def records(self) -> pd.DataFrame:
        """One row per (window, condition, randomization): the audit's raw data, which every statistic reads.

        Columns: `example` (the window), `condition`, `randomization`, `nll` (mean next-token NLL per predicted
        token), `tokens` (predicted tokens), `active` (mean nonzero coefficients per layer, token and stream), then a
        codec's execution counts where it has them. Sorted by condition (registry order), randomization, example.

        Examples
        --------
        >>> result.records.columns.tolist()[:6]
        ['example', 'condition', 'randomization', 'nll', 'tokens', 'active']
        >>> result.records.groupby("condition", sort=False)["nll"].mean().index[0]
        'Correct'
        """
        if self._records is None:
            self._records = load_records(self.path, partial=self.partial)
        return self._records

    def __repr__(self) -> str:
        r = self.replay
        windows = (self.config.get("windows") or {}).get("n_eval")  # from config.json: a repr reads no records
        return (f"AuditResult({str(self.path)!r}, {windows} windows, R={self.config.get('randomizations')}, "
                f"replay passed={r.get('passed')} max|Δlogit|={r.get('max_abs_dlogit')}"
                f"{', PARTIAL' if self.partial else ''})")

    @classmethod
    def load(cls, path: str | os.PathLike, allow_partial: bool = False) -> "AuditResult":
        """Read an audit directory, one `fcaudit audit` or `fca.audit` wrote.

        Parameters
        ----------
        path
            The audit directory (the `--out` / `out=` of the audit).
        allow_partial
            Read an unfinished audit (one stopped before its end) instead of refusing it; the result is marked
            `partial`, and its statistics use the units it has.

        Raises
        ------
        FcauditError
            Not an audit directory, an unfinished audit without `allow_partial`, a damaged file, or a failed
            exact replay check.

        Examples
        --------
        >>> again = fca.AuditResult.load(result.path)
        >>> again.replay["passed"], again.partial
        (True, False)
        """
        adir = AuditDir(path)
        if not adir.config_path.is_file():
            raise FcauditError(f"{adir.root} is not an audit directory (no config.json); pass a directory written by "
                               "`fcaudit audit`")
        if not any((adir.root / n).exists() for n in (MARKER, "records")):
            raise FcauditError(f"{adir.root} is not an audit directory (a checkpoint?): audit it first with "
                               f"`fcaudit audit {adir.root} --out DIR` and pass DIR")
        try:
            config = adir.config()
        except files.Damaged as e:
            raise _damaged(e, adir.root) from None
        replay = _read_json(adir.read_replay, adir.root)
        if (replay or {}).get("passed") is False:
            raise FcauditError(f"{adir.root}: the exact replay check failed ({replay.get('max_abs_dlogit')} max "
                               "|Δlogit|); its interventions are not valid, see replay.json")
        # variation.json is written last: without it (or replay.json) the audit was stopped before its end
        missing = missing_records(adir, config) + [p.name for p, obj in (
            (adir.replay, replay), (adir.variation, _read_json(adir.read_variation, adir.root))) if obj is None]
        if missing and not allow_partial:
            raise FcauditError(f"{adir.root} is an unfinished audit (lacks {', '.join(missing[:3])}"
                               f"{' ...' if len(missing) > 3 else ''}); rerun the audit command with --out "
                               f"{adir.root} to finish it (or pass --allow-partial)")
        return cls(adir.root, config, replay or {}, partial=bool(missing),
                   _records=load_records(adir.root, partial=True) if missing else None)

    @property
    def notices(self) -> tuple[str, ...]:
        """The pre-write checks' notices (e.g. a site that looks like a hidden state), from replay.json."""
        return tuple(self.replay.get("notices") or ())

    @property
    def labels(self) -> dict[str, str]:
        """Display label per condition: the registry's defaults, renamed by the controller (e.g. LayerMean).

        `retention(...)` and a result object's `[...]` accept a label wherever they take a condition's name.

        Examples
        --------
        >>> result.labels["StaticProfile"], result.labels["StructureRemoved"]
        ('StaticProfile', 'GlobalMean')
        """
        return protocol.default_labels() | dict(self.config.get("labels") or {})

    @property
    def variation(self) -> dict | None:
        """Coefficient variation (variation.json): does the controller vary across inputs, tokens and layers?

        Each layer's coefficient profile (`layers`: mean, sd, shape, site) and a balanced variance decomposition into
        layer, input, token and their interactions (`decomposition`: shares of the total); None for an audit stopped
        before its end. Whether the model uses that spread is what the conditions test.

        Examples
        --------
        >>> sorted(result.variation["decomposition"])
        ['input', 'input:layer', 'input:layer:token', 'input:token', 'layer', 'layer:token', 'token']
        >>> result.variation["layers"][0]["site"]
        'gates.0'
        """
        return _read_json(AuditDir(self.path).read_variation, self.path)

    @property
    def criteria(self) -> Criteria:
        """The prespecified criteria in config.json (the defaults for audits written without them).

        Examples
        --------
        >>> result.criteria
        Criteria(small_upper=0.002, retention_lower=0.95, confidence=0.95)
        """
        return Criteria.from_dict(self.config["criteria"]) if self.config.get("criteria") else Criteria()

    def statistics(self, confidence: float | None = None, n_resamples: int = 10000) -> WindowStatistics:
        """The window-level statistics of this audit's records, which penalties, factor effects and retention are
        computed from (as `fca.summarize` reads a single checkpoint).

        Parameters
        ----------
        confidence
            The intervals' level; None takes the criteria's.
        n_resamples
            Bootstrap resamples of the windows.

        Examples
        --------
        >>> stats = result.statistics()
        >>> stats.per_window.shape  # ΔNLL per window (rows) and condition (columns)
        (4, ...)
        """
        crit = self.criteria if confidence is None else replace(self.criteria, confidence=confidence)
        return WindowStatistics(self.records, self.labels, crit, complete=not self.partial, n_resamples=n_resamples)

    def penalties(self, confidence: float | None = None, n_resamples: int = 10000) -> PenaltiesResult:
        """The cost of each condition: mean ΔNLL vs Correct per condition (Eq. 4), with its interval over windows.

        Each condition replaces the coefficients (e.g. CrossInput: another input's; StaticProfile: a fixed profile
        from the calibration windows); its penalty is how much worse the frozen model predicts. Also the Monte
        Carlo SE across randomizations and the mean active sources (experts) per token.

        Parameters
        ----------
        confidence
            The intervals' level; None takes the audit's criteria's.
        n_resamples
            Bootstrap resamples of the windows.

        Returns
        -------
        PenaltiesResult
            Prints a table; `.statistic`, `.confidence_interval`, `pen["CrossInput"]`, `.to_frame()`.

        Examples
        --------
        >>> pen = result.penalties()
        >>> pen.to_frame()[["condition", "mean", "ci_low", "ci_high"]].columns.tolist()
        ['condition', 'mean', 'ci_low', 'ci_high']
        >>> pen["StaticProfile"].n  # windows the interval is over
        4
        """
        return self.statistics(confidence, n_resamples).penalties()

    def factor_effects(self, confidence: float | None = None, n_resamples: int = 10000) -> FactorEffectsResult:
        """The factorial contrasts E_input, E_token and E_interaction (Eq. 5-7), with their intervals over windows.

        From the paired cells CC (Correct), DC (CrossInput), CS (TokenShuffle) and DS (CrossShuffle) of each
        window and randomization: contrasts, not an additive split into mechanisms.

        Parameters
        ----------
        confidence
            The intervals' level; None takes the audit's criteria's.
        n_resamples
            Bootstrap resamples of the windows.

        Returns
        -------
        FactorEffectsResult
            Prints a table; `fx["E_input"]`, `.statistic`, `.confidence_interval`, `.to_frame()`.

        Examples
        --------
        >>> fx = result.factor_effects()
        >>> fx.to_frame().index.tolist()
        ['input', 'token', 'interaction']
        """
        return self.statistics(confidence, n_resamples).factor_effects()

    def retention(self, name: str = "StaticProfile", confidence: float | None = None,
                  n_resamples: int = 10000) -> RetentionResult:
        """How much of the input-dependent structure's value a static condition keeps (Eq. 8).

        Retention(S) = 1 - ΔNLL(S) / ΔNLL(StructureRemoved), with its paired-window interval, reported beside both
        absolute ΔNLLs. Undefined (statistic nan, with the reason) unless the reference's interval lies above the
        criteria's practically-small bound.

        Parameters
        ----------
        name
            A retained static condition (StaticProfile, LayerPositionMean, StaticTopK) or its display label (e.g.
            LayerMean).
        confidence
            The interval's level; None takes the audit's criteria's.
        n_resamples
            Bootstrap resamples of the windows.

        Returns
        -------
        RetentionResult
            `.statistic`, `.confidence_interval`, `.defined`, `.reason`, `.line()`, `.to_frame()`.

        Examples
        --------
        >>> ret = result.retention("StaticProfile")
        >>> ret.reference_label, ret.n
        ('GlobalMean', 4)
        >>> ret.line()
        'retention StaticProfile vs GlobalMean: ...; ΔNLL ... vs ...'
        """
        return self.statistics(confidence, n_resamples).retention(name)

    def retention_lines(self) -> list[str]:
        """One line per retained condition: retention, its interval and the two absolute ΔNLLs (or why undefined).

        What `fcaudit audit` prints under its table; a capacity router's audit adds its drops.

        Examples
        --------
        >>> for line in result.retention_lines():
        ...     print(line)
        retention Layer×PositionMean vs GlobalMean: ...
        retention StaticProfile vs GlobalMean: ...; ΔNLL ... vs ...
        """
        return [r.line() for r in self.statistics().retentions()] + self.capacity_lines()

    def capacity_lines(self) -> list[str]:
        """A capacity router's drops (a `dropped` record column): each condition's mean assignments per window dropped
        past the experts' capacity, beside those run under Correct, in one line ([] for other controllers).

        Examples
        --------
        >>> result.capacity_lines()  # a gate controller drops nothing
        []
        """
        rec = self.records
        if "dropped" not in rec.columns:
            return []
        experts = [c for c in rec.columns if c.startswith("expert") and c[6:].isdigit()]
        means = rec.groupby("condition", sort=False)["dropped"].mean()
        ran = float(rec.loc[rec.condition == "Correct", experts].sum(axis=1).mean()) if experts else float("nan")
        labels = self.labels
        dropped = ", ".join(f"{labels.get(c, c)} {v:.4g}" for c, v in means.items() if c != "Correct" and v > 0)
        return [f"capacity: assignments dropped past the experts' capacity, mean per window: {dropped or 'none'} "
                f"(Correct runs {ran:.4g}, its router's own drops already out of its combine vectors)"]
