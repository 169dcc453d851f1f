"""Execution of routed models under the audit's conditions. For a top-k router (an MoE runs k of E experts per token)
a static profile is a shortcut only if it stays sparse: StaticMixMean runs every expert with a nonzero mean, StaticTopK
keeps k. A token router (Mixture-of-Depths: its kind's `execution` is "tokens") is counted in token x block pairs;
its conditions have equal budgets, so their FLOPs are equal and latency says whether the assignment alone changes
wall time."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Sequence

import numpy as np
import pandas as pd
import torch
from torch import nn

from fcaudit import protocol
from fcaudit.controllers.controller import Controller
from fcaudit.controllers.patching import Captured
from fcaudit.controllers.sites import Decoding, path_matches
from fcaudit.execution.flops import flops
from fcaudit.execution.latency import Timing, latencies
from fcaudit.families import Family
from fcaudit.kinds import TOKEN_ROUTER, chosen
from fcaudit.protocol import Coeffs

ROUTED = TOKEN_ROUTER.compared  # a token router's conditions, in this order (equal budgets)


def captured(model: nn.Module, ids: torch.Tensor, controller: Controller) -> Captured:
    """The canonical coefficients of the live model's forward on ids, with what replays decode them with."""
    with torch.inference_mode(), controller.capture(*ids.shape) as found:
        model(ids)
    return found


def static_coefficients(model: nn.Module, controller: Controller, calib: torch.Tensor, batch: int,
                        batch_size: int = 8) -> dict[str, Captured]:
    """The replay coefficients of every static condition for a [batch, T] input, from calibration windows [N, T]
    (the audit's profiles: fcaudit.protocol.static_profiles), each with what replays decode them with."""
    parts, found = [], None
    for ids in calib.split(batch_size):
        found = captured(model, ids, controller)
        parts.append((protocol.batch_sums(found), ids.shape[0]))
    token = calib.shape[1]
    return {name: Captured([protocol.expand(p.to(c.dtype), batch, token) for p, c in zip(profile, found)],
                           found.decoding)
            for name, profile in protocol.static_profiles(parts, controller.info).items()}


class Replaying(nn.Module):
    """`model` with its controller replaying fixed coefficients on every forward (for timing a static condition):
    `coeffs` with the `decoding` of a capture (default: theirs, when a capture returned them)."""

    def __init__(self, model: nn.Module, controller: Controller, coeffs: Coeffs,
                 decoding: Sequence[Decoding] | None = None):
        super().__init__()
        self.model, self.controller, self.coeffs = model, controller, coeffs
        self.decoding = decoding if decoding is not None else coeffs.decoding
        self.config = getattr(model, "config", None)

    def forward(self, ids: torch.Tensor):
        with self.controller.replay(self.coeffs, self.decoding):
            return self.model(ids)


def _statics(model: nn.Module, controller: Controller, calib: torch.Tensor, ids: torch.Tensor) -> dict[str, Captured]:
    """The static conditions for the batch `ids`, profiled on the calibration windows cut to its length."""
    batch, window = ids.shape
    return static_coefficients(model, controller, calib[:, :window].to(ids.device), batch, batch)


def _timed(rows: list[dict], runs: list[nn.Module], ids: torch.Tensor, timing: Timing) -> list[dict]:
    """The rows with each run's latency on a batch shaped like `ids`, timed round-robin."""
    for row, lat in zip(rows, latencies(runs, *ids.shape, ids.device, timing)):
        row.update(lat.columns())
    return rows


def condition_execution(model: nn.Module, family: Family, calib: torch.Tensor, ids: torch.Tensor,
                        timing: Timing) -> pd.DataFrame:
    """One row per condition (Correct, then each static one, profiled on the calibration windows `calib`) on the
    batch `ids`: the family's `execution` columns (experts and expert FLOPs per token) and latency, round-robin."""
    controller = family.controller(model)
    labels = {**protocol.default_labels(), **controller.labels}
    rows = [{"condition": "Correct", "label": "Correct (live)", **family.execution(model, ids, controller)}]
    runs = [model]
    for name, coeffs in _statics(model, controller, calib, ids).items():
        rows.append({"condition": name, "label": labels.get(name, name),
                     **family.execution(model, ids, controller, coeffs)})
        runs.append(Replaying(model, controller, coeffs))
    df = pd.DataFrame(_timed(rows, runs, ids, timing))
    df["latency_vs_correct"] = df["latency_ms"] / df["latency_ms"].iloc[0]
    return df


def token_sites(controller: Controller) -> list[int]:
    """The sites whose decisions are counted in token x block pairs (their kind's `execution`)."""
    return [i for i, k in enumerate(controller.info.of) if k.execution == "tokens"]


def token_columns(coeffs: Coeffs, controller: Controller, blocks: list[str]) -> dict:
    """Token x block pairs that ran under `coeffs`: the fraction of tokens each of `blocks` ran (1 without a router),
    its mean over the routed blocks (`token_fraction`, the capacity) and over all (`token_block_fraction`)."""
    routed = {}
    for i in token_sites(controller):
        frac = float(chosen(coeffs[i]).double().mean())
        block = next((b for b in blocks if path_matches(controller.sites[i].path, b + ".**")), None)
        routed.setdefault(block, []).append(frac)
    per_block = [float(np.mean(routed[b])) if b in routed else 1.0 for b in blocks]
    fractions = [f for fs in routed.values() for f in fs]
    return {"token_fraction": float(np.mean(fractions)),
            "token_block_fraction": float(np.mean(per_block)) if per_block else float("nan"),
            "token_fraction_by_block": json.dumps([round(f, 6) for f in per_block])}


def token_conditions(model: nn.Module, controller: Controller, calib: torch.Tensor, ids: torch.Tensor,
                     blocks: list[str], timing: Timing) -> pd.DataFrame:
    """One row per condition of ROUTED on the batch `ids`, all replayed: token columns, FLOPs and latency, and each
    vs Correct's. StaticTopK is profiled on `calib` as in the audit; RandomRoute is its randomization 0."""
    labels = {**protocol.default_labels(), **controller.labels}
    correct = captured(model, ids, controller)
    profile = _statics(model, controller, calib, ids)["StaticTopK"]
    made = {"Correct": correct, "StaticTopK": protocol.static_routes(profile, correct),
            "RandomRoute": protocol.random_routes(correct, np.arange(ids.shape[0]), 0, 0)}
    runs = [Replaying(model, controller, made[name], correct.decoding) for name in ROUTED]
    rows = [{"condition": name, "label": labels.get(name, name) + (" (replayed)" if name == "Correct" else ""),
             **token_columns(made[name], controller, blocks), "flops_per_token": flops(run, ids)}
            for name, run in zip(ROUTED, runs)]
    # the conditions share one model's timing budget: equal work, so only a difference beyond the spread counts
    df = pd.DataFrame(_timed(rows, runs, ids, replace(timing, min_run_time=timing.min_run_time / len(runs))))
    df["flops_vs_correct"] = df["flops_per_token"] / df["flops_per_token"].iloc[0]
    df["latency_vs_correct"] = df["latency_ms"] / df["latency_ms"].iloc[0]
    return df
