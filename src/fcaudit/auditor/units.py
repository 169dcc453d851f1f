"""Work units of an audit: capture(b) (stage 1 on evaluation batch b, its Correct records, the exact replay check),
calibrate(b) (float64 sums of calibration batch b) and replay(c, r, b) (stage 2). Each unit's result is a pure function
of (seed, window indices) in its own file, so any partition of the units over processes ends the same bit for bit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import islice
from typing import Iterable, Iterator

from fcaudit import protocol


@dataclass(frozen=True, slots=True)
class Unit:
    kind: str  # "capture" | "calibrate" | "replay"
    start: int  # first window index of the batch
    condition: str = "Correct"
    r: int = 0

    @property
    def passes(self) -> int:
        """Forward passes the unit runs (capture: the capture and the exact replay check)."""
        return 2 if self.kind == "capture" else 1


@dataclass(frozen=True)
class Schedule:
    n_eval: int
    n_calib: int
    batch_size: int
    randomizations: int
    conditions: tuple[str, ...]  # every condition the audit runs, Correct included

    @property
    def eval_starts(self) -> list[int]:
        return list(range(0, self.n_eval, self.batch_size))

    @property
    def calib_starts(self) -> list[int]:
        return list(range(0, self.n_calib, self.batch_size))

    def iter_stage1(self) -> Iterator[Unit]:
        yield from (Unit("capture", b) for b in self.eval_starts)
        yield from (Unit("calibrate", b) for b in self.calib_starts)

    def replay_keys(self) -> list[tuple[str, int]]:
        """(condition, randomization) pairs of stage 2; randomization-major so one derangement serves its conditions."""
        static = [(c, 0) for c in self.conditions if protocol.REGISTRY[c].kind == "static"]
        randomized = [(c, r) for r in range(self.randomizations) for c in self.conditions
                      if protocol.REGISTRY[c].randomized]
        return static + randomized

    def iter_stage2(self) -> Iterator[Unit]:
        """Generated on demand: the unit list, which grows with the windows, is never held."""
        return (Unit("replay", b, c, r) for c, r in self.replay_keys() for b in self.eval_starts)

    def record_keys(self) -> list[tuple[str, int]]:
        return [("Correct", 0)] + self.replay_keys()

    def runs(self) -> int:
        """len(replay_keys()), counted without listing them."""
        static = sum(protocol.REGISTRY[c].kind == "static" for c in self.conditions)
        return static + self.randomizations * sum(protocol.REGISTRY[c].randomized for c in self.conditions)

    def forward_passes(self) -> int:
        return protocol.forward_passes(self.conditions, math.ceil(self.n_eval / self.batch_size),
                                       math.ceil(self.n_calib / self.batch_size), self.randomizations)

    def passes_per_rank(self, world: int) -> list[int]:
        """Each rank's forward passes under `share` of stage 1 and of stage 2, counted without listing the units."""
        ne, nc = math.ceil(self.n_eval / self.batch_size), math.ceil(self.n_calib / self.batch_size)
        replays = self.runs() * ne

        def of(n: int, rank: int) -> int:  # how many of n units are `rank`'s: every world-th one from index `rank`
            return max(0, -(-(n - rank) // world))

        # stage 1: the captures (2 passes each: counted in both terms), then the calibration batches (1 each)
        return [of(ne, k) + of(ne + nc, k) + of(replays, k) for k in range(world)]


def share(units: Iterable[Unit], rank: int, world: int) -> Iterator[Unit]:
    """Rank `rank`'s share: every world-th unit, so each rank gets a mix of conditions and batches."""
    return islice(units, rank, None, world)
