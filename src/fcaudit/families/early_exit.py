"""The early-exit family: fcaudit.models.early_exit, trained byte-level here (`fcaudit train --model early-exit`);
its baseline is FeatureGate's Dense of the same shape. Its controller is the exit decisions of `blocks.*.exit`, an
exit-depth controller (fcaudit.kinds): every condition keeps each window's budget of executed (block, token) pairs.
Its training "gate mass" is the fraction of (block, token) pairs that ran: a block's update enters a token's state
with weight 1 where it ran, 0 where the token had exited.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from fcaudit.controllers.controller import Controller
from fcaudit.families import Family, register
from fcaudit.kinds import EXIT_DEPTH
from fcaudit.models.checkpoint import read_checkpoint, write_checkpoint
from fcaudit.models.early_exit import PRESETS, VARIANTS, EarlyExitGPT, config_for

MODEL_TYPE = "early-exit"
PATTERN = "blocks.*.exit"


def controller(model: EarlyExitGPT) -> Controller:
    """The exit decisions of every block but the last: a token's depth is 1 + its first exit."""
    return Controller.from_modules(model, PATTERN, kind=EXIT_DEPTH.name)


def load(dir: Path, device: torch.device, dtype: torch.dtype | None) -> tuple[nn.Module, dict]:
    return read_checkpoint(dir, EarlyExitGPT, device, dtype)


def executed(model: EarlyExitGPT, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits, [L, B, T] 1.0 where a block ran for a token): training's evaluation reads it as gates."""
    logits, ran = model(ids, return_executed=True)
    return logits, ran.float()


register(Family(
    name="early-exit",
    accepts=lambda config: config.get("model_type") == MODEL_TYPE,
    load=load,
    matches=lambda model: isinstance(model, EarlyExitGPT),
    controller=controller,
    label=lambda model: "early-exit",
    trains=VARIANTS,
    presets=tuple(PRESETS),
    build=lambda cfg: EarlyExitGPT(config_for(cfg.preset)),
    save=lambda model, out, meta: write_checkpoint(out, model, MODEL_TYPE, meta),
    train_loss=lambda model, ids: model.loss(ids),
    gates=executed,
    architecture="FeatureGateGPT",  # its Dense baseline: FeatureGate's dense of the same shape
))
