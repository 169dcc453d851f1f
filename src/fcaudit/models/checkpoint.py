"""Checkpoints in Hugging Face layout, never pickle: `config.json` (with `model_type`) + `model.safetensors`, for
any module's weights and any model with a `config` dataclass (FeatureGate's and MoD's)."""

import json
import os
from dataclasses import asdict, fields
from pathlib import Path

import torch
import torch.nn as nn
from safetensors import SafetensorError
from safetensors.torch import load_model as load_safetensors_model
from safetensors.torch import save_file

from fcaudit.errors import FcauditError, one_line
from fcaudit.io import atomic_write, read_json, write_json
from fcaudit.models.featuregate import FeatureGateGPT
from fcaudit.weights import check_depth, check_sizes, stored_dtype, stored_shapes

MODEL_TYPE = "featuregate"
CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"


def save_weights(path: str | os.PathLike, model: nn.Module) -> Path:
    """Atomically write a module's weights as safetensors: tied tensors once, under the first of their sorted names,
    the ties in one metadata entry, so every save has the same bytes (safetensors' save_model orders them randomly)."""
    state = model.state_dict()
    tied: dict[tuple, list[str]] = {}
    for name, t in state.items():
        where = (t.untyped_storage().data_ptr(), t.storage_offset(), t.shape, t.stride(), t.dtype)
        tied.setdefault(where if t.numel() else (name,), []).append(name)  # empty tensors share no data
    tensors, ties = {}, {}
    for names in tied.values():
        keep = min(names)
        tensors[keep] = state[keep].contiguous()
        ties.update({name: keep for name in names if name != keep})
    meta = {"tied": json.dumps(ties, sort_keys=True)} if ties else None
    return atomic_write(path, lambda p: save_file(tensors, str(p), metadata=meta))


def load_weights(path: str | os.PathLike, model: nn.Module, *, device: str | torch.device = "cpu") -> None:
    """Load safetensors weights into `model` strictly; a missing, corrupt or mismatched file -> FcauditError."""
    path = Path(path)
    if not path.is_file():
        raise FcauditError(f"no weights file {path}: point to a complete checkpoint directory (rerun the training to write it)")
    try:
        load_safetensors_model(model, str(path), strict=True, device=str(device))
    except (SafetensorError, OSError, ValueError) as e:
        raise FcauditError(f"weights file {path} is corrupt or truncated ({one_line(e)}): retrain or re-download the checkpoint") from None
    except RuntimeError as e:
        raise FcauditError(f"weights in {path} do not match its config.json ({one_line(e)}): use the config.json written with these weights") from None


def write_checkpoint(dir: str | os.PathLike, model: nn.Module, model_type: str, meta: dict | None = None) -> Path:
    """Write `model.safetensors`, then `config.json` (model_type, the `config` dataclass's fields, meta), each
    atomically: a directory whose config.json names model_type is complete."""
    dir = Path(dir)
    dir.mkdir(parents=True, exist_ok=True)
    save_weights(dir / WEIGHTS_NAME, model)
    write_json(dir / CONFIG_NAME, {"model_type": model_type, **asdict(model.config), "meta": meta or {}})
    return dir


def read_checkpoint(dir: Path, model_class: type, device: torch.device,
                    dtype: torch.dtype | None) -> tuple[nn.Module, dict]:
    """(model in eval mode, meta) of a `write_checkpoint` directory: `model_class(model_class.config_class(config.json's
    fields))`, unknown keys ignored, built first on the meta device to check its sizes against the weights; in `dtype`,
    None: the stored weights' own."""
    config = read_json(dir / CONFIG_NAME)
    meta = config.pop("meta", {})
    if not isinstance(meta, dict):
        raise FcauditError(f"{dir / CONFIG_NAME} has a meta of type {type(meta).__name__}, not an object: use the "
                           "config.json written with these weights")
    cls = model_class.config_class
    names = {f.name for f in fields(cls)}  # model_type is none of them
    known = {k: v for k, v in config.items() if k in names}
    try:
        model_config = cls(**known)
    except TypeError as e:
        raise FcauditError(f"{dir / CONFIG_NAME} has an invalid field ({one_line(e)}): use the config.json written "
                           "with these weights") from None
    stored = stored_shapes(dir)  # every size against the weights' headers before a module is built
    if hasattr(model_config, "n_layer"):
        check_depth(dir, stored, "n_layer", model_config.n_layer)
    check_sizes(lambda: model_class(model_config), dir, stored)
    # built in the precision it is loaded in (the checkpoint's own unless `dtype` says otherwise): a float64
    # checkpoint loses no digit, and a float16 one is not audited in float32
    model = model_class(model_config).to(dtype=dtype or stored_dtype(dir) or torch.float32)
    load_weights(dir / WEIGHTS_NAME, model)
    return model.to(device=device).eval(), meta


def save_checkpoint(dir: str | os.PathLike, model: FeatureGateGPT, meta: dict | None = None) -> Path:
    """A FeatureGate-family checkpoint (`write_checkpoint` with model_type "featuregate")."""
    return write_checkpoint(dir, model, MODEL_TYPE, meta)
