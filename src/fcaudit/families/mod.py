"""The Mixture-of-Depths family: fcaudit.models.mod, trained byte-level here (`fcaudit train --model mod`); its
baselines are FeatureGate's Dense and FixedDepth of the same shape. Every routed block's router is a token-routing
site (each token's score and whether it was chosen, so every condition keeps each window's budget k), audited as its
config's `routing` says: the top-k over the window (as trained) or the causal predictor (`causal(model)`).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from fcaudit.controllers.codecs import TokenRoute
from fcaudit.controllers.controller import Controller
from fcaudit.errors import FcauditError
from fcaudit.families import Family, register
from fcaudit.loss import token_nll
from fcaudit.models.checkpoint import read_checkpoint, write_checkpoint
from fcaudit.models.mod import PRESETS, MoDGPT, config_for

MODEL_TYPE = "mod"
PATTERN = "blocks.*.router"


def controller(model: MoDGPT) -> Controller:
    if not any(b.router is not None for b in model.blocks):
        raise FcauditError("this MoD model has no routed block to audit (variant dense): audit variant mod")
    ctrl = Controller.from_modules(model, PATTERN, codec=TokenRoute())
    if model.config.routing == "topk":  # each routed block's MLP runs its k tokens: observed under every condition
        # (the causal predictor's index is padded with -1, whose rows a block runs too: its budget stays the decisions')
        ctrl = replace(ctrl, sites=tuple(replace(s, runs=(mlp := s.path.rsplit(".", 1)[0] + ".mlp",
                                                          model.get_submodule(mlp))) for s in ctrl.sites))
    # the top-k router and the causal predictor are two controllers of one checkpoint (audits and summaries tell
    # them apart by the description)
    return replace(ctrl, description=f"{ctrl.description}:routing={model.config.routing}")


def causal(model: MoDGPT) -> MoDGPT:
    """The same model routing by its causal predictor (what autoregressive decoding can use)."""
    model.config.routing = "predictor"
    return model


def causal_checkpoint(src: Path, out: Path) -> Path:
    """A copy of the checkpoint `src` that routes by its causal predictor (`causal`), written to `out`. The training
    run's Byte-PPL stays with `src` (it is the top-k router's), so the copy records none."""
    model, meta = load(Path(src), torch.device("cpu"), None)
    meta = {**{k: v for k, v in meta.items() if k != "byte_ppl"}, "variant": "mod-causal", "routing_of": str(src)}
    return save(causal(model), Path(out), meta)


def load(dir: Path, device: torch.device, dtype: torch.dtype | None) -> tuple[nn.Module, dict]:
    return read_checkpoint(dir, MoDGPT, device, dtype)


def save(model: MoDGPT, out: Path, meta: dict) -> Path:
    return write_checkpoint(out, model, MODEL_TYPE, meta)


def train_loss(model: MoDGPT, ids: torch.Tensor) -> torch.Tensor:
    """Next-token NLL plus the causal predictors' BCE (their inputs are detached, so it trains them only)."""
    logits, aux = model(ids, return_aux=True)
    return token_nll(logits, ids).mean() + aux


def label(model: MoDGPT) -> str:
    return "mod-causal" if model.config.routing == "predictor" else "mod"


register(Family(
    name="mod",
    accepts=lambda config: config.get("model_type") == MODEL_TYPE,
    load=load,
    matches=lambda model: isinstance(model, MoDGPT),
    controller=controller,
    ungated=lambda model: all(b.router is None for b in model.blocks),
    label=label,
    trains=("mod",),
    presets=tuple(PRESETS),
    build=lambda cfg: MoDGPT(config_for(cfg.preset, "mod")),
    save=save,
    train_loss=train_loss,
    architecture="FeatureGateGPT",  # its Dense and FixedDepth baselines: FeatureGate's variants of the same shape
))
