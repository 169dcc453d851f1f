"""Tokenizers for subword checkpoints (MUDDPythia uses the Pythia / GPT-NeoX BPE), through `tokenizers`; byte-level
models need none (their token ids are the bytes, fcaudit.data)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from fcaudit.errors import FcauditError
from fcaudit.hub import is_hub_id, snapshot


def load_tokenizer(dir_or_hub_id: str | os.PathLike, revision: str | None = None) -> Tokenizer:
    """`tokenizer.json` from a checkpoint directory, the file itself, or a hub repo (at `revision`)."""
    path = Path(dir_or_hub_id).expanduser()
    if path.is_file():
        return _from_file(path)
    if path.is_dir():
        if not (path / "tokenizer.json").exists():
            raise FcauditError(f"no tokenizer.json in {path}: copy the checkpoint's tokenizer.json there "
                               f"(for MUDDPythia, the Pythia tokenizer from EleutherAI/pythia-1.4b)")
        return _from_file(path / "tokenizer.json")
    name = str(dir_or_hub_id)
    if not is_hub_id(name):
        raise FcauditError(f"no tokenizer at {name!r}: pass a checkpoint directory with tokenizer.json "
                           f"or a Hugging Face hub id")
    file = snapshot(name, revision, ["tokenizer.json"]) / "tokenizer.json"
    if not file.is_file():
        raise FcauditError(f"hub repo {name} has no tokenizer.json: pass a directory holding the matching "
                           f"tokenizer.json instead")
    return _from_file(file)


def _from_file(path: Path) -> Tokenizer:
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:
        raise FcauditError(f"{path} is not a tokenizers JSON file ({type(e).__name__}): use the checkpoint's "
                           f"tokenizer.json") from None


def encode(tokenizer: Tokenizer, texts: str | list[str]) -> np.ndarray:
    """Encode texts (e.g. the lines of a WikiText split) into one contiguous int64 id stream: lines in parallel
    batches without special tokens, concatenated in order (the ids fitting the model are checked with the windows)."""
    if isinstance(texts, str):
        texts = [texts]
    encodings = tokenizer.encode_batch(list(texts), add_special_tokens=False)
    return np.fromiter((i for e in encodings for i in e.ids), dtype=np.int64)
