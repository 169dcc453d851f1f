"""The MUDDPythia family (the paper's external control, §4.4): fcaudit.models.muddpythia, loaded from the published
HF-format checkpoint or trained byte-level here (`fcaudit train --model mudd`).

Controller: every layer's dynamic dense block emits dw [stream, batch, token, source], static dense_bs included, so
a replay skips only the controller MLPs. Static profile StaticMixMean (layer, stream, source); the structure-removed
reference SourceUniformMean gives each source the mean over sources (keeping their signed sum).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from fcaudit.controllers.controller import Controller
from fcaudit.families import Family, register
from fcaudit.io import read_json
from fcaudit.models.muddpythia import BYTE_PRESETS, MODEL_TYPE, MUDDPythia, from_pretrained


def controller(model: MUDDPythia) -> Controller:
    return Controller.from_modules(model, "dynamic_dense.*", layout="stream batch token source",
                                   kind="source_mixture", static_name="StaticMixMean")


def load(dir: Path, device: torch.device, dtype: torch.dtype | None) -> tuple[nn.Module, dict]:
    meta = {k: v for k, v in read_json(dir / "config.json").items() if k != "model_type"}
    return from_pretrained(dir, dtype=dtype).to(device).eval(), meta


register(Family(
    name="muddpythia",
    accepts=lambda config: config.get("model_type") == MODEL_TYPE,
    load=load,
    matches=lambda model: isinstance(model, MUDDPythia),
    controller=controller,
    label=lambda model: "mudd",
    trains=("mudd",),
    presets=tuple(BYTE_PRESETS),
    build=lambda cfg: MUDDPythia(BYTE_PRESETS[cfg.preset]),
    no_decay=("dense_bs",),  # the static mix, initialised as "take the latest hidden state": decay would pull it to 0
    save=lambda model, out, meta: model.save_pretrained(out),
))
