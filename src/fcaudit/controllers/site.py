"""Controller sites: the modules whose forward output is a layer's coefficient tensor, and how to read and replace it.

A site's output is described by an einops layout ("batch token", "stream batch token source",
"(batch token) expert"). The engine sees only the canonical per-layer tensor [batch, token, stream, source];
a missing stream or source axis becomes a unit axis, and any axis name other than batch/token/stream is the
source axis (an expert, a source layer, a top-k slot). Capture = forward hooks; replay = the site's forward is
replaced by one returning the supplied coefficients, so the controller's computation does not run.
"""

from __future__ import annotations

import fnmatch
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch
from einops import EinopsError, rearrange
from torch import nn

from fcaudit.errors import FcauditError

CANONICAL = ("batch", "token", "stream", "source")


def path_matches(path: str, pattern: str) -> bool:
    """Glob over module paths: `*` matches within one dotted component ("blocks.*.gate" does not match
    "blocks.0.mlp.gate"); a pattern containing `**` is matched against the whole path with plain fnmatch."""
    if "**" in pattern:
        return fnmatch.fnmatchcase(path, pattern.replace("**", "*"))
    parts, pats = path.split("."), pattern.split(".")
    return len(parts) == len(pats) and all(fnmatch.fnmatchcase(a, p) for a, p in zip(parts, pats))


@dataclass(frozen=True)
class Layout:
    """One einops layout of a site output and its rearrange patterns to and from the canonical layout."""

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

    @property
    def canonical(self) -> str:
        names = self.pattern.replace("(", " ").replace(")", " ").split()
        stream = "stream" if "stream" in names else "1"
        return f"batch token {stream} {self.source or '1'}"

    def to_canonical(self, x: torch.Tensor, batch: int, token: int, where: str = "site") -> torch.Tensor:
        try:
            return rearrange(x, f"{self.pattern} -> {self.canonical}", batch=batch, token=token)
        except EinopsError:
            raise FcauditError(f"{where} output of shape {tuple(x.shape)} does not fit layout {self.pattern!r} "
                               f"for batch={batch}, token={token}; pass the layout that names its axes") from None

    def from_canonical(self, c: torch.Tensor, memory_order: tuple[int, ...] | None = None) -> torch.Tensor:
        """Native layout as a fresh tensor (downstream in-place ops cannot touch the cache), its dims laid out in
        memory in `memory_order` (outermost first) as the captured output was, so kernels see the same strides."""
        x = rearrange(c, f"{self.canonical} -> {self.pattern}")
        if memory_order is None or len(memory_order) != x.dim():
            return x.clone(memory_format=torch.contiguous_format)
        inverse = sorted(range(len(memory_order)), key=memory_order.__getitem__)
        return x.permute(memory_order).clone(memory_format=torch.contiguous_format).permute(inverse)


def memory_order(t: torch.Tensor) -> tuple[int, ...]:
    """Dims from outermost to innermost in memory (largest stride first; size-1 and broadcast dims keep order)."""
    return tuple(sorted(range(t.dim()), key=lambda d: (-t.stride(d) if t.shape[d] > 1 else 0, d)))


@dataclass
class Site:
    """A module whose output is the coefficient tensor of one target layer.

    `layout` is a tuple of Layouts when the module returns a tuple (e.g. an HF MoE router returning
    (logits, top-k weights, top-k indices)); the engine currently audits single-tensor sites only.
    """

    path: str
    module: nn.Module = field(repr=False)
    layout: Layout | tuple[Layout, ...] = field(default=None)
    memory_order: tuple[int, ...] | None = field(default=None, repr=False)  # of the captured output

    def canonical(self, out, batch: int, token: int) -> torch.Tensor:
        if isinstance(self.layout, tuple):
            raise FcauditError(f"site {self.path!r} has a tuple layout; tuple outputs are not supported yet, "
                               "point the pattern at a module returning one tensor")
        if not isinstance(out, torch.Tensor):
            raise FcauditError(f"site {self.path!r} returned {type(out).__name__}, not a tensor; "
                               "point the pattern at the module that returns the coefficients")
        self.memory_order = memory_order(out)
        return self.layout.to_canonical(out, batch, token, where=f"site {self.path!r}")


@dataclass
class Controller:
    """The ordered controller sites of one model plus the names of its static/reference conditions."""

    sites: list[Site]
    static_name: str = "StaticProfile"
    reference: str = "global_mean"  # or "source_uniform_mean"
    reference_name: str = "GlobalMean"
    description: str = ""

    def __post_init__(self):
        if self.reference not in ("global_mean", "source_uniform_mean"):
            raise FcauditError(f"unknown reference {self.reference!r}; use 'global_mean' or 'source_uniform_mean'")
        if not self.sites:
            raise FcauditError("a controller needs at least one site; check the module pattern")

    @classmethod
    def from_modules(cls, model: nn.Module, pattern: str, layout: str | Sequence[str], *,
                     static_name: str = "StaticProfile", reference: str = "global_mean",
                     reference_name: str | None = None) -> "Controller":
        """Sites = the modules whose `named_modules()` path matches the glob `pattern`, in model order."""
        parsed = tuple(Layout.parse(p) for p in layout) if not isinstance(layout, str) else Layout.parse(layout)
        sites = [Site(name, m, parsed) for name, m in model.named_modules() if name and path_matches(name, pattern)]
        if not sites:
            sample = [n for n, _ in model.named_modules() if n][:6]
            raise FcauditError(f"pattern {pattern!r} matches no module of {type(model).__name__}; "
                               f"module paths look like {sample}")
        if reference_name is None:
            reference_name = "GlobalMean" if reference == "global_mean" else "SourceUniformMean"
        desc = f"{type(model).__name__}:{pattern}:{layout if isinstance(layout, str) else tuple(layout)}"
        return cls(sites, static_name, reference, reference_name, desc)

    @property
    def labels(self) -> dict[str, str]:
        return {"StaticProfile": self.static_name, "StructureRemoved": self.reference_name}

    def describe(self) -> dict:
        return {"description": self.description, "sites": [s.path for s in self.sites],
                "layouts": [s.layout.pattern if isinstance(s.layout, Layout) else [l.pattern for l in s.layout]
                            for s in self.sites],
                "reference": self.reference, "labels": self.labels}

    @contextmanager
    def capture(self, batch: int, token: int) -> Iterator[list[torch.Tensor | None]]:
        """Record each site's output (canonical, detached) during one forward pass of `batch` x `token` ids."""
        found: list[torch.Tensor | None] = [None] * len(self.sites)

        def hook_for(i: int, site: Site):
            def hook(module, args, out):
                if found[i] is not None:
                    raise FcauditError(f"site {site.path!r} ran twice in one forward pass; "
                                       "pick a module that produces one layer's coefficients once")
                found[i] = site.canonical(out, batch, token).detach().clone()  # the model may modify out in place
            return hook

        handles = [s.module.register_forward_hook(hook_for(i, s)) for i, s in enumerate(self.sites)]
        try:
            yield found
        finally:
            for h in handles:
                h.remove()

    @contextmanager
    def replay(self, coeffs: Sequence[torch.Tensor]) -> Iterator[None]:
        """Within the context each site's forward returns the given canonical coefficients in native layout.

        The site's own computation (the controller) does not run. Each original forward is restored on exit,
        also when the body raises.
        """
        if len(coeffs) != len(self.sites):
            raise FcauditError(f"replay got {len(coeffs)} coefficient tensors for {len(self.sites)} sites")
        saved = []
        try:
            for site, c in zip(self.sites, coeffs):
                native = site.layout.from_canonical(c, site.memory_order)
                saved.append((site.module, site.module.__dict__.get("forward")))
                site.module.forward = (lambda t: lambda *args, **kwargs: t)(native)
            yield
        finally:
            for module, original in saved:
                if original is None:
                    del module.forward
                else:
                    module.forward = original
