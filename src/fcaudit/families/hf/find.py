"""The controller sites of a Hugging Face model that its module classes' recipes name (recipes.py), and the
mechanisms fcaudit names but does not audit."""

from __future__ import annotations

from dataclasses import replace

from torch import nn

from fcaudit.controllers.codecs import Layout, Parts
from fcaudit.controllers.controller import Controller
from fcaudit.controllers.patching import Pass, patched
from fcaudit.controllers.sites import Site
from fcaudit.errors import FcauditError
from fcaudit.families import OWN_ROUTE
from fcaudit.families.hf.discover import is_moe, moe_controller, probe_pass
from fcaudit.families.hf.load import check_scan
from fcaudit.families.hf.recipes import RECIPES, UNAUDITED


def recipe_sites(model: nn.Module) -> list[tuple[str, Site]]:
    """(path of the instance holding it, site) for each recipe of each module whose class has recipes, in model
    order. A recipe whose module is not there is refused: the entry no longer fits the class."""
    found = []
    for path, m in model.named_modules():
        for r in RECIPES.get(type(m).__name__, ()):
            at = ".".join(p for p in (path, r.module) if p)
            if r.module and getattr(m, r.module, m) is None:  # the config turned the mechanism off (g_proj = None)
                continue
            try:
                module = m.get_submodule(r.module) if r.module else m
            except AttributeError:
                raise FcauditError(f"{type(m).__name__} at {path} has no submodule {r.module!r}, which fcaudit's recipe "
                                   f"for its {r.what} reads (fcaudit/families/hf/recipes.py): describe its sites with "
                                   "fcaudit.Controller.from_modules(...)") from None
            codec = Parts(Layout.parse(r.layout), r.parts, r.op) if r.parts else Layout.parse(r.layout)
            found.append((path, Site(at, module, codec=codec, call=r.call, method=r.method, op=r.op, kind=r.kind)))
    return found


def recipe_controller(model: nn.Module) -> Controller | None:
    """The sites of `model`'s recipes, each instance of a class one layer (its sites move together), or None."""
    found = recipe_sites(model)
    if not found:
        return None
    layer = {owner: i for i, owner in enumerate(dict.fromkeys(owner for owner, _ in found))}
    sites = tuple(Site(s.path, s.module, codec=s.codec, call=s.call, method=s.method, op=s.op, kind=s.kind,
                       group=layer[owner]) for owner, s in found)
    classes = dict.fromkeys(type(model.get_submodule(owner)).__name__ for owner in layer)
    whats = dict.fromkeys(f"{r.what} ({cls})" for cls in classes for r in RECIPES[cls])
    return Controller(sites, description=f"{type(model).__name__}: {len(sites)} sites by recipe: {'; '.join(whats)}")


def unaudited(model: nn.Module) -> list[str]:
    """One line per class of mechanism the model holds that fcaudit names but does not audit."""
    held: dict[str, list[str]] = {}
    for path, m in model.named_modules():
        if type(m).__name__ in UNAUDITED:
            held.setdefault(type(m).__name__, []).append(path)
    return [f"not audited: {len(paths)} {cls} ({paths[0]}{', ...' if len(paths) > 1 else ''}): {UNAUDITED[cls]}"
            for cls, paths in held.items()]


def per_call(model: nn.Module, controller: Controller) -> Controller:
    """`controller` with each site whose method runs n > 1 times in a forward pass (a looped layer: Dory's recurrent
    layers, HRM's stacks) made n sites, call=0..n-1, each loop pass of each instance its own layer. n is counted in a
    probe pass by the counters that number a capture's calls, and every pass of the audit checks it (`Site.calls`):
    a count that the input changes is a halting decision, refused there."""
    run = Pass([replace(s, call=-1) for s in controller.sites])  # no site takes a call: the pass only counts them
    with patched(run), controller.context():
        probe_pass(model, why=", which counts the calls of its controller sites")
    runs = [run.method_calls.get((id(s.module), s.method), 0) for s in run.sites]
    for s, n in zip(controller.sites, runs):
        if s.call is not None and n > 1:  # its call N counts over every pass: one pass audited, the others live
            raise FcauditError(f"site {s.name!r}: {s.path}.{s.method} runs {n} times in a forward pass (a looped "
                               f"layer), and call={s.call} numbers the calls{f' of {s.op!r}' if s.op else ''} over "
                               "all of them, so one pass would be audited and the others left live; describe each "
                               "pass's site with fcaudit.Controller.from_ops(..., call=N)")
    split = {i: n for i, (s, n) in enumerate(zip(run.sites, runs))
             if controller.sites[i].call is None and n > 1
             and (s.op is None or run.count(s) == n)}  # an op site: once in each call of its method
    if not split:
        return controller
    layer: dict[tuple, int] = {}
    sites = tuple(replace(s, call=k, calls=split.get(i), group=layer.setdefault((s.group, k), len(layer)))
                  for i, s in enumerate(controller.sites) for k in (range(split[i]) if i in split else (s.call,)))
    looped = f"; the {len(split)} sites of looped layers one per call: {sum(split.values())} sites"
    return replace(controller, sites=sites, description=controller.description + looped)


def is_hf(model: nn.Module) -> bool:
    """This family's model (no forward pass): a transformers model (its own code or a checkpoint's), or any model
    holding MoE routers or a module of a class with recipes or named as not audited (its refusal says what it holds)."""
    modules = [c.__module__ for c in type(model).__mro__]
    return any(m.startswith(("transformers.", "transformers_modules.")) for m in modules) or is_moe(model) or \
        any(type(m).__name__ in RECIPES or type(m).__name__ in UNAUDITED for m in model.modules())


def hf_controller(model: nn.Module) -> Controller:
    """Every controller fcaudit finds in a Hugging Face model: its MoE routers (by structure) and its recipes' sites,
    merged; a mechanism it names but does not audit goes into the controller's notes."""
    config = getattr(model, "config", None)
    if callable(getattr(config, "get_text_config", None)):  # before the probes' passes: a scan's memory
        check_scan(config.get_text_config(), f"{type(model).__name__}'s config",
                   "load the model again with from_pretrained(..., {key}={fits})")
    skipped = tuple(unaudited(model))
    routers = moe_controller(model) if is_moe(model) else None
    recipes = recipe_controller(model)
    if routers is None and recipes is None:
        why = f"; it holds {skipped[0].removeprefix('not audited: ')}" if skipped else ""
        raise FcauditError(f"{type(model).__name__} has no controller fcaudit finds (no MoE router beside its experts, "
                           f"no module of a class in fcaudit/families/hf/recipes.py){why}; {OWN_ROUTE}")
    if recipes is None:
        return per_call(model, replace(routers, notes=routers.notes + skipped))
    if routers is None:
        return per_call(model, replace(recipes, notes=skipped))
    layer = {s.path: s.group for s in recipes.sites}  # a recipe instance's sites move together; a router alone
    merged = Controller.merge(routers, recipes, group=lambda s: ("recipe", layer[s.path]) if s.path in layer
                              else ("router", s.path))
    return per_call(model, replace(merged, notes=merged.notes + skipped))
