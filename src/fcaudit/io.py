"""Atomic writes (a file is absent or complete, never half written) and the one rule for every command's --out:
fcaudit writes only into a directory that is new, empty or carries that command's marker, and deletes only what it
wrote there. No write, replace, lock or removal inside a claimed directory goes through a symbolic link, so a link
planted in it cannot make fcaudit touch a file outside."""

import fcntl
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
from typing import Any, BinaryIO, Callable, Iterable, Iterator

from fcaudit.errors import FcauditError

_UMASK = os.umask(0o022)
os.umask(_UMASK)

# atomic_write's temp files ("." + target name + "." + mkstemp's random characters + ".tmp") and the probe's
_TEMP = re.compile(r"^\..+\.tmp$")


@contextmanager
def _replacing(path: Path) -> Iterator[tuple[int, str]]:
    """(descriptor, name) of a temp file next to `path`, with the permissions open() would give (mkstemp makes
    0600); renamed onto `path` when the block ends, removed when it raises."""
    _guard(path)
    _not_a_directory(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _record(path)  # before the rename: a file of ours is never left unrecorded, whatever kills the process
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


def write_json(path: str | os.PathLike, obj: Any) -> Path:
    """Pretty, sorted JSON; non-finite numbers are written as null (`finite_json`)."""
    return write_text(path, json.dumps(finite_json(obj), indent=2, sort_keys=True, default=str, allow_nan=False)
                      + "\n")


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
    legacy: str | None = None  # the file by which a directory without its marker is recognized (an older fcaudit's)
    legacy_keys: tuple[str, ...] = ()  # the JSON keys that file must hold (an audit's config.json: no checkpoint's)


# keyed by the name messages use ("... for the training run")
COMMANDS = {
    # an audit whose marker was lost is recognized by its config.json, which it rewrites the marker from
    "audit": Command(".fcaudit-audit", records=False, writes_marker=False, legacy="config.json",
                     legacy_keys=("config_hash", "windows", "controller", "_sha256")),
    "training run": Command(".fcaudit-train", records=False, legacy="train_config.json"),
    "summary": Command(".fcaudit-summary", records=True),
    "execution results": Command(".fcaudit-execution", records=True),
    "report": Command(".fcaudit-report", records=True),
    "demo": Command(".fcaudit-demo", records=True),
}
MARKERS = {c.marker: what for what, c in COMMANDS.items()}
_CHECKPOINT_FILES = ("config.json", "model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")


@dataclass
class _Claim:
    root: Path  # absolute, as given
    what: str
    files: set[str] | None  # recorded files (relative paths), None for a command that records none


_CLAIMS: dict[str, _Claim] = {}  # this process's claimed directories, by absolute path (as given and resolved)


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


def _marked(path: Path, command: Command) -> bool:
    """Whether directory `path` is the command's: its marker, or the legacy file holding the legacy keys."""
    if _regular(path / command.marker):
        return True
    if command.legacy is None or not _regular(path / command.legacy):
        return False
    if not command.legacy_keys:
        return True
    try:
        obj = json.loads((path / command.legacy).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(obj, dict) and all(k in obj for k in command.legacy_keys)


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


def prepare_out(path: str | os.PathLike, what: str, *, avoid: Iterable[str | os.PathLike] = ()) -> Path:
    """Check, before any work and changing nothing, that `path` can become (or is) the `what`'s output directory:
    refused in one line naming the fix when it is the root, home, in a checkpoint of `avoid`, a file or below one,
    unwritable, another's directory, or ours holding a symbolic link."""
    command = COMMANDS[what]
    path = valid_path(path, "--out")
    named = _refused_by_name(path, avoid)
    if named is not None:
        raise FcauditError(f"--out {path} {named}: pass a directory of its own for the {what}")
    if path.is_symlink() and not path.exists():
        raise FcauditError(f"--out {path} is a broken symbolic link: pass a directory for the {what}")
    if path.exists() and not path.is_dir():
        raise FcauditError(f"--out {path} is an existing file, not a directory: pass a directory for the {what} "
                           "(fcaudit does not overwrite files it did not write)")
    if path.is_dir():
        if not _marked(path, command) and not all(_ours(n) for n in os.listdir(path)):
            raise FcauditError(f"--out {path} is not an fcaudit {what} directory (it {_kind_of(path)}): pass a new or "
                               f"empty directory for the {what}")
        link = _first_link(path)
        if link is not None:
            raise FcauditError(f"{link} is a symbolic link inside the {what} directory {path}: fcaudit never writes "
                               "through links there; remove it or pass a new --out")
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
        raise FcauditError(f"--out {path}: cannot write to {where} ({e.strerror}): pass a writable directory for the "
                           f"{what}") from None
    return path


def claim_out(path: str | os.PathLike, what: str, *, avoid: Iterable[str | os.PathLike] = ()) -> Path:
    """`prepare_out`, then make `path` the `what`'s directory, created, marked (unless the command writes its own
    marker) and `confine`d; called where the first file is written."""
    command = COMMANDS[what]
    path = prepare_out(path, what, avoid=avoid)
    path.mkdir(parents=True, exist_ok=True)
    fresh = command.writes_marker and not os.path.lexists(path / command.marker)
    claim = confine(path, what)  # read again: the directory may have been deleted and made anew since an earlier claim
    if fresh:
        _save(claim)
    return path


def confine(root: str | os.PathLike, what: str) -> _Claim:
    """From now on, no write, replace, lock or removal below `root` goes through a symbolic link, and for a command
    that records its files, only recorded files are replaced or removed (the record is read from its marker)."""
    absolute = Path(os.path.abspath(root))
    command = COMMANDS[what]
    files: set[str] | None = None
    if command.records:
        try:
            listed = json.loads((absolute / command.marker).read_text()).get("files", [])
            files = {str(f) for f in listed} if isinstance(listed, list) else set()
        except (OSError, ValueError, AttributeError):
            files = set()
    claim = _Claim(absolute, what, files)
    for key in {str(absolute), os.path.realpath(absolute)}:
        _CLAIMS[key] = claim
    return claim


def _claims_of(path: Path) -> list[tuple[str, _Claim]]:
    """(root key, claim) of every claimed directory that holds `path`, outermost first."""
    text = os.path.abspath(path)
    return sorted(((k, c) for k, c in _CLAIMS.items() if text == k or text.startswith(k.rstrip(os.sep) + os.sep)),
                  key=lambda kc: len(kc[0]))


def _guard(path: str | os.PathLike) -> None:
    """Refuse `path` when it, or a directory between it and a claimed directory holding it, is a symbolic link."""
    text = os.path.abspath(path)
    for key, claim in _claims_of(Path(text)):
        current = key
        for part in Path(os.path.relpath(text, key)).parts if text != key else ():
            current = os.path.join(current, part)
            try:
                mode = os.lstat(current).st_mode
            except (FileNotFoundError, NotADirectoryError):
                break  # what is missing is created as a real directory or file
            if stat.S_ISLNK(mode):
                raise FcauditError(f"{current} is a symbolic link inside the {claim.what} directory {claim.root}: "
                                   "fcaudit never writes through links there; remove it or pass a new --out")


def _recording(path: Path) -> tuple[_Claim, str] | None:
    """The innermost claimed directory holding `path`, with `path` relative to it, when that command records files."""
    held = _claims_of(path)
    if not held:
        return None
    key, claim = held[-1]
    rel = os.path.relpath(os.path.abspath(path), key)
    if claim.files is None or rel == COMMANDS[claim.what].marker:
        return None
    return claim, rel


def _save(claim: _Claim) -> None:
    """Write the claim's marker, listing the files recorded so far (the marker is not recorded in itself)."""
    body = {"command": claim.what} if claim.files is None else {"command": claim.what, "files": sorted(claim.files)}
    write_text(claim.root / COMMANDS[claim.what].marker, json.dumps(body, indent=2) + "\n")


def _record(path: Path) -> None:
    """Add `path` to its recording directory's marker before it is written; a file already there that fcaudit did
    not record is never replaced."""
    claim, rel = _recording(path) or (None, "")
    if claim is None or rel in claim.files:
        return
    if os.path.lexists(path):
        raise FcauditError(f"{path} is not a file fcaudit wrote (its directory's {COMMANDS[claim.what].marker} does "
                           "not list it): move it away or pass a new --out")
    claim.files.add(rel)
    _save(claim)


def recorded(root: str | os.PathLike) -> list[Path]:
    """The files fcaudit recorded writing into the claimed directory `root` (for a command that records them)."""
    claim = _CLAIMS.get(os.path.abspath(root))
    return [claim.root / f for f in sorted(claim.files or ())] if claim is not None else []


def remove_file(path: str | os.PathLike) -> bool:
    """Delete `path` if fcaudit may: never through a link (`_guard`), and in a directory whose command records its
    files only a recorded one. Returns whether a file was deleted."""
    path = Path(path)
    _guard(path)
    _not_a_directory(path)
    claim, rel = _recording(path) or (None, "")
    if claim is not None and rel not in claim.files:
        return False
    removed = os.path.lexists(path)
    path.unlink(missing_ok=True)
    if claim is not None:
        claim.files.discard(rel)
        _save(claim)
    return removed


def remove_tree(path: str | os.PathLike) -> None:
    """shutil.rmtree(path, ignore_errors=True), but never of a link or through one (`_guard`); rmtree itself does
    not follow the links below it."""
    path = Path(path)
    _guard(path)
    if os.path.islink(path):
        raise FcauditError(f"{path} is a symbolic link: fcaudit never deletes through links; remove it and rerun")
    shutil.rmtree(path, ignore_errors=True)


def lock_dir(path: str | os.PathLike, what: str) -> int:
    """Claim directory `path` for the `what` (`claim_out`) and take its exclusive lock, or fail at once: two
    processes must never write one directory. Returns the lock's descriptor (never opened through a link); closing
    it, or the process ending however it ends, releases the lock."""
    path = claim_out(path, what)
    try:
        fd = os.open(path / LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError as e:
        raise FcauditError(f"{path / LOCK} cannot be opened as a lock ({e.strerror}; fcaudit never follows a link "
                           "there): remove it or pass a new --out") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "another process"
        os.close(fd)
        raise Locked(f"{path} is being written by another fcaudit process ({holder}); wait for it to finish or pass "
                     f"another --out for the {what}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise FcauditError(f"{path / LOCK} is not a regular file: remove it or pass a new --out")
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()}".encode(), 0)
    return fd


def locked(path: str | os.PathLike, what: str) -> BinaryIO:
    """`lock_dir` for the duration of a `with` block: the lock file, held while it is open."""
    return os.fdopen(lock_dir(path, what), "rb")


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
