"""The Hugging Face hub: the one resolver of hub ids, failing fast and clearly offline instead of retrying for half a
minute. Checkpoints, tokenizers and corpora all come through here."""

from __future__ import annotations

import os
import socket
from functools import cache
from pathlib import Path

from fcaudit.errors import FcauditError
from fcaudit.io import valid_path

HUB_HOST = "huggingface.co"
# What fcaudit reads from a checkpoint repo, never a .py file (no checkpoint code runs, so none is fetched);
# pickle-era .bin weights only when a repo has no safetensors, read through torch's restricted unpickler.
CHECKPOINT_FILES = ["config.json", "generation_config.json", "*.safetensors", "*.safetensors.index.json",
                    "tokenizer*.json", "tokenizer.model", "special_tokens_map.json", "vocab.json", "merges.txt"]
PICKLE_FALLBACK = ["pytorch_model*.bin", "*.bin.index.json"]


def offline_mode() -> bool:
    return any(os.environ.get(v, "").lower() in ("1", "true", "yes") for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))


@cache
def hub_reachable() -> bool:
    """One TCP connect to the hub (3 s at most); False under HF_HUB_OFFLINE=1 or without network."""
    if offline_mode():
        return False
    try:
        with socket.create_connection((HUB_HOST, 443), timeout=3.0):
            return True
    except OSError:
        return False


def is_hub_id(name: str) -> bool:
    return name.count("/") == 1 and not name.startswith((".", "/", "~")) and not Path(name).expanduser().exists()


def snapshot(repo_id: str, revision: str | None, patterns: list[str]) -> Path:
    """The files of `repo_id` matching `patterns` in the local HF cache, downloaded when the hub is reachable."""
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=patterns,
                                      local_files_only=not hub_reachable()))
    except Exception as e:  # offline, unknown repo, bad revision: all need the same fix
        at, rev = (f" @ {revision}", f" --revision {revision}") if revision else ("", "")
        raise FcauditError(f"cannot fetch {repo_id}{at} from the Hugging Face hub ({type(e).__name__}); download it "
                           f"where the hub is reachable (`hf download {repo_id}{rev} --local-dir DIR`) and pass the "
                           f"local directory DIR") from None


def resolve(path_or_id: str | os.PathLike, revision: str | None = None) -> Path:
    """A local checkpoint directory, or a hub id fetched into (or found in) the local cache."""
    local = valid_path(path_or_id, "the checkpoint").expanduser()
    if local.exists():
        if revision is not None:  # recorded, it would claim a version the directory may not hold
            raise FcauditError(f"--revision {revision} names a version of a Hugging Face hub repository, but {local} "
                               "is a local directory: drop --revision, or pass the hub id")
        if not local.is_dir():
            raise FcauditError(f"checkpoint {local} is a file: pass the directory that holds config.json and the weights")
        return local
    name = str(path_or_id)
    if not is_hub_id(name):
        raise FcauditError(f"no checkpoint directory {name}: pass a directory written by `fcaudit train` (config.json "
                           f"and weights) or a Hugging Face hub id like org/name")
    try:
        path = snapshot(name, revision, CHECKPOINT_FILES)
    except FcauditError as e:
        if local.parent.is_dir() and local.parent != Path("."):  # "runs/fg-s9" beside runs/: a mistyped path?
            raise FcauditError(f"no checkpoint directory {name} in the existing directory {local.parent}, nor a hub "
                               f"repository of that name ({e}); check the path") from None
        raise
    if not list(path.glob("*.safetensors")):
        path = snapshot(name, revision, CHECKPOINT_FILES + PICKLE_FALLBACK)
    return path
