"""One forward pass with a controller's sites patched in: each (module, method) that holds sites wrapped once, as an
instance attribute removed on exit (the class and the model's code are untouched); an op site is watched by a
TorchFunctionMode while its method runs. A capture pass returns what it saw (`Captured`); a replay pass puts each
site's replayed output in place of its computation, which then does not run.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from fcaudit.controllers.sites import Call, Decoding, Site, op_name, shape_of
from fcaudit.errors import FcauditError


class Captured(list):
    """What a capture pass returns: each site's canonical coefficients (the list itself, in site order) and, unless
    the capture was told not to keep it, `decoding`: what a replay needs to decode each site's coefficients into its
    place (`Controller.replay(coeffs, captured.decoding)`)."""

    def __init__(self, coeffs: Sequence, decoding: Sequence[Decoding | None] | None = None):
        super().__init__(coeffs)
        self.decoding = None if decoding is None else list(decoding)


class Pass:
    """The sites of one forward pass: captured into `found` (and `raw`: each output and call), or replayed by
    `replayed(i, call)` (then not computed). Calls are counted per pass, so `call=N` means the N-th call of that
    forward pass."""

    def __init__(self, sites: Sequence[Site], batch: int = 0, token: int = 0, decoding: bool = False,
                 raw: list | None = None, replayed: Callable[[int, Call], Any] | None = None):
        self.sites, self.batch, self.token, self.raw, self.replayed = sites, batch, token, raw, replayed
        n = len(sites)
        self.found = Captured([None] * n, [None] * n if decoding else None)  # site i's canonical output
        self.method_calls: dict[tuple[int, str], int] = {}
        self.op_calls: dict[tuple[int, str, str], list[str]] = {}  # each call of a watched op, with its shapes

    def count(self, site: Site) -> int:
        """How many calls `site.call` numbers in this pass so far: of its method, or of its op while that runs."""
        if site.op is None:
            return self.method_calls.get((id(site.module), site.method), 0)
        return len(self.op_calls.get((id(site.module), site.method, site.op), []))

    def call(self, chosen: list[int], inputs: Call, compute: Callable[[], Any], seen: Callable[[], str]) -> Any:
        """One call of a site's method or op: replayed, or computed and encoded by the sites `chosen` (a second call
        of a site without `call` is refused)."""
        if chosen and self.replayed is not None:
            return self.replayed(chosen[0], inputs)
        out = compute()
        for i in chosen:
            site = self.sites[i]
            if self.found[i] is not None:
                raise FcauditError(f"site {site.name!r} ran twice in one forward pass ({seen()}); pick one call with "
                                   f"call=0 or call=1 (Controller.{'from_ops' if site.op else 'from_modules'}(..., "
                                   "call=N)), or a module that produces one layer's coefficients once")
            self.found[i] = site.encode(out, self.batch, self.token)
            if self.found.decoding is not None:
                self.found.decoding[i] = Decoding.of(site.codec, out)
            if self.raw is not None:
                self.raw[i] = (out, inputs)
        return out


class OpMode(TorchFunctionMode):
    """Active while one site method runs: the watched ops' results are captured or replaced (then not computed)."""

    def __init__(self, run: Pass, module: nn.Module, method: str, sites: list[int]):
        super().__init__()
        self.run, self.module, self.key, self.sites = run, module, (id(module), method), sites
        self.ops = {run.sites[i].op for i in sites}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = op_name(func)
        if name not in self.ops:
            return func(*args, **kwargs)
        calls = self.run.op_calls.setdefault((*self.key, name), [])
        n = len(calls)
        calls.append(f"#{n} {name}({', '.join(shape_of(a) for a in args)})")  # for the one-line errors

        def compute():
            out = func(*args, **kwargs)
            calls[n] += f" -> {shape_of(out)}"
            return out

        chosen = [i for i in self.sites if self.run.sites[i].op == name and self.run.sites[i].call in (None, n)]
        return self.run.call(chosen, Call(tuple(args), kwargs, self.module), compute, lambda: "; ".join(calls))


def _wrapper(run: Pass, module: nn.Module, method: str, inner: Callable, sites: list[int]) -> Callable:
    """`inner` (the bound method) with the pass's sites on it: module-level sites take (or replace) the whole
    result of their call; op sites are watched by an OpMode while it runs."""
    key = (id(module), method)
    whole = [i for i in sites if run.sites[i].op is None]
    ops = [i for i in sites if run.sites[i].op is not None]

    def wrapped(*args, **kwargs):
        n = run.method_calls.get(key, 0)
        run.method_calls[key] = n + 1

        def compute():
            with OpMode(run, module, method, ops) if ops else nullcontext():
                return inner(*args, **kwargs)

        chosen = [i for i in whole if run.sites[i].call in (None, n)]
        return run.call(chosen, Call(args, kwargs, module), compute,
                        lambda: f"call {n} of {type(module).__name__}.{method}")

    return wrapped


@contextmanager
def patched(run: Pass) -> Iterator[None]:
    """Each (module, method) holding sites wrapped for the pass (an instance attribute, removed on exit: the class
    and the model's code are untouched)."""
    points: dict[tuple[int, str], tuple[nn.Module, list[int]]] = {}
    for i, s in enumerate(run.sites):
        points.setdefault((id(s.module), s.method), (s.module, []))[1].append(i)
    saved = []
    try:
        for (_, method), (module, sites) in points.items():
            saved.append((module, method, module.__dict__.get(method)))  # a method, or None (the class's)
            setattr(module, method, _wrapper(run, module, method, getattr(module, method), sites))
        yield
    finally:
        for module, method, original in reversed(saved):
            module.__dict__.pop(method, None)
            if original is not None:
                module.__dict__[method] = original


def check_calls(run: Pass) -> None:
    """Refuses a finished pass in which a looped layer's method (an op site: its op) ran another number of times than
    its sites, one per call, number (`Site.calls`): a call beyond them would run live, one short of them unreplayed."""
    for s in run.sites:
        if s.calls is None:
            continue
        if (n := run.count(s)) != s.calls:
            what = f"{s.path}.{s.method}" + (f" made {n} call(s) of {s.op!r}" if s.op else f" ran {n} time(s)")
            raise FcauditError(f"site {s.name!r}: {what} in a forward pass, not the {s.calls} of the pass that "
                               "numbered its calls: how many times it runs depends on the input (a halting decision, "
                               "itself a controller, or the window's length), so call=N is not one loop pass; audit "
                               "a halting decision with kind='halting' or 'exit_depth' (Controller.from_modules)")


def check_ran(run: Pass) -> None:
    """Refuses, naming what it saw instead, the first call or op site that did not run in a finished capture pass,
    or a looped layer's that ran another number of times (`check_calls`)."""
    check_calls(run)
    for i, s in enumerate(run.sites):
        if run.found[i] is not None or (s.call is None and s.op is None and s.method == "forward"):
            continue  # a plain module site: the engine's own check names it
        where, ran = f"{s.path}.{s.method}", run.method_calls.get((id(s.module), s.method), 0)
        calls = run.op_calls.get((id(s.module), s.method, s.op), [])
        if not ran:
            raise FcauditError(f"site {s.name!r}: {where} did not run in a forward pass; pick a method the model calls")
        if s.op is not None and not calls:
            raise FcauditError(f"site {s.name!r}: {where} made no call of {s.op!r} in one forward pass; name an op it "
                               "makes (e.g. 'matmul' for @, 'sigmoid', 'softmax', 'einsum')")
        n, saw = (ran, f"ran {ran} time(s) in one forward pass") if s.op is None else \
            (len(calls), f"made {len(calls)} call(s) of {s.op!r} ({'; '.join(calls)})")
        raise FcauditError(f"site {s.name!r}: {where} {saw}, so call={s.call} does not exist; pass call=0..{n - 1}")


def recompute(sites: Sequence[Site], calls: Sequence[tuple | None], batch: int, token: int,
              which: Sequence[int]) -> dict[int, torch.Tensor]:
    """The live controller's canonical output on recorded site calls (args, kwargs): what sites `which` would have
    emitted on that trajectory. Call outside a replay, so the original methods run."""
    out = {}
    for i in which:
        site, call = sites[i], calls[i]
        if call is None:
            raise FcauditError(f"site {site.name!r} did not run in the recorded pass")
        fn = getattr(site.module, site.method) if site.op is None else \
            next((getattr(m, site.op) for m in (torch.Tensor, torch, torch.nn.functional) if hasattr(m, site.op)), None)
        if fn is None:
            raise FcauditError(f"site {site.name!r}: no torch function {site.op!r} to recompute it with")
        out[i] = site.encode(fn(*call[0], **call[1]), batch, token)
    return out
