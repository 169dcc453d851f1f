"""Depth decisions (early exit, halting, block skipping) as the audit sees them: how much a window executes (its
budget: the (layer, token) pairs that run) and the operations the budget-keeping conditions are made of.

A depth controller's sites, in order, hold one kind (fcaudit.kinds):
- exit_depth: one site per block but the last, canonical [batch, token, 1, 1] 1.0 where the token has exited after
  that block (monotone over the sites: the capture keeps the first exit, `canonical`); a token's depth is 1 + the
  sites it passed, so it runs blocks 0 .. depth - 1;
- halting: per token a distribution over steps (the sites' sources side by side, [batch, token, 1, steps] each),
  the weights ACT or PonderNet mix the step states by; its depth is 1 + its last step of nonzero weight;
- skip_mask: one site per skippable block, [batch, token, 1, 1] 1.0 where the block runs for the token (not
  monotone).
Decisions made once per window (`window`: a sequence's halt, a block skipped for a whole input) are equal over its
tokens; the operations then read token 0 and give every token its result.

The budget is counted in units: a layer of one token, or of the whole window where decisions are per window. `fit` changes as few units as the budget difference, one at a time at random, and
`profile_units` rounds a profile to a budget: both exact, so every condition keeps each window's budget exactly.
Imports nothing of fcaudit but its error type.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from fcaudit.errors import FcauditError

STEPS = ("exit_depth", "halting")  # a token's decision is a depth
KINDS = STEPS + ("skip_mask",)  # skip_mask: a run/skip decision per (layer, token)

Coeffs = Sequence[torch.Tensor]


def canonical(kind: str, coeffs: Coeffs) -> list[torch.Tensor]:
    """Exit decisions as the model obeys them: a token stays exited after its first exit (the later sites' values
    for it, which the model ignores, become 1). Every other kind as it is."""
    if kind != "exit_depth":
        return list(coeffs)
    out, seen = [], None
    for c in coeffs:
        seen = c if seen is None else torch.maximum(seen.to(c.device), c)
        out.append(seen)
    return out


def first(coeffs: Coeffs) -> list[torch.Tensor]:
    """Per-window decisions as one token: token 0 of each window (all its tokens hold the same)."""
    return [c[:, :1] for c in coeffs]


def spread(coeffs: Coeffs, token: int) -> list[torch.Tensor]:
    """One token's decisions given to all `token` tokens of its window."""
    return [c.expand(-1, token, -1, -1).contiguous() for c in coeffs]


def top(kind: str, coeffs: Coeffs) -> int:
    """The most units a token can execute: blocks, steps or skippable blocks."""
    if kind == "exit_depth":
        return len(coeffs) + 1
    if kind == "halting":
        return sum(c.shape[3] for c in coeffs)
    return len(coeffs)


def depths(kind: str, coeffs: Coeffs) -> torch.Tensor:
    """[batch, token] int64: each token's depth (exit_depth, halting)."""
    if kind == "exit_depth":
        return 1 + sum((c[:, :, 0, 0] <= 0.5).long() for c in coeffs)
    w = torch.cat([c.to(coeffs[0].device) for c in coeffs], -1)[:, :, 0, :] != 0
    last = w.shape[-1] - 1 - w.flip(-1).long().argmax(-1)
    return torch.where(w.any(-1), last + 1, 1)


def cells(kind: str, coeffs: Coeffs) -> torch.Tensor:
    """[batch, layer, token] bool: which (layer, token) cells run (skip_mask)."""
    return torch.stack([c[:, :, 0, 0].to(coeffs[0].device) > 0.5 for c in coeffs], 1)


def units(kind: str, coeffs: Coeffs, window: bool = False) -> np.ndarray:
    """Each window's budget in its units, int64 [batch]."""
    coeffs = first(coeffs) if window else coeffs
    per = depths(kind, coeffs) if kind in STEPS else cells(kind, coeffs)
    return per.reshape(per.shape[0], -1).sum(1).cpu().numpy()


def executed(kind: str, coeffs: Coeffs, window: bool = False) -> torch.Tensor:
    """Per window [batch] float64: the fraction of its (layer, token) pairs that run, of the pairs it could run."""
    coeffs = first(coeffs) if window else coeffs
    return torch.from_numpy(units(kind, coeffs)).double() / (top(kind, coeffs) * coeffs[0].shape[1])


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


# ---- from decisions to units and back --------------------------------------------------------------------------

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


def with_depths(kind: str, like: Coeffs, d: np.ndarray, weights: np.ndarray | None = None) -> list[torch.Tensor]:
    """Coefficients whose tokens have depths d [batch, token]: exit decisions (exited after site l where d <= l + 1),
    or halting `weights` [batch, token, steps] (default: those of `like`) set to those depths."""
    if kind == "exit_depth":
        d = torch.from_numpy(d)
        return [(d <= l + 1)[:, :, None, None].to(c.dtype).to(c.device) for l, c in enumerate(like)]
    w = weights if weights is not None else torch.cat([c.cpu() for c in like], -1)[:, :, 0, :].double().numpy()
    out = np.stack([[set_depth(wt, int(dt)) for wt, dt in zip(wb, db)] for wb, db in zip(w, d)])
    return _sites(like, torch.from_numpy(out)[:, :, None, :])


def with_cells(like: Coeffs, run: np.ndarray) -> list[torch.Tensor]:
    """Coefficients from run cells [batch, layer, token]."""
    run = torch.from_numpy(run)
    return [run[:, l, :, None, None].to(c.dtype).to(c.device) for l, c in enumerate(like)]


def per_window(op):
    """`op(kind, ..., taken, ...)` on per-window decisions (`window=True`): on token 0 of every coefficient
    tensor it takes, its result given to every token."""
    def run(kind: str, *args, window: bool = False):
        if not window:
            return op(kind, *args)
        tensors = [isinstance(a, list) and bool(a) and isinstance(a[0], torch.Tensor) for a in args]
        T = args[tensors.index(True)][0].shape[1]
        return spread(op(kind, *(first(a) if t else a for a, t in zip(args, tensors))), T)
    run.__doc__, run.__name__ = op.__doc__, op.__name__
    return run


# ---- the operations of the conditions --------------------------------------------------------------------------

@per_window
def fit(kind: str, coeffs: Coeffs, targets: np.ndarray, rngs: Sequence[np.random.Generator]) -> list[torch.Tensor]:
    """Each window's decisions moved by as few units as its budget differs from `targets` (its receiving window's
    own), at random units: a token's depth one layer deeper or shallower, a cell run or skipped."""
    if kind in STEPS:
        d = depths(kind, coeffs).cpu().numpy()
        new = np.stack([fit_units(row, t, 1, top(kind, coeffs), rng) for row, t, rng in zip(d, targets, rngs)])
        return with_depths(kind, coeffs, new)
    run = cells(kind, coeffs).cpu().numpy().astype(np.int64)
    new = np.stack([fit_units(row.ravel(), t, 0, 1, rng).reshape(row.shape) for row, t, rng in zip(run, targets, rngs)])
    return with_cells(coeffs, new.astype(bool))


@per_window
def static(kind: str, profile: Coeffs, taken: Coeffs) -> list[torch.Tensor]:
    """StaticDepth: each window's own budget laid out as the calibration windows' profile says (`profile`: the
    layer x position means, expanded to the batch): each position's mean depth (exit_depth), each position's mean
    halting distribution at the depth its mean step gives (halting), the cells (layers) run most often."""
    targets = units(kind, taken)
    if kind == "exit_depth":
        mean = (1 + sum(1 - p[0, :, 0, 0].double() for p in profile)).cpu().numpy()
        d = np.stack([profile_units(mean, t, 1, top(kind, taken)) for t in targets])
        return with_depths(kind, taken, d)
    if kind == "halting":
        w = torch.cat([p[:1].cpu() for p in profile], -1)[0, :, 0, :].double()  # [token, steps]
        step = (w * torch.arange(1, w.shape[1] + 1)).sum(1) / w.sum(1).clamp_min(1e-12)
        d = np.stack([profile_units(step.numpy(), t, 1, w.shape[1]) for t in targets])
        return with_depths(kind, taken, d, np.broadcast_to(w.numpy(), (len(targets), *w.shape)))
    often = torch.stack([p[0, :, 0, 0].double().cpu() for p in profile])  # [layer, token]
    run = np.stack([profile_units(often.numpy().ravel(), t, 0, 1).reshape(often.shape) for t in targets])
    return with_cells(taken, run.astype(bool))


@per_window
def random(kind: str, profile: Coeffs, taken: Coeffs, rngs: Sequence[np.random.Generator]) -> list[torch.Tensor]:
    """The structure-removed reference (RandomExit, RandomHalt, RandomSkip): decisions drawn independently per token
    from the calibration windows' distribution pooled over positions, then fitted to each window's own budget
    (`fit`): which token goes how deep, or which cells run, is random; the budget and the calibration's layer
    pattern are kept."""
    targets, (B, T) = units(kind, taken), taken[0].shape[:2]
    if kind in STEPS:
        if kind == "exit_depth":  # P(depth >= l + 2) = P(not exited after block l), pooled over positions
            passed = np.array([1.0] + [float(1 - p[0, :, 0, 0].double().mean()) for p in profile] + [0.0])
            weights, pooled = None, np.clip(passed[:-1] - passed[1:], 0, None)
        else:  # a token's depth drawn from the pooled mean halting distribution, which it then carries
            pooled = torch.cat([p[0].cpu() for p in profile], -1)[:, 0, :].double().mean(0).numpy()
            weights = np.broadcast_to(pooled, (B, T, len(pooled)))
        drawn = np.stack([rng.choice(len(pooled), T, p=pooled / pooled.sum()) + 1 for rng in rngs])
        start = with_depths(kind, taken, drawn, weights)
        return fit(kind, start, targets, rngs)
    rate = np.array([float(p[0, :, 0, 0].double().mean()) for p in profile])  # each layer's pooled run rate
    run = np.stack([rng.random((len(rate), T)) < rate[:, None] for rng in rngs])
    return fit(kind, with_cells(taken, run), targets, rngs)
