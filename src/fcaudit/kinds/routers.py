"""Expert routers: per token a combine vector over experts whose support is the experts that run (top-k MoE), and
capacity routers, whose codec rebuilds the (expert, slot) dispatch by the router's own rule and counts dropped tokens.
The support moves with the weights; StaticTopK (the top-k of the static mean) keeps k experts per token; the
reference ExpertUniformMean gives every expert the mean weight."""

from __future__ import annotations

import torch

from fcaudit.kinds.base import PAPER, Kind, register


class ExpertRouter(Kind):
    name = "expert_router"
    conditions = PAPER + ("StaticTopK",)
    reference = "ExpertUniformMean"
    static = "StaticTopK"
    router = True

    def decisions(self, c: torch.Tensor) -> torch.Tensor:
        """The experts that run: nonzero weights."""
        return c != 0


class CapacityRouter(ExpertRouter):
    name = "capacity_router"
    runs = "experts"  # the rows entering each of its experts: the slots filled (`Codec.executed`)


EXPERT_ROUTER = register(ExpertRouter())
CAPACITY_ROUTER = register(CapacityRouter())
