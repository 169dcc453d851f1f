"""Static profiles from the calibration sums: the rules a kind's static conditions and structure-removed references
are computed by. Imports nothing of fcaudit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

import torch

if TYPE_CHECKING:
    from fcaudit.kinds.description import Description


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


REFERENCES: dict[str, Callable[[Calibration], list[torch.Tensor]]] = {  # the static structure-removed rules
    "GlobalMean": global_mean, "SourceUniformMean": source_uniform_mean, "ExpertUniformMean": source_uniform_mean}


def reference_profiles(cal: Calibration, ctrl: "Description") -> list[torch.Tensor]:
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
