"""Controller sites: where a layer's coefficients appear in an unmodified model, and how to read and replace them.

A site is a module's method (or a torch function called while it runs, watched by a TorchFunctionMode) plus a codec
to and from canonical [batch, token, stream, source]. Capture and replay wrap the method for one pass, so the engine
sees only canonical tensors, never a model class.
"""

from __future__ import annotations

import fnmatch
import inspect
import re
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from functools import cached_property
from operator import attrgetter
from typing import Any, Callable, Hashable, Iterator, NamedTuple, Sequence

import torch
from einops import EinopsError, rearrange
from torch import nn
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode

from fcaudit.errors import FcauditError
from fcaudit.protocol import RECORD_COLUMNS, Coeffs, Controllers, REFERENCES


def path_matches(path: str, pattern: str) -> bool:
    """Glob over module paths: `*` matches within one dotted component ("blocks.*.gate" does not match
    "blocks.0.mlp.gate"); a pattern containing `**` is matched against the whole path with plain fnmatch."""
    if "**" in pattern:
        return fnmatch.fnmatchcase(path, pattern.replace("**", "*"))
    parts, pats = path.split("."), pattern.split(".")
    return len(parts) == len(pats) and all(fnmatch.fnmatchcase(a, p) for a, p in zip(parts, pats))


class Codec:
    """How one site's output maps to canonical coefficients [batch, token, stream, source] and back.

    Subclass it for a site whose output is not one tensor (a tuple, a dataclass, a router's indices and weights);
    a single tensor takes a `Layout` (`layout="batch token"`). Set `top_k` on a top-k router's codec so that the
    audit offers StaticTopK.

    Examples
    --------
    A gate module that returns (gate [batch, token], an auxiliary loss):

    >>> class GateAndLoss(fca.Codec):
    ...     def encode(self, output, batch, token):
    ...         return output[0].detach().reshape(batch, token, 1, 1).clone()
    ...     def decode(self, canonical, meta):
    ...         g = canonical.reshape(canonical.shape[:2])
    ...         return g, g.mean()
    >>> codec = GateAndLoss()
    >>> c = codec.encode((torch.full((2, 3), 0.5), torch.tensor(0.5)), batch=2, token=3)
    >>> c.shape
    torch.Size([2, 3, 1, 1])
    >>> codec.decode(c, {})[1]
    tensor(0.5000)

    It is passed as `fca.Controller.from_modules(model, "gates.*", codec=GateAndLoss())`.
    """

    top_k: int | None = None  # a top-k router's experts per token
    routing: str | None = None  # "tokens": the site chooses which tokens a block runs on
    counts: tuple[str, ...] = ()  # names of the counts `executed` reports: extra columns of the audit's records

    def executed(self, canonical: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Per window, for a module that does not run exactly its nonzero coefficients (a capacity router drops its
        excess): the sources it runs [B] and its `counts` [B, len(counts)], float64. None: the nonzero ones run."""
        return None

    def encode(self, output: Any, batch: int, token: int) -> torch.Tensor:
        """Canonical coefficients of one output: a fresh tensor, never a view the model could modify in place."""
        raise NotImplementedError

    def meta(self, output: Any) -> dict:
        """What `decode` needs beyond the canonical tensor (dtypes, memory order), read from one captured output."""
        return {}

    def decode(self, canonical: torch.Tensor, meta: dict) -> Any:
        """The site's output rebuilt from (possibly transformed) canonical coefficients, for any batch size. A third
        argument `inputs` (a `Call` of the site's live args) is passed to a codec that takes one."""
        raise NotImplementedError

    def describe(self) -> str:
        return type(self).__name__


@dataclass(frozen=True)
class Layout(Codec):
    """An einops layout of a single-tensor site output: the default codec.

    Name the output's axes: `batch` and `token` always, `stream` where the site has several residual streams, and
    one source axis (an expert, a source layer, or a merged group "(a b)"); a missing one becomes a unit axis.

    Examples
    --------
    A router's weights [batch * token, experts] become canonical [batch, token, stream, source]:

    >>> router = fca.Layout.parse("(batch token) expert")
    >>> router.source
    'expert'
    >>> router.encode(torch.rand(2 * 3, 4), batch=2, token=3).shape
    torch.Size([2, 3, 1, 4])
    >>> fca.Layout.parse("batch token").scalar  # one coefficient per token: a gate
    True
    """

    pattern: str  # einops pattern (a merged source group renamed to one axis)
    source: str | None  # name of the axis that plays the source role, if any
    given: str | None = None  # the pattern as written, when it differs

    @classmethod
    def parse(cls, pattern: str) -> "Layout":
        """Axes are names, merged groups "(a b)" and unit axes "1" or "()"."""
        if re.sub(r"\([^()]*\)|[^\s()]+|\s", "", pattern):
            raise FcauditError(f"layout {pattern!r} has unbalanced or nested parentheses; write axes, merged groups "
                               "'(a b)' and unit axes '1' or '()', e.g. 'batch token (view layer)'")
        names = [n for n in re.findall(r"[^\s()]+", pattern) if n != "1"]
        if len(set(names)) != len(names):
            raise FcauditError(f"layout {pattern!r} repeats an axis name; name each axis once, e.g. 'batch token'")
        if "batch" not in names or "token" not in names:
            raise FcauditError(f"layout {pattern!r} must name a 'batch' and a 'token' axis, e.g. '(batch token) expert'")
        roles = {"batch", "token", "stream"}
        axes = [(a, set(a.strip("()").split())) for a in re.findall(r"\([^()]*\)|[^\s()]+", pattern)]
        extra = [a for a, parts in axes if a not in ("1", "()") and not parts & roles]
        mixed = [a for a, parts in axes if a.startswith("(") and parts & roles and parts - roles]
        if len(extra) > 1 or mixed:
            raise FcauditError(f"layout {pattern!r} has more than one source-like axis "
                               f"{[a.strip('()') for a in extra] or mixed}; merge them with parentheses, e.g. "
                               "'(head expert)', apart from batch, token and stream")
        if not extra or not extra[0].startswith("("):
            return cls(pattern, extra[0] if extra else None)
        merged = "_".join(extra[0].strip("()").split())  # one axis named after its parts, so einops needs no sizes
        return cls(pattern.replace(extra[0], merged, 1), merged, pattern)

    @cached_property
    def canonical(self) -> str:
        stream = "stream" if "stream" in re.findall(r"[^\s()]+", self.pattern) else "1"
        return f"batch token {stream} {self.source or '1'}"

    @property
    def scalar(self) -> bool:
        """One coefficient per (batch, token): a scalar gate."""
        return self.canonical == "batch token 1 1"

    def encode(self, output, batch: int, token: int) -> torch.Tensor:
        if not isinstance(output, torch.Tensor):
            raise FcauditError(f"site returned {type(output).__name__}, not a tensor; give the site a codec for its "
                               "output structure (Controller.from_modules(..., codec=...)) or point the pattern at "
                               "the module that returns the coefficients")
        try:
            c = rearrange(output, f"{self.pattern} -> {self.canonical}", batch=batch, token=token)
        except EinopsError:
            raise FcauditError(f"site output of shape {tuple(output.shape)} does not fit layout {self.pattern!r} "
                               f"for batch={batch}, token={token}; pass the layout that names its axes (unit axes "
                               "as '1', merged ones as '(a b)')") from None
        return c.detach().clone()  # the model may modify `output` in place

    def meta(self, output) -> dict:
        """Its dims from outermost to innermost in memory (largest stride first; size-1 dims keep their order)."""
        strides = [-stride if n > 1 else 0 for stride, n in zip(output.stride(), output.shape)]
        return {"memory_order": tuple(sorted(range(output.dim()), key=strides.__getitem__))}  # stable: ties in order

    def decode(self, canonical: torch.Tensor, meta: dict) -> torch.Tensor:
        """A fresh copy (in-place ops downstream cannot touch the cache) with the captured output's memory order, so
        kernels see the same strides."""
        x, order = rearrange(canonical, f"{self.canonical} -> {self.pattern}"), meta["memory_order"]
        inverse = sorted(range(len(order)), key=order.__getitem__)
        return x.permute(order).clone(memory_format=torch.contiguous_format).permute(inverse)

    def describe(self) -> str:
        return self.given or self.pattern


class Call(NamedTuple):
    """A site's live call (of the method, or of the op for an op site), as `decode(canonical, meta, inputs)` gets it."""

    args: tuple
    kwargs: dict
    module: nn.Module


OP_ALIASES = {"@": "matmul", "*": "mul", "+": "add", "-": "sub", "/": "div"}


def op_name(func: Callable) -> str:
    """A torch function's name as `from_ops` matches it: `x @ w` (Tensor.__matmul__, __rmatmul__), torch.matmul and
    Tensor.matmul are all "matmul"; `F.softmax`, `torch.softmax` and `Tensor.softmax` are "softmax"."""
    name = getattr(func, "__name__", "") or ""
    if name.startswith("__") and name.endswith("__") and len(name) > 4:
        name = name[2:-2]
        if name.startswith("r") and name[1:] in ("matmul", "mul", "add", "sub", "truediv"):
            name = name[1:]
    return "div" if name == "truediv" else name


@dataclass
class Site:
    """The coefficient tensor of one target layer: the output of a module's method, or the result of the torch
    function `op` while that method runs (its `call`-th call in one forward pass, else its only one), and its codec."""

    path: str
    module: nn.Module = field(repr=False)
    codec: Codec = None
    call: int | None = None
    method: str = "forward"
    op: str | None = None  # an op_name
    meta: dict | None = field(default=None, repr=False)  # codec metadata of the last remembered output
    device: torch.device | None = field(default=None, repr=False)  # that output's device
    dtype: torch.dtype | None = field(default=None, repr=False)  # its floating dtype (a codec may widen it)

    @property
    def name(self) -> str:
        """The site as a user names it: its module path, with the method, op and call where given."""
        where = self.path + (f".{self.method}" if self.method != "forward" else "")
        where += f":{self.op}" if self.op is not None else ""
        return where + (f"[call={self.call}]" if self.call is not None else "")

    @cached_property
    def reads_inputs(self) -> bool:
        """Whether the codec's decode takes the live call (a third positional parameter)."""
        kinds = [p.kind for p in inspect.signature(self.codec.decode).parameters.values()]
        P = inspect.Parameter
        return sum(k in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD) for k in kinds) >= 3 or P.VAR_POSITIONAL in kinds

    def encode(self, out, batch: int, token: int) -> torch.Tensor:
        try:
            c = self.codec.encode(out, batch, token)
        except FcauditError as e:
            raise FcauditError(f"site {self.name!r}: {e}") from None
        if c.dim() != 4 or tuple(c.shape[:2]) != (batch, token):
            raise FcauditError(f"site {self.name!r}: codec {self.codec.describe()} gave shape {tuple(c.shape)}, "
                               f"not [batch={batch}, token={token}, stream, source]; fix the codec")
        return c

    def remember(self, out) -> None:
        """Keep what decoding needs (memory order, dtypes, device) from one captured output; replays decode with it."""
        self.meta = self.codec.meta(out)
        self.device = getattr(first_tensor(out), "device", None)
        self.dtype = getattr(first_tensor(out, floating=True), "dtype", None)

    def decode(self, c: torch.Tensor, inputs: Call | None = None):
        """The site's output from canonical coefficients, on its captured output's device (a device_map's layer)."""
        c = c.to(self.device) if self.device is not None else c
        return self.codec.decode(c, self.meta, inputs) if self.reads_inputs else self.codec.decode(c, self.meta)


def leaves(x: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    """(path, leaf) of a site output: ".name" for a namedtuple field, "[i]" for a tuple or list item, "['k']" for a
    dict entry, "" for the output itself."""
    if isinstance(x, tuple) and hasattr(x, "_fields"):
        for name, v in zip(x._fields, x):
            yield from leaves(v, f"{path}.{name}")
    elif isinstance(x, (tuple, list)):
        for i, v in enumerate(x):
            yield from leaves(v, f"{path}[{i}]")
    elif isinstance(x, dict):
        for k, v in x.items():
            yield from leaves(v, f"{path}[{k!r}]")
    else:
        yield path, x


def first_tensor(out, floating: bool = False) -> torch.Tensor | None:
    """The first tensor (floating-point, with `floating`) among the leaves of a module output."""
    return next((t for _, t in leaves(out) if isinstance(t, torch.Tensor) and (t.is_floating_point() or not floating)),
                None)


# ---- token routers (controllers.routing holds the capacity router) -----------------------------------------------

class TokenRoute(Codec):
    """A router whose output is (scores [B, T], index [B, k]): a tuple or a namedtuple of those two fields (more
    fields are refused: a codec that reads the site's inputs is needed to rebuild them)."""

    routing = "tokens"

    def encode(self, output: Any, batch: int, token: int) -> torch.Tensor:
        if not isinstance(output, tuple) or len(output) != 2:
            raise FcauditError(f"a token router's output is (scores [batch, token], index [batch, k]); got "
                               f"{type(output).__name__}: write a codec for it")
        scores, index = output
        if tuple(scores.shape) != (batch, token) or index.dim() != 2 or index.shape[0] != batch:
            raise FcauditError(f"token router output has scores {tuple(scores.shape)} and index {tuple(index.shape)}, "
                               f"not [batch={batch}, token={token}] and [batch, k]")
        c = torch.zeros(batch, token, 1, 2, dtype=torch.float32, device=scores.device)
        c[:, :, 0, 0] = scores.detach().float()
        c[:, :, 0, 1].scatter_add_(1, index.clamp_min(0), (index >= 0).float())  # padding (-1) adds 0 to token 0
        return c

    def meta(self, output: Any) -> dict:
        return {"type": type(output), "dtype": output[0].dtype}

    def decode(self, canonical: torch.Tensor, meta: dict) -> Any:
        scores = canonical[:, :, 0, 0].to(meta["dtype"]).contiguous()
        chosen, T = canonical[:, :, 0, 1] > 0.5, canonical.shape[1]
        k = max(1, int(chosen.sum(-1).max()) if chosen.numel() else 1)
        index = torch.where(chosen, torch.arange(T, device=chosen.device), T).sort(-1).values[:, :k]
        index = torch.where(index < T, index, -1)  # the chosen positions, ascending, padded with -1 where fewer
        return meta["type"](scores, index) if meta["type"] is not tuple else (scores, index)

    def describe(self) -> str:
        return "token router: (scores [batch token], chosen index [batch k])"


def _codec(layout: str | Codec | None, codec: Codec | None, routing: str | None = None) -> Codec:
    """The site's codec from `layout` or `codec`; with routing="tokens" TokenRoute by default, or the given codec
    marked as a token router."""
    if isinstance(layout, Codec) and codec is None:
        codec, layout = layout, None
    if routing is None and codec is None and not isinstance(layout, str):
        raise FcauditError("describe the site output: pass layout='batch token' (an einops layout of a tensor) or "
                           "codec=... for a tuple or other structured output")
    if routing is None:
        return codec if codec is not None else Layout.parse(layout)
    if routing != "tokens":
        raise FcauditError(f"routing={routing!r}: the one routing fcaudit knows is 'tokens' (a router choosing the "
                           "tokens a block runs on); drop routing= for any other site")
    if layout is not None:
        raise FcauditError(f"routing='tokens' with layout {layout!r}: a token router's coefficient is (score, chosen) "
                           "per token; drop the layout (TokenRoute reads a (scores, index) output) or pass codec=")
    codec = codec if codec is not None else TokenRoute()
    if codec.routing not in (None, "tokens"):
        raise FcauditError(f"codec {codec.describe()} says routing={codec.routing!r}, not 'tokens': pass a token "
                           "router's codec")
    if codec.routing is None:
        try:
            codec.routing = "tokens"
        except AttributeError:  # a frozen dataclass
            raise FcauditError(f"codec {codec.describe()} cannot be marked as a token router: give its class "
                               "routing = 'tokens'") from None
    return codec


def shape_of(x) -> str:
    return str(list(x.shape)) if isinstance(x, torch.Tensor) else type(x).__name__


# ---- one forward pass: each (module, method) that holds sites wrapped once ----------------------------------------

class _Pass:
    """The sites of one forward pass: captured, or replayed by `replayed(i, call)` (then not computed). Calls are
    counted per pass, so `call=N` means the N-th call of that forward pass."""

    def __init__(self, sites: Sequence[Site], batch: int = 0, token: int = 0, remember: bool = False,
                 raw: list | None = None, replayed: Callable[[int, Call], Any] | None = None):
        self.sites, self.batch, self.token, self.remember, self.raw = sites, batch, token, remember, raw
        self.replayed = replayed
        self.found: list = [None] * len(sites)  # site i's canonical output
        self.method_calls: dict[tuple[int, str], int] = {}
        self.op_calls: dict[tuple[int, str, str], list[str]] = {}  # each call of a watched op, with its shapes

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
            if self.remember:
                site.remember(out)
            if self.raw is not None:
                self.raw[i] = (out, inputs)
        return out


class _OpMode(TorchFunctionMode):
    """Active while one site method runs: the watched ops' results are captured or replaced (then not computed)."""

    def __init__(self, run: _Pass, module: nn.Module, method: str, sites: list[int]):
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


def _wrapper(run: _Pass, module: nn.Module, method: str, inner: Callable, sites: list[int]) -> Callable:
    """`inner` (the bound method) with the pass's sites on it: module-level sites take (or replace) the whole
    result of their call; op sites are watched by an _OpMode while it runs."""
    key = (id(module), method)
    whole = [i for i in sites if run.sites[i].op is None]
    ops = [i for i in sites if run.sites[i].op is not None]

    def wrapped(*args, **kwargs):
        n = run.method_calls.get(key, 0)
        run.method_calls[key] = n + 1

        def compute():
            with _OpMode(run, module, method, ops) if ops else nullcontext():
                return inner(*args, **kwargs)

        chosen = [i for i in whole if run.sites[i].call in (None, n)]
        return run.call(chosen, Call(args, kwargs, module), compute,
                        lambda: f"call {n} of {type(module).__name__}.{method}")

    return wrapped


@contextmanager
def _patched(run: _Pass) -> Iterator[None]:
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


def _check_ran(run: _Pass) -> None:
    """Refuses, naming what it saw instead, the first call or op site that did not run in a finished capture pass."""
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


# ---- the controller ----------------------------------------------------------------------------------------------

@dataclass
class Controller:
    """The controller sites of a model: where each layer's coefficients appear, and how to read and replace them.

    An audit captures every site's output on the unmodified model, then replays transformed coefficients in its
    place. Build one with `from_modules` (a module's output), `from_ops` (a tensor computed inside a module's method)
    or `merge` (several kinds of sites); `fca.controller_for(model)` gives a registered family's.

    Attributes
    ----------
    sites : list of Site
        In model order; `site.name` is the module path, with the method, op and call where given.
    static_name, reference_name : str
        Display labels of the StaticProfile and StructureRemoved conditions (e.g. "LayerMean").
    reference : str
        What StructureRemoved puts in place of the coefficients: "global_mean" or "source_uniform_mean".
    groups : tuple of int
        Each site's layer: sites of one group move together under the randomized conditions; () is one per site.
    context : callable
        A factory of the context manager every capture and replay pass runs within (default: none).

    Examples
    --------
    Two blocks, each with a gate module and a local tanh coefficient computed in its forward:

    >>> class Block(nn.Module):
    ...     def __init__(self, d=8):
    ...         super().__init__()
    ...         self.gate = nn.Sequential(nn.Linear(d, 1), nn.Sigmoid(), nn.Flatten(-2))
    ...         self.mlp, self.w = nn.Linear(d, d), nn.Parameter(torch.zeros(d))
    ...     def forward(self, h):  # h [batch, token, d]
    ...         h = h + self.gate(h).unsqueeze(-1) * self.mlp(h)  # gate(h): [batch, token]
    ...         return h + torch.tanh(h @ self.w).unsqueeze(-1) * h  # tanh(...): [batch, token]
    >>> model = nn.Sequential(Block(), Block())
    >>> ctrl = fca.Controller.from_modules(model, "*.gate", layout="batch token")
    >>> [site.name for site in ctrl.sites]
    ['0.gate', '1.gate']

    The examples of its methods use this `model`.
    """

    sites: list[Site]
    static_name: str = "StaticProfile"
    reference: str = "global_mean"  # or "source_uniform_mean" (protocol.REFERENCES)
    reference_name: str = "GlobalMean"
    description: str = ""
    context: Callable[[], AbstractContextManager] = nullcontext
    groups: tuple[int, ...] = ()

    def __post_init__(self):
        if self.reference not in REFERENCES:
            raise FcauditError(f"unknown reference {self.reference!r}; use one of {', '.join(REFERENCES)}")
        if not self.sites:
            raise FcauditError("a controller needs at least one site; check the module pattern")
        if self.groups and len(self.groups) != len(self.sites):
            raise FcauditError(f"{len(self.groups)} groups for {len(self.sites)} sites; give one group per site")
        clash = [n for s in self.sites for n in s.codec.counts if n in RECORD_COLUMNS]
        if clash:
            raise FcauditError(f"a codec counts {clash[0]!r}, the name of a record column; rename that count")
        self._recording: list | None = None

    @classmethod
    def from_modules(cls, model: nn.Module, pattern: str, layout: str | Codec | None = None, *,
                     codec: Codec | None = None, call: int | None = None, method: str = "forward",
                     static_name: str = "StaticProfile", reference: str = "global_mean",
                     reference_name: str | None = None,
                     context: Callable[[], AbstractContextManager] | None = None,
                     routing: str | None = None) -> "Controller":
        """A controller whose sites are the outputs of the modules that match `pattern`.

        Parameters
        ----------
        model
            The model whose `named_modules()` paths are matched.
        pattern
            A glob over module paths, in model order: `*` matches within one dotted component ("blocks.*.gate"
            does not match "blocks.0.mlp.gate"); a pattern containing `**` matches across components.
        layout, codec
            The einops layout of a single-tensor output (see `Layout`), e.g. "batch token", or else a `Codec`.
        call
            Read the `call`-th call (0-based) of a module called several times in one forward pass; default: a
            module called exactly once.
        method
            The method whose output is read (default forward; another works when the parent calls it directly).
        static_name, reference, reference_name
            The StaticProfile condition's label, the structure-removed reference ("global_mean" or
            "source_uniform_mean") and its label.
        context
            See `Controller.context`; its name joins the description, so an audit made under another context is not
            resumed with this one.
        routing
            "tokens": each site chooses the tokens a block runs on (`TokenRoute` unless `codec` is given).

        Examples
        --------
        >>> ctrl = fca.Controller.from_modules(model, "*.gate", layout="batch token",
        ...                                    static_name="LayerMean")
        >>> len(ctrl.sites), ctrl.labels["StaticProfile"]
        (2, 'LayerMean')
        """
        return cls._build(model, pattern, _codec(layout, codec, routing), call, method, None, static_name, reference,
                          reference_name, context)

    @classmethod
    def from_ops(cls, model: nn.Module, pattern: str, op: str, layout: str | Codec | None = None, *,
                 codec: Codec | None = None, method: str = "forward", call: int | None = None,
                 static_name: str = "StaticProfile", reference: str = "global_mean", reference_name: str | None = None,
                 context: Callable[[], AbstractContextManager] | None = None) -> "Controller":
        """A controller whose sites are the results of a torch function called inside modules.

        For coefficients that no submodule returns (`torch.sigmoid(h @ self.w)` in a forward). Replay substitutes
        the op's result, and the op is not computed.

        Parameters
        ----------
        model, pattern, layout, codec, static_name, reference, reference_name, context
            As for `from_modules`; `pattern` matches the modules whose `method` runs the op.
        op
            The torch function's name: "matmul" (or "@"), "sigmoid", "softmax", "tanh", "einsum", ... (`x @ w`,
            `torch.matmul` and `Tensor.matmul` are all "matmul").
        method, call
            The method during which the op is watched (default forward), and which call of `op` while it runs is
            the site (0-based; default: its only one).

        Examples
        --------
        >>> ctrl = fca.Controller.from_ops(model, "*", "tanh", layout="batch token")
        >>> [site.name for site in ctrl.sites]
        ['0:tanh', '1:tanh']
        """
        if not isinstance(op, str) or not op:
            raise FcauditError(f"op must be a torch function's name such as 'matmul' or '@', got {op!r}")
        return cls._build(model, pattern, _codec(layout, codec), call, method, OP_ALIASES.get(op, op), static_name,
                          reference, reference_name, context)

    @classmethod
    def _build(cls, model: nn.Module, pattern: str, codec: Codec, call: int | None, method: str, op: str | None,
               static_name: str, reference: str, reference_name: str | None,
               context: Callable[[], AbstractContextManager] | None) -> "Controller":
        if call is not None and (isinstance(call, bool) or not isinstance(call, int) or call < 0):
            raise FcauditError(f"call must be an integer >= 0 (0 = the first call in a forward pass), got {call!r}")
        if not isinstance(method, str) or not method:
            raise FcauditError(f"method must be a method's name such as 'forward' or 'prepare', got {method!r}")
        if not isinstance(pattern, str):
            raise FcauditError(f"pattern must be a glob over module paths such as 'blocks.*.gate', got {pattern!r}")
        sites = [Site(name, m, codec, call, method, op) for name, m in model.named_modules()
                 if name and path_matches(name, pattern)]
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
        lacking = next((s for s in sites if not callable(getattr(s.module, s.method, None))
                        or isinstance(getattr(s.module, s.method), nn.Module)), None)
        if lacking is not None:
            own = sorted(n for n, v in vars(type(lacking.module)).items() if callable(v) and not n.startswith("_"))
            raise FcauditError(f"module {lacking.path!r} ({type(lacking.module).__name__}) has no method "
                               f"{lacking.method!r}; its own methods are {own[:8]}")
        if reference_name is None:
            reference_name = "GlobalMean" if reference == "global_mean" else "SourceUniformMean"
        parts = [f"{type(model).__name__}:{pattern}:{codec.describe()}"]
        parts += [f"{k}={v}" for k, v in (("method", method if method != "forward" else None), ("op", op),
                                          ("call", call)) if v is not None]
        parts += [context.__name__] if context is not None else []
        return cls(sites, static_name, reference, reference_name, ":".join(parts), context or nullcontext)

    @classmethod
    def merge(cls, *controllers: "Controller", group: Callable[[Site], Hashable] | None = None) -> "Controller":
        """One controller of all their sites, in order: for a model with several kinds of coefficients per layer.

        Sites of one layer form a group: by default those on the same module (alpha and beta of one
        hyper-connection), else those `group(site)` gives one key. The randomized conditions draw once per group,
        so a group's coefficients move together, and statistics count a group as one layer.

        Parameters
        ----------
        *controllers
            Controllers of one model, with the same reference, condition names and context.
        group
            The layer key of a site, e.g. `lambda site: site.path.split(".")[0]`; default: its module.

        Examples
        --------
        Each block's gate and its tanh coefficient, one layer per block:

        >>> gates = fca.Controller.from_modules(model, "*.gate", layout="batch token")
        >>> tanhs = fca.Controller.from_ops(model, "*", "tanh", layout="batch token")
        >>> layer = lambda site: site.path.split(".")[0]  # "0.gate" and "0:tanh" -> "0"
        >>> both = fca.Controller.merge(gates, tanhs, group=layer)
        >>> [site.name for site in both.sites], both.groups
        (['0.gate', '1.gate', '0:tanh', '1:tanh'], (0, 1, 0, 1))
        """
        if not controllers or not all(isinstance(c, Controller) for c in controllers):
            raise FcauditError("Controller.merge takes one or more fcaudit.Controller objects")
        first = controllers[0]
        names = attrgetter("reference", "static_name", "reference_name")
        if any(names(c) != names(first) for c in controllers):
            raise FcauditError("controllers with other references or condition names cannot be merged; build "
                               "them with the same reference= and names")
        if any(c.context is not first.context for c in controllers):
            raise FcauditError("controllers run within other contexts cannot be merged; pass the same context=")
        sites = [s for c in controllers for s in c.sites]
        seen: set[tuple[int, str, str | None, int | None]] = set()
        for s in sites:
            key = (id(s.module), s.method, s.op, s.call)
            if key in seen:
                raise FcauditError(f"site {s.name!r} is in two of the merged controllers; give each site once")
            seen.add(key)
        for s in sites:  # in either order: a site on every call beside one on a single call of the same place
            if s.call is None and sum(k[:3] == (id(s.module), s.method, s.op) for k in seen) > 1:
                raise FcauditError(f"site {s.name!r} takes every call and another merged site one of them; pass "
                                   "call=N to both")
        order: dict[Hashable, int] = {}  # each key's group: its rank of first appearance
        groups = tuple(order.setdefault(group(s) if group is not None else id(s.module), len(order)) for s in sites)
        return cls(sites, first.static_name, first.reference, first.reference_name,
                   " + ".join(c.description for c in controllers), first.context,
                   groups if len(set(groups)) < len(groups) else ())

    @property
    def labels(self) -> dict[str, str]:
        return {"StaticProfile": self.static_name, "StructureRemoved": self.reference_name}

    @property
    def info(self) -> Controllers:
        """What the protocol's conditions need to know about this controller."""
        return Controllers(self.reference, tuple(s.codec.top_k for s in self.sites), self.groups,
                           tuple(s.codec.routing for s in self.sites))

    def describe(self) -> dict:
        out = {"description": self.description, "sites": [s.name for s in self.sites],
               "codecs": [s.codec.describe() for s in self.sites], "reference": self.reference,
               "labels": self.labels}
        return out | ({"groups": list(self.groups)} if self.groups else {})

    @contextmanager
    def capture(self, batch: int, token: int, remember: bool = True) -> Iterator[list[torch.Tensor | None]]:
        """Record each site's output (canonical, detached) during one forward pass of `batch` x `token` ids; with
        `remember` each site also keeps this output's codec metadata, which later replays decode with."""
        run = _Pass(self.sites, batch, token, remember)
        with _patched(run), self.context():
            yield run.found
        _check_ran(run)

    @contextmanager
    def outputs(self, batch: int, token: int) -> Iterator[list[tuple[Any, Call] | None]]:
        """Each site's raw output and call (args, kwargs, module) in one forward pass, for the pre-write checks."""
        run = _Pass(self.sites, batch, token, raw=[None] * len(self.sites))
        with _patched(run), self.context():
            yield run.raw
        _check_ran(run)

    @contextmanager
    def replay(self, coeffs: Coeffs) -> Iterator[None]:
        """Within the context each site's result is its decoded coefficients: the site's own computation (its method
        or op) does not run. The model is restored on exit, also when the body raises."""
        if len(coeffs) != len(self.sites):
            raise FcauditError(f"replay got {len(coeffs)} coefficient tensors for {len(self.sites)} sites")
        blank = next((s for s in self.sites if s.meta is None), None)
        if blank is not None:
            raise FcauditError(f"site {blank.name!r} has no captured output to replay into; capture a batch first")
        native = [None if s.reads_inputs else s.decode(c) for s, c in zip(self.sites, coeffs)]  # decoded in advance

        def replayed(i: int, inputs: Call) -> Any:
            if self._recording is not None:  # read at each call: recording_inputs may be entered after this
                self._recording[i] = (inputs.args, inputs.kwargs)
            return native[i] if native[i] is not None else self.sites[i].decode(coeffs[i], inputs)

        with _patched(_Pass(self.sites, replayed=replayed)), self.context():
            yield

    @contextmanager
    def recording_inputs(self) -> Iterator[list[tuple | None]]:
        """Keep each site's call arguments of one replay pass entered within (or around) this block, for
        `recompute`."""
        inputs: list[tuple | None] = [None] * len(self.sites)
        previous, self._recording = self._recording, inputs
        try:
            yield inputs
        finally:
            self._recording = previous

    def recompute(self, inputs: list[tuple | None], batch: int, token: int,
                  which: Sequence[int] | None = None) -> dict[int, torch.Tensor]:
        """The live controller's canonical output on recorded site inputs: what sites `which` (default all) would
        have emitted on that trajectory. Call outside `replay`, so the original methods run."""
        out = {}
        for i in (range(len(self.sites)) if which is None else which):
            site, call = self.sites[i], inputs[i]
            if call is None:
                raise FcauditError(f"site {site.name!r} did not run in the recorded pass")
            fn = getattr(site.module, site.method) if site.op is None else \
                next((getattr(m, site.op) for m in (torch.Tensor, torch, F) if hasattr(m, site.op)), None)
            if fn is None:
                raise FcauditError(f"site {site.name!r}: no torch function {site.op!r} to recompute it with")
            out[i] = site.encode(fn(*call[0], **call[1]), batch, token)
        return out
