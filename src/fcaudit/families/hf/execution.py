"""Execution measures for MoE models (the paper's question 3): the distinct experts of each token's index row as its
experts module receives it, and the FLOPs torch.utils.flop_counter counts inside that module. A static dense mixture
shows every expert running, and the zero-weight slots of "repeat" padding (GPT-OSS computes them) their FLOPs.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from fcaudit.controllers.controller import Controller
from fcaudit.families.hf.discover import moe_controller


@dataclass
class ExpertExecution:
    num_experts: list[int]           # per layer: experts that compute (LongCat-Flash's identity experts left out)
    experts_per_token: torch.Tensor  # [layers, batch, token] int64: experts run for each token
    expert_flops: list[int]          # per layer: FLOPs counted inside the experts module
    dense_flops: list[int]           # per layer: FLOPs if every token ran every expert (same per-expert cost)

    def summary(self) -> dict:
        """Experts run and expert FLOPs per token, against running every expert (the family's execution columns)."""
        active, dense, tokens = sum(self.expert_flops), sum(self.dense_flops), self.experts_per_token[0].numel()
        return {"experts_per_token": float(self.experts_per_token.float().mean()),
                "expert_flops_per_token": active / tokens, "all_experts_flops_per_token": dense / tokens,
                "active_expert_fraction": active / dense}


def computing_experts(experts: nn.Module, num_experts: int) -> int:
    """How many experts compute: those with a slice of every 3-D weight (not LongCat-Flash's identity experts)."""
    return min([num_experts, *(p.shape[0] for p in experts.parameters(recurse=False) if p.dim() == 3)])


def _flops_per_pair(experts: nn.Module, computing: int) -> int:
    """Matmul FLOPs of one (token, computing expert) pair: 2 x the size of one expert's slice of each 3-D weight, or
    of each 2-D weight that stacks the experts' rows (DBRX's [num_experts x size, hidden])."""
    own = [p for p in experts.parameters(recurse=False) if p.dim() == 3]
    if own:
        return sum(2 * p[0].numel() for p in own if p.shape[0] >= computing)
    return sum(2 * p.numel() // computing for p in experts.parameters() if p.dim() == 2 and p.shape[0] % computing == 0)


def expert_execution(model: nn.Module, ids: torch.Tensor, controller: Controller | None = None,
                     coefficients: Sequence[torch.Tensor] | None = None) -> ExpertExecution:
    """Experts run per token and layer, and expert FLOPs, for ids [batch, token] on the unmodified model or, with
    `coefficients` (canonical, one per site of `controller`, as a capture returns them), with those replayed."""
    controller = controller or moe_controller(model)
    routers = [controller.sites[i].codec for i in controller.info.routers]
    experts = [(c.experts_path, m, computing_experts(m, c.num_experts))
               for c in routers for m in [model.get_submodule(c.experts_path)]]
    B, T = ids.shape
    counts: dict[str, torch.Tensor] = {}

    def count(path: str, E: int, args: tuple, kwargs: dict) -> None:
        index = next((t for t in (*args, *kwargs.values())
                      if isinstance(t, torch.Tensor) and not t.is_floating_point()), None)
        if index is None:  # no index: every expert computes every token (Llama 4: inputs scaled by scores)
            counts[path] = torch.full((B, T), E, dtype=torch.int64)
            return
        # distinct computing experts per token: a "repeat" padding slot names one of the token's experts again,
        # and a zero-computation expert (or the sentinel) lands in the column dropped at the end
        hit = torch.zeros(index.shape[0], E + 1, dtype=torch.bool, device=index.device)
        hit.scatter_(1, torch.where((index >= 0) & (index < E), index, E).long(), True)
        counts[path] = hit[:, :E].sum(1).reshape(B, T).cpu()

    handles = [m.register_forward_pre_hook(lambda _, a, k, p=p, E=E: count(p, E, a, k), with_kwargs=True)
               for p, m, E in experts]
    replay = controller.replay(coefficients) if coefficients is not None else contextlib.nullcontext()
    # torch's module tracker fails on a view of a parameter that requires grad given to a module (DBRX's experts
    # pass each expert's slice of their weights to their MLP): none requires grad for this pass
    trainable = [p for p in model.parameters() if p.requires_grad]
    try:
        for p in trainable:
            p.requires_grad_(False)
        with torch.inference_mode(), replay, FlopCounterMode(display=False) as counter:
            model(input_ids=ids, use_cache=False)
    finally:
        for p in trainable:
            p.requires_grad_(True)
        for h in handles:
            h.remove()
    by_module = counter.get_flop_counts()  # keyed by path, under the model's own name
    keys = [next((k for k in by_module if k == p or k.endswith("." + p)), None) for p, _, _ in experts]
    return ExpertExecution([E for _, _, E in experts], torch.stack([counts[p] for p, _, _ in experts]),
                           [int(sum(by_module[k].values())) if k else 0 for k in keys],
                           [B * T * E * _flops_per_pair(m, E) for _, m, E in experts])
