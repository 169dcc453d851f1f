"""FeatureGate adapter: the gate module of every block emits one scalar per token."""

from __future__ import annotations

from torch import nn

from fcaudit.controllers.generic import register
from fcaudit.controllers.site import Controller, path_matches
from fcaudit.errors import FcauditError

PATTERN = "blocks.*.gate"


def featuregate_controller(model: nn.Module) -> Controller:
    if not any(path_matches(name, PATTERN) for name, _ in model.named_modules()):
        variant = getattr(getattr(model, "config", None), "variant", type(model).__name__)
        raise FcauditError(f"model variant {variant!r} has no gate modules ({PATTERN}) to audit; "
                           "audit a gated variant (featuregate, uniform, layerstatic)")
    return Controller.from_modules(model, PATTERN, layout="batch token", static_name="LayerMean",
                                   reference="global_mean", reference_name="GlobalMean")


register("FeatureGateGPT", featuregate_controller)
