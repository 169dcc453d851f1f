"""The FCA protocol (paper §3.2-3.4): the condition registry, the record schema and the prespecified criteria.

Everything else (schedule, statistics, summary, report) reads `REGISTRY`; adding a condition is one entry there (a
user's: `register`), and how it moves each kind's coefficients is the kind's (fcaudit.kinds) or the user's `moves`.
Randomness is keyed by what it permutes, never by batch or process: `default_rng([tag, seed, r, example])` (the
derangement: `[DERANGE, seed, r]`); CrossShuffle pairs CrossInput's donor with TokenShuffle's permutations. Static
profiles are functions of the calibration sums only. A condition applies to a controller when one of its sites' kinds
offers it (fcaudit.kinds); the per-site rules (a site's reference, a token router's budget) come from its kind. A
depth controller's conditions move a token's whole depth as one and keep each window's budget (fcaudit.kinds.depth).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Callable, Iterable, Mapping, Sequence

import numpy as np
import torch

from fcaudit.errors import FcauditError
from fcaudit.kinds import KINDS, Description
from fcaudit.kinds.base import Context
from fcaudit.kinds.moves import (DERANGE, DEPTH_FIT, DEPTH_RANDOM, RESAMPLE, ROUTE_PAST, ROUTE_RANDOM, SHUFFLE,  # noqa: F401
                                 Coeffs, group_rows, past_positions, resample_past, shuffle_tokens, token_permutations)
from fcaudit.kinds.profiles import (REFERENCES, Calibration, expand, global_mean, reference_profiles,  # noqa: F401
                                    source_uniform_mean, static_top_k)
from fcaudit.kinds.tokens import random_routes, routes_past, static_routes  # noqa: F401

RECORD_COLUMNS = ("example", "condition", "randomization", "nll", "tokens", "active")
"""One record per (example, condition, randomization): `nll` is the window's mean next-token NLL per predicted token,
`tokens` the predicted tokens, `active` the mean nonzero sources per (layer, token, stream), over the routers when
there are any (token routers: the fraction of tokens chosen). Codecs that count what their module runs
(`Codec.executed`, e.g. a capacity router) set `active` from what ran and add their counts as extra columns."""


# ---- the transformations ---------------------------------------------------------------------------------------

def derangement(n: int, seed: int, r: int) -> np.ndarray:
    """A uniformly random permutation of range(n) without fixed points (rejection sampling, ~e draws)."""
    if n < 2:
        raise FcauditError(f"a derangement needs at least 2 evaluation windows, got {n}; pass more windows (--eval)")
    rng = np.random.default_rng([DERANGE, seed, r])
    while True:
        perm = rng.permutation(n)
        if not np.any(perm == np.arange(n)):
            return perm


# ---- static profiles from the calibration sums -----------------------------------------------------------------

def batch_sums(coeffs: Coeffs) -> list[torch.Tensor]:
    """One calibration batch's part of the sums: per layer, the float64 sum over its windows, on the CPU."""
    return [c.detach().to("cpu", torch.float64).sum(0) for c in coeffs]


def static_profiles(parts: Iterable[tuple[list[torch.Tensor], int]],
                    ctrl: Description) -> dict[str, list[torch.Tensor]]:
    """The profile of each static condition that applies to `ctrl`, from the calibration batches' (batch_sums,
    window count) added in batch order: equal bit for bit however the batches were spread over processes."""
    sums, count = None, 0
    for part, n in parts:
        sums = list(part) if sums is None else [s + p for s, p in zip(sums, part)]
        count += n
    if sums is None:
        raise FcauditError("no calibration windows: pass at least one calibration window")
    cal = Calibration(sums, count, ctrl.top_k)
    return {c.name: c.profile(cal, ctrl) for c in REGISTRY.values() if c.kind == "static" and c.offered(ctrl)}


# ---- conditions ------------------------------------------------------------------------------------------------

ReplayContext = Context  # what a condition may use to make a batch's replay coefficients (the audit engine)


@dataclass(frozen=True)
class Condition:
    """One condition: how it is scheduled and reported here; how it moves coefficients is its kinds' to say.

    A built-in condition asks the controller's kind (`Kind.move`, one method per condition; static conditions:
    `Kind.profile` from the calibration sums). A user's (`register`) brings `moves`: per kind name, a function
    (context, randomization, examples) -> coefficients, which the kind then keeps to its budget (`Kind.keep`), and
    the audit refuses a move that changes a window's budget (`Kind.budget`)."""

    name: str
    kind: str  # "reference" (Correct), "randomized" (R draws) or "static" (one deterministic replay)
    label: str  # default display label; a controller may rename StaticProfile and StructureRemoved
    role: str | None = None  # factorial role: "input" (DC), "token" (CS), "both" (DS); None: outside Eq. 5-7
    retained: bool = False  # retention (Eq. 8) is reported for it against the structure-removed reference
    structure_removed: bool = False  # the reference R of Eq. 8
    moves: Mapping[str, Callable[[ReplayContext, int, np.ndarray], Coeffs]] | None = None  # a user's, per kind name

    @property
    def randomized(self) -> bool:
        return self.kind == "randomized"

    def offered(self, ctrl: Description) -> bool:
        """Whether an audit of this controller runs it: some site's kind offers it, or (a user's) it moves every
        site's kind."""
        if self.moves is not None:
            return all(k in self.moves for k in ctrl.kinds)
        return self.name in ctrl.conditions

    def make(self, ctx: ReplayContext, r: int, examples: np.ndarray) -> Coeffs:
        """A batch's replay coefficients (randomization r) of the evaluation `examples`."""
        kind = ctx.info.lead
        if self.moves is None:
            return kind.move(self.name, ctx, r, examples)
        moved = kind.keep(ctx, list(self.moves[kind.name](ctx, r, examples)), r, examples, USER)
        own, got = kind.budget(ctx.info, ctx.take(examples)), kind.budget(ctx.info, moved)
        if own is not None and not np.array_equal(own, got):
            w = int(np.flatnonzero(own != got)[0])
            raise FcauditError(f"condition {self.name} changed window {int(examples[w])}'s {kind.name} budget from "
                               f"{int(own[w])} to {int(got[w])}: a condition keeps each window's budget; move the "
                               "decisions without adding or removing any")
        return moved

    def profile(self, cal: Calibration, ctrl: Description) -> list[torch.Tensor]:
        """A static condition's profile (its kind's `profile` from the calibration sums)."""
        return ctrl.lead.profile(self.name, cal, ctrl)


USER = 8  # the draw tag of a user's condition's budget fit (distinct from fcaudit.kinds.moves's)

# in paper order; what each controls for: docs/concepts.md; which kinds offer each and how: fcaudit.kinds
REGISTRY: dict[str, Condition] = {c.name: c for c in (
    Condition("Correct", "reference", "Correct"),
    Condition("CrossInput", "randomized", "Cross-input", role="input"),
    Condition("TokenShuffle", "randomized", "Token-shuffle", role="token"),
    Condition("CrossShuffle", "randomized", "Cross+shuffle", role="both"),  # CrossInput's donor, TokenShuffle's draws
    Condition("TokenResamplePast", "randomized", "Token-resample-past"),  # the causal control of TokenShuffle
    Condition("LayerPositionMean", "static", "Layer×PositionMean", retained=True),
    Condition("StaticProfile", "static", "StaticProfile", retained=True),
    Condition("StaticTopK", "static", "StaticTopK", retained=True),
    Condition("StructureRemoved", "static", "StructureRemoved", structure_removed=True),
    Condition("RandomRoute", "randomized", "RandomRoute", structure_removed=True),  # token routers' reference
    Condition("StaticDepth", "static", "StaticDepth", retained=True),  # depth: the budget laid out by calibration
    # the depth kinds' structure-removed references: exit depths, halting distributions, run cells at random
    *(Condition(name, "randomized", name, structure_removed=True) for name in ("RandomExit", "RandomHalt",
                                                                             "RandomSkip")),
)}


def register(condition: Condition) -> Condition:
    """Adds a user's condition (with `moves`, per kind) to the registry: every audit of a controller whose kinds it
    moves then runs it, scheduled, recorded and reported as the built-in ones. Returns it.

    Examples
    --------
    >>> def reverse(ctx, r, examples):  # every window's gates in reverse token order
    ...     return [c.flip(1) for c in ctx.take(examples)]
    >>> fca.protocol.register(fca.protocol.Condition("TokenReverse", "static", "Token-reverse",
    ...                                             moves={"scalar_gate": reverse}))
    """
    if condition.moves is None or not condition.moves:
        raise FcauditError(f"condition {condition.name!r}: give its moves, per kind name, e.g. "
                           "moves={'scalar_gate': fn} with fn(ctx, r, examples) -> coefficients")
    if condition.kind not in ("randomized", "static"):
        raise FcauditError(f"condition {condition.name!r}: kind must be 'randomized' or 'static', not "
                           f"{condition.kind!r}")
    if condition.structure_removed or condition.role:
        raise FcauditError(f"condition {condition.name!r}: a user's condition takes no factorial role and is no "
                           "structure-removed reference (retention and Eq. 5-8 keep the paper's)")
    old = REGISTRY.get(condition.name)
    if old is not None and old.moves is None:
        raise FcauditError(f"{condition.name} is a built-in condition; give yours another name")
    lookup_kinds = [k for k in condition.moves if k not in KINDS]
    if lookup_kinds:
        raise FcauditError(f"condition {condition.name!r} moves unknown kind {lookup_kinds[0]!r}; use one of "
                           f"{', '.join(KINDS)}")
    REGISTRY[condition.name] = condition
    return condition


def unregister(name: str) -> None:
    """Removes a user's condition (a built-in one stays)."""
    if name in REGISTRY and REGISTRY[name].moves is not None:
        del REGISTRY[name]


def for_controller(ctrl: Description) -> list[str]:
    """The conditions an audit of this controller runs: those its sites' kinds offer, in registry order."""
    return [c.name for c in REGISTRY.values() if c.offered(ctrl)]


def factorial() -> dict[str, str]:
    """Eq. 5-7's cells: {"input": DC, "token": CS, "both": DS} (CC = Correct, ΔNLL 0)."""
    return {c.role: c.name for c in REGISTRY.values() if c.role}


def retained() -> list[str]:
    return [c.name for c in REGISTRY.values() if c.retained]


def structure_removed(run: Iterable[str]) -> str | None:
    """Eq. 8's reference R among the conditions `run` (StructureRemoved; RandomRoute for token routers; RandomExit,
    RandomHalt or RandomSkip for depth), if any."""
    ran = set(run)
    return next((c.name for c in REGISTRY.values() if c.structure_removed and c.name in ran), None)


def default_labels() -> dict[str, str]:
    return {c.name: c.label for c in REGISTRY.values()}


def order(name: str) -> int:
    """Sort key: registry order, unknown names last."""
    keys = list(REGISTRY)
    return keys.index(name) if name in keys else len(keys)


def forward_passes(conditions_run: Sequence[str], eval_batches: int, calib_batches: int, randomizations: int) -> int:
    """Calibration + capture + exact replay check + one pass per replay (R per randomized condition) per batch."""
    per_batch = sum(randomizations if REGISTRY[c].randomized else 1 for c in conditions_run if c != "Correct")
    return calib_batches + eval_batches * (2 + per_batch)


# ---- prespecified criteria (§4.1) --------------------------------------------------------------------------------

@dataclass
class Criteria:
    """The two prespecified criteria of §4.1, fixed before the audit runs: is a static profile's cost practically
    small, and is its retention high?

    An audit writes them into config.json before it replays anything (so they were not chosen after the results);
    `fca.summarize` and the report judge each family against them, at checkpoint level where there are several.

    Parameters
    ----------
    small_upper
        StaticProfile's ΔNLL is "practically small" when its interval's upper bound is below this (nats per
        predicted token); retention is defined only where the structure-removed reference's interval lies
        above it.
    retention_lower
        StaticProfile's retention is "high" when its interval's lower bound is above this.
    confidence
        The level of the intervals the criteria are judged on.

    Examples
    --------
    >>> strict = fca.Criteria(small_upper=0.001, confidence=0.99)
    >>> strict.to_dict()
    {'small_upper': 0.001, 'retention_lower': 0.95, 'confidence': 0.99}

    It is passed as `fca.audit(..., criteria=strict)`.
    """

    small_upper: float = 0.002  # StaticProfile ΔNLL: upper CI bound below this => "practically small"
    retention_lower: float = 0.95  # StaticProfile retention: lower CI bound above this => "high retention"
    confidence: float = 0.95  # level of the intervals the criteria are judged on

    def __post_init__(self):
        for name in ("small_upper", "retention_lower", "confidence"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise FcauditError(f"criteria {name} must be a number, got {type(v).__name__}; e.g. small_upper=0.002")
        if not 0 < self.confidence < 1:
            raise FcauditError(f"criteria confidence must be in (0, 1), got {self.confidence}; e.g. 0.95")
        if not (math.isfinite(self.small_upper) and math.isfinite(self.retention_lower)):
            raise FcauditError("criteria thresholds must be finite numbers, e.g. small_upper=0.002")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Criteria":
        if not isinstance(d, dict):
            raise FcauditError(f"criteria must be a dict of numbers, got {type(d).__name__}")
        known = {f.name for f in fields(cls)}
        d = {k: v for k, v in d.items() if k != "fixed_at"}  # the engine stamps when the criteria were fixed
        unknown = set(d) - known
        if unknown:
            raise FcauditError(f"unknown criteria keys {sorted(unknown)}; allowed: {sorted(known)}")
        try:
            return cls(**{k: float(v) for k, v in d.items()})
        except (TypeError, ValueError):
            raise FcauditError(f"criteria values must be numbers, got {d}") from None
