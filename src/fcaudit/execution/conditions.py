"""Execution under the audit's static conditions, for top-k routers (an MoE runs k of E experts per token). A static
profile is a computational shortcut only if it stays sparse: StaticMixMean runs every expert with a nonzero mean,
StaticTopK keeps k. Measured for Correct and each static condition: experts run, expert FLOPs and latency."""

from __future__ import annotations

import pandas as pd
import torch
from torch import nn

from fcaudit import protocol
from fcaudit.controllers.site import Controller
from fcaudit.execution.latency import Timing, latencies
from fcaudit.families import Family
from fcaudit.protocol import Coeffs


def static_coefficients(model: nn.Module, controller: Controller, calib: torch.Tensor, batch: int,
                        batch_size: int = 8) -> dict[str, Coeffs]:
    """The replay coefficients of every static condition for a [batch, T] input, from calibration windows [N, T]
    (the audit's profiles: fcaudit.protocol.static_profiles)."""
    parts, dtypes = [], None
    with torch.inference_mode():
        for ids in calib.split(batch_size):
            with controller.capture(*ids.shape) as found:
                model(ids)
            parts.append((protocol.batch_sums(found), ids.shape[0]))
            dtypes = [c.dtype for c in found]
    token = calib.shape[1]
    return {name: [protocol.expand(p.to(dt), batch, token) for p, dt in zip(profile, dtypes)]
            for name, profile in protocol.static_profiles(parts, controller.info).items()}


class Replaying(nn.Module):
    """`model` with its controller replaying fixed coefficients on every forward (for timing a static condition)."""

    def __init__(self, model: nn.Module, controller: Controller, coeffs: Coeffs):
        super().__init__()
        self.model, self.controller, self.coeffs = model, controller, coeffs
        self.config = getattr(model, "config", None)

    def forward(self, ids: torch.Tensor):
        with self.controller.replay(self.coeffs):
            return self.model(ids)


def condition_execution(model: nn.Module, family: Family, calib: torch.Tensor, ids: torch.Tensor,
                        timing: Timing) -> pd.DataFrame:
    """One row per condition (Correct, then each static one, profiled on the calibration windows `calib`) on the
    batch `ids`: the family's `execution` columns (experts and expert FLOPs per token) and latency, round-robin."""
    controller = family.controller(model)
    labels = {**protocol.default_labels(), **controller.labels}
    batch_size, window = ids.shape
    statics = static_coefficients(model, controller, calib[:, :window].to(ids.device), batch_size, batch_size)
    rows = [{"condition": "Correct", "label": "Correct (live)", **family.execution(model, ids, controller)}]
    runs = [model]
    for name, coeffs in statics.items():
        rows.append({"condition": name, "label": labels.get(name, name),
                     **family.execution(model, ids, controller, coeffs)})
        runs.append(Replaying(model, controller, coeffs))
    for row, lat in zip(rows, latencies(runs, batch_size, window, ids.device, timing)):
        row.update(lat.columns())
    df = pd.DataFrame(rows)
    df["latency_vs_correct"] = df["latency_ms"] / df["latency_ms"].iloc[0]
    return df
