"""The family registry: everything fcaudit knows about one kind of model lives in that family's own module.

A family registers a `Family`: which checkpoints it loads (config.json), how it loads and saves them, which models it
recognizes, their controller adapter (the sites FCA audits), a label for tables, and, when fcaudit can train it, its
builder. Nothing outside a family's module dispatches on a model class. Every module in this package registers itself
on import; the registry imports them on first use (so `import fcaudit` never imports a model), and a user's own family
is one `register(Family(...))` call.
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from fcaudit.errors import FcauditError


@dataclass(frozen=True)
class Family:
    name: str
    accepts: Callable[[dict], bool]  # does this family load a checkpoint with this config.json?
    load: Callable[[Path, torch.device, torch.dtype | None], tuple[nn.Module, dict]]  # -> (model in eval mode, meta)
    matches: Callable[[nn.Module], bool]  # is this loaded or built model one of the family's?
    controller: Callable[[nn.Module], Any]  # -> fcaudit.controllers.Controller
    label: Callable[[nn.Module], str] = lambda model: type(model).__name__  # tables, execution rows
    trains: tuple[str, ...] = ()  # `fcaudit train --model` names this family builds
    build: Callable[[Any], nn.Module] | None = None  # TrainConfig -> fresh model
    save: Callable[[nn.Module, Path, dict], None] | None = None  # final checkpoint (config.json + weights)
    # training evaluation: (logits, gates [L, B, T] or None); gate mass of an ungated member (Dense: 1.0) or None
    gates: Callable[[nn.Module, torch.Tensor], tuple[torch.Tensor, torch.Tensor | None]] | None = None
    ungated_mass: float | None = None
    # extra execution columns (MoE: experts run, expert FLOPs): (model, ids, controller=None, coefficients=None)
    execution: Callable[..., dict] | None = None
    train_loss: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None = None  # default: next-token NLL
    # load(dir, device, dtype, device_map=..., offload_folder=...) spreads a model with accelerate (fcaudit.placement)
    device_maps: bool = False


_FAMILIES: dict[str, Family] = {}
_LOADED = False


def register(family: Family) -> Family:
    """Add (or replace) a family; later registrations win when several match a model."""
    _FAMILIES[family.name] = family
    return family


def unregister(name: str) -> None:
    _FAMILIES.pop(name, None)


def families() -> list[Family]:
    global _LOADED
    if not _LOADED:
        _LOADED = True
        for info in pkgutil.iter_modules(__path__):
            importlib.import_module(f"{__name__}.{info.name}")  # each registers itself
    return list(_FAMILIES.values())


def for_model(model: nn.Module) -> Family | None:
    return next((f for f in reversed(families()) if f.matches(model)), None)


def for_config(config: dict) -> Family | None:
    return next((f for f in reversed(families()) if f.accepts(config)), None)


def for_training(name: str) -> Family:
    for f in families():
        if name in f.trains:
            return f
    raise FcauditError(f"unknown model {name!r}: use one of {', '.join(trainable())}")


def trainable() -> list[str]:
    return [n for f in families() for n in f.trains]


DEFAULT_WINDOW_CAP = 2048  # a window left to default is the model's context, at most this (Llama 4's is 10M tokens)


def context_length(model: nn.Module) -> int | None:
    """The longest window a model takes (block_size, or a transformers config's max_position_embeddings)."""
    config = getattr(model, "config", None)
    for key in ("block_size", "max_position_embeddings", "n_positions"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def label(model: nn.Module) -> str:
    f = for_model(model)
    return f.label(model) if f is not None else type(model).__name__
