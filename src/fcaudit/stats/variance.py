"""Coefficient variation (question 1): per-layer profiles and the balanced functional variance decomposition, which
says how much of the spread is layer vs input vs token (paper Figure 3), not whether the model *uses* it."""

import itertools
import math
import warnings
from typing import Sequence

import numpy as np

from fcaudit.errors import FcauditError

AXES = ("input", "layer", "token")
# the decomposition's terms as shown: the three main effects, then their interactions
TERMS = ("layer", "input", "token", "input:layer", "input:token", "layer:token", "input:layer:token")
DECOMPOSITION_BUDGET = 256 * 2**20  # bytes of float64 coefficients loaded for the variance decomposition
DECOMPOSITION_WINDOWS = 256  # at most this many windows (the first ones): memory flat in the number of windows


def functional_anova(x: np.ndarray) -> tuple[dict[str, float], float]:
    """Balanced functional ANOVA of a complete [input, layer, token] array: ({"input": ss, "input:layer": ss, ...} by
    interaction size, then axis order; total ss). The effect of axes S is the mean over the other axes minus the
    effects of S's proper subsets, so the effects are orthogonal and their sums of squares add up to the total about
    the grand mean."""
    k = x.ndim
    subsets = [s for size in range(1, k + 1) for s in itertools.combinations(range(k), size)]
    grand = x.mean()
    effects: dict[tuple, np.ndarray] = {(): np.asarray(grand).reshape((1,) * k)}
    ss = {}
    for s in subsets:
        other = tuple(a for a in range(k) if a not in s)
        eff = x.mean(axis=other, keepdims=True) if other else x.copy()
        for sub, sub_eff in effects.items():  # all proper subsets were computed earlier (smaller size first)
            if set(sub) < set(s):
                eff -= sub_eff  # in place: the full interaction is as big as x (no temporary per subset)
        effects[s] = eff
        # each cell of the effect is repeated over the other axes' extent
        ss[":".join(AXES[a] for a in s)] = float((eff**2).sum() * np.prod([x.shape[a] for a in other]))
    del effects  # the full interaction, before the deviations below take as much again
    dev = x - grand
    total = float(np.square(dev, out=dev).sum())
    return ss, total


def variance_decomposition(coeffs: np.ndarray) -> dict[str, float]:
    """Fractions of the total sum of squares of coefficients [input, layer, token, *trailing], by input, layer, token
    and their interactions (summing to 1). Trailing axes (stream, source) are not factors: each trailing slice is
    decomposed about its own mean and the sums of squares pooled, so the fractions are of the within-slice variation.
    A slice may be nan-padded in layers where it does not exist (MUDD sources k > layer + 1): it uses its present
    layers only. Constant coefficients give nan fractions with a RuntimeWarning."""
    x = np.asarray(coeffs)
    if x.ndim < 3 or not np.issubdtype(x.dtype, np.number):
        raise FcauditError(f"coefficients must be a numeric array with axes (input, layer, token, ...), got shape {x.shape}")
    pooled: dict[str, float] = {}
    total = tol = 0.0
    for idx in np.ndindex(*x.shape[3:]):
        sl = np.asarray(x[(slice(None), slice(None), slice(None), *idx)], dtype=np.float64)
        present = ~np.isnan(sl).all(axis=(0, 2))
        if not present.any():  # a (stream, source) that no layer has
            continue
        sl = sl[:, present, :]
        if np.isnan(sl).any():
            raise FcauditError(
                f"coefficient slice {idx} has missing values inside a layer: the decomposition needs complete "
                "(input, token) grids; pad only whole absent layers with nan"
            )
        if np.isinf(sl).any():
            raise FcauditError("coefficients contain inf: check the controller's output dtype and rerun the audit")
        ss, t = functional_anova(sl)
        for name, v in ss.items():
            pooled[name] = pooled.get(name, 0.0) + v
        total += t
        # a total SS that is only rounding error of the grand mean (a constant array rarely gives exactly 0)
        tol += sl.size * (64 * np.finfo(np.float64).eps * float(np.abs(sl).max())) ** 2
    if total <= tol:
        warnings.warn("coefficients are constant (zero total variance): variance fractions are nan",
                      RuntimeWarning, stacklevel=2)
        return {name: math.nan for name in pooled}
    return {name: v / total for name, v in pooled.items()}


def by_layer(coeffs: list, layers: Sequence[Sequence[int]] | None = None) -> list:
    """The sites of each layer (`fcaudit.kinds.Description.layers`; None: one per site) as one: their coefficients
    side by side on the source axis, streams padded with zeros to the layer's widest."""
    if layers is None or len(layers) == len(coeffs):
        return coeffs
    out = []
    for sites in layers:
        parts = [coeffs[i] for i in sites]
        layer = parts[0].new_zeros(*parts[0].shape[:2], max(c.shape[2] for c in parts), sum(c.shape[3] for c in parts))
        at = 0
        for c in parts:
            layer[:, :, :c.shape[2], at:at + c.shape[3]] = c
            at += c.shape[3]
        out.append(layer)
    return out


def variation(store, starts: np.ndarray, sites: list[str] | None = None,
              layers: Sequence[Sequence[int]] | None = None) -> dict:
    """An audit's variation.json: per-layer mean/sd of the evaluation coefficients and the balanced variance
    decomposition. `store`: the audit's coefficient store (`read_chunk(start)` gives one [batch, token, stream,
    source] tensor per site); `starts`: its batches' first windows. `sites`: each site's module path (a layer is a
    site: an MoE whose first block is dense has its layer 0 in model.layers.1); `layers`: the sites of each layer
    where merged sites share one (then counted once, `by_layer`)."""
    if layers is not None and sites:
        sites = [" + ".join(dict.fromkeys(sites[i] for i in layer)) for layer in layers]
    first = by_layer(store.read_chunk(int(starts[0])), layers)
    shapes, token = [tuple(c.shape[2:]) for c in first], first[0].shape[1]  # [stream, source] of each layer
    scalar = all(sh == (1, 1) for sh in shapes)
    s_max, k_max = max(sh[0] for sh in shapes), max(sh[1] for sh in shapes)
    per_window = len(shapes) * token * s_max * k_max * 8
    n_total = int(starts[-1]) + store.read_chunk(int(starts[-1]))[0].shape[0]
    n_used = max(2, min(n_total, DECOMPOSITION_WINDOWS, DECOMPOSITION_BUDGET // per_window))
    arr = np.full((n_used, len(shapes), token, s_max, k_max), np.nan)  # the first windows, for the decomposition
    totals, count = None, 0  # per layer: sums and sums of squares over (input, token), [stream, source] each
    for b0 in starts:
        chunk = [c.double() for c in by_layer(store.read_chunk(int(b0)), layers)]
        part = [(c.sum(dim=(0, 1)), (c * c).sum(dim=(0, 1))) for c in chunk]
        totals = part if totals is None else [(a + s, b + q) for (a, b), (s, q) in zip(totals, part)]
        count += chunk[0].shape[0] * chunk[0].shape[1]
        for l, c in enumerate(chunk if b0 < n_used else ()):
            c = c[: n_used - b0].numpy()
            arr[b0:b0 + c.shape[0], l, :, : c.shape[2], : c.shape[3]] = c
    layers = []
    for l, (s, q) in enumerate(totals):
        n = count * s.numel()
        mean = float(s.sum()) / n
        layers.append({"layer": l, **({"site": sites[l]} if sites else {}), "shape": [int(x) for x in s.shape],
                       "mean": mean, "sd": math.sqrt(max(float(q.sum()) / n - mean * mean, 0.0)),
                       "stream_source_mean": (s / count).tolist()})
    if scalar:
        what = "the scalar coefficient per (input, layer, token)"
        arr = arr[..., 0, 0]
    else:
        what = ("each (stream, source) slice over (input, layer, token), sums of squares pooled over slices; "
                "layers lacking a slice are left out of it")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        fractions = variance_decomposition(arr)
    return {"layers": layers, "decomposition": fractions, "decomposed": what,
            "windows_decomposed": int(n_used), "windows": n_total}
