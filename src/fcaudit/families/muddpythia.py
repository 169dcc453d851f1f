"""The MUDDPythia family (the paper's external control, §4.4): fcaudit.models.muddpythia, loaded from the published
HF-format checkpoint or trained byte-level here (`fcaudit train --model mudd`).

Controller: the dynamic dense block of every layer emits dw [stream, batch, token, source]. dw already includes the
static dense_bs, so replaying it with the controller disabled skips only the controller MLPs. The static profile is
StaticMixMean (layer, stream, source); the structure-removed reference is SourceUniformMean (each source of a
(layer, stream) gets the mean over sources, which keeps the signed sum over sources).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from fcaudit.controllers.site import Controller
from fcaudit.families import Family, register
from fcaudit.io import read_json
from fcaudit.models.muddpythia import BYTE_PRESETS, MODEL_TYPE, MUDDPythia, from_pretrained

LAYOUT = "stream batch token source"


def controller(model: MUDDPythia) -> Controller:
    return Controller.from_modules(model, "dynamic_dense.*", layout=LAYOUT, static_name="StaticMixMean",
                                   reference="source_uniform_mean", reference_name="SourceUniformMean")


def load(dir: Path, device: torch.device, dtype: torch.dtype | None) -> tuple[nn.Module, dict]:
    meta = {k: v for k, v in read_json(dir / "config.json").items() if k != "model_type"}
    return from_pretrained(dir, dtype=dtype).to(device).eval(), meta


def build(cfg) -> MUDDPythia:
    return MUDDPythia(BYTE_PRESETS[cfg.preset])


register(Family(
    name="muddpythia",
    accepts=lambda config: config.get("model_type") == MODEL_TYPE,
    load=load,
    matches=lambda model: isinstance(model, MUDDPythia),
    controller=controller,
    label=lambda model: "mudd",
    trains=("mudd",),
    presets=tuple(BYTE_PRESETS),
    build=build,
    no_decay=("dense_bs",),  # the static mix, initialised as "take the latest hidden state": decay would pull it to 0
    save=lambda model, out, meta: model.save_pretrained(out),
))
