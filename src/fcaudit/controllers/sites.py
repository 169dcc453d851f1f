"""Sites: where one layer's coefficients appear in an unmodified model (a module's method, or a torch function called
while it runs), each with its codec, its kind, its reference and its layer (group), and the helpers that name a
module path, a torch function and the leaves of a structured output.
"""

from __future__ import annotations

import fnmatch
import inspect
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Callable, Iterator, NamedTuple

import torch
from torch import nn

from fcaudit.controllers.codecs import Codec, Layout
from fcaudit.errors import FcauditError
from fcaudit.kinds import EXPERT_ROUTER, KINDS, SCALAR_GATE, SOURCE_MIXTURE, VECTOR_GATE, lookup


def path_matches(path: str, pattern: str) -> bool:
    """Glob over module paths: `*` matches within one dotted component ("blocks.*.gate" does not match
    "blocks.0.mlp.gate"); a pattern containing `**` is matched against the whole path with plain fnmatch."""
    if "**" in pattern:
        return fnmatch.fnmatchcase(path, pattern.replace("**", "*"))
    parts, pats = path.split("."), pattern.split(".")
    return len(parts) == len(pats) and all(fnmatch.fnmatchcase(a, p) for a, p in zip(parts, pats))


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


def shape_of(x) -> str:
    return str(list(x.shape)) if isinstance(x, torch.Tensor) else type(x).__name__


@dataclass(frozen=True)
class Decoding:
    """What a replay needs of one site's captured output to decode into its place: the codec's `meta`, the output's
    device (a device map's layer) and its floating dtype (a codec may widen it)."""

    meta: dict
    device: torch.device | None
    dtype: torch.dtype | None

    @classmethod
    def of(cls, codec: Codec, out: Any) -> "Decoding":
        return cls(codec.meta(out), getattr(first_tensor(out), "device", None),
                   getattr(first_tensor(out, floating=True), "dtype", None))


def infer_kind(codec: Codec, reference: str | None) -> str:
    """A site's kind when none is given: its codec's, a top-k router's, a source mixture's where its reference is a
    source rule, else a gate (scalar when its layout says one coefficient per token)."""
    if codec.kind is not None:
        return codec.kind
    if codec.top_k is not None:
        return EXPERT_ROUTER.name
    if reference in ("SourceUniformMean", "ExpertUniformMean"):
        return SOURCE_MIXTURE.name
    return (SCALAR_GATE if isinstance(codec, Layout) and codec.scalar else VECTOR_GATE).name


@dataclass(frozen=True)
class Site:
    """The coefficient tensor of one target layer: the output of a module's method, or the result of the torch
    function `op` while that method runs (its `call`-th call in one forward pass, else its only one), its codec, its
    kind (fcaudit.kinds.KINDS; default: `infer_kind`), its structure-removed reference (default: its kind's) and its
    layer `group` (given by its Controller); `runs`: the module whose input rows are the tokens its decisions chose
    (a token router's routed block), whose rows the audit observes (`Controller.observing`); `calls`: where the
    sites of a looped layer take each of its calls, how many there are in a forward pass."""

    path: str
    module: nn.Module = field(repr=False)
    codec: Codec = None
    call: int | None = None
    method: str = "forward"
    op: str | None = None  # an op_name
    kind: str | None = None
    reference: str | None = None
    group: int | None = None
    runs: tuple[str, nn.Module] | None = field(default=None, repr=False)  # (path, module) of its routed block
    # a looped layer's site, one per call: how many calls its `call` numbers in every forward pass (its method's, an
    # op site's op's), which each pass checks (a count that varies is a halting decision, not a loop)
    calls: int | None = None

    def __post_init__(self):
        kind = lookup(self.kind if self.kind is not None else infer_kind(self.codec, self.reference)).name
        reference = self.reference if self.reference is not None else KINDS[kind].reference
        if reference not in KINDS[kind].references:
            raise FcauditError(f"site {self.name!r}: a {kind} takes the reference "
                               f"{' or '.join(KINDS[kind].references)}, not {reference!r}")
        if self.codec.kind is not None and kind != self.codec.kind:
            raise FcauditError(f"site {self.name!r}: codec {self.codec.describe()} reads a {self.codec.kind}, not a "
                               f"{kind}; pass kind={self.codec.kind!r} or another codec")
        object.__setattr__(self, "kind", kind)  # defaults resolved once: the site is frozen from here on
        object.__setattr__(self, "reference", reference)

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

    def decode(self, c: torch.Tensor, decoding: Decoding, inputs: Call | None = None):
        """The site's output from canonical coefficients, on its captured output's device (a device_map's layer)."""
        c = c.to(decoding.device) if decoding.device is not None else c
        return self.codec.decode(c, decoding.meta, inputs) if self.reads_inputs else self.codec.decode(c, decoding.meta)
