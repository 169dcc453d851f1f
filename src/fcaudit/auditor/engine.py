"""Algorithm 1 as work units: capture + exact replay check, calibration, profiles, replays, and the final merge.

`Engine` runs one process's share of the units (its `Group`'s) in an audit directory the driver has configured and
locked. A unit's output is verified when reused and recomputed when damaged; randomness is keyed by (seed, r, example),
so any partition of the units over processes, and any resume, gives the same files bit for bit.
"""

from __future__ import annotations

import math
from contextlib import contextmanager, nullcontext
from itertools import groupby
from pathlib import Path
from typing import Callable, ContextManager, Iterable, Iterator, Sequence

import numpy as np
import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from torch import nn

from fcaudit import placement, protocol
from fcaudit.auditor import files
from fcaudit.auditor.directory import AuditDir
from fcaudit.auditor.group import Group
from fcaudit.auditor.results import Replay
from fcaudit.auditor.state import ModelState, changed_itself
from fcaudit.auditor.store import CoefficientStore, all_finite, check_finite
from fcaudit.auditor.units import Schedule, Unit, share
from fcaudit.config import AuditConfig
from fcaudit.controllers.budget_checks import observed_budget
from fcaudit.controllers.codecs import Codec
from fcaudit.controllers.controller import Controller
from fcaudit.controllers.findings import Finding
from fcaudit.controllers.patching import Captured
from fcaudit.errors import FcauditError, one_line
from fcaudit.execution.decided import audit_execution
from fcaudit.kinds import Description
from fcaudit.loss import logits_of, token_nll, usable_logits
from fcaudit.protocol import Coeffs
from fcaudit.stats.variance import variation

LossFn = Callable[[object, torch.Tensor], torch.Tensor]
RESIDENT_FRACTION = 0.25  # on a GPU the whole store is held there when it takes at most this part of its free memory


def keeps_store_on(device: torch.device, nbytes: int) -> bool:
    """Whether stage 2 holds the whole store (`nbytes`) on `device`: a GPU with room to spare, so replays gather there
    with no host copy per batch; on the CPU the store stays in its files, so memory stays flat with the windows."""
    return device.type == "cuda" and nbytes <= RESIDENT_FRACTION * torch.cuda.mem_get_info(device)[0]


# ---- one forward pass --------------------------------------------------------------------------------------------

def forward_nll(model: nn.Module, ids: torch.Tensor, loss_fn: LossFn | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits, mean NLL per predicted token per window [B], float64 on the model's device)."""
    out = model(ids)
    logits = logits_of(out, model, ids)
    if logits.device != ids.device:  # a model spread over devices by hand: its logits are on its last one
        ids = ids.to(logits.device)
    nll = loss_fn(out, ids) if loss_fn is not None else token_nll(logits, ids).mean(1)
    if not isinstance(nll, torch.Tensor) or tuple(nll.shape) != (ids.shape[0],):
        shape = tuple(nll.shape) if isinstance(nll, torch.Tensor) else type(nll).__name__
        raise FcauditError(f"loss_fn returned {shape}, not one loss per window [{ids.shape[0]}]; return a tensor "
                           "of shape [batch]")
    return logits, nll.detach().double()


def check_scores(logits: torch.Tensor, nll: torch.Tensor, where: str) -> None:
    """Refused: logits holding nan or +inf, or a non-finite NLL, of the unmodified model on `where`. A -inf logit is a
    masked entry and passes where the NLL stays finite."""
    if not usable_logits(logits):
        raise FcauditError(f"the model's logits on {where} are non-finite (nan or +inf); fix the model or its dtype "
                           "(e.g. load in float32) before auditing")
    if not all_finite(nll):
        raise FcauditError(f"the model's NLL on {where} is non-finite (nan or inf) although its logits hold no nan or "
                           "+inf: a next token has probability 0 (its logit is -inf, or a whole row is); fix the "
                           "model's masking before auditing")


# a fix may change what the finished batches computed: only an unchanged model and windows may resume them
AGAIN = ("fix it and audit again into a new --out (this one resumes only for a model and windows that compute as "
         "before)")


@contextmanager
def running(where: str, then: str = AGAIN):
    """A failure of the model's forward pass (or of its loss) as one line naming the windows and the condition, and
    `then`, the way on; the cause's traceback stays chained for a bug in the model's own code."""
    try:
        yield
    except FcauditError as e:
        raise FcauditError(f"{e} ({where})") from e
    except Exception as e:  # whatever the model raises
        raise FcauditError(f"the model's forward pass failed on {where} ({type(e).__name__}: {one_line(e)}); "
                           f"{then}") from e


def capture_batch(model: nn.Module, controller: Controller, ids: torch.Tensor, loss_fn: LossFn | None,
                  decoding: bool = False) -> tuple[Captured, torch.Tensor, torch.Tensor]:
    """Stage 1 on one batch: the coefficients of every site (with what a replay needs to decode them, if asked), the
    logits and the NLL of the unperturbed model."""
    with controller.capture(ids.shape[0], ids.shape[1], decoding=decoding) as found:
        logits, nll = forward_nll(model, ids, loss_fn)
    missing = [s.path for s, c in zip(controller.sites, found) if c is None]
    if missing:
        raise FcauditError(f"sites {missing[:3]} did not run in the forward pass; pick modules the model calls")
    # one device, also for sites on others (a device_map)
    return Captured([c.to(ids.device) for c in found], found.decoding), logits, nll


def exact_replay(model: nn.Module, controller: Controller, ids: torch.Tensor,
                 captured: tuple[Coeffs, torch.Tensor, torch.Tensor], decoding: list | None, config: AuditConfig,
                 start: int, observing: ContextManager = nullcontext()) -> Replay:
    """The exact replay check on one evaluation batch (windows from `start`): with the controller disabled, replaying
    its `captured` coefficients (decoded with `decoding`) must give the captured logits and NLL (bit-equal at
    `config.tolerance` 0; within it otherwise) and, for routers, no route flip. `observing` wraps the replay (the
    engine's budget observation). Its `record` is what a failure writes to replay.json."""
    coeffs, logits, nll = captured
    info = controller.info
    routers, calls = info.routers, [None] * len(coeffs)
    with controller.replay(coeffs, decoding, calls if routers else None), observing:
        logits_r, nll_r = forward_nll(model, ids, config.loss_fn)
    flips = sum(info.changed(i, c, coeffs[i]) for i, c in
                controller.recompute(calls, *ids.shape, routers).items()) if routers else None
    exact = torch.equal(logits_r, logits) and torch.equal(nll_r, nll)
    finite = exact or (usable_logits(logits_r) and all_finite(nll_r))  # Correct's are checked before
    dlogit = float("nan")
    if finite:  # one window at a time: no float32 copy of a whole batch's logits; equal -inf entries differ by 0
        dlogit = max(float(torch.where(x == y, 0.0, (x.float() - y.float()).abs()).max())
                     for x, y in zip(logits_r, logits))
    dnll = float((nll_r - nll).abs().max().cpu())
    tol = config.tolerance
    passed = finite and (exact if tol == 0 else (dlogit <= tol and dnll <= tol)) and not flips
    return Replay.from_json({"max_abs_dlogit": dlogit, "delta_nll": dnll, "bit_equal": exact, "route_flips": flips,
                             "passed": passed, "tolerance": tol, "windows": [start, start + ids.shape[0] - 1]})


def replay_refusal(replay: Replay, fix: str) -> str:
    """The one line naming the fix for a batch's failed exact replay check (`fix`: its controller kind's)."""
    (start, last), dlogit, flips = replay.windows, replay.max_abs_dlogit, replay.route_flips
    if math.isnan(dlogit):
        return (f"the replayed logits or NLL of windows {start}..{last} are non-finite (nan or +inf) where the model's "
                "own are finite: replaying its cached coefficients does not reproduce its forward pass; make the "
                "output path independent of the controller's computation (and deterministic)")
    if flips:  # the router recomputed on its own inputs routes otherwise: no tolerance helps
        return (f"exact replay failed on windows {start}..{last}: route flips = {flips} (max |Δlogit| = {dlogit:.3g}): "
                "the router, recomputed on the replayed trajectory, "
                "chooses otherwise than the cache, so its routing is not a function of its inputs (it samples, or its "
                "noise is reseeded between calls): make its eval routing deterministic (no sampling, no noise outside "
                "training) before auditing")
    flip = f", route flips = {flips}" if flips is not None else ""
    return (f"exact replay failed on windows {start}..{last}: max |Δlogit| = {dlogit:.3g}, ΔNLL = "
            f"{replay.delta_nll:.3g}{flip} (tolerance {replay.tolerance:g}); {fix}")


def executed(coeffs: Coeffs, codecs: Sequence[Codec], info: Description, names: tuple[str, ...]) -> torch.Tensor:
    """[B, 1 + len(names)] float64 for codecs that count what their modules run (`Codec.executed`): `active` from what
    ran, then each count of `names` summed over the sites that report it."""
    out = torch.zeros(coeffs[0].shape[0], 1 + len(names), dtype=torch.float64, device=coeffs[0].device)
    ran = {}
    for i, (c, codec) in enumerate(zip(coeffs, codecs)):
        counted = codec.executed(c)
        if counted is not None:
            ran[i] = counted[0].to(out.device)
            for j, name in enumerate(codec.counts):
                out[:, 1 + names.index(name)] += counted[1][:, j].to(out.device)
    out[:, 0] = info.active(coeffs, ran)
    return out


def non_finite_under(where: str) -> FcauditError:
    """A non-finite NLL under a condition, finite under Correct: the model's response to those coefficients."""
    return FcauditError(f"the model's NLL is non-finite (nan or inf) on {where}, while finite under Correct: the "
                        "model itself gives it with these coefficients (e.g. it divides by a gate's sum or takes a "
                        "root or log of one), so this condition cannot be scored; make the model finite for such "
                        "coefficients (e.g. clamp them) and audit it again into a new --out")


# ---- the engine --------------------------------------------------------------------------------------------------

class Engine:
    """One process's share of an audit. `ev`, `ca`: window ids [N, T] on the CPU."""

    def __init__(self, model: nn.Module, controller: Controller, windows: tuple[torch.Tensor, torch.Tensor],
                 config: AuditConfig, group: Group, first: tuple[Captured, torch.Tensor, torch.Tensor],
                 findings: Sequence[Finding] = (), state: ModelState | None = None):
        """`windows`: the (evaluation, calibration) ids; `config.out`: the audit directory, already configured and
        locked; `first`: the first evaluation batch's capture by the driver's probe (its dtypes are the sites', its
        decoding what every replay decodes with); `findings`: the pre-write checks' notices, for replay.json;
        `state`: the model's before the checks, compared after stage 1 and at the end (None: not compared)."""
        ev, ca = windows
        self.model, self.controller, self.ev, self.ca, self.dir = model, controller, ev, ca, AuditDir(config.out)
        self.info = controller.info  # protocol.ReplayContext: the sites' kinds, references and layers
        self.schedule = Schedule(ev.shape[0], ca.shape[0], config.batch_size, config.randomizations,
                                 tuple(protocol.for_controller(controller.info)))
        self.config, self.seed, self.tol, self.loss_fn = config, config.seed, config.tolerance, config.loss_fn
        self.dtypes = [c.dtype for c in first[0]]
        self.decoding = first[0].decoding
        self.paths = [s.path for s in controller.sites]
        self.group = group
        self.device = placement.input_device(model)
        self.B = config.batch_size
        self.store = CoefficientStore(self.dir.coeffs)
        self.starts = np.asarray(self.schedule.eval_starts)
        self._perm: tuple[int, np.ndarray | None] = (-1, None)
        self._taken: tuple[int, dict[bytes, Coeffs]] = (-1, {})  # stage 2's current batch: the rows read for it
        self._static: dict[str, Coeffs] = {}
        self._done: dict[tuple[str, int], set[int] | bool] = {}  # `_recorded`
        # extra record columns: what codecs that count their execution report (empty for most controllers)
        self.counts = tuple(dict.fromkeys(n for s in controller.sites for n in s.codec.counts))
        self.redone: list[str] = []  # damaged files removed for recomputation
        self.findings = tuple(findings)
        self._first = first  # stage 1 of the first batch uses it instead of running the same forward pass again
        self.state = state
        self.console = Console(stderr=True, quiet=config.quiet or not group.is_main)  # progress
        self.notices = Console(stderr=True, quiet=not group.is_main, highlight=False)  # printed even when quiet

    # ---- reuse: a unit is done when its output verifies ----------------------------------------------------------
    def _verified(self, path: Path, read: Callable[[Path], object] | None = None) -> bool:
        """Whether `path` is there and passes `read` (default: its hash and its audit); a damaged file is removed."""
        try:
            (read or self.dir.read_bound)(path)
            return True
        except FileNotFoundError:
            return False
        except files.Damaged as e:
            self.redone.append(f"{e.path.relative_to(self.dir.root)} ({e.why})")
            e.path.unlink(missing_ok=True)
            return False

    def _recorded(self, condition: str, r: int) -> set[int] | bool:
        """True when the records file of (condition, r) verifies (AuditDir's check, which the reader makes too: this
        audit's, one row per window), else the evaluation windows in its verified part files (cached: a fresh audit
        lists each (condition, r) once, not per unit)."""
        key, n = (condition, r), self.ev.shape[0]
        if key not in self._done:
            if self._verified(self.dir.records(condition, r), lambda p: self.dir.read_records(condition, r, n)):
                self._done[key] = True
            else:
                found: set[int] = set()
                for part in sorted(self.dir.parts(condition, r).glob("b*.safetensors")):
                    self._verified(part, lambda p: self.dir.read_part(p, condition, r, n, self.B, found))
                self._done[key] = found
        return self._done[key]

    def done(self, unit: Unit) -> bool:
        if unit.kind == "calibrate":
            return self._verified(self.dir.profiles) or self._verified(self.dir.calib_part(unit.start))
        if unit.kind == "capture" and not self._verified(self.store.chunk_path(unit.start)):
            return False
        recorded = self._recorded(unit.condition, unit.r)  # capture units record Correct r0
        return recorded is True or set(range(unit.start, min(unit.start + self.B, self.ev.shape[0]))) <= recorded

    # ---- the run -------------------------------------------------------------------------------------------------
    def run(self) -> None:
        """Stage 1, profiles, stage 2, merge; a failure on any rank stops every rank with its one-line error."""
        rank, world, sched = self.group.rank, self.group.world, self.schedule
        with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      TimeRemainingColumn(), console=self.console, disable=self.console.quiet) as progress:
            task = progress.add_task("audit (forward passes)", total=sched.passes_per_rank(world)[rank])
            # a quiet audit takes no progress lock per forward pass
            step = (lambda n=1: None) if progress.disable else (lambda n=1: progress.advance(task, n))  # noqa: E731
            failed: list[Replay] = []  # this rank's failed exact replay check

            def stage1() -> None:
                if (replay := self._stage1(share(sched.iter_stage1(), rank, world), step)) is not None:
                    failed.append(replay)
                    raise FcauditError(replay_refusal(replay, self.info.lead.replay_fix))

            try:
                self.group.run(stage1)
            except FcauditError as e:
                if changed_itself(e):
                    self._discard()
                # several ranks may fail the replay check at once: only the rank whose error every rank raises
                # writes the failure report, so replay.json and the error name the same windows
                elif failed and getattr(e, "rank", rank) == rank:
                    self.dir.write_json(self.dir.replay, self.dir.bound(failed[0].to_dict()))
                raise
            self._same_state("after stage 1")
            self.group.run(self._reduce_profiles, main_only=True)
            self.group.run(lambda: self._stage2(share(sched.iter_stage2(), rank, world), step))
            self._same_state("at the end", repeat=True)
        self.group.run(self._finalize, main_only=True)
        redone = [f for rank in self.group.gather(self.redone) for f in rank]  # damaged files found by any rank
        if redone:
            self.notices.print(f"resumed: recomputed {len(redone)} damaged file(s): " + "; ".join(redone[:3])
                               + (" ..." if len(redone) > 3 else ""), soft_wrap=True)

    def _same_state(self, when: str, repeat: bool = False) -> None:
        """On every rank, the model's tensors as before the checks and, if `repeat`, the first batch's Correct pass
        as in stage 1; a change removes every result of the audit (none of them is valid) before the error."""
        if self.state is None:
            return

        def check() -> None:
            self.state.check_tensors(self.model, when)
            if repeat:
                ids = self._ids(self.ev, 0)
                with running(f"evaluation windows 0..{ids.shape[0] - 1}, their Correct pass repeated at the end"):
                    again = capture_batch(self.model, self.controller, ids, self.loss_fn)
                self.state.check_pass(*again[1:])
        try:
            self.group.run(check)
        except FcauditError as e:
            if changed_itself(e):  # a model that failed a pass changed nothing: its results stay, the rerun resumes
                self._discard()
            raise

    def _discard(self) -> None:
        """Every result of the audit removed (by rank 0, once every rank has stopped): none is valid for a model
        that changed itself, and a rerun must not resume them."""
        if self.group.is_main:
            for name in ("coeffs", "calib", "parts", "records"):
                self.dir.out.remove_tree(self.dir.root / name)
            for path in (self.dir.profiles, self.dir.replay, self.dir.variation):
                self.dir.out.remove_file(path)

    def _ids(self, windows: torch.Tensor, start: int) -> torch.Tensor:
        return windows[start:start + self.B].to(self.device)

    def _stage1(self, units: Iterable[Unit], step) -> Replay | None:
        """Capture and calibration units; stops at the first failed exact replay check and returns it."""
        for u in units:
            # the probe serves the first batch or nothing (resumed, or another rank's): its logits go at once
            first, self._first = (self._first if u.kind == "capture" and u.start == 0 else None), None
            if not self.done(u):
                if u.kind == "capture":
                    if not (replay := self._capture(u.start, first)).passed:
                        return replay
                else:
                    self._calibrate(u.start)
            step(u.passes)
        return None

    def _capture(self, start: int, first: tuple[Coeffs, torch.Tensor, torch.Tensor] | None = None) -> Replay:
        """Stage 1 + the exact replay check on one evaluation batch (captured now, or `first`: the same batch's
        capture by the probe); where it passed, the chunk first, then its Correct records."""
        ids = self._ids(self.ev, start)
        where = f"evaluation windows {start}..{start + ids.shape[0] - 1}"
        if first is None:
            with running(f"{where}, capturing Correct"):
                first = capture_batch(self.model, self.controller, ids, self.loss_fn)
        coeffs, logits, nll = first
        check_finite(coeffs, where, self.paths)
        check_scores(logits, nll, f"{where} (Correct)")
        with running(f"{where}, replaying Correct for the exact replay check"):
            replay = exact_replay(self.model, self.controller, ids, (coeffs, logits, nll), self.decoding, self.config,
                                  start, self._observed(start, 0, "Correct", coeffs))
        if not replay.passed:
            if self.state is not None:  # a model that changed itself since the checks: that is the cause to name
                self.state.check_tensors(self.model, f"by the exact replay check of {where}")
            return replay
        stats = {k: replay.record[k] for k in ("max_abs_dlogit", "delta_nll", "bit_equal", "route_flips")}
        self.store.write(start, coeffs, self.dir.bound(stats))
        self._write_part("Correct", 0, np.arange(start, start + ids.shape[0]), nll, self._active(coeffs))
        return replay

    def _active(self, coeffs: Coeffs) -> torch.Tensor:
        """Per window, `active` [B]; with execution counts (`self.counts`), [B, 1 + counts] (see `executed`)."""
        if not self.counts:
            return self.info.active(coeffs)
        return executed(coeffs, [s.codec for s in self.controller.sites], self.info, self.counts)

    def _write_part(self, condition: str, r: int, examples: np.ndarray, nll: torch.Tensor, act: torch.Tensor) -> None:
        """One part file of (condition, r) records: some windows (named by the first), their NLLs and active sources."""
        files.write_tensors(self.dir.part(condition, r, int(examples[0])),
                            {"example": torch.from_numpy(examples), "nll": nll, "active": act},
                            self.dir.binding(condition, r))

    def _calibrate(self, start: int) -> None:
        ids = self._ids(self.ca, start)
        where = f"calibration windows {start}..{start + ids.shape[0] - 1}"
        with running(f"{where}, capturing the static profiles"):
            coeffs, _, _ = capture_batch(self.model, self.controller, ids, self.loss_fn)
        check_finite(coeffs, where, self.paths)
        sums = {f"layer.{l}": c for l, c in enumerate(protocol.batch_sums(coeffs))}
        files.write_tensors(self.dir.calib_part(start), sums, self.dir.bound({"count": int(ids.shape[0])}))

    def _reduce_profiles(self) -> None:
        """Static profiles from the calibration sums, added in batch order (equal bit for bit at any world size); the
        sums go once the profiles hold them, also those a run stopped just after writing the profiles left."""
        if not self._verified(self.dir.profiles):
            parts = (files.read_tensors(self.dir.calib_part(start)) for start in self.schedule.calib_starts)
            sums = (([t[f"layer.{l}"] for l in range(len(t))], m["count"]) for t, m in parts)
            profiles = protocol.static_profiles(sums, self.info)
            files.write_tensors(self.dir.profiles, {f"{c}.{l}": p for c, ps in profiles.items()
                                                    for l, p in enumerate(ps)},
                                self.dir.bound({"count": int(self.ca.shape[0]), "conditions": list(profiles)}))
        self.dir.out.remove_tree(self.dir.root / "calib")

    # ---- stage 2 -------------------------------------------------------------------------------------------------
    def _stage2(self, units: Iterable[Unit], step) -> None:
        """Replays, with the static profiles and, where it fits a GPU (`keeps_store_on`), the whole store there."""
        profiles, _ = files.read_tensors(self.dir.profiles)
        self._static = {name: [profiles[f"{name}.{l}"].to(dt).to(self.device) for l, dt in enumerate(self.dtypes)]
                        for name in self.schedule.conditions if protocol.REGISTRY[name].kind == "static"}
        if keeps_store_on(self.device, self.store.row_bytes(0) * self.ev.shape[0]):
            self.store.load(self.starts, self.ev.shape[0], self.device)
        try:
            self._replays(units, step)
        finally:
            self.store.unload()

    def _replays(self, units: Iterable[Unit], step) -> None:
        """The pending replays of each randomization r, batch by batch: a batch's conditions run one after the other
        and read its rows (and its donors') once (`take`), so peak memory stays flat with the windows. Each (condition,
        r) keeps its NLLs and active counts in arrays over the windows until r ends, then writes them (`_write_run`)."""
        ev, n = self.ev.to(self.device), self.ev.shape[0]  # once, not per batch (on the CPU the same tensor)
        order = {c: i for i, c in enumerate(protocol.REGISTRY)}
        active_shape = (n, 1 + len(self.counts)) if self.counts else (n,)  # see `_active`
        for _, same_r in groupby(units, lambda u: u.r):
            runs: dict[tuple[str, int], tuple[list, np.ndarray, np.ndarray]] = {}
            for u in sorted(same_r, key=lambda u: (u.start, order[u.condition])):
                if not self.done(u):
                    if u.start != self._taken[0]:
                        self._taken = (u.start, {})
                    rows = slice(u.start, min(u.start + self.B, n))
                    coeffs = protocol.REGISTRY[u.condition].make(self, u.r, np.arange(rows.start, rows.stop))
                    ranges, nll, act = runs.setdefault((u.condition, u.r), ([], np.empty(n), np.empty(active_shape)))
                    act[rows] = self._active(coeffs).cpu().numpy()
                    where = f"evaluation windows {rows.start}..{rows.stop - 1} under {u.condition} r{u.r}"
                    with self.controller.replay(coeffs, self.decoding), running(where), \
                            self._observed(u.start, u.r, u.condition, coeffs):
                        # the NLL alone: the logits go now, not during the next forward
                        scores = forward_nll(self.model, ev[rows], self.loss_fn)[1]
                    if not all_finite(scores):
                        raise non_finite_under(where)
                    nll[rows] = scores.cpu().numpy()
                    ranges.append(rows)
                step()
            self._taken = (-1, {})
            for key, run in runs.items():
                self._write_run(key, *run)

    @contextmanager
    def _observed(self, start: int, r: int, condition: str, coeffs: Coeffs) -> Iterator[None]:
        """On the first batch of every condition (its randomization 0), the rows that entered the blocks `runs=` named,
        checked against the replayed decisions (`observed_budget`); elsewhere nothing."""
        if start != 0 or r != 0 or not self.controller.observed:
            yield
            return
        with self.controller.observing(coeffs[0].shape[0]) as seen:
            yield
        found = observed_budget(self.controller, coeffs, seen, condition)
        if found is not None:
            raise FcauditError(found.line)

    def _write_run(self, key: tuple[str, int], ranges: list[slice], nll: np.ndarray, act: np.ndarray) -> None:
        """The windows `ranges` of one (condition, r), their rows of `nll` and `act` filled: its records file when it
        holds every window (one process, nothing resumed), else a part file for the final merge."""
        if sum(r.stop - r.start for r in ranges) == self.ev.shape[0]:
            self._write_records(*key, nll, act)
            self._done[key] = True
        else:
            examples = np.concatenate([np.arange(r.start, r.stop) for r in ranges])
            self._write_part(*key, examples, torch.from_numpy(nll[examples]), torch.from_numpy(act[examples]))

    def _write_records(self, condition: str, r: int, nll: np.ndarray, act: np.ndarray) -> None:
        """The records of (condition, r), one row per evaluation window in window order."""
        n = self.ev.shape[0]
        columns = {"example": np.arange(n, dtype=np.int64), "condition": condition,
                   "randomization": np.full(n, r, dtype=np.int64), "nll": nll,
                   "tokens": np.full(n, self.ev.shape[1] - 1, dtype=np.int64), "active": act}
        counts = {}
        if act.ndim == 2:  # active, then the execution counts (see `executed`)
            columns["active"] = np.ascontiguousarray(act[:, 0])
            counts = {name: act[:, 1 + j].astype(np.int64) for j, name in enumerate(self.counts)}  # exact sums
        columns = {**{c: columns[c] for c in protocol.RECORD_COLUMNS}, **counts}
        files.write_columns(self.dir.records(condition, r), columns, self.dir.binding(condition, r))

    # ---- the ReplayContext of protocol.Condition.make -------------------------------------------------------------
    def take(self, examples: np.ndarray) -> Coeffs:
        """The rows of `examples`, read once per batch of stage 2 (its own rows, its donors' rows)."""
        taken = self._taken[1]
        key = examples.tobytes()
        if key not in taken:
            taken[key] = self.store.take(examples, self.starts)
            if self.device.type == "cuda" and self.store.device != self.device:
                taken[key] = [c.pin_memory().to(self.device, non_blocking=True) for c in taken[key]]
        return taken[key]

    def derangement(self, r: int) -> np.ndarray:
        if self._perm[0] != r:  # one derangement per randomization, shared by CrossInput and CrossShuffle
            self._perm = (r, protocol.derangement(self.ev.shape[0], self.seed, r))
        return self._perm[1]

    def static(self, condition: str, batch: int) -> Coeffs:
        return [protocol.expand(p, batch, self.ev.shape[1]) for p in self._static[condition]]

    # ---- the end: merge records, replay report, variation ---------------------------------------------------------
    def _merge_parts(self, condition: str, r: int) -> None:
        """The part files of (condition, r) into its records file, each window's row put in its place as the parts
        are read (no list of them: memory stays that of the records)."""
        n, nll, act = self.ev.shape[0], None, None
        times = np.zeros(n, dtype=np.int64)  # how often each window was found

        def uncovered() -> FcauditError:
            self.dir.out.remove_tree(self.dir.parts(condition, r))  # so that the rerun the message names redoes them
            return FcauditError(f"the records of {condition} r{r} do not cover each evaluation window once; rerun "
                                "the audit command to recompute them")

        for path in sorted(self.dir.parts(condition, r).glob("b*.safetensors")):
            part = {k: t.numpy() for k, t in files.read_tensors(path)[0].items()}
            example = part["example"]
            if len(example) and (example.min() < 0 or example.max() >= n):
                raise uncovered()
            if nll is None:
                nll = np.empty(n, part["nll"].dtype)
                act = np.empty((n, *part["active"].shape[1:]), part["active"].dtype)
            nll[example], act[example] = part["nll"], part["active"]
            np.add.at(times, example, 1)
        if nll is None or not (times == 1).all():
            raise uncovered()
        self._write_records(condition, r, nll, act)
        self.dir.out.remove_tree(self.dir.parts(condition, r))

    def _replay_summary(self) -> dict:
        """replay.json: the exact replay check over all capture batches, from their chunks' headers."""
        checks = [(m["max_abs_dlogit"], m["delta_nll"], m["bit_equal"], m.get("route_flips"))
                  for m in map(self.store.metadata, self.starts.tolist())]
        dlogit, dnll, bit_equal, flips = zip(*checks)
        flips = [f for f in flips if f is not None]
        return {"max_abs_dlogit": max(dlogit), "delta_nll": max(dnll), "bit_equal": all(bit_equal),
                "route_flips": sum(flips) if flips else None,
                "passed": True, "tolerance": self.tol, "windows": int(self.ev.shape[0]),
                "findings": [f.to_json() for f in self.findings]}

    def _finalize(self) -> None:
        for condition, r in self.schedule.record_keys():
            if self._recorded(condition, r) is not True:
                self._merge_parts(condition, r)
        self.dir.out.remove_tree(self.dir.root / "parts")
        # rewritten anyway; the check says so if it was damaged
        self._verified(self.dir.replay, lambda p: self.dir.read_replay())
        self.dir.write_json(self.dir.replay, self.dir.bound(self._replay_summary()))
        if not self._verified(self.dir.variation, lambda p: self.dir.read_variation()):
            self.dir.write_json(self.dir.variation, self.dir.bound(variation(self.store, self.starts, self.paths,
                                                                          self.info.layers)))
        if self.config.execution and not self._verified(self.dir.execution, lambda p: self.dir.read_execution()):
            self.dir.write_json(self.dir.execution, self.dir.bound(audit_execution(
                self.model, self.controller, self._ids(self.ev, 0))))
