"""Controller sites: the modules whose forward output is a layer's coefficients, and how to read and replace them.

A site is a module plus a **codec**: `encode(output) -> canonical [batch, token, stream, source]` and
`decode(canonical, meta) -> the module's output` (a tensor, a tuple, any structure). The default codec is an einops
layout ("batch token", "stream batch token source", "(batch token) expert"): a missing stream or source axis becomes
a unit axis, and any axis name other than batch/token/stream is the source axis (an expert, a source layer).

Capture = forward hooks that encode each site's output. Replay = for the duration of a context manager each site's
forward is replaced by a function returning the decoded coefficients, so the controller's computation does not run;
the original forward is restored on exit and on error. Both run the model within the controller's `context` where it
has one: a model whose output path can share work with its controller (FeatureGate's tiled attention) takes there a
path that shares none, the same in capture and in replay. The engine sees only canonical tensors and never a model
class.
"""

from __future__ import annotations

import fnmatch
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Callable, Iterator, Sequence

import torch
from einops import EinopsError, rearrange
from torch import nn

from fcaudit.errors import FcauditError
from fcaudit.protocol import Coeffs, Controllers, REFERENCES

def path_matches(path: str, pattern: str) -> bool:
    """Glob over module paths: `*` matches within one dotted component ("blocks.*.gate" does not match
    "blocks.0.mlp.gate"); a pattern containing `**` is matched against the whole path with plain fnmatch."""
    if "**" in pattern:
        return fnmatch.fnmatchcase(path, pattern.replace("**", "*"))
    parts, pats = path.split("."), pattern.split(".")
    return len(parts) == len(pats) and all(fnmatch.fnmatchcase(a, p) for a, p in zip(parts, pats))


def memory_order(t: torch.Tensor) -> tuple[int, ...]:
    """Dims from outermost to innermost in memory (largest stride first; size-1 and broadcast dims keep order)."""
    return tuple(sorted(range(t.dim()), key=lambda d: (-t.stride(d) if t.shape[d] > 1 else 0, d)))


def with_memory_order(x: torch.Tensor, order: Sequence[int] | None) -> torch.Tensor:
    """A fresh copy of x (downstream in-place ops cannot touch the cache) whose dims are laid out in memory in
    `order` (outermost first), as the captured output was, so kernels see the same strides."""
    if order is None or len(order) != x.dim() or all(d == i for i, d in enumerate(order)):
        return x.clone(memory_format=torch.contiguous_format)
    inverse = sorted(range(len(order)), key=order.__getitem__)
    return x.permute(tuple(order)).clone(memory_format=torch.contiguous_format).permute(inverse)


class Codec:
    """How one site's output maps to canonical coefficients [batch, token, stream, source] and back."""

    top_k: int | None = None  # a top-k router's experts per token (the protocol then offers StaticTopK)

    def encode(self, output: Any, batch: int, token: int) -> torch.Tensor:
        """Canonical coefficients of one output: a fresh tensor, never a view the model could modify in place."""
        raise NotImplementedError

    def meta(self, output: Any) -> dict:
        """What `decode` needs beyond the canonical tensor (dtypes, memory order), read from one captured output."""
        return {}

    def decode(self, canonical: torch.Tensor, meta: dict) -> Any:
        """The module's output rebuilt from (possibly transformed) canonical coefficients, for any batch size."""
        raise NotImplementedError

    def describe(self) -> str:
        return type(self).__name__


@dataclass(frozen=True)
class Layout(Codec):
    """An einops layout of a single-tensor site output: the default codec."""

    pattern: str
    source: str | None  # name of the axis that plays the source role, if any

    @classmethod
    def parse(cls, pattern: str) -> "Layout":
        names = pattern.replace("(", " ").replace(")", " ").split()
        if sorted(set(names)) != sorted(names):
            raise FcauditError(f"layout {pattern!r} repeats an axis name; name each axis once, e.g. 'batch token'")
        if "batch" not in names or "token" not in names:
            raise FcauditError(f"layout {pattern!r} must name a 'batch' and a 'token' axis, e.g. '(batch token) expert'")
        extra = [n for n in names if n not in ("batch", "token", "stream")]
        if len(extra) > 1:
            raise FcauditError(f"layout {pattern!r} has more than one source-like axis {extra}; "
                               "merge them with parentheses, e.g. '(head expert)'")
        return cls(pattern, extra[0] if extra else None)

    @cached_property
    def canonical(self) -> str:
        names = self.pattern.replace("(", " ").replace(")", " ").split()
        stream = "stream" if "stream" in names else "1"
        return f"batch token {stream} {self.source or '1'}"

    @cached_property
    def _decoding(self) -> str:
        return f"{self.canonical} -> {self.pattern}"

    @property
    def scalar(self) -> bool:
        """One coefficient per (batch, token): a scalar gate."""
        return self.source is None and "stream" not in self.pattern.replace("(", " ").replace(")", " ").split()

    def to_canonical(self, x: torch.Tensor, batch: int, token: int, where: str = "site") -> torch.Tensor:
        if not isinstance(x, torch.Tensor):
            raise FcauditError(f"{where} returned {type(x).__name__}, not a tensor; give the site a codec for its "
                               "output structure (Controller.from_modules(..., codec=...)) or point the pattern at "
                               "the module that returns the coefficients")
        try:
            return rearrange(x, f"{self.pattern} -> {self.canonical}", batch=batch, token=token)
        except EinopsError:
            raise FcauditError(f"{where} output of shape {tuple(x.shape)} does not fit layout {self.pattern!r} "
                               f"for batch={batch}, token={token}; pass the layout that names its axes") from None

    def from_canonical(self, c: torch.Tensor, memory_order: tuple[int, ...] | None = None) -> torch.Tensor:
        return with_memory_order(rearrange(c, self._decoding), memory_order)

    def encode(self, output, batch: int, token: int) -> torch.Tensor:
        return self.to_canonical(output, batch, token).detach().clone()  # the model may modify `output` in place

    def meta(self, output) -> dict:
        return {"memory_order": memory_order(output)}

    def decode(self, canonical: torch.Tensor, meta: dict) -> torch.Tensor:
        return self.from_canonical(canonical, meta.get("memory_order"))

    def describe(self) -> str:
        return self.pattern


@dataclass
class Site:
    """A module whose output is the coefficient tensor of one target layer, with the codec that reads it."""

    path: str
    module: nn.Module = field(repr=False)
    codec: Codec = field(default=None)
    meta: dict | None = field(default=None, repr=False)  # codec metadata of the last captured output
    device: torch.device | None = field(default=None, repr=False)  # where that output was (the site's device)
    dtype: torch.dtype | None = field(default=None, repr=False)  # its precision (a codec may widen it, e.g. bf16)

    def encode(self, out, batch: int, token: int) -> torch.Tensor:
        try:
            c = self.codec.encode(out, batch, token)
        except FcauditError as e:
            raise FcauditError(f"site {self.path!r}: {e}") from None
        if c.dim() != 4 or tuple(c.shape[:2]) != (batch, token):
            raise FcauditError(f"site {self.path!r}: codec {self.codec.describe()} gave shape {tuple(c.shape)}, "
                               f"not [batch={batch}, token={token}, stream, source]; fix the codec")
        return c

    def remember(self, out) -> None:
        """Keep what decoding needs (memory order, dtypes, device) from one captured output; replays decode with it."""
        self.meta = self.codec.meta(out)
        first = _first_tensor(out)
        self.device = first.device if first is not None else None
        floats = _first_tensor(out, floating=True)
        self.dtype = floats.dtype if floats is not None else None

    def decode(self, c: torch.Tensor):
        """The site's output from canonical coefficients, on the device its captured output was on (a model spread
        over devices by a device_map computes each layer on its own)."""
        if self.meta is None:
            raise FcauditError(f"site {self.path!r} has no captured output to replay into; capture a batch first")
        if self.device is not None and c.device != self.device:
            c = c.to(self.device)
        return self.codec.decode(c, self.meta)


def _first_tensor(out, floating: bool = False) -> torch.Tensor | None:
    """The first tensor (floating-point, with `floating`) in a module output: a tensor, or a tuple, list or dict
    holding tensors."""
    if isinstance(out, torch.Tensor):
        return out if out.is_floating_point() or not floating else None
    items = out.values() if isinstance(out, dict) else out if isinstance(out, (tuple, list)) else ()
    return next((t for t in (_first_tensor(i, floating) for i in items) if t is not None), None)


def _codec(layout: str | Codec | None, codec: Codec | None) -> Codec:
    if codec is not None:
        return codec
    if isinstance(layout, Codec):
        return layout
    if isinstance(layout, str):
        return Layout.parse(layout)
    raise FcauditError("describe the site output: pass layout='batch token' (an einops layout of a tensor) or "
                       "codec=... for a tuple or other structured output")


@dataclass
class Controller:
    """The ordered controller sites of one model plus the names of its static/reference conditions."""

    sites: list[Site]
    static_name: str = "StaticProfile"
    reference: str = "global_mean"  # or "source_uniform_mean" (protocol.REFERENCES)
    reference_name: str = "GlobalMean"
    description: str = ""
    context: Callable[[], AbstractContextManager] = nullcontext  # what every capture and replay pass runs within

    def __post_init__(self):
        if self.reference not in REFERENCES:
            raise FcauditError(f"unknown reference {self.reference!r}; use one of {', '.join(REFERENCES)}")
        if not self.sites:
            raise FcauditError("a controller needs at least one site; check the module pattern")

    @classmethod
    def from_modules(cls, model: nn.Module, pattern: str, layout: str | Codec | None = None, *,
                     codec: Codec | None = None, static_name: str = "StaticProfile", reference: str = "global_mean",
                     reference_name: str | None = None,
                     context: Callable[[], AbstractContextManager] | None = None) -> "Controller":
        """Sites = the modules whose `named_modules()` path matches the glob `pattern`, in model order, each read
        with `codec` (or the einops `layout` of a single-tensor output). `context`: see Controller.context (its name
        joins the description, so an audit made under another one is not resumed with this one)."""
        chosen = _codec(layout, codec)
        sites = [Site(name, m, chosen) for name, m in model.named_modules() if name and path_matches(name, pattern)]
        shared = [name for name, _ in model.named_modules(remove_duplicate=False) if name and path_matches(name, pattern)
                  and name not in {s.path for s in sites}]
        if shared:  # named_modules lists a module once, under its first path: one module computing several layers
            raise FcauditError(f"pattern {pattern!r} matches {shared[0]!r}, a module that is also at another path: "
                               "fcaudit audits one module per layer (each replayed with its own coefficients); give "
                               "each layer its own controller module")
        if not sites:
            sample = [n for n, _ in model.named_modules() if n][:6]
            raise FcauditError(f"pattern {pattern!r} matches no module of {type(model).__name__}; "
                               f"module paths look like {sample}")
        if reference_name is None:
            reference_name = "GlobalMean" if reference == "global_mean" else "SourceUniformMean"
        described = f"{type(model).__name__}:{pattern}:{chosen.describe()}"
        if context is None:
            return cls(sites, static_name, reference, reference_name, described)
        return cls(sites, static_name, reference, reference_name, f"{described}:{context.__name__}", context)

    @property
    def labels(self) -> dict[str, str]:
        return {"StaticProfile": self.static_name, "StructureRemoved": self.reference_name}

    @property
    def info(self) -> Controllers:
        """What the protocol's conditions need to know about this controller."""
        return Controllers(self.reference, tuple(s.codec.top_k for s in self.sites))

    def describe(self) -> dict:
        return {"description": self.description, "sites": [s.path for s in self.sites],
                "codecs": [s.codec.describe() for s in self.sites], "reference": self.reference,
                "labels": self.labels}

    @contextmanager
    def capture(self, batch: int, token: int, remember: bool = True) -> Iterator[list[torch.Tensor | None]]:
        """Record each site's output (canonical, detached) during one forward pass of `batch` x `token` ids.

        With `remember` each site also keeps the codec metadata of this output for later replays (the audit engine
        takes it once, from a probe of the first batch, so every replay decodes alike)."""
        found: list[torch.Tensor | None] = [None] * len(self.sites)

        def hook_for(i: int, site: Site):
            def hook(module, args, out):
                if found[i] is not None:
                    raise FcauditError(f"site {site.path!r} ran twice in one forward pass; "
                                       "pick a module that produces one layer's coefficients once")
                found[i] = site.encode(out, batch, token)
                if remember:
                    site.remember(out)
            return hook

        handles = [s.module.register_forward_hook(hook_for(i, s)) for i, s in enumerate(self.sites)]
        try:
            with self.context():
                yield found
        finally:
            for h in handles:
                h.remove()

    @contextmanager
    def replay(self, coeffs: Coeffs) -> Iterator[None]:
        """Within the context each site's forward returns its decoded canonical coefficients.

        The site's own computation (the controller) does not run. Each original forward is restored on exit,
        also when the body raises.
        """
        if len(coeffs) != len(self.sites):
            raise FcauditError(f"replay got {len(coeffs)} coefficient tensors for {len(self.sites)} sites")
        saved = []
        try:
            for site, c in zip(self.sites, coeffs):
                native = site.decode(c)
                saved.append((site.module, site.module.__dict__.get("forward")))
                site.module.forward = (lambda out: lambda *args, **kwargs: out)(native)
            with self.context():
                yield
        finally:
            for module, original in saved:
                if original is None:
                    del module.forward
                else:
                    module.forward = original

    @contextmanager
    def recording_inputs(self) -> Iterator[list[tuple | None]]:
        """Keep each site's call arguments of one forward pass (e.g. a replay pass), for `recompute`."""
        inputs: list[tuple | None] = [None] * len(self.sites)

        def hook_for(i: int):
            def hook(module, args, kwargs):
                inputs[i] = (args, kwargs)
            return hook

        handles = [s.module.register_forward_pre_hook(hook_for(i), with_kwargs=True) for i, s in enumerate(self.sites)]
        try:
            yield inputs
        finally:
            for h in handles:
                h.remove()

    def recompute(self, inputs: list[tuple | None], batch: int, token: int,
                  which: Sequence[int] | None = None) -> dict[int, torch.Tensor]:
        """The live controller's canonical output on recorded site inputs: what sites `which` (default all) would
        have emitted on that trajectory. Call outside `replay`, so the original forwards run."""
        out = {}
        for i in (range(len(self.sites)) if which is None else which):
            site, call = self.sites[i], inputs[i]
            if call is None:
                raise FcauditError(f"site {site.path!r} did not run in the recorded pass")
            args, kwargs = call
            out[i] = site.encode(site.module.forward(*args, **kwargs), batch, token)
        return out
