"""Codecs: how a site's output maps to canonical coefficients [batch, token, stream, source] and back. `Layout` (an
einops pattern) reads a single tensor; `TokenRoute` a token router's (scores, index); a subclass of `Codec` anything
else. A codec is never modified by fcaudit: what an audit keeps of a captured output is returned by the capture.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch
from einops import EinopsError, rearrange

from fcaudit.errors import FcauditError
from fcaudit.kinds import TOKEN_ROUTER, chosen


class Codec:
    """How one site's output maps to canonical coefficients [batch, token, stream, source] and back.

    Subclass it for a site whose output is not one tensor (a tuple, a dataclass, a router's indices and weights);
    a single tensor takes a `Layout` (`layout="batch token"`). Set `top_k` on a top-k router's codec so that the
    audit offers StaticTopK, and `kind` where its sites are of one kind whatever the controller says
    (fcaudit.kinds.KINDS: a token router's codec says "token_router").

    The audit checks `decode(encode(output)) == output` on the first batch, leaf by leaf. Two attributes say what
    that check may let pass: `placeholders`, the leaves the model never reads (rebuilt as placeholders), and
    `unordered`, a (weights, index) pair of leaves whose rows are sets of (index, weight) pairs: a router's top-k
    with ties may list them in any order, so rows holding the same pairs in another order pass with a notice.
    Leaves are named as `decode`'s output is indexed: "" for the output itself, "[1]", ".scores", "['index']".

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
    kind: str | None = None  # the kind of its sites, where the codec decides it (fcaudit.kinds.KINDS)
    counts: tuple[str, ...] = ()  # names of the counts `executed` reports: extra columns of the audit's records
    placeholders: tuple[str, ...] = ()  # leaves the model never reads: not compared by the round-trip check
    unordered: tuple[str, ...] = ()  # (weights, index) leaves whose rows are sets: compared up to their order

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


AXES = r"\([^()]*\)|[^\s()]+"  # a layout's top-level axes: merged groups, names, unit axes


@dataclass(frozen=True)
class Layout(Codec):
    """An einops layout of a single-tensor site output: the default codec.

    Name the output's axes: `batch` and `token` always, `stream` where the site has several residual streams, and
    one source axis (an expert, a source layer, or a merged group "(a b)"); a missing one becomes a unit axis. A
    merged source group fits an output with one axis for it or with its axes side by side: "batch token (a b)"
    reads [batch, token, 6] and [batch, token, 2, 3] alike. One source axis may be flattened with batch and token
    (a norm that sees [batch * token * head, channel]): "(batch token head) channel" reads it as the source
    "(head channel)".

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
    >>> fca.Layout.parse("batch token (view layer)").encode(torch.rand(2, 3, 2, 5), 2, 3).shape
    torch.Size([2, 3, 1, 10])
    """

    pattern: str  # einops pattern (a merged source group renamed to one axis)
    source: str | None  # name of the axis that plays the source role, if any
    given: str | None = None  # the pattern as written, when it differs
    parts: tuple[str, ...] = ()  # a merged source group's axes, which an output may hold side by side
    sized: tuple[str, ...] = ()  # axes whose sizes decode reads from the output (beside a source axis flattened in)

    @classmethod
    def parse(cls, pattern: str) -> "Layout":
        """Axes are names, merged groups "(a b)" and unit axes "1" or "()"."""
        if re.sub(AXES + r"|\s", "", pattern):
            raise FcauditError(f"layout {pattern!r} has unbalanced or nested parentheses; write axes, merged groups "
                               "'(a b)' and unit axes '1' or '()', e.g. 'batch token (view layer)'")
        names = [n for n in re.findall(r"[^\s()]+", pattern) if n != "1"]
        if len(set(names)) != len(names):
            raise FcauditError(f"layout {pattern!r} repeats an axis name; name each axis once, e.g. 'batch token'")
        if "batch" not in names or "token" not in names:
            raise FcauditError(f"layout {pattern!r} must name a 'batch' and a 'token' axis, e.g. "
                               "'(batch token) expert'")
        roles = {"batch", "token", "stream"}
        axes = [(a, set(a.strip("()").split())) for a in re.findall(AXES, pattern)]
        extra = [a for a, parts in axes if a not in ("1", "()") and not parts & roles]
        mixed = [a for a, parts in axes if a.startswith("(") and parts & roles and parts - roles]
        inner = [n for a in mixed for n in a.strip("()").split() if n not in roles | {"1"}]  # in a role's group
        if len(extra) > 1 or len(inner) > 1 or (inner and extra and extra[0].startswith("(")):
            side = " ".join(extra)  # axes side by side merge into one group that reads the same output
            apart = not mixed and side in pattern and not any(a.startswith("(") for a in extra)
            fix = pattern.replace(side, f"({side})") if apart else "(head expert)"
            raise FcauditError(f"layout {pattern!r} has more than one source-like axis "
                               f"{[*inner, *(a.strip('()') for a in extra)]}; merge them with parentheses, e.g. "
                               f"{fix!r}, apart from batch, token and stream")
        if inner:  # the source: the flattened axis and the output's own one, in the pattern's order
            source = [n for n in names if n in inner + extra]
            return cls(pattern, source[0] if len(source) == 1 else f"({' '.join(source)})", sized=tuple(extra))
        if not extra or not extra[0].startswith("("):
            return cls(pattern, extra[0] if extra else None)
        parts = tuple(extra[0].strip("()").split())
        merged = "_".join(parts)  # one axis named after its parts, so einops needs no sizes
        return cls(pattern.replace(extra[0], merged, 1), merged, pattern, parts)

    @cached_property
    def canonical(self) -> str:
        stream = "stream" if "stream" in re.findall(r"[^\s()]+", self.pattern) else "1"
        return f"batch token {stream} {self.source or '1'}"

    @cached_property
    def side_by_side(self) -> tuple[str, str]:
        """(output, canonical) patterns for an output that holds a merged source group's axes side by side."""
        return (self.pattern.replace(self.source, " ".join(self.parts)),
                self.canonical.replace(self.source, f"({' '.join(self.parts)})"))

    def _apart(self, output: torch.Tensor) -> bool:
        return len(self.parts) > 1 and output.dim() == len(re.findall(AXES, self.pattern)) + len(self.parts) - 1

    @property
    def scalar(self) -> bool:
        """One coefficient per (batch, token): a scalar gate."""
        return self.canonical == "batch token 1 1"

    def encode(self, output, batch: int, token: int) -> torch.Tensor:
        if not isinstance(output, torch.Tensor):
            raise FcauditError(f"site returned {type(output).__name__}, not a tensor; give the site a codec for its "
                               "output structure (Controller.from_modules(..., codec=...)) or point the pattern at "
                               "the module that returns the coefficients")
        shape = self.side_by_side if self._apart(output) else (self.pattern, self.canonical)
        try:
            c = rearrange(output, f"{shape[0]} -> {shape[1]}", batch=batch, token=token)
        except EinopsError:
            raise FcauditError(f"site output of shape {tuple(output.shape)} does not fit layout {self.describe()!r} "
                               f"for batch={batch}, token={token}; pass the layout that names its axes (unit axes "
                               "as '1', merged ones as '(a b)')") from None
        return c.detach().clone()  # the model may modify `output` in place

    def meta(self, output) -> dict:
        """Its dims from outermost to innermost in memory (largest stride first; size-1 dims keep their order), and
        the sizes of a merged group's axes where the output holds them side by side (or of the axes `sized`)."""
        strides = [-stride if n > 1 else 0 for stride, n in zip(output.stride(), output.shape)]
        order = {"memory_order": tuple(sorted(range(output.dim()), key=strides.__getitem__))}  # stable: ties in order
        if self.sized:
            axes = re.findall(AXES, self.pattern)
            return order | {"axes": {n: output.shape[axes.index(n)] for n in self.sized}}
        if not self._apart(output):
            return order
        at = self.side_by_side[0].split().index(self.parts[0])
        return order | {"sizes": dict(zip(self.parts[:-1], output.shape[at:at + len(self.parts) - 1]))}

    def decode(self, canonical: torch.Tensor, meta: dict) -> torch.Tensor:
        """A fresh copy (in-place ops downstream cannot touch the cache) with the captured output's memory order, so
        kernels see the same strides."""
        if "sizes" in meta:
            out, canon = self.side_by_side
            x = rearrange(canonical, f"{canon} -> {out}", **meta["sizes"])
        else:
            x = rearrange(canonical, f"{self.canonical} -> {self.pattern}", **meta.get("axes", {}))
        order = meta["memory_order"]
        inverse = sorted(range(len(order)), key=order.__getitem__)
        return x.permute(order).clone(memory_format=torch.contiguous_format).permute(inverse)

    def describe(self) -> str:
        return self.given or self.pattern


@dataclass(frozen=True)
class Parts(Codec):
    """The parts `coefficients` of a tuple that a torch function `op` returns (a chunk or split of one projection),
    each read by `layout` and set side by side on the source axis; the other parts are the value path: a replay
    computes them from the live call (op's arguments), so only the coefficients are replaced.

    Examples
    --------
    LFM2's short convolution splits one projection into its gates B, C and the value x (`B, C, x = BCx.chunk(3, -2)`):

    >>> from fcaudit.controllers.codecs import Parts
    >>> codec = Parts(fca.Layout.parse("batch channel token"), (0, 1), "chunk")
    >>> bcx = torch.rand(2, 12, 3)  # [batch, 3 x channel, token]
    >>> codec.encode(bcx.chunk(3, dim=-2), batch=2, token=3).shape
    torch.Size([2, 3, 1, 8])
    """

    layout: Layout
    coefficients: tuple[int, ...]
    op: str

    def encode(self, output: Any, batch: int, token: int) -> torch.Tensor:
        if not isinstance(output, (tuple, list)) or len(output) <= max(self.coefficients):
            got = f"{len(output)} parts" if isinstance(output, (tuple, list)) else type(output).__name__
            raise FcauditError(f"{self.op!r} returned {got}, which has no parts {list(self.coefficients)}: point the "
                               f"recipe at the {self.op!r} call that splits the coefficients off")
        return torch.cat([self.layout.encode(output[i], batch, token) for i in self.coefficients], dim=-1)

    def meta(self, output: Any) -> dict:
        return {"parts": [self.layout.meta(output[i]) for i in self.coefficients],
                "sizes": [output[i].numel() for i in self.coefficients]}  # their shares of the source axis

    def decode(self, canonical: torch.Tensor, meta: dict, inputs) -> tuple:
        fn = next(getattr(m, self.op) for m in (torch.Tensor, torch, torch.nn.functional) if hasattr(m, self.op))
        out = list(fn(*inputs.args, **inputs.kwargs))  # the value path, live
        widths = [canonical.shape[-1] * n // sum(meta["sizes"]) for n in meta["sizes"]]
        for i, c, m in zip(self.coefficients, canonical.split(widths, dim=-1), meta["parts"]):
            out[i] = self.layout.decode(c, m)
        return tuple(out)

    def describe(self) -> str:
        return f"parts {list(self.coefficients)} of {self.op}: {self.layout.describe()}"


class TokenRoute(Codec):
    """A router whose output is (scores [B, T], index [B, k]): a tuple or a namedtuple of those two fields (more
    fields are refused: a codec that reads the site's inputs is needed to rebuild them)."""

    kind = TOKEN_ROUTER.name

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
        picked, T = chosen(canonical), canonical.shape[1]
        k = max(1, int(picked.sum(-1).max()) if picked.numel() else 1)
        index = torch.where(picked, torch.arange(T, device=picked.device), T).sort(-1).values[:, :k]
        index = torch.where(index < T, index, -1)  # the chosen positions, ascending, padded with -1 where fewer
        return meta["type"](scores, index) if meta["type"] is not tuple else (scores, index)

    def describe(self) -> str:
        return "token router: (scores [batch token], chosen index [batch k])"


class Decisions(Codec):
    """Run or exit decisions: one per token (a [batch, token] output, bool or 0/1), or with `window=True` one per
    window (a [batch] or [batch, 1] output, for every token of the window) <-> canonical 0.0/1.0 [batch, token, 1, 1].
    Decoded in the output's dtype and shape, so that a model testing `if decision` or `done | decision` sees what it
    returned. The default codec of exit depths and skip masks (fcaudit.kinds). `always`: the blocks that run for
    every token before the decided ones (exit sites that start after block k, blocks no mask can skip), which the
    records' `active` counts as executed.

    Examples
    --------
    >>> from fcaudit.controllers import Decisions
    >>> codec = Decisions()
    >>> c = codec.encode(torch.tensor([[True, False, True]]), batch=1, token=3)
    >>> c[0, :, 0, 0]
    tensor([1., 0., 1.])
    >>> codec.decode(c, codec.meta(torch.zeros(1, 3, dtype=torch.bool)))
    tensor([[ True, False,  True]])
    """

    def __init__(self, window: bool = False, always: int = 0):
        if isinstance(always, bool) or not isinstance(always, int) or always < 0:
            raise FcauditError(f"always={always!r}: the number of blocks that run for every token before the decided "
                               "ones, an int >= 0")
        self.window, self.always = bool(window), always

    def encode(self, output: Any, batch: int, token: int) -> torch.Tensor:
        want = "[batch] or [batch, 1]" if self.window else "[batch, token] (or [batch, token, 1])"
        if not isinstance(output, torch.Tensor):
            raise FcauditError(f"a decision site returned {type(output).__name__}, not a tensor {want}")
        shape = tuple(output.shape)
        fits = (output.numel() == batch and shape[:1] == (batch,)) if self.window else \
            shape in ((batch, token), (batch, token, 1))
        if not fits:
            if not self.window and shape[:2] == (batch, token):
                hint = ("; one decision per token and block takes one site per block (a depth site holds one "
                        "decision per token)")
            elif not self.window and output.numel() == batch:
                hint = "; one decision per window takes Decisions(window=True)"
            else:
                hint = ""
            raise FcauditError(f"decisions of shape {shape} are not {want} for batch={batch}, token={token}{hint}")
        values = output.detach().reshape(batch, -1)
        if not ((values == 0) | (values == 1)).all():
            raise FcauditError("decisions must be bool or 0/1; a site of soft weights (halting) takes a layout")
        return values.float().expand(batch, token)[:, :, None, None].contiguous()

    def meta(self, output: Any) -> dict:
        return {"dtype": output.dtype, "shape": tuple(output.shape[1:])}

    def decode(self, canonical: torch.Tensor, meta: dict) -> torch.Tensor:
        run = canonical[:, :1, 0, 0] if self.window else canonical[:, :, 0, 0]
        return (run > 0.5).to(meta["dtype"]).reshape(canonical.shape[0], *meta["shape"]).contiguous()

    def describe(self) -> str:
        what = "decisions: one per window ([batch])" if self.window else "decisions: one per token ([batch token])"
        return what + (f", after {self.always} blocks that always run" if self.always else "")
