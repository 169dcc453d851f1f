"""The FCA protocol (paper §3.2-3.4): the condition registry, the record schema and the prespecified criteria.

Everything else (schedule, statistics, summary, report) reads `REGISTRY`; adding a condition is one entry there.
Randomness is keyed by what it permutes, never by batch or process: `default_rng([tag, seed, r, example])` (the
derangement: `[DERANGE, seed, r]`); CrossShuffle pairs CrossInput's donor with TokenShuffle's permutations. Static
profiles are functions of the calibration sums only. A condition applies to a controller when one of its sites' kinds
offers it (fcaudit.kinds); the per-site rules (a site's reference, a token router's budget) come from its kind. A
depth controller's conditions move a token's whole depth as one and keep each window's budget (fcaudit.depth).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from itertools import accumulate
from typing import Callable, Iterable, Protocol, Sequence

import numpy as np
import torch

from fcaudit import depth
from fcaudit.errors import FcauditError
from fcaudit.kinds import Description, chosen

Coeffs = list[torch.Tensor]  # one canonical [batch, token, stream, source] tensor per site (target layer)

# distinct leading tags: numpy pads short seed entropy with zeros, so [seed, r] would equal [seed, r, 0]
DERANGE, SHUFFLE, RESAMPLE, ROUTE_PAST, ROUTE_RANDOM, DEPTH_FIT, DEPTH_RANDOM = 1, 2, 3, 4, 5, 6, 7

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


def token_permutations(examples: np.ndarray, seed: int, r: int, token: int, rows: int) -> np.ndarray:
    """An int array [examples, rows, token]: per example an independent permutation of positions per row, one row per
    (layer, stream) in layer order (`group_rows`). TokenShuffle r and CrossShuffle r use the same ones."""
    positions = np.broadcast_to(np.arange(token), (rows, token))
    return np.stack([np.random.default_rng([SHUFFLE, seed, r, int(e)]).permuted(positions, axis=1) for e in examples])


def past_positions(examples: np.ndarray, seed: int, r: int, token: int, rows: int) -> np.ndarray:
    """An int array [examples, rows, token], one row per (layer, stream): position t takes a uniformly drawn position
    s <= t."""
    high = np.arange(1, token + 1)
    return np.stack([np.random.default_rng([RESAMPLE, seed, r, int(e)]).integers(0, high, size=(rows, token))
                     for e in examples])


def group_rows(coeffs: Coeffs, layers: Sequence[Sequence[int]] | None = None) -> tuple[int, list[int]]:
    """The index rows one draw needs and each site's first row: one row per stream of each layer (its widest site),
    layers in order (`Description.layers`; None: one per site); a site uses its layer's first rows, so the sites of
    one layer move together."""
    layers = layers if layers is not None else [(i,) for i in range(len(coeffs))]
    width = [max(coeffs[i].shape[2] for i in sites) for sites in layers]
    first = [0] * len(coeffs)
    for sites, row in zip(layers, accumulate(width, initial=0)):
        for i in sites:
            first[i] = row
    return sum(width), first


def _move_tokens(coeffs: Coeffs, draw: Callable[..., np.ndarray], examples: np.ndarray, seed: int, r: int,
                 layers: Sequence[Sequence[int]] | None) -> Coeffs:
    """new[b, t, s, :] = old[b, index[b, row(l, s), t], s, :] for every layer l (the source vector moves as one), with
    index = draw(examples, seed, r, token, rows) [batch, rows, token], rows as `group_rows` says."""
    rows, first = group_rows(coeffs, layers)
    index = draw(examples, seed, r, coeffs[0].shape[1], rows)
    # one host-to-device copy of the whole index, in the [batch, token, row] order gather wants
    index = torch.from_numpy(index.transpose(0, 2, 1).copy()).to(coeffs[0].device)
    return [torch.gather(c, 1, index[:, :, s0:s0 + c.shape[2], None].expand(-1, -1, -1, c.shape[3]))
            for c, s0 in zip(coeffs, first)]


def shuffle_tokens(coeffs: Coeffs, examples: np.ndarray, seed: int, r: int,
                   layers: Sequence[Sequence[int]] | None = None) -> Coeffs:
    """TokenShuffle r of the receiving `examples`: independent permutations per example, layer and stream."""
    return _move_tokens(coeffs, token_permutations, examples, seed, r, layers)


def resample_past(coeffs: Coeffs, examples: np.ndarray, seed: int, r: int,
                  layers: Sequence[Sequence[int]] | None = None) -> Coeffs:
    """TokenResamplePast r: position t takes the coefficient of a uniform position s <= t of the same example (the
    same s for every site of a layer)."""
    return _move_tokens(coeffs, past_positions, examples, seed, r, layers)


# ---- token routing: every transformation keeps each window's budget k per layer ---------------------------------
# A token router's canonical tensor is [batch, token, 1, 2]: its score and whether the token was chosen (0/1). The
# routed block runs on the chosen tokens only (fcaudit.kinds.chosen), so a (score, chosen) pair moves as one and k
# never changes.

def routes_past(coeffs: Coeffs, examples: np.ndarray, seed: int, r: int) -> Coeffs:
    """TokenResamplePast for token routers: each chosen position s moves, with its score, to a uniformly drawn free
    position t >= s (latest s first, so a free one always exists); the unchosen tokens fill the other positions in
    their order. So a choice only moves later, where the tokens it was computed from are visible, and k is kept."""
    out = []
    for layer, c in enumerate(coeffs):
        picked = chosen(c).cpu().numpy()
        T = c.shape[1]
        index = np.empty(picked.shape, np.int64)
        for row, (example, mask) in enumerate(zip(examples, picked)):
            rng = np.random.default_rng([ROUTE_PAST, seed, r, int(example), layer])
            taken = np.zeros(T, bool)
            for s in np.flatnonzero(mask)[::-1]:
                free = np.flatnonzero(~taken[s:]) + s
                t = free[rng.integers(len(free))]
                taken[t] = True
                index[row, t] = s
            index[row, ~taken] = np.flatnonzero(~mask)
        out.append(torch.gather(c, 1, torch.from_numpy(index).to(c.device)[:, :, None, None].expand_as(c)))
    return out


def random_routes(coeffs: Coeffs, examples: np.ndarray, seed: int, r: int) -> Coeffs:
    """RandomRoute: per window and layer a uniformly random set of as many tokens as the router chose, each chosen
    token weighted by the mean score of the window's own chosen tokens (which tokens, and how each is weighted, are
    removed; the budget and the window's mean weight are kept)."""
    out = []
    for layer, c in enumerate(coeffs):
        picked = chosen(c)
        k = picked.sum(1).cpu().numpy()
        mean = (c[:, :, 0, 0] * picked).sum(1) / picked.sum(1).clamp_min(1)
        mask = np.zeros(picked.shape, bool)
        for row, (example, n) in enumerate(zip(examples, k)):
            rng = np.random.default_rng([ROUTE_RANDOM, seed, r, int(example), layer])
            mask[row, rng.choice(c.shape[1], int(n), replace=False)] = True
        new = torch.zeros_like(c)
        m = torch.from_numpy(mask).to(c.device)
        new[:, :, 0, 1] = m.to(c.dtype)
        new[:, :, 0, 0] = torch.where(m, mean[:, None].to(c.dtype), 0.0)
        out.append(new)
    return out


def static_routes(profile: Coeffs, taken: Coeffs) -> Coeffs:
    """StaticTopK for token routers: each window's k (as its router chose) tokens are the k positions chosen most
    often in the calibration windows (ties: the higher mean score, then the earlier position), each weighted by its
    calibration mean score (LayerPositionMean)."""
    out = []
    for p, c in zip(profile, taken):
        k = chosen(c).sum(1)
        often, score = p[0, :, 0, 1].cpu().numpy(), p[0, :, 0, 0].cpu().numpy()
        order = torch.from_numpy(np.lexsort((np.arange(len(often)), -score, -often))).to(c.device)
        rank = torch.empty_like(order)
        rank[order] = torch.arange(order.numel(), device=order.device)
        m = rank[None, :] < k[:, None].to(rank.device)
        new = torch.zeros_like(c)
        new[:, :, 0, 1] = m.to(c.dtype)
        new[:, :, 0, 0] = torch.where(m, p[:, :, 0, 0].to(c.dtype), 0.0)
        out.append(new)
    return out


# ---- depth: every transformation keeps each window's budget of executed (layer, token) pairs --------------------
# The randomized conditions move a token's whole depth as one (`Description.draws`); where a window receives other
# decisions than its own (CrossInput, TokenResamplePast) they are fitted to its own budget (fcaudit.depth.fit).

def _rngs(tag: int, seed: int, r: int, examples: np.ndarray) -> list[np.random.Generator]:
    return [np.random.default_rng([DEPTH_FIT, tag, seed, r, int(e)]) for e in examples]


def kept(ctx: "ReplayContext", coeffs: Coeffs, r: int, examples: np.ndarray, tag: int) -> Coeffs:
    """Depth: `coeffs` fitted to the budgets of the receiving windows `examples` (their own captured ones), with
    draws keyed by the condition's `tag`; any other controller's as they are."""
    if not ctx.info.depth:
        return coeffs
    info = ctx.info
    own = depth.units(info.depth, ctx.take(examples), info.window)
    return depth.fit(info.depth, coeffs, own, _rngs(tag, ctx.seed, r, examples), window=info.window)


def cross_input(ctx: "ReplayContext", r: int, examples: np.ndarray) -> Coeffs:
    """CrossInput r: each window gets its donor's whole tensor (depth: fitted to its own budget)."""
    return kept(ctx, ctx.take(ctx.derangement(r)[examples]), r, examples, DERANGE)


def random_depth(ctx: "ReplayContext", r: int, examples: np.ndarray) -> Coeffs:
    """A depth controller's structure-removed reference r (fcaudit.depth.random), from the StaticDepth profile."""
    rngs = [np.random.default_rng([DEPTH_RANDOM, ctx.seed, r, int(e)]) for e in examples]
    return depth.random(ctx.info.depth, ctx.static("StaticDepth", len(examples)), ctx.take(examples), rngs,
                        window=ctx.info.window)


# ---- static profiles from the calibration sums -----------------------------------------------------------------

@dataclass(frozen=True)
class Calibration:
    """Float64 sums of the calibration coefficients over windows, per layer [token, stream, source], and the count
    (added in batch order: equal bit for bit however the batches were spread over processes)."""

    sums: list[torch.Tensor]
    count: int
    top_k: tuple[int | None, ...]  # per site: experts per token of a top-k router, else None

    def of(self, sites: Sequence[int]) -> "Calibration":
        """The calibration of some sites only."""
        return Calibration([self.sums[i] for i in sites], self.count, tuple(self.top_k[i] for i in sites))

    def layer_position_mean(self) -> list[torch.Tensor]:
        return [s / self.count for s in self.sums]

    def layer_mean(self) -> list[torch.Tensor]:
        return [p.mean(0) for p in self.layer_position_mean()]  # [stream, source]


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
    return {c.name: c.profile(cal, ctrl) for c in REGISTRY.values() if c.kind == "static" and c.name in ctrl.conditions}


def global_mean(cal: Calibration) -> list[torch.Tensor]:
    """Mass-matched GlobalMean: one scalar for every coefficient of every layer (of the sites it is the reference
    of)."""
    total = sum(float(s.sum()) for s in cal.sums)
    n = sum(s.numel() for s in cal.sums) * cal.count
    return [torch.full_like(p, total / n) for p in cal.layer_mean()]


def source_uniform_mean(cal: Calibration) -> list[torch.Tensor]:
    """SourceUniformMean (ExpertUniformMean for routers): every source of (layer, stream) gets the mean over sources,
    which keeps the signed sum over sources (for a router: m_l / E for every expert)."""
    return [p.mean(1, keepdim=True).expand_as(p).clone() for p in cal.layer_mean()]


REFERENCES: dict[str, Callable[[Calibration], list[torch.Tensor]]] = {  # kinds.STATIC_REFERENCES
    "GlobalMean": global_mean, "SourceUniformMean": source_uniform_mean, "ExpertUniformMean": source_uniform_mean}


def reference_profiles(cal: Calibration, ctrl: Description) -> list[torch.Tensor]:
    """StructureRemoved: each site's own reference, computed over the sites that share it (a merged gate's GlobalMean
    beside its layer's mixture's SourceUniformMean)."""
    out: list[torch.Tensor] = [None] * len(cal.sums)
    for ref in dict.fromkeys(ctrl.references):
        sites = [i for i, r in enumerate(ctrl.references) if r == ref]
        for i, p in zip(sites, REFERENCES[ref](cal.of(sites))):
            out[i] = p
    return out


def static_top_k(cal: Calibration) -> list[torch.Tensor]:
    """The top-k sources of each (layer, stream) mean vector with their mean weights, rescaled to the mean's mass
    (a static sparse routing: k experts run per token, as under Correct). Sites that are not top-k routers (e.g. a
    shared-expert gate) get their plain static mean."""
    out = []
    for p, k in zip(cal.layer_mean(), cal.top_k):
        if k is None:
            out.append(p)
            continue
        keep = torch.zeros_like(p).scatter_(-1, p.topk(min(k, p.shape[-1]), dim=-1).indices, 1.0)
        kept = p * keep
        out.append(kept * (p.sum(-1, keepdim=True) / kept.sum(-1, keepdim=True)))
    return out


def expand(profile: torch.Tensor, batch: int, token: int) -> torch.Tensor:
    """A static profile ([token, stream, source] or [stream, source]) as a batch's coefficients (a view)."""
    if profile.dim() == 3:
        return profile[None].expand(batch, -1, -1, -1)
    return profile[None, None].expand(batch, token, -1, -1)


# ---- conditions ------------------------------------------------------------------------------------------------

class ReplayContext(Protocol):
    """What a condition may use to make a batch's replay coefficients (implemented by the audit engine)."""

    seed: int
    info: Description  # the controller as the conditions see it: its sites' kinds, references and layers

    def take(self, examples: np.ndarray) -> Coeffs: ...  # captured coefficients of these evaluation examples
    def derangement(self, r: int) -> np.ndarray: ...  # the donor of each example in randomization r
    def static(self, condition: str, batch: int) -> Coeffs: ...  # a static profile, expanded to a batch


@dataclass(frozen=True)
class Condition:
    name: str
    kind: str  # "reference" (Correct), "randomized" (R draws) or "static" (one deterministic replay)
    label: str  # default display label; a controller may rename StaticProfile and StructureRemoved
    make: Callable[[ReplayContext, int, np.ndarray], Coeffs]  # (context, randomization, examples) -> coefficients
    role: str | None = None  # factorial role: "input" (DC), "token" (CS), "both" (DS); None: outside Eq. 5-7
    profile: Callable[[Calibration, Description], list[torch.Tensor]] | None = None  # static: the profile
    retained: bool = False  # retention (Eq. 8) is reported for it against the structure-removed reference
    structure_removed: bool = False  # the reference R of Eq. 8

    @property
    def randomized(self) -> bool:
        return self.kind == "randomized"


def _static(name: str) -> Callable:
    return lambda ctx, r, examples: ctx.static(name, len(examples))


# in paper order; what each controls for: docs/concepts.md; which kinds offer each: fcaudit.kinds
REGISTRY: dict[str, Condition] = {c.name: c for c in (
    Condition("Correct", "reference", "Correct", lambda ctx, r, ex: ctx.take(ex)),
    Condition("CrossInput", "randomized", "Cross-input", cross_input, role="input"),
    Condition("TokenShuffle", "randomized", "Token-shuffle",
              lambda ctx, r, ex: shuffle_tokens(ctx.take(ex), ex, ctx.seed, r, ctx.info.draws), role="token"),
    Condition("CrossShuffle", "randomized", "Cross+shuffle",  # the paired CrossInput donor and TokenShuffle draws
              lambda ctx, r, ex: shuffle_tokens(cross_input(ctx, r, ex), ex, ctx.seed, r, ctx.info.draws),
              role="both"),
    Condition("TokenResamplePast", "randomized", "Token-resample-past",  # the causal control of TokenShuffle
              lambda ctx, r, ex: (routes_past(ctx.take(ex), ex, ctx.seed, r) if ctx.info.tokens
                                  else kept(ctx, resample_past(ctx.take(ex), ex, ctx.seed, r, ctx.info.draws), r, ex,
                                            RESAMPLE))),
    Condition("LayerPositionMean", "static", "Layer×PositionMean", _static("LayerPositionMean"),
              profile=lambda cal, ctrl: cal.layer_position_mean(), retained=True),
    Condition("StaticProfile", "static", "StaticProfile", _static("StaticProfile"),
              profile=lambda cal, ctrl: cal.layer_mean(), retained=True),
    Condition("StaticTopK", "static", "StaticTopK",
              lambda ctx, r, ex: (static_routes(ctx.static("StaticTopK", len(ex)), ctx.take(ex)) if ctx.info.tokens
                                  else ctx.static("StaticTopK", len(ex))),
              profile=lambda cal, ctrl: cal.layer_position_mean() if ctrl.tokens else static_top_k(cal), retained=True),
    Condition("StructureRemoved", "static", "StructureRemoved", _static("StructureRemoved"),
              profile=reference_profiles, structure_removed=True),
    Condition("RandomRoute", "randomized", "RandomRoute",  # token routers' structure-removed reference
              lambda ctx, r, ex: random_routes(ctx.take(ex), ex, ctx.seed, r), structure_removed=True),
    Condition("StaticDepth", "static", "StaticDepth",  # depth: each window's budget laid out by the calibration profile
              lambda ctx, r, ex: depth.static(ctx.info.depth, ctx.static("StaticDepth", len(ex)), ctx.take(ex),
                                              window=ctx.info.window),
              profile=lambda cal, ctrl: cal.layer_position_mean(), retained=True),
    # the depth kinds' structure-removed references: exit depths, halting distributions, run cells at random
    *(Condition(name, "randomized", name, random_depth, structure_removed=True)
      for name in ("RandomExit", "RandomHalt", "RandomSkip")),
)}


def for_controller(ctrl: Description) -> list[str]:
    """The conditions an audit of this controller runs: those its sites' kinds offer, in registry order."""
    return [c.name for c in REGISTRY.values() if c.name in ctrl.conditions]


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
