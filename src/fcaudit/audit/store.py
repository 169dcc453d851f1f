"""The coefficient store: every captured coefficient of the evaluation windows, on disk.

One safetensors file per capture batch (`chunk_{start:07d}.safetensors`, keys `layer.{l}` with the canonical
shape [n, token, stream, source] in the model's dtype), each written atomically, so RAM does not grow with the
number of windows and a killed run leaves only whole chunks. Reads are memory-mapped (`safe_open`).
"""

from __future__ import annotations

import os
import re
from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from fcaudit.errors import FcauditError
from fcaudit.io import atomic_write

_CHUNK = re.compile(r"^chunk_(\d+)\.safetensors$")
MAX_OPEN = 16  # memory-mapped chunk files kept open; bounds the mapped (resident) part of the store


def check_finite(coeffs: list[torch.Tensor], where: str) -> None:
    for l, c in enumerate(coeffs):
        if not torch.isfinite(c).all():
            raise FcauditError(f"non-finite coefficients at site {l} ({where}); fix the model or its dtype "
                               "(e.g. load in float32) before auditing")


class CoefficientStore:
    """Per-layer coefficient arrays over all evaluation windows, split into chunk files."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._handles: OrderedDict[int, object] = OrderedDict()

    def chunk_path(self, start: int) -> Path:
        return self.path / f"chunk_{start:07d}.safetensors"

    def write(self, start: int, coeffs: list[torch.Tensor], metadata: dict[str, str] | None = None) -> Path:
        """Write the coefficients of windows start..start+n atomically (the chunk is whole or absent)."""
        check_finite(coeffs, f"windows from {start}")
        tensors = {f"layer.{l}": c.detach().to("cpu").contiguous() for l, c in enumerate(coeffs)}
        self._handles.pop(start, None)
        return atomic_write(self.chunk_path(start), lambda p: save_file(tensors, str(p), metadata=metadata))

    def starts(self) -> list[int]:
        if not self.path.exists():
            return []
        return sorted(int(m.group(1)) for p in self.path.iterdir() if (m := _CHUNK.match(p.name)))

    def has(self, start: int) -> bool:
        return self.chunk_path(start).exists()

    def _open(self, start: int):
        if start in self._handles:
            self._handles.move_to_end(start)
        else:
            self._handles[start] = safe_open(str(self.chunk_path(start)), framework="pt")
            if len(self._handles) > MAX_OPEN:
                self._handles.popitem(last=False)
        return self._handles[start]

    def metadata(self, start: int) -> dict[str, str]:
        return self._open(start).metadata() or {}

    def n_layers(self, start: int) -> int:
        return sum(k.startswith("layer.") for k in self._open(start).keys())

    def read_chunk(self, start: int) -> list[torch.Tensor]:
        f = self._open(start)
        return [f.get_tensor(f"layer.{l}") for l in range(self.n_layers(start))]

    def take(self, examples: np.ndarray, chunk_starts: np.ndarray) -> list[torch.Tensor]:
        """Coefficients of the given example indices (any order), per layer; reads only the rows it needs.

        `chunk_starts` is the sorted array of chunk start indices (all chunks but the last hold the same count).
        """
        examples = np.asarray(examples, dtype=np.int64)
        which = np.searchsorted(chunk_starts, examples, side="right") - 1
        order = np.lexsort((examples, which))
        pieces: list[list[torch.Tensor]] = []
        positions: list[np.ndarray] = []
        i = 0
        while i < len(order):  # runs of consecutive rows inside one chunk are one slice read
            j = i + 1
            while (j < len(order) and which[order[j]] == which[order[i]]
                   and examples[order[j]] == examples[order[j - 1]] + 1):
                j += 1
            start = int(chunk_starts[which[order[i]]])
            lo, hi = int(examples[order[i]]) - start, int(examples[order[j - 1]]) - start + 1
            f = self._open(start)
            pieces.append([f.get_slice(f"layer.{l}")[lo:hi] for l in range(self.n_layers(start))])
            positions.append(order[i:j])
            i = j
        # duplicated example indices appear once per occurrence; restore the requested order
        flat_pos = torch.from_numpy(np.concatenate(positions))
        inverse = torch.empty_like(flat_pos)
        inverse[flat_pos] = torch.arange(len(flat_pos))
        n_layers = len(pieces[0])
        return [torch.cat([p[l] for p in pieces])[inverse] for l in range(n_layers)]

    def close(self) -> None:
        self._handles.clear()
