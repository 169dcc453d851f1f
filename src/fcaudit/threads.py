"""`--threads`: how many CPU threads torch uses, and a hint when the machine is already busy.

On a shared machine torch's default (one thread per core) competes with the other jobs for every core: an audit
of a tiny model took 63.5 s with 2 threads on a loaded 2-core machine and 16.7 s with 1 (records bit-identical).
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Iterator

from fcaudit.errors import FcauditError


def oversubscription_hint(threads: int, load: float, cpus: int) -> str | None:
    """A one-line hint when `threads` more busy threads would exceed the machine's cores, else None.

    `load` is the 1-minute load average (the other jobs' runnable threads, before this command starts)."""
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


def set_threads(threads: int | None) -> int:
    """Set torch's intra-op CPU threads (None: keep torch's choice) and return the number in use."""
    import torch

    if threads is not None:
        if threads < 1:
            raise FcauditError(f"--threads {threads}: pass 1 or more CPU threads (or leave it out for torch's default)")
        torch.set_num_threads(threads)
    return torch.get_num_threads()


@contextmanager
def using_threads(threads: int | None, *, hint=None) -> Iterator[int]:
    """Run the body with `threads` torch threads and restore the previous number afterwards.

    When `threads` is None and the machine is busy, `hint(line)` is called with oversubscription_hint's line."""
    import torch

    before = torch.get_num_threads()
    n = set_threads(threads)
    if threads is None and hint is not None:
        line = oversubscription_hint(n, *machine_load())
        if line:
            hint(line)
    try:
        yield n
    finally:
        torch.set_num_threads(before)
