"""A token router as a user builds it (a CoLT5-style routed heavy branch), audited through
Controller.from_modules(..., routing="tokens"): exact replay, every condition keeping the budget k."""

import numpy as np
import pytest
import torch
from torch import nn

import fcaudit as fca
from fcaudit import protocol
from fcaudit.controllers.site import TokenRoute
from fcaudit.errors import FcauditError


class Router(nn.Module):
    """Top-k tokens of the window; straight-through scores that are exactly 1.0 (only the chosen set matters)."""

    def __init__(self, d: int, k: int):
        super().__init__()
        self.score, self.k = nn.Linear(d, 1), k

    def forward(self, h):
        s = self.score(h).squeeze(-1)
        index = s.topk(self.k, dim=-1).indices.sort(-1).values
        return s - s.detach() + 1, index


class RoutedLayer(nn.Module):
    """A light MLP on every token, a heavy one on the router's k tokens only (CoLT5's conditional branch)."""

    def __init__(self, d: int, k: int):
        super().__init__()
        self.router = Router(d, k)
        self.light = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, d), nn.GELU())
        self.heavy = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, h):
        scores, index = self.router(h)
        at = index.unsqueeze(-1).expand(-1, -1, h.size(-1))
        heavy = self.heavy(h.gather(1, at)) * scores.gather(1, index).unsqueeze(-1)
        return (h + self.light(h)).scatter_add(1, at, heavy)


class Routed(nn.Module):
    def __init__(self, vocab: int = 256, d: int = 32, k: int = 8, layers: int = 2):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(RoutedLayer(d, k) for _ in range(layers))
        self.head = nn.Linear(d, vocab)

    def forward(self, ids):
        h = self.emb(ids)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def test_a_user_built_token_router_audits_with_an_exact_replay_and_its_budget(tmp_path):
    torch.manual_seed(0)
    model = Routed().eval()
    ctrl = fca.Controller.from_modules(model, "layers.*.router", routing="tokens", reference_name="RandomRoute",
                                       static_name="StaticTopK")
    assert all(isinstance(s.codec, TokenRoute) for s in ctrl.sites) and ctrl.info.tokens
    ev, ca = fca.windows("embedded", n_eval=6, n_calib=6, window=32)
    result = fca.audit(model, ctrl, ev, ca, randomizations=2, seed=0, out=tmp_path / "a", quiet=True)
    rep = result.replay
    assert rep.passed and rep.bit_equal and rep.max_abs_dlogit == 0.0 and rep.route_flips == 0
    assert rep.later_token_flips > 0  # top-k over the window sees later tokens
    assert set(result.records["condition"]) == set(protocol.for_controller(ctrl.info))
    assert (result.records["active"] == 8 / 32).all()  # k tokens of 32 run the heavy branch, under every condition
    with torch.inference_mode(), ctrl.capture(*ev.ids.shape) as found:
        model(ev.ids)
    assert all(bool((c[:, :, 0, 0] == 1.0).all()) for c in found)  # the scores carry nothing
    moved = protocol.routes_past(found, np.arange(ev.ids.shape[0]), 0, 0)
    assert all(torch.equal(protocol.chosen(a).sum(1), protocol.chosen(b).sum(1)) for a, b in zip(found, moved))


class Chosen(fca.Codec):
    """A user's codec for a router returning only the chosen positions' mask."""

    def encode(self, output, batch, token):
        c = torch.zeros(batch, token, 1, 2)
        c[:, :, 0, 0], c[:, :, 0, 1] = output.float(), output.float()
        return c

    def decode(self, canonical, meta):
        return canonical[:, :, 0, 1] > 0.5


def test_from_modules_routing_tokens_marks_or_checks_the_codec():
    model = Routed()
    ctrl = fca.Controller.from_modules(model, "layers.*.router", codec=Chosen(), routing="tokens")
    assert ctrl.info.routing == ("tokens", "tokens")
    with pytest.raises(FcauditError, match="drop the layout"):
        fca.Controller.from_modules(model, "layers.*.router", layout="batch token", routing="tokens")
    with pytest.raises(FcauditError, match="the one routing fcaudit knows"):
        fca.Controller.from_modules(model, "layers.*.router", routing="experts")
