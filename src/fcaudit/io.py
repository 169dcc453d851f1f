"""Atomic writes: a file is either absent or complete, never half written."""

import json
import os
import tempfile
from pathlib import Path
from typing import Any, Callable

_UMASK = os.umask(0o022)
os.umask(_UMASK)


def atomic_write(path: str | os.PathLike, write: Callable[[Path], None]) -> Path:
    """Call write(tmp_path) on a temp file next to `path`, then rename it into place."""
    path = Path(path)
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


def write_text(path: str | os.PathLike, text: str) -> Path:
    return atomic_write(path, lambda p: p.write_text(text))


def write_json(path: str | os.PathLike, obj: Any) -> Path:
    return write_text(path, json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


def read_json(path: str | os.PathLike) -> Any:
    return json.loads(Path(path).read_text())
