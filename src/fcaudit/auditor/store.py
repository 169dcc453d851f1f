"""The coefficient store: every captured coefficient of the evaluation windows, on disk (Eq. 2's A_i).

One safetensors file per capture batch (`chunk_{start:07d}.safetensors`). Each example's canonical coefficients of all
layers are flattened into one row, one 2-D tensor [n, features] per dtype (`coeffs.float32`, `coeffs.bfloat16`, ...),
so reading the coefficients of any set of examples costs one slice per run of consecutive rows, not one per layer.
Chunks are written atomically with a content hash (audit.files), so RAM does not grow with the number of windows
and a killed run leaves only whole chunks. Reads come from chunks loaded whole (safetensors' `load_file`), the most
recently used kept up to MAX_LOADED bytes (at least one). A store that fits a GPU can be held there whole (`load`, the
engine decides), so reads gather on the device with no host copy.
"""

from __future__ import annotations

import math
import os
import re
from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from fcaudit.auditor.files import read_tensors, tensor_meta, write_tensors
from fcaudit.errors import FcauditError
from fcaudit.protocol import Coeffs

_CHUNK = re.compile(r"^chunk_(\d+)\.safetensors$")
# Loaded chunks are kept up to this many bytes, least recently used first out: a derangement reads each batch's
# donors from chunks all over the store, and memory stays bounded however many windows there are.
MAX_LOADED = 256 * 2**20


def all_finite(t: torch.Tensor) -> bool:
    """No nan or inf in `t`. Below float64, from its float64 sum (nan and inf carry through it, and no sum of finite
    float32, bf16 or float16 values reaches float64's range): one pass and no boolean copy of a batch's logits."""
    if t.dtype == torch.float64 or not t.is_floating_point():
        return bool(torch.isfinite(t).all())
    return math.isfinite(t.sum(dtype=torch.float64))


def check_finite(coeffs: Coeffs, where: str, sites: list[str] | None = None) -> None:
    for l, c in enumerate(coeffs):
        if not all_finite(c):
            name = f"site {sites[l]!r}" if sites else f"site {l}"
            raise FcauditError(f"non-finite coefficients at {name} ({where}); fix the model or its dtype "
                               "(e.g. load in float32) before auditing")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class CoefficientStore:
    """Per-layer coefficient arrays over all evaluation windows, split into chunk files."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._loaded: OrderedDict[int, dict[str, torch.Tensor]] = OrderedDict()  # chunk start -> {dtype: [n, F]}
        self._bytes = 0  # bytes of the kept chunks' tensors
        self._layout: list[dict] | None = None  # per layer: dtype, offset into its dtype's row, shape [T, S, K]
        self._slices: list[tuple[str, int, int, tuple[int, ...]]] | None = None
        self._resident: dict[str, torch.Tensor] | None = None  # `load`: every row, in window order, per dtype

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
        self._drop(start)
        return write_tensors(self.chunk_path(start), tensors, {"layers": layout, **(metadata or {})})

    def starts(self) -> list[int]:
        if not self.path.exists():
            return []
        return sorted(int(m.group(1)) for p in self.path.iterdir() if (m := _CHUNK.match(p.name)))

    def has(self, start: int) -> bool:
        return self.chunk_path(start).exists()

    def verify(self, start: int) -> dict:
        """Read the whole chunk and check its content hashes (audit.files.Damaged if it fails); returns its meta."""
        self._drop(start)
        return read_tensors(self.chunk_path(start))[1]

    def _drop(self, start: int) -> None:
        tensors = self._loaded.pop(start, None)
        if tensors is not None:
            self._bytes -= sum(t.nbytes for t in tensors.values())

    def _open(self, start: int) -> dict[str, torch.Tensor]:
        if start in self._loaded:
            self._loaded.move_to_end(start)
        else:
            self._loaded[start] = {k.removeprefix("coeffs."): t for k, t in load_file(self.chunk_path(start)).items()}
            self._bytes += sum(t.nbytes for t in self._loaded[start].values())
            while len(self._loaded) > 1 and self._bytes > MAX_LOADED:
                self._drop(next(iter(self._loaded)))
        return self._loaded[start]

    def _rows(self, start: int, dtype: str, lo: int, hi: int) -> torch.Tensor:
        """Rows lo:hi of one chunk's flat tensor (a view of the loaded chunk)."""
        return self._open(start)[dtype][lo:hi]

    def metadata(self, start: int) -> dict:
        return tensor_meta(self.chunk_path(start))

    def row_bytes(self, start: int) -> int:
        """Bytes of one window's coefficients, all layers."""
        return sum(math.prod(s["shape"]) * getattr(torch, s["dtype"]).itemsize for s in self.layout(start))

    def layout(self, start: int) -> list[dict]:
        if self._layout is None:
            self._layout = self.metadata(start)["layers"]
            # (dtype, first column, last column + 1, shape) per layer: how `_split` cuts a row
            self._slices = [(s["dtype"], s["offset"], s["offset"] + math.prod(s["shape"]), tuple(s["shape"]))
                            for s in self._layout]
        return self._layout

    def _split(self, rows: dict[str, torch.Tensor]) -> Coeffs:
        return [rows[d][:, lo:hi].reshape(-1, *shape) for d, lo, hi, shape in self._slices]

    def read_chunk(self, start: int) -> Coeffs:
        self.layout(start)
        return self._split(self._open(start))

    def load(self, chunk_starts: np.ndarray, windows: int, device: torch.device) -> None:
        """Hold the rows of all `windows` on `device`, one [windows, features] tensor per dtype in window order (each
        chunk read once, straight into its rows); `take` then gathers there. `unload` lets them go."""
        self.layout(int(chunk_starts[0]))
        rows: dict[str, torch.Tensor] = {}
        for start in chunk_starts:
            for k, t in load_file(self.chunk_path(int(start))).items():
                d = k.removeprefix("coeffs.")
                if d not in rows:
                    rows[d] = torch.empty(windows, t.shape[1], dtype=t.dtype, device=device)
                rows[d][int(start):int(start) + t.shape[0]].copy_(t)
        self._resident = rows

    def unload(self) -> None:
        self._resident = None

    @property
    def device(self) -> torch.device | None:
        """Where `load` holds the store (None: read from the chunk files)."""
        return None if self._resident is None else next(iter(self._resident.values())).device

    def take(self, examples: np.ndarray, chunk_starts: np.ndarray) -> Coeffs:
        """Coefficients of the given example indices (any order, repeats allowed), per layer. They may be views of a
        loaded chunk: callers never modify them in place (transformations gather, site codecs decode into copies).

        `chunk_starts` is the sorted array of chunk start indices. A run of consecutive rows inside one chunk is read
        as one slice. A loaded store gathers on its device.
        """
        examples = np.asarray(examples, dtype=np.int64)
        if self._resident is not None:
            if bool((np.diff(examples) == 1).all()):
                lo, hi = int(examples[0]), int(examples[-1]) + 1
                return self._split({d: t[lo:hi] for d, t in self._resident.items()})
            index = torch.from_numpy(examples).to(self.device)
            return self._split({d: t.index_select(0, index) for d, t in self._resident.items()})
        which = np.searchsorted(chunk_starts, examples, side="right") - 1
        layout = self.layout(int(chunk_starts[0]))
        dtypes = list(dict.fromkeys(s["dtype"] for s in layout))
        # runs of consecutive rows within one chunk: [lo, hi) positions in `examples`
        cuts = np.flatnonzero((np.diff(examples) != 1) | (np.diff(which) != 0)) + 1
        if not len(cuts):  # a batch's own rows: one slice
            start = int(chunk_starts[which[0]])
            lo = int(examples[0]) - start
            return self._split({d: self._rows(start, d, lo, lo + len(examples)) for d in dtypes})
        # e.g. the windows of several batches: a slice per chunk; a derangement's donors: one row each, in order
        lo, hi = np.concatenate(([0], cuts)), np.concatenate((cuts, [len(examples)]))
        firsts = chunk_starts[which[lo]]
        rows = examples[lo] - firsts  # each run's first row within its chunk
        runs = list(zip(firsts.tolist(), rows.tolist(), (rows + hi - lo).tolist()))
        return self._split({d: torch.cat([self._rows(f, d, a, b) for f, a, b in runs]) for d in dtypes})

    def close(self) -> None:
        self._loaded.clear()
        self._bytes = 0
        self._resident = None
