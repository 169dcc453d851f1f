"""The controller: a model's sites, built once and frozen. It answers what the audit asks of it in one place
(`info`: each site's kind, reference and layer; which sites are routers; the per-layer counts), captures a forward
pass's coefficients (returned, never kept on it) and replays coefficients in the sites' place.
"""

from __future__ import annotations

from collections import Counter
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from functools import cached_property, partial
from typing import Any, Callable, Hashable, Iterator, Sequence

import torch
from torch import nn

from fcaudit.controllers.codecs import Codec, Decisions, Layout, TokenRoute
from fcaudit.controllers.patching import Captured, Pass, check_calls, check_ran, patched, recompute
from fcaudit.controllers.rows import counting_rows, fused_part
from fcaudit.controllers.sites import OP_ALIASES, Call, Decoding, Site, path_matches
from fcaudit.errors import FcauditError
from fcaudit.kinds import Description, lookup
from fcaudit.protocol import RECORD_COLUMNS, Coeffs


@dataclass(frozen=True)
class Controller:
    """The controller sites of a model: where each layer's coefficients appear, and how to read and replace them.

    An audit captures every site's output on the unmodified model, then replays transformed coefficients in its
    place. Build one with `from_modules` (a module's output), `from_ops` (a tensor computed inside a module's method)
    or `merge` (several kinds of sites); `fca.controller_for(model)` gives a registered family's. It is frozen: a
    capture returns what it saw, and nothing is written onto the controller, its sites or their codecs.

    Attributes
    ----------
    sites : tuple of Site
        In model order; `site.name` is the module path, with the method, op and call where given; each site has its
        kind, its reference and its layer (`site.group`).
    static_name : str
        The display label of the StaticProfile condition (e.g. "LayerMean").
    description : str
        What the controller is, as audits and summaries tell controllers apart.
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
    >>> [(site.name, site.kind, site.reference) for site in ctrl.sites]
    [('0.gate', 'scalar_gate', 'GlobalMean'), ('1.gate', 'scalar_gate', 'GlobalMean')]

    The examples of its methods use this `model`.
    """

    sites: tuple[Site, ...]
    static_name: str = "StaticProfile"
    description: str = ""
    context: Callable[[], AbstractContextManager] = nullcontext
    # the blocks whose rows the audit observes where they are not one per site (`routing`): a depth controller's
    # blocks, capacity routers' experts, as (path, module) in order
    runs: tuple[tuple[str, nn.Module], ...] = field(default=(), repr=False)
    # what the audit says of the controller as notices: input-dependent mechanisms of the model its sites leave out
    notes: tuple[str, ...] = ()

    def __post_init__(self):
        sites = tuple(self.sites)
        if not sites:
            raise FcauditError("a controller needs at least one site; check the module pattern")
        if all(s.group is None for s in sites):  # one layer per site
            sites = tuple(replace(s, group=i) for i, s in enumerate(sites))
        elif any(s.group is None for s in sites):
            raise FcauditError("give every site a group, or none (one layer per site)")
        rank: dict[int, int] = {}  # groups numbered in the order they first appear
        sites = tuple(s if rank.setdefault(s.group, len(rank)) == s.group else replace(s, group=rank[s.group])
                      for s in sites)
        object.__setattr__(self, "sites", sites)
        clash = [n for s in sites for n in s.codec.counts if n in RECORD_COLUMNS]
        if clash:
            raise FcauditError(f"a codec counts {clash[0]!r}, the name of a record column; rename that count")
        self.info  # refuses kinds that cannot be audited together, now rather than at the audit

    @cached_property
    def info(self) -> Description:
        """The controller as the protocol, the engine, the statistics and execution see it (fcaudit.kinds)."""
        return Description(tuple(s.kind for s in self.sites), tuple(s.reference for s in self.sites),
                           tuple(s.group for s in self.sites), tuple(s.codec.top_k for s in self.sites),
                           tuple(bool(getattr(s.codec, "window", False)) for s in self.sites),
                           tuple(int(getattr(s.codec, "always", 0)) for s in self.sites))

    @property
    def groups(self) -> tuple[int, ...]:
        """Each site's layer where some layer holds several sites (`merge`), else () (one layer per site)."""
        return self.info.groups if self.info.merged else ()

    @classmethod
    def from_modules(cls, model: nn.Module, pattern: str, layout: str | Codec | None = None, *,
                     codec: Codec | None = None, kind: str | None = None, reference: str | None = None,
                     static_name: str = "StaticProfile", call: int | None = None, method: str = "forward",
                     context: Callable[[], AbstractContextManager] | None = None,
                     runs: str | None = None) -> "Controller":
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
        kind
            What the coefficients are (fcaudit.kinds.KINDS): "scalar_gate", "vector_gate", "source_mixture",
            "expert_router", "capacity_router" or "token_router" (each site chooses the tokens a block runs on; a
            `TokenRoute` codec unless `codec` is given), or a depth kind: "exit_depth" (one site per block but the
            last, True where the token exits after it) or "skip_mask" (per block, True where it runs for the token),
            both read by `Decisions` unless `codec` is given (`Decisions(window=True)`: one decision per window;
            `Decisions(always=k)`: k blocks run for every token before the first decided one),
            or "halting" (per token a distribution over steps, with a layout). Default: the codec's kind, "expert_router" for a codec with
            `top_k`, "source_mixture" for a source reference, else a gate.
        reference
            The structure-removed reference: "GlobalMean" (a gate's, the mass-matched mean), "SourceUniformMean" (a
            mixture's: each source the mean over sources), "ExpertUniformMean" (the same rule over experts) or
            "RandomRoute" (a token router's), "RandomExit", "RandomHalt" or "RandomSkip" (a depth kind's); default:
            its kind's.
        static_name
            The StaticProfile condition's label (e.g. "LayerMean").
        call, method
            Read the `call`-th call (0-based) of a module called several times in one forward pass (default: a
            module called exactly once), and the method whose output is read (default forward; another works when
            the parent calls it directly).
        context
            See `Controller.context`; its name joins the description, so an audit made under another context is not
            resumed with this one.
        runs
            The blocks the sites' decisions run, whose rows the audit observes on the first batch of every condition
            (the budget observed: `routing`), a pattern matching, in order: for token routers one routed block per
            site (its input rows are the tokens the site chose, e.g. "layers.*.mlp"); for capacity routers each
            router's experts (e.g. "layers.*.moe.experts.*"); for a depth controller its blocks, the ones that always
            run included (e.g. "blocks.*"), or one block shared by every halting step. Give it only where those
            blocks run the decided tokens alone (they gather them): a block that computes every token and masks
            shows every row, and is refused.

        Examples
        --------
        >>> ctrl = fca.Controller.from_modules(model, "*.gate", layout="batch token", static_name="LayerMean")
        >>> len(ctrl.sites), ctrl.labels["StaticProfile"]
        (2, 'LayerMean')
        """
        codec = _codec(layout, codec, kind)
        built = cls._build(model, pattern, partial(Site, codec=codec, call=call, method=method, kind=kind,
                                                   reference=reference), static_name, context)
        return built if runs is None else built.routing(model, runs)

    def routing(self, model: nn.Module, runs: str) -> "Controller":
        """This controller with the blocks its decisions run, matching `runs` in order (see `from_modules`): one per
        site for token routers (`Site.runs`), the rest on the controller (`runs`), for the budget observation."""
        blocks = [(name, m) for name, m in model.named_modules() if name and path_matches(name, runs)]
        how = {k.runs for k in self.info.of}
        fused = fused_part(model, [n for n, _ in blocks], within=how != {"block"})  # a routed block: one hook on it
        if fused is not None:
            raise FcauditError(f"runs={runs!r} names {fused[0]!r}, a part of nn.TransformerEncoderLayer {fused[1]!r}: "
                               "a hook there turns off its fused fast path, so observing its rows would change the "
                               "numerics the exact replay check compares; drop runs= (its budget is then the "
                               "decisions')")
        if len(how) != 1 or None in how:
            raise FcauditError("runs= names the blocks a router's decisions route tokens into (a token router's routed "
                               "blocks, a capacity router's experts, a depth controller's blocks); its sites are "
                               f"{self.info.kinds[0]}s")
        if how == {"block"}:
            if len(blocks) != len(self.sites):
                raise FcauditError(f"runs={runs!r} matches {len(blocks)} modules for {len(self.sites)} sites; give a "
                                   "pattern matching one routed block per site, in the sites' order")
            return replace(self, sites=tuple(replace(s, runs=b) for s, b in zip(self.sites, blocks)))
        if how == {"experts"}:
            experts = [getattr(s.codec, "num_experts", None) for s in self.sites]
            if None in experts or any(getattr(s.codec, "capacity", None) is None for s in self.sites):
                raise FcauditError("runs= for a capacity router needs a codec that says its experts and capacity "
                                   "(CapacityRoute(num_experts, capacity))")
            if len(blocks) != sum(experts):
                raise FcauditError(f"runs={runs!r} matches {len(blocks)} modules for the {sum(experts)} experts of "
                                   f"{len(self.sites)} capacity routers; give a pattern matching each router's "
                                   "experts, in the sites' order")
        elif not blocks:
            raise FcauditError(f"runs={runs!r} matches no module of {type(model).__name__}; give the pattern of the "
                               "blocks the depth decisions run, e.g. 'blocks.*'")
        return replace(self, runs=tuple(blocks))

    @property
    def observed(self) -> bool:
        """Whether the audit observes the rows its decisions run (`runs=` was given)."""
        return bool(self.runs) or any(s.runs is not None for s in self.sites)

    @contextmanager
    def observing(self, batch: int) -> Iterator["Seen"]:
        """The rows the passes run in the context computed where `runs=` named: for each site's routed block
        (`Site.runs`) a list per call, per window ([batch] int64) where the block's input is [batch, rows, ...], else
        the batch's total (an int: a flattened [rows, ...] input); for the controller's blocks (`runs`) a Counter
        each of the rows its computing modules took (`counting_rows`)."""
        calls: dict[int, list] = {}

        def hook(i: int) -> Callable:
            def pre(module, args, kwargs):
                x = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
                if x is not None and x.dim() >= 1:
                    calls.setdefault(i, []).append(torch.full((batch,), x.shape[1]) if x.dim() >= 3 and
                                                   x.shape[0] == batch else int(x.shape[0]))
            return pre

        handles = [s.runs[1].register_forward_pre_hook(hook(i), with_kwargs=True)
                   for i, s in enumerate(self.sites) if s.runs is not None]
        try:
            with counting_rows([m for _, m in self.runs]) as counts:
                yield Seen(calls, counts)
        finally:
            for h in handles:
                h.remove()

    @classmethod
    def from_ops(cls, model: nn.Module, pattern: str, op: str, layout: str | Codec | None = None, *,
                 codec: Codec | None = None, kind: str | None = None, reference: str | None = None,
                 static_name: str = "StaticProfile", method: str = "forward", call: int | None = None,
                 context: Callable[[], AbstractContextManager] | None = None) -> "Controller":
        """A controller whose sites are the results of a torch function called inside modules.

        For coefficients that no submodule returns (`torch.sigmoid(h @ self.w)` in a forward). Replay substitutes
        the op's result, and the op is not computed.

        Parameters
        ----------
        model, pattern, layout, codec, kind, reference, static_name, context
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
        codec = _codec(layout, codec, kind)
        return cls._build(model, pattern, partial(Site, codec=codec, call=call, method=method,
                                                  op=OP_ALIASES.get(op, op), kind=kind, reference=reference),
                          static_name, context)

    @classmethod
    def _build(cls, model: nn.Module, pattern: str, site: Callable[[str, nn.Module], Site], static_name: str,
               context: Callable[[], AbstractContextManager] | None) -> "Controller":
        """The sites `site(path, module)` of the modules matching `pattern`, checked."""
        call, method = site.keywords["call"], site.keywords["method"]
        if call is not None and (isinstance(call, bool) or not isinstance(call, int) or call < 0):
            raise FcauditError(f"call must be an integer >= 0 (0 = the first call in a forward pass), got {call!r}")
        if not isinstance(method, str) or not method:
            raise FcauditError(f"method must be a method's name such as 'forward' or 'prepare', got {method!r}")
        if not isinstance(pattern, str):
            raise FcauditError(f"pattern must be a glob over module paths such as 'blocks.*.gate', got {pattern!r}")
        matched = [(name, m) for name, m in model.named_modules() if name and path_matches(name, pattern)]
        shared = [name for name, _ in model.named_modules(remove_duplicate=False)
                  if name and path_matches(name, pattern) and name not in dict(matched)]
        if shared:  # named_modules lists a module once, under its first path: one module computing several layers
            raise FcauditError(f"pattern {pattern!r} matches {shared[0]!r}, a module that is also at another path: "
                               "fcaudit audits one module per layer (each replayed with its own coefficients); give "
                               "each layer its own controller module")
        if not matched:
            sample = [n for n, _ in model.named_modules() if n][:6]
            raise FcauditError(f"pattern {pattern!r} matches no module of {type(model).__name__}; "
                               f"module paths look like {sample}")
        lacking = next(((name, m) for name, m in matched if not callable(getattr(m, method, None))
                        or isinstance(getattr(m, method), nn.Module)), None)
        if lacking is not None:
            own = sorted(n for n, v in vars(type(lacking[1])).items() if callable(v) and not n.startswith("_"))
            raise FcauditError(f"module {lacking[0]!r} ({type(lacking[1]).__name__}) has no method {method!r}; its own "
                               f"methods are {own[:8]}")
        sites = [site(name, m) for name, m in matched]
        parts = [f"{type(model).__name__}:{pattern}:{sites[0].codec.describe()}"]
        parts += [f"{k}={v}" for k, v in (("method", method if method != "forward" else None), ("op", sites[0].op),
                                          ("call", call)) if v is not None]
        parts += [context.__name__] if context is not None else []
        return cls(tuple(sites), static_name, ":".join(parts), context or nullcontext)

    @classmethod
    def merge(cls, *controllers: "Controller", group: Callable[[Site], Hashable] | None = None) -> "Controller":
        """One controller of all their sites, in order: for a model with several kinds of coefficients per layer.

        Sites of one layer form a group: by default those on the same module (alpha and beta of one
        hyper-connection), else those `group(site)` gives one key. The randomized conditions draw once per group,
        so a group's coefficients move together, and statistics count a group as one layer. Each site keeps its
        kind and its reference: the static conditions apply each site's own rule (a mixture's SourceUniformMean
        beside a gate's GlobalMean).

        Parameters
        ----------
        *controllers
            Controllers of one model, run within the same context.
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
        _refuse_nested(sites)
        order: dict[Hashable, int] = {}  # each key's group: its rank of first appearance
        grouped = [replace(s, group=order.setdefault(group(s) if group is not None else id(s.module), len(order)))
                   for s in sites]
        return cls(tuple(grouped), " + ".join(dict.fromkeys(c.static_name for c in controllers)),
                   " + ".join(c.description for c in controllers), first.context,
                   notes=tuple(dict.fromkeys(n for c in controllers for n in c.notes)))

    @property
    def labels(self) -> dict[str, str]:
        """Display labels: StaticProfile's, and StructureRemoved's, the sites' references (joined where merged)."""
        return {"StaticProfile": self.static_name,
                "StructureRemoved": " + ".join(dict.fromkeys(s.reference for s in self.sites))}

    def describe(self) -> dict:
        """What config.json records of the controller (an audit under another description is not resumed)."""
        out = {"description": self.description, "sites": [s.name for s in self.sites],
               "codecs": [s.codec.describe() for s in self.sites], "kinds": [s.kind for s in self.sites],
               "references": [s.reference for s in self.sites], "static": self.info.static, "labels": self.labels}
        return out | ({"groups": list(self.groups)} if self.groups else {})

    @contextmanager
    def capture(self, batch: int, token: int, decoding: bool = True) -> Iterator[Captured]:
        """Record each site's output (canonical, detached) during one forward pass of `batch` x `token` ids, into the
        `Captured` list this yields; with `decoding` also what a replay needs to decode them (`Captured.decoding`).

        Examples
        --------
        >>> ids = torch.randn(2, 3, 8)  # this toy model takes hidden states
        >>> with torch.no_grad(), ctrl.capture(2, 3) as found:
        ...     out = model(ids)
        >>> found[0].shape  # [batch, token, stream, source]
        torch.Size([2, 3, 1, 1])
        >>> with torch.no_grad(), ctrl.replay([torch.zeros_like(c) for c in found], found.decoding):
        ...     closed = model(ids)  # both gates replayed as 0: the gated updates vanish
        """
        run = Pass(self.sites, batch, token, decoding)
        with patched(run), self.context():
            yield run.found
        check_ran(run)
        if all(c is not None for c in run.found):  # refused where a kind cannot mean them; as the model obeys them
            self.info.validate([s.name for s in self.sites], run.found)
            run.found[:] = self.info.canonical(run.found)

    @contextmanager
    def outputs(self, batch: int, token: int) -> Iterator[list[tuple[Any, Call] | None]]:
        """Each site's raw output and call (args, kwargs, module) in one forward pass, for the pre-write checks."""
        run = Pass(self.sites, batch, token, raw=[None] * len(self.sites))
        with patched(run), self.context():
            yield run.raw
        check_ran(run)

    @contextmanager
    def replay(self, coeffs: Coeffs, decoding: Sequence[Decoding] | None = None,
               calls: list | None = None) -> Iterator[None]:
        """Within the context each site's result is its decoded coefficients: the site's own computation (its method
        or op) does not run. The model is restored on exit, also when the body raises.

        `decoding` is a capture's (`Captured.decoding`; default: that of `coeffs`, when it is what a capture
        returned). `calls`, a list with one slot per site, receives each site's call (args, kwargs) of the pass, for
        `recompute`."""
        if len(coeffs) != len(self.sites):
            raise FcauditError(f"replay got {len(coeffs)} coefficient tensors for {len(self.sites)} sites")
        decoding = decoding if decoding is not None else getattr(coeffs, "decoding", None)
        if decoding is None or any(d is None for d in decoding):
            raise FcauditError("replay needs what a capture saw of each site's output: pass the coefficients a "
                               "capture returned, or `decoding=` of one (ctrl.replay(coeffs, captured.decoding))")
        sites = self.sites
        native = [None if s.reads_inputs else s.decode(c, d) for s, c, d in zip(sites, coeffs, decoding)]  # in advance

        def replayed(i: int, inputs: Call) -> Any:
            if calls is not None:
                calls[i] = (inputs.args, inputs.kwargs)
            return native[i] if native[i] is not None else sites[i].decode(coeffs[i], decoding[i], inputs)

        run = Pass(sites, replayed=replayed)
        with patched(run), self.context():
            yield
        check_calls(run)

    def recompute(self, calls: list[tuple | None], batch: int, token: int,
                  which: Sequence[int] | None = None) -> dict[int, torch.Tensor]:
        """The live controller's canonical output on the site calls a replay recorded (`replay(..., calls=)`): what
        sites `which` (default all) would have emitted on that trajectory, as a capture keeps it
        (`Description.canonical`). Call outside `replay`."""
        which = range(len(self.sites)) if which is None else which
        found = recompute(self.sites, calls, batch, token, which)
        if self.info.depth and len(found) == len(self.sites):
            found = dict(enumerate(self.info.canonical([found[i] for i in range(len(self.sites))])))
        return found


@dataclass(frozen=True)
class Seen:
    """What `Controller.observing` saw: per token-router site the rows of each call of its routed block, and per
    block of `Controller.runs` the rows each of its computing modules took."""

    calls: dict[int, list]
    blocks: list[Counter]


# the default codecs a kind names (`Kind.codec`): kinds live below the codecs, so they name them and this maps them
OWN_CODECS: dict[str, Callable[[], Codec]] = {"TokenRoute": TokenRoute, "Decisions": Decisions}


def _refuse_nested(sites: list[Site]) -> None:
    """Refuses an op site that numbers its calls (call=N) beside a site nested in the module whose method it watches:
    a replay does not run the nested site's computation, so the calls it made no longer count and call N would be
    another call (or none), replayed silently wrong."""
    for o in sites:
        if o.op is None or o.call is None:
            continue
        inside = {id(m) for m in o.module.modules()}
        for s in sites:
            same_op = s.module is o.module and s.method == o.method and s.op == o.op
            if id(s.module) in inside and not same_op and (s.op is None or s.op == o.op):
                raise FcauditError(f"site {o.name!r} numbers the calls of {o.op!r} in {o.path}.{o.method}, and site "
                                   f"{s.name!r} lies inside {o.path}: a replay does not run it, so the call numbers "
                                   "would shift; audit the two in separate controllers")


def _codec(layout: str | Codec | None, codec: Codec | None, kind: str | None) -> Codec:
    """The site's codec from `layout` or `codec`; a kind that has its own codec (a token router's, a depth
    decision's: `Kind.codec`) gets it without either."""
    if isinstance(layout, Codec) and codec is None:
        codec, layout = layout, None
    own = lookup(kind) if kind is not None else None
    if own is not None and own.codec is not None and codec is None:
        if layout is not None:
            raise FcauditError(f"kind={kind!r} with layout {layout!r}: a {kind.replace('_', ' ')}'s coefficient is "
                               f"{own.coefficient}; drop the layout ({own.reads}) or pass codec=")
        return OWN_CODECS[own.codec]()
    if codec is None and not isinstance(layout, str):
        raise FcauditError("describe the site output: pass layout='batch token' (an einops layout of a tensor) or "
                           "codec=... for a tuple or other structured output")
    return codec if codec is not None else Layout.parse(layout)
