"""`--threads`: how many CPU threads torch uses, and a hint when the machine is already busy (on a shared machine
torch's default of one thread per core competes with the other jobs for every core)."""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Callable, Iterator

import torch

from fcaudit.errors import FcauditError


def oversubscription_hint(threads: int, load: float, cpus: int) -> str | None:
    """A one-line hint when `threads` more busy threads would exceed the `cpus`, given the 1-minute `load` average
    (the other jobs' runnable threads), else None."""
    if threads <= 1 or load + threads <= cpus + 0.5:
        return None
    free = max(1, round(cpus - load))
    return (f"hint: load average {load:.1f} on {cpus} CPUs and torch would use {threads} threads; "
            f"--threads {min(free, threads - 1)} is likely faster on this busy machine")


def machine_load() -> tuple[float, int]:
    """(1-minute load average, usable CPUs); (0, cpus) where the load average is unavailable."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        load = os.getloadavg()[0]
    except (OSError, AttributeError):
        load = 0.0
    return load, cpus


@contextmanager
def using_threads(threads: int | None, *, hint: Callable[[str], None] | None = None) -> Iterator[int]:
    """Run the body with `threads` torch intra-op threads (None: torch's choice) and restore the previous number
    afterwards; yields the number in use. When `threads` is None and the machine is busy, `hint(line)` is called with
    oversubscription_hint's line."""
    before = torch.get_num_threads()
    if threads is not None:
        cpus = machine_load()[1]
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise FcauditError(f"--threads {threads}: pass 1 or more CPU threads (or leave it out for torch's default)")
        if threads > cpus:  # more threads than CPUs only compete for them (and torch takes a C int)
            raise FcauditError(f"--threads {threads}: this machine lets fcaudit use {cpus} CPUs; pass at most {cpus} "
                               "(or leave it out for torch's default)")
        torch.set_num_threads(threads)
    n = torch.get_num_threads()
    if threads is None and hint is not None and (line := oversubscription_hint(n, *machine_load())):
        hint(line)
    try:
        yield n
    finally:
        torch.set_num_threads(before)
