"""Where a site's output goes in one forward pass, for the pre-write checks: which later modules take it (a hidden
state does), which ops contract it (hidden-width features do), and which ops rank or threshold it (a router's scores
are ranked, a gate's are not), with what those rankings decided.

A tensor carries a site's output when it is that output, or the result of a torch function of a carrier with as
many elements (a view, an elementwise op) whose other tensors are smaller (a per-channel scale) or, for a sum, of any
size (the residual stream); a shape-only op (`reshape_as`, `view_as`, `expand_as`) carries its first argument, `where`
its values and `cat` / `stack` their parts. A product with a tensor as large stops it: a coefficient acting on
activations.

A module takes a site when its first floating-point input (what it transforms) carries it and its output no longer
does: a later argument (a gated norm's gate, a mask) is followed through the module's ops like any other tensor, and a
module whose output still carries the site (an activation, a norm, a residual block) leaves it to those inside or after.
"""

from __future__ import annotations

import re
from contextlib import ExitStack
from typing import Any, Sequence

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from fcaudit.controllers.codecs import AXES, Layout
from fcaudit.controllers.sites import first_tensor, leaves, op_name

SUMS = {"add", "add_", "sub", "sub_"}  # op_name of `x + h`, `x += h`, `x - h`, `1 - h`
SHAPED = {"reshape_as", "view_as", "expand_as", "type_as"}  # the other argument gives a shape or dtype only
JOINED = {"cat", "concat", "concatenate", "stack", "hstack", "vstack"}
CONTRACTIONS = {"matmul", "mm", "bmm", "linear", "einsum", "tensordot", "bilinear", "inner"}
COMPARISONS = {"gt", "lt", "ge", "le", "greater", "less", "greater_equal", "less_equal"}
ALONG = {"topk": 2, "kthvalue": 2, "sort": 1, "argsort": 1, "argmax": 1, "argmin": 1}  # where each takes its dim
RANKS = COMPARISONS | set(ALONG)


def batch_token_axes(site) -> tuple[int, int] | None:
    """The batch and token axes of a site's raw output where its layout names them as axes of their own."""
    if not isinstance(site.codec, Layout):
        return None
    axes = re.findall(AXES, site.codec.pattern)
    return (axes.index("batch"), axes.index("token")) if {"batch", "token"} <= set(axes) else None


def decided(name: str, args: tuple, kwargs: dict, out: Any, token: int) -> torch.Tensor | None:
    """A ranking op's decisions with the input's shape: a comparison's mask; for a top-k, argmax or kth value along
    the token axis the tokens it picked, for a sort along it each token's rank; along another axis its indices per
    token. None where the op's dims cannot be read (an argmax over every element)."""
    x = args[0]
    if name in COMPARISONS:
        return out if isinstance(out, torch.Tensor) and out.shape == x.shape else None
    at = ALONG[name]
    dim = kwargs.get("dim", args[at] if len(args) > at else (None if name in ("argmax", "argmin") else -1))
    if not isinstance(dim, int):
        return None
    dim %= x.dim()
    index = out if isinstance(out, torch.Tensor) else getattr(out, "indices", None)
    if index is None:
        return None
    if index.dim() < x.dim():
        index = index.unsqueeze(dim)
    if dim != token:
        return index
    if name in ("sort", "argsort"):  # each position's rank
        ranks = torch.arange(index.shape[dim], device=index.device)
        ranks = ranks.view([-1 if d == dim else 1 for d in range(x.dim())]).expand_as(index)
        return torch.empty_like(index).scatter_(dim, index, ranks)
    return torch.zeros(x.shape, dtype=torch.bool, device=x.device).scatter_(dim, index, True)  # the picked tokens


class Flow(TorchFunctionMode):
    """Follows the outputs of sites `watch` (hidden-width ones) and `rank` (soft coefficients) through one forward
    pass: `feeds` (watched sites a later module takes and transforms), `contracted` (watched sites an op
    contracts), `ranked` (site -> the ranking op that reads it) and `decisions` (site -> what those rankings decided,
    with the raw output's shape, where `axes` names its batch and token axes)."""

    def __init__(self, outputs: list, watch: Sequence[int], rank: Sequence[int] = (),
                 axes: dict[int, tuple[int, int]] | None = None):
        super().__init__()
        self.outputs, self.pending, self.watch, self.rank = outputs, set(watch) | set(rank), set(watch), set(rank)
        self.axes = axes or {}
        self.feeds: set[int] = set()
        self.taking: list[frozenset[int]] = []  # per module running: the sites its first input carries
        self.contracted: set[int] = set()
        self.ranked: dict[int, str] = {}
        self.decisions: dict[int, list[torch.Tensor]] = {}
        self.carriers: dict[int, tuple[torch.Tensor, frozenset[int]]] = {}  # id -> (the tensor, its sites)
        self.raw_shape: dict[int, torch.Size] = {}

    def sites_of(self, t: Any) -> frozenset[int]:
        """The sites `t` carries (a hidden-width site only until a module takes it)."""
        for i in [i for i in self.pending if self.outputs[i] is not None]:  # a site that ran since the last look
            self.pending.discard(i)
            out = first_tensor(self.outputs[i][0])
            if out is not None:
                self.carriers[id(out)] = (out, frozenset({i}))
                self.raw_shape[i] = out.shape
        held = self.carriers.get(id(t))
        return held[1] - (self.feeds - self.rank) if held is not None and held[0] is t else frozenset()

    def _carried(self, name: str, args: tuple, kwargs: dict, out: torch.Tensor) -> frozenset[int]:
        if name in SHAPED and args:
            return self.sites_of(args[0])
        if name in JOINED and args and isinstance(args[0], (list, tuple)):
            return frozenset().union(*(self.sites_of(t) for t in args[0]))
        tensors = [t for _, t in leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        tensors = tensors[1:] if name == "where" else tensors  # its condition says where, not what
        carrying = {id(t): self.sites_of(t) for t in tensors if t.numel() == out.numel()}
        sites = frozenset().union(*carrying.values())
        if sites and (name in SUMS or all(t.numel() < out.numel() for t in tensors if not carrying.get(id(t)))):
            return sites
        return frozenset()

    def _read(self, name: str, args: tuple, kwargs: dict, out: Any) -> None:
        """What a contraction or a ranking op makes of the sites its inputs carry."""
        if name in CONTRACTIONS:
            self.contracted |= self.watch & frozenset().union(*(self.sites_of(t) for _, t in leaves((args, kwargs))))
            return
        inputs = args[:2] if name in COMPARISONS else args[:1]
        for x in inputs:
            for i in self.rank & self.sites_of(x):
                self.ranked.setdefault(i, name)
                if self._aligned(i, x):
                    d = decided(name, (x, *args[1:]) if x is args[0] else (x, args[0]), kwargs, out, self.axes[i][1])
                    if d is not None:
                        self.decisions.setdefault(i, []).append(d.movedim(self.axes[i], (0, 1)))

    def _aligned(self, i: int, x: torch.Tensor) -> bool:
        """Whether carrier x of site i keeps the raw output's batch and token axes where they were (an elementwise
        op, a squeeze of unit axes after them)."""
        raw = self.raw_shape.get(i)
        if i not in self.axes or raw is None or x.numel() != raw.numel():
            return False
        b, t = self.axes[i]
        return x.dim() > max(b, t) and x.shape[b] == raw[b] and x.shape[t] == raw[t]

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = op_name(func)
        if name in CONTRACTIONS or name in RANKS:
            self._read(name, args, kwargs, out)
        if isinstance(out, torch.Tensor):
            sites = self._carried(name, args, kwargs, out)
            if sites:
                self.carriers[id(out)] = (out, sites | self.sites_of(out))
        return out

    def consumer(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """A module's forward pre-hook: the watched sites its first floating-point input carries (positional or
        keyword: the tensor it transforms); a later input (a gate, a mask, a scale) is left to its ops."""
        self.taking.append(self.watch & self.sites_of(first_tensor((args, kwargs), floating=True)))

    def consumed(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        """A module's forward hook: the sites it took that its output no longer carries feed it (one that passes a
        site on elementwise, an activation or a norm, leaves it to the modules after it)."""
        fed = self.taking.pop() - frozenset().union(*(self.sites_of(t) for _, t in leaves(output)))
        if fed:
            self.feeds |= fed
            self.carriers = {k: (t, s) for k, (t, s) in self.carriers.items() if s - (self.feeds - self.rank)}

    def following(self, model: nn.Module) -> ExitStack:
        """The mode and every module's pre-hook, active for one pass (nothing is followed without sites to watch)."""
        stack = ExitStack()
        if self.pending:
            stack.enter_context(self)
            for m in model.modules():
                stack.callback(m.register_forward_pre_hook(self.consumer, with_kwargs=True).remove)
                stack.callback(m.register_forward_hook(self.consumed, with_kwargs=True, always_call=True).remove)
        return stack
