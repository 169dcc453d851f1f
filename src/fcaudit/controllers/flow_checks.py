"""The checks made by following the model's flow (the Flow mode): a site that looks like a hidden state or
hidden-width features, a site whose values the model ranks, and the causality check (does a decision at t depend on
tokens after t?)."""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from fcaudit.controllers.controller import Controller
from fcaudit.controllers.findings import CAUSALITY, LATER_TOKENS, Finding
from fcaudit.controllers.flow import Flow, batch_token_axes

# the evaluation windows the causality check probes (at most): a decision that reads later tokens in some windows
# only (a per-window policy) is found where it does in about 1 in 20 windows; its cost is 2 passes per batch of them
CAUSALITY_WINDOWS = 64


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
    """A notice when a site of the model's hidden width feeds a later module (the input it transforms: an activation;
    a gate handed to a gated norm is not one) or an op contracts it over its width (`norm(h) @ w`: features): the
    conditions would move activations, not coefficients."""
    fed = [s.name for i, s in enumerate(controller.sites) if i in flow.feeds]
    contracted = [s.name for i, s in enumerate(controller.sites) if i in flow.contracted and i not in flow.feeds]
    if fed:
        return Finding.notice("hidden state", f"note: site {_some(fed)} looks like a hidden state, not a coefficient: its "
                       f"source axis has the model's hidden width {width} and a later module takes its output as the "
                       "input it transforms; the conditions would move activations, not a controller's coefficients: "
                       "point the pattern at the module or op that computes the coefficients (a gate, a mixture, a "
                       "router)", {"sites": fed, "width": width})
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
