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

The checks live by what they check: `coefficient_checks` (the captured coefficients), `flow_checks` (the model's
flow: hidden states, ranked sites, causality), `budget_checks` (the budget observed, its notices); their findings in
`findings`. Here: what runs them, in order, and their forward passes.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import nn

from fcaudit.controllers.budget_checks import (depth_blocks, depth_rows_notice, first_blocks_notice,
                                               routed_blocks_notice, routed_inputs)
from fcaudit.controllers.coefficient_checks import (check_composition, check_constant, check_deterministic,
                                                    check_effect, check_layout, check_round_trip, check_slots)
from fcaudit.controllers.controller import Controller
from fcaudit.controllers.findings import TOKEN_ROUTING, Finding
from fcaudit.controllers.flow import Flow
from fcaudit.controllers.flow_checks import (CAUSALITY_WINDOWS, check_causality, hidden_state_notice, hidden_width,
                                             ranked_notice)
from fcaudit.controllers.rows import counting_rows
from fcaudit.errors import FcauditError
from fcaudit.loss import logits_of

# forward passes of the checks before the units (Schedule counts only the units'; `check_passes` all of them): window
# 0 alone and replayed and one more pass of the first batch; where sites are followed, the Flow pass of the first
# batch; for routers (and sites the model ranks) the causality check's two
SITE_CHECK_PASSES = 3
FLOW_CHECK_PASSES = 1
BATCH_CHECK_PASSES = 2  # the batch-composition check's captures (a first batch of two or more windows)
ROUTING_CHECK_PASSES = 2  # per batch of the windows the causality check probes (`routing_check_passes`)


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
    found += [Finding.notice("controller", note) for note in controller.notes]
    found += [f for f in (first_blocks_notice(controller) or depth_rows_notice(controller, pattern, rows, alone),
                          routed_blocks_notice(model, controller, took, alone)) if f is not None]
    return found


def zero_notices(info) -> list[Finding]:
    """A notice per reason its kinds give why conditions cannot change anything (`Description.zero`): their ΔNLL, and
    the factorial effects made of them, are 0 by construction, not a finding about the controller."""
    reasons: dict[str, list[str]] = {}
    for condition, why in info.zero.items():
        reasons.setdefault(why, []).append(condition)
    return [Finding.notice("zero", f"note: {why}: {', '.join(names)} {'is' if len(names) == 1 else 'are'} 0 by "
                                   "construction, not a finding about the controller", {"conditions": names})
            for why, names in reasons.items()]
