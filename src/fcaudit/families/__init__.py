"""The family registry: everything fcaudit knows about one kind of model lives in that family's own module, and
nothing outside it dispatches on a model class. Each module of this package registers its `Family` on import; the
registry imports them on first use, so `import fcaudit` never imports a model.
"""

from __future__ import annotations

import importlib
import json
import os
import pkgutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from fcaudit.controllers.controller import Controller
from fcaudit.errors import FcauditError, one_line
from fcaudit.hub import resolve
from fcaudit.io import read_json
from fcaudit.models.checkpoint import CONFIG_NAME


# The route that audits any model, named wherever fcaudit's own families stop
OWN_ROUTE = ("load the model yourself (transformers: AutoModelForCausalLM.from_pretrained) and describe its controller "
             "with fca.Controller.from_modules(model, 'path.*', codec=...) or fca.Controller.from_ops(...), then "
             "fca.audit(model, controller, ...)")


@dataclass(frozen=True)
class Family:
    """Everything fcaudit knows about one kind of model: which models it recognizes and their controller, and
    optionally how to load, save and train its checkpoints.

    Registered (`fca.register`) with only `name`, `matches` and `controller`, it lets `fca.controller_for(model)` and
    the tables find a model of your own class; the built-in families add loading and `fcaudit train`'s hooks.

    Parameters
    ----------
    name
        The family's name (a later registration of the same name replaces it).
    matches
        `matches(model) -> bool`: is this model one of the family's?
    controller
        `controller(model) -> fca.Controller`: the sites FCA audits.
    accepts, load
        `accepts(config) -> bool` for a checkpoint's config.json, and `load(dir, device, dtype) -> (model,
        meta)`: what lets `fca.load` and `fcaudit audit DIR` read its checkpoints.
    label
        The model's name in tables and execution rows (default: its class name).

    Examples
    --------
    >>> class TwoGates(nn.Module):  # only its module paths matter here
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.gates = nn.ModuleList(nn.Linear(8, 1) for _ in range(2))
    >>> def sites(model):
    ...     return fca.Controller.from_modules(model, "gates.*", layout="batch token 1")
    >>> family = fca.Family("two-gates", matches=lambda m: isinstance(m, TwoGates), controller=sites)
    >>> family.name, family.matches(TwoGates()), family.matches(nn.Linear(2, 2))
    ('two-gates', True, False)
    """

    name: str
    matches: Callable[[nn.Module], bool]  # is this loaded or built model one of the family's?
    controller: Callable[[nn.Module], Controller]  # the sites FCA audits
    accepts: Callable[[dict], bool] = lambda config: False  # does this family load a checkpoint with this config.json?
    load: Callable[[Path, torch.device, torch.dtype | None], tuple[nn.Module, dict]] | None = None  # -> (model, meta)
    label: Callable[[nn.Module], str] = lambda model: type(model).__name__  # tables, execution rows
    # a member with no controller by design (Dense, FixedDepth): `fcaudit execution` measures it as a reference;
    # any other model whose controller is not found is refused there
    ungated: Callable[[nn.Module], bool] = lambda model: False
    # training: the `fcaudit train --model` names and presets it builds; TrainConfig -> fresh model; final checkpoint
    trains: tuple[str, ...] = ()
    presets: tuple[str, ...] = ()
    build: Callable[[Any], nn.Module] | None = None
    save: Callable[[nn.Module, Path, dict], None] | None = None  # config.json + weights
    configure: Callable[[Any], None] | None = None  # checks and completes a TrainConfig's variant options
    no_decay: tuple[str, ...] = ()  # parameter names (prefixes) kept from weight decay besides vectors
    train_loss: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None = None  # default: next-token NLL
    # training evaluation: (logits, gates [L, B, T] or None); gate mass of an ungated member (Dense: 1.0) or None
    gates: Callable[[nn.Module, torch.Tensor], tuple[torch.Tensor, torch.Tensor | None]] | None = None
    ungated_mass: float | None = None
    # extra execution columns (MoE: experts run, expert FLOPs): (model, ids, controller=None, coefficients=None)
    execution: Callable[..., dict] | None = None
    device_maps: bool = False  # load(..., device_map=..., offload_folder=...) spreads a model (fcaudit.placement)
    architecture: str | None = None  # execution ratios: its Dense baseline's class when another family's (MoD's)


_FAMILIES: dict[str, Family] = {}
_LOADED = False


def register(family: Family) -> Callable[[], None]:
    """Make a family known, so that `fca.controller_for`, `fca.load` and the CLI find its models.

    A family of the same name is replaced; where several match a model, the one registered last wins (a user's
    own after the built-in ones).

    Parameters
    ----------
    family
        A `fca.Family`.

    Returns
    -------
    callable
        `unregister()`: removes it again (a no-op once another family has replaced it).

    Examples
    --------
    With `family` and `TwoGates` of `fca.Family`'s example:

    >>> unregister = fca.register(family)
    >>> [site.name for site in fca.controller_for(TwoGates()).sites]
    ['gates.0', 'gates.1']
    >>> _ = unregister()
    """
    families()  # the built-in families first
    _FAMILIES.pop(family.name, None)
    _FAMILIES[family.name] = family
    return lambda: _FAMILIES.pop(family.name, None) if _FAMILIES.get(family.name) is family else None


def families() -> list[Family]:
    global _LOADED
    if not _LOADED:
        _LOADED = True
        for info in pkgutil.iter_modules(__path__):
            importlib.import_module(f"{__name__}.{info.name}")  # each registers itself
    return list(_FAMILIES.values())


def for_model(model: nn.Module) -> Family | None:
    return next((f for f in reversed(families()) if f.matches(model)), None)


def for_training(name: str) -> Family:
    for f in families():
        if name in f.trains:
            return f
    raise FcauditError(f"unknown model {name!r}: use one of {', '.join(trainable())}")


def trainable() -> list[str]:
    return [n for f in families() for n in f.trains]


def controller_for(model: nn.Module) -> Controller:
    """The controller of a model of a registered family: its sites, found for you.

    Built-in families cover FeatureGate, MoD, MUDDPythia and Hugging Face mixture-of-experts LMs (routers found by
    structure); a model of any other class needs `fca.Controller.from_modules(...)` or a registered `fca.Family`.

    Parameters
    ----------
    model
        The model (or the `(model, meta)` pair `fcaudit.families.load_model` returns).

    Raises
    ------
    FcauditError
        No registered family matches the model; the message says how to describe its sites.

    Examples
    --------
    >>> try:
    ...     fca.controller_for(nn.Linear(2, 2))
    ... except fca.FcauditError as e:
    ...     print(e)
    no controller adapter for Linear; describe its sites with fcaudit.Controller.from_modules(...) (or codec=...)

    With `model`, the FeatureGate checkpoint of `fca.load`'s example:

    >>> ctrl = fca.controller_for(model)
    >>> [site.name for site in ctrl.sites]
    ['blocks.0.gate', 'blocks.1.gate']
    >>> ctrl.labels["StaticProfile"]  # FeatureGate's static condition is a per-layer mean
    'LayerMean'
    """
    if isinstance(model, tuple):  # (model, meta) as load_model returns it
        model = model[0]
    family = for_model(model)
    if family is None:
        raise FcauditError(f"no controller adapter for {type(model).__name__}; describe its sites with "
                           "fcaudit.Controller.from_modules(model, 'path.*.pattern', layout='batch token') (or "
                           "codec=...)")
    return family.controller(model)


def load_model(path_or_id: str | os.PathLike, *, revision: str | None = None, device: str | torch.device = "cpu",
               dtype: torch.dtype | None = None, device_map: str | dict | None = None,
               offload_folder: str | os.PathLike | None = None) -> tuple[nn.Module, dict]:
    """Load a checkpoint directory or hub id with the family that accepts its config.json: returns (model in eval
    mode on `device`, or spread as `device_map` says (fcaudit.placement), meta dict)."""
    dir = resolve(path_or_id, revision)
    config_path = dir / CONFIG_NAME
    if not config_path.is_file():
        raise FcauditError(f"{dir} has no {CONFIG_NAME}: pass a checkpoint directory (one written by `fcaudit train`, "
                           "or a Hugging Face checkpoint: config.json + safetensors)")
    try:
        config = read_json(config_path)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise FcauditError(f"{config_path} is not valid JSON ({one_line(e)}): restore it from the training run") from None
    family = next((f for f in reversed(families()) if f.accepts(config)), None) if isinstance(config, dict) else None
    if family is None:
        model_type = config.get("model_type") if isinstance(config, dict) else None
        known = ", ".join(f.name for f in families() if f.load is not None)
        raise FcauditError(f"{config_path} has model_type {model_type!r}, which no fcaudit family loads ({known}): "
                           f"{OWN_ROUTE}")
    if device_map is None:
        return family.load(dir, torch.device(device), dtype)
    if not family.device_maps:
        raise FcauditError(f"a device map spreads Hugging Face checkpoints; {dir} is a {family.name} checkpoint, "
                           "which runs on one device: drop --device-map and pass --device")
    return family.load(dir, torch.device(device), dtype, device_map=device_map, offload_folder=offload_folder)


DEFAULT_WINDOW_CAP = 2048  # a window left to default is the model's context, at most this (Llama 4's is 10M tokens)


def context_length(model: nn.Module) -> int | None:
    """The longest window a model takes (block_size, or a transformers config's max_position_embeddings)."""
    config = getattr(model, "config", None)
    values = (getattr(config, key, None) for key in ("block_size", "max_position_embeddings", "n_positions"))
    return next((v for v in values if isinstance(v, int) and v > 0), None)


def label(model: nn.Module) -> str:
    f = for_model(model)
    return f.label(model) if f is not None else type(model).__name__
