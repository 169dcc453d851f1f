"""The one reader of audit directories, `AuditResult` (the Python API, `fcaudit summarize` and `fcaudit report` use
it): records, the replay check and the pre-write checks' findings (`Replay`), the three questions (variation, the
window-level statistics of functional dependence, and execution where the audit measured it), as result objects."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pandas as pd
import pyarrow.parquet as pq

from fcaudit import protocol
from fcaudit.auditor import files
from fcaudit.auditor.directory import MARKER, AuditDir, record_keys
from fcaudit.controllers.findings import CAUSALITY, Finding
from fcaudit.errors import FcauditError
from fcaudit.execution.decided import ExecutionResult
from fcaudit.protocol import Criteria
from fcaudit.stats.levels import WindowStatistics
from fcaudit.stats.results import (NOT_MEASURED, Results, VariationResult, questions_html, questions_lines,
                                   three_questions)


def _g(x: Any) -> str:
    return "None" if x is None else f"{x:.3g}"


@dataclass(frozen=True, eq=False)
class Replay:
    """The exact replay check (replay.json) and the pre-write checks' findings: is every intervention valid?

    With the default tolerance 0, `passed` needs bit-equal logits and NLL (`max_abs_dlogit` and `delta_nll` 0) and,
    for routers, no route flip. `AuditResult.load` refuses an audit whose replay failed.

    Attributes
    ----------
    passed, bit_equal : bool
        The check passed; the replay was bit-equal (None where not recorded).
    max_abs_dlogit, delta_nll : float
        The largest |Δlogit| and |ΔNLL| over every capture batch.
    route_flips : int or None
        Routers: decisions that differ between the live router and the cache (None for other controllers).
    tolerance : float
        The allowed max |Δlogit| (0: bit-exact).
    windows : int or tuple of int
        The windows checked (a failed check: the first and last window of the failing batch).
    findings : tuple of Finding
        The pre-write checks' findings (refusals and notices, with their data).
    record : dict
        replay.json as written.

    Examples
    --------
    >>> result.replay
    Replay(passed=True, bit_equal=True, max|Δlogit|=0, ΔNLL=0, 4 windows, ...)
    >>> result.replay.passed, result.replay.max_abs_dlogit, result.replay.notices
    (True, 0.0, ())
    """

    passed: bool | None
    bit_equal: bool | None
    max_abs_dlogit: float | None
    delta_nll: float | None
    route_flips: int | None
    tolerance: float | None
    windows: int | tuple[int, int] | None
    findings: tuple[Finding, ...]
    record: dict = field(repr=False)

    @classmethod
    def from_json(cls, replay: dict) -> "Replay":
        """replay.json's content as `AuditDir.read_replay` checked it ({} for an audit stopped before it)."""
        windows = replay.get("windows")
        return cls(replay.get("passed"), replay.get("bit_equal"), replay.get("max_abs_dlogit"), replay.get("delta_nll"),
                   replay.get("route_flips"), replay.get("tolerance"),
                   tuple(windows) if isinstance(windows, list) else windows,
                   tuple(Finding.from_json(f) for f in replay.get("findings", ())), dict(replay))

    def to_dict(self) -> dict:
        """replay.json's content, as written."""
        return dict(self.record)

    @property
    def notices(self) -> tuple[str, ...]:
        """The lines of the findings that are notices (a router's later-token dependence among them)."""
        return tuple(f.line for f in self.findings if f.line and not f.refusal)

    def finding(self, check: str) -> Finding | None:
        """The finding of one check (e.g. "causality"), None where the audit has none."""
        return next((f for f in self.findings if f.check == check), None)

    @property
    def later_token_flips(self) -> int | None:
        """The causality check's count: routing decisions at earlier positions that changed when only the last
        quarter of the probe windows did (None: no router, or not checked)."""
        found = self.finding(CAUSALITY)
        return None if found is None else found.data.get("later_token_flips")

    def line(self) -> str:
        """One line, as the CLI prints it first."""
        flips = "" if self.route_flips is None else f" route flips={self.route_flips}"
        return (f"exact replay: passed={self.passed} bit_equal={self.bit_equal} max|Δlogit|={_g(self.max_abs_dlogit)} "
                f"ΔNLL={_g(self.delta_nll)}{flips}")

    def __repr__(self) -> str:
        flips = "" if self.route_flips is None else f", route flips={self.route_flips}"
        windows = f"{self.windows} windows" if isinstance(self.windows, int) else f"windows {self.windows}"
        return (f"Replay(passed={self.passed}, bit_equal={self.bit_equal}, max|Δlogit|={_g(self.max_abs_dlogit)}, "
                f"ΔNLL={_g(self.delta_nll)}{flips}, {windows}, {len(self.findings)} finding(s))")

    def _repr_html_(self) -> str:
        import html

        return "".join(f"<p>{html.escape(line)}</p>" for line in (self.line(), *self.notices))


def _damaged(e: files.Damaged, root: Path) -> FcauditError:
    return FcauditError(f"{e.path} is damaged ({e.why}); rerun the audit command on {root} to recompute it")


def _gone(missing, root: Path) -> FcauditError:
    return FcauditError(f"{missing} is gone: the audit directory {root} was moved or removed since it was read; load "
                        "it where it is now (fca.AuditResult.load(DIR)) or run the audit again")


def _read_json(read: Callable[[], dict], root: Path) -> dict | None:
    """replay.json, variation.json or execution.json (AuditDir's checked `read`), None when it is missing; a damaged
    one, or a directory that went away, is an error."""
    try:
        return read()
    except FileNotFoundError:
        if not root.is_dir():
            raise _gone(root, root) from None
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
    except FileNotFoundError as e:  # the directory moved or removed after the result was made
        raise _gone(e.filename or e.args[0], adir.root) from None
    if not frames:
        raise FcauditError(f"{path} has no records; run `fcaudit audit ... --out {path}` first")
    df = pd.concat(frames, ignore_index=True).sort_values(
        ["condition", "randomization", "example"], ignore_index=True,
        key=lambda s: s.map(protocol.order) if s.name == "condition" else s)
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


@dataclass(repr=False, eq=False)
class AuditResult(Results):
    """One audit read back from its directory: records, replay check and the paper's three questions: variation
    (`variation()`), functional dependence (the statistics) and, where the audit measured it, execution
    (`execution()`).

    `fca.audit(...)` returns one, and `fca.AuditResult.load(dir)` reads any audit directory (`fcaudit audit`
    writes the same). The records are read (and their content hashes checked) when first used; each statistic is
    computed once. `str(result)` is what `fcaudit audit` prints, opening with the three answers (`questions()`),
    and a notebook shows it as tables.

    Attributes
    ----------
    path : pathlib.Path
        The audit directory.
    config : dict
        Its config.json: windows, randomizations, seed, conditions, labels, criteria, controller, model and
        provenance.
    replay : Replay
        The exact replay check and the pre-write checks' findings (replay.json).
    partial : bool
        True for an unfinished audit loaded with `allow_partial=True`; every summary of it then says so.

    Examples
    --------
    With `out`, the directory of `fca.audit`'s example:

    >>> result = fca.AuditResult.load(out)
    >>> result
    AuditResult('...', 4 windows, R=1, replay passed=True max|Δlogit|=0.0)
    >>> result.penalties().to_frame()[["label", "statistic", "ci_low", "ci_high"]]
                                   label  statistic  ci_low  ci_high
    condition
    CrossInput               Cross-input  ...
    StructureRemoved          GlobalMean  ...
    >>> print(result)
    three questions:
      variation   layer ...%, input ...%, token ...%, interactions ...%
      dependence  StaticProfile ΔNLL ..., Cross-input ΔNLL ..., retention ...
      execution   not measured: pass execution=True to fca.audit ...
    exact replay: passed=True bit_equal=True max|Δlogit|=0 ΔNLL=0
    FCA penalties (...)
    PenaltiesResult: mean ΔNLL vs Correct per condition (nats per predicted token), 95% paired-window ...
      condition ...
    ...
    criterion 'high retention' (lower 95% bound of the StaticProfile retention > 95%; ...): ...

    The examples of its methods, and of the result objects they return, use this `result`.
    """

    path: Path
    config: dict
    replay: Replay
    partial: bool = False
    _records: pd.DataFrame | None = None
    _statistics: dict = field(default_factory=dict, init=False)

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
        windows = (self.config.get("windows") or {}).get("n_eval")  # from config.json: a repr reads no records
        return (f"AuditResult({str(self.path)!r}, {windows} windows, R={self.config.get('randomizations')}, "
                f"replay passed={self.replay.passed} max|Δlogit|={self.replay.max_abs_dlogit}"
                f"{', PARTIAL' if self.partial else ''})")

    def _heading(self) -> list[str]:
        return [self.replay.line()]

    def _caption(self) -> list[str]:
        return [f"FCA penalties ({self.path})" + (" [PARTIAL]" if self.partial else "")]

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
        >>> again.replay.passed, again.partial
        (True, False)
        """
        adir = AuditDir(path)
        if not adir.config_path.is_file():
            raise FcauditError(f"{adir.root} is not an audit directory (no config.json); pass a directory written by "
                               "`fcaudit audit`")
        if not (adir.root / MARKER).is_file():  # a checkpoint, or an audit that lost its marker
            raise FcauditError(f"{adir.root} is not an audit directory (no {MARKER}: a checkpoint?): audit it first "
                               f"with `fcaudit audit {adir.root} --out DIR` and pass DIR")
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
        return cls(adir.root, config, Replay.from_json(replay or {}), partial=bool(missing),
                   _records=load_records(adir.root, partial=True) if missing else None)

    @property
    def notices(self) -> tuple[str, ...]:
        """Every notice of the pre-write checks (e.g. a site that looks like a hidden state, a router whose decisions
        depend on later tokens), from replay.json.

        Examples
        --------
        >>> result.notices  # a plain gate controller: nothing to say
        ()
        """
        return self.replay.notices

    @property
    def static(self) -> str:
        """The controller's own static condition, which `retention()` defaults to and the criteria judge:
        config.json's controller.static.

        Examples
        --------
        >>> result.static
        'StaticProfile'
        """
        return self.config["controller"]["static"]

    @property
    def labels(self) -> dict[str, str]:
        """Display label per condition: the registry's defaults, renamed by the controller (e.g. LayerMean).

        `retention(...)` and a result object's `[...]` accept a label wherever they take a condition's name.

        Examples
        --------
        >>> result.labels["StaticProfile"], result.labels["StructureRemoved"]
        ('StaticProfile', 'GlobalMean')
        """
        return protocol.default_labels() | dict(self.config["labels"])

    def variation(self) -> VariationResult | None:
        """Question 1, coefficient variation (variation.json): how much of the coefficients' spread layer, input,
        token and their interactions explain, beside each layer's profile; None for an audit stopped before its end.

        Descriptive: whether the model uses that spread is what the conditions test.

        Returns
        -------
        VariationResult
            A Mapping component -> share; `.line()`, `.to_frame()`, `.profile()` (per layer), `.plot()`, `.record`
            (variation.json as written).

        Examples
        --------
        >>> var = result.variation()
        >>> sorted(var)
        ['input', 'input:layer', 'input:layer:token', 'input:token', 'layer', 'layer:token', 'token']
        >>> var.layers[0]["site"]
        'gates.0'
        """
        var = _read_json(AuditDir(self.path).read_variation, self.path)
        return None if var is None else VariationResult.from_json(var)

    def execution(self) -> ExecutionResult | None:
        """Question 3, where the audit measured it (`execution=True`): what the controller decided beside what the
        forward pass computed, and FLOPs per token live and replayed with the controller disabled, on the first
        evaluation batch (execution.json). None where it was not measured; `execution_note` says why.

        Examples
        --------
        >>> result.execution() is None, result.execution_note  # fca.audit's example did not ask for it
        (True, 'not measured: pass execution=True to fca.audit (fcaudit audit --execution)')
        """
        ex = self.execution_record()
        return None if ex is None or "reason" in ex else ExecutionResult.from_json(ex)

    @property
    def execution_note(self) -> str:
        """Why `execution()` is None ('' where it is not): not asked for, or the one line saying why fcaudit could
        not tell what ran."""
        ex = self.execution_record()
        return NOT_MEASURED if ex is None else f"not measured: {ex['reason']}" if "reason" in ex else ""

    def execution_record(self) -> dict | None:
        """execution.json as the audit wrote it (None: not measured; {"reason": ...}: fcaudit could not tell)."""
        return _read_json(AuditDir(self.path).read_execution, self.path)

    def questions(self) -> dict[str, dict[str, str]]:
        """The three questions' answers, as `str(result)`, its HTML and the report open with: {question: {column:
        text}} for variation, dependence and execution (`fcaudit.stats.results.three_questions`).

        Examples
        --------
        >>> list(result.questions()), list(result.questions()["variation"])
        (['variation', 'dependence', 'execution'], ['layer', 'input', 'token', 'interactions'])
        """
        retention = {r.condition: r for r in self.statistics().retentions()}.get(self.static)
        return three_questions(self.variation(), self.penalties(), retention, self.static, self.execution(),
                               self.execution_note)

    def __str__(self) -> str:
        return "\n".join([*questions_lines(self.questions()), super().__str__()])

    def _repr_html_(self) -> str:
        return f"<div>{questions_html(self.questions())}{super()._repr_html_()}</div>"

    @property
    def criteria(self) -> Criteria:
        """The prespecified criteria in config.json.

        Examples
        --------
        >>> result.criteria
        Criteria(small_upper=0.002, retention_lower=0.95, confidence=0.95)
        """
        return Criteria.from_dict(self.config["criteria"])

    def _compute(self, confidence: float, n_resamples: int) -> WindowStatistics:
        return WindowStatistics(self.records, self.labels, replace(self.criteria, confidence=confidence),
                                complete=not self.partial, n_resamples=n_resamples)

    def retention_lines(self) -> list[str]:
        """One line per retained condition: retention, its interval and the two absolute ΔNLLs (or why undefined).

        What `fcaudit audit` prints under its table; a capacity router's audit adds its drops.
        """
        return super().retention_lines() + self.capacity_lines()

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
        own = float(means.get("Correct", 0.0))  # a codec whose coefficients keep the router's own drops (SwitchRoute)
        correct = f"drops {own:.4g}" if own > 0 else "its router's own drops already out of its combine vectors"
        return [f"capacity: assignments dropped past the experts' capacity, mean per window: {dropped or 'none'} "
                f"(Correct runs {ran:.4g}, {correct})"]
