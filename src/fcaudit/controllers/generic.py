"""Which controller adapter fits a model: a small registry plus `controller_for`.

Built-in adapters register themselves on import (featuregate.py); the MUDDPythia adapter lives in
`fcaudit.controllers.muddpythia` and is imported lazily, so loading fcaudit never imports a model class.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Callable

from torch import nn

from fcaudit.controllers.site import Controller
from fcaudit.errors import FcauditError

Factory = Callable[[nn.Module], Controller]
_REGISTRY: list[tuple[str | Callable[[nn.Module], bool], Factory]] = []
_PLUGINS = ("fcaudit.controllers.muddpythia",)


def register(match: str | Callable[[nn.Module], bool], factory: Factory) -> None:
    """Register an adapter: `match` is a class name (any class in the model's MRO) or a predicate on the model."""
    _REGISTRY.append((match, factory))


def _matches(match, model: nn.Module) -> bool:
    if isinstance(match, str):
        return any(cls.__name__ == match for cls in type(model).__mro__)
    return bool(match(model))


def _load_plugins() -> None:
    for name in _PLUGINS:
        if importlib.util.find_spec(name) is not None:
            importlib.import_module(name)  # registers itself


def controller_for(model: nn.Module) -> Controller:
    """The registered adapter for `model`; later registrations win over earlier ones."""
    _load_plugins()
    for match, factory in reversed(_REGISTRY):
        if _matches(match, model):
            return factory(model)
    raise FcauditError(f"no controller adapter for {type(model).__name__}; describe its sites with "
                       "fcaudit.Controller.from_modules(model, 'path.*.pattern', layout='batch token')")
