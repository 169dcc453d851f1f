"""Expert routers: per token a combine vector over experts whose support is the experts that run (top-k MoE), and
capacity routers, whose codec rebuilds the (expert, slot) dispatch by the router's own rule and counts dropped tokens.
The support moves with the weights; StaticTopK (the top-k of the static mean) keeps k experts per token; the
reference ExpertUniformMean gives every expert the mean weight."""

from __future__ import annotations

import torch

from fcaudit.kinds.base import PAPER, Kind, register


class ExpertRouter(Kind):
    name = "expert_router"
    execution = "experts"  # k of E experts per token: their FLOPs say what ran
    conditions = PAPER + ("StaticTopK",)
    reference = "ExpertUniformMean"
    static = "StaticTopK"
    router = True

    def decisions(self, c: torch.Tensor) -> torch.Tensor:
        """The experts that run: nonzero weights."""
        return c != 0

    def everything(self, c: torch.Tensor) -> None:
        """None: a top-k router's codec keeps k experts whatever it replays; a model running every expert is a
        reference of its own (`fca.execution(..., reference=)`)."""
        return None


class CapacityRouter(ExpertRouter):
    name = "capacity_router"
    runs = "experts"  # the rows entering each of its experts: the slots filled (`Codec.executed`)


class SwitchRouter(CapacityRouter):
    """A capacity router that scales a token's experts by one weight (Switch Transformers' top-1): a mean over
    experts with distinct weights has no form it can run, so the conditions that replay one are not offered."""
    name = "switch_router"
    conditions = tuple(c for c in CapacityRouter.conditions if c not in ("LayerPositionMean", "StaticProfile"))
    note = ("LayerPositionMean and StaticProfile are not offered for Switch routers: they scale a token's experts by "
            "one weight, and a mean over experts has a weight of its own for each")


EXPERT_ROUTER = register(ExpertRouter())
CAPACITY_ROUTER = register(CapacityRouter())
SWITCH_ROUTER = register(SwitchRouter())
