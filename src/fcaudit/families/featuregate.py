"""The FeatureGate family (paper §4.1): every variant of fcaudit.models.featuregate, trained from scratch here.

Controller: the gate module of every block (`blocks.*.gate`) emits one scalar per token ("batch token"); the static
profile is the layerwise LayerMean and the structure-removed reference the mass-matched GlobalMean.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from fcaudit.controllers.site import Controller, path_matches
from fcaudit.errors import FcauditError
from fcaudit.families import Family, register
from fcaudit.models.checkpoint import MODEL_TYPE, load_featuregate, save_checkpoint
from fcaudit.models.featuregate import PRESETS, VARIANTS, FeatureGateGPT, config_for

PATTERN = "blocks.*.gate"


def controller(model: nn.Module) -> Controller:
    if not any(path_matches(name, PATTERN) for name, _ in model.named_modules()):
        variant = getattr(getattr(model, "config", None), "variant", type(model).__name__)
        raise FcauditError(f"model variant {variant!r} has no gate modules ({PATTERN}) to audit; "
                           "audit a gated variant (featuregate, uniform, layerstatic)")
    return Controller.from_modules(model, PATTERN, layout="batch token", static_name="LayerMean",
                                   reference="global_mean", reference_name="GlobalMean")


def label(model: FeatureGateGPT) -> str:
    v = model.config.variant
    return f"fixeddepth-{model.config.n_layer}" if v == "fixeddepth" else v


def build(cfg) -> FeatureGateGPT:
    if cfg.preset not in PRESETS:
        raise FcauditError(f"unknown preset {cfg.preset!r}: use one of {', '.join(PRESETS)}")
    return FeatureGateGPT(config_for(cfg.preset, cfg.model, gate_value=cfg.gate_value, fixed_depth=cfg.fixed_depth))


def gates(model: FeatureGateGPT, ids: torch.Tensor):
    return model(ids, return_gates=True)


register(Family(
    name="featuregate",
    accepts=lambda config: config.get("model_type") == MODEL_TYPE,
    load=load_featuregate,
    matches=lambda model: isinstance(model, FeatureGateGPT),
    controller=controller,
    label=label,
    trains=VARIANTS,
    build=build,
    save=lambda model, out, meta: save_checkpoint(Path(out), model, meta),
    gates=gates,
    ungated_mass=1.0,
))
