"""What a new user's adaptive-depth and routing code found (issue 45): each is now a refusal naming the fix, a notice,
or a correct number. The models are written here the way their papers describe the mechanisms, nothing in them knows
of fcaudit."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from harness import api_refusal
from torch import nn

import fcaudit as fca
from fcaudit.controllers import Codec, Decisions, Layout
from fcaudit.controllers.flow_checks import CAUSALITY_WINDOWS, check_causality

V, D, T, STEPS = 32, 16, 12, 4


def windows(n, seed=0):
    return torch.randint(0, V, (n, T), generator=torch.Generator().manual_seed(seed))


def audit(model, ctrl, out, n=8, **kw):
    return fca.audit(model.eval(), ctrl, windows(n), windows(8, 1), randomizations=kw.pop("R", 2), seed=0, out=out,
                     batch_size=4, quiet=True, **kw)


# ---- halting ---------------------------------------------------------------------------------------------------

class Ponder(nn.Module):
    """Per step a state; the output mixes the step states by `halt`'s weights over steps."""

    def __init__(self, halt: nn.Module):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.pos, self.step, self.head = nn.Embedding(V, D), nn.Embedding(T, D), nn.Linear(D, D), nn.Linear(D, V)
        self.halt = halt

    def forward(self, ids):
        h = self.emb(ids) + self.pos.weight[: ids.shape[1]]
        states = []
        for _ in range(STEPS):
            h = h + torch.tanh(self.step(h))
            states.append(h)
        w = self.halt(ids, h)  # [batch, token, steps]
        return self.head(sum(w[..., s, None] * states[s] for s in range(STEPS)))


class StepProbabilities(nn.Module):
    """Per-step halting probabilities, each a sigmoid: not a distribution over steps."""

    def __init__(self):
        super().__init__()
        self.p = nn.Linear(D, STEPS)

    def forward(self, ids, h):
        return torch.sigmoid(self.p(h))


class ContinueMask(nn.Module):
    """A 0/1 "keep going" mask per (token, step): several ones per token."""

    def __init__(self):
        super().__init__()
        self.p = nn.Linear(D, STEPS)

    def forward(self, ids, h):
        return (self.p(h) > -0.3).float()


class ByPosition(nn.Module):
    """ACT-like weights that depend on the position only: position t halts at step 1 + t % STEPS, its weights a
    softmax over the steps it runs."""

    def __init__(self):
        super().__init__()
        self.logits = nn.Parameter(torch.randn(T, STEPS, generator=torch.Generator().manual_seed(3)))

    def forward(self, ids, h):
        depth = 1 + torch.arange(T) % STEPS
        runs = torch.arange(STEPS)[None, :] < depth[:, None]
        w = self.logits.masked_fill(~runs, float("-inf")).softmax(-1)
        return w[None].expand(ids.shape[0], -1, -1)


@pytest.mark.parametrize("halt", [StepProbabilities, ContinueMask])
def test_halting_weights_that_are_not_a_distribution_are_refused_naming_the_fix(halt, tmp_path):
    model = Ponder(halt())
    ctrl = fca.Controller.from_modules(model, "halt", layout="batch token step", kind="halting")
    line = api_refusal(lambda: audit(model, ctrl, tmp_path / "a"))
    assert "the weights over steps are not a distribution per token" in line
    assert "kind='skip_mask'" in line and "kind='exit_depth'" in line
    assert not (tmp_path / "a").exists()


def test_static_depth_of_halting_keeps_each_positions_depth_where_halting_depends_on_the_position_only(tmp_path):
    model = Ponder(ByPosition())
    ctrl = fca.Controller.from_modules(model, "halt", layout="batch token step", kind="halting")
    result = audit(model, ctrl, tmp_path / "a")
    pen = result.penalties()
    assert result.replay.bit_equal
    assert pen["CrossInput"].statistic == 0 and pen["StaticDepth"].statistic == 0  # the same depths and weights
    assert pen["RandomHalt"].statistic != 0


# ---- exit depth --------------------------------------------------------------------------------------------------

class LateExits(nn.Module):
    """Four blocks; blocks 0 and 1 run for every token, exit classifiers after blocks 1 and 2 (block 3 is the last).
    `runs` counts the (block, token) pairs that ran, as the model decides them."""

    def __init__(self, unit_axis=False):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.head = nn.Embedding(V, D), nn.Linear(D, V)
        self.blocks = nn.ModuleList(nn.Linear(D, D) for _ in range(4))
        self.exits = nn.ModuleDict({"1": Exit(unit_axis), "2": Exit(unit_axis)})
        self.runs = []

    def forward(self, ids):
        h = self.emb(ids)
        done = torch.zeros(ids.shape, dtype=torch.bool)
        ran = 0
        for l, block in enumerate(self.blocks):
            ran = ran + (~done).sum(1)
            h = torch.where(done[..., None], h, h + torch.tanh(block(h)))
            if str(l) in self.exits:
                done = done | self.exits[str(l)](h).reshape(ids.shape).bool()
        self.runs.append(ran.double() / (4 * ids.shape[1]))
        return self.head(h)


class Exit(nn.Module):
    def __init__(self, unit_axis):
        super().__init__()
        self.score, self.unit_axis = nn.Linear(D, 1), unit_axis

    def forward(self, h):
        out = self.score(h) > 0
        return out if self.unit_axis else out[..., 0]


def test_exit_sites_after_block_k_count_the_blocks_that_always_run(tmp_path):
    model = LateExits()
    ctrl = fca.Controller.from_modules(model, "exits.*", kind="exit_depth", codec=Decisions(always=1))
    result = audit(model, ctrl, tmp_path / "a")
    model.runs.clear()
    with torch.no_grad():
        model(windows(8))
    correct = result.records[result.records.condition == "Correct"].sort_values("example").active.to_numpy()
    assert np.array_equal(correct, model.runs[0].numpy())  # the fraction of (block, token) pairs that ran, exactly
    undeclared = fca.Controller.from_modules(model, "exits.*", kind="exit_depth")
    result = audit(model, undeclared, tmp_path / "b")
    assert any("Decisions(always=1)" in f.line for f in result.replay.findings)


def test_decisions_accept_a_trailing_unit_axis(tmp_path):
    model = LateExits(unit_axis=True)
    ctrl = fca.Controller.from_modules(model, "exits.*", kind="exit_depth", codec=Decisions(always=1))
    assert audit(model, ctrl, tmp_path / "a").replay.bit_equal


class Skipper(nn.Module):
    """Blocks skipped per (token, block) by a mask whose module says True for "skip the next block"."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.head = nn.Embedding(V, D), nn.Linear(D, V)
        self.blocks = nn.ModuleList(nn.Linear(D, D) for _ in range(3))
        self.skips = nn.ModuleList(Exit(False) for _ in range(2))

    def forward(self, ids):
        h = self.emb(ids)
        skip = torch.zeros(ids.shape, dtype=torch.bool)
        for l, block in enumerate(self.blocks):
            h = torch.where(skip[..., None], h, h + torch.tanh(block(h)))
            if l < 2:
                skip = self.skips[l](h)  # not kept: a skipped block does not end the token
        return self.head(h)


def test_a_skip_mask_declared_as_exits_is_refused_without_suggesting_a_tolerance(tmp_path):
    model = Skipper()
    line = api_refusal(lambda: audit(model, fca.Controller.from_modules(model, "skips.*", kind="exit_depth"),
                                     tmp_path / "a"))
    assert line.startswith("exact replay failed") and "tolerance" in line and "pass a tolerance" not in line
    assert "declare the decisions the model obeys" in line


# ---- skip masks --------------------------------------------------------------------------------------------------

class WindowSkip(nn.Module):
    """Per window, each of two blocks skipped or run for all its tokens (a policy on the window's first token)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.head = nn.Embedding(V, D), nn.Linear(D, V)
        self.blocks = nn.ModuleList(nn.Linear(D, D) for _ in range(2))
        self.policy = nn.ModuleList(Policy(l) for l in range(2))

    def forward(self, ids):
        h = self.emb(ids)
        for block, policy in zip(self.blocks, self.policy):
            run = policy(ids)  # [batch]
            h = torch.where(run[:, None, None], h + torch.tanh(block(h)), h)
        return self.head(h)


class Policy(nn.Module):
    def __init__(self, l, late=False):
        super().__init__()
        self.l, self.late = l, late

    def forward(self, ids):
        first = ids[:, 0]
        if self.late:  # windows whose first id is 0 mod 16 .. 2 mod 16 decide on the last token instead
            return torch.where(first % 16 < 3, ids[:, -1] % 2 == 0, (first + self.l) % 2 == 0)
        return (first + self.l) % 2 == 0


def test_a_per_window_skip_policy_says_token_conditions_are_zero_by_construction(tmp_path):
    model = WindowSkip()
    ctrl = fca.Controller.from_modules(model, "policy.*", kind="skip_mask", codec=Decisions(window=True))
    result = audit(model, ctrl, tmp_path / "a")
    zero = next(f for f in result.replay.findings if f.check == "zero")
    assert zero.data["conditions"] == ["TokenShuffle", "TokenResamplePast", "E_token", "E_interaction"]
    assert "0 by construction" in zero.line
    pen, effects = result.penalties(), result.factor_effects()
    assert pen["TokenShuffle"].statistic == 0 and pen["TokenResamplePast"].statistic == 0
    assert effects["E_token"].statistic == 0 and pen["CrossInput"].statistic != 0


def test_the_causality_check_probes_enough_windows_to_find_a_policy_that_reads_later_tokens_in_some(tmp_path):
    model = WindowSkip()
    model.policy = nn.ModuleList(Policy(l, late=True) for l in range(2))
    ids = windows(400, seed=5)
    late = ids[:, 0] % 16 < 3
    ids = torch.cat([ids[~late][:52], ids[late][:12]])  # 12 of 64 windows read their last token, none of the first 8
    ctrl = fca.Controller.from_modules(model, "policy.*", kind="skip_mask", codec=Decisions(window=True))
    with torch.no_grad():
        assert check_causality(model, ctrl, ids[:8], V).data["later_token_flips"] == 0  # the first batch alone
    assert CAUSALITY_WINDOWS >= 64
    result = fca.audit(model.eval(), ctrl, ids, windows(8, 1), randomizations=1, out=tmp_path / "a", batch_size=8,
                       quiet=True)
    causality = result.replay.finding("causality")
    assert causality.data["windows"] == 64 and causality.data["later_token_flips"] > 0


class OnePolicy(nn.Module):
    """One policy module decides, per token, which of three blocks run: [batch, token, block]."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.head = nn.Embedding(V, D), nn.Linear(D, V)
        self.blocks = nn.ModuleList(nn.Linear(D, D) for _ in range(3))
        self.policy = nn.Linear(D, 3)

    def forward(self, ids):
        h = self.emb(ids)
        run = self.policy(h) > 0
        for l, block in enumerate(self.blocks):
            h = torch.where(run[..., l, None], h + torch.tanh(block(h)), h)
        return self.head(h)


def test_a_depth_site_with_a_source_axis_is_refused_up_front(tmp_path):
    model = OnePolicy()
    line = api_refusal(lambda: fca.Controller.from_modules(model, "policy", layout="batch token block",
                                                           kind="skip_mask"))
    assert "drop the layout" in line  # a layout is refused at once
    ctrl = fca.Controller.from_modules(model, "policy", codec=Layout.parse("batch token block"), kind="skip_mask")
    line = api_refusal(lambda: audit(model, ctrl, tmp_path / "a"))  # a codec: refused at the probe, before stage 1
    assert "holds one decision per token" in line and "declare one site per block" in line
    line = api_refusal(lambda: audit(model, fca.Controller.from_modules(model, "policy", kind="skip_mask"),
                                     tmp_path / "b"))
    assert "one site per block" in line and "window=True" not in line
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


# ---- gates and capacity ------------------------------------------------------------------------------------------

class Gated(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.head = nn.Embedding(V, D), nn.Linear(D, V)
        self.blocks = nn.ModuleList(nn.Linear(D, D) for _ in range(2))
        self.gates = nn.ModuleList(nn.Sequential(nn.Linear(D, 1), nn.Sigmoid(), nn.Flatten(-2)) for _ in range(2))

    def forward(self, ids):
        h = self.emb(ids)
        for block, gate in zip(self.blocks, self.gates):
            h = h + gate(h)[..., None] * torch.tanh(block(h))
        return self.head(h)


def test_a_gate_given_a_mixtures_reference_is_refused(tmp_path):
    model = Gated()
    line = api_refusal(lambda: fca.Controller.from_modules(model, "gates.*", layout="batch token", kind="scalar_gate",
                                                           reference="SourceUniformMean"))
    assert "takes the reference GlobalMean, not 'SourceUniformMean'" in line
    inferred = fca.Controller.from_modules(model, "gates.*", layout="batch token", reference="SourceUniformMean")
    line = api_refusal(lambda: audit(model, inferred, tmp_path / "a"))
    assert "holds one source per (token, stream): it is a gate; pass kind='scalar_gate'" in line


E, C = 4, 5  # experts, slots per expert and window


class StraightThroughRouter(nn.Module):
    """Top-1 routing with capacity C; the dispatch is a straight-through estimate whose ones come out 0.99999994."""

    def __init__(self):
        super().__init__()
        self.wg = nn.Linear(D, E, bias=False)

    def forward(self, x):
        probs = self.wg(x).softmax(-1)
        mask = F.one_hot(probs.argmax(-1), E).float()
        location = mask.cumsum(1) - 1
        mask = mask * (location < C)
        slot = F.one_hot(location.clamp(0, C - 1).long(), C).float() * mask[..., None]
        dispatch = slot * (1 - 2 ** -24)  # what hard + soft - soft.detach() leaves in float32
        return dispatch, (probs * mask)[..., None] * slot


class CapacityLM(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.head = nn.Embedding(V, D), nn.Linear(D, V)
        self.router = StraightThroughRouter()
        self.experts = nn.ModuleList(nn.Linear(D, D) for _ in range(E))

    def forward(self, ids):
        x = self.emb(ids)
        x = x + x.cumsum(1) / torch.arange(1, x.shape[1] + 1)[None, :, None]
        dispatch, combine = self.router(x)
        inputs = torch.einsum("btec,btd->becd", dispatch, x)
        outputs = torch.stack([f(inputs[:, e]) for e, f in enumerate(self.experts)], 1)
        return self.head(x + torch.einsum("btec,becd->btd", combine, outputs))


class Slots(Codec):
    """The combine weights indexed by (expert, slot) as the coefficient: the slots move with the tokens."""

    def encode(self, output, batch, token):
        return output[1].detach().reshape(batch, token, 1, E * C).clone()

    def meta(self, output):
        return {}

    def decode(self, canonical, meta):
        combine = canonical.reshape(canonical.shape[0], canonical.shape[1], E, C).contiguous()
        return (combine != 0).float() * (1 - 2 ** -24), combine


def test_an_almost_binary_dispatch_is_caught_by_the_slot_check(tmp_path):
    model = CapacityLM()
    ctrl = fca.Controller.from_modules(model, "router", codec=Slots(), kind="capacity_router")
    line = api_refusal(lambda: audit(model, ctrl, tmp_path / "a"))
    assert "puts two or more tokens in one slot" in line and "under TokenResamplePast" in line
