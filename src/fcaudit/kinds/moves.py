"""The moves every kind's randomized conditions are made of: permutations of positions (TokenShuffle) and draws of
earlier positions (TokenResamplePast), per layer and stream, keyed by what they permute.

Randomness is keyed by what it permutes, never by batch or process: `default_rng([tag, seed, r, example])`. Imports
nothing of fcaudit.
"""

from __future__ import annotations

from itertools import accumulate
from typing import Callable, Sequence

import numpy as np
import torch

Coeffs = list[torch.Tensor]  # one canonical [batch, token, stream, source] tensor per site (target layer)

# distinct leading tags: numpy pads short seed entropy with zeros, so [seed, r] would equal [seed, r, 0]
DERANGE, SHUFFLE, RESAMPLE, ROUTE_PAST, ROUTE_RANDOM, DEPTH_FIT, DEPTH_RANDOM = 1, 2, 3, 4, 5, 6, 7


def token_permutations(examples: np.ndarray, seed: int, r: int, token: int, rows: int) -> np.ndarray:
    """An int array [examples, rows, token]: per example an independent permutation of positions per row, one row per
    (layer, stream) in layer order (`group_rows`). TokenShuffle r and CrossShuffle r use the same ones."""
    positions = np.broadcast_to(np.arange(token), (rows, token))
    return np.stack([np.random.default_rng([SHUFFLE, seed, r, int(e)]).permuted(positions, axis=1) for e in examples])


def past_positions(examples: np.ndarray, seed: int, r: int, token: int, rows: int) -> np.ndarray:
    """An int array [examples, rows, token], one row per (layer, stream): position t takes a uniformly drawn position
    s <= t."""
    high = np.arange(1, token + 1)
    return np.stack([np.random.default_rng([RESAMPLE, seed, r, int(e)]).integers(0, high, size=(rows, token))
                     for e in examples])


def group_rows(coeffs: Coeffs, layers: Sequence[Sequence[int]] | None = None) -> tuple[int, list[int]]:
    """The index rows one draw needs and each site's first row: one row per stream of each layer (its widest site),
    layers in order (`Description.layers`; None: one per site); a site uses its layer's first rows, so the sites of
    one layer move together."""
    layers = layers if layers is not None else [(i,) for i in range(len(coeffs))]
    width = [max(coeffs[i].shape[2] for i in sites) for sites in layers]
    first = [0] * len(coeffs)
    for sites, row in zip(layers, accumulate(width, initial=0)):
        for i in sites:
            first[i] = row
    return sum(width), first


def _move_tokens(coeffs: Coeffs, draw: Callable[..., np.ndarray], examples: np.ndarray, seed: int, r: int,
                 layers: Sequence[Sequence[int]] | None) -> Coeffs:
    """new[b, t, s, :] = old[b, index[b, row(l, s), t], s, :] for every layer l (the source vector moves as one), with
    index = draw(examples, seed, r, token, rows) [batch, rows, token], rows as `group_rows` says."""
    rows, first = group_rows(coeffs, layers)
    index = draw(examples, seed, r, coeffs[0].shape[1], rows)
    # one host-to-device copy of the whole index, in the [batch, token, row] order gather wants
    index = torch.from_numpy(index.transpose(0, 2, 1).copy()).to(coeffs[0].device)
    return [torch.gather(c, 1, index[:, :, s0:s0 + c.shape[2], None].expand(-1, -1, -1, c.shape[3]))
            for c, s0 in zip(coeffs, first)]


def shuffle_tokens(coeffs: Coeffs, examples: np.ndarray, seed: int, r: int,
                   layers: Sequence[Sequence[int]] | None = None) -> Coeffs:
    """TokenShuffle r of the receiving `examples`: independent permutations per example, layer and stream."""
    return _move_tokens(coeffs, token_permutations, examples, seed, r, layers)


def resample_past(coeffs: Coeffs, examples: np.ndarray, seed: int, r: int,
                  layers: Sequence[Sequence[int]] | None = None) -> Coeffs:
    """TokenResamplePast r: position t takes the coefficient of a uniform position s <= t of the same example (the
    same s for every site of a layer)."""
    return _move_tokens(coeffs, past_positions, examples, seed, r, layers)
