"""Mixture-of-Depths (Raposo et al. 2024): a byte-level pre-LN decoder in which every other block runs on the
top-k tokens its router picks (expert choice over the window, k = capacity * T), the rest passing by on the residual
stream: h[t] += r[t] * F_l(h[S])[t] for t in the chosen S, the router's score r keeping it on the gradient path.
Top-k over the window is not causal, so a small causal predictor of "is t in the top-k" trains beside the model (BCE,
input detached); `routing="predictor"` runs on its choices. The blocks and decoder are FeatureGate's Dense ones, so
comparisons with Dense of the same shape measure the mechanism. `blocks[l].router` is the site an audit replays.
Decoding token by token (FeatureGate's KV cache) needs the causal predictor: a routed block's cache holds the tokens it
chose, so a token attends to the chosen tokens before it, as in the window's forward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from fcaudit.errors import FcauditError
from fcaudit.models import featuregate
from fcaudit.models.featuregate import GPT, Decoding, KVCache, check_config

VARIANTS = ("mod", "dense")
ROUTINGS = ("topk", "predictor")


@dataclass
class MoDConfig:
    variant: str = "mod"
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 96
    block_size: int = 128
    vocab_size: int = 256
    capacity: float = 0.125  # fraction of a window's tokens that enter each routed block
    route_every: int = 2  # blocks 1, 3, 5, ... are routed (every other block, as in the paper's best setting)
    predictor_hidden: int = 16
    routing: str = "topk"  # topk (training, non-causal) | predictor (the causal predictor's choices)
    norm_eps: float = 1e-5

    def __post_init__(self):
        check_config(self, VARIANTS, dict(n_layer=1, n_head=1, d_model=1, block_size=2, vocab_size=1, route_every=1,
                                          predictor_hidden=1))
        if self.routing not in ROUTINGS:
            raise FcauditError(f"unknown routing {self.routing!r}: use one of {', '.join(ROUTINGS)}")
        if not (isinstance(self.capacity, (int, float)) and 0.0 < self.capacity <= 1.0):
            raise FcauditError(f"MoDConfig capacity={self.capacity!r} is invalid: pass a fraction in (0, 1]")

    def routed(self, layer: int) -> bool:
        return self.variant == "mod" and layer % self.route_every == self.route_every - 1

    def budget(self, tokens: int) -> int:
        """k: how many of a window's `tokens` enter a routed block (at least one)."""
        return max(1, min(tokens, math.ceil(self.capacity * tokens)))


PRESETS: dict[str, MoDConfig] = {
    "tiny": MoDConfig(n_layer=2, n_head=2, d_model=32, block_size=64, predictor_hidden=8, capacity=0.25),
    "demo": MoDConfig(n_layer=4, n_head=4, d_model=96, block_size=128, predictor_hidden=16),
}


def config_for(preset: str, variant: str) -> MoDConfig:
    if preset not in PRESETS:
        raise FcauditError(f"unknown MoD preset {preset!r}: use one of {', '.join(PRESETS)}")
    return replace(PRESETS[preset], variant=variant)


class Route(NamedTuple):
    """What a router decides for one block: the score of every token [B, T] and the chosen tokens [B, k]
    (ascending positions; k may differ between windows only under the causal predictor, padded with -1)."""

    scores: torch.Tensor
    index: torch.Tensor


class Router(nn.Module):
    """One linear score per token; the top-k tokens of the window (or the predictor's picks) are chosen."""

    def __init__(self, cfg: MoDConfig):
        super().__init__()
        self.cfg = cfg
        self.score = nn.Linear(cfg.d_model, 1, bias=False)
        self.predictor = nn.Sequential(nn.Linear(cfg.d_model, cfg.predictor_hidden), nn.GELU(),
                                       nn.Linear(cfg.predictor_hidden, 1))

    def forward(self, h: torch.Tensor) -> Route:
        scores = self.score(h).squeeze(-1)
        if self.cfg.routing == "predictor":
            return Route(scores, choose(self.predictor(h.detach()).squeeze(-1) > 0))
        k = self.cfg.budget(h.size(1))
        return Route(scores, scores.topk(k, dim=-1, sorted=False).indices.sort(-1).values)

    def predictor_loss(self, h: torch.Tensor, route: Route) -> torch.Tensor:
        """BCE of the causal predictor against the top-k choices (its input detached: it does not shape h)."""
        target = torch.zeros_like(route.scores).scatter_(1, route.index.clamp_min(0), 1.0)
        logits = self.predictor(h.detach()).squeeze(-1)
        return F.binary_cross_entropy_with_logits(logits, target)


def choose(mask: torch.Tensor) -> torch.Tensor:
    """The chosen positions of a [B, T] mask as ascending indices [B, k_max], padded with -1."""
    k = max(1, int(mask.sum(-1).max().item())) if mask.numel() else 1
    order = torch.arange(mask.size(1), device=mask.device).expand_as(mask)
    keyed = torch.where(mask, order, order + mask.size(1))  # chosen positions first, in order
    index = keyed.sort(-1).values[:, :k]
    return torch.where(index < mask.size(1), index, torch.full_like(index, -1))


class Block(featuregate.Block):
    """FeatureGate's ungated block, with a router when it is routed."""

    def __init__(self, cfg: MoDConfig, routed: bool):
        super().__init__(cfg, gate=None)
        self.router = Router(cfg) if routed else None

    def forward(self, h: torch.Tensor, kv: KVCache | None = None) -> tuple[torch.Tensor, Route | None]:
        if self.router is None:
            return h + self.update(h, kv)[0], None
        route = self.router(h)
        if kv is not None:
            return self.step(h, route, kv), route
        safe = route.index.clamp_min(0)  # -1 pads a window with fewer chosen tokens: weight 0 below
        x = h.gather(1, safe.unsqueeze(-1).expand(-1, -1, h.size(-1)))  # the chosen tokens, in order
        weight = route.scores.gather(1, safe) * (route.index >= 0)
        delta = weight.unsqueeze(-1).to(h.dtype) * self.update(x)[0]
        return h.scatter_add(1, safe.unsqueeze(-1).expand_as(delta), delta), route

    def step(self, h: torch.Tensor, route: Route, kv: KVCache) -> torch.Tensor:
        """One decoding step (h [B, 1, D]): the rows whose token the router chose run the block; only their keys and
        values enter its cache."""
        rows = (route.index[:, 0] >= 0).nonzero().squeeze(-1)
        if not len(rows):
            return h
        delta = route.scores[rows].unsqueeze(-1).to(h.dtype) * self.update(h[rows], kv, rows)[0]
        return h.index_add(0, rows, delta)


class MoDGPT(GPT):
    config_class = MoDConfig

    def make_blocks(self) -> list[Block]:
        return [Block(self.config, self.config.routed(i)) for i in range(self.config.n_layer)]

    def start_decoding(self, batch: int, window: int | None = None) -> Decoding:
        if self.config.routing == "topk" and any(b.router is not None for b in self.blocks):
            raise FcauditError("MoD routing 'topk' chooses among the whole window's tokens, which decoding has not "
                               "seen yet: decode with its causal predictor (fcaudit.families.mod.causal)")
        return super().start_decoding(batch, window)

    def forward(self, ids: torch.Tensor, *, return_aux: bool = False, cache: Decoding | None = None):
        """Logits [B, T, V]; with return_aux also the causal predictors' mean BCE loss (0 without routed blocks). With
        `cache` (start_decoding), ids [B, 1] is the next token of each sequence."""
        h = self.embed(ids, cache)
        aux = []
        for block, kv in zip(self.blocks, self.caches(cache)):
            before = h
            h, route = block(h, kv)
            if return_aux and route is not None:
                aux.append(block.router.predictor_loss(before, route))
        logits = self.lm_head(self.ln_f(h))
        if not return_aux:
            return logits
        return logits, (torch.stack(aux).mean() if aux else logits.new_zeros(()))
