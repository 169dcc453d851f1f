"""Capacity routers (GShard / Switch): each token's combine vector as the coefficient, the expert slots rebuilt from
it by the router's own rule, so that no condition can put two tokens in one slot. (A token router's codec, TokenRoute,
is in controllers.codecs.)
"""

from __future__ import annotations

from typing import Any

import torch

from fcaudit.controllers.codecs import Codec
from fcaudit.controllers.sites import shape_of
from fcaudit.errors import FcauditError
from fcaudit.kinds import CAPACITY_ROUTER


def slots(c: torch.Tensor, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The router's slot rule on canonical combine vectors c [batch, token, 1, E]: (kept, slot), both [batch, token,
    E]. Each assignment (a nonzero weight) takes its expert's next slot in sequence order, kept below the capacity."""
    assigned = c[:, :, 0, :] != 0
    slot = assigned.long().cumsum(1) - 1
    return assigned & (slot < capacity), slot


def placed(c: torch.Tensor, capacity: int) -> torch.Tensor:
    """[batch, token, E, capacity] bool: the slot of each kept assignment (the dispatch mask the router builds)."""
    kept, slot = slots(c, capacity)
    return kept[..., None] & (slot.clamp(0, capacity - 1)[..., None] == torch.arange(capacity, device=c.device))


class CapacityRoute(Codec):
    """A GShard / Switch capacity router's (dispatch, combine) [batch, token, E, capacity] <-> each token's combine
    vector [batch, token, 1, E].

    Each token goes to its top-k experts, and an expert takes the first `capacity` of them per window. The slots are
    not the coefficient (a condition could move two tokens into one): decode rebuilds them by that rule (`slots`), so
    a slot holds at most one token under every condition, and `executed` counts what ran and what was dropped. A
    router with another slot rule is refused."""

    name = "capacity router"
    kind = CAPACITY_ROUTER.name

    def __init__(self, num_experts: int, capacity: int, top_k: int = 2):
        if num_experts < 1 or capacity < 1 or not 1 <= top_k <= num_experts:
            raise FcauditError(f"{self.name}: num_experts={num_experts}, capacity={capacity}, top_k={top_k}: give at "
                               "least one expert, a capacity of at least 1 and 1 <= top_k <= num_experts")
        self.num_experts, self.capacity, self.top_k = int(num_experts), int(capacity), int(top_k)
        self.counts = tuple(f"expert{e}" for e in range(self.num_experts)) + ("dropped",)

    def encode(self, output: Any, batch: int, token: int) -> torch.Tensor:
        sequence = isinstance(output, (tuple, list))
        if not (sequence and len(output) == 2 and all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in output)
                and output[0].shape == output[1].shape):
            got = f"({', '.join(map(shape_of, output))})" if sequence else type(output).__name__
            raise FcauditError(f"{self.name} returned {got}, not (dispatch, combine) of shape [batch, token, expert, "
                               "slot]; point the pattern at the router module that returns them")
        dispatch, combine = output
        if not combine.is_floating_point():
            raise FcauditError(f"{self.name}: combine weights of dtype {combine.dtype} are not floating point; the "
                               "second output must be the combine weights")
        if tuple(combine.shape) != (batch, token, self.num_experts, self.capacity):
            raise FcauditError(f"{self.name} returned dispatch/combine of shape {list(combine.shape)}, not "
                               f"[{batch}, {token}, {self.num_experts}, {self.capacity}]; pass "
                               "CapacityRoute(num_experts, capacity) as the router has them (capacity = its slots "
                               "per expert and window)")
        dtype = torch.promote_types(combine.dtype, torch.float32)  # bf16 / fp16 weights convert to it and back exactly
        c = combine.detach().to(dtype).sum(-1)[:, :, None, :]  # one slot per (token, expert) holds the weight
        if not torch.equal(placed(c, self.capacity), dispatch.detach() != 0):
            raise FcauditError(f"{self.name}: its slots are not assigned in sequence order per expert and window (or "
                               "a dispatched token has weight 0); CapacityRoute rebuilds slots by that rule only, so "
                               "this router needs its own codec")
        return c.contiguous()

    def meta(self, output: Any) -> dict:  # of an output `encode` has checked
        return {"dispatch_dtype": output[0].dtype, "combine_dtype": output[1].dtype, "type": type(output)}

    def decode(self, canonical: torch.Tensor, meta: dict) -> tuple[torch.Tensor, torch.Tensor]:
        if canonical.dim() != 4 or tuple(canonical.shape[2:]) != (1, self.num_experts):
            raise FcauditError(f"{self.name}: coefficients of shape {list(canonical.shape)} are not "
                               f"[batch, token, 1, {self.num_experts}]")
        where = placed(canonical, self.capacity)
        combine = torch.where(where, canonical[:, :, 0, :, None].to(meta["combine_dtype"]), 0.0)
        out = (where.to(meta["dispatch_dtype"]), combine)
        return list(out) if meta["type"] is list else out

    def executed(self, canonical: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per window: the (token, expert) assignments that run [B] and the counts [B, E + 1]: tokens each expert
        runs, then the assignments dropped past the capacity (float64)."""
        kept, _ = slots(canonical, self.capacity)
        dropped = (canonical[:, :, 0, :] != 0) & ~kept
        per_expert = kept.sum(1).double()
        return per_expert.sum(1), torch.cat([per_expert, dropped.sum((1, 2)).double()[:, None]], 1)

    def describe(self) -> str:
        return (f"capacity router: top-{self.top_k} of {self.num_experts} experts, capacity {self.capacity} per "
                f"expert and window, slots in sequence order: (batch token) expert combine vector")
