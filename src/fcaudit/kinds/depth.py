"""Depth decisions (early exit, halting, block skipping) as the audit sees them: how much a window executes (its
budget: the (layer, token) pairs that run) and the operations the budget-keeping conditions are made of.

A depth controller's sites, in order, hold one kind:
- exit_depth: one site per exit decision, canonical [batch, token, 1, 1] 1.0 where the token has exited after that
  block (monotone over the sites: the capture keeps the first exit, `canonical`); a token's depth is 1 + the sites
  it passed, so it runs blocks 0 .. depth - 1 of the decided ones;
- halting: per token a distribution over steps (the sites' sources side by side, [batch, token, 1, steps] each),
  the weights ACT or PonderNet mix the step states by; its depth is 1 + its last step of nonzero weight;
- skip_mask: one site per skippable block, [batch, token, 1, 1] 1.0 where the block runs for the token (not
  monotone).
Blocks that always run before the decided ones (`Decisions(always=k)`: exit sites that start after block k) count
as executed for every token. Decisions made once per window (`window`: a sequence's halt, a block skipped for a whole
input) are equal over its tokens; the operations then read token 0 and give every token its result.

The budget is counted in units: a layer of one token, or of the whole window where decisions are per window. `fit`
changes as few units as the budget difference, one at a time at random, and `profile_units` rounds a profile to a
budget: both exact, so every condition keeps each window's budget exactly. Imports nothing of fcaudit but its error
type and this package's base.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from fcaudit.errors import FcauditError
from fcaudit.kinds.base import RANDOMIZED, Context, Kind, register
from fcaudit.kinds.moves import DEPTH_FIT, DEPTH_RANDOM

Coeffs = Sequence[torch.Tensor]

DEPTH = RANDOMIZED + ("StaticDepth",)  # every depth kind's, each with its structure-removed reference
DEPTH_NOTE = ("depth: LayerPositionMean, StaticProfile and GlobalMean are not offered (the mean of exits or of run/skip "
              "choices is no depth); every condition keeps each window's budget of executed (layer, token) pairs")
# a halting distribution sums to 1 per token up to rounding of this many ulps per step
SUM_ULPS = 64


def first(coeffs: Coeffs) -> list[torch.Tensor]:
    """Per-window decisions as one token: token 0 of each window (all its tokens hold the same)."""
    return [c[:, :1] for c in coeffs]


def spread(coeffs: Coeffs, token: int) -> list[torch.Tensor]:
    """One token's decisions given to all `token` tokens of its window."""
    return [c.expand(-1, token, -1, -1).contiguous() for c in coeffs]


# ---- budgets ----------------------------------------------------------------------------------------------------

def fit_units(values: np.ndarray, target: int, low: int, high: int, rng: np.random.Generator) -> np.ndarray:
    """`values` (ints in [low, high]) with sum `target`: |sum - target| units moved by one each, at units drawn
    uniformly among those that can move (no value leaves [low, high]). Reads the total only, no value's place."""
    k = int(values.sum()) - int(target)
    if k == 0:
        return values
    room = values - low if k > 0 else high - values
    slots = np.repeat(np.arange(len(values)), room)
    if len(slots) < abs(k):
        raise FcauditError(f"a budget of {target} units does not fit {len(values)} values in [{low}, {high}]")
    out = values.copy()
    np.add.at(out, slots[rng.choice(len(slots), abs(k), replace=False)], -int(np.sign(k)))
    return out


def profile_units(profile: np.ndarray, target: int, low: int, high: int) -> np.ndarray:
    """Integers in [low, high] with sum `target` that follow `profile` (floats): profile + c clipped to [low, high]
    with the shift c that gives the target, rounded down, and the remaining units to the largest remainders (ties:
    the earlier entry). Deterministic."""
    lo, hi = low - float(profile.max()), high - float(profile.min())
    for _ in range(80):  # bisection on the shift: the clipped sum is monotone in it
        c = (lo + hi) / 2
        lo, hi = (c, hi) if np.clip(profile + c, low, high).sum() < target else (lo, c)
    x = np.clip(profile + hi, low, high)
    out = np.clip(np.floor(x + 1e-9), low, high).astype(np.int64)
    frac = x - out
    left = int(target) - int(out.sum())
    if left > 0:
        order = [i for i in np.argsort(-frac, kind="stable") if out[i] < high]
        out[order[:left]] += 1
    elif left < 0:
        order = [i for i in np.argsort(frac, kind="stable") if out[i] > low]
        out[order[:-left]] -= 1
    return out


def set_depth(w: np.ndarray, d: int) -> np.ndarray:
    """A halting distribution over steps [steps] with depth `d`: the mass past step d folds into step d (the last
    that runs), or the last step's mass moves to step d; the total is kept. An all-zero row stays as it is."""
    nz = np.flatnonzero(w)
    if not len(nz) or nz[-1] + 1 == d:
        return w
    w = w.copy()
    if nz[-1] + 1 > d:
        w[d - 1] += w[d:].sum()
        w[d:] = 0
    else:
        w[d - 1], w[nz[-1]] = w[nz[-1]], 0
    return w


def _sites(like: Coeffs, values: torch.Tensor) -> list[torch.Tensor]:
    """Split [batch, token, 1, sources] along the sites' source widths, each in its site's dtype and device."""
    parts = values.split([c.shape[3] for c in like], -1)
    return [p.to(c.dtype).to(c.device).contiguous() for p, c in zip(parts, like)]


def with_cells(like: Coeffs, run: np.ndarray) -> list[torch.Tensor]:
    """Coefficients from run cells [batch, layer, token]."""
    run = torch.from_numpy(run)
    return [run[:, l, :, None, None].to(c.dtype).to(c.device) for l, c in enumerate(like)]


def per_window(op):
    """`kind.op(..., taken, ...)` on per-window decisions (`window=True`): on token 0 of every coefficient tensor it
    takes, its result given to every token."""
    def run(self, *args, window: bool = False):
        if not window:
            return op(self, *args)
        tensors = [isinstance(a, list) and bool(a) and isinstance(a[0], torch.Tensor) for a in args]
        T = args[tensors.index(True)][0].shape[1]
        return spread(op(self, *(first(a) if t else a for a, t in zip(args, tensors))), T)
    run.__doc__, run.__name__ = op.__doc__, op.__name__
    return run


# ---- the kinds ---------------------------------------------------------------------------------------------------

class Depth(Kind):
    """How deep each token goes. Its conditions move a token's whole depth as one (`Description.draws`) and keep
    each window's budget of executed (layer, token) pairs: where a window receives other decisions than its own
    (CrossInput, TokenResamplePast) they are fitted to its own budget (`fit`)."""

    static = "StaticDepth"
    note = DEPTH_NOTE
    router = depth = True
    codec, coefficient, reads = "Decisions", "a decision per token", "Decisions reads a [batch, token] output"
    steps = True  # a token's decision is a depth (else a run/skip decision per (layer, token))
    runs = "units"  # `runs=`: its blocks in order (the `always` ones first), whose rows the audit observes (`rows`)
    replay_fix = ("declare the decisions the model obeys (its kind, codec and the blocks that always run), made "
                  "deterministically: a tolerance would let other depths than the model ran stand for its budget")

    def decisions(self, c: torch.Tensor) -> torch.Tensor:
        return c > 0.5

    def check(self, site: str, c: torch.Tensor, window: bool) -> None:
        if c.shape[2:] != (1, 1):
            raise FcauditError(f"site {site!r}: a {self.name} site holds one decision per token, but its coefficients "
                               f"have {c.shape[2]} streams x {c.shape[3]} sources (one module deciding for several "
                               "blocks?): declare one site per block, e.g. from_ops or a codec per block's decision")

    # what a window executes
    def top(self, coeffs: Coeffs) -> int:
        """The most units a token can execute: blocks, steps or skippable blocks."""
        return len(coeffs)

    def per(self, coeffs: Coeffs) -> torch.Tensor:
        """Each token's depth [batch, token] (steps), else the run cells [batch, layer, token]."""
        raise NotImplementedError

    def units(self, coeffs: Coeffs, window: bool = False) -> np.ndarray:
        """Each window's budget in its units, int64 [batch]."""
        coeffs = first(coeffs) if window else coeffs
        per = self.per(coeffs)
        return per.reshape(per.shape[0], -1).sum(1).cpu().numpy()

    def executed(self, coeffs: Coeffs, window: bool = False, always: int = 0) -> torch.Tensor:
        """Per window [batch] float64: the fraction of its (layer, token) pairs that run, of the pairs it could run;
        `always`: blocks before the decided ones, which run for every token."""
        coeffs = first(coeffs) if window else coeffs
        T = coeffs[0].shape[1]
        ran = torch.from_numpy(self.units(coeffs)).double() + always * T
        return ran / ((self.top(coeffs) + always) * T)

    def active(self, info, coeffs, ran) -> torch.Tensor:
        return self.executed(coeffs, info.window, info.always[0])

    def rows(self, coeffs: Coeffs, always: int = 0) -> list[int]:
        """The (block, token) pairs run in each block over the batch: every token in the `always` blocks, then in
        each decided block (or step) the tokens that reach it (or for which it runs)."""
        B, T = coeffs[0].shape[:2]
        per = self.per(coeffs)
        ran = [int((per > l).sum()) for l in range(self.top(coeffs))] if self.steps else per.sum((0, 2)).tolist()
        return [B * T] * always + [int(n) for n in ran]

    def budget(self, info, coeffs: Coeffs) -> np.ndarray:
        return self.units(coeffs, info.window)

    def zero(self, info) -> dict[str, str]:
        if not info.window:
            return {}
        if self.steps:  # a window's depth is its budget, which every condition keeps
            why = ("the depth is decided once per window, so a window's depth is its budget, which every condition "
                   "keeps: each condition replays every window's own depth")
            return {c: why for c in (*self.conditions[1:], "E_input", "E_token", "E_interaction")}
        why = ("the skip decisions are made once per window, the same for all its tokens: moving them between positions "
               "moves nothing (CrossShuffle replays CrossInput's decisions)")
        return {c: why for c in ("TokenShuffle", "TokenResamplePast", "E_token", "E_interaction")}

    # the conditions
    def keep(self, ctx: Context, coeffs, r: int, examples: np.ndarray, tag: int):
        """`coeffs` fitted to the budgets of the receiving windows `examples` (their own captured ones)."""
        info = ctx.info
        own = self.units(ctx.take(examples), info.window)
        rngs = [np.random.default_rng([DEPTH_FIT, tag, ctx.seed, r, int(e)]) for e in examples]
        return self.fit(coeffs, own, rngs, window=info.window)

    def static_depth(self, ctx: Context, r: int, examples: np.ndarray):
        return self.layout(ctx.static("StaticDepth", len(examples)), ctx.take(examples), window=ctx.info.window)

    def reference_draw(self, ctx: Context, r: int, examples: np.ndarray):
        """The structure-removed reference r (`random`), from the StaticDepth profile."""
        rngs = [np.random.default_rng([DEPTH_RANDOM, ctx.seed, r, int(e)]) for e in examples]
        return self.random(ctx.static("StaticDepth", len(examples)), ctx.take(examples), rngs, window=ctx.info.window)

    random_exit = random_halt = random_skip = reference_draw

    @per_window
    def fit(self, coeffs: Coeffs, targets: np.ndarray, rngs: Sequence[np.random.Generator]) -> list[torch.Tensor]:
        """Each window's decisions moved by as few units as its budget differs from `targets` (its receiving window's
        own), at random units: a token's depth one layer deeper or shallower, a cell run or skipped."""
        if self.steps:
            d = self.per(coeffs).cpu().numpy()
            new = np.stack([fit_units(row, t, 1, self.top(coeffs), rng) for row, t, rng in zip(d, targets, rngs)])
            return self.with_depths(coeffs, new)
        run = self.per(coeffs).cpu().numpy().astype(np.int64)
        new = np.stack([fit_units(row.ravel(), t, 0, 1, rng).reshape(row.shape)
                        for row, t, rng in zip(run, targets, rngs)])
        return with_cells(coeffs, new.astype(bool))

    @per_window
    def layout(self, profile: Coeffs, taken: Coeffs) -> list[torch.Tensor]:
        """StaticDepth: each window's own budget laid out as the calibration windows' profile (`profile`: the layer x
        position means, expanded to the batch) says."""
        raise NotImplementedError

    @per_window
    def random(self, profile: Coeffs, taken: Coeffs, rngs: Sequence[np.random.Generator]) -> list[torch.Tensor]:
        """The structure-removed reference (RandomExit, RandomHalt, RandomSkip): decisions drawn independently per
        token from the calibration windows' distribution pooled over positions, then fitted to each window's own
        budget (`fit`): which token goes how deep, or which cells run, is random; the budget and the calibration's
        layer pattern are kept."""
        targets, (B, T) = self.units(taken), taken[0].shape[:2]
        if self.steps:
            weights, pooled = self.pooled(profile, B, T)
            drawn = np.stack([rng.choice(len(pooled), T, p=pooled / pooled.sum()) + 1 for rng in rngs])
            return self.fit(self.with_depths(taken, drawn, weights), targets, rngs)
        rate = np.array([float(p[0, :, 0, 0].double().mean()) for p in profile])  # each layer's pooled run rate
        run = np.stack([rng.random((len(rate), T)) < rate[:, None] for rng in rngs])
        return self.fit(with_cells(taken, run), targets, rngs)


class ExitDepth(Depth):
    name = "exit_depth"
    conditions = DEPTH + ("RandomExit",)
    reference = "RandomExit"
    references = ("RandomExit",)

    def everything(self, c: torch.Tensor) -> torch.Tensor:
        """No token exits: every block runs for every token."""
        return torch.zeros_like(c)

    def canonical(self, coeffs: Coeffs) -> list[torch.Tensor]:
        """Exit decisions as the model obeys them: a token stays exited after its first exit (the later sites'
        values for it, which the model ignores, become 1)."""
        out, seen = [], None
        for c in coeffs:
            seen = c if seen is None else torch.maximum(seen.to(c.device), c)
            out.append(seen)
        return out

    def top(self, coeffs: Coeffs) -> int:
        return len(coeffs) + 1

    def per(self, coeffs: Coeffs) -> torch.Tensor:
        return 1 + sum((c[:, :, 0, 0] <= 0.5).long() for c in coeffs)

    def with_depths(self, like: Coeffs, d: np.ndarray, weights: np.ndarray | None = None) -> list[torch.Tensor]:
        """Exit decisions whose tokens have depths d [batch, token] (exited after site l where d <= l + 1)."""
        d = torch.from_numpy(d)
        return [(d <= l + 1)[:, :, None, None].to(c.dtype).to(c.device) for l, c in enumerate(like)]

    @per_window
    def layout(self, profile: Coeffs, taken: Coeffs) -> list[torch.Tensor]:
        """Each position's mean depth, shifted to the window's budget."""
        mean = (1 + sum(1 - p[0, :, 0, 0].double() for p in profile)).cpu().numpy()
        d = np.stack([profile_units(mean, t, 1, self.top(taken)) for t in self.units(taken)])
        return self.with_depths(taken, d)

    def pooled(self, profile: Coeffs, B: int, T: int) -> tuple[None, np.ndarray]:
        """P(depth = d) pooled over positions: P(depth >= l + 2) = P(not exited after block l)."""
        passed = np.array([1.0] + [float(1 - p[0, :, 0, 0].double().mean()) for p in profile] + [0.0])
        return None, np.clip(passed[:-1] - passed[1:], 0, None)


class Halting(Depth):
    name = "halting"
    conditions = DEPTH + ("RandomHalt",)
    reference = "RandomHalt"
    references = ("RandomHalt",)
    codec = None  # soft weights: a layout
    coefficient = reads = ""

    def everything(self, c: torch.Tensor) -> None:
        """None: which step is a token's last is spread over the sites' sources, and a halting model may run every
        step whatever its weights say; a model of fixed depth is a reference of its own."""
        return None

    def decisions(self, c: torch.Tensor) -> torch.Tensor:
        return c != 0

    def check(self, site: str, c: torch.Tensor, window: bool) -> None:
        if c.shape[2] != 1:
            raise FcauditError(f"site {site!r}: halting weights hold one distribution over steps per token, but its "
                               f"coefficients have {c.shape[2]} streams: give the layout 'batch token step'")

    def validate(self, sites: Sequence[str], coeffs: Coeffs, window: bool) -> None:
        """Refused unless each token's weights over all steps (the sites side by side) are a distribution: >= 0
        and summing to 1 (ACT's and PonderNet's are; per-step halting probabilities or a continue mask are not)."""
        super().validate(sites, coeffs, window)
        w = torch.cat([c.to(coeffs[0].device).double() for c in coeffs], -1)[:, :, 0, :]
        total = w.sum(-1)
        eps = max(float(torch.finfo(c.dtype).eps) for c in coeffs if c.is_floating_point()) if any(
            c.is_floating_point() for c in coeffs) else 0.0
        off = (total - 1).abs() > SUM_ULPS * eps * w.shape[-1]
        if bool((w < 0).any()) or bool(off.any()):
            lo, hi = float(total.min()), float(total.max())
            raise FcauditError(f"halting sites {sites[0]!r}...: the weights over steps are not a distribution per token "
                               f"(sums {lo:.3g} to {hi:.3g}{', negative weights' if bool((w < 0).any()) else ''}); "
                               "declare the weights the model mixes step states by (ACT: p_t with the remainder at "
                               "the halting step, summing to 1), or a 0/1 continue decision per step as "
                               "kind='skip_mask' (one site per step), or its first stop as kind='exit_depth'")

    def top(self, coeffs: Coeffs) -> int:
        return sum(c.shape[3] for c in coeffs)

    def per(self, coeffs: Coeffs) -> torch.Tensor:
        w = torch.cat([c.to(coeffs[0].device) for c in coeffs], -1)[:, :, 0, :] != 0
        last = w.shape[-1] - 1 - w.flip(-1).long().argmax(-1)
        return torch.where(w.any(-1), last + 1, 1)

    def with_depths(self, like: Coeffs, d: np.ndarray, weights: np.ndarray | None = None) -> list[torch.Tensor]:
        """Halting `weights` [batch, token, steps] (default: those of `like`) set to depths d [batch, token]."""
        w = weights if weights is not None else torch.cat([c.cpu() for c in like], -1)[:, :, 0, :].double().numpy()
        out = np.stack([[set_depth(wt, int(dt)) for wt, dt in zip(wb, db)] for wb, db in zip(w, d)])
        return _sites(like, torch.from_numpy(out)[:, :, None, :])

    @per_window
    def layout(self, profile: Coeffs, taken: Coeffs) -> list[torch.Tensor]:
        """Each position's depth as the budget counts it (its last step of nonzero mean weight over the calibration
        windows), shifted to the window's budget, with the position's mean halting distribution set to that depth:
        where halting depends on the position only, every token keeps its own depth and weights."""
        w = torch.cat([p[:1].cpu() for p in profile], -1)[0, :, 0, :].double()  # [token, steps]
        nz = w != 0
        last = (w.shape[1] - nz.flip(-1).long().argmax(-1)).where(nz.any(-1), torch.ones((), dtype=torch.long))
        d = np.stack([profile_units(last.double().numpy(), t, 1, w.shape[1]) for t in self.units(taken)])
        return self.with_depths(taken, d, np.broadcast_to(w.numpy(), (len(d), *w.shape)))

    def pooled(self, profile: Coeffs, B: int, T: int) -> tuple[np.ndarray, np.ndarray]:
        """A token's depth drawn from the pooled mean halting distribution, which it then carries."""
        pooled = torch.cat([p[0].cpu() for p in profile], -1)[:, 0, :].double().mean(0).numpy()
        return np.broadcast_to(pooled, (B, T, len(pooled))), pooled


class SkipMask(Depth):
    name = "skip_mask"
    conditions = DEPTH + ("RandomSkip",)
    reference = "RandomSkip"
    references = ("RandomSkip",)
    steps = False

    def everything(self, c: torch.Tensor) -> torch.Tensor:
        """Every block runs for every token."""
        return torch.ones_like(c)

    def per(self, coeffs: Coeffs) -> torch.Tensor:
        return torch.stack([c[:, :, 0, 0].to(coeffs[0].device) > 0.5 for c in coeffs], 1)

    @per_window
    def layout(self, profile: Coeffs, taken: Coeffs) -> list[torch.Tensor]:
        """The cells (layers x positions) run most often, as many as the window's budget."""
        often = torch.stack([p[0, :, 0, 0].double().cpu() for p in profile])  # [layer, token]
        run = np.stack([profile_units(often.numpy().ravel(), t, 0, 1).reshape(often.shape) for t in self.units(taken)])
        return with_cells(taken, run.astype(bool))


EXIT_DEPTH = register(ExitDepth())
HALTING = register(Halting())
SKIP_MASK = register(SkipMask())
