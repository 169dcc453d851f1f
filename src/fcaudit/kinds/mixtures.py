"""Source mixtures (FeatureGate's MUDD, hyper-connections): per (token, stream) a vector over sources. The paper's
conditions; the structure-removed reference SourceUniformMean gives every source the mean over sources."""

from __future__ import annotations

import torch

from fcaudit.errors import FcauditError
from fcaudit.kinds.base import Kind, register


class SourceMixture(Kind):
    name = "source_mixture"
    reference = "SourceUniformMean"
    follows = ("StaticTopK",)

    def check(self, site: str, c: torch.Tensor, window: bool) -> None:
        if c.shape[3] == 1:  # SourceUniformMean of one source is its static mean: retention 0 by construction
            raise FcauditError(f"site {site!r} is read as a source mixture (reference SourceUniformMean) but holds one "
                               "source per (token, stream): it is a gate; pass kind='scalar_gate' (reference "
                               "GlobalMean), or a layout naming its source axis")


SOURCE_MIXTURE = register(SourceMixture())
