"""MUDDPythia adapter: the dynamic dense block of every layer emits dw [stream, batch, token, source].

dw already includes the static dense_bs, so replaying it with the controller disabled skips only the
controller MLPs. The static profile is StaticMixMean (layer, stream, source); the structure-removed
reference is SourceUniformMean (each source of a (layer, stream) gets the mean over sources, which keeps
the signed sum over sources).
"""

from __future__ import annotations

from torch import nn

from fcaudit.controllers.generic import register
from fcaudit.controllers.site import Controller, Layout, Site

PATTERN = "dynamic_dense.*"
LAYOUT = "stream batch token source"


def muddpythia_controller(model: nn.Module) -> Controller:
    # The sites are exactly the children of model.dynamic_dense (a glob "dynamic_dense.*" would also match
    # their w1/w2 submodules), one per layer in layer order.
    layout = Layout.parse(LAYOUT)
    sites = [Site(f"dynamic_dense.{i}", m, layout) for i, m in enumerate(model.dynamic_dense)]
    return Controller(sites, static_name="StaticMixMean", reference="source_uniform_mean",
                      reference_name="SourceUniformMean", description=f"{type(model).__name__}:{PATTERN}:{LAYOUT}")


register("MUDDPythia", muddpythia_controller)
