"""The files of an audit directory, each written atomically with a content hash and verified when it is reused.

Safetensors files carry one metadata key, "fcaudit" (sorted JSON holding the sha256 of every tensor and the file's own
metadata), so equal content gives equal bytes; Parquet files carry the sha256 of their columns in the schema metadata;
JSON files carry "_sha256" of the rest of their content. `read_*` raises `Damaged` for a file that is unreadable,
truncated or edited: the engine then recomputes the unit that wrote it.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from safetensors.torch import save

from fcaudit.io import finite_json, write_bytes

META_KEY = "fcaudit"


class Damaged(Exception):
    """A file of an audit directory is unreadable or does not match its recorded content hash."""

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


def write_tensors(path: str | os.PathLike, tensors: dict[str, torch.Tensor], meta: dict | None = None) -> Path:
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
    info = {"meta": meta or {}, "sha256": {k: tensor_sha256(v) for k, v in sorted(tensors.items())}}
    header = {META_KEY: json.dumps(info, sort_keys=True)}
    return write_bytes(path, save(tensors, metadata=header))


# Reading goes through the file's bytes or a memory map, not `safe_open(...).get_tensor/get_slice`: with safetensors
# 0.8 each of those calls keeps ~28 bytes for good (safetensors/safetensors#369), and an audit reads its store a few
# hundred thousand times. The format is stable and small: an 8-byte header length, a JSON header, the data.
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}


def _header(data) -> tuple[dict, int]:
    """(JSON header, offset of the data) of safetensors bytes (any bytes-like object)."""
    n = int.from_bytes(bytes(data[:8]), "little")
    return json.loads(bytes(data[8:8 + n])), 8 + n


def _views(buffer, header: dict, base: int) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file as views of `buffer` (bytes-like), no copy."""
    out = {}
    for name, spec in header.items():
        if name == "__metadata__":
            continue
        dtype, (lo, hi) = _DTYPES[spec["dtype"]], spec["data_offsets"]
        flat = torch.frombuffer(buffer, dtype=torch.uint8, count=hi - lo, offset=base + lo) if hi > lo \
            else torch.empty(0, dtype=torch.uint8)
        out[name] = flat.view(dtype).reshape(spec["shape"])
    return out


def mapped_tensors(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file as views of a private memory map of it (pages are read when touched;
    writes to the views would not reach the file)."""
    mm = np.memmap(path, mode="c")
    return _views(mm, *_header(mm))


def _data_end(header: dict) -> int:
    return max((spec["data_offsets"][1] for name, spec in header.items() if name != "__metadata__"), default=0)


def tensor_meta(path: str | os.PathLike) -> dict:
    """The `meta` dict stored with `write_tensors`, from the header (and the file's size, which must be the one
    the header gives: `read_tensors` holds a file to the same); raises Damaged when unreadable."""
    path = _exists(Path(path))
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(min(n, size)))  # a torn length reads no more than the file
        meta = json.loads(header["__metadata__"][META_KEY])["meta"]
    except Exception as e:
        raise Damaged(path, f"unreadable ({type(e).__name__})") from None
    if size != 8 + n + _data_end(header):
        raise Damaged(path, "its size is not the one its header gives")
    return meta


def read_tensors(path: str | os.PathLike, verify: bool = True) -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors, meta) of a file written by `write_tensors`; with `verify` every tensor's hash is checked."""
    path = _exists(Path(path))
    try:
        with open(path, "rb") as f:  # into a writable buffer: tensors made from it need no copy, raise no warning
            data = bytearray(os.fstat(f.fileno()).st_size)
            f.readinto(data)
        header, base = _header(data)
        info = json.loads(header["__metadata__"][META_KEY])
        tensors = _views(data, header, base)
    except Exception as e:
        raise Damaged(path, f"unreadable ({type(e).__name__})") from None
    if len(data) != base + _data_end(header):  # bytes beyond the data: safetensors' own reader refuses the file
        raise Damaged(path, "its size is not the one its header gives")
    if verify:
        if sorted(tensors) != sorted(info["sha256"]):
            raise Damaged(path, "tensors differ from those recorded")
        for k, t in tensors.items():
            if tensor_sha256(t) != info["sha256"][k]:
                raise Damaged(path, f"content hash of {k!r} does not match")
    return tensors, info["meta"]


def _column_bytes(values: np.ndarray | str, rows: int) -> Iterator[bytes | np.ndarray]:
    """The bytes a column is hashed by: a string column as numpy's fixed-width UTF-32 array of it. A str stands for
    a column holding it in each of `rows` rows, hashed in pieces as that array would be, without making it (a
    condition name in every row of a records table: 4 bytes per character and row)."""
    if isinstance(values, str):
        one = np.array([values]).tobytes()
        for r0 in range(0, rows, 4096):
            yield one * min(4096, rows - r0)
        return
    values = np.asarray(values)
    yield values.astype(str) if values.dtype.kind in "OUT" else np.ascontiguousarray(values)  # buffers, not copies


def _columns_sha256(columns: dict[str, np.ndarray | str], rows: int) -> str:
    h = hashlib.sha256()
    for name, values in columns.items():
        h.update(name.encode())
        for piece in _column_bytes(values, rows):
            h.update(piece)
    return h.hexdigest()


def _frame_sha256(frame: pd.DataFrame) -> str:
    return _columns_sha256({col: frame[col].to_numpy() for col in frame.columns}, len(frame))


def write_columns(path: str | os.PathLike, columns: dict[str, np.ndarray | str]) -> Path:
    """A Parquet table of equal-length numpy columns (read back by `read_frame`); a str value is a column holding that
    string in every row (dictionary-encoded). Built with pyarrow directly: a pandas frame costs more than the write
    itself for the short per-(condition, r) record tables."""
    rows = next(len(v) for v in columns.values() if not isinstance(v, str))
    # glibc's pool, not arrow's default (mimalloc): that kept 2 MiB resident after one 2048-row write, 160 KiB in use
    pool = pa.system_memory_pool()
    table = pa.table({name: pa.repeat(v, rows, memory_pool=pool) if isinstance(v, str)
                      else pa.array(v, memory_pool=pool) for name, v in columns.items()})
    table = table.replace_schema_metadata({b"fcaudit_sha256": _columns_sha256(columns, rows).encode()})
    buffer = pa.BufferOutputStream(pool)  # serialized in memory: arrow's own file opening costs more than the write
    # a dictionary only for the constant columns: on columns of distinct numbers trying one costs more than the write
    # (3.5x at 8192 rows) and arrow's memory for it grows with the rows
    pq.write_table(table, buffer, use_dictionary=[name for name, v in columns.items() if isinstance(v, str)],
                   memory_pool=pool)
    return write_bytes(path, memoryview(buffer.getvalue()))  # arrow's buffer itself, not a copy as bytes


def read_frame(path: str | os.PathLike, verify: bool = True, require_hash: bool = False) -> pd.DataFrame:
    """A Parquet table written by `write_columns`, its content hash checked (with `verify`). `require_hash`: a table
    without one is damaged too (it was rewritten by something else, e.g. pandas, which drops the hash)."""
    path = _exists(Path(path))
    try:
        table = pq.read_table(path)
        frame = table.to_pandas()
    except Exception as e:
        raise Damaged(path, f"unreadable ({type(e).__name__})") from None
    recorded = (table.schema.metadata or {}).get(b"fcaudit_sha256")
    if verify and require_hash and recorded is None:
        raise Damaged(path, "it has no content hash (rewritten by another program)")
    if verify and recorded is not None and recorded.decode() != _frame_sha256(frame):
        raise Damaged(path, "content hash does not match")
    return frame


def _json_sha256(obj: dict) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def write_json(path: str | os.PathLike, obj: dict) -> Path:
    obj = {k: v for k, v in obj.items() if k != "_sha256"}
    obj = json.loads(json.dumps(finite_json(obj), default=str))  # hash what a reader will see; nan as null
    text = json.dumps({**obj, "_sha256": _json_sha256(obj)}, indent=2, sort_keys=True) + "\n"
    return write_bytes(path, text.encode())


def read_json(path: str | os.PathLike, keys: tuple[str, ...] = ()) -> dict:
    """A JSON object written by `write_json`: parsed, hash checked (when recorded), `keys` present."""
    path = _exists(Path(path))
    try:
        obj = json.loads(path.read_text())
    except Exception as e:
        raise Damaged(path, f"unreadable ({type(e).__name__})") from None
    if not isinstance(obj, dict):
        raise Damaged(path, "not a JSON object")
    recorded = obj.pop("_sha256", None)
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
