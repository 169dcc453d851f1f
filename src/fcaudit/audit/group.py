"""The processes that run one audit together: which share of the units is this process's, and one verdict per phase.

A phase (stage 1, the profile reduction, stage 2, the final merge) ends with every rank agreeing: if any rank failed
with an FcauditError, every rank raises that one-line error, so nothing half-written is consumed by a later phase.
The units' outputs are files; the group only carries barriers and the verdicts (torch.distributed under torchrun).
"""

from __future__ import annotations

from typing import Callable

from fcaudit.errors import FcauditError


class Group:
    """A single process: rank 0 of 1."""

    rank = 0
    world = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def run(self, phase: Callable[[], None], main_only: bool = False) -> None:
        """Run `phase` (on rank 0 only if `main_only`), then agree on the outcome with every rank."""
        error = None
        try:
            if self.is_main or not main_only:
                phase()
        except FcauditError as e:
            error = str(e)
        self.agree(error)

    def agree(self, error: str | None) -> None:
        if error is not None:
            raise FcauditError(error)
