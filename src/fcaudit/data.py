"""Corpora (train / validation / test arrays of byte or tokenizer ids) and the paper's windows: fixed-length,
non-overlapping, seeded; evaluation windows from the test split, calibration windows from the validation split.
The default corpus, "embedded", is the running interpreter's standard library source (PSF License): several MB of
real text on every machine, no download, each file in a split by a stable hash of its path.
"""

from __future__ import annotations

import functools
import hashlib
import os
import sys
import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from fcaudit.errors import FcauditError
from fcaudit.hub import hub_reachable, offline_mode
from fcaudit.io import valid_path
from fcaudit.tokens import encode

PSEUDO = ("/proc", "/sys", "/dev")  # filesystems of the kernel's, whose files are no text
EMBEDDED_BYTES = 8_000_000  # cap: ~8 MB keeps loading under a second and leaves ~400 KB per held-out split
_SKIP_DIRS = {"test", "tests", "idlelib", "site-packages", "__pycache__", "lib2to3"}
_HELD_OUT = 20  # 1 file in 20 to validation, 1 in 20 to test (by path hash)
SPLITS = ("train", "validation", "test")

# name -> (datasets path, config); a corpus without validation and test splits is split by document hash
HF_CORPORA = {
    "wikitext-103": ("Salesforce/wikitext", "wikitext-103-raw-v1"),
    "openwebtext": ("Skylion007/openwebtext", None),
}


@dataclass(frozen=True)
class Corpus:
    name: str
    train: np.ndarray
    validation: np.ndarray
    test: np.ndarray
    vocab_size: int
    license: str
    source: str
    fingerprint: str = ""

    def describe(self) -> dict:
        return {"name": self.name, "source": self.source, "license": self.license, "vocab_size": self.vocab_size,
                "fingerprint": self.fingerprint, "tokens": {s: len(getattr(self, s)) for s in SPLITS}}


@dataclass(frozen=True)
class WindowSet:
    """N windows of T token ids; `starts` are offsets into `split` of the corpus they came from."""

    ids: torch.Tensor
    starts: np.ndarray
    split: str

    def __len__(self) -> int:
        return self.ids.shape[0]


def _fingerprint(*arrays: np.ndarray) -> str:
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(a))
        h.update(b"|")
    return h.hexdigest()[:16]


def _split_by_path(named_texts: list[tuple[str, bytes]]) -> tuple[bytes, bytes, bytes]:
    """Whole files to splits by a stable hash of their path (no file straddles two splits)."""
    parts: dict[str, list[bytes]] = {"train": [], "validation": [], "test": []}
    for name, text in named_texts:
        bucket = zlib.crc32(name.encode()) % _HELD_OUT
        parts["validation" if bucket == 0 else "test" if bucket == 1 else "train"].append(text)
    return tuple(b"".join(parts[s]) for s in ("train", "validation", "test"))  # type: ignore[return-value]


def _split_contiguous(text: bytes) -> tuple[bytes, bytes, bytes]:
    """One file: the first 90% trains, the next 5% validates, the last 5% tests."""
    a, b = int(len(text) * 0.90), int(len(text) * 0.95)
    return text[:a], text[a:b], text[b:]


@functools.lru_cache(maxsize=1)  # read once per process: the demo and the tests load it many times
def _embedded_texts() -> tuple[tuple[str, bytes], ...]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if not _SKIP_DIRS.intersection(p.relative_to(root).parts))
    out, total = [], 0
    for p in files:
        rel = p.relative_to(root).as_posix()
        text = f"# file: {rel}\n".encode() + p.read_bytes()
        out.append((rel, text))
        total += len(text)
        if total >= EMBEDDED_BYTES:
            break
    return tuple(out)


BYTES = 256  # a byte-level model's vocabulary: its token ids are the text's bytes


def _encode(texts: tuple[bytes, bytes, bytes], tokenizer, splits: tuple[str, ...]) -> tuple[list[np.ndarray], int]:
    """Bytes are their own ids; a tokenizer encodes only the splits asked for (BPE over WikiText-103's train
    split takes minutes, and an audit needs only validation and test)."""
    if tokenizer is None:
        return [np.frombuffer(t, dtype=np.uint8).copy() if s in splits else np.zeros(0, np.uint8)
                for s, t in zip(SPLITS, texts)], BYTES
    raw = {s: t for s, t in zip(SPLITS, texts) if s in splits}
    decoded = {s: t.decode("utf-8", errors="replace") for s, t in raw.items()}
    # replacement characters decoding added (not those the text holds as such)
    bad = sum(decoded[s].count("\ufffd") - t.decode("utf-8", errors="ignore").count("\ufffd") for s, t in raw.items())
    if bad:  # e.g. Latin-1 text: the tokenizer sees U+FFFD where each such byte was
        print(f"note: the corpus holds {bad} bytes that are not UTF-8; the tokenizer reads each as U+FFFD (convert "
              "the text to UTF-8 to keep them)", file=sys.stderr)
    arrays = [encode(tokenizer, decoded[s].splitlines(keepends=True)).astype(np.int32)
              if s in splits else np.zeros(0, np.int32) for s, t in zip(SPLITS, texts)]
    return arrays, int(tokenizer.get_vocab_size())


def _pseudo(path: Path) -> bool:
    """In /proc, /sys or /dev (also through a link): files that can be endless or block."""
    real = path.resolve()
    return any(real == Path(d) or Path(d) in real.parents for d in PSEUDO)


def _is_binary(text: bytes) -> bool:
    return b"\0" in text[:8000]  # git's test: a NUL byte early on


def _hf_texts(name: str) -> tuple[bytes, bytes, bytes]:
    path, config = HF_CORPORA[name]
    try:  # before the hub is asked: the fix is an install, not a network
        import datasets
    except ImportError:
        raise FcauditError(f"corpus {name!r} needs the datasets package: pip install datasets (or pass a local text "
                           "file or directory with --corpus PATH)") from None
    if not offline_mode() and not hub_reachable():
        raise FcauditError(
            f"corpus {name!r} needs the Hugging Face hub, which is unreachable; pass a local text file or directory "
            f"with --corpus PATH (or set HF_HUB_OFFLINE=1 to use a cached copy)")
    try:  # a dataset's loading script never runs: datasets>=4 runs none, older ones are told not to
        ds = datasets.load_dataset(path, config, trust_remote_code=False)
    except Exception as e:  # datasets raises many types for "not cached / not reachable"
        raise FcauditError(f"could not load {name!r} through datasets ({type(e).__name__}); pass a local text file "
                           f"or directory with --corpus PATH") from None
    if name == "wikitext-103":
        return tuple("".join(ds[s]["text"]).encode() for s in ("train", "validation", "test"))  # type: ignore[return-value]
    # OpenWebText has only a train split: documents go to splits by a stable hash of their index.
    docs = ds["train"]["text"]
    return _split_by_path([(str(i), d.encode() + b"\n") for i, d in enumerate(docs)])


def load_corpus(name: str = "embedded", tokenizer=None, splits: tuple[str, ...] = SPLITS) -> Corpus:
    """The embedded corpus, a local file or directory, or a hub corpus (wikitext-103, openwebtext); splits not in
    `splits` are left empty (an audit needs only validation and test)."""
    if not isinstance(name, (str, os.PathLike)):
        raise FcauditError(f"corpus must be a name or a path, got {type(name).__name__}: e.g. 'embedded'")
    name = os.fspath(name)
    if name == "embedded":
        texts = _split_by_path(_embedded_texts())
        source = f"Python {sysconfig.get_python_version()} standard library source ({sysconfig.get_paths()['stdlib']})"
        license = "PSF License Agreement (Python standard library; see LICENSE.txt beside the stdlib)"
    elif name in HF_CORPORA:
        texts = _hf_texts(name)
        source, license = f"huggingface:{HF_CORPORA[name][0]}", "see the dataset card"
    else:
        path = valid_path(name, "--corpus")
        if not path.exists():
            raise FcauditError(f"unknown corpus {name!r}; use 'embedded', {', '.join(HF_CORPORA)}, or a path to a "
                               f"text file or directory")
        if _pseudo(path) or path.resolve() == Path(path.resolve().anchor):
            raise FcauditError(f"corpus {path} is the filesystem root or in {', '.join(PSEUDO)}, "
                               "which hold no text to read (their files can be endless or block): point --corpus at "
                               "text files")
        if not (path.is_dir() or path.is_file()):  # a FIFO blocks the read, a device never ends
            raise FcauditError(f"corpus {path} is not a regular file or a directory (a device, a pipe or a socket): "
                               "point --corpus at text files")
        if path.is_dir():
            # hidden files and directories (.git, .cache) and binary files are not text the user meant
            files = sorted(p for p in path.rglob("*") if p.is_file() and not _pseudo(p)
                           and not any(part.startswith(".") for part in p.relative_to(path).parts))
            named = [(p.relative_to(path).as_posix(), p.read_bytes()) for p in files]
            binary = {n for n, t in named if _is_binary(t)}
            text = [(n, t) for n, t in named if n not in binary]
            if binary:
                print(f"note: corpus {path}: {len(binary)} binary file(s) left out (e.g. {min(binary)})",
                      file=sys.stderr)
            if not text:
                raise FcauditError(f"corpus directory {path} holds no text files (hidden and binary files are not "
                                   "read); point --corpus at text files")
            texts = _split_by_path(text)  # too few files for both held-out splits: joined, then split 90/5/5
            if not (texts[1] and texts[2]):
                texts = _split_contiguous(b"".join(t for _, t in text))
        else:
            raw = path.read_bytes()
            if _is_binary(raw):  # as a binary file inside a corpus directory is left out: then nothing is left
                raise FcauditError(f"corpus file {path} is binary (a NUL byte in its first 8000 bytes), not text: "
                                   "point --corpus at a text file or directory")
            texts = _split_contiguous(raw)
        source, license = f"local:{path.resolve()}", "as stated by the files' owner"
    arrays, vocab = _encode(texts, tokenizer, splits)
    for split, a in zip(SPLITS, arrays):
        if split in splits and len(a) == 0:
            raise FcauditError(f"corpus {name!r} has an empty {split} split; give it more text (at least a few files)")
    return Corpus(name, *arrays, vocab_size=vocab, license=license, source=source, fingerprint=_fingerprint(*arrays))


def _slots(tokens: np.ndarray, window: int, split: str = "") -> int:
    """How many non-overlapping windows fit in a split (at least one, or a one-line error)."""
    if len(tokens) < window:
        raise FcauditError(f"window {window} is longer than the {split + ' ' if split else ''}split ({len(tokens)} "
                           "tokens); use a shorter --window")
    return len(tokens) // window


def make_windows(tokens: np.ndarray, n: int, window: int, seed: int, split: str,
                 avoid: frozenset[bytes] | None = None) -> WindowSet:
    """n non-overlapping windows of `window` tokens at seeded random slots of one split (n, window: checked by the
    callers' configs); with `avoid`, their texts distinct and none in it. A corpus whose text repeats (the embedded
    one holds tables that several files share) would otherwise give an audit a window twice, which it refuses: a slot
    whose text is taken gives way to the next one the same generator draws, so the draw is unchanged wherever nothing
    repeats."""
    slots = _slots(tokens, window, split)
    if n > slots:
        raise FcauditError(f"the {split} split has room for {slots} non-overlapping windows of {window} tokens, "
                           f"not {n}; lower the window count or --window")
    rng = np.random.default_rng([seed, zlib.crc32(split.encode())])
    offset = int(rng.integers(0, len(tokens) - slots * window + 1))
    text = lambda slot: tokens[slot * window + offset:(slot + 1) * window + offset].tobytes()  # noqa: E731
    chosen = rng.choice(slots, size=n, replace=False)
    if avoid is None:
        return _windows_at(tokens, chosen, window, offset, split)
    seen, kept = set(avoid), []
    for slot in chosen:
        if (t := text(slot)) not in seen:
            seen.add(t)
            kept.append(slot)
    if len(kept) < n:  # the rest drawn in the same generator's order from the slots not drawn yet
        for slot in rng.permutation(np.setdiff1d(np.arange(slots), chosen)):
            if (t := text(slot)) not in seen:
                seen.add(t)
                kept.append(slot)
                if len(kept) == n:
                    break
        else:
            raise FcauditError(f"the {split} split has only {len(kept)} window(s) of {window} tokens whose text is "
                               f"distinct{' from the evaluation windows' if avoid else ''}, not {n}; lower the window "
                               "count or use a larger corpus")
    return _windows_at(tokens, np.asarray(kept), window, offset, split)


def _windows_at(tokens: np.ndarray, slots: np.ndarray, window: int, offset: int, split: str) -> WindowSet:
    starts = np.sort(slots) * window + offset
    ids = torch.from_numpy(np.stack([tokens[s:s + window] for s in starts]).astype(np.int64))
    return WindowSet(ids, starts.astype(np.int64), split)


def audit_windows(corpus: Corpus, n_eval: int, n_calib: int, window: int, seed: int) -> tuple[WindowSet, WindowSet]:
    """Evaluation windows from the test split, calibration windows from the validation split (as in the paper), no
    text twice: a calibration window equal to an evaluation window would make the static profiles hold its own
    coefficients."""
    ev = make_windows(corpus.test, n_eval, window, seed, "test", avoid=frozenset())
    texts = frozenset(corpus.test[s:s + window].tobytes() for s in ev.starts)
    return ev, make_windows(corpus.validation, n_calib, window, seed, "validation", avoid=texts)


def all_windows(tokens: np.ndarray, window: int, limit: int | None = None) -> torch.Tensor:
    """Contiguous non-overlapping windows covering a split from its start (Byte-PPL evaluation)."""
    n = _slots(tokens, window) if limit is None else min(_slots(tokens, window), limit)
    return torch.from_numpy(tokens[: n * window].astype(np.int64).reshape(n, window))


def random_batch(tokens: np.ndarray, batch_size: int, window: int, rng: np.random.Generator) -> torch.Tensor:
    """Training batch of windows at uniformly random offsets."""
    _slots(tokens, window)
    starts = rng.integers(0, len(tokens) - window + 1, size=batch_size)
    return torch.from_numpy(np.stack([tokens[s:s + window] for s in starts]).astype(np.int64))
