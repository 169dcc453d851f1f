"""Finding the controller sites of a Hugging Face MoE model by structure, not by class name.

A router has top-k and expert-count attributes and a [num_experts, hidden] weight, beside an experts module (3-D
weights or a ModuleList); one probe forward pass checks what makes its codec valid (`_probe`). A Linear(hidden, 1)
sibling of a router (Qwen2-MoE's shared_expert_gate) is a second kind of site: one scalar per token.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from fcaudit import placement
from fcaudit.controllers.codecs import Codec
from fcaudit.controllers.controller import Controller
from fcaudit.controllers.sites import Site
from fcaudit.errors import FcauditError, one_line
from fcaudit.families import DEFAULT_WINDOW_CAP, OWN_ROUTE, context_length
from fcaudit.families.hf.codecs import (ROUTER_PARTS, SHARED, STATE, GroupedRouterCodec, ScoreRouterCodec,
                                        SharedGateCodec, TopKRouterCodec, experts_implementation, is_grouped,
                                        split_parts, split_score_output)
from fcaudit.families.hf.load import TOP_K_KEYS
from fcaudit.loss import logits_of

TOP_K_NAMES = ("top_k", "num_experts_per_tok")
TOP_K_CONFIG_NAMES = ("top_k", *TOP_K_KEYS)  # where a router that does not say its top-k may find it
# LongCat-Flash: the router's n_routed_experts counts its zero-computation (identity) experts too, which its
# num_experts does not; a router's count is the one its weight has rows for. Its experts module may hold all of them
# (total_experts) or only those that compute, the block handling the rest itself (`_experts_of`).
# Zaya: its router's weight has a row for a skip expert too (num_router_classes), which its experts skip; Inkling's
# for its shared experts too (n_total_experts), whose weights it returns beside its choices.
NUM_EXPERTS_NAMES = ("num_experts", "num_local_experts", "n_routed_experts", "total_experts", "num_router_classes",
                     "n_total_experts")
# Routers tested end to end; used only to name the closest supported one in an error message.
SUPPORTED_EXAMPLES = ("MixtralTopKRouter", "OlmoeTopKRouter", "Qwen2MoeTopKRouter", "Qwen3MoeTopKRouter",
                      "DeepseekV3TopkRouter", "GptOssTopKRouter", "Llama4Router")
PROBE_TOKENS = 4
REPEAT_TOLERANCE = 1e-3  # "repeat" padding: the probe's bound on the output's change, relative to its largest value


def _counts(m: nn.Module, names: tuple[str, ...]) -> list[int]:
    return [v for n in names if isinstance(v := getattr(m, n, None), int) and not isinstance(v, bool) and v > 0]


def _int_attr(m: nn.Module, names: tuple[str, ...]) -> int | None:
    return next(iter(_counts(m, names)), None)


def _router_shape(m: nn.Module) -> tuple[int, int] | None:
    """(num_experts, hidden) of a router-like module: the first of its expert counts that a 2-D weight has rows for."""
    weights = [p for p in m.parameters() if p.dim() == 2]
    return next(((v, p.shape[1]) for v in _counts(m, NUM_EXPERTS_NAMES) for p in weights if p.shape[0] == v), None)


def _holds_experts(m: nn.Module, num_experts: int) -> bool:
    if isinstance(m, nn.ModuleList):
        return len(m) == num_experts
    if any(p.dim() == 3 and p.shape[0] == num_experts for p in m.parameters(recurse=False)):
        return True
    # DBRX: each expert a block of rows of 2-D weights [num_experts x size, hidden], size one of its attributes
    sizes = {v for v in vars(m).values() if isinstance(v, int) and not isinstance(v, bool) and v > 1}
    flat = [p for p in m.parameters() if p.dim() == 2]
    return bool(flat) and all(any(p.shape[0] == num_experts * v for v in sizes) for p in flat)


def _experts_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Modules that hold as many experts as their own expert-count attribute says."""
    return {path: m for path, m in model.named_modules()
            if (E := _int_attr(m, NUM_EXPERTS_NAMES)) is not None and _holds_experts(m, E)}


def _closest(cls_name: str) -> str:
    return difflib.get_close_matches(cls_name, SUPPORTED_EXAMPLES, n=1, cutoff=0.0)[0]


def _unsupported(m: nn.Module, path: str, why: str) -> FcauditError:
    cls = type(m).__name__
    return FcauditError(f"unsupported MoE router {cls} at {path}: {why}; fcaudit finds transformers>=5 top-k routers "
                        f"that hand (router_logits, top_k_weights, top_k_index) to an experts module, or return "
                        f"(router_scores, router_logits) with scores zero off the top-k, like {_closest(cls)}; for "
                        f"this one, {OWN_ROUTE}")


@dataclass
class _Candidate:
    path: str
    module: nn.Module
    top_k: int | None  # None: read from the router's output by the probe
    num_experts: int
    experts_path: str
    experts: nn.Module
    gate_paths: list[str]
    codec: Codec | None = None  # set by the probe, which tells a top-k router from a score router and its padding
    method: str = "forward"  # a block's method where the router returns its logits only (DBRX)
    repeats: bool = False  # the probe saw it route a token to one expert in two slots (`_repeats`)
    shared: int = 0  # the shared experts its weight has rows for beyond its routed ones (`_read_shared`)


def _experts_of(siblings: dict[str, nn.Module], experts: dict[str, nn.Module], E: int) -> list[tuple[str, nn.Module]]:
    """A router's experts among its siblings: those holding its E experts, else those holding fewer (the block then
    computes the others itself, as LongCat-Flash's identity experts; the probe checks that padding keeps it so)."""
    held = [(p, c, _int_attr(c, NUM_EXPERTS_NAMES)) for p, c in siblings.items() if p in experts]
    return [(p, c) for p, c, n in held if n == E] or [(p, c) for p, c, n in held if n < E]


def _siblings(modules: dict[str, nn.Module], parent_path: str, of: nn.Module) -> dict[str, nn.Module]:
    return {f"{parent_path}.{n}" if parent_path else n: c for n, c in modules[parent_path].named_children() if c is not of}


def _shared_gates(siblings: dict[str, nn.Module], hidden: int) -> list[str]:
    """Linear(hidden, 1) siblings of a router: shared-expert gates if the probe sees them run once per token."""
    return [p for p, c in siblings.items() if isinstance(c, nn.Linear) and c.out_features == 1 and c.in_features == hidden]


def _unnamed_router(modules: dict[str, nn.Module], experts: dict[str, nn.Module], path: str) -> _Candidate | None:
    """The router of the experts at `path` that says neither its top-k nor its expert count (Gemma-4's reads them
    from its config, Ergo's count from its weight): the smallest sibling holding a [num_experts, hidden] weight. Its
    top-k is its own, its config's or its block's, else what its output holds (the probe reads it)."""
    m, parent_path = modules[path], path.rpartition(".")[0]
    E, block = _int_attr(m, NUM_EXPERTS_NAMES), modules[parent_path]
    siblings = _siblings(modules, parent_path, m)
    routers = [(p, c, w.shape[1]) for p, c in siblings.items() if p not in experts
               and not any(e.startswith(p + ".") for e in experts)
               for w in [next((w for w in c.parameters() if w.dim() == 2 and w.shape[0] == E), None)] if w is not None]
    if not routers:
        return None
    p, router, hidden = min(routers, key=lambda r: sum(w.numel() for w in r[1].parameters()))
    k = next((k for o in (router, getattr(router, "config", None), block, getattr(block, "config", None))
              if (k := _int_attr(o, TOP_K_CONFIG_NAMES)) is not None), None)
    return _Candidate(p, router, k, E, path, m, _shared_gates(siblings, hidden))


def _candidates(model: nn.Module) -> list[_Candidate]:
    modules = dict(model.named_modules())
    experts = _experts_modules(model)
    found, routed_parents = [], set()
    for path, m in modules.items():
        k, shape = _int_attr(m, TOP_K_NAMES), _router_shape(m)
        if k is None or shape is None or not path or path in experts or any(e.startswith(path + ".") for e in experts):
            continue  # not router-like, or a block that contains the experts itself
        (E, hidden), parent_path = shape, path.rpartition(".")[0]
        siblings = _siblings(modules, parent_path, m)
        ex = _experts_of(siblings, experts, E)
        if not ex:
            continue
        found.append(_Candidate(path, m, k, E, ex[0][0], ex[0][1], _shared_gates(siblings, hidden)))
        routed_parents.add(parent_path)
    for path, m in experts.items():
        parent_path = path.rpartition(".")[0]
        if parent_path in routed_parents:
            continue
        if (c := _unnamed_router(modules, experts, path)) is None:
            block = modules[parent_path]
            raise FcauditError(f"unsupported MoE block {type(block).__name__} at {parent_path or 'the model'}: its experts "
                               f"({type(m).__name__}) have no router module beside them; fcaudit finds "
                               f"transformers>=5 top-k routers like {_closest(type(block).__name__)}; for this one, "
                               f"{OWN_ROUTE}")
        found.append(c)
    order = {p: i for i, p in enumerate(modules)}
    return sorted(found, key=lambda c: order[c.path])


def ensure_eager_experts(model: nn.Module) -> str:
    """Switch a transformers model's experts to the eager implementation (see codecs.py for why); returns the
    implementation it ran before. Capture and replay must both run eager: the audit's Correct NLL is eager's."""
    experts = list(_experts_modules(model).values())
    before = sorted({experts_implementation(m) for m in experts}) or ["eager"]
    if before != ["eager"] and hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation("eager")
    still = sorted({experts_implementation(m) for m in experts} - {"eager"})
    if still:
        raise FcauditError(f"cannot switch the experts of {type(model).__name__} from {still[0]!r} to 'eager'; "
                           f"load the model with experts_implementation='eager'")
    return ",".join(before)


def _probe(model: nn.Module, cands: list[_Candidate]) -> None:
    """One short forward pass: each router returns (router_logits, top_k_weights, top_k_index), which reach its
    experts (or its block turns them into what they receive) and a padded slot leaves the output as it is; or
    (router_scores, router_logits), top_k per token at most; or its logits only, and a method of its block returns the
    (top_k_weights, top_k_index) its experts receive (one more pass finds it)."""
    outputs: dict[str, object] = {}  # the first output of each router and gate
    inputs: dict[str, tuple] = {}  # the first (args, kwargs) of each experts module and each router's block
    handles = [model.get_submodule(p).register_forward_hook(lambda m, a, o, p=p: outputs.setdefault(p, o))
               for c in cands for p in [c.path, *c.gate_paths]]
    handles += [model.get_submodule(p).register_forward_pre_hook(lambda m, a, k, p=p: inputs.setdefault(p, (a, k)),
                                                                 with_kwargs=True)
                for p in dict.fromkeys(q for c in cands for q in (c.experts_path, _block_path(c)))]
    try:
        _probe_forward(model, cands, outputs, inputs)
    finally:
        for h in handles:
            h.remove()
    pads: dict[type, str] = {}  # the padding of each experts class, probed on the CPU for a model elsewhere
    for c in cands:
        if c.path not in outputs or c.experts_path not in inputs:
            raise _unsupported(c.module, c.path, f"it or its experts ({c.experts_path}) did not run in a forward pass")
    lone = [c for c in cands if isinstance(outputs[c.path], torch.Tensor)]  # logits only: the block picks the top-k
    if lone:
        _find_routing_methods(model, cands, lone, outputs, inputs)
    for c in cands:
        if c.method == "forward" and c.top_k is not None and is_grouped(outputs[c.path], c.num_experts):
            c.codec, c.gate_paths = GroupedRouterCodec(c.num_experts, c.top_k, c.path, c.experts_path), []
            continue  # its experts take the grouped rows, and an absent slot pads exactly (the codec's docstring)
        if c.method == "forward":
            _read_shared(c, outputs[c.path])
        output, names = outputs[c.path] if c.method != "forward" else \
            (outputs[c.path], _forward_names(outputs[c.path], c.shared))
        # (router_scores, router_logits): dense scores, every expert's input scaled by its own
        scored = names == ROUTER_PARTS and isinstance(output, (tuple, list)) and len(output) == 2
        try:
            if scored:
                parts = split_score_output(output, c.num_experts, "it")
            else:  # (logits, weights, index), the logits None where a block's method returns none
                parts = tuple(split_parts(output, names, c.num_experts, "it").get(n) for n in ROUTER_PARTS)
        except FcauditError as e:
            raise _unsupported(c.module, c.path, str(e)) from None
        if c.top_k is None:  # a router that does not say its top-k: the experts per token it returned
            c.top_k = int((parts[0] != 0).sum(1).max()) if scored else parts[1].shape[1]
        if scored:
            if ((parts[0] != 0).sum(1) > c.top_k).any():
                raise _unsupported(c.module, c.path, f"its scores select more than top_k={c.top_k} experts per token")
            c.codec = ScoreRouterCodec(c.num_experts, c.top_k, c.path, c.experts_path)
        else:
            _, weights, index = parts
            if weights.shape[1] != c.top_k:
                raise _unsupported(c.module, c.path, f"it returned {weights.shape[1]} experts per token, not "
                                                     f"top_k={c.top_k}")
            args, kwargs = inputs[c.experts_path]
            received = list(args) + list(kwargs.values())
            if any(t is index for t in received) and any(t is weights for t in received):
                module, make = c.experts, lambda a, k, cpu, c=c, i=index, w=weights: _experts_run(c, a, k, cpu(i),
                                                                                                   cpu(w))
            else:  # the block turns them into what its experts receive (LongCat-Flash's identity experts): the
                module, (args, kwargs) = model.get_submodule(_block_path(c)), inputs[_block_path(c)]  # padding is
                make = lambda a, k, cpu, c=c, b=module: _block_run(c, b, a, k)  # probed on the whole block
            pad = _padding_on_cpu(c, module, args, kwargs, make, pads)
            c.repeats = _repeats(index, c.num_experts)
            c.codec = TopKRouterCodec(c.num_experts, c.top_k, c.experts, c.path, c.experts_path, pad, names)
        # a Linear(hidden, 1) sibling is a shared-expert gate only if it ran once per token
        c.gate_paths = [g for g in c.gate_paths
                        if isinstance(outputs.get(g), torch.Tensor) and outputs[g].numel() == parts[1].shape[0]]


def _repeats(index: torch.Tensor, num_experts: int) -> bool:
    """Whether a row of a router's choices names one expert twice (DeepSeek-V4's hash router: a table of token ids,
    all zeros until a checkpoint fills it): the combine vector sums the two slots' weights, which the experts add
    apart, so replay cannot be exact. The sentinel index num_experts may repeat."""
    ranked = index.sort(1).values
    return bool(((ranked[:, 1:] == ranked[:, :-1]) & (ranked[:, 1:] < num_experts)).any())


def _read_shared(c: _Candidate, output) -> None:
    """Inkling: a router whose weight has rows for its shared experts too (n_total_experts) returns logits over its
    routed experts only, as many as its experts module holds; the other rows weigh its shared experts."""
    held = _int_attr(c.experts, NUM_EXPERTS_NAMES)
    logits = output[0] if isinstance(output, (tuple, list)) and output else None
    if isinstance(logits, torch.Tensor) and logits.dim() == 2 and held is not None and logits.shape[1] == held \
            and held < c.num_experts:
        c.shared, c.num_experts = c.num_experts - held, held


def _forward_names(output, shared: int = 0) -> tuple[str, ...]:
    """A router's leaves: (logits, weights, index), then for each further tensor it returns a SHARED (its `shared`
    experts' weights [N, shared], Inkling's) or a STATE (Zaya's router state, read by the next layer's router only)."""
    extra = output[len(ROUTER_PARTS):] if isinstance(output, (tuple, list)) else ()
    if extra and all(isinstance(t, torch.Tensor) for t in output):
        return ROUTER_PARTS + tuple(SHARED if shared and t.dim() == 2 and t.shape[1] == shared else STATE
                                    for t in extra)
    return ROUTER_PARTS


def _check_states(model: nn.Module, cands: list[_Candidate]) -> None:
    """Routers that return a state beside their choices (Zaya's, for the next layer's router): a pass in which every
    router returns its own choices with zero states must give the model's logits, so that nothing but routers reads
    the states (a replay computes them for the route-flip check alone, codecs.TopKRouterCodec._states)."""
    stateful = [c for c in cands if STATE in getattr(c.codec, "parts", ())]
    if not stateful:
        return
    live: dict[str, tuple] = {}
    handles = [c.module.register_forward_hook(lambda m, a, o, p=c.path: live.setdefault(p, o)) for c in stateful]
    try:
        n = _probe_forward(model, cands, live, {})
        reference = logits_of(forward_window(model, n))
    finally:
        for h in handles:
            h.remove()
    zeroed = lambda c: tuple(torch.zeros_like(t) if p == STATE else t for p, t in zip(c.codec.parts, live[c.path]))
    handles = [c.module.register_forward_hook(lambda m, a, o, c=c: zeroed(c)) for c in stateful]
    try:
        same = torch.equal(logits_of(forward_window(model, n)), reference)
    finally:
        for h in handles:
            h.remove()
    if not same:
        c = stateful[0]
        raise _unsupported(c.module, c.path, f"it returns a state beside its choices ({_shapes_of(live[c.path])}), "
                                             "which more than the next router reads")


def _fixed_width(model: nn.Module, cands: list[_Candidate]) -> list[_Candidate]:
    """The grouped routers whose block runs exactly top_k experts per token (JetMoE's attention experts: k query
    slots per token): a probe pass with every expert of one block class's routers given a weight fails. One pass per
    block class."""
    grouped: dict[type, list[_Candidate]] = {}
    for c in cands:
        if isinstance(c.codec, GroupedRouterCodec):
            grouped.setdefault(type(model.get_submodule(_block_path(c))), []).append(c)
    fixed = []
    for same in grouped.values():
        def every_expert(m, a, o, c=same[0]):
            coeffs = c.codec.encode(o, 1, o[4].shape[0])
            return c.codec.decode(torch.where(coeffs != 0, coeffs, 1.0), c.codec.meta(o))
        handles = [c.module.register_forward_hook(every_expert) for c in same]
        try:
            _probe_forward(model, cands, {}, {})
        except FcauditError:
            fixed += same
        finally:
            for h in handles:
                h.remove()
    return fixed


def _shapes_of(output) -> str:
    return ", ".join(f"Tensor{list(t.shape)}" for t in output)


def _own_methods(block: nn.Module) -> list[str]:
    """The methods a block's classes define beyond nn.Module's, but forward: where a block may pick its top-k."""
    base = set(dir(nn.Module))
    return sorted({n for cls in type(block).__mro__ for n, v in vars(cls).items()
                   if inspect.isfunction(v) and n not in base and not n.startswith("__")} - set(vars(block)))


def _recording(method: Callable, key: tuple[str, str], returns: dict) -> Callable:
    """`method`, its first return kept in `returns[key]`."""
    def recorded(*args, **kwargs):
        out = method(*args, **kwargs)
        returns.setdefault(key, out)
        return out
    return recorded


def _find_routing_methods(model: nn.Module, cands: list[_Candidate], lone: list[_Candidate], outputs: dict,
                          inputs: dict) -> None:
    """For routers that return their logits only (DBRX): one more probe pass with their blocks' own methods
    recorded; the site is the method whose return holds the (top_k_weights, top_k_index) the experts receive.
    `outputs` takes (its return, its leaves' names) under the block's path, `inputs` the experts' inputs of that pass."""
    returns: dict[tuple[str, str], object] = {}
    blocks = {_block_path(c): model.get_submodule(_block_path(c)) for c in lone}
    wrapped = []
    for path, block in blocks.items():
        for name in _own_methods(block):
            block.__dict__[name] = _recording(getattr(block, name), (path, name), returns)  # for this pass only
            wrapped.append((block, name))
    received: dict[str, tuple] = {}  # this pass's experts inputs: the returns are found among them by identity
    handles = [c.experts.register_forward_pre_hook(lambda m, a, k, p=c.experts_path: received.setdefault(p, (a, k)),
                                                   with_kwargs=True) for c in lone]
    try:
        _probe_forward(model, cands, {}, received)
    finally:
        for h in handles:
            h.remove()
        for block, name in wrapped:
            block.__dict__.pop(name, None)
    for c in lone:
        args, kwargs = inputs[c.experts_path] = received[c.experts_path]
        found = [(name, out, names) for (path, name), out in returns.items() if path == _block_path(c)
                 for names in [_leaf_names(out, [*args, *kwargs.values()])] if names is not None]
        if len(found) != 1:
            raise _unsupported(c.module, c.path, f"it returns its logits only, and {len(found) or 'no'} methods of its "
                                                 f"block return the top-k weights and index its experts receive")
        name, out, names = found[0]
        c.path, c.module, c.method = _block_path(c), blocks[_block_path(c)], name
        outputs[c.path] = (out, names)


def _leaf_names(out, received: list) -> tuple[str, ...] | None:
    """The names of a method's returned leaves if they are the (weights, index) the experts received, with or
    without the logits, in any order; else None."""
    if not (isinstance(out, (tuple, list)) and len(out) in (2, 3) and all(isinstance(t, torch.Tensor) for t in out)):
        return None
    passed = [any(t is r for r in received) for t in out]
    names = tuple(("weights" if t.is_floating_point() else "index") if p else "logits" for t, p in zip(out, passed))
    return names if sorted(names) in (sorted(ROUTER_PARTS), ["index", "weights"]) else None


def probe_lengths(model: nn.Module) -> list[int]:
    """PROBE_TOKENS, then longer windows the model takes (a sparse attention that selects more keys than a short
    window holds fails on it), up to its context or the default window cap."""
    longest = min(context_length(model) or DEFAULT_WINDOW_CAP, DEFAULT_WINDOW_CAP)
    return sorted({min(n, longest) for n in (PROBE_TOKENS, 8 * PROBE_TOKENS, 64 * PROBE_TOKENS, DEFAULT_WINDOW_CAP)})


def forward_window(model: nn.Module, n: int):
    """The model's output on a probe window of n tokens."""
    vocab = getattr(getattr(model, "config", None), "vocab_size", None) or 2
    ids = (torch.arange(n) % vocab).unsqueeze(0).to(placement.input_device(model))
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False) if "use_cache" in inspect.signature(model.forward).parameters \
            else model(ids)


def _probe_forward(model: nn.Module, cands: list[_Candidate], outputs: dict, inputs: dict) -> int:
    """One forward pass of the shortest probe window the model runs; `outputs` and `inputs` hold that pass's.
    Returns its length."""
    # a failed pass may have run some routers
    return probe_pass(model, lambda: (outputs.clear(), inputs.clear()),
                      check=f" (its routers read top_k {cands[0].top_k} of {cands[0].num_experts} experts)")


def probe_pass(model: nn.Module, before: Callable[[], object] = lambda: None, why: str = "", check: str = "") -> int:
    """One forward pass of the shortest probe window the model runs (`before` it each try); returns its length. Where
    every one fails, one line: `why` the probe runs, and what in config.json to `check`."""
    first = None
    for n in probe_lengths(model):
        before()
        try:
            forward_window(model, n)
            return n
        except (RuntimeError, IndexError, ValueError, NotImplementedError) as e:
            # e.g. Llama 4 sends its ids to the embedding's device
            if "meta tensor" in str(e) and placement.is_dispatched(model):
                raise FcauditError(f"{type(model).__name__} cannot run with the device map given: a module it reads "
                                   "directly (its input embedding) is offloaded; keep model.embed_tokens on a device "
                                   "(cpu or cuda) in the map") from e
            first = first or (n, e)
    n, e = first
    raise FcauditError(f"{type(model).__name__} fails a {n}-token forward pass ({type(e).__name__}: "
                       f"{one_line(e, 120)}) and every longer probe up to {probe_lengths(model)[-1]} tokens{why}; "
                       f"check its config.json{check} and that the model fits in memory") from e


def _block_path(c: _Candidate) -> str:
    return c.path if c.method != "forward" else c.path.rpartition(".")[0]


# A probe run: the output of the experts (or of the router's block) with each router slot row widened by `widen`
# (weights, index) -> (weights, index), or as it is for None
Run = Callable[[Callable | None], torch.Tensor]


def _experts_run(c: _Candidate, args: tuple, kwargs: dict, index: torch.Tensor, weights: torch.Tensor) -> Run:
    """The experts called on their inputs, `index` and `weights` (found among them by identity) widened."""
    def run(widen: Callable | None) -> torch.Tensor:
        swap = dict(zip((id(weights), id(index)), widen(weights, index))) if widen else {}
        sub = lambda t: swap.get(id(t), t)  # noqa: E731
        with torch.no_grad():
            return c.experts(*map(sub, args), **{k: sub(v) for k, v in kwargs.items()})
    return run


def _block_run(c: _Candidate, block: nn.Module, args: tuple, kwargs: dict) -> Run:
    """The router's block called on its inputs, its router's (logits, weights, index) widened as they leave it."""
    def run(widen: Callable | None) -> torch.Tensor:
        hook = c.module.register_forward_hook(lambda m, a, o: (o[0], *widen(o[1], o[2]), *o[3:]) if widen else None)
        try:
            with torch.no_grad():
                out = block(*args, **kwargs)
        finally:
            hook.remove()
        return out[0] if isinstance(out, (tuple, list)) else out  # the hidden states, beside any router logits
    return run


def _padding_on_cpu(c: _Candidate, module: nn.Module, args: tuple, kwargs: dict,
                    make: Callable[[tuple, dict, Callable], Run], pads: dict[type, str]) -> str:
    """`_padding` of `make(args, kwargs, cpu)` (`module` called on them), probed on the CPU (on CUDA a refused index
    trips a device-side assert that ends the CUDA context): for a model elsewhere once per module class (`pads`), on
    CPU copies of its weights and inputs; `cpu` maps each input to its copy."""
    tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
    if not any(placement.off_cpu(t) for t in tensors):
        return _padding(c, module, make(args, kwargs, lambda t: t))
    if type(module) not in pads:
        moved = {id(t): t.cpu() for t in tensors}  # one CPU copy per tensor: a run finds index and weights by identity
        cpu = lambda t: moved.get(id(t), t)  # noqa: E731
        with placement.on_cpu(module):
            pads[type(module)] = _padding(c, module, make(tuple(map(cpu, args)), {k: cpu(v) for k, v in kwargs.items()},
                                                          cpu))
    return pads[type(module)]


def _padding(c: _Candidate, module: nn.Module, run: Run) -> str:
    """How decode may pad a row (codecs.PADDINGS): "sentinel" if one more slot (num_experts, weight 0) leaves the
    experts' output bit-identical, else "repeat" if each token's first expert again at weight 0 keeps it within
    REPEAT_TOLERANCE of its largest value (or 4 ulps): more rows move rounding, a weighted slot a whole expert."""
    plain = run(None)
    failed = {}
    for pad, filler in (("sentinel", lambda index: torch.full_like(index[:, :1], c.num_experts)),
                        ("repeat", lambda index: index[:, :1])):
        widen = lambda weights, index, filler=filler: (  # noqa: E731
            torch.cat([weights, torch.zeros_like(weights[:, :1])], 1), torch.cat([index, filler(index)], 1))
        try:
            padded = run(widen)
        except (IndexError, RuntimeError) as e:
            failed[pad] = f"reject it ({type(e).__name__})"
            continue
        if torch.equal(plain, padded):
            return pad
        scale = float(plain.abs().max()) if plain.numel() else 0.0
        tolerance = max(REPEAT_TOLERANCE, 4 * torch.finfo(plain.dtype).eps) * scale
        if pad == "repeat" and float((padded - plain).abs().max()) <= tolerance:
            return pad
        failed[pad] = "change their output"
    what = "experts" if module is c.experts else "block"
    raise _unsupported(c.module, c.path, f"its {what} ({type(module).__name__}) cannot be padded: the sentinel index "
                                         f"{c.num_experts} at weight 0 they {failed['sentinel']}, a repeated expert at "
                                         f"weight 0 they {failed['repeat']}")


def moe_controller(model: nn.Module) -> Controller:
    """The audit controller of an MoE model: its routers (and shared-expert gates), each with its codec, in module
    order. Switches its experts to eager first, and back when the model cannot be audited."""
    before = ensure_eager_experts(model)
    try:
        cands = _candidates(model)
        if not cands:
            raise FcauditError(f"{type(model).__name__} has no MoE router (a module with top_k and num_experts "
                               "attributes next to an experts module); fcaudit finds the routers of transformers>=5 MoE "
                               f"models like Mixtral; for this model, {OWN_ROUTE}")
        _probe(model, cands)
        _check_states(model, cands)
        skipped = {"fixed": _fixed_width(model, cands), "repeats": [c for c in cands if c.repeats]}
        cands = [c for c in cands if not any(c in s for s in skipped.values())] or _refuse_skipped(model, skipped)
    except FcauditError:
        if before != "eager" and "," not in before and hasattr(model, "set_experts_implementation"):
            model.set_experts_implementation(before)  # leave a model we cannot audit as it was
        raise
    sites = [Site(c.path, c.module, codec=c.codec, method=c.method) for c in cands]
    sites += [Site(g, model.get_submodule(g), codec=SharedGateCodec(g)) for c in cands for g in c.gate_paths]
    order = {p: i for i, (p, _) in enumerate(model.named_modules())}
    sites.sort(key=lambda s: order[s.path])
    gates = len(sites) - len(cands)
    desc = (f"{type(model).__name__}: {len(cands)} top-{cands[0].top_k} routers over {cands[0].num_experts} experts "
            f"({type(cands[0].module).__name__})" + (f", {gates} shared-expert gates" if gates else ""))
    return Controller(tuple(sites), static_name="StaticMixMean", description=desc,
                      notes=_skipped_notes(model, skipped) + _shared_notes(cands))


def _shared_notes(cands: list[_Candidate]) -> tuple[str, ...]:
    """The shared experts' weights a router returns beside its choices: every replay recomputes them live."""
    shared = [c for c in cands if SHARED in getattr(c.codec, "parts", ())]
    if not shared:
        return ()
    c = shared[0]
    note = (f"not audited: the weights of {c.shared} shared experts that {len(shared)} {type(c.module).__name__} "
            f"routers ({c.path}{', ...' if len(shared) > 1 else ''}) return beside their top-{c.top_k} choices; "
            "every replay recomputes them live from the router's input")
    return (note,)


def _skipped_why(model: nn.Module, skipped: dict[str, list[_Candidate]]) -> list[str]:
    """Why each group of routers left out of the controller is: `_fixed_width`'s, or `_repeats`'."""
    why = []
    for reason, cands in skipped.items():
        if not cands:
            continue
        c = cands[0]
        what = f"{len(cands)} {type(c.module).__name__} routers ({c.path}{', ...' if len(cands) > 1 else ''})"
        if reason == "fixed":
            block = type(model.get_submodule(_block_path(c))).__name__
            why.append(f"{len(cands)} routers of {block} ({c.path}{', ...' if len(cands) > 1 else ''}): the block runs "
                       f"exactly top-{c.top_k} experts per token, so the conditions that replay a mean over experts "
                       "cannot run in it")
        else:
            why.append(f"{what}: they route a token to one expert in two slots (e.g. by a table of token ids still "
                       "all zeros), whose weights the experts add apart and a combine vector sums, so no replay of "
                       "them is exact; they run live")
    return why


def _skipped_notes(model: nn.Module, skipped: dict[str, list[_Candidate]]) -> tuple[str, ...]:
    return tuple(f"not audited: {w}" for w in _skipped_why(model, skipped))


def _refuse_skipped(model: nn.Module, skipped: dict[str, list[_Candidate]]):
    raise FcauditError(f"{type(model).__name__}: its only routers are {'; and '.join(_skipped_why(model, skipped))}; "
                       f"{OWN_ROUTE}")


def is_moe(model: nn.Module) -> bool:
    """Structural check (no forward pass): does the model hold a router next to an experts module?"""
    try:
        return bool(_candidates(model))
    except FcauditError:  # an MoE block of an unsupported kind: still this family's, its adapter will say why
        return True
