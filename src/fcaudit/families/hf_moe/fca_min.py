"""Minimal capture and replay through codecs: a stand-in for the engine's Controller.capture / replay (engine
v2), used by the execution measures, the tests and benchmarks/moe_penalties.py until the engine lands.

Capture: forward hooks encode each site's output. Replay: each site's `forward` is replaced by one returning
the codec's decoding of the supplied coefficients, so the router does not run; restored on exit.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch

from fcaudit.errors import FcauditError
from fcaudit.families.hf_moe.discover import MoeSite


@dataclass
class Captured:
    coefficients: list[torch.Tensor]  # per site, canonical [batch, token, stream, source]
    metas: list[dict]
    logits: torch.Tensor


def forward_logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


def capture(model, sites: Sequence[MoeSite], ids: torch.Tensor) -> Captured:
    """One unmodified forward pass of ids [batch, token]: every site's canonical coefficients and the logits."""
    B, T = ids.shape
    coeffs: list[torch.Tensor | None] = [None] * len(sites)
    metas: list[dict | None] = [None] * len(sites)

    def hook_for(i: int, site: MoeSite):
        def hook(module, args, out):
            if coeffs[i] is not None:
                raise FcauditError(f"site {site.path!r} ran twice in one forward pass")
            coeffs[i], metas[i] = site.codec.encode(out, B, T), site.codec.meta(out)
        return hook

    handles = [s.module.register_forward_hook(hook_for(i, s)) for i, s in enumerate(sites)]
    try:
        logits = forward_logits(model, ids)
    finally:
        for h in handles:
            h.remove()
    missing = [s.path for s, c in zip(sites, coeffs) if c is None]
    if missing:
        raise FcauditError(f"sites {missing} did not run in the forward pass")
    return Captured(coeffs, metas, logits)


@contextmanager
def replaying(sites: Sequence[MoeSite], coefficients: Sequence[torch.Tensor], metas: Sequence[dict]) -> Iterator[None]:
    """Within the context each site returns its codec's decoding of the given coefficients (a fresh output per call)."""
    if not (len(sites) == len(coefficients) == len(metas)):
        raise FcauditError(f"replay got {len(coefficients)} coefficient tensors for {len(sites)} sites")
    saved = []
    try:
        for site, c, meta in zip(sites, coefficients, metas):
            saved.append((site.module, site.module.__dict__.get("forward")))
            site.module.forward = (lambda codec, c, meta: lambda *a, **k: codec.decode(c, meta))(site.codec, c, meta)
        yield
    finally:
        for module, original in saved:
            if original is None:
                del module.forward
            else:
                module.forward = original


def replay_logits(model, sites: Sequence[MoeSite], ids: torch.Tensor, coefficients: Sequence[torch.Tensor],
                  metas: Sequence[dict]) -> torch.Tensor:
    with replaying(sites, coefficients, metas):
        return forward_logits(model, ids)
