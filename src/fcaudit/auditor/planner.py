"""The dry run: what an audit of these windows will cost (store, forward passes, memory), measured from a one-window
and a two-window forward pass; `fca.plan` returns it and `fcaudit audit --dry-run` prints it."""

from __future__ import annotations

import weakref
from contextlib import nullcontext
from dataclasses import dataclass, replace

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from fcaudit import placement, protocol
from fcaudit.auditor.engine import capture_batch, keeps_store_on
from fcaudit.auditor.inputs import as_windows, check_controller, check_ids, evaluating, first_forward
from fcaudit.auditor.state import STATE_CHECK_PASSES
from fcaudit.auditor.store import check_finite
from fcaudit.auditor.units import Schedule
from fcaudit.config import AuditConfig, with_settings
from fcaudit.controllers.checks import BATCH_CHECK_PASSES, check_passes, follow
from fcaudit.controllers.controller import Controller


@dataclass
class AuditPlan:
    """What `fca.plan` returns: `str(plan)` is the line `fcaudit audit --dry-run` prints, the fields the numbers
    behind it (bytes, forward passes in all and per rank, each site's canonical [token, stream, source] shape). The
    forward passes are all an audit runs: its work units', every rank's checks' (`check_passes` of them)
    and, on ranks other than 0, the probe's (rank 0's is the first batch's capture)."""

    n_eval: int
    n_calib: int
    window: int
    batch_size: int
    randomizations: int
    conditions: list[str]
    layer_shapes: list[list[int]]
    coeff_dtype: str
    store_bytes: int
    forward_passes: int
    param_bytes: int
    activation_bytes: int  # measured growth of a forward pass per window it holds, beyond the parameters
    # parameters + plan + pass_bytes + windows per pass x (activations + the first pass's logits + 3 x coefficients):
    # the tensors' bytes (the C allocator may hold more, e.g. freed heap memory glibc keeps)
    peak_memory_bytes: int
    world_size: int = 1
    passes_per_rank: list[int] | None = None
    store_device: str | None = None  # where the replays hold the whole store (keeps_store_on), if anywhere
    devices: list[str] | None = None  # a model spread by a device map: its devices (the memory is over all of them)
    plan_bytes: int = 0  # the plan itself: the windows' token ids and the schedule's bookkeeping per run
    check_passes: int = 0  # each rank's checks: pre-write, batch composition, state (counted in forward_passes)
    pass_bytes: int = 0  # what a forward pass allocates once, whatever its number of windows

    def __str__(self) -> str:
        split = ""
        if self.world_size > 1:
            ranks = self.passes_per_rank or []
            each = ranks if len(ranks) <= 8 else f"{min(ranks)}-{max(ranks)}"
            split = f"; {self.world_size} processes: forward passes per rank {each}"
        held = f"; the replays also hold the store on {self.store_device}" if self.store_device else ""
        over = f" over {', '.join(self.devices)} (its device map)" if self.devices else ""
        return (f"{len(self.layer_shapes)} sites, store {_size(self.store_bytes)}, "
                f"{self.forward_passes} forward passes ({', '.join(self.conditions)}), peak memory "
                f"~{_size(self.peak_memory_bytes)} (parameters {_size(self.param_bytes)} + plan "
                f"{_size(self.plan_bytes)} + per pass {_size(self.pass_bytes)} + {min(self.batch_size, self.n_eval)} x "
                f"{_size(self.activation_bytes)} per window)"
                f"{over}{held}{split}")


def _size(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


class _PeakBytes(TorchDispatchMode):
    """The bytes live at once of the CPU tensors its ops allocate, after each op (a view of a live tensor adds
    nothing; a storage is freed with its last view)."""

    def __init__(self):
        super().__init__()
        self.live = 0
        self.trace: list[int] = []
        self._held: set[int] = set()

    @property
    def peak(self) -> int:
        return max(self.trace, default=0)

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
                    weakref.finalize(storage, self._free, ptr, nbytes)
        self.trace.append(self.live)
        return out


def _capture_bytes(model: nn.Module, controller: Controller, ids: torch.Tensor, device: torch.device) -> tuple:
    """(coefficients, logits, activation bytes) of a capture of `ids`: beyond the parameters, the bytes live after
    each op on the CPU, or CUDA's allocator's peak alone."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    with nullcontext() if cuda else _PeakBytes() as counted:
        coeffs, logits, _ = capture_batch(model, controller, ids, None)
    return coeffs, logits, [int(torch.cuda.max_memory_allocated(device) - base)] if cuda else counted.trace or [0]


def _activations(model: nn.Module, controller: Controller, ev: torch.Tensor, device: torch.device,
                 windows: int, checked: tuple[int, int]) -> tuple:
    """(coefficients and logits of one window, activation bytes per pass and per window, the checks' forward passes)
    for a pass of `windows`: from captures of one window and of two after a warm-up pass. Each moment of a pass
    holds bytes it allocates once (a mask, a table, a router's bookkeeping) and bytes per window; the pass's peak is
    the moment where their sum for `windows` is largest, which for short windows is not where a one-window pass
    peaks. The checks' passes: a Flow pass of one window says which sites the model ranks, as the audit's first
    batch's, for `checked` (evaluation windows, batch)."""
    with evaluating(model):
        first_forward(model, controller, ev[:1], None)  # warm-up: weights paged in, lazy tables built
        coeffs, logits_of_one, one = _capture_bytes(model, controller, ev[:1], device)
        two = _capture_bytes(model, controller, ev[:2], device)[2] if ev.shape[0] > 1 else None
        check_finite(coeffs, "a 1-window forward")
        checks = check_passes(controller, follow(model, controller, ev[:1], coeffs), *checked)
    if two is None:  # a single window: nothing to split
        return coeffs, logits_of_one, 0, max(one), checks
    if len(one) != len(two):  # other ops for two windows (a router's experts): the peaks alone
        one, two = [max(one)], [max(two)]
    fixed, per_window = max(((2 * a - b, b - a) for a, b in zip(one, two)), key=lambda m: m[0] + windows * m[1])
    return coeffs, logits_of_one, max(fixed, 0), max(per_window, 0), checks


RUN_BYTES = 512  # the engine's bookkeeping per (condition, randomization): its key and verified-records entry


def plan(model: nn.Module, controller: Controller, eval_windows, calib_windows=None, *,
         config: AuditConfig | None = None, world_size: int = 1, **settings) -> AuditPlan:
    """What an audit of these windows will cost (store, forward passes, memory), from a one- and a two-window pass.

    Size a large audit with it and choose `batch_size` and the number of processes; `fcaudit audit --dry-run`
    prints the same. Peak memory counts the parameters, the plan (windows, bookkeeping), what a pass allocates once
    and, per window of a batch, its activations, the capture's logits and three windows of coefficients.

    Parameters
    ----------
    model, controller, eval_windows, calib_windows
        As for `fca.audit`; `calib_windows` may be None.
    config, **settings
        As for `fca.audit` (the plan reads `batch_size` and `randomizations`), so the audit it plans is the same call.
    world_size
        Processes the work units are split over (torchrun ranks).

    Returns
    -------
    AuditPlan
        Its `str()` is one line; its fields hold each size in bytes and the forward passes per rank.

    Examples
    --------
    With `model`, `ctrl`, `eval_w` and `calib_w` from `fca.audit`'s example:

    >>> p = fca.plan(model, ctrl, eval_w, calib_w, randomizations=20)
    >>> p.forward_passes, len(p.layer_shapes)
    (..., 2)
    >>> print(p)
    2 sites, store ... MiB, ... forward passes (Correct, ...), peak memory ~... MiB (parameters ...)
    """
    config = replace(with_settings(config, settings, "fca.plan"), world_size=world_size)
    check_controller(model, controller)
    ev, _ = as_windows(eval_windows, "evaluation")
    n_calib = 0 if calib_windows is None else as_windows(calib_windows, "calibration")[0].shape[0]
    check_ids(model, ev)
    device = placement.input_device(model)
    largest = min(config.batch_size, ev.shape[0])  # the most windows one pass holds
    coeffs, logits_of_one, pass_bytes, acts, checks = _activations(model, controller, ev[:2].to(device), device,
                                                                   largest, (ev.shape[0], largest))
    per_window = sum(c.numel() * c.element_size() for c in coeffs)
    logits = logits_of_one.numel() * logits_of_one.element_size()  # the capture's logits, kept for the check
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    conditions = protocol.for_controller(controller.info)
    world, batch = config.world_size or 1, config.batch_size  # None: one process, as for a run without torchrun
    sched = Schedule(ev.shape[0], n_calib, batch, config.randomizations, tuple(conditions))
    store = per_window * ev.shape[0]
    planned = (ev.shape[0] + n_calib) * ev.shape[1] * ev.element_size() + (sched.runs() + 1) * RUN_BYTES
    # besides the pre-write checks, every rank runs the batch-composition check (a first batch of two or more
    # windows) and the state check's repeated Correct pass
    checks += STATE_CHECK_PASSES + (BATCH_CHECK_PASSES if min(batch, ev.shape[0]) >= 2 else 0)
    per_rank = [units + checks + (k > 0) for k, units in enumerate(sched.passes_per_rank(world))]  # k > 0: a probe
    return AuditPlan(ev.shape[0], n_calib, ev.shape[1], batch, config.randomizations, conditions,
                     [list(c.shape[1:]) for c in coeffs], str(coeffs[0].dtype).replace("torch.", ""),
                     store, sum(per_rank), param_bytes, acts,
                     param_bytes + planned + pass_bytes + largest * (acts + logits + 3 * per_window), world,
                     per_rank, str(device) if keeps_store_on(device, store) else None,
                     sorted(set(placement.device_map(model).values())) if placement.is_dispatched(model) else None,
                     planned, checks, pass_bytes)
