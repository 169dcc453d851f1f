"""Token routers: sites whose coefficient says which tokens a block runs on (Mixture-of-Depths, routed branches).

Such a site's canonical tensor is [batch, token, 1, 2]: the router's score of each token and whether it was chosen
(1) or not (0). Decoding rebuilds the router's output from the (possibly transformed) pair: the chosen positions in
ascending order and the scores, so the block downstream gathers, runs and scatters exactly the replayed set. The
protocol's token-routing conditions keep the number chosen per window and layer (protocol.chosen).
"""

from __future__ import annotations

from typing import Any

import torch

from fcaudit.controllers.site import Codec
from fcaudit.errors import FcauditError


def chosen_index(mask: torch.Tensor) -> torch.Tensor:
    """The chosen positions of a [B, T] bool mask, ascending, as [B, k_max] int64, padded with -1 where a window
    chose fewer (at least one column)."""
    T = mask.size(1)
    k = max(1, int(mask.sum(-1).max().item()) if mask.numel() else 1)
    order = torch.arange(T, device=mask.device).expand_as(mask)
    index = torch.where(mask, order, order + T).sort(-1).values[:, :k]
    return torch.where(index < T, index, torch.full_like(index, -1))


class TokenRoute(Codec):
    """A router whose output is (scores [B, T], index [B, k]): a tuple or a namedtuple of those two fields (more
    fields are refused: a codec that reads the site's inputs is needed to rebuild them)."""

    routing = "tokens"

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
        valid = index >= 0
        c[:, :, 0, 1].scatter_add_(1, index.clamp_min(0), valid.float())  # padding (-1) adds 0 to token 0
        return c

    def meta(self, output: Any) -> dict:
        return {"type": type(output), "dtype": output[0].dtype}

    def decode(self, canonical: torch.Tensor, meta: dict) -> Any:
        scores = canonical[:, :, 0, 0].to(meta["dtype"]).contiguous()
        index = chosen_index(canonical[:, :, 0, 1] > 0.5)
        kind = meta["type"]
        return kind(scores, index) if kind is not tuple else (scores, index)

    def describe(self) -> str:
        return "token router: (scores [batch token], chosen index [batch k])"


def routed(layout: Any, codec: Codec | None, routing: str) -> Codec:
    """The codec of a site declared `routing` (Controller.from_modules(..., routing="tokens")): TokenRoute when
    neither a codec nor a layout is given; a given codec is marked as a token router (or must already be one)."""
    if routing != "tokens":
        raise FcauditError(f"routing={routing!r}: the one routing fcaudit knows is 'tokens' (a router choosing the "
                           "tokens a block runs on); drop routing= for any other site")
    if codec is None and isinstance(layout, Codec):
        codec, layout = layout, None
    if layout is not None:
        raise FcauditError(f"routing='tokens' with layout {layout!r}: a token router's coefficient is (score, chosen) "
                           "per token; drop the layout (TokenRoute reads a (scores, index) output) or pass codec=")
    if codec is None:
        return TokenRoute()
    if codec.routing not in (None, "tokens"):
        raise FcauditError(f"codec {codec.describe()} says routing={codec.routing!r}, not 'tokens': pass a token "
                           "router's codec")
    if codec.routing is None:
        try:
            codec.routing = "tokens"
        except (AttributeError, TypeError):  # a frozen dataclass
            raise FcauditError(f"codec {codec.describe()} cannot be marked as a token router: give its class "
                               "routing = 'tokens'") from None
    return codec


def decisions(c: torch.Tensor, tokens: bool) -> torch.Tensor:
    """A router's discrete decisions in one canonical tensor, [batch, token, stream, *]: which tokens were chosen
    (a token router) or which sources are nonzero (an expert router)."""
    return c[..., 1:] > 0.5 if tokens else c != 0


def later_token_flips(model: torch.nn.Module, controller, ids: torch.Tensor, vocab: int, seed: int = 0) -> int:
    """How many routing decisions at earlier positions change when only the last quarter of each window (at least
    its last token) changes to seeded random tokens: above 0, a decision at t depends on tokens after t (top-k over
    the whole window does), so the router cannot decode autoregressively as it is. A span rather than the last token
    alone: a trained top-k router rarely moves its last token across the k-th score, so changing one token would
    mostly find nothing."""
    span = max(1, ids.shape[1] // 4)
    changed = ids.clone()
    gen = torch.Generator().manual_seed(seed)
    changed[:, -span:] = torch.randint(0, vocab, (ids.shape[0], span), generator=gen).to(ids.device)
    runs = []
    for x in (ids, changed):
        with torch.inference_mode(), controller.capture(*x.shape, remember=False) as found:
            model(x)
        runs.append(found)
    flips = 0
    for i, site in enumerate(controller.sites):
        tokens = site.codec.routing == "tokens"
        if tokens or site.codec.top_k is not None:
            before, after = (decisions(run[i][:, :-span], tokens) for run in runs)
            flips += int((before != after).any(-1).sum())
    return flips
