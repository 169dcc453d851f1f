"""Controller adapters: which modules emit a model's coefficients, and how to read them (site codecs).

`controller_for(model)` asks the adapters registered with `register` (a user's own models) and then the model's
family (fcaudit.families); any other model is described with `Controller.from_modules`.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator

from torch import nn

from fcaudit.controllers.site import Codec, Controller, Layout, Site
from fcaudit.errors import FcauditError

Factory = Callable[[nn.Module], Controller]
_ADAPTERS: list[tuple[Callable[[nn.Module], bool], Factory]] = []


def register(match: Callable[[nn.Module], bool], factory: Factory) -> Callable[[], None]:
    """Register an adapter for the models `match` accepts (later registrations win); returns its `unregister`."""
    entry = (match, factory)
    _ADAPTERS.append(entry)
    return lambda: _ADAPTERS.remove(entry) if entry in _ADAPTERS else None


@contextmanager
def registered(match: Callable[[nn.Module], bool], factory: Factory) -> Iterator[None]:
    """An adapter registered for the duration of a `with` block (tests, notebooks)."""
    unregister = register(match, factory)
    try:
        yield
    finally:
        unregister()


def controller_for(model: nn.Module) -> Controller:
    """The controller of `model`: a registered adapter, else its family's."""
    from fcaudit import families

    if isinstance(model, tuple):  # (model, meta) as fcaudit.models.checkpoint.load_model returns it
        model = model[0]
    for match, factory in reversed(_ADAPTERS):
        if match(model):
            return factory(model)
    family = families.for_model(model)
    if family is not None:
        return family.controller(model)
    raise FcauditError(f"no controller adapter for {type(model).__name__}; describe its sites with "
                       "fcaudit.Controller.from_modules(model, 'path.*.pattern', layout='batch token') (or codec=...)")


__all__ = ["Codec", "Controller", "Layout", "Site", "controller_for", "register", "registered"]
