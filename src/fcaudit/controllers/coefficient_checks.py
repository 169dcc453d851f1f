"""The checks of a controller's captured coefficients: window 0 captured alone against its row of the batch (layout),
replaying zeros (effect), coefficients that are one value (constant), the first batch with other windows beside its
rows (batch composition), a second Correct pass (determinism), decode(encode(output)) (round trip) and the slots a
codec rebuilds once coefficients move (slots)."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch
from torch import nn

from fcaudit import protocol
from fcaudit.controllers.controller import Controller
from fcaudit.controllers.findings import Finding
from fcaudit.controllers.sites import Call, Decoding, Site, leaves
from fcaudit.errors import FcauditError
from fcaudit.kinds import chosen
from fcaudit.loss import logits_of

# Batched and single-window passes may round differently (other kernels; a router's near-tie), so half the positions
# must agree at the site's own precision; axes named in the wrong order move whole rows, and next to none agree.
AGREEING_POSITIONS = 0.5
# a dispatch mask's cells are 0/1 up to this much (a straight-through trick leaves 0.99999994); a cell holds a token
# where its value is above it
ALMOST_BINARY = 1e-3


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
