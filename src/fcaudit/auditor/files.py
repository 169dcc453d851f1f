"""The files of an audit directory, each written atomically with a hash that every `read_*` checks: safetensors carry
the sha256 of their metadata and tensors in metadata key "fcaudit", a Parquet file's sha256 is in its sidecar
`NAME.parquet.sha256` (`sha256sum` format, written first), JSON files carry "_sha256" of the rest
(`fcaudit.io.write_json(..., hashed=True)`). A file that is unreadable, truncated, edited or lacks its hash raises
`Damaged`: readers refuse it, the next audit recomputes it."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from safetensors import safe_open
from safetensors.torch import save

from fcaudit.errors import FcauditError
from fcaudit.io import json_sha256, write_bytes

META_KEY = "fcaudit"


class Damaged(Exception):
    """A file of an audit directory is unreadable, lacks its hash or does not match it."""

    def __init__(self, path: Path, why: str):
        super().__init__(f"{path}: {why}")
        self.path, self.why = Path(path), why


def _exists(path: str | os.PathLike) -> Path:
    if (path := Path(path)).is_dir():
        raise FcauditError(f"{path} is a directory where the audit keeps a file: remove it and rerun the audit "
                           "command")
    if not path.is_file():
        raise FileNotFoundError(path)
    return path


def _read(path: str | os.PathLike, parse: Callable[[Path], Any]) -> Any:
    """parse(path); FileNotFoundError for a missing file, Damaged for one that does not parse."""
    path = _exists(path)
    try:
        return parse(path)
    except Exception as e:
        raise Damaged(path, f"unreadable ({type(e).__name__})") from None


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


def _header(path: Path) -> dict:
    with safe_open(path, "pt") as f:
        return json.loads(f.metadata()[META_KEY])


def _contents(path: Path) -> tuple[dict[str, torch.Tensor], dict, str]:
    with safe_open(path, "pt") as f:
        info = json.loads(f.metadata()[META_KEY])
        return {k: f.get_tensor(k) for k in f.keys()}, info["meta"], info["sha256"]


def tensor_meta(path: str | os.PathLike) -> dict:
    """The `meta` dict stored with `write_tensors`, from the header alone (unchecked: `read_tensors` checks it)."""
    return _read(path, lambda p: _header(p)["meta"])


def read_tensors(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors, meta) of a file written by `write_tensors`, its hash checked."""
    tensors, meta, recorded = _read(path, _contents)
    if recorded != _tensors_sha256(tensors, meta):
        raise Damaged(path, "content hash does not match")
    return tensors, meta


def sidecar(path: Path) -> Path:
    """Where the sha256 of a Parquet file's bytes is kept."""
    return path.with_name(path.name + ".sha256")


def write_columns(path: str | os.PathLike, columns: dict[str, np.ndarray | str], meta: dict | None = None) -> Path:
    """A Parquet table of equal-length numpy columns (a str value: that string in every row), `meta` in its schema's
    metadata (key "fcaudit"), its sha256 in its sidecar. The sidecar is written first, so a killed write leaves a
    file that is absent or fails its check."""
    path = Path(path)
    rows = next(len(v) for v in columns.values() if not isinstance(v, str))
    pool = pa.system_memory_pool()  # pyarrow's own pool keeps what its largest table took: it would grow with the rows
    table = pa.table({name: pa.repeat(v, rows, memory_pool=pool) if isinstance(v, str) else pa.array(v, memory_pool=pool)
                      for name, v in columns.items()})
    if meta is not None:
        table = table.replace_schema_metadata({META_KEY: json.dumps(meta, sort_keys=True)})
    buffer = pa.BufferOutputStream(memory_pool=pool)
    # a dictionary for the constant columns only: on distinct numbers it costs more than the write
    pq.write_table(table, buffer, use_dictionary=[name for name, v in columns.items() if isinstance(v, str)],
                   memory_pool=pool)
    data = memoryview(buffer.getvalue())
    write_bytes(sidecar(path), f"{hashlib.sha256(data).hexdigest()}  {path.name}\n".encode())
    return write_bytes(path, data)


def read_frame(path: str | os.PathLike) -> pd.DataFrame:
    """A Parquet table written by `write_columns`, its bytes checked against the sidecar's sha256."""
    return read_table(path)[0]


def read_table(path: str | os.PathLike) -> tuple[pd.DataFrame, dict | None]:
    """(table, meta) of a Parquet file written by `write_columns`, its bytes checked against the sidecar's sha256;
    meta is None when it was written without."""
    path = _exists(path)
    try:
        recorded = sidecar(path).read_text().split()[0]
    except (OSError, UnicodeDecodeError, IndexError):
        raise Damaged(path, f"it has no recorded sha256 ({sidecar(path).name}; rewritten by another program?)") \
            from None
    data = path.read_bytes()
    if hashlib.sha256(data).hexdigest() != recorded:
        raise Damaged(path, "its sha256 does not match the recorded one")
    try:
        table = pq.read_table(pa.BufferReader(data))
        meta = (table.schema.metadata or {}).get(META_KEY.encode())
        return table.to_pandas(), None if meta is None else json.loads(meta)
    except Exception as e:
        raise Damaged(path, f"unreadable ({type(e).__name__})") from None


def read_json(path: str | os.PathLike, keys: tuple[str, ...] = (), require_hash: bool = False) -> dict:
    """A JSON object written by `fcaudit.io.write_json(..., hashed=True)`: parsed, hash checked (when recorded;
    `require_hash`: it must be), `keys` present."""
    obj = _read(path, lambda p: json.loads(p.read_text()))
    if not isinstance(obj, dict):
        raise Damaged(path, "not a JSON object")
    recorded = obj.pop("_sha256", None)
    if recorded is None and require_hash:
        raise Damaged(path, "it has no recorded _sha256")
    if recorded is not None and recorded != json_sha256(obj):
        raise Damaged(path, "content hash does not match")
    if missing := [k for k in keys if k not in obj]:
        raise Damaged(path, f"lacks {missing}")
    return obj


def quietly(read, *args, **kwargs) -> Any | None:
    """read(...) or None when the file is missing or damaged."""
    try:
        return read(*args, **kwargs)
    except (Damaged, FileNotFoundError):
        return None
