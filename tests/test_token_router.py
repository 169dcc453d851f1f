"""A token router as a user builds it (a CoLT5-style routed heavy branch), audited through
Controller.from_modules(..., kind="token_router"): exact replay, every condition keeping the budget k."""

import numpy as np
import pytest
import torch
from torch import nn

import fcaudit as fca
from fcaudit import protocol
from fcaudit.controllers import TokenRoute
from fcaudit.errors import FcauditError
from fcaudit.kinds import chosen


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
    ctrl = fca.Controller.from_modules(model, "layers.*.router", kind="token_router")
    assert all(isinstance(s.codec, TokenRoute) for s in ctrl.sites) and ctrl.info.tokens
    assert ctrl.labels["StructureRemoved"] == "RandomRoute" and ctrl.describe()["static"] == "StaticTopK"
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
    assert all(torch.equal(chosen(a).sum(1), chosen(b).sum(1)) for a, b in zip(found, moved))


class Chosen(fca.Codec):
    """A user's codec for a router returning only the chosen positions' mask."""

    def encode(self, output, batch, token):
        c = torch.zeros(batch, token, 1, 2)
        c[:, :, 0, 0], c[:, :, 0, 1] = output.float(), output.float()
        return c

    def decode(self, canonical, meta):
        return canonical[:, :, 0, 1] > 0.5


def test_kind_token_router_declares_a_users_codec_a_token_router_without_changing_the_codec():
    model = Routed()
    codec = Chosen()
    ctrl = fca.Controller.from_modules(model, "layers.*.router", codec=codec, kind="token_router")
    assert ctrl.info.kinds == ("token_router", "token_router") and ctrl.info.routers == (0, 1)
    assert vars(codec) == {} and Chosen.kind is None  # the codec is the user's, untouched
    with pytest.raises(FcauditError, match="drop the layout"):
        fca.Controller.from_modules(model, "layers.*.router", layout="batch token", kind="token_router")
    with pytest.raises(FcauditError, match="unknown kind 'experts'; use one of scalar_gate, "):
        fca.Controller.from_modules(model, "layers.*.router", layout="batch token", kind="experts")
    with pytest.raises(FcauditError, match="a token_router takes the reference RandomRoute, not 'GlobalMean'"):
        fca.Controller.from_modules(model, "layers.*.router", kind="token_router", reference="GlobalMean")
    with pytest.raises(FcauditError, match="reads a token_router, not a scalar_gate"):
        fca.Controller.from_modules(model, "layers.*.router", codec=TokenRoute(), kind="scalar_gate")


def test_a_token_router_merged_with_a_gate_is_refused_naming_the_conditions_they_do_not_share():
    model = Routed()
    routers = fca.Controller.from_modules(model, "layers.*.router", kind="token_router")
    gates = fca.Controller.from_modules(model, "layers.*.light.1", "batch token hidden")
    with pytest.raises(FcauditError, match=r"a token_router and a vector_gate cannot be audited together \(the "
                                           r"vector_gate's LayerPositionMean, StaticProfile, StructureRemoved mean "
                                           r"nothing for the other\); give each kind its own controller"):
        fca.Controller.merge(routers, gates)


class ChoiceOnlyLayer(RoutedLayer):
    """The heavy branch runs on the router's tokens and ignores their scores (a hard choice)."""

    def forward(self, h):
        _, index = self.router(h)
        at = index.unsqueeze(-1).expand(-1, -1, h.size(-1))
        return (h + self.light(h)).scatter_add(1, at, self.heavy(h.gather(1, at)))


def test_a_router_whose_block_ignores_the_scores_is_not_said_to_measure_nothing(tmp_path):
    """Replaying zeros for the scores changes nothing here, but the choices matter: the effect check replays another
    set of as many tokens, so there is no "measure nothing" notice, and RandomRoute costs NLL."""
    torch.manual_seed(0)
    model = Routed().eval()
    for layer in model.layers:
        layer.__class__ = ChoiceOnlyLayer
    ctrl = fca.Controller.from_modules(model, "layers.*.router", kind="token_router")
    ev, ca = fca.windows("embedded", n_eval=4, n_calib=4, window=32)
    with torch.inference_mode():
        with ctrl.capture(*ev.ids.shape) as found:
            logits = model(ev.ids)
        with ctrl.replay([c * torch.tensor([0.0, 1.0]) for c in found], found.decoding):  # no scores, same choices
            assert torch.equal(model(ev.ids), logits)
    result = fca.audit(model, ctrl, ev, ca, randomizations=1, out=tmp_path / "a", quiet=True)
    assert result.replay.passed and not any("measure nothing" in line for line in result.notices)
    nll = result.records.set_index(["condition", "example"])["nll"]
    assert (nll["RandomRoute"] != nll["Correct"]).all()  # other tokens through the heavy branch: other NLLs
