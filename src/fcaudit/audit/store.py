"""The coefficient store: every captured coefficient of the evaluation windows, on disk (Eq. 2's A_i).

One safetensors file per capture batch (`chunk_{start:07d}.safetensors`). Each example's canonical coefficients of all
layers are flattened into one row, one 2-D tensor [n, features] per dtype (`coeffs.float32`, `coeffs.bfloat16`, ...),
so reading the coefficients of any set of examples costs one slice per run of consecutive rows, not one per layer.
Chunks are written atomically with a content hash (audit.files), so RAM does not grow with the number of windows
and a killed run leaves only whole chunks. Reads are memory-mapped (`safe_open`).
"""

from __future__ import annotations

import math
import os
import re
from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

from fcaudit.audit.files import read_tensors, tensor_meta, write_tensors
from fcaudit.errors import FcauditError
from fcaudit.protocol import Coeffs

_CHUNK = re.compile(r"^chunk_(\d+)\.safetensors$")
MAX_OPEN = 16  # memory-mapped chunk files kept open; bounds the mapped (resident) part of the store
WHOLE_CHUNK_BYTES = 4 * 2**20  # chunks up to this size are read whole once and kept (at most MAX_OPEN of them)


def check_finite(coeffs: Coeffs, where: str, sites: list[str] | None = None) -> None:
    for l, c in enumerate(coeffs):
        if not torch.isfinite(c).all():
            name = f"site {sites[l]!r}" if sites else f"site {l}"
            raise FcauditError(f"non-finite coefficients at {name} ({where}); fix the model or its dtype "
                               "(e.g. load in float32) before auditing")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class CoefficientStore:
    """Per-layer coefficient arrays over all evaluation windows, split into chunk files."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._handles: OrderedDict[int, object] = OrderedDict()
        self._whole: OrderedDict[int, dict[str, torch.Tensor]] = OrderedDict()  # small chunks, read once
        self._large: set[int] = set()  # chunks read by slices
        self._layout: list[dict] | None = None  # per layer: dtype, offset into its dtype's row, shape [T, S, K]
        self._slices: list[tuple[str, int, int, tuple[int, ...]]] | None = None

    def chunk_path(self, start: int) -> Path:
        return self.path / f"chunk_{start:07d}.safetensors"

    def write(self, start: int, coeffs: Coeffs, metadata: dict | None = None) -> Path:
        """Write the coefficients of windows start..start+n atomically (the chunk is whole or absent)."""
        check_finite(coeffs, f"windows from {start}")
        layout, groups, offsets = [], {}, {}
        for c in coeffs:
            name = _dtype_name(c.dtype)
            flat = c.detach().to("cpu").reshape(c.shape[0], -1)
            layout.append({"dtype": name, "offset": offsets.get(name, 0), "shape": list(c.shape[1:])})
            offsets[name] = offsets.get(name, 0) + flat.shape[1]
            groups.setdefault(name, []).append(flat)
        tensors = {f"coeffs.{k}": torch.cat(v, dim=1) for k, v in groups.items()}
        self._handles.pop(start, None)
        self._whole.pop(start, None)
        self._large.discard(start)
        return write_tensors(self.chunk_path(start), tensors, {"layers": layout, **(metadata or {})})

    def starts(self) -> list[int]:
        if not self.path.exists():
            return []
        return sorted(int(m.group(1)) for p in self.path.iterdir() if (m := _CHUNK.match(p.name)))

    def has(self, start: int) -> bool:
        return self.chunk_path(start).exists()

    def verify(self, start: int) -> dict:
        """Read the whole chunk and check its content hashes (audit.files.Damaged if it fails); returns its meta."""
        self._handles.pop(start, None)
        self._whole.pop(start, None)
        self._large.discard(start)
        return read_tensors(self.chunk_path(start))[1]

    def _open(self, start: int):
        if start in self._handles:
            self._handles.move_to_end(start)
        else:
            self._handles[start] = safe_open(str(self.chunk_path(start)), framework="pt")
            if len(self._handles) > MAX_OPEN:
                self._handles.popitem(last=False)
        return self._handles[start]

    def _rows(self, start: int, dtype: str, lo: int, hi: int) -> torch.Tensor:
        """Rows lo:hi of one chunk's flat tensor: from the kept copy of a small chunk, else a memory-mapped slice
        (a per-call cost that matters only for small models, whose chunks are small)."""
        if start not in self._whole:
            f = self._open(start)
            if start in self._large or self.chunk_path(start).stat().st_size > WHOLE_CHUNK_BYTES:
                self._large.add(start)
                return f.get_slice(f"coeffs.{dtype}")[lo:hi]
            self._whole[start] = {k.removeprefix("coeffs."): f.get_tensor(k) for k in f.keys()}
            if len(self._whole) > MAX_OPEN:
                self._whole.popitem(last=False)
        self._whole.move_to_end(start)
        return self._whole[start][dtype][lo:hi]

    def metadata(self, start: int) -> dict:
        return tensor_meta(self.chunk_path(start))

    def row_bytes(self, start: int) -> int:
        """Bytes of one window's coefficients, all layers."""
        return sum(math.prod(s["shape"]) * torch.empty(0, dtype=getattr(torch, s["dtype"])).element_size()
                   for s in self.layout(start))

    def layout(self, start: int) -> list[dict]:
        if self._layout is None:
            self._layout = self.metadata(start)["layers"]
        return self._layout

    def _split(self, rows: dict[str, torch.Tensor], layout: list[dict]) -> Coeffs:
        if self._slices is None:  # (dtype, first column, last column + 1, shape) per layer, computed once
            self._slices = [(s["dtype"], s["offset"], s["offset"] + math.prod(s["shape"]), tuple(s["shape"]))
                            for s in layout]
        return [rows[d][:, lo:hi].reshape(-1, *shape) for d, lo, hi, shape in self._slices]

    def read_chunk(self, start: int) -> Coeffs:
        f = self._open(start)
        layout = self.layout(start)
        return self._split({s["dtype"]: f.get_tensor(f"coeffs.{s['dtype']}") for s in layout}, layout)

    def take(self, examples: np.ndarray, chunk_starts: np.ndarray) -> Coeffs:
        """Coefficients of the given example indices (any order, repeats allowed), per layer. They may be views of a
        kept chunk: callers never modify them in place (transformations gather, site codecs decode into copies).

        `chunk_starts` is the sorted array of chunk start indices. A run of consecutive rows inside one chunk is read
        as one slice.
        """
        examples = np.asarray(examples, dtype=np.int64)
        which = np.searchsorted(chunk_starts, examples, side="right") - 1
        layout = self.layout(int(chunk_starts[0]))
        dtypes = list(dict.fromkeys(s["dtype"] for s in layout))
        if which[0] == which[-1] and int(examples[-1] - examples[0]) == len(examples) - 1 \
                and bool((np.diff(examples) == 1).all()):  # a batch's own rows (Correct, TokenShuffle, ...): one slice
            start = int(chunk_starts[which[0]])
            lo = int(examples[0]) - start
            return self._split({d: self._rows(start, d, lo, lo + len(examples)) for d in dtypes}, layout)
        firsts = chunk_starts[which]
        rows = {d: torch.cat([self._rows(int(f), d, int(e - f), int(e - f) + 1) for f, e in zip(firsts, examples)])
                for d in dtypes}  # e.g. a derangement's donors: one row each, in the order asked
        return self._split(rows, layout)

    def close(self) -> None:
        self._handles.clear()
        self._whole.clear()
