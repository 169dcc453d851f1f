"""Atomic writes (a file is either absent or complete, never half written) and output-directory checks."""

import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any, Callable

from fcaudit.errors import FcauditError

_UMASK = os.umask(0o022)
os.umask(_UMASK)

# atomic_write's temp files: "." + target name + "." + mkstemp's 8 random characters + ".tmp"
_TEMP = re.compile(r"^\..+\.[A-Za-z0-9_]{8}\.tmp$")


def atomic_write(path: str | os.PathLike, write: Callable[[Path], None]) -> Path:
    """Call write(tmp_path) on a temp file next to `path`, then rename it into place."""
    path = Path(path)
    if not path.parent.is_dir():  # a stat is far cheaper than mkdir's failing syscall on every write
        path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(Path(tmp))
        os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp creates 0600; give the file the permissions open() would
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """`atomic_write` of bytes already in memory: written through the temp file's own descriptor (the audit writes
    many small files, where opening the file a second time costs more than the write)."""
    path = Path(path)
    if not path.parent.is_dir():
        path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            os.fchmod(f.fileno(), 0o666 & ~_UMASK)  # mkstemp creates 0600; give the permissions open() would
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write_text(path: str | os.PathLike, text: str) -> Path:
    return write_bytes(path, text.encode())


def write_json(path: str | os.PathLike, obj: Any) -> Path:
    return write_text(path, json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


def read_json(path: str | os.PathLike) -> Any:
    return json.loads(Path(path).read_text())


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


def prepare_out(path: str | os.PathLike, what: str) -> Path:
    """Check, before any work, that `path` can become (or already is) a writable directory for the `what`.

    Creates nothing and deletes nothing: a file at `path`, a file among its parents, or a directory that cannot
    be written becomes one FcauditError naming the fix. Returns `path` as a Path.
    """
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise FcauditError(f"--out {path} is an existing file, not a directory: pass a directory for the {what} "
                           "(fcaudit does not overwrite files it did not write)")
    existing = path
    while not existing.exists():  # the nearest existing ancestor is where the first directory would be created
        if existing.parent == existing:
            break
        existing = existing.parent
    if existing.exists() and not existing.is_dir():
        raise FcauditError(f"--out {path} lies below the file {existing}: pass a directory path for the {what} "
                           "that is not inside a file")
    try:  # os.access ignores read-only mounts and is always true for root: really try to create a file
        fd, probe = tempfile.mkstemp(dir=existing, prefix=".fcaudit-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        where = "it" if existing == path else f"its parent {existing}"
        raise FcauditError(f"--out {path}: cannot write to {where} ({e.strerror}): pass a writable directory for the "
                           f"{what}") from None
    return path
