"""Checks before anything is written: what passes the exact replay check and still is not a controller audit. Each
returns a `Finding`, a refusal (the audit stops with its line) or a notice (kept in replay.json and said with the
results), with its data.

On one more Correct pass of the first evaluation batch, run as the probe was: refused when the eval forward is not
deterministic, a codec does not rebuild its site's output, or it puts two tokens in one slot once coefficients move;
on one more under the Flow mode, compared with no other pass: a notice when a site looks like a hidden state or
hidden-width features, or holds scores the model ranks. On window 0 alone: refused when its coefficients are not its
row of the batch (a layout naming axes in the wrong order); a notice when replaying what removes every coefficient's
effect changes nothing. On the first batch with its odd, then its even rows replaced: refused when the kept rows'
coefficients change (a controller over the flattened batch). For routers and ranked sites, on two more passes (both
under the Flow mode where a site is ranked): the causality check (does a decision at t depend on tokens after t?).
Route flips are counted by the engine's exact replay check.
"""

from __future__ import annotations

import math
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import numpy as np
import torch
from torch import nn

from fcaudit import protocol
from fcaudit.controllers.controller import Controller, Seen
from fcaudit.controllers.flow import Flow, batch_token_axes
from fcaudit.controllers.rows import block_rows, counting_rows, fused_part, input_rows, largest_list
from fcaudit.controllers.sites import Call, Decoding, Site, leaves, path_matches
from fcaudit.errors import FcauditError
from fcaudit.kinds import chosen
from fcaudit.loss import logits_of

# Batched and single-window passes may round differently (other kernels; a router's near-tie), so half the positions
# must agree at the site's own precision; axes named in the wrong order move whole rows, and next to none agree.
AGREEING_POSITIONS = 0.5
# forward passes of the checks before the units (Schedule counts only the units'; `check_passes` all of them): window
# 0 alone and replayed and one more pass of the first batch; where sites are followed, the Flow pass of the first
# batch; for routers (and sites the model ranks) the causality check's two
SITE_CHECK_PASSES = 3
FLOW_CHECK_PASSES = 1
BATCH_CHECK_PASSES = 2  # the batch-composition check's captures (a first batch of two or more windows)
ROUTING_CHECK_PASSES = 2  # per batch of the windows the causality check probes (`routing_check_passes`)
# the evaluation windows the causality check probes (at most): a decision that reads later tokens in some windows
# only (a per-window policy) is found where it does in about 1 in 20 windows; its cost is 2 passes per batch of them
CAUSALITY_WINDOWS = 64
LATER_TOKENS = "routing depends on later tokens"
CAUSALITY, TOKEN_ROUTING = "causality", "token routing"  # the router checks' findings (Finding.check)
# a dispatch mask's cells are 0/1 up to this much (a straight-through trick leaves 0.99999994); a cell holds a token
# where its value is above it
ALMOST_BINARY = 1e-3


@dataclass(frozen=True, eq=False)
class Finding:
    """One pre-write check's finding: a refusal (the audit raises FcauditError(line)) or a notice (kept in replay.json's
    "findings" and said by the CLI, the result and the report), its line for the user and what it measured.

    Attributes
    ----------
    check : str
        The check: e.g. "causality" (a router's decisions against later tokens, data `later_token_flips` and
        `windows`), "token routing", "hidden state".
    refusal : bool
        Whether it stopped the audit.
    line : str
        What the CLI, the result and the report say ("" for a check that measured but found nothing to say).
    data : dict
        What the check measured (JSON-able).

    Examples
    --------
    >>> result.replay.finding("causality") is None  # a gate controller: no router, no causality check
    True
    """

    check: str
    refusal: bool
    line: str
    data: dict = field(default_factory=dict)

    @classmethod
    def notice(cls, check: str, line: str, data: dict | None = None) -> "Finding":
        return cls(check, False, line, data or {})

    @classmethod
    def refused(cls, check: str, line: str, data: dict | None = None) -> "Finding":
        return cls(check, True, line, data or {})

    def to_json(self) -> dict:
        return {"check": self.check, "refusal": self.refusal, "line": self.line, "data": self.data}

    @classmethod
    def from_json(cls, d: dict) -> "Finding":
        """A finding as replay.json keeps it (`to_json`); ValueError for anything else."""
        found = cls(d.get("check"), d.get("refusal"), d.get("line"), d.get("data")) if isinstance(d, dict) else None
        if found is None or not (isinstance(found.check, str) and isinstance(found.refusal, bool)
                                 and isinstance(found.line, str) and isinstance(found.data, dict)):
            raise ValueError(f"not a finding: {str(d)[:80]}")
        return found


# ---- window 0 alone ----------------------------------------------------------------------------------------------

def agreeing(a: torch.Tensor, row: torch.Tensor, decoding: Decoding) -> torch.Tensor:
    """[batch, token, stream] bool: where two captures of the same windows agree at the site's own precision (other
    kernels may round otherwise; a coefficient that moved differs by more). Integer and bool decisions must be
    equal."""
    if not row.is_floating_point():
        return (a == row).all(-1)
    scale = float(row.abs().amax()) if row.numel() else 0.0
    # the precision the model computed in (a codec may widen bf16 router weights to float32)
    native = decoding.dtype if decoding.dtype is not None and decoding.dtype.is_floating_point else row.dtype
    rtol = max(1e-3, 8 * torch.finfo(native).eps)
    return torch.isclose(a.double(), row.double(), rtol=rtol, atol=rtol * scale).all(-1)  # per position


def check_layout(controller: Controller, alone: Sequence[torch.Tensor], probe: tuple) -> Finding | None:
    """Refused when window 0's coefficients captured alone are not its row of the batch's: a layout with a flattened
    output's axes in the wrong order passes the exact replay but moves coefficients between windows."""
    coeffs = probe[0]
    if coeffs[0].shape[0] < 2:
        return None
    for site, a, c, d in zip(controller.sites, alone, coeffs, coeffs.decoding):
        row = c[:1].to(a.device)
        if a.shape != row.shape or a.dtype != row.dtype:
            continue  # a site whose canonical shape depends on the batch: nothing to compare
        close = agreeing(a, row, d)
        agree = float(close.double().mean()) if close.numel() else 1.0
        if agree < AGREEING_POSITIONS:
            return Finding.refused("layout", f"site {site.path!r}: window 0's coefficients captured alone differ from its row "
                           f"of the batch ({agree:.0%} of positions agree): check the layout "
                           f"{site.codec.describe()!r} names the output's axes in their order (e.g. '(batch token) "
                           "expert' for a [batch*token, expert] output); if the routing depends on the other windows "
                           "of a batch (capacity limits), use batch size 1", {"site": site.name, "agree": agree})
    return None


def check_composition(model: nn.Module, controller: Controller, first: torch.Tensor, probe: tuple) -> Finding | None:
    """Refused when a window's coefficients change with the other windows of its batch: the first batch captured
    twice more, once with its odd rows and once with its even rows replaced by the batch's next windows (its own
    text, rolled by one: no token the user did not give; same batch size and positions, so the same kernels), must
    give the kept rows' coefficients at the site's precision at every position. Every window is compared with windows before and after it replaced, so a capacity filled in batch
    order (a cumulative sum over the flattened batch) is caught as well as a rank or normalization over it, which
    would make every condition measure the batch and the penalties change with batch_size."""
    coeffs = probe[0]
    b = first.shape[0]
    if b < 2:
        return None
    for replaced in (1, 0):
        other = first.clone()
        rows = torch.arange(replaced, b, 2)
        other[rows] = first[(rows + 1) % b]
        with controller.capture(*other.shape, decoding=False) as found:
            model(other)
        kept = torch.arange(1 - replaced, b, 2)
        for site, a, c, d in zip(controller.sites, found, coeffs, coeffs.decoding):
            if a is None or a.shape != c.shape or a.dtype != c.dtype:
                continue  # a site that did not run, or whose canonical shape depends on the batch: nothing to compare
            a, c = a[kept.to(a.device)], c[kept.to(c.device)].to(a.device)
            if torch.equal(a, c):
                continue
            moved = (~agreeing(a, c, d)).reshape(a.shape[0], a.shape[1], -1).any(-1)  # per (window, token)
            if differ := int(moved.sum()):
                window = int(kept[int(moved.any(1).to(torch.int8).argmax())])
                return Finding.refused("batch", f"site {site.path!r}: the coefficients of window {window} "
                                       "change when the other windows of its batch change "
                                       f"({differ} of {a.shape[0] * a.shape[1]} positions of the kept windows "
                                       "differ): the controller depends on the batch (e.g. a capacity, top-k or "
                                       "normalization over the flattened batch x token scores), so every condition "
                                       "would measure the batch and the penalties change with batch_size; make the "
                                       "controller act on each window alone (a capacity per window), or audit with "
                                       "batch_size=1", {"site": site.name, "differ": differ, "window": window})
    return None


def check_effect(model: nn.Module, controller: Controller, one: torch.Tensor, alone: list, logits: torch.Tensor,
                 decoding: Sequence[Decoding]) -> Finding | None:
    """A notice when replaying zeros for every coefficient (for a token router: no scores and another set of as many
    tokens, so that its choices are tested too) leaves window 0's logits unchanged: every replay measures nothing."""
    info = controller.info
    nulls = [k.null(a) for k, a in zip(info.of, alone)]  # a token router's: another set of as many tokens
    try:
        with controller.replay(nulls, decoding):
            if not torch.equal(logits_of(model(one), model, one), logits):
                return None
    except (FcauditError, ValueError, IndexError):  # a codec that refuses all-zero coefficients: no conclusion
        return None
    k = {s.name: int(chosen(a).sum()) for s, kind, a in zip(controller.sites, info.of, alone)
         if kind.tokens}
    if k and all(n in (0, one.shape[1]) for n in k.values()):
        which = "no token" if not any(k.values()) else "every token"
        return Finding.notice("effect", f"note: the token routers chose {which} of window 0, so no other set of tokens exists "
                       "for their choices, and replaying zeros for their scores leaves the logits unchanged: on "
                       "windows like it the interventions below measure nothing", {"chosen": k})
    return Finding.notice("effect", "note: replaying zeros for every coefficient" + (" and another set of as many tokens for "
                   "each token router" if k else "") + " leaves the logits unchanged: the coefficients have no effect "
                   "on this model, or it does not use what its sites return (e.g. it keeps the gate's value in an "
                   "attribute), and then the interventions below measure nothing: point the pattern at the modules "
                   "whose output the model consumes", {"chosen": k})


def check_constant(coeffs: Sequence[torch.Tensor]) -> Finding | None:
    """A notice when every site's coefficients are one value for every window and token of the first batch (a router
    or gate whose weights are all zero, as at initialisation): moving them moves nothing, every ΔNLL of a randomized
    condition is 0 by construction."""
    if not coeffs or any(c is None or c.dim() < 2 or c.shape[0] * c.shape[1] < 2
                         or not torch.equal(c, c[:1, :1].expand_as(c)) for c in coeffs):
        return None
    return Finding.notice("effect", "note: every site's coefficients are the same for every window and token of the "
                          "first batch (as where a router's or gate's weights are all zero, e.g. at initialisation): "
                          "the randomized conditions move nothing where that holds, so their ΔNLL is exactly 0 by "
                          "construction, not a finding about what the controller's choices are worth")


# ---- one more pass of the first batch -----------------------------------------------------------------------------

def check_deterministic(controller: Controller, logits: torch.Tensor, coeffs: list[torch.Tensor],
                        probe: tuple) -> Finding | None:
    """Refused when a second Correct pass of the first batch gives other logits or coefficients than the probe."""
    if not torch.equal(logits, probe[1]):
        diff = float((logits.double() - probe[1].double()).abs().max())
        where, data = f"the logits (max |Δlogit| = {diff:.3g})", {"max_abs_dlogit": diff}
    else:
        site = next((s for s, a, b in zip(controller.sites, coeffs, probe[0]) if not torch.equal(a, b.to(a.device))),
                    None)
        if site is None:
            return None
        where, data = f"the coefficients of site {site.name!r}", {"site": site.name}
    return Finding.refused("deterministic", f"two Correct passes of the first evaluation batch differ in {where}: the model is "
                   "not deterministic in eval mode (e.g. a router that samples, or noise left on outside training); "
                   "make its eval forward deterministic before auditing", data)


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


def round_trip_difference(site: Site, output: Any, call: Call | None, decoding: Decoding, batch: int,
                          token: int) -> str | None:
    """Where decode(encode(output)) differs from `output`: the first differing leaf and how, or None. The codec's
    `placeholders` are skipped; when only its `unordered` (weights, index) leaves differ, rows holding the same
    (index, weight) pairs in another order are reported as "slot order"."""
    skip = set(site.codec.placeholders)
    got, want = dict(leaves(site.decode(site.encode(output, batch, token), decoding, call))), dict(leaves(output))
    if list(got) != list(want):
        return f"the structure ({sorted(got)} instead of {list(want)})"
    differ = {p: how for p in want if p not in skip and (how := _differs(want[p], got[p])) is not None}
    if not differ:
        return None
    pair = site.codec.unordered
    if len(pair) == 2 and set(differ) <= set(pair):
        (w, i), (w2, i2) = ([d[p].to(want[p].device) for p in pair] for d in (want, got))
        if (w.shape, w.dtype, i.shape, i.dtype) == (w2.shape, w2.dtype, i2.shape, i2.dtype):
            a, b = i.sort(1), i2.sort(1)
            if torch.equal(a.values, b.values) and torch.equal(w.gather(1, a.indices), w2.gather(1, b.indices)):
                return (f"slot order ({int((i != i2).any(1).sum())} of {i.shape[0]} rows hold their experts and "
                        "weights in another order)")
    first = next(iter(differ))
    return f"leaf {first or '(the output)'}: {differ[first]}"


def check_round_trip(controller: Controller, outputs: list[tuple[Any, Call]], first: torch.Tensor,
                     decoding: Sequence[Decoding]) -> Finding | None:
    """Refused when a site's codec does not give back the captured output; a notice when a router's rebuilt slots
    differ only in order (ties): an experts loop sums per expert, so only rounding could depend on it."""
    notice = None
    for site, (out, call), d in zip(controller.sites, outputs, decoding):
        how = round_trip_difference(site, out, call, d, *first.shape)
        if how is not None and how.startswith("slot order"):
            notice = notice or Finding.notice("round trip", f"note: site {site.name!r}: decode(encode(output)) of codec "
                                       f"{site.codec.describe()!r} gives the captured output in another {how}; the "
                                       "exact replay check shows whether the model's output depends on it",
                                       {"site": site.name, "how": how})
        elif how is not None:
            return Finding.refused("round trip", f"site {site.name!r}: decode(encode(output)) of codec "
                           f"{site.codec.describe()!r} differs from the captured output at {how}; fix the codec so "
                           "that it rebuilds what the site returned (replays would feed the model something else)",
                           {"site": site.name, "how": how})
    return notice


def one_token_cells(output: Any, batch: int, token: int) -> dict[str, torch.Tensor]:
    """The leaves of a site output that give each (window, cell) at most one token, as [batch, token, cells] 0/1
    masks: a dispatch mask's (expert, slot) cells, also where its values are almost 0/1 (ALMOST_BINARY). Gates,
    weights and indices are not such leaves."""
    out = {}
    for path, t in leaves(output):
        if not isinstance(t, torch.Tensor) or t.dim() < 3 or t.numel() == 0:
            continue
        if not ((t.shape[:2] == (batch, token) and t.dim() >= 4) or t.shape[0] == batch * token):
            continue  # a token's cells on two axes of their own, (expert, slot)
        cells = t.reshape(batch, token, -1)
        values = cells.detach().double()
        binary = values.round()
        if values.shape[2] > 1 and ((binary == 0) | (binary == 1)).all() and \
                (values - binary).abs().max() <= ALMOST_BINARY and binary.sum(1).max() == 1:
            out[path] = binary
    return out


def check_slots(controller: Controller, outputs: list[tuple[Any, Call]], coeffs: Sequence[torch.Tensor],
                decoding: Sequence[Decoding], examples: int) -> Finding | None:
    """Refused, with the count, when a codec whose output gives each (expert, slot) one token places several tokens
    in one once coefficients move between tokens (a TokenResamplePast draw, the batch's mean per position)."""
    info = controller.info
    for i, (site, (out, call)) in enumerate(zip(controller.sites, outputs)):
        batch, token = coeffs[i].shape[:2]
        cells = one_token_cells(out, batch, token)
        if not cells or not info.of[i].slots:  # a token router's conditions keep a set of tokens
            continue
        c = coeffs[i]
        moved = {"TokenResamplePast": protocol.resample_past([c], np.arange(examples), 0, 0)[0],
                 "LayerPositionMean": c.double().mean(0, keepdim=True).to(c.dtype).expand_as(c)}
        for condition, m in moved.items():
            try:
                rebuilt = dict(leaves(site.decode(m, decoding[i], call)))
            except (FcauditError, ValueError, IndexError, RuntimeError):
                continue
            for path in cells:
                got = rebuilt.get(path)
                if isinstance(got, torch.Tensor) and got.numel() == cells[path].numel():
                    held = (got.detach().double().reshape(cells[path].shape).abs() > ALMOST_BINARY).sum(1)
                    if (n := int((held > 1).sum())) > 0:
                        return Finding.refused("slots", f"site {site.name!r}: codec {site.codec.describe()!r} puts two or more "
                                       f"tokens in one slot once coefficients move between tokens: under {condition} "
                                       f"{n} cells of leaf {path or '(the output)'} hold several tokens, which the "
                                       "model's own router never does; rebuild the slots in decode from the moved "
                                       "coefficients by the router's rule (as fcaudit.controllers.CapacityRoute does)",
                                       {"site": site.name, "condition": condition, "cells": n})
    return None


def hidden_width(model: nn.Module) -> int | None:
    """The model's hidden width: its config's hidden_size / n_embd / d_model, else its input embeddings' width."""
    config = getattr(model, "config", None)
    for name in ("hidden_size", "n_embd", "d_model"):
        if isinstance(getattr(config, name, None), int):
            return getattr(config, name)
    get = getattr(model, "get_input_embeddings", None)
    emb = get() if callable(get) else next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    return int(emb.embedding_dim) if isinstance(emb, nn.Embedding) else None


def _some(names: list[str]) -> str:
    return f"{names[0]!r}" + (f" (and {len(names) - 1} more)" if len(names) > 1 else "")


def hidden_state_notice(controller: Controller, flow: Flow, width: int | None) -> Finding | None:
    """A notice when a site of the model's hidden width feeds a later module (an activation) or an op contracts it
    over its width (`norm(h) @ w`: features): the conditions would move activations, not coefficients."""
    fed = [s.name for i, s in enumerate(controller.sites) if i in flow.feeds]
    contracted = [s.name for i, s in enumerate(controller.sites) if i in flow.contracted and i not in flow.feeds]
    if fed:
        return Finding.notice("hidden state", f"note: site {_some(fed)} looks like a hidden state, not a coefficient: its "
                       f"source axis has the model's hidden width {width} and a later module takes its output as "
                       "input; the conditions would move activations, not a controller's coefficients: point the "
                       "pattern at the module or op that computes the coefficients (a gate, a mixture, a router)",
                       {"sites": fed, "width": width})
    if contracted:
        return Finding.notice("hidden state", f"note: site {_some(contracted)} looks like hidden-width features, not "
                       f"coefficients: its source axis has the model's hidden width {width} and an op (a matmul, a "
                       "linear map) contracts it; the static conditions would average features: point the pattern "
                       "at what that op computes (e.g. from_ops(..., 'sigmoid') for the gate it feeds)",
                       {"sites": contracted, "width": width})
    return None


def ranked_notice(controller: Controller, flow: Flow) -> Finding | None:
    """A notice when the model ranks or thresholds a site read as a soft coefficient: its routing is the decision,
    so declare it (a static score gives every token one value, and the model's ranking then picks by ties)."""
    if not flow.ranked:
        return None
    names = [controller.sites[i].name for i in sorted(flow.ranked)]
    ops = sorted(set(flow.ranked.values()))
    return Finding.notice("ranked", f"note: the model ranks or thresholds the values of site {_some(names)} "
                   f"({', '.join(ops)}): read as a gate, a static condition gives every token one score and the "
                   "ranking then picks by ties; declare the routing: kind='token_router' for scores that choose "
                   "tokens (Controller.from_modules(..., kind='token_router') with a codec of (score, chosen)), or a "
                   "codec with top_k for scores that choose experts", {"sites": names, "ops": ops})


# ---- the budget observed -------------------------------------------------------------------------------------------

def observed_budget(controller: Controller, coeffs: Sequence[torch.Tensor], seen: Seen,
                    condition: str) -> Finding | None:
    """Refused, naming the site or block and the counts, when the rows the replayed model ran where `runs=` named
    (`seen`, from `Controller.observing` during a replay of `coeffs`) differ from the rows its replayed decisions
    select: the model re-derives its set (a threshold from the replayed scores on its live router weights, depths
    from its live exit rule, experts from its own top-k), so the budget the records say is not what ran. The budget's
    equivalent of the exact replay check."""
    for i, site in enumerate(controller.sites):
        if site.runs is None:
            continue
        want = controller.info.of[i].select(coeffs[i]).cpu().long()
        calls = seen.calls.get(i, [])
        per_window = [c for c in calls if isinstance(c, torch.Tensor)]
        got_total = sum(int(c.sum()) for c in per_window) + sum(c for c in calls if isinstance(c, int))
        if per_window and len(per_window) == len(calls):
            got = sum(per_window)
            if not torch.equal(got, want):
                w = int(torch.nonzero(got != want)[0, 0])
                return _budget_refusal(site, condition, f"window {w} of the first batch sent {int(got[w])} tokens "
                                                        f"into it for {int(want[w])} chosen", got_total, want)
        elif got_total != int(want.sum()):
            return _budget_refusal(site, condition, f"the first batch sent {got_total} tokens into it for "
                                                    f"{int(want.sum())} chosen", got_total, want)
    if controller.runs:
        ran = [block_rows(c) for c in seen.blocks]
        return (_experts_budget if controller.info.of[0].runs == "experts" else _depth_budget)(
            controller, coeffs, ran, condition)
    return None


def _budget_refusal(site: Site, condition: str, how: str, got: int, want: torch.Tensor) -> Finding:
    return Finding.refused("budget", f"site {site.name!r}: under {condition} its routed block {site.runs[0]!r} did not "
                           f"run the tokens the replayed decisions chose: {how}; the model re-derives the set (e.g. a "
                           "threshold from the replayed scores on its live router weights): make the block run "
                           "the chosen index (gather), or declare the site where the set is decided",
                           {"site": site.name, "condition": condition, "ran": got, "chosen": int(want.sum())})


def _depth_budget(controller: Controller, coeffs: Sequence[torch.Tensor], ran: list[int],
                  condition: str) -> Finding | None:
    """A depth controller's blocks (`runs=`, in order): each must compute exactly the (block, token) pairs the
    replayed decisions run in it (`Kind.rows`); one block run at every step (halting), their sum."""
    info = controller.info
    kind, always = info.of[0], info.always[0]
    want = kind.rows(coeffs, always)
    blocks = [name for name, _ in controller.runs]
    if len(blocks) == 1 and len(want) > 1:  # one block shared by every step (halting, a looped block)
        want = [sum(want)]
    if len(blocks) != len(want):
        late = len(blocks) - len(want) + always
        hint = (f"where the first {late} block(s) run for every token before the first decision, declare "
                f"Decisions(always={late})" if late > 0 else "give a pattern matching the blocks the decisions run")
        return Finding.refused("budget", f"runs= names {len(blocks)} blocks ({blocks[0]!r}...) for the {len(want)} "
                               f"that the decisions of {len(controller.sites)} {kind.name} sites run"
                               f"{f' ({always} of them always)' if always else ''}, or one block run at every "
                               f"step: {hint}",
                               {"blocks": len(blocks), "units": len(want), "condition": condition})
    for name, got, need in zip(blocks, ran, want):
        if got != need:
            return Finding.refused("budget", f"block {name!r}: under {condition} it computed {got} rows on the first "
                                   f"batch for the {need} (block, token) pairs the replayed {kind.name} decisions run "
                                   "in it; " + ("it computes tokens the decisions stop (a model that masks rather "
                                                "than gathers shows every row: drop runs=, its budget is then the "
                                                "decisions', not observed), or the model re-derives its depths"
                                                if got > need else "the model re-derives its depths (its live rule, "
                                                "not the replayed decisions, says which tokens run)")
                                   + ": declare the decisions the model obeys, and runs= only for blocks that "
                                     "run the decided tokens alone",
                                   {"block": name, "condition": condition, "ran": got, "decided": need})
    return None


def _experts_budget(controller: Controller, coeffs: Sequence[torch.Tensor], ran: list[int],
                    condition: str) -> Finding | None:
    """Capacity routers' experts (`runs=`, each router's in order): each must compute the slots the replayed
    decisions fill (`Codec.executed`), or every slot of its capacity (a fixed-shape dispatch computes empty slots
    too, and then rows cannot show the slots filled)."""
    at = 0
    for i, site in enumerate(controller.sites):
        codec = site.codec
        filled = codec.executed(coeffs[i])[1][:, :codec.num_experts].sum(0)
        every = coeffs[i].shape[0] * codec.capacity
        for e in range(codec.num_experts):
            name, got = controller.runs[at][0], ran[at]
            at += 1
            if got not in (int(filled[e]), every):
                return Finding.refused("budget", f"site {site.name!r}: under {condition} its expert {name!r} "
                                       f"computed {got} rows on the first batch for the {int(filled[e])} slots the "
                                       f"replayed decisions fill (of {every}); the experts run other tokens than "
                                       "the dispatch says (their own top-k on live router weights, or past the "
                                       "capacity): make the experts run the dispatched tokens, or declare the "
                                       "router whose slots they obey",
                                       {"site": site.name, "expert": name, "condition": condition, "ran": got,
                                        "filled": int(filled[e])})
    return None


# ---- the causality check -------------------------------------------------------------------------------------------

def check_causality(model: nn.Module, controller: Controller, ids: torch.Tensor, vocab: int,
                    ranked: Sequence[int] = (), batch: int | None = None) -> Finding | None:
    """How many decisions at earlier positions change when the last quarter of each window (at least one token; one
    rarely crosses the k-th score) changes to seeded random tokens: a router's own (its selected sources, its chosen
    tokens), and what the model's rankings of `ranked` sites decided (their values, where the ranking cannot be
    read). Above 0 a decision depends on later tokens (top-k over the window does): the router cannot decode
    autoregressively. `ids`: the windows probed (up to CAUSALITY_WINDOWS: a policy that reads later tokens in some
    windows only is found in them), in batches of `batch` (default all at once): ROUTING_CHECK_PASSES passes per
    batch. None for a controller without routers or ranked sites."""
    info = controller.info
    if not info.routers and not ranked:
        return None
    span = max(1, ids.shape[1] // 4)
    gen = torch.Generator().manual_seed(0)
    flips = 0
    for part in ids.split(batch or ids.shape[0]):
        changed = part.clone()
        changed[:, -span:] = torch.randint(0, vocab, (part.shape[0], span), generator=gen).to(part.device)
        flips += _later_flips(model, controller, part, changed, span, ranked)
    windows = int(ids.shape[0])
    line = (f"{LATER_TOKENS}: changing only the last quarter of {windows} windows changed {flips} routing decisions at "
            "earlier positions (fine for training; this router cannot decode autoregressively as it is)") if flips else ""
    return Finding.notice(CAUSALITY, line, {"later_token_flips": flips, "windows": windows})


def _later_flips(model: nn.Module, controller: Controller, ids: torch.Tensor, changed: torch.Tensor, span: int,
                 ranked: Sequence[int]) -> int:
    """The decisions before the last `span` positions that differ between a pass of `ids` and one of `changed`."""
    info = controller.info
    runs = []
    for x in (ids, changed):
        with controller.outputs(*x.shape) as raws, (flow := Flow(raws, (), ranked, {
                i: a for i in ranked if (a := batch_token_axes(controller.sites[i])) is not None})).following(model):
            model(x)
        coeffs = {i: controller.sites[i].encode(raws[i][0], *x.shape) for i in (*info.routers, *ranked)}
        if info.depth:  # a depth controller's sites are all routers: its exits as the model obeys them
            coeffs = dict(enumerate(info.canonical([coeffs[i] for i in range(len(controller.sites))])))
        runs.append((coeffs, flow.decisions))
    (before, made), (after, remade) = runs
    flips = sum(info.changed(i, before[i][:, :-span], after[i][:, :-span]) for i in info.routers)
    for i in ranked:
        pairs = list(zip(made.get(i, []), remade.get(i, [])))
        if not pairs:  # the ranking's dims cannot be read: whether the values it ranks changed
            pairs = [(before[i], after[i])]
        flips += int(sum((a[:, :-span] != b[:, :-span]).reshape(a.shape[0], a.shape[1] - span, -1).any(-1).sum()
                         for a, b in pairs if a.shape == b.shape))
    return flips


def routing_check_passes(windows: int, batch: int) -> int:
    """The causality check's forward passes for an audit of `windows` evaluation windows in batches of `batch`."""
    return ROUTING_CHECK_PASSES * math.ceil(min(windows, CAUSALITY_WINDOWS) / batch)


# ---- all of them --------------------------------------------------------------------------------------------------

def follow(model: nn.Module, controller: Controller, x: torch.Tensor, coeffs: Sequence[torch.Tensor]) -> Flow | None:
    """A pass of `x` under the Flow mode, following the sites of the model's hidden width (by their canonical
    `coeffs`) to the modules they feed and the soft coefficients to the ops that rank them; None where there are none.
    Its outputs are compared with no other pass: a TorchFunctionMode (and a hook on every module) turns off torch's
    fused attention fast path (nn.MultiheadAttention, nn.TransformerEncoderLayer), which rounds differently."""
    width = hidden_width(model)
    watch = [i for i, c in enumerate(coeffs) if c.shape[-1] == width]
    rank = [i for i, k in enumerate(controller.info.of) if not k.router]
    if not watch and not rank:
        return None
    with controller.outputs(*x.shape) as raws, (flow := Flow(raws, watch, rank)).following(model):
        model(x)
    return flow


def check_passes(controller: Controller, flow: Flow | None, windows: int, batch: int) -> int:
    """The forward passes of the pre-write checks of an audit of `windows` evaluation windows in batches of `batch`
    whose first batch's `follow` gave `flow`."""
    ranks = bool(controller.info.routers) or (flow is not None and bool(flow.ranked))
    return (SITE_CHECK_PASSES + (FLOW_CHECK_PASSES if flow is not None else 0)
            + (routing_check_passes(windows, batch) if ranks else 0))


def first_batch_checks(model: nn.Module, controller: Controller, first: torch.Tensor,
                       probe: tuple) -> tuple[list[Finding], list[int]]:
    """The checks on more passes of the first batch (refusals first), and the sites the model ranks: one pass run as
    the probe was, compared with it; then, unless that refused, the Flow pass (`follow`), compared with nothing."""
    info = controller.info
    with controller.outputs(*first.shape) as raws:
        logits = logits_of(model(first), model, first)
    coeffs = info.canonical([s.encode(out, *first.shape) for s, (out, _) in zip(controller.sites, raws)])
    decoding = probe[0].decoding
    found = [f for f in (check_deterministic(controller, logits, coeffs, probe),
                         check_round_trip(controller, raws, first, decoding),
                         check_slots(controller, raws, coeffs, decoding, first.shape[0])) if f is not None]
    flow = None if any(f.refusal for f in found) else follow(model, controller, first, probe[0])
    if flow is not None:
        found += [f for f in (hidden_state_notice(controller, flow, hidden_width(model)),
                              ranked_notice(controller, flow)) if f is not None]
    return sorted(found, key=lambda f: not f.refusal), sorted(flow.ranked) if flow is not None else []


def pre_write_checks(model: nn.Module, controller: Controller, first: torch.Tensor, probe: tuple,
                     vocab: int, probed: torch.Tensor | None = None) -> list[Finding]:
    """Every check before anything is written, on the first evaluation batch `first` and `probe`, its capture
    (coefficients with their decoding, logits, nll); stops at the first refusal (it comes first). `vocab`: the ids the
    causality check may draw; `probed`: the windows it probes (default `first`), in batches as large as `first`."""
    found, ranked = first_batch_checks(model, controller, first, probe)
    if found and found[0].refusal:
        return found
    one = first[:1]
    pattern, blocks = depth_blocks(model, controller)
    with controller.capture(*one.shape, decoding=False) as alone, counting_rows([m for _, m in blocks]) as rows, \
            routed_inputs(model, controller) as took:
        logits = logits_of(model(one), model, one)
    if (missing := [s.path for s, c in zip(controller.sites, alone) if c is None]):
        raise FcauditError(f"sites {missing[:3]} did not run in the forward pass of window 0 alone; pick modules the "
                           "model calls on every input")
    layout = check_layout(controller, alone, probe)
    if layout is not None:
        return [layout, *found]
    effect = check_effect(model, controller, one, alone, logits, probe[0].decoding) or check_constant(probe[0])
    batch = check_composition(model, controller, first, probe)  # after the effect check: it reads window 0's
    if batch is not None:
        return [batch, *found]
    found += [f for f in (effect, check_causality(model, controller, first if probed is None else probed, vocab,
                                                  ranked, first.shape[0])) if f is not None]
    info = controller.info
    check = "depth" if info.depth else TOKEN_ROUTING  # the kinds' note: why conditions are not offered
    found += [Finding.notice(check, note) for note in info.notes]
    found += zero_notices(info)
    found += [f for f in (first_blocks_notice(controller) or depth_rows_notice(controller, pattern, rows, alone),
                          routed_blocks_notice(model, controller, took, alone)) if f is not None]
    return found


@contextmanager
def routed_inputs(model: nn.Module, controller: Controller) -> Iterator[dict[int, dict[str, int]]]:
    """For each token-router site without `runs=`: the rows every module under the site's parent (the site's own
    left out) took in the passes run in the context, by path; for `routed_blocks_notice`. Pre-hooks only read."""
    took: dict[int, dict[str, int]] = {}
    handles = []
    for i, site in enumerate(controller.sites):
        if site.runs is not None or controller.info.of[i].runs != "block" or "." not in site.path:
            continue
        parent, own = site.path.rsplit(".", 1)[0], {id(m) for m in site.module.modules()}
        if fused_part(model, [parent]) is not None:  # hooks would change the pass's numerics
            continue
        for name, m in model.get_submodule(parent).named_modules(prefix=parent):
            if name != parent and id(m) not in own:
                def pre(module, args, rows=took.setdefault(i, {}), name=name):
                    rows[name] = rows.get(name, 0) + input_rows(args)
                handles.append(m.register_forward_pre_hook(pre))
    try:
        yield took
    finally:
        for h in handles:
            h.remove()


def routed_blocks_notice(model: nn.Module, controller: Controller, took: dict[int, dict[str, int]],
                         alone: Sequence[torch.Tensor]) -> Finding | None:
    """A notice naming `runs=` where a token router's routed block is found by structure: the outermost module under
    the site's parent (the largest of several) that took exactly the rows the site chose in the live forward of window
    0 (0 < k < its tokens). A notice, not an observation made on its own: a module found this way could take k rows
    by coincidence, and an observation of the wrong block would refuse an honest model."""
    found: dict[int, str] = {}
    for i, rows in took.items():
        k, tokens = int(controller.info.of[i].select(alone[i]).sum()), alone[i].shape[1]
        took_k = [n for n, r in rows.items() if r == k] if 0 < k < tokens else []
        outer = [n for n in took_k if not any(n.startswith(c + ".") for c in took_k)]
        if outer:
            found[i] = max(outer, key=lambda n: sum(p.numel() for p in model.get_submodule(n).parameters()))
    if not found:
        return None
    paths = [found[i] for i in sorted(found)]
    parts = [p.split(".") for p in paths]
    glob = ".".join(c[0] if len(set(c)) == 1 else "*" for c in zip(*parts)) if len({len(p) for p in parts}) == 1 \
        else ""
    routers = [i for i, k in enumerate(controller.info.of) if k.runs == "block"]
    exact = sorted(found) == routers and [n for n, _ in model.named_modules() if n and path_matches(n, glob)] == paths
    how = (f"pass runs={glob!r}" if exact else "pass runs= a pattern matching one such block per token router, in "
           "order")
    first = controller.sites[min(found)].name
    return Finding.notice("budget", f"note: the tokens token router {first!r} chose in window 0 entered {paths[0]!r} "
                          f"(found by structure: the rows it took){f' ({len(paths)} sites)' if len(paths) > 1 else ''}:"
                          f" {how} to have the audit observe the tokens entering it on the first batch of every "
                          "condition", {"sites": [controller.sites[i].name for i in sorted(found)], "blocks": paths})


def depth_blocks(model: nn.Module, controller: Controller) -> tuple[str, list[tuple[str, nn.Module]]]:
    """A depth controller's blocks found by structure where `runs=` names none (the children of the model's largest
    ModuleList), as (pattern, blocks), for `depth_rows_notice`; else ("", [])."""
    pattern = largest_list(model) if controller.info.depth and not controller.runs else None
    blocks = [(n, m) for n, m in model.named_modules() if n and path_matches(n, pattern)] if pattern else []
    if not blocks or fused_part(model, [n for n, _ in blocks]) is not None:  # hooks would change the pass's numerics
        return "", []
    return pattern, blocks


def depth_rows_notice(controller: Controller, pattern: str, counts: list[Counter], alone: Sequence[torch.Tensor],
                      ) -> Finding | None:
    """Where no `runs=` names a depth controller's blocks: the rows the model's blocks (found by structure, the
    controller's own modules left out) computed in the live forward of window 0, beside the (block, token) pairs its
    decisions run (`Kind.rows`). A notice, never a refusal: a model that masks computes every row honestly, and blocks
    found by structure need not be the decided ones. It says when the blocks outnumber what the decisions run (exits
    that start after block k), when a block computed fewer rows than its decisions run (they are not what the model
    obeys), and when every block computed exactly them (`runs=` would observe them under every condition)."""
    if not counts:
        return None
    info = controller.info
    kind, always = info.of[0], info.always[0]
    want = kind.rows(list(alone), always)
    own = {m for s in controller.sites if s.op is None and s.method == "forward" for m in s.module.modules()}
    if any(all(m in own for m in c) for c in counts):  # the list found holds the controller, not the blocks
        return None
    ran = [block_rows(Counter({m: r for m, r in c.items() if m not in own})) for c in counts]
    if len(ran) > len(want) > 1:
        k = len(ran) - len(want) + always
        return Finding.notice("depth", f"note: the model's {len(ran)} blocks ({pattern!r}) are more than the "
                              f"{len(want)} its {kind.name} decisions run: if its first {k} run for every token "
                              f"before the first decision, pass codec=Decisions(always={k}), or `active` and the "
                              "budget count only the decided blocks", {"blocks": len(ran), "units": len(want)})
    if len(ran) != len(want):
        return None
    short = next(((i, g, w) for i, (g, w) in enumerate(zip(ran, want)) if g < w), None)
    if short is not None:
        i, g, w = short
        return Finding.notice("depth", f"note: block {pattern[:-1]}{i} computed {g} rows of window 0 for the {w} "
                              f"(block, token) pairs the {kind.name} decisions run in it: the model runs less than "
                              "its decisions say, and the budget counts what they say: declare the decisions it "
                              "obeys (its own stop rule, the blocks that always run)",
                              {"block": i, "ran": g, "decided": w})
    if ran == want and sum(want) < len(want) * alone[0].shape[1]:
        return Finding.notice("depth", f"note: the blocks {pattern!r} computed exactly the (block, token) pairs the "
                              f"{kind.name} decisions run (they gather the running tokens): pass runs={pattern!r} to "
                              "have the audit observe them on the first batch of every condition",
                              {"blocks": len(ran)})
    return None


def first_blocks_notice(controller: Controller) -> Finding | None:
    """A notice when a depth controller's first site is on block k > 0 of a numbered path ("blocks.2.exit") and no
    blocks are declared to run always: blocks before its first decision run for every token, which `active` counts
    only when the codec says so (`Decisions(always=k)`)."""
    info = controller.info
    if not info.depth or info.always[0] or info.lead.codec is None:
        return None
    path = controller.sites[0].path
    k = next((int(p) for p in path.split(".") if p.isdigit()), 0)
    if k == 0:
        return None
    return Finding.notice("depth", f"note: the first depth site {path!r} is on block {k}: if blocks 0..{k - 1} run "
                                   "for every token before it, pass codec=Decisions(always=" + str(k) + ") (or the "
                                   "number that do), or `active` and the budget's fraction count only the decided "
                                   "blocks", {"site": path, "block": k})


def zero_notices(info) -> list[Finding]:
    """A notice per reason its kinds give why conditions cannot change anything (`Description.zero`): their ΔNLL, and
    the factorial effects made of them, are 0 by construction, not a finding about the controller."""
    reasons: dict[str, list[str]] = {}
    for condition, why in info.zero.items():
        reasons.setdefault(why, []).append(condition)
    return [Finding.notice("zero", f"note: {why}: {', '.join(names)} {'is' if len(names) == 1 else 'are'} 0 by "
                                   "construction, not a finding about the controller", {"conditions": names})
            for why, names in reasons.items()]
