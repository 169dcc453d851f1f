"""Atomic writes (a file is absent or complete, never half written) and the one rule for every command's --out:
fcaudit writes only into a directory that is new, empty or carries that command's marker, and deletes only what it
wrote there. `OutDir` is the one object that checks, claims and locks such a directory and writes its files. The
claim is the marker on disk, not a process's memory: every atomic write, replace and removal below a marked directory
refuses to go through a symbolic link, and in a directory whose command records its files replaces only recorded
ones, in whichever process (another rank, a worker, a nested command) it runs."""

import fcntl
import hashlib
import json
import math
import os
import re
import shutil
import stat
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from fcaudit.errors import FcauditError

_UMASK = os.umask(0o022)
os.umask(_UMASK)

# atomic_write's temp files ("." + target name + "." + mkstemp's random characters + ".tmp") and the probe's
_TEMP = re.compile(r"^\..+\.tmp$")


@contextmanager
def _replacing(path: Path) -> Iterator[tuple[int, str]]:
    """(descriptor, name) of a temp file next to `path`, with the permissions open() would give (mkstemp makes
    0600); renamed onto `path` when the block ends, removed when it raises."""
    held = _guard(path)
    _not_a_directory(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _record(path, held)  # before the rename: a file of ours is never left unrecorded, whatever kills the process
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~_UMASK)
        yield fd, tmp
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _not_a_directory(path: Path) -> None:
    """Refuse a directory where fcaudit writes or removes one of its files (a user's, or another program's)."""
    if path.is_dir() and not path.is_symlink():
        raise FcauditError(f"{path} is a directory where fcaudit writes a file: remove it and rerun the command")


def atomic_write(path: str | os.PathLike, write: Callable[[Path], None]) -> Path:
    """Call write(tmp_path) on a temp file next to `path`, then rename it into place."""
    path = Path(path)
    with _replacing(path) as (fd, tmp):
        os.close(fd)
        write(Path(tmp))
    return path


def write_bytes(path: str | os.PathLike, data: bytes | memoryview) -> Path:
    """`atomic_write` of bytes in memory, through the temp file's own descriptor (no second open per small file)."""
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


def json_sha256(obj: dict) -> str:
    """The hash of a JSON-able object: an audit config's identity, and the "_sha256" a hashed JSON file carries."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def write_json(path: str | os.PathLike, obj: Any, *, hashed: bool = False) -> Path:
    """Pretty, sorted JSON; non-finite numbers are written as null (`finite_json`). `hashed`: the object (a dict)
    also carries "_sha256" of what a reader will see of the rest, which the audit's readers check."""
    obj = finite_json(obj)
    if hashed:
        obj = json.loads(json.dumps({k: v for k, v in obj.items() if k != "_sha256"}, default=str))
        obj = {**obj, "_sha256": json_sha256(obj)}
    return write_text(path, json.dumps(obj, indent=2, sort_keys=True, default=str, allow_nan=False) + "\n")


def read_json(path: str | os.PathLike) -> Any:
    return json.loads(Path(path).read_text())


def read_object(path: str | os.PathLike, fix: str) -> dict:
    """The JSON object in `path`, a file a user may have edited (a checkpoint's metrics.json): one line naming `fix`
    when it does not parse or holds another type."""
    try:
        obj = read_json(path)
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
        raise FcauditError(f"{path} is not valid JSON ({type(e).__name__}): {fix}") from None
    if not isinstance(obj, dict):
        raise FcauditError(f"{path} holds a JSON {type(obj).__name__}, not an object: {fix}")
    return obj


NAME_MAX = 255  # bytes per file name on Linux's and macOS's filesystems
PATH_MAX = 4095  # bytes per path that Linux's system calls take


def valid_path(path: Any, what: str) -> Path:
    """`path` as a Path, or one line when it cannot name a file: not a str or os.PathLike, empty, holding a NUL byte,
    or a name (or the whole path) longer than the filesystem takes, whose error would otherwise come from inside a
    library."""
    if not isinstance(path, (str, os.PathLike)):
        raise FcauditError(f"{what} must be a path (a str or os.PathLike), got {type(path).__name__}")
    text = os.fspath(path)
    text = os.fsdecode(text) if isinstance(text, bytes) else text
    if not text:
        raise FcauditError(f"{what} is an empty path '': pass a directory or file name")
    if "\0" in text:
        raise FcauditError(f"{what} {text!r} holds a NUL byte, which no file name can: pass a path without it")
    if len(os.fsencode(text)) > PATH_MAX:
        raise FcauditError(f"{what} is {len(os.fsencode(text))} bytes long, more than a path can be ({PATH_MAX}): "
                           "pass a shorter one")
    if long := next((p for p in Path(text).parts if len(os.fsencode(p)) > NAME_MAX), None):
        size = len(os.fsencode(long))
        raise FcauditError(f"{what} holds the name {long[:24]}... of {size} bytes, "
                           f"more than a file name can be ({NAME_MAX}): pass a shorter one")
    return Path(text)


class Locked(FcauditError):
    """Another process holds a directory's lock."""


LOCK = ".lock"


# ---- the rule for output directories ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Command:
    marker: str  # the file that makes a directory this command's
    records: bool  # the marker lists every file written (commands whose set of files changes between runs)
    writes_marker: bool = True  # False: the command writes its own marker (the audit's holds its config hash)


# keyed by the name messages use ("... for the training run")
COMMANDS = {
    "audit": Command(".fcaudit-audit", records=False, writes_marker=False),
    "training run": Command(".fcaudit-train", records=False),
    "summary": Command(".fcaudit-summary", records=True),
    "execution results": Command(".fcaudit-execution", records=True),
    "report": Command(".fcaudit-report", records=True),
    "demo": Command(".fcaudit-demo", records=True),
}
MARKERS = {c.marker: what for what, c in COMMANDS.items()}
_CHECKPOINT_FILES = ("config.json", "model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")


def _ours(name: str) -> bool:
    """A name fcaudit leaves in any directory it writes: the lock and the temp files of a killed write."""
    return name == LOCK or bool(_TEMP.match(name))


def _kind_of(path: Path) -> str:
    """What a directory that is not ours holds, for the refusal."""
    names = set(os.listdir(path))
    other = next((MARKERS[n] for n in sorted(names) if n in MARKERS), None)
    if other is not None:
        return f"holds {'an' if other[0] in 'aeiou' else 'a'} {other}"
    if names & set(_CHECKPOINT_FILES):
        return "holds a checkpoint"
    theirs = sorted(n for n in names if not _ours(n))
    return f"holds files fcaudit did not write ({theirs[0]}{', ...' if len(theirs) > 1 else ''})"


def _regular(path: str | os.PathLike) -> bool:
    """A regular file itself, not a link to one."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def _first_link(root: Path) -> Path | None:
    """The first symbolic link anywhere below `root` (os.walk does not descend into linked directories)."""
    return next((Path(d) / n for d, dirs, files in os.walk(root) for n in sorted(dirs + files)
                 if os.path.islink(os.path.join(d, n))), None)


def _refused_by_name(path: Path, avoid: Iterable[str | os.PathLike]) -> str | None:
    real = path.resolve()
    if real == Path(real.anchor):
        return "is the filesystem root"
    if real == Path.home().resolve():
        return "is the home directory"
    for other in avoid:
        other = valid_path(other, "the checkpoint").expanduser()
        if other.exists() and (real == other.resolve() or other.resolve() in real.parents):
            return f"is {'inside ' if real != other.resolve() else ''}the checkpoint {other}"
    return None


def _claimed(path: str | os.PathLike) -> list[tuple[Path, str]]:
    """(directory, command) of every fcaudit directory holding `path`, outermost first: each of its parents that
    carries a command's marker. What claims a directory is its marker on disk, not a process's memory, so a nested
    command, another rank and a worker process are held to the same rule without being told."""
    held = []
    for parent in Path(os.path.abspath(path)).parents:
        what = next((w for m, w in MARKERS.items() if _regular(parent / m)), None)
        if what is not None:
            held.append((parent, what))
    return held[::-1]


def _guard(path: str | os.PathLike) -> list[tuple[Path, str]]:
    """Refuse `path` when it, or a directory between it and the outermost fcaudit directory holding it, is a
    symbolic link; else the fcaudit directories holding it (`_claimed`)."""
    held = _claimed(path)
    if not held:
        return held
    root, what = held[0]
    current = str(root)
    for part in Path(os.path.relpath(os.path.abspath(path), root)).parts:
        current = os.path.join(current, part)
        try:
            mode = os.lstat(current).st_mode
        except (FileNotFoundError, NotADirectoryError):
            break  # what is missing is created as a real directory or file
        if stat.S_ISLNK(mode):
            raise FcauditError(f"{current} is a symbolic link inside the {what} directory {root}: fcaudit never "
                               "writes through links there; remove it or pass a new --out")
    return held


def _listed(root: Path, what: str) -> set[str]:
    """The files the marker of `root` (a command that records them) lists."""
    try:
        listed = json.loads((root / COMMANDS[what].marker).read_text()).get("files", [])
    except (OSError, ValueError, AttributeError):
        return set()
    return {str(f) for f in listed} if isinstance(listed, list) else set()


def _recording(path: Path, held: list[tuple[Path, str]]) -> tuple[Path, str, str, set[str]] | None:
    """(directory, command, `path` relative to it, its recorded files) of the innermost of the fcaudit directories
    `held` holding `path` when that command records its files; None for a marker (its own directory's, not a file of
    the one holding it)."""
    if not held or path.name in MARKERS or not COMMANDS[held[-1][1]].records:
        return None
    root, what = held[-1]
    return root, what, os.path.relpath(os.path.abspath(path), root), _listed(root, what)


def _save(root: Path, what: str, files: set[str] | None) -> None:
    """Write the marker of `root`, listing `files` (None: a command that records none; the marker is not listed)."""
    body = {"command": what} if files is None else {"command": what, "files": sorted(files)}
    write_text(root / COMMANDS[what].marker, json.dumps(body, indent=2) + "\n")


def _record(path: Path, held: list[tuple[Path, str]]) -> None:
    """Add `path` to its recording directory's marker before it is written; a file already there that fcaudit did
    not record is never replaced."""
    recording = _recording(path, held)
    if recording is None or recording[2] in recording[3]:
        return
    root, what, rel, files = recording
    if os.path.lexists(path):
        raise FcauditError(f"{path} is not a file fcaudit wrote (its directory's {COMMANDS[what].marker} does not "
                           "list it): move it away or pass a new --out")
    _save(root, what, files | {rel})


def remove_file(path: str | os.PathLike) -> bool:
    """Delete `path` if fcaudit may: never through a link (`_guard`), and in a directory whose command records its
    files only a recorded one. Returns whether a file was deleted."""
    path = Path(path)
    held = _guard(path)
    _not_a_directory(path)
    recording = _recording(path, held)
    if recording is not None and recording[2] not in recording[3]:
        return False
    removed = os.path.lexists(path)
    path.unlink(missing_ok=True)
    if recording is not None:
        root, what, rel, files = recording
        _save(root, what, files - {rel})
    return removed


def remove_tree(path: str | os.PathLike) -> None:
    """shutil.rmtree(path, ignore_errors=True), but never of a link or through one (`_guard`); rmtree itself does
    not follow the links below it."""
    path = Path(path)
    _guard(path)
    if os.path.islink(path):
        raise FcauditError(f"{path} is a symbolic link: fcaudit never deletes through links; remove it and rerun")
    shutil.rmtree(path, ignore_errors=True)


def remove_stale_temps(directory: str | os.PathLike, recursive: bool = False) -> list[Path]:
    """Delete and return the temp files (atomic_write's own name pattern only) an interrupted write left in
    `directory`, and with `recursive` below it (links not followed)."""
    directory = Path(directory)
    if not directory.is_dir() or directory.is_symlink():
        return []
    stale = []
    for dirpath, dirnames, filenames in os.walk(directory):
        stale += [Path(dirpath) / n for n in sorted(filenames) if _TEMP.match(n) and _regular(os.path.join(dirpath, n))]
        if not recursive:
            break
    for p in stale:
        _guard(p)
        p.unlink(missing_ok=True)
    return stale


class OutDir:
    """A command's output directory: the one object that checks it may become the command's (new, empty or carrying
    the command's marker; not the root, home, a checkpoint, a file or a link's target), claims it, locks it,
    and writes, records and removes the command's files in it. Its only state is its path and its lock: the claim
    is the marker on disk, which every atomic write below it reads (`_claimed`)."""

    def __init__(self, path: Any, what: str):
        self.root = valid_path(path, "--out")
        self.what, self.command = what, COMMANDS[what]
        self._lock: int | None = None

    def __repr__(self) -> str:
        return f"OutDir({str(self.root)!r}, {self.what!r})"

    def check(self, *, avoid: Iterable[str | os.PathLike] = ()) -> "OutDir":
        """Check, before any work and changing nothing, that the directory can become (or is) the command's (and is
        not a checkpoint of `avoid` nor inside one): refused in one line naming the fix otherwise."""
        path, what = self.root, self.what
        _guard(path)  # inside another fcaudit directory (a demo's), not below a link planted there
        named = _refused_by_name(path, avoid)
        if named is not None:
            raise FcauditError(f"--out {path} {named}: pass a directory of its own for the {what}")
        if path.is_symlink() and not path.exists():
            raise FcauditError(f"--out {path} is a broken symbolic link: pass a directory for the {what}")
        if path.exists() and not path.is_dir():
            raise FcauditError(f"--out {path} is an existing file, not a directory: pass a directory for the {what} "
                               "(fcaudit does not overwrite files it did not write)")
        if path.is_dir():
            if not _regular(path / self.command.marker) and not all(_ours(n) for n in os.listdir(path)):
                raise FcauditError(f"--out {path} is not an fcaudit {what} directory (it {_kind_of(path)}): pass a new "
                                   f"or empty directory for the {what}")
            link = _first_link(path)
            if link is not None:
                raise FcauditError(f"{link} is a symbolic link inside the {what} directory {path}: fcaudit never "
                                   "writes through links there; remove it or pass a new --out")
        existing = next((p for p in (path, *path.parents) if p.exists()), path)
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
            raise FcauditError(f"--out {path}: cannot write to {where} ({e.strerror}): pass a writable directory for "
                               f"the {what}") from None
        return self

    def claim(self) -> "OutDir":
        """`check`, then make the directory the command's: created and marked (unless the command writes its own
        marker); called where its first file is written."""
        self.check()
        self.root.mkdir(parents=True, exist_ok=True)
        if self.command.writes_marker and not os.path.lexists(self.root / self.command.marker):
            _save(self.root, self.what, set() if self.command.records else None)
        return self

    def lock(self) -> "OutDir":
        """`claim`, then take the directory's exclusive lock, or fail at once: two processes must never write one
        directory. The lock (never opened through a link) is held until `unlock` or the process ends."""
        self.claim()
        path = self.root / LOCK
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        except OSError as e:
            raise FcauditError(f"{path} cannot be opened as a lock ({e.strerror}; fcaudit never follows a link "
                               "there): remove it or pass a new --out") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise Locked(f"{self.root} is being written by another fcaudit process ({holder}); wait for it to finish "
                         f"or pass another --out for the {self.what}") from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise FcauditError(f"{path} is not a regular file: remove it or pass a new --out")
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()}".encode(), 0)
        self._lock = fd
        return self

    def unlock(self) -> None:
        if self._lock is not None:
            os.close(self._lock)  # closing releases the flock
            self._lock = None

    def __enter__(self) -> "OutDir":
        return self.lock()

    def __exit__(self, *exc) -> None:
        self.unlock()

    def recorded(self) -> list[Path]:
        """The files fcaudit recorded writing here (for a command that records them)."""
        if not self.command.records or not _regular(self.root / self.command.marker):
            return []
        return [self.root / f for f in sorted(_listed(self.root, self.what))]

    def _inside(self, path: str | os.PathLike) -> Path:
        """`path` (a path below the directory, as its command names it) when it is inside: a command writes only into
        its own directory."""
        path, root = Path(path), os.path.abspath(self.root)
        if os.path.abspath(path) != root and Path(root) not in Path(os.path.abspath(path)).parents:
            raise ValueError(f"{path} is outside the {self.what} directory {self.root}")
        return path

    def write_bytes(self, path: str | os.PathLike, data: bytes | memoryview) -> Path:
        return write_bytes(self._inside(path), data)

    def write_text(self, path: str | os.PathLike, text: str) -> Path:
        return write_text(self._inside(path), text)

    def write_json(self, path: str | os.PathLike, obj: Any, *, hashed: bool = False) -> Path:
        return write_json(self._inside(path), obj, hashed=hashed)

    def atomic_write(self, path: str | os.PathLike, write: Callable[[Path], None]) -> Path:
        return atomic_write(self._inside(path), write)

    def remove_file(self, path: str | os.PathLike) -> bool:
        return remove_file(self._inside(path))

    def remove_tree(self, path: str | os.PathLike) -> None:
        remove_tree(self._inside(path))
