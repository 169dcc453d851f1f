"""The files of an audit directory, each written atomically with a hash and verified when it is reused or read.

Safetensors files carry one metadata key, "fcaudit" (sorted JSON of the file's own metadata and the sha256 of that
metadata with every tensor's name, dtype, shape and bytes), so equal content gives equal bytes, and the library's own
header check covers the rest of the file. A Parquet file's sha256, of all its bytes, is in a sidecar
`NAME.parquet.sha256` (in `sha256sum` format) written before it. JSON files carry "_sha256" of the rest of their
content. The engine and every reader go through `read_*`, which raise `Damaged` for a file that is unreadable,
truncated, edited or lacks its hash: the reader then refuses it, and the next audit run recomputes it.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from safetensors import safe_open
from safetensors.torch import save

from fcaudit.io import finite_json, write_bytes

META_KEY = "fcaudit"


class Damaged(Exception):
    """A file of an audit directory is unreadable, lacks its hash or does not match it."""

    def __init__(self, path: Path, why: str):
        super().__init__(f"{path}: {why}")
        self.path, self.why = Path(path), why


def _exists(path: Path) -> Path:
    if not path.is_file():
        raise FileNotFoundError(path)
    return path


def tensor_sha256(t: torch.Tensor) -> str:
    t = t.detach().to("cpu").contiguous()
    return hashlib.sha256(t.reshape(-1).view(torch.uint8).numpy()).hexdigest()


def _tensors_sha256(tensors: dict[str, torch.Tensor], meta: dict) -> str:
    h = hashlib.sha256(json.dumps(meta, sort_keys=True).encode())
    for name, t in sorted(tensors.items()):
        h.update(f"\0{name}\0{t.dtype}\0{list(t.shape)}\0".encode())
        h.update(t.contiguous().reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def write_tensors(path: str | os.PathLike, tensors: dict[str, torch.Tensor], meta: dict | None = None) -> Path:
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
    meta = json.loads(json.dumps(meta or {}))  # hash what a reader will see
    info = {"meta": meta, "sha256": _tensors_sha256(tensors, meta)}
    return write_bytes(path, save(tensors, metadata={META_KEY: json.dumps(info, sort_keys=True)}))


def tensor_meta(path: str | os.PathLike) -> dict:
    """The `meta` dict stored with `write_tensors`, from the header alone (unchecked: `read_tensors` checks it)."""
    path = _exists(Path(path))
    try:
        with safe_open(path, "pt") as f:
            return json.loads(f.metadata()[META_KEY])["meta"]
    except Exception as e:
        raise Damaged(path, f"unreadable ({type(e).__name__})") from None


def read_tensors(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors, meta) of a file written by `write_tensors`, its hash checked."""
    path = _exists(Path(path))
    try:
        with safe_open(path, "pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
            info = json.loads(f.metadata()[META_KEY])
        meta, recorded = info["meta"], info["sha256"]
    except Exception as e:
        raise Damaged(path, f"unreadable ({type(e).__name__})") from None
    if recorded != _tensors_sha256(tensors, meta):
        raise Damaged(path, "content hash does not match")
    return tensors, meta


def sidecar(path: Path) -> Path:
    """Where the sha256 of a Parquet file's bytes is kept."""
    return path.with_name(path.name + ".sha256")


def write_columns(path: str | os.PathLike, columns: dict[str, np.ndarray | str]) -> Path:
    """A Parquet table of equal-length numpy columns (a str value: that string in every row), its sha256 in its
    sidecar. The sidecar is written first, so a killed write leaves a file that is absent or fails its check."""
    path = Path(path)
    rows = next(len(v) for v in columns.values() if not isinstance(v, str))
    pool = pa.system_memory_pool()  # pyarrow's own pool keeps what its largest table took: it would grow with the rows
    table = pa.table({name: pa.repeat(v, rows, memory_pool=pool) if isinstance(v, str) else pa.array(v, memory_pool=pool)
                      for name, v in columns.items()})
    buffer = pa.BufferOutputStream(memory_pool=pool)
    # a dictionary for the constant columns only: on distinct numbers it costs more than the write
    pq.write_table(table, buffer, use_dictionary=[name for name, v in columns.items() if isinstance(v, str)],
                   memory_pool=pool)
    data = memoryview(buffer.getvalue())
    write_bytes(sidecar(path), f"{hashlib.sha256(data).hexdigest()}  {path.name}\n".encode())
    return write_bytes(path, data)


def read_frame(path: str | os.PathLike) -> pd.DataFrame:
    """A Parquet table written by `write_columns`, its bytes checked against the sidecar's sha256."""
    path = _exists(Path(path))
    try:
        recorded = sidecar(path).read_text().split()[0]
    except (OSError, UnicodeDecodeError, IndexError):
        raise Damaged(path, f"it has no recorded sha256 ({sidecar(path).name}; rewritten by another program?)") \
            from None
    data = path.read_bytes()
    if hashlib.sha256(data).hexdigest() != recorded:
        raise Damaged(path, "its sha256 does not match the recorded one")
    try:
        return pq.read_table(pa.BufferReader(data)).to_pandas()
    except Exception as e:
        raise Damaged(path, f"unreadable ({type(e).__name__})") from None


def _json_sha256(obj: dict) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def write_json(path: str | os.PathLike, obj: dict) -> Path:
    obj = {k: v for k, v in obj.items() if k != "_sha256"}
    obj = json.loads(json.dumps(finite_json(obj), default=str))  # hash what a reader will see; nan as null
    text = json.dumps({**obj, "_sha256": _json_sha256(obj)}, indent=2, sort_keys=True) + "\n"
    return write_bytes(path, text.encode())


def read_json(path: str | os.PathLike, keys: tuple[str, ...] = (), require_hash: bool = False) -> dict:
    """A JSON object written by `write_json`: parsed, hash checked (when recorded; `require_hash`: it must be),
    `keys` present."""
    path = _exists(Path(path))
    try:
        obj = json.loads(path.read_text())
    except Exception as e:
        raise Damaged(path, f"unreadable ({type(e).__name__})") from None
    if not isinstance(obj, dict):
        raise Damaged(path, "not a JSON object")
    recorded = obj.pop("_sha256", None)
    if recorded is None and require_hash:
        raise Damaged(path, "it has no recorded _sha256")
    if recorded is not None and recorded != _json_sha256(obj):
        raise Damaged(path, "content hash does not match")
    missing = [k for k in keys if k not in obj]
    if missing:
        raise Damaged(path, f"lacks {missing}")
    return obj


def quietly(read, *args, **kwargs) -> Any | None:
    """read(...) or None when the file is missing or damaged."""
    try:
        return read(*args, **kwargs)
    except (Damaged, FileNotFoundError):
        return None
