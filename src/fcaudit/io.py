"""Atomic writes (a file is either absent or complete, never half written) and output-directory checks."""

import fcntl
import json
import math
import os
import re
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

from fcaudit.errors import FcauditError

_UMASK = os.umask(0o022)
os.umask(_UMASK)

# atomic_write's temp files: "." + target name + "." + mkstemp's 8 random characters + ".tmp"
_TEMP = re.compile(r"^\..+\.[A-Za-z0-9_]{8}\.tmp$")


@contextmanager
def _replacing(path: Path) -> Iterator[tuple[int, str]]:
    """(descriptor, name) of a temp file next to `path`, with the permissions open() would give (mkstemp makes
    0600); renamed onto `path` when the block ends, removed when it raises."""
    if not path.parent.is_dir():  # a stat is far cheaper than mkdir's failing syscall on every write
        path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~_UMASK)
        yield fd, tmp
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write(path: str | os.PathLike, write: Callable[[Path], None]) -> Path:
    """Call write(tmp_path) on a temp file next to `path`, then rename it into place."""
    path = Path(path)
    with _replacing(path) as (fd, tmp):
        os.close(fd)
        write(Path(tmp))
    return path


def write_bytes(path: str | os.PathLike, data: bytes | memoryview) -> Path:
    """`atomic_write` of bytes already in memory, through the temp file's own descriptor (the audit writes many small
    files, where opening the file a second time costs more than the write)."""
    path = Path(path)
    with _replacing(path) as (fd, _), os.fdopen(fd, "wb") as f:
        f.write(data)
    return path


def write_text(path: str | os.PathLike, text: str) -> Path:
    return write_bytes(path, text.encode())


def finite_json(obj: Any) -> Any:
    """`obj` with every nan or infinite float (Python or numpy) as None: JSON has no NaN, and strict readers
    (JavaScript's JSON.parse, jq) refuse the bare NaN that Python's json writes. Numpy scalars become Python's."""
    if isinstance(obj, dict):
        return {k: finite_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_json(v) for v in obj]
    if hasattr(obj, "item") and getattr(obj, "ndim", None) == 0:  # a numpy scalar
        obj = obj.item()
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


def write_json(path: str | os.PathLike, obj: Any) -> Path:
    """Pretty, sorted JSON; non-finite numbers are written as null (`finite_json`)."""
    return write_text(path, json.dumps(finite_json(obj), indent=2, sort_keys=True, default=str, allow_nan=False)
                      + "\n")


def read_json(path: str | os.PathLike) -> Any:
    return json.loads(Path(path).read_text())


class Locked(FcauditError):
    """Another process holds a directory's lock."""


LOCK = ".lock"


def lock_dir(path: str | os.PathLike, what: str) -> int:
    """Take the exclusive lock of directory `path` (created if need be) for the `what`, or fail at once: two
    processes must never write one run or audit directory. Returns the lock's descriptor; closing it (or the
    process ending, however it ends) releases the lock."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    fd = os.open(path / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "another process"
        os.close(fd)
        raise Locked(f"{path} is being written by another fcaudit process ({holder}); wait for it to finish or pass "
                     f"another --out for the {what}") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()}".encode(), 0)
    return fd


@contextmanager
def locked(path: str | os.PathLike, what: str) -> Iterator[None]:
    """`lock_dir` for the duration of the block."""
    fd = lock_dir(path, what)
    try:
        yield
    finally:
        os.close(fd)


def remove_stale_temps(directory: str | os.PathLike) -> list[Path]:
    """Delete the temp files an interrupted atomic_write left in `directory` (not below it); returns them.

    Only names of atomic_write's own pattern are touched, never a file fcaudit did not create."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    stale = [p for p in directory.iterdir() if p.is_file() and _TEMP.match(p.name)]
    for p in stale:
        p.unlink(missing_ok=True)
    return stale


# files that make a directory a checkpoint or an audit: no other command's output goes into it
OTHERS = {".fcaudit-audit": "an audit", "config.json": "a checkpoint", "model.safetensors": "a checkpoint"}


def prepare_out(path: str | os.PathLike, what: str, *, alone: bool = False) -> Path:
    """Check, before any work, that `path` can become (or already is) a writable directory for the `what`.

    Creates nothing and deletes nothing: a file at `path`, a file among its parents, or a directory that cannot
    be written becomes one FcauditError naming the fix; so does, with `alone`, a directory holding a checkpoint or
    an audit (OTHERS), whose files the `what` would mix with. Returns `path` as a Path.
    """
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise FcauditError(f"--out {path} is an existing file, not a directory: pass a directory for the {what} "
                           "(fcaudit does not overwrite files it did not write)")
    if alone and path.is_dir():
        held = next((kind for name, kind in OTHERS.items() if (path / name).exists()), None)
        if held is not None:
            raise FcauditError(f"--out {path} holds {held}: pass a directory of its own for the {what}")
    existing = path
    while not existing.exists():  # the nearest existing ancestor is where the first directory would be created
        if existing.parent == existing:
            break
        existing = existing.parent
    if existing.exists() and not existing.is_dir():
        raise FcauditError(f"--out {path} lies below the file {existing}: pass a directory path for the {what} "
                           "that is not inside a file")
    try:  # os.access ignores read-only mounts and is always true for root: really try to create a file
        # named like atomic_write's temp files: another rank checking the directory meanwhile counts it as ours
        fd, probe = tempfile.mkstemp(dir=existing, prefix=".fcaudit-probe.", suffix=".tmp")
        os.close(fd)
        Path(probe).unlink(missing_ok=True)  # a rank that holds the lock may have cleaned it up already
    except OSError as e:
        where = "it" if existing == path else f"its parent {existing}"
        raise FcauditError(f"--out {path}: cannot write to {where} ({e.strerror}): pass a writable directory for the "
                           f"{what}") from None
    return path
