"""Checks before anything is written: what passes the exact replay check and still is not a controller audit.

On one more Correct pass of the first evaluation batch: a refusal when the eval forward is not deterministic or a
codec does not rebuild its site's output, a notice when a site looks like a hidden state (route flips are counted by
the engine's exact replay check).
"""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from fcaudit.controllers.site import Call, Controller, Site, first_tensor, leaves, op_name
from fcaudit.loss import logits_of


@dataclass(frozen=True)
class Finding:
    """One line for the user: a refusal (raise FcauditError(line)) or a notice (print it with the results)."""

    line: str
    refusal: bool


SUMS = {"add", "add_", "sub", "sub_"}  # op_name of `x + h`, `x += h`, `x - h`, `1 - h`


class _Flow(TorchFunctionMode):
    """Follows the outputs of the `watch`ed sites through one forward pass to the inputs of later modules (`feeds`).

    A tensor carries a site's output when it is that output, or the result of a torch function of a carrier with as
    many elements (a view, an elementwise op) whose other tensors are smaller (a per-channel scale) or, for a sum, of
    any size (the residual stream). A product with a tensor as large stops it: a coefficient acting on activations."""

    def __init__(self, outputs: list, watch: Sequence[int]):
        super().__init__()
        self.outputs, self.pending, self.feeds = outputs, set(watch), set()
        self.carriers: dict[int, tuple[torch.Tensor, frozenset[int]]] = {}  # id -> (the tensor, its sites)

    def sites_of(self, t: Any) -> frozenset[int]:
        """The sites `t` carries that no module took yet."""
        for i in [i for i in self.pending if self.outputs[i] is not None]:  # a site that ran since the last look
            self.pending.discard(i)
            out = first_tensor(self.outputs[i][0])
            if out is not None:
                self.carriers[id(out)] = (out, frozenset({i}))
        held = self.carriers.get(id(t))
        return held[1] - self.feeds if held is not None and held[0] is t else frozenset()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor):
            tensors = [t for _, t in leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            carrying = {id(t): self.sites_of(t) for t in tensors if t.numel() == out.numel()}
            sites = frozenset().union(*carrying.values())
            if sites and (op_name(func) in SUMS or all(t.numel() < out.numel() for t in tensors
                                                         if not carrying.get(id(t)))):
                self.carriers[id(out)] = (out, sites | self.sites_of(out))
        return out

    def consumer(self, module: nn.Module, args: tuple) -> None:
        """A module's forward pre-hook: the sites its inputs carry feed it."""
        fed = frozenset().union(*(self.sites_of(t) for _, t in leaves(args)))
        if fed:
            self.feeds |= fed
            self.carriers = {k: (t, s - self.feeds) for k, (t, s) in self.carriers.items() if s - self.feeds}


def check_deterministic(controller: Controller, logits: torch.Tensor, coeffs: list[torch.Tensor],
                        probe: tuple) -> Finding | None:
    """Refused when a second Correct pass of the first batch gives other logits or coefficients than the probe."""
    if not torch.equal(logits, probe[1]):
        diff = float((logits.double() - probe[1].double()).abs().max())
        where = f"the logits (max |Δlogit| = {diff:.3g})"
    else:
        site = next((s for s, a, b in zip(controller.sites, coeffs, probe[0]) if not torch.equal(a, b.to(a.device))),
                    None)
        if site is None:
            return None
        where = f"the coefficients of site {site.name!r}"
    return Finding(f"two Correct passes of the first evaluation batch differ in {where}: the model is not "
                   "deterministic in eval mode (e.g. a router that samples, or noise left on outside training); make "
                   "its eval forward deterministic before auditing", True)


def _differs(a: Any, b: Any) -> str | None:
    if isinstance(a, torch.Tensor) != isinstance(b, torch.Tensor):
        return f"{type(b).__name__} instead of {type(a).__name__}"
    if not isinstance(a, torch.Tensor):
        return None if a == b else f"{b!r} instead of {a!r}"
    if a.shape != b.shape or a.dtype != b.dtype:
        return f"{b.dtype} {list(b.shape)} instead of {a.dtype} {list(a.shape)}"
    if not torch.equal(a, b.to(a.device)):
        return f"other values ({int((a != b.to(a.device)).sum())} of {a.numel()} elements)"
    return None


def round_trip_difference(site: Site, output: Any, call: Call, batch: int, token: int) -> str | None:
    """Where decode(encode(output)) differs from `output`: the first differing leaf and how, or None. The codec's
    `placeholders` (leaves the model never reads) are skipped; when only its `slots` (weight and index leaves)
    differ, rows holding the same (index, weight) pairs in another order are reported as "slot order"."""
    skip = set(getattr(site.codec, "placeholders", ()))
    got, want = dict(leaves(site.decode(site.encode(output, batch, token), call))), dict(leaves(output))
    if list(got) != list(want):
        return f"the structure ({sorted(got)} instead of {list(want)})"
    differ = {p: how for p in want if p not in skip and (how := _differs(want[p], got[p])) is not None}
    if not differ:
        return None
    slots = getattr(site.codec, "slots", None)
    if slots and set(differ) <= set(slots):
        (w, i), (w2, i2) = ([d[p].to(want[p].device) for p in slots] for d in (want, got))
        if (w.shape, w.dtype, i.shape, i.dtype) == (w2.shape, w2.dtype, i2.shape, i2.dtype):
            a, b = i.sort(1), i2.sort(1)
            if torch.equal(a.values, b.values) and torch.equal(w.gather(1, a.indices), w2.gather(1, b.indices)):
                return (f"slot order ({int((i != i2).any(1).sum())} of {i.shape[0]} rows hold their experts and "
                        "weights in another order)")
    first = next(iter(differ))
    return f"leaf {first or '(the output)'}: {differ[first]}"


def check_round_trip(controller: Controller, outputs: list[tuple[Any, Call]], first: torch.Tensor) -> Finding | None:
    """Refused when a site's codec does not give back the captured output; a notice when a router's rebuilt slots
    differ only in order (ties): an experts loop sums per expert, so only rounding could depend on it."""
    notice = None
    for site, (out, call) in zip(controller.sites, outputs):
        how = round_trip_difference(site, out, call, *first.shape)
        if how is not None and how.startswith("slot order"):
            notice = notice or Finding(f"note: site {site.name!r}: decode(encode(output)) of codec "
                                       f"{site.codec.describe()!r} gives the captured output in another {how}; the "
                                       "exact replay check shows whether the model's output depends on it", False)
        elif how is not None:
            return Finding(f"site {site.name!r}: decode(encode(output)) of codec {site.codec.describe()!r} differs "
                           f"from the captured output at {how}; fix the codec so that it rebuilds what the site "
                           "returned (replays would feed the model something else)", True)
    return notice


def hidden_width(model: nn.Module) -> int | None:
    """The model's hidden width: its config's hidden_size / n_embd / d_model, else its input embeddings' width."""
    config = getattr(model, "config", None)
    for name in ("hidden_size", "n_embd", "d_model"):
        if isinstance(getattr(config, name, None), int):
            return getattr(config, name)
    get = getattr(model, "get_input_embeddings", None)
    emb = get() if callable(get) else next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    return int(emb.embedding_dim) if isinstance(emb, nn.Embedding) else None


def hidden_state_notice(controller: Controller, feeds: set[int], width: int | None) -> Finding | None:
    """A notice when a site of the model's hidden width feeds a later module (`_Flow`): an activation."""
    hidden = [s.name for i, s in enumerate(controller.sites) if i in feeds]
    if not hidden:
        return None
    more = f" (and {len(hidden) - 1} more)" if len(hidden) > 1 else ""
    return Finding(f"note: site {hidden[0]!r}{more} looks like a hidden state, not a coefficient: its source axis has "
                   f"the model's hidden width {width} and a later module takes its output as input; the conditions "
                   "would move activations, not a controller's coefficients: point the pattern at the module or op "
                   "that computes the coefficients (a gate, a mixture, a router)", False)


def pre_write_checks(model: nn.Module, controller: Controller, first: torch.Tensor, probe: tuple) -> list[Finding]:
    """The checks on one more pass of the first evaluation batch, refusals first; `probe` = the audit's
    (coefficients, logits, nll) of that batch, captured with `remember` (so each site's codec metadata is set). Only
    the sites of hidden width are followed to the modules they feed."""
    width = hidden_width(model)
    watch = [i for i, c in enumerate(probe[0]) if c.shape[-1] == width]
    with controller.outputs(*first.shape) as raws, ExitStack() as watching:
        flow = _Flow(raws, watch)
        if watch:
            watching.enter_context(flow)
            watching.callback(nn.modules.module.register_module_forward_pre_hook(flow.consumer).remove)
        logits = logits_of(model(first))
    coeffs = [s.encode(out, *first.shape) for s, (out, _) in zip(controller.sites, raws)]
    found = [check_deterministic(controller, logits, coeffs, probe), check_round_trip(controller, raws, first),
             hidden_state_notice(controller, flow.feeds, width)]
    return sorted((f for f in found if f is not None), key=lambda f: not f.refusal)
