"""The coefficient store (Eq. 2's A_i): one safetensors chunk per capture batch, written atomically with a content hash.

Each window's layers are flattened into one row per dtype (`coeffs.float32`, ...), so any set of windows costs one read
per run of consecutive rows. A read takes only the rows asked for and nothing stays loaded, so memory stays flat with
the windows; a store that fits a GPU can be held there whole (`load`).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from fcaudit.auditor.files import Damaged, tensor_meta, write_tensors
from fcaudit.errors import FcauditError
from fcaudit.protocol import Coeffs


def all_finite(t: torch.Tensor) -> bool:
    """No nan or inf in `t`. Below float64, from its float64 sum (nan and inf carry through it, and no sum of finite
    float32, bf16 or float16 values reaches float64's range): one pass and no boolean copy of a batch's logits."""
    if t.dtype == torch.float64 or not t.is_floating_point():
        return bool(torch.isfinite(t).all())
    return math.isfinite(t.sum(dtype=torch.float64))


def check_finite(coeffs: Coeffs, where: str, sites: list[str] | None = None) -> None:
    """Float coefficients, all finite. An integer or bool one is refused: the static and mean conditions replay
    averages, which its dtype would round to 0 or 1 (a gate read as off or on everywhere)."""
    for l, c in enumerate(coeffs):
        name = f"site {sites[l]!r}" if sites else f"site {l}"
        if not c.is_floating_point():
            dtype = str(c.dtype).removeprefix("torch.")
            raise FcauditError(f"{name} emits {dtype} coefficients, which cannot hold the means the static and mean "
                               f"conditions replay; declare 0/1 decisions with kind=\"skip_mask\" "
                               "(Controller.from_modules(..., kind=\"skip_mask\"), no layout) or have the model emit the "
                               "gate as float (e.g. gate.float())")
        if not all_finite(c):
            raise FcauditError(f"non-finite coefficients at {name} ({where}); fix the model or its dtype "
                               "(e.g. load in float32) before auditing")


class CoefficientStore:
    """Per-layer coefficient arrays over all evaluation windows, split into chunk files."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._slices: list[tuple[str, int, int, tuple[int, ...]]] = []  # per layer: dtype, its columns lo:hi, shape
        self._width: dict[str, int] = {}  # features per row of each dtype, in the order of the layers
        self._offsets: dict[int, tuple[int, list[int]]] = {}  # per chunk read: `_where`
        self._resident: dict[str, torch.Tensor] | None = None  # `load`: every row, in window order, per dtype

    def chunk_path(self, start: int) -> Path:
        return self.path / f"chunk_{start:07d}.safetensors"

    def write(self, start: int, coeffs: Coeffs, metadata: dict | None = None) -> Path:
        """Write the coefficients of windows start..start+n atomically (the chunk is whole or absent)."""
        check_finite(coeffs, f"windows from {start}")
        layout, groups = [], {}
        for c in coeffs:
            name = str(c.dtype).removeprefix("torch.")
            group = groups.setdefault(name, [])
            layout.append({"dtype": name, "offset": sum(f.shape[1] for f in group), "shape": list(c.shape[1:])})
            group.append(c.detach().to("cpu").reshape(c.shape[0], -1))
        tensors = {f"coeffs.{k}": torch.cat(v, dim=1) for k, v in groups.items()}
        return write_tensors(self.chunk_path(start), tensors, {"layers": layout, **(metadata or {})})

    def _read(self, runs: list[list[int]]) -> dict[str, torch.Tensor]:
        """Rows lo:hi of chunk `start` for each (start, lo, hi) of `runs`, one after the other, per dtype, read from
        the file (safetensors' own readers keep some bytes per call, and an audit reads very many times)."""
        total = sum(hi - lo for _, lo, hi in runs)
        out = {d: torch.empty(total, n, dtype=getattr(torch, d)) for d, n in self._width.items()}
        views = [t.view(torch.uint8).numpy() for t in out.values()]  # numpy has no bfloat16; bytes it has
        row = 0
        for start, lo, hi in runs:
            rows, where = self._where(start)
            if not 0 <= lo < hi <= rows:
                raise Damaged(self.chunk_path(start), f"it holds {rows} windows, not row {hi - 1}")
            fd = os.open(self.chunk_path(start), os.O_RDONLY)
            try:
                for begin, view in zip(where, views):
                    width = view.shape[1]  # bytes per row
                    if os.preadv(fd, [view[row:row + hi - lo]], begin + lo * width) != (hi - lo) * width:
                        raise Damaged(self.chunk_path(start), "truncated")
            finally:
                os.close(fd)
            row += hi - lo
        return out

    def _where(self, start: int) -> tuple[int, list[int]]:
        """(windows, where each dtype's rows begin) of a chunk, from its safetensors header (an 8-byte length, then
        JSON), read once."""
        if start not in self._offsets:
            path = self.chunk_path(start)
            try:
                with open(path, "rb") as f:
                    size = int.from_bytes(f.read(8), "little")
                    header = json.loads(f.read(size))
            except (OSError, ValueError) as e:  # emptied or cut while the audit ran (stage 1 wrote and checked it)
                raise Damaged(path, f"unreadable ({type(e).__name__})") from None
            specs = [header.get(f"coeffs.{d}", {}) for d in self._width]
            if any(s.get("shape", [0, 0])[1] != n for s, n in zip(specs, self._width.values())):
                raise Damaged(path, "its rows do not match the store's layout")
            self._offsets[start] = specs[0]["shape"][0], [8 + size + s["data_offsets"][0] for s in specs]
        return self._offsets[start]

    def metadata(self, start: int) -> dict:
        return tensor_meta(self.chunk_path(start))

    def row_bytes(self, start: int) -> int:
        """Bytes of one window's coefficients, all layers."""
        self._layout(start)
        return sum(n * getattr(torch, d).itemsize for d, n in self._width.items())

    def _layout(self, start: int) -> None:
        """How `_split` cuts a row into layers, from chunk `start`'s header, once."""
        if not self._slices:
            self._slices = [(s["dtype"], s["offset"], s["offset"] + math.prod(s["shape"]), tuple(s["shape"]))
                            for s in self.metadata(start)["layers"]]
            self._width = {d: hi for d, _, hi, _ in self._slices}  # each dtype's row: its last layer's end

    def _split(self, rows: dict[str, torch.Tensor]) -> Coeffs:
        return [rows[d][:, lo:hi].reshape(-1, *shape) for d, lo, hi, shape in self._slices]

    def read_chunk(self, start: int) -> Coeffs:
        self._layout(start)
        return self._split({k.removeprefix("coeffs."): t for k, t in load_file(self.chunk_path(start)).items()})

    def load(self, chunk_starts: np.ndarray, windows: int, device: torch.device) -> None:
        """Hold the rows of all `windows` on `device`, one [windows, features] tensor per dtype in window order (each
        chunk read once, straight into its rows); `take` then gathers there. `unload` lets them go."""
        self._layout(int(chunk_starts[0]))
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
        """Coefficients of the given example indices (any order, repeats allowed), per layer; `chunk_starts`: the
        sorted chunk starts. They may be views of the store held on a device (`load`): callers never modify them in
        place (transformations gather, site codecs decode into copies)."""
        examples = np.asarray(examples, dtype=np.int64)
        if self._resident is not None:
            if bool((np.diff(examples) == 1).all()):
                lo, hi = int(examples[0]), int(examples[-1]) + 1
                return self._split({d: t[lo:hi] for d, t in self._resident.items()})
            index = torch.from_numpy(examples).to(self.device)
            return self._split({d: t.index_select(0, index) for d, t in self._resident.items()})
        self._layout(int(chunk_starts[0]))
        runs: list[list[int]] = []  # [chunk start, first row, last row + 1]: a batch's own rows are one run
        chunks = chunk_starts[np.searchsorted(chunk_starts, examples, side="right") - 1]
        for e, c in zip(examples.tolist(), chunks.tolist()):
            if runs and runs[-1][0] == c and runs[-1][2] == e - c:
                runs[-1][2] += 1
            else:
                runs.append([c, e - c, e - c + 1])
        return self._split(self._read(runs))
