"""Post-training thresholding of scalar gates (paper section 4.5): how much could a soft gate skip, at what cost?
Every gate below tau is set to 0 and replayed into the frozen model. A block is *skippable* for a window when all its
gates there are below tau: only then could it be dropped for the whole sequence. This is potential skipping: a zeroed
gate still runs its block (h + 0 * F(h)); measure.py measures what really runs."""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import pandas as pd
import torch
from torch import nn

from fcaudit.controllers.codecs import Layout
from fcaudit.controllers.controller import Controller
from fcaudit.errors import FcauditError
from fcaudit.families import controller_for
from fcaudit.loss import logits_of, token_nll
from fcaudit.placement import input_device


def vector_site(controller: Controller):
    """The first site that does not emit one scalar per token (layout "batch token"), which thresholding needs."""
    return next((s for s in controller.sites if not (isinstance(s.codec, Layout) and s.codec.scalar)), None)


@torch.inference_mode()
def thresholding(model: nn.Module, controller: Controller | None, windows, thresholds: Sequence[float], *,
                 batch_size: int = 8) -> pd.DataFrame:
    """One row per threshold tau: NLL and Byte-PPL with gates < tau set to 0, and how much could be skipped.

    Columns: threshold, nll (mean per predicted token), byte_ppl (exp(nll)), plain_nll (the unmodified model),
    delta_nll, frac_below (of the (window, layer, token) gates), skippable_blocks (mean over windows of the blocks
    whose gates are all below tau), skippable_fraction (/ n_layers), n_layers, windows, tokens (predicted tokens).
    tau = 0 replays the captured gates unchanged (the plain NLL, bit for bit); tau = 1 zeroes every sigmoid gate.
    """
    controller = controller if controller is not None else controller_for(model)
    if (site := vector_site(controller)) is not None:
        raise FcauditError(f"thresholding needs scalar gates (layout 'batch token'), but site {site.path!r} has "
                           f"{site.codec.describe()!r}: threshold a FeatureGate-family model (featuregate, uniform, "
                           "layerstatic)")
    ids = torch.as_tensor(windows.ids if hasattr(windows, "ids") else windows)
    if ids.dim() != 2 or ids.shape[0] < 1 or ids.shape[1] < 2 or ids.dtype.is_floating_point:
        raise FcauditError(f"thresholding needs integer windows [N, T] with N >= 1 and T >= 2, got {ids.dtype} "
                           f"{tuple(ids.shape)}: pass a WindowSet or an int64 tensor of token ids")
    ids = ids.long()
    taus = [float(t) for t in thresholds]
    if not taus or not all(math.isfinite(t) for t in taus):
        raise FcauditError(f"thresholds {list(thresholds)}: pass one or more finite thresholds, e.g. 0.1,0.3,0.5")
    if batch_size < 1:
        raise FcauditError(f"batch size {batch_size}: pass a batch size of at least 1")
    device = input_device(model)
    n_layers = len(controller.sites)

    plain_sum = 0.0
    nll_sum, below, skippable = np.zeros(len(taus)), np.zeros(len(taus), np.int64), np.zeros(len(taus), np.int64)
    for batch in ids.split(batch_size):
        batch = batch.to(device)
        B, T = batch.shape
        with controller.capture(B, T) as found:
            plain = token_nll(logits_of(model(batch), model, batch), batch)
        if any(c is None for c in found):
            raise FcauditError("a gate site did not run in the forward pass; check the controller's module pattern")
        plain_sum += plain.double().sum().item()
        gates = torch.stack([c.reshape(B, T) for c in found])  # [L, B, T]
        for i, tau in enumerate(taus):
            with controller.replay([c.masked_fill(c < tau, 0.0) for c in found], found.decoding):
                nll_sum[i] += token_nll(logits_of(model(batch), model, batch), batch).double().sum().item()
            mask = gates < tau
            below[i] += int(mask.sum())
            skippable[i] += int(mask.all(dim=2).sum())  # (layer, window) pairs with every token below tau

    n, t = ids.shape
    tokens = n * (t - 1)
    nll, plain_nll = nll_sum / tokens, plain_sum / tokens
    return pd.DataFrame({"threshold": taus, "nll": nll, "byte_ppl": [math.exp(x) for x in nll], "plain_nll": plain_nll,
                         "delta_nll": nll - plain_nll, "frac_below": below / (n_layers * n * t),
                         "skippable_blocks": skippable / n, "skippable_fraction": skippable / (n * n_layers),
                         "n_layers": n_layers, "windows": n, "tokens": tokens})
