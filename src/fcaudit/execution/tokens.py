"""Execution of token routers (sites with routing="tokens": Mixture-of-Depths, routed branches), whose blocks run on
the tokens chosen: the work is counted in token x block pairs, and FLOPs on the forward that really runs. Under the
audit's conditions Correct, StaticTopK and RandomRoute are all replayed with equal budgets per window and layer, so
their FLOPs are equal and the latency says whether the assignment alone changes wall time."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pandas as pd
import torch
from torch import nn

from fcaudit import protocol
from fcaudit.controllers.site import Controller, path_matches
from fcaudit.execution.conditions import Replaying, static_coefficients
from fcaudit.execution.flops import flops
from fcaudit.execution.latency import Timing, latencies
from fcaudit.protocol import Coeffs

ROUTED = ("Correct", "StaticTopK", "RandomRoute")  # the conditions measured, in this order (equal budgets)


def token_sites(controller: Controller) -> list[int]:
    return [i for i, s in enumerate(controller.sites) if s.codec.routing == "tokens"]


def captured(model: nn.Module, ids: torch.Tensor, controller: Controller) -> Coeffs:
    """The canonical coefficients of the live model's forward on ids (the sites keep what replays decode with)."""
    with torch.inference_mode(), controller.capture(*ids.shape) as found:
        model(ids)
    return list(found)


def token_columns(coeffs: Coeffs, controller: Controller, blocks: list[str]) -> dict:
    """Token x block pairs that ran, from the coefficients a forward used: per block (`blocks`, in order) the fraction
    of tokens that ran it (1 without a router), `token_fraction` (the routed blocks' mean: the capacity) and
    `token_block_fraction` (all blocks': the share of the dense model's pairs)."""
    routed = {}
    for i in token_sites(controller):
        frac = float(protocol.chosen(coeffs[i]).double().mean())
        block = next((b for b in blocks if path_matches(controller.sites[i].path, b + ".**")), None)
        routed.setdefault(block, []).append(frac)
    per_block = [float(np.mean(routed[b])) if b in routed else 1.0 for b in blocks]
    fractions = [f for fs in routed.values() for f in fs]
    return {"token_fraction": float(np.mean(fractions)),
            "token_block_fraction": float(np.mean(per_block)) if per_block else float("nan"),
            "token_fraction_by_block": json.dumps([round(f, 6) for f in per_block])}


def token_conditions(model: nn.Module, controller: Controller, calib: torch.Tensor, ids: torch.Tensor,
                     blocks: list[str], timing: Timing) -> pd.DataFrame:
    """One row per condition of ROUTED on the batch `ids`, all replayed: token columns, FLOPs and latency (and each vs
    Correct's). StaticTopK's profile comes from the calibration windows `calib` as in the audit; RandomRoute is its
    randomization 0."""
    labels = {**protocol.default_labels(), **controller.labels}
    batch, window = ids.shape
    correct = captured(model, ids, controller)
    profile = static_coefficients(model, controller, calib[:, :window].to(ids.device), batch, batch)["StaticTopK"]
    made = {"Correct": correct, "StaticTopK": protocol.static_routes(profile, correct),
            "RandomRoute": protocol.random_routes(correct, np.arange(batch), 0, 0)}
    rows, runs = [], []
    for name in ROUTED:
        runs.append(Replaying(model, controller, made[name]))
        rows.append({"condition": name, "label": labels.get(name, name) + (" (replayed)" if name == "Correct" else ""),
                     **token_columns(made[name], controller, blocks), "flops_per_token": flops(runs[-1], ids)})
    # the conditions share one model's timing budget: equal work, so only a difference beyond the spread counts
    shared = replace(timing, min_run_time=timing.min_run_time / len(runs))
    for row, lat in zip(rows, latencies(runs, batch, window, ids.device, shared)):
        row.update(lat.columns())
    df = pd.DataFrame(rows)
    df["flops_vs_correct"] = df["flops_per_token"] / df["flops_per_token"].iloc[0]
    df["latency_vs_correct"] = df["latency_ms"] / df["latency_ms"].iloc[0]
    return df
