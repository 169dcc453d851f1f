"""Algorithm 1 (Frozen-Controller Audit) from the user's side: check the inputs, probe the model, fix the
configuration, lock the audit directory, run the work units (audit.engine) and return the results.

Every finished unit is written atomically and verified when reused, so rerunning the same command resumes an
interrupted audit; randomness is keyed by (seed, randomization, example), so a resumed audit yields the same records
bit for bit as an uninterrupted one.
"""

from __future__ import annotations

import hashlib
import math
import os
import secrets
import tempfile
import time
import weakref
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from rich.console import Console
from rich.table import Table
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from fcaudit import placement, protocol
from fcaudit.audit import files
from fcaudit.audit.directory import AuditDir, Locked, config_hash, differences, identity, stored_identity
from fcaudit.audit.engine import Engine, LossFn, capture_batch, keeps_store_on
from fcaudit.audit.files import tensor_sha256
from fcaudit.audit.group import Group, launched_world
from fcaudit.audit.results import AuditResult
from fcaudit.audit.store import all_finite, check_finite
from fcaudit.audit.units import Schedule
from fcaudit.controllers.site import Controller
from fcaudit.errors import FcauditError, one_line
from fcaudit.io import write_text
from fcaudit.loss import logits_of
from fcaudit.protocol import Criteria


# ---- inputs -----------------------------------------------------------------------------------------------------

def as_windows(windows, what: str) -> tuple[torch.Tensor, object | None]:
    """ids [N, T] int64 from a tensor, a list of rows, or a WindowSet (anything with `.ids`)."""
    window_set = windows if hasattr(windows, "ids") else None
    ids = windows.ids if window_set is not None else windows
    if isinstance(ids, (list, tuple)):
        lengths = sorted({len(row) for row in ids})
        if len(lengths) > 1:
            raise FcauditError(f"{what} windows have unequal lengths {lengths[:4]}; cut every window to one length (--window)")
        ids = torch.stack([torch.as_tensor(row) for row in ids]) if ids else torch.empty(0, 0, dtype=torch.long)
    ids = torch.as_tensor(ids)
    if ids.dim() != 2 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise FcauditError(f"{what} windows must be an integer tensor [N, T] of token ids, got {ids.dtype} {tuple(ids.shape)}")
    return ids.long().cpu(), window_set


def check_windows(ev: torch.Tensor, ca: torch.Tensor, ev_set, ca_set) -> None:
    if ev.shape[0] < 2:
        raise FcauditError(f"{ev.shape[0]} evaluation window(s): CrossInput needs a derangement, so pass at least 2 (--eval)")
    if ca.shape[0] < 1:
        raise FcauditError("no calibration windows: static profiles need at least 1 (--calib)")
    if ev.shape[1] != ca.shape[1]:
        raise FcauditError(f"evaluation windows have length {ev.shape[1]} but calibration windows {ca.shape[1]}; "
                           "use one window length for both (--window)")
    if ev.shape[1] < 2:
        raise FcauditError("windows need at least 2 tokens for a next-token NLL; pass a longer --window")
    # rows by their hash (a set of the rows' bytes would copy every evaluation window), equality checked on a match
    evn, by_hash = ev.numpy(), {}
    for i, row in enumerate(evn):
        by_hash.setdefault(hash(row.tobytes()), []).append(i)
    shared = sum(any(np.array_equal(row, evn[i]) for i in by_hash.get(hash(row.tobytes()), ())) for row in ca.numpy())
    if shared:
        raise FcauditError(f"{shared} calibration window(s) equal evaluation windows; draw calibration windows "
                           "from a different split (e.g. validation) than the evaluation windows (test), or, when "
                           "they already are (as fcaudit audit draws them), use a corpus whose text does not repeat")
    starts = [getattr(s, "starts", None) for s in (ev_set, ca_set)]
    if all(s is not None for s in starts) and ev_set.split == ca_set.split:
        t = ev.shape[1]
        e = np.sort(np.asarray(starts[0]))
        c = np.asarray(starts[1])
        # a calibration window [c, c+t) overlaps an eval window [e, e+t) iff some e lies in (c-t, c+t)
        nxt = np.searchsorted(e, c - t + 1)
        if np.any((nxt < len(e)) & (e[np.minimum(nxt, len(e) - 1)] < c + t)):
            raise FcauditError(f"calibration windows overlap evaluation windows in split {ev_set.split!r}; "
                               "take them from another split or non-overlapping ranges")


# ---- model helpers ----------------------------------------------------------------------------------------------

def parameter_hash(model: nn.Module) -> str:
    h = hashlib.sha256()
    for name, t in placement.named_tensors(model):  # an offloaded layer's weights too, one module at a time
        h.update(name.encode())
        h.update(str(t.dtype).encode())
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())  # the buffer: no copy
    return h.hexdigest()




def vocab_size(model: nn.Module) -> int | None:
    """The number of token ids the model embeds (input embedding rows), when it has one."""
    get = getattr(model, "get_input_embeddings", None)
    emb = get() if callable(get) else next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    return int(emb.num_embeddings) if isinstance(emb, nn.Embedding) else None


def check_ids(model: nn.Module, *windows: torch.Tensor) -> None:
    """Token ids the model embeds, in windows no longer than its context (positions it was never trained on
    would give NLLs of another model; some models do not refuse them)."""
    from fcaudit.families import context_length

    vocab, context = vocab_size(model), context_length(model)
    for ids in windows:
        if context is not None and ids.dim() == 2 and ids.shape[1] > context:
            raise FcauditError(f"windows of {ids.shape[1]} tokens exceed the model's context of {context} positions; "
                               f"pass windows of at most {context} tokens (--window {context})")
        if ids.numel() and (int(ids.min()) < 0 or (vocab is not None and int(ids.max()) >= vocab)):
            raise FcauditError(f"token ids range over [{int(ids.min())}, {int(ids.max())}] but the model embeds ids "
                               f"0..{vocab - 1 if vocab else '?'}; encode the windows with the model's tokenizer")


# A layout check compares window 0 captured alone with its row of the batch. Batched and single-window forward
# passes may round differently (a GPU picks other kernels for other batch sizes; a router may then pick another
# expert at a near-tie): half the positions must agree, at the tolerance of the site's own precision. A layout
# naming the axes in the wrong order moves whole rows between windows: next to no position agrees.
AGREEING_POSITIONS = 0.5
SITE_CHECK_PASSES = 2  # check_sites_read's single-window forward passes, run by every audit (and resume) before its
# units; plan() and Schedule count the units' passes only


def check_sites_read(model: nn.Module, controller: Controller, first: torch.Tensor, coeffs: list[torch.Tensor],
                     loss_fn: LossFn | None) -> str | None:
    """Two single-window forward passes on window 0 that check the controller is read as the audit assumes:
    - captured alone, its coefficients must be its row of the batch's capture (else an error): a layout that names
      the axes of a flattened output in the wrong order ("(token batch)" for "(batch token)") passes the exact
      replay check but moves coefficients between windows;
    - replaying zeros for every coefficient should change its logits. When it does not, returns a notice: either
      the coefficients have no effect (e.g. gated branches that output zero at initialization), or the model does
      not use what its sites return (it keeps the gate's value in an attribute), and then every replay measures
      nothing. The logits cannot tell the two apart. A codec that refuses all-zero coefficients skips this."""
    one = first[:1]
    alone, logits_alone, _ = capture_batch(model, controller, one, loss_fn)
    if first.shape[0] > 1:
        for site, a, c in zip(controller.sites, alone, coeffs):
            row = c[:1].to(a.device)
            if a.shape != row.shape or a.dtype != row.dtype:
                continue  # a site whose canonical shape depends on the batch: nothing to compare
            scale = float(row.abs().amax()) if row.numel() else 0.0
            native = site.dtype if site.dtype is not None and site.dtype.is_floating_point else row.dtype
            # the precision the model computed in (a codec may widen bf16 router weights to float32): bf16 ~6%
            rtol = max(1e-3, 8 * torch.finfo(native).eps) if row.is_floating_point() else 0.0
            close = torch.isclose(a.double(), row.double(), rtol=rtol, atol=rtol * scale).all(-1)  # per position
            if close.numel() and float(close.double().mean()) < AGREEING_POSITIONS:
                raise FcauditError(f"site {site.path!r}: window 0's coefficients captured alone differ from its row "
                                   f"of the batch ({float(close.double().mean()):.0%} of positions agree): check the "
                                   f"layout {site.codec.describe()!r} names the output's axes in their order (e.g. "
                                   "'(batch token) expert' for a [batch*token, expert] output); if the routing "
                                   "depends on the other windows of a batch (capacity limits), use batch size 1")
    try:
        with controller.replay([torch.zeros_like(a) for a in alone]):
            unchanged = torch.equal(logits_of(model(one)), logits_alone)
    except (FcauditError, ValueError, IndexError):  # a codec that refuses all-zero coefficients: no conclusion
        return None
    if not unchanged:
        return None
    return ("note: replaying zeros for every coefficient leaves the logits unchanged: the coefficients have no effect "
            "on this model, or it does not use what its sites return (e.g. it keeps the gate's value in an "
            "attribute), and then the interventions below measure nothing: point the pattern at the modules whose "
            "output the model consumes")


def _check_int(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise FcauditError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


# ---- plan -------------------------------------------------------------------------------------------------------

@dataclass
class AuditPlan:
    """Sizes of an audit, from one 1-window forward pass."""

    n_eval: int
    n_calib: int
    window: int
    batch_size: int
    randomizations: int
    conditions: list[str]
    layer_shapes: list[list[int]]  # canonical [token, stream, source] per layer
    coeff_dtype: str
    store_bytes: int
    forward_passes: int
    param_bytes: int
    activation_bytes: int  # measured growth of one 1-window forward pass, beyond the parameters
    peak_memory_bytes: int  # parameters + batch_size x (activations + the first pass's logits + 3 x coefficients)
    world_size: int = 1
    passes_per_rank: list[int] | None = None
    store_device: str | None = None  # where the replays hold the whole store (keeps_store_on), if anywhere
    devices: list[str] | None = None  # a model spread by a device map: its devices (the memory is over all of them)

    def __str__(self) -> str:
        split = ""
        if self.world_size > 1:
            split = f"; {self.world_size} processes: forward passes per rank {self.passes_per_rank}"
        held = f"; the replays also hold the store on {self.store_device}" if self.store_device else ""
        over = f" over {', '.join(self.devices)} (its device map)" if self.devices else ""
        return (f"{len(self.layer_shapes)} sites, store {_size(self.store_bytes)}, "
                f"{self.forward_passes} forward passes ({', '.join(self.conditions)}), peak memory "
                f"~{_size(self.peak_memory_bytes)} (parameters {_size(self.param_bytes)} + {self.batch_size} x "
                f"{_size(self.activation_bytes)} per window){over}{held}{split}")


def _size(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


class _PeakBytes(TorchDispatchMode):
    """The bytes of the tensors that the ops run within it allocate, live at once at their peak (a tensor is live
    until its last reference goes; a view of a live tensor adds nothing)."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self._held: set[int] = set()

    def _free(self, ptr: int, nbytes: int) -> None:
        self._held.discard(ptr)
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                storage = t.untyped_storage()
                ptr, nbytes = storage.data_ptr(), storage.nbytes()
                if nbytes and ptr not in self._held:
                    self._held.add(ptr)
                    self.live += nbytes
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(t, self._free, ptr, nbytes)
        return out


def _activation_bytes(model: nn.Module, controller: Controller, one: torch.Tensor) -> int:
    """Memory one forward pass of one window allocates beyond the parameters at its peak, after a warm-up pass (lazy
    tables built): from CUDA's allocator statistics on a GPU, from the tensors its ops make on the CPU."""
    device = one.device
    with torch.inference_mode():
        capture_batch(model, controller, one, None)  # warm-up: weights paged in, lazy tables built
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
            capture_batch(model, controller, one, None)
            return int(torch.cuda.max_memory_allocated(device) - base)
        with _PeakBytes() as counted:
            capture_batch(model, controller, one, None)
        return counted.peak


def plan(model: nn.Module, controller: Controller, eval_windows, calib_windows=None, *, batch_size: int = 8,
         randomizations: int = 20, world_size: int = 1) -> AuditPlan:
    """What an audit of these windows will cost: store size, forward passes (split over `world_size` processes),
    peak memory: the parameters plus, per window of a batch, the measured activations of a one-window forward pass,
    the capture pass's logits (kept while the exact replay check runs) and three windows of coefficients."""
    from fcaudit.audit.units import split

    randomizations = _check_int("randomizations", randomizations, 1)
    batch_size = _check_int("batch size", batch_size, 1)
    world_size = _check_int("world size", world_size, 1)
    ev, _ = as_windows(eval_windows, "evaluation")
    check_ids(model, ev)
    n_calib = 0 if calib_windows is None else as_windows(calib_windows, "calibration")[0].shape[0]
    device = placement.input_device(model)
    was_training = model.training
    model.eval()
    try:
        one = ev[:1].to(device)
        acts = _activation_bytes(model, controller, one)
        with torch.inference_mode():
            coeffs, logits_of_one, _ = capture_batch(model, controller, one, None)
    finally:
        model.train(was_training)
    check_finite(coeffs, "a 1-window forward")
    per_window = sum(c.numel() * c.element_size() for c in coeffs)
    logits = logits_of_one.numel() * logits_of_one.element_size()  # the capture's logits, kept for the check
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    conditions = protocol.for_controller(controller.info)
    sched = Schedule(ev.shape[0], n_calib, batch_size, randomizations, tuple(conditions))
    per_rank = [sum(u.passes for u in split(sched.stage1(), k, world_size) + split(sched.stage2(), k, world_size))
                for k in range(world_size)]
    store = per_window * ev.shape[0]
    return AuditPlan(ev.shape[0], n_calib, ev.shape[1], batch_size, randomizations, conditions,
                     [list(c.shape[1:]) for c in coeffs], str(coeffs[0].dtype).replace("torch.", ""),
                     store, sched.forward_passes(), param_bytes, acts,
                     param_bytes + batch_size * (acts + logits + 3 * per_window), world_size, per_rank,
                     str(device) if keeps_store_on(device, store) else None,
                     sorted(set(placement.device_map(model).values())) if placement.is_dispatched(model) else None)


dry_run = plan


def against_out(out: str | Path, model: nn.Module, controller: Controller, eval_windows, calib_windows,
                planned: AuditPlan, *, seed: int = 0, tolerance: float = 0.0, criteria=None,
                model_info: dict | None = None) -> str | None:
    """For a dry run into `out`: a line saying whether the real run would resume the audit `out` holds or refuse it
    (another configuration, and which fields); None when `out` holds no audit results."""
    adir = AuditDir(out)
    current = files.quietly(files.read_json, adir.config_path) if adir.is_ours() else None
    if current is None or not adir.has_results():
        return None
    ev, ev_set = as_windows(eval_windows, "evaluation")
    ca, ca_set = as_windows(calib_windows, "calibration")
    config = _config(model, controller, ev, ca, ev_set, ca_set, conditions=planned.conditions,
                     randomizations=planned.randomizations, seed=seed, batch_size=planned.batch_size,
                     tolerance=tolerance, loss_fn=None, criteria=criteria, model_info=model_info,
                     coeff_dtype=planned.coeff_dtype)
    changed = differences(stored_identity(current), identity(config))
    if changed:
        return f"note: {out} holds an audit with another configuration (differs in {changed}): the real run would " \
               "refuse it; pass a new --out"
    return f"note: {out} holds this audit: the real run resumes it"


# ---- the audit --------------------------------------------------------------------------------------------------

def _config(model, controller, ev, ca, ev_set, ca_set, *, conditions, randomizations, seed, batch_size, tolerance,
            loss_fn, criteria, model_info, coeff_dtype) -> dict:
    try:
        crit = criteria if isinstance(criteria, Criteria) else Criteria.from_dict(criteria or {})
    except AttributeError:
        raise FcauditError(f"criteria must be a fcaudit.Criteria or a dict, got {type(criteria).__name__}") from None
    windows = {"n_eval": int(ev.shape[0]), "n_calib": int(ca.shape[0]), "window": int(ev.shape[1]),
               "eval_sha256": tensor_sha256(ev), "calib_sha256": tensor_sha256(ca)}
    for name, s in (("eval", ev_set), ("calib", ca_set)):
        if s is not None and getattr(s, "split", None) is not None:
            windows[f"{name}_split"] = s.split
    model_desc = {**(model_info or {}), "class": type(model).__name__,
                  "n_params": sum(p.numel() for p in model.parameters()), "params_sha256": parameter_hash(model),
                  "dtype": next((str(p.dtype).replace("torch.", "") for p in model.parameters()), None),
                  "device_type": placement.input_device(model).type, "coeff_dtype": coeff_dtype}
    return {"format": 2, "seed": int(seed), "randomizations": int(randomizations), "batch_size": int(batch_size),
            "tolerance": float(tolerance), "conditions": list(conditions), "windows": windows, "model": model_desc,
            "controller": controller.describe(), "labels": controller.labels,
            "loss": "token_nll" if loss_fn is None else getattr(loss_fn, "__qualname__", repr(loss_fn)),
            "criteria": crit.to_dict()}


def _lock_and_open(adir: AuditDir, config: dict, group: Group) -> str:
    try:
        adir.lock()
    except Locked as e:
        if group.world == 1 and launched_world() > 1:  # every torchrun rank running the whole audit on its own
            raise FcauditError(f"{e}; under torchrun pass group=fcaudit.audit.group_from_env() so the ranks share "
                               "one audit") from None
        raise
    return adir.open(config)


def _prepare(model: nn.Module, controller: Controller, eval_windows, calib_windows, *, randomizations, seed,
             batch_size, tolerance, loss_fn, criteria, model_info, out, world) -> tuple:
    """Check the inputs, probe the first batch and fix the configuration: (eval ids, calib ids, probe, config, a
    notice of `check_sites_read` or None). The
    probe is the first evaluation batch's capture (coefficients, logits, NLL): stage 1 uses it for that batch."""
    if out is None and world > 1:
        raise FcauditError(f"{world} processes share this audit but no out directory was given; pass out= (a "
                           "directory every rank sees)")
    randomizations = _check_int("randomizations", randomizations, 1)
    batch_size = _check_int("batch size", batch_size, 1)
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise FcauditError(f"seed must be an integer >= 0 (numpy's generators take no negative seed), got {seed!r}")
    if not (isinstance(tolerance, (int, float)) and tolerance >= 0 and math.isfinite(tolerance)):
        raise FcauditError(f"tolerance must be a number >= 0, got {tolerance!r}")
    if not isinstance(controller, Controller):
        raise FcauditError(f"controller must be a fcaudit.Controller (fcaudit.controller_for(model)), got "
                           f"{type(controller).__name__}")
    modules = {id(m) for m in model.modules()}
    foreign = [s.path for s in controller.sites if id(s.module) not in modules]
    if foreign:
        raise FcauditError(f"the controller's site {foreign[0]!r} is a module of another model instance; build the "
                           "controller from this model (fcaudit.controller_for(model) or Controller.from_modules)")
    ev, ev_set = as_windows(eval_windows, "evaluation")
    ca, ca_set = as_windows(calib_windows, "calibration")
    check_windows(ev, ca, ev_set, ca_set)
    check_ids(model, ev, ca)
    # probe the first batch before anything is written: layouts, non-finite values, site coverage, the loss;
    # it also fixes each site's codec metadata, so every replay decodes alike on every rank
    first = ev[:batch_size].to(placement.input_device(model))
    try:
        probe = capture_batch(model, controller, first, loss_fn, remember=True)
    except (IndexError, RuntimeError) as e:  # e.g. windows beyond a model's position table that it does not declare
        raise FcauditError(f"the model's forward pass on the first evaluation batch ({first.shape[0]} windows of "
                           f"{first.shape[1]} tokens) failed ({type(e).__name__}: {one_line(e)}); check that the "
                           "windows fit the model (its context and vocabulary) and a batch fits in memory (batch "
                           "size)") from e  # the cause's traceback stays, for a bug in the model's own code
    coeffs, logits, _ = probe
    check_finite(coeffs, "the first evaluation batch", [s.path for s in controller.sites])
    if not all_finite(logits):
        raise FcauditError("the model's logits on the first evaluation batch are non-finite (nan or inf); fix the "
                           "model or its dtype (e.g. load in float32) before auditing")
    notice = check_sites_read(model, controller, first, coeffs, loss_fn)
    config = _config(model, controller, ev, ca, ev_set, ca_set, conditions=protocol.for_controller(controller.info),
                     randomizations=randomizations, seed=seed, batch_size=batch_size, tolerance=tolerance,
                     loss_fn=loss_fn, criteria=criteria, model_info=model_info,
                     coeff_dtype=str(coeffs[0].dtype).replace("torch.", ""))
    return ev, ca, probe, config, notice


SHARED_CHECK = ".fcaudit-ranks"  # rank 0's token in the audit directory, removed once every rank has read it
SHARED_WAIT = (0.0, 0.5, 1, 2, 4, 8, 16, 30)  # seconds between looks: an NFS client caches "not found" up to ~60 s


def _check_shared(adir: AuditDir, group: Group) -> None:
    """Every rank must see rank 0's audit directory: a node-local path, or other paths on other ranks, would split
    the audit's files (found only once the merge misses them). Rank 0 writes a token there; every rank reads it,
    looking again for about a minute (a network filesystem's cache may still say the directory is empty)."""
    token = group.gather(secrets.token_hex(8))[0]  # rank 0's, on every rank
    path = adir.root / SHARED_CHECK

    def read() -> None:
        seen = None
        for wait in SHARED_WAIT:
            time.sleep(wait)
            if adir.root.is_dir():
                os.listdir(adir.root)  # refreshes a network filesystem's view of the directory
            seen = path.read_text() if path.is_file() else None
            if seen == token:
                return
        raise FcauditError(f"rank {group.rank} does not see rank 0's audit directory at {adir.root} ("
                           f"{'its check file is missing' if seen is None else 'another audit is there'}): --out "
                           "must be one directory that every rank shares (a network filesystem), at one path")
    try:
        group.run(lambda: write_text(path, token), main_only=True)
        group.run(read)
    finally:
        if group.is_main:
            path.unlink(missing_ok=True)


def _check_same(configs: list[dict]) -> None:
    """Every rank must audit the same model, windows and settings (e.g. the same checkpoint on every node)."""
    digests = [config_hash(c) for c in configs]
    if len(set(digests)) > 1:
        odd = next(k for k, d in enumerate(digests) if d != digests[0])
        fields = differences(identity(configs[0]), identity(configs[odd]))
        raise FcauditError(f"rank {odd} has another audit configuration than rank 0 (differs in {fields}); give "
                           "every node the same checkpoint and corpus")


def audit(model: nn.Module, controller: Controller, eval_windows, calib_windows, randomizations: int = 20,
          seed: int = 0, out: str | Path | None = None, *, batch_size: int = 8, tolerance: float = 0.0,
          loss_fn: LossFn | None = None, criteria=None, model_info: dict | None = None, quiet: bool = False,
          group: Group | None = None) -> AuditResult:
    """Run (or resume) a Frozen-Controller Audit of `model` and return its results (also written to `out`).

    eval_windows / calib_windows: int tensors [N, T] of token ids or `fcaudit.data.WindowSet`s.
    batch_size: windows per forward pass. tolerance: 0 demands bit-equal replay of logits and NLL; a positive value
    accepts max |Δlogit| and max |ΔNLL| up to it (recorded in replay.json). loss_fn(output, ids) -> [B] replaces the
    next-token NLL (the logits are still read from the output, for the exact replay check). criteria: a
    fcaudit.Criteria (or dict) fixed before the audit runs. model_info: what the config records about the model;
    its "family" is the name `summarize` pools checkpoints by as training seeds (default: class and size), and
    "checkpoint" where it came from. quiet: no progress bar or summary table.
    group: the processes sharing this audit (default: this process alone); under torchrun pass
    `fcaudit.audit.group_from_env(device)` and every rank runs its share of the work units.
    """
    group = group or Group()
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            # an agreed phase: bad input on any rank stops every rank with its one-line error
            ev, ca, probe, config, notice = group.run(lambda: _prepare(
                model, controller, eval_windows, calib_windows, randomizations=randomizations, seed=seed,
                batch_size=batch_size, tolerance=tolerance, loss_fn=loss_fn, criteria=criteria,
                model_info=model_info, out=out, world=group.world))
            if notice and group.is_main:  # printed even when quiet: it may mean the results measure nothing
                Console(stderr=True, highlight=False).print(notice, soft_wrap=True)
            out = Path(out) if out is not None else Path(tempfile.mkdtemp(prefix="fcaudit-audit-"))
            adir = AuditDir(out)
            configs = group.gather(config)
            group.run(lambda: _check_same(configs))
            try:
                # rank 0 alone locks and configures the directory, inside an agreed phase: a lock held by another
                # process (or a refused configuration) stops every rank with the same error instead of leaving the
                # other ranks waiting at the next barrier
                state = group.run(lambda: _lock_and_open(adir, config, group), main_only=True)
                if group.world > 1:
                    _check_shared(adir, group)
                schedule = Schedule(ev.shape[0], ca.shape[0], config["batch_size"], config["randomizations"],
                                    tuple(config["conditions"]))
                engine = Engine(model, controller, ev, ca, adir, schedule, seed=int(seed), tolerance=float(tolerance),
                                loss_fn=loss_fn, dtypes=[c.dtype for c in probe[0]], group=group, quiet=quiet,
                                first=probe)
                del probe  # the engine holds it until the first batch's capture, then lets it go
                if state == "repaired":
                    engine.redone.append("config.json (rewritten: the marker holds its hash)")
                engine.run()
            finally:
                adir.unlock()
    finally:
        model.train(was_training)
    # the engine finished: every records file is written and verified (`AuditResult.load` would read the metadata
    # of each again, ~1% of a small audit)
    result = AuditResult(adir.root, adir.config(), files.read_json(adir.replay))
    if not quiet and group.is_main:
        print_summary(result)
    return result


def print_summary(result: AuditResult, console: Console | None = None) -> None:
    """Mean ΔNLL per condition (rich table), with the replay check on top and retention (or why it is undefined)."""
    console = console or Console()
    rep = result.replay
    flips = "" if rep.get("route_flips") is None else f" route flips={rep['route_flips']}"
    console.print(f"exact replay: passed={rep['passed']} bit_equal={rep.get('bit_equal')} "
                  f"max|Δlogit|={rep['max_abs_dlogit']:.3g} ΔNLL={rep['delta_nll']:.3g}{flips}", markup=False)
    table = Table(title=f"FCA penalties ({result.path})" + (" [PARTIAL]" if result.partial else ""))
    active = "experts" if rep.get("route_flips") is not None else "active"  # per token
    table.add_column("condition", overflow="fold")
    for col in ("mean ΔNLL", f"{100 * result.penalties_confidence:g}% CI", "MC SE", active):
        table.add_column(col, justify="right", no_wrap=True)
    for _, row in result.penalties().iterrows():
        table.add_row(row["label"], f"{row['mean']:.6f}", f"[{row['ci_low']:.6f}, {row['ci_high']:.6f}]",
                      "" if not np.isfinite(row["mc_se"]) else f"{row['mc_se']:.2g}",
                      "" if not np.isfinite(row["active"]) else f"{row['active']:.3g}")
    console.print(table)
    for line in result.retention_lines():
        console.print(line, markup=False, highlight=False)
