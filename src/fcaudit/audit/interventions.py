"""The conditions of FCA (paper section 3.3) on canonical coefficients [batch, token, stream, source].

Randomness comes from one seed and is keyed by what it permutes, never by batch or chunk:
the derangement of randomization r from `default_rng([DERANGE, seed, r])`, the token permutations of example i in
randomization r from `default_rng([SHUFFLE, seed, r, i])`. CrossShuffle r uses both: the donor of example i is
derangement_r[i] and its token order is the TokenShuffle permutation of example i (the receiving example).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from fcaudit.errors import FcauditError
from fcaudit.io import atomic_write

CONDITIONS = ("Correct", "CrossInput", "TokenShuffle", "CrossShuffle", "LayerPositionMean", "StaticProfile",
              "StructureRemoved")
RANDOMIZED = ("CrossInput", "TokenShuffle", "CrossShuffle")
STATIC = ("LayerPositionMean", "StaticProfile", "StructureRemoved")
# distinct leading tags: numpy pads short seed entropy with zeros, so [seed, r] would equal [seed, r, 0]
DERANGE, SHUFFLE = 1, 2


def derangement(n: int, seed: int, r: int) -> np.ndarray:
    """A uniformly random permutation of range(n) without fixed points (rejection sampling, ~e draws)."""
    if n < 2:
        raise FcauditError(f"a derangement needs at least 2 evaluation windows, got {n}; pass more windows (--eval)")
    rng = np.random.default_rng([DERANGE, seed, r])
    while True:
        perm = rng.permutation(n)
        if not np.any(perm == np.arange(n)):
            return perm


def token_permutations(example: int, seed: int, r: int, token: int, streams: list[int]) -> list[np.ndarray]:
    """Per layer an int array [stream, token]: an independent permutation of positions per layer and stream."""
    rng = np.random.default_rng([SHUFFLE, seed, r, example])
    rows = rng.permuted(np.broadcast_to(np.arange(token), (sum(streams), token)), axis=1)
    return np.split(rows, np.cumsum(streams)[:-1])


def shuffle_tokens(coeffs: list[torch.Tensor], examples: np.ndarray, seed: int, r: int) -> list[torch.Tensor]:
    """new[b, t, s, :] = old[b, perm_{example_b, layer, s}[t], s, :] -- the source vector moves as one."""
    token = coeffs[0].shape[1]
    streams = [c.shape[2] for c in coeffs]
    perms = [token_permutations(int(e), seed, r, token, streams) for e in examples]
    out = []
    for l, c in enumerate(coeffs):
        idx = torch.from_numpy(np.stack([p[l] for p in perms]).transpose(0, 2, 1).copy())  # [b, token, stream]
        out.append(torch.gather(c, 1, idx.to(c.device)[..., None].expand(-1, -1, -1, c.shape[3])))
    return out


def randomized(condition: str, store_take, examples: np.ndarray, perm: np.ndarray, seed: int, r: int) -> list[torch.Tensor]:
    """Coefficients of `examples` under CrossInput/TokenShuffle/CrossShuffle randomization r."""
    donors = perm[examples] if condition in ("CrossInput", "CrossShuffle") else examples
    coeffs = store_take(donors)
    if condition in ("TokenShuffle", "CrossShuffle"):
        coeffs = shuffle_tokens(coeffs, examples, seed, r)
    return coeffs


@dataclass
class Profiles:
    """Static profiles from the calibration windows only (float64)."""

    layer_position_mean: list[torch.Tensor]  # [token, stream, source] per layer
    static_profile: list[torch.Tensor]  # [stream, source] per layer
    structure_removed: list[torch.Tensor]  # [stream, source] per layer
    reference: str

    def coeffs(self, condition: str, batch: int, dtypes: list[torch.dtype], device) -> list[torch.Tensor]:
        """The replay coefficients of a static condition for a batch, rounded once to each site's dtype."""
        if condition == "LayerPositionMean":
            return [p.to(dt).to(device)[None].expand(batch, -1, -1, -1)
                    for p, dt in zip(self.layer_position_mean, dtypes)]
        token = self.layer_position_mean[0].shape[0]
        prof = self.static_profile if condition == "StaticProfile" else self.structure_removed
        return [p.to(dt).to(device)[None, None].expand(batch, token, -1, -1) for p, dt in zip(prof, dtypes)]

    def save(self, path: str | os.PathLike) -> Path:
        tensors = {}
        for l in range(len(self.static_profile)):
            tensors[f"layer_position_mean.{l}"] = self.layer_position_mean[l].contiguous()
            tensors[f"static_profile.{l}"] = self.static_profile[l].contiguous()
            tensors[f"structure_removed.{l}"] = self.structure_removed[l].contiguous()
        return atomic_write(path, lambda p: save_file(tensors, str(p), metadata={"reference": self.reference}))

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Profiles":
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            reference = (f.metadata() or {}).get("reference", "global_mean")
        t = load_file(str(path))
        n = len([k for k in t if k.startswith("static_profile.")])
        return cls([t[f"layer_position_mean.{l}"] for l in range(n)], [t[f"static_profile.{l}"] for l in range(n)],
                   [t[f"structure_removed.{l}"] for l in range(n)], reference)


class ProfileAccumulator:
    """Running float64 sums over calibration windows, per layer and position."""

    def __init__(self):
        self.sums: list[torch.Tensor] | None = None
        self.count = 0

    def add(self, coeffs: list[torch.Tensor]) -> None:
        batch = [c.detach().to("cpu", torch.float64).sum(0) for c in coeffs]
        self.sums = batch if self.sums is None else [s + b for s, b in zip(self.sums, batch)]
        self.count += coeffs[0].shape[0]

    def profiles(self, reference: str) -> Profiles:
        if not self.count:
            raise FcauditError("no calibration windows; pass at least one (--calib)")
        lpm = [s / self.count for s in self.sums]
        static = [p.mean(0) for p in lpm]
        if reference == "global_mean":
            # one scalar for every coefficient of every layer: the mass-matched GlobalMean
            total = sum(float(s.sum()) for s in self.sums)
            n = sum(s.numel() for s in self.sums) * self.count
            removed = [torch.full_like(p, total / n) for p in static]
        else:
            # SourceUniformMean: every source of (layer, stream) gets the mean over sources, keeping the signed sum
            removed = [p.mean(1, keepdim=True).expand_as(p).clone() for p in static]
        return Profiles(lpm, static, removed, reference)
