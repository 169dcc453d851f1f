"""Checkpoints in Hugging Face layout: `config.json` (with `model_type`) + `model.safetensors`, never pickle.

load_model dispatches on model_type: "featuregate" -> FeatureGateGPT, "muddpythia" -> fcaudit.models.muddpythia.
A path that does not exist locally is treated as a Hugging Face hub id (resolve_checkpoint): only the files fcaudit
reads are downloaded, and the local cache is used when the hub is unreachable.
"""

import json
import os
from pathlib import Path

import torch
import torch.nn as nn
from safetensors import SafetensorError
from safetensors.torch import load_model as load_safetensors_model
from safetensors.torch import save_model as save_safetensors_model

from fcaudit.errors import FcauditError
from fcaudit.io import atomic_write, read_json, write_json
from fcaudit.models.featuregate import FeatureGateGPT, GPTConfig

MODEL_TYPE = "featuregate"
CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"


def save_weights(path: str | os.PathLike, model: nn.Module) -> Path:
    """Atomically write a module's weights as safetensors (tied tensors stored once, restored on load)."""
    return atomic_write(path, lambda p: save_safetensors_model(model, str(p)))


def load_weights(path: str | os.PathLike, model: nn.Module, *, device: str | torch.device = "cpu") -> None:
    """Load safetensors weights into `model` strictly; a missing, corrupt or mismatched file -> FcauditError."""
    path = Path(path)
    if not path.is_file():
        raise FcauditError(f"no weights file {path}: point to a complete checkpoint directory (rerun the training to write it)")
    try:
        load_safetensors_model(model, str(path), strict=True, device=str(device))
    except (SafetensorError, OSError, ValueError) as e:
        raise FcauditError(f"weights file {path} is corrupt or truncated ({_one_line(e)}): retrain or re-download the checkpoint") from None
    except RuntimeError as e:
        raise FcauditError(f"weights in {path} do not match its config.json ({_one_line(e)}): use the config.json written with these weights") from None


def save_checkpoint(dir: str | os.PathLike, model: FeatureGateGPT, meta: dict | None = None) -> Path:
    """Write `config.json` (model_type, the GPTConfig fields, meta) and `model.safetensors`, each atomically.

    The weights go first, the config last: a directory whose config.json names model_type is complete.
    """
    dir = Path(dir)
    dir.mkdir(parents=True, exist_ok=True)
    save_weights(dir / WEIGHTS_NAME, model)
    write_json(dir / CONFIG_NAME, {"model_type": MODEL_TYPE, **model.config.to_dict(), "meta": meta or {}})
    return dir


# What fcaudit reads from a hub repo; pickle-era .bin weights only when a repo has no safetensors.
HUB_PATTERNS = [CONFIG_NAME, "*.safetensors", "*.safetensors.index.json", "tokenizer*", "special_tokens_map.json"]
HUB_FALLBACK = ["pytorch_model*.bin", "*.bin.index.json"]


def resolve_checkpoint(path_or_id: str | os.PathLike, revision: str | None = None) -> Path:
    """A local checkpoint directory, or a hub id downloaded (from the local cache when the hub is unreachable)."""
    local = Path(path_or_id).expanduser()
    if local.exists():
        if not local.is_dir():
            raise FcauditError(f"checkpoint {local} is a file: pass the directory that holds config.json and model.safetensors")
        return local
    repo_id = str(path_or_id)
    if repo_id.count("/") != 1 or repo_id.startswith((".", "/", "~")):
        raise FcauditError(f"no checkpoint directory {repo_id}: pass a directory written by `fcaudit train` or a hub id like org/name")
    from huggingface_hub import snapshot_download

    from fcaudit.hub import hub_reachable

    offline = not hub_reachable()  # fail fast (or use the cache) instead of retrying for half a minute
    try:
        path = Path(snapshot_download(repo_id, revision=revision, allow_patterns=HUB_PATTERNS, local_files_only=offline))
        if not list(path.glob("*.safetensors")):
            path = Path(snapshot_download(repo_id, revision=revision, allow_patterns=HUB_PATTERNS + HUB_FALLBACK,
                                          local_files_only=offline))
    except Exception as e:  # offline, unknown repo, bad revision: all end the same way for the user
        raise FcauditError(f"{repo_id} is not a local directory and could not be fetched from the Hugging Face hub "
                           f"({type(e).__name__}): pass a local checkpoint directory, or connect and retry") from None
    return path


def load_model(path_or_id: str | os.PathLike, *, revision: str | None = None, device: str | torch.device = "cpu",
               dtype: torch.dtype | None = None) -> tuple[nn.Module, dict]:
    """Load a checkpoint directory or hub id: returns (model in eval mode on `device`, meta dict from config.json)."""
    dir = resolve_checkpoint(path_or_id, revision)
    config_path = dir / CONFIG_NAME
    if not config_path.is_file():
        raise FcauditError(f"{dir} has no {CONFIG_NAME}: pass a checkpoint directory written by `fcaudit train`")
    try:
        config = read_json(config_path)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise FcauditError(f"{config_path} is not valid JSON ({_one_line(e)}): restore it from the training run") from None
    model_type = config.get("model_type") if isinstance(config, dict) else None
    if model_type == "muddpythia":
        from fcaudit.models import muddpythia  # written separately; imported only when needed

        model = muddpythia.from_pretrained(dir, dtype=dtype)
        return model.to(device).eval(), {k: v for k, v in config.items() if k != "model_type"}
    if model_type != MODEL_TYPE:
        raise FcauditError(f"{config_path} has model_type {model_type!r}: fcaudit loads 'featuregate' and 'muddpythia' checkpoints")
    meta = config.pop("meta", {})
    config.pop("model_type")
    try:
        model = FeatureGateGPT(GPTConfig.from_dict(config))
    except TypeError as e:
        raise FcauditError(f"{config_path} has an invalid field ({_one_line(e)}): use the config.json written with these weights") from None
    load_weights(dir / WEIGHTS_NAME, model)
    return model.to(device=device, dtype=dtype).eval(), meta


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return text if len(text) <= 160 else text[:157] + "..."
