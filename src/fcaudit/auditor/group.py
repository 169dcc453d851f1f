"""The processes that run one audit together (torch.distributed under torchrun, or one process alone): which share
of the units is this process's, and one verdict per phase. A phase ends with every rank agreeing: if any rank failed
with an FcauditError, every rank raises that one line, so nothing half-written is consumed by a later phase. The
units' outputs are files; the group carries only barriers and verdicts."""

from __future__ import annotations

import gc
import os
import signal
import threading
from datetime import timedelta
from typing import Callable, TypeVar

import torch
import torch.distributed as dist

from fcaudit.errors import FcauditError

T = TypeVar("T")
# A rank waits at a phase's barrier for the slowest rank (e.g. rank 0's merge, or a resume that left one rank more
# units); torchrun tears every rank down when one dies, so the wait needs no short timeout.
TIMEOUT = timedelta(hours=24)


class RankError(FcauditError):
    """The error every rank raises after a phase: the one of the first failing rank, `rank`."""

    def __init__(self, message: str, rank: int):
        super().__init__(message)
        self.rank = rank


class Group:
    """A single process: rank 0 of 1."""

    rank = 0
    world = 1
    on_failure: Callable[[], None] | None = None  # called on every rank once they have agreed on an error

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def run(self, phase: Callable[[], T], main_only: bool = False) -> T | None:
        """Run `phase` (on rank 0 only if `main_only`), agree on the outcome with every rank, and return its result
        (None where skipped). An FcauditError on any rank is raised on every rank (a RankError; one process raises
        the error itself); any other exception is re-raised with its traceback on its own rank and stops the others
        with a one-line error naming it."""
        error, crash, result = None, None, None
        try:
            if self.is_main or not main_only:
                result = phase()
        except FcauditError as e:
            if self.world == 1:  # nothing to agree on: the error itself, not a RankError
                if self.on_failure is not None:
                    self.on_failure()
                raise
            error = str(e)
        except Exception as e:
            if self.world == 1:
                raise
            crash = e
            first = (str(e).strip().splitlines() or [""])[0]
            error = f"rank {self.rank} failed with {type(e).__name__}: {first} (its traceback is in that rank's log)"
        try:
            self.agree(error)
        except RankError:
            if crash is not None:
                raise crash from None
            raise
        return result

    def agree(self, error: str | None) -> None:
        """Raise the first rank's error on every rank (a barrier)."""
        failed = [(k, e) for k, e in enumerate(self.gather(error)) if e is not None]
        if failed:
            if self.on_failure is not None:
                self.on_failure()
            raise RankError(failed[0][1], failed[0][0])

    def gather(self, obj: object) -> list:
        """`obj` of every rank, in rank order (a barrier)."""
        return [obj]

    def close(self) -> None:
        """Release what the group holds (nothing for one process)."""


class TorchGroup(Group):
    """The ranks of the initialized torch.distributed process group; verdicts travel on a gloo group (on the CPU),
    even when the default group is nccl."""

    def __init__(self, owned: bool = False):
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self._owned = owned  # initialized by group_from_env: destroyed by close()
        self._objects = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo", timeout=TIMEOUT)

    def gather(self, obj: object) -> list:
        out: list = [None] * self.world
        dist.all_gather_object(out, obj, group=self._objects)
        return out

    def close(self) -> None:
        if self._owned and dist.is_initialized():
            dist.destroy_process_group()
            self._owned = False
            gc.collect()  # gloo's last work objects freed while the interpreter is whole, not during its shutdown


def launched_world() -> int:
    """WORLD_SIZE that torchrun (or another launcher) set for this process; 1 when launched alone."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        raise FcauditError(f"WORLD_SIZE={os.environ['WORLD_SIZE']!r} is not an integer; launch with torchrun") from None


def launched_rank() -> int:
    return int(os.environ.get("RANK", "0") or 0)


def rank_device(device: torch.device) -> torch.device:
    """This rank's device: `cuda` without an index becomes cuda:LOCAL_RANK (one process per GPU); an explicit index
    or the CPU is kept."""
    if device.type != "cuda" or device.index is not None or "LOCAL_RANK" not in os.environ:
        return device
    local, count = int(os.environ["LOCAL_RANK"]), torch.cuda.device_count()
    if local >= count:
        raise FcauditError(f"LOCAL_RANK {local} but only {count} CUDA device(s) are visible; launch at most {count} "
                           "processes per node (torchrun --nproc_per_node)")
    return torch.device("cuda", local)


def group_from_env(device: torch.device | str = "cpu") -> Group:
    """The group of this process: a TorchGroup under torchrun (WORLD_SIZE > 1, or an already initialized process
    group), initializing it with nccl when `device` is CUDA, else gloo; Group() for a process launched alone."""
    device = torch.device(device)
    initialized = dist.is_available() and dist.is_initialized()
    if launched_world() <= 1 and not initialized:
        return Group()
    if not dist.is_available():
        raise FcauditError("this torch build has no torch.distributed; run one process or install a torch with it")
    if initialized:
        return TorchGroup()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    try:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=TIMEOUT)
    except ValueError as e:  # env:// without MASTER_ADDR / MASTER_PORT / RANK
        raise FcauditError(f"WORLD_SIZE is {launched_world()} but the process group cannot start ({e}); launch with "
                           "torchrun, or unset WORLD_SIZE to run one process") from None
    return TorchGroup(owned=True)


def ignore_sigterm() -> None:
    """For a launched rank about to print its error and exit 2: torchrun SIGTERMs the other ranks once the first
    exits, which must neither cut their line nor turn their exit code 2 into -15."""
    if launched_world() > 1 and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
