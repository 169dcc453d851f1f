"""Capacity dispatch: a tiny top-2 MoE whose router assigns expert slots by a cumulative sum over the window (GShard /
Switch style, written here as a third-party package writes one), audited through CapacityRoute: exact replay, at most
one token per slot and `capacity` tokens per expert under every condition, dropped assignments counted, and `active`
equal to what the model's experts really ran."""

from collections import defaultdict

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fcaudit as fca
from fcaudit import protocol
from fcaudit.auditor.engine import executed
from fcaudit.controllers import Codec
from fcaudit.controllers.routing import CapacityRoute
from fcaudit.errors import FcauditError
from fcaudit.kinds import Description
from fcaudit.loss import token_nll
from fcaudit.stats.results import retention_value

V, D, E, C, L, T = 64, 16, 4, 6, 2, 16  # vocab, width, experts, capacity per expert and window, layers, window


# ---- the model, as a third-party package writes it (nothing in it knows of fcaudit) -------------------------------

class CapacityRouter(nn.Module):
    """Top-2 gating with a fixed capacity: slots in sequence order per expert (cumulative sum); assignments past the
    capacity are dropped. Returns (dispatch, combine), both [batch, token, expert, capacity]."""

    def __init__(self, dim: int, experts: int, capacity: int, reverse: bool = False):
        super().__init__()
        self.wg = nn.Linear(dim, experts, bias=False)
        self.capacity, self.reverse = capacity, reverse  # reverse: slots from the last token back (another rule)

    def forward(self, x):
        probs = self.wg(x).softmax(-1)
        mask = torch.zeros_like(probs).scatter_(-1, probs.topk(2, dim=-1).indices, 1.0)
        order = mask.flip(1) if self.reverse else mask
        location = order.cumsum(1) - 1
        location = location.flip(1) if self.reverse else location
        mask = mask * (location < self.capacity)
        gates = probs * mask
        gates = gates / gates.sum(-1, keepdim=True).clamp_min(1e-9)
        slot = F.one_hot(location.clamp(0, self.capacity - 1).long(), self.capacity).to(x.dtype) * mask[..., None]
        return slot.bool(), gates[..., None] * slot


class CapacityMoE(nn.Module):
    def __init__(self, dim: int, experts: int, capacity: int, reverse: bool = False):
        super().__init__()
        self.router = CapacityRouter(dim, experts, capacity, reverse)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
                                     for _ in range(experts))

    def forward(self, x):
        dispatch, combine = self.router(x)
        inputs = torch.einsum("btec,btd->becd", dispatch.to(x.dtype), x)
        outputs = torch.stack([f(inputs[:, e]) for e, f in enumerate(self.experts)], 1)
        return torch.einsum("btec,becd->btd", combine, outputs)  # a token no expert took adds 0: it passes through


class Block(nn.Module):
    def __init__(self, dim: int, experts: int, capacity: int, reverse: bool = False):
        super().__init__()
        self.ln = nn.LayerNorm(dim)
        self.mix = nn.Linear(dim, dim)
        self.moe = CapacityMoE(dim, experts, capacity, reverse)

    def forward(self, x):
        # a causal running mean lets a token's output depend on earlier tokens
        prefix = x.cumsum(1) / torch.arange(1, x.shape[1] + 1, device=x.device)[None, :, None]
        x = x + self.mix(prefix)
        return x + self.moe(self.ln(x))


class CapacityLM(nn.Module):
    def __init__(self, reverse: bool = False):
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.layers = nn.ModuleList(Block(D, E, C, reverse) for _ in range(L))
        self.head = nn.Linear(D, V)

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def tiny(seed: int = 0, reverse: bool = False) -> CapacityLM:
    torch.manual_seed(seed)
    return CapacityLM(reverse).eval()


def windows(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, V, (n, T), generator=torch.Generator().manual_seed(seed))


def controller(model: nn.Module, codec: Codec | None = None) -> fca.Controller:
    return fca.Controller.from_modules(model, "layers.*.moe.router", codec=codec or CapacityRoute(E, C))


class Dispatches:
    """Forward hooks on the routers: per forward pass, the dispatch masks the experts really consumed (replay included:
    a replaced forward still runs the module's hooks), and the slots holding more than one token."""

    def __init__(self, model: nn.Module):
        self.calls: list[torch.Tensor] = []
        self.shared_slots = 0
        self.handles = [m.register_forward_hook(self.hook) for n, m in model.named_modules() if n.endswith("router")]

    def hook(self, module, args, out):
        dispatch = out[0].bool()
        assert dispatch.shape[2:] == (E, C)  # at most C tokens per expert by construction of the tensor
        self.shared_slots += int((dispatch.sum(1) > 1).sum())  # (window, expert, slot) holding two tokens or more
        self.calls.append(dispatch)

    def take(self) -> list[torch.Tensor]:
        calls, self.calls = self.calls, []
        return calls

    def remove(self):
        for h in self.handles:
            h.remove()


# ---- the codec ----------------------------------------------------------------------------------------------------

def test_codec_round_trip_and_refusals():
    model, ids = tiny(), windows(3, 1)
    ctrl = controller(model)
    with torch.no_grad(), ctrl.capture(*ids.shape) as found:
        model(ids)
    router = model.layers[0].moe.router
    x = torch.randn(3, T, D)
    with torch.no_grad():
        out = router(x)
        c = ctrl.sites[0].codec.encode(out, 3, T)
    assert c.shape == (3, T, 1, E) and found[0].shape == (3, T, 1, E)
    assert int((c != 0).sum(-1).max()) <= 2
    dispatch, combine = ctrl.sites[0].codec.decode(c, ctrl.sites[0].codec.meta(out))
    assert dispatch.dtype == torch.bool and torch.equal(dispatch, out[0]) and torch.equal(combine, out[1])
    # the router's own drops: some tokens under capacity C = 6 got fewer than 2 experts, and none is counted dropped
    ran, counts = CapacityRoute(E, C).executed(c)
    assert int((c != 0).sum()) < 2 * 3 * T and torch.equal(ran, (c != 0).sum((1, 2, 3)).double())
    assert torch.equal(counts[:, -1], torch.zeros(3, dtype=torch.float64))
    with pytest.raises(FcauditError, match="capacity"):
        CapacityRoute(E, C + 1).encode(out, 3, T)
    with pytest.raises(FcauditError, match="not .dispatch, combine."):
        CapacityRoute(E, C).encode(out[1], 3, T)
    with torch.no_grad():
        reversed_out = CapacityRouter(D, E, C, reverse=True)(x)
    with pytest.raises(FcauditError, match="sequence order"):
        CapacityRoute(E, C).encode(reversed_out, 3, T)
    # a router whose capacity spans the flattened batch ([batch * token, expert, slot]) is refused, not misread
    with torch.no_grad():
        flat = CapacityRouter(D, E, 3 * C)(x.reshape(1, 3 * T, D))
    with pytest.raises(FcauditError, match=r"not \(dispatch, combine\) of shape \[batch, token, expert, slot\]"):
        CapacityRoute(E, 3 * C).encode(tuple(t[0] for t in flat), 3, T)


def test_static_mean_replayed_through_the_codec_drops_what_exceeds_the_capacity():
    codec = CapacityRoute(E, C)
    dense = torch.full((2, T, 1, E), 0.25)  # a dense static mean: every token asks for every expert
    dispatch, combine = codec.decode(dense, {"dispatch_dtype": torch.bool, "combine_dtype": torch.float32,
                                             "type": tuple})
    assert torch.equal(dispatch.sum(1), torch.ones(2, E, C, dtype=torch.long))  # every slot full, one token each
    assert torch.equal(dispatch[:, :C].sum((2, 3)), torch.full((2, C), E)) and not dispatch[:, C:].any()
    ran, counts = codec.executed(dense)
    assert ran.tolist() == [E * C] * 2 and counts[:, :E].tolist() == [[C] * E] * 2
    assert counts[:, E].tolist() == [E * (T - C)] * 2


def naive_slots():
    """What the issue's user wrote: the combine weights indexed by (expert, slot) as the coefficient."""

    class Slots(Codec):
        def encode(self, output, batch, token):
            return output[1].detach().reshape(batch, token, 1, E * C).clone()

        def meta(self, output):
            return {}

        def decode(self, canonical, meta):
            combine = canonical.reshape(canonical.shape[0], canonical.shape[1], E, C).contiguous()
            return combine != 0, combine

    return Slots()


@pytest.mark.parametrize("naive", [True, False])
def test_token_resample_past_puts_two_tokens_in_one_slot_only_when_slots_are_the_coefficient(naive):
    model, ids = tiny(), windows(8, 2)
    ctrl = controller(model, naive_slots() if naive else None)
    with torch.no_grad(), ctrl.capture(*ids.shape) as found:
        model(ids)
    seen = Dispatches(model)
    try:
        for r in range(4):
            moved = protocol.resample_past(list(found), np.arange(8), 0, r)
            with torch.no_grad(), ctrl.replay(moved, found.decoding):
                model(ids)
    finally:
        seen.remove()
    assert (seen.shared_slots > 0) == naive


def test_an_audit_through_a_codec_whose_slots_collide_is_refused_with_the_count(tmp_path):
    model = tiny()
    with pytest.raises(FcauditError, match=r"puts two or more tokens in one slot .*under TokenResamplePast [1-9]\d* "
                                           r"cells of leaf \[0\] hold several tokens"):
        fca.audit(model, controller(model, naive_slots()), windows(4, 0), windows(2, 1), randomizations=1,
                  out=tmp_path / "a", batch_size=2, quiet=True)
    assert not (tmp_path / "a").exists()


# ---- whole audits ---------------------------------------------------------------------------------------------------

class Executions:
    """What the model ran per window in each forward pass, keyed by (window ids, NLL) as the engine computes it:
    (experts per token and layer, tokens per expert summed over layers)."""

    def __init__(self, model: nn.Module):
        self.seen = Dispatches(model)
        self.by_key: dict[tuple, set] = defaultdict(set)
        self.handle = model.register_forward_hook(self.hook)

    def hook(self, module, args, logits):
        ids = args[0]
        calls = self.seen.take()
        if len(calls) != L:  # a pass that stopped early (none here)
            return
        per_expert = torch.stack([d.sum((1, 3)) for d in calls]).sum(0)  # [B, E]
        nll = token_nll(logits, ids).mean(1).double()
        for b in range(ids.shape[0]):
            runs = int(per_expert[b].sum())
            self.by_key[(ids[b].numpy().tobytes(), float(nll[b]))].add(
                (runs / (T * L), tuple(int(v) for v in per_expert[b])))

    def remove(self):
        self.seen.remove()
        self.handle.remove()


def test_audit_of_a_capacity_moe(tmp_path):
    model, ev, ca = tiny(), windows(6, 3), windows(4, 4)
    ctrl = controller(model)
    runs = Executions(model)
    try:
        res = fca.audit(model, ctrl, ev, ca, randomizations=2, out=tmp_path, batch_size=3, quiet=True)
    finally:
        runs.remove()
    assert res.replay.passed and res.replay.bit_equal and res.replay.route_flips == 0
    assert runs.seen.shared_slots == 0  # no slot held two tokens in any pass of the audit, under any condition
    rec = res.records
    counted = [f"expert{e}" for e in range(E)]
    assert list(rec.columns) == list(protocol.RECORD_COLUMNS) + counted + ["dropped"]
    assert set(rec.condition) == {"Correct", "CrossInput", "TokenShuffle", "CrossShuffle", "TokenResamplePast",
                                  "LayerPositionMean", "StaticProfile", "StaticTopK", "StructureRemoved"}
    assert (rec[counted].to_numpy() <= C * L).all()  # no expert above its capacity in any layer
    # `active` and the per-expert counts are what the experts really ran in that window's replay
    for row in rec.itertuples():
        ran = runs.by_key[(ev[row.example].numpy().tobytes(), float(row.nll))]
        assert ran == {(row.active, tuple(getattr(row, c) for c in counted))}, (row.condition, row.example)
    by = rec.groupby("condition")
    assert (by.get_group("Correct")["dropped"] == 0).all()  # the router's own drops are out of its combine vectors
    # a dense static mean asks every expert for every token: C kept per expert and layer, the rest counted dropped
    for name in ("StaticProfile", "StructureRemoved"):
        g = by.get_group(name)
        assert (g["dropped"] == L * E * (T - C)).all() and (g["active"] == E * C / T).all()
    g = by.get_group("StaticTopK")  # two experts for every token
    assert (g["dropped"] == L * 2 * (T - C)).all() and (g["active"] == 2 * C / T).all()
    assert (by.get_group("TokenShuffle")["dropped"] == 0).all()  # a permutation keeps each expert's count
    assert by.get_group("TokenResamplePast")["dropped"].sum() > 0  # drawn with replacement: some experts overfill


def test_executed_equals_active_for_codecs_that_do_not_count():
    coeffs = [torch.tensor([[[[0.5, 0.0, 0.5]]], [[[1.0, 0.0, 0.0]]]]), torch.ones(2, 1, 1, 1)]
    plain = [Codec(), Codec()]
    for info in (Description(("expert_router", "scalar_gate")), Description(("vector_gate", "scalar_gate"))):
        assert torch.equal(executed(coeffs, plain, info, ())[:, 0], info.active(coeffs))


def test_summary_lines_show_drops_and_a_negative_retention(tmp_path):
    model, ev, ca = tiny(), windows(4, 5), windows(2, 6)
    res = fca.audit(model, controller(model), ev, ca, randomizations=1, out=tmp_path, batch_size=2, quiet=True)
    line = res.capacity_lines()[0]
    assert f"StaticProfile {L * E * (T - C):g}" in line and f"StaticTopK {L * 2 * (T - C):g}" in line
    assert f"ExpertUniformMean {L * E * (T - C):g}" in line  # the display label of StructureRemoved
    assert "TokenShuffle" not in line  # a permutation drops nothing
    assert retention_value(-0.049, -0.073, -0.026, "").endswith("below 0: costs more than the structure-removed "
                                                                  "reference")
    assert "below 0" not in retention_value(0.5, 0.4, 0.6, "")


def test_a_count_named_like_a_record_column_is_refused_at_the_controller():
    codec = CapacityRoute(E, C)
    codec.counts = codec.counts + ("nll",)
    with pytest.raises(FcauditError, match="'nll', the name of a record column"):
        controller(tiny(), codec)
