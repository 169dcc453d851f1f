"""Depth controllers (exit depth, halting weights, skip masks per token and per window): exact replay on every depth
kind, every condition
keeps each window's budget of executed (layer, token) pairs (a test per kind), exits stay monotone, a planted toy
tells position from content, and the causality check reads depth decisions."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_early_exit
from torch import nn

import fcaudit as fca
from fcaudit import protocol
from fcaudit.kinds import depth
from fcaudit.controllers import Decisions
from fcaudit.errors import FcauditError

B, T = 8, 16


# ---- toy models of the other depth kinds ---------------------------------------------------------------------

class ACT(nn.Module):
    """ACT's halting (Graves 2016): per step a halting probability; a token halts at the first step where their sum
    passes 1 - eps, its last weight the remainder. Returns each token's weights over the steps [B, T, S]."""

    def __init__(self, d: int, eps: float = 0.05):
        super().__init__()
        self.unit, self.eps = nn.Linear(d, 1), eps

    def forward(self, states: torch.Tensor) -> torch.Tensor:
        p = torch.sigmoid(self.unit(states)).squeeze(-1)  # [B, T, S]
        over = p.cumsum(-1) >= 1 - self.eps
        over[..., -1] = True
        halt = over.long().argmax(-1, keepdim=True)  # the step it halts at
        steps = torch.arange(p.shape[-1])
        w = torch.where(steps < halt, p, 0.0)
        return w.scatter(-1, halt, 1 - w.sum(-1, keepdim=True))


class HaltingLM(nn.Module):
    """A Universal-Transformer-like toy: one shared block applied for S steps, the states mixed by ACT's weights."""

    def __init__(self, vocab: int = 64, d: int = 16, steps: int = 4):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.block, self.head = nn.Embedding(vocab, d), nn.Linear(d, d), nn.Linear(d, vocab)
        self.halt, self.steps = ACT(d), steps
        nn.init.normal_(self.halt.unit.weight, std=1.0)

    def forward(self, ids):
        h, states = self.emb(ids), []
        for _ in range(self.steps):
            h = h + torch.tanh(self.block(h))
            states.append(h)
        states = torch.stack(states, 2)
        return self.head((self.halt(states).unsqueeze(-1) * states).sum(2))


class Router(nn.Module):
    """Whether the block runs: per token, or (`window`) once per window from its mean state (SkipNet-style)."""

    def __init__(self, d: int, window: bool = False):
        super().__init__()
        self.score, self.window = nn.Linear(d, 1), window

    def forward(self, h):
        return self.score(h.mean(1) if self.window else h).squeeze(-1) > 0


class SkipLM(nn.Module):
    def __init__(self, vocab: int = 64, d: int = 16, n: int = 4, window: bool = False):
        super().__init__()
        torch.manual_seed(1)
        self.emb, self.head = nn.Embedding(vocab, d), nn.Linear(d, vocab)
        self.blocks = nn.ModuleList(nn.Linear(d, d) for _ in range(n))
        self.routers = nn.ModuleList(Router(d, window) for _ in range(n))

    def forward(self, ids):
        h = self.emb(ids)
        for block, router in zip(self.blocks, self.routers):
            run = router(h)
            run = run[:, None] if run.dim() == 1 else run
            h = torch.where(run.unsqueeze(-1), h + torch.tanh(block(h)), h)
        return self.head(h)


def windows(n=B, seed=0, vocab=64):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n, T), generator=g)


def cases():
    """(kind, model, controller) for every depth kind."""
    ee = tiny_early_exit()
    act = HaltingLM()
    skip, block = SkipLM(), SkipLM(window=True)
    return {"exit_depth": (ee, fca.controller_for(ee)),
            "halting": (act, fca.Controller.from_modules(act, "halt", layout="batch token step", kind="halting")),
            "skip_mask": (skip, fca.Controller.from_modules(skip, "routers.*", kind="skip_mask")),
            "skip_window": (block, fca.Controller.from_modules(block, "routers.*", codec=Decisions(window=True),
                                                              kind="skip_mask"))}


CASES = cases()


# ---- exact replay ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", CASES)
def test_replay_is_exact_and_the_depth_rule_does_not_run(kind):
    model, ctrl = CASES[kind]
    ids = windows()
    with torch.inference_mode(), ctrl.capture(*ids.shape) as found:
        live = model(ids)
    calls = []
    hooks = [m.register_forward_pre_hook(lambda *a: calls.append(1))  # the rule's own layers
             for s in ctrl.sites for m in s.module.modules() if m is not s.module]
    try:
        with torch.inference_mode(), ctrl.replay(found):
            replayed = model(ids)
    finally:
        for h in hooks:
            h.remove()
    assert torch.equal(live, replayed) and not calls
    assert ctrl.info.lead.name == kind.replace("skip_window", "skip_mask") and ctrl.info.static == "StaticDepth"
    fraction = ctrl.info.active(found)
    assert 0 < float(fraction.mean()) < 1, "the toy should skip some (layer, token) pairs and run others"


# ---- every condition keeps the budget ----------------------------------------------------------------------------

class Context:
    """The protocol's ReplayContext over captured coefficients (what the engine gives a condition)."""

    def __init__(self, ctrl, coeffs, calib, seed=0):
        self.seed, self.info, self.coeffs = seed, ctrl.info, coeffs
        self.profiles = protocol.static_profiles([(protocol.batch_sums(calib), calib[0].shape[0])], ctrl.info)

    def take(self, examples):
        return [c[torch.as_tensor(examples)] for c in self.coeffs]

    def derangement(self, r):
        return protocol.derangement(self.coeffs[0].shape[0], self.seed, r)

    def static(self, name, batch):
        return [protocol.expand(p.to(c.dtype), batch, T) for p, c in zip(self.profiles[name], self.coeffs)]


def captured(model, ctrl, ids):
    with torch.inference_mode(), ctrl.capture(*ids.shape) as found:
        model(ids)
    return found


@pytest.mark.parametrize("case", CASES)
def test_every_condition_keeps_each_windows_budget_exactly(case):
    model, ctrl = CASES[case]
    coeffs, calib = captured(model, ctrl, windows()), captured(model, ctrl, windows(seed=1))
    ctx, examples = Context(ctrl, coeffs, calib), np.arange(B)
    kind, window = ctrl.info.lead, ctrl.info.window
    budget = kind.units(coeffs, window)
    conditions = protocol.for_controller(ctrl.info)
    assert conditions == ["Correct", "CrossInput", "TokenShuffle", "CrossShuffle", "TokenResamplePast",
                          "StaticDepth", ctrl.info.references[0]]
    moved = 0
    for name in conditions:
        for r in range(3 if protocol.REGISTRY[name].randomized else 1):
            out = protocol.REGISTRY[name].make(ctx, r, examples)
            assert [c.shape for c in out] == [c.shape for c in coeffs] and [c.dtype for c in out] == \
                [c.dtype for c in coeffs]
            assert np.array_equal(kind.units(out, window), budget), (name, r)
            assert torch.equal(ctrl.info.active(out), ctrl.info.active(coeffs)), (name, r)
            moved += sum(not torch.equal(a, b) for a, b in zip(out, coeffs))
            if kind is depth.EXIT_DEPTH:  # monotone: a token that exited after block l has exited after every later one
                assert all((a <= b).all() for a, b in zip(out, out[1:])), (name, r)
            if kind is depth.HALTING:  # a distribution over steps, its mass kept
                w = torch.cat(out, -1)
                assert (w >= 0).all() and torch.allclose(w.sum(-1), torch.ones(()), atol=1e-5), (name, r)
            if window:  # one decision per window, for all its tokens
                assert all((c == c[:, :1]).all() for c in out), (name, r)
    assert moved, "the conditions should change the decisions"


def test_a_tokens_whole_depth_moves_as_one_under_token_shuffle():
    model, ctrl = CASES["exit_depth"]
    coeffs = captured(model, ctrl, windows())
    ctx = Context(ctrl, coeffs, coeffs)
    shuffled = protocol.REGISTRY["TokenShuffle"].make(ctx, 0, np.arange(B))
    before, after = depth.EXIT_DEPTH.per(coeffs), depth.EXIT_DEPTH.per(shuffled)
    perm = protocol.token_permutations(np.arange(B), 0, 0, T, 1)[:, 0]
    assert torch.equal(after, before.gather(1, torch.from_numpy(perm)))


def test_the_budget_operations_are_exact_and_move_as_little_as_they_must():
    rng = np.random.default_rng(0)
    d = np.array([1, 3, 2, 3, 1])
    fitted = depth.fit_units(d, 7, 1, 3, rng)
    assert fitted.sum() == 7 and ((fitted >= 1) & (fitted <= 3)).all() and np.abs(fitted - d).sum() == 3
    assert np.array_equal(depth.profile_units(np.array([1.0, 2.0, 3.0]), 6, 1, 3), [1, 2, 3])  # its own budget
    assert np.array_equal(depth.profile_units(np.array([1.2, 1.9, 2.6]), 7, 1, 3), [2, 2, 3])
    assert np.array_equal(depth.profile_units(np.array([0.9, 0.1, 0.5, 0.5]), 2, 0, 1), [1, 0, 1, 0])  # ties: first
    w = np.array([0.5, 0.25, 0.25, 0.0])
    assert np.allclose(depth.set_depth(w, 2), [0.5, 0.5, 0, 0]) and np.allclose(depth.set_depth(w, 4), [.5, .25, 0, .25])
    with pytest.raises(FcauditError, match="does not fit"):
        depth.fit_units(d, 20, 1, 3, rng)


# ---- a planted toy: depth through position, or through content -------------------------------------------------

class Exit(nn.Module):
    """Exits a token after block `l` where 1 + (its key mod L) == l + 1: key = its position or its token."""

    def __init__(self, l: int, n: int, by: str):
        super().__init__()
        self.l, self.n, self.key = l, n, {"token": 0, "position": 1}[by]

    def forward(self, h):
        return 1 + h[..., self.key].long() % self.n == self.l + 1


class Planted(nn.Module):
    """Windows count up by one, so the next token is the current + 1. A token's prediction is sharp only where it
    ran exactly its own depth, 1 + (its position or token) mod L, which is where its exit module exits it: the loss
    depends on depth through position only, or through content only."""

    def __init__(self, by: str, n: int = 3, vocab: int = 256):
        super().__init__()
        self.n, self.vocab = n, vocab
        self.exits = nn.ModuleList(Exit(l, n, by) for l in range(n - 1))
        self.key = {"token": 0, "position": 1}[by]

    def forward(self, ids):
        Bn, Tn = ids.shape
        h = torch.stack([ids.float(), torch.arange(Tn).float().expand(Bn, Tn), torch.zeros(Bn, Tn)], -1)
        done = torch.zeros(Bn, Tn, dtype=torch.bool)
        for l in range(self.n):
            h = torch.where(done[..., None], h, h + torch.tensor([0.0, 0.0, 1.0]))  # a block: counts the blocks run
            if l < self.n - 1:
                done = done | self.exits[l](h)
        hit = (h[..., 2] == 1 + h[..., self.key].long() % self.n).float()
        return 4.0 * hit[..., None] * F.one_hot((ids + 1) % self.vocab, self.vocab).float()


def counting(part: int, n: int = 24, vocab: int = 256):
    """n windows counting up from distinct starts; part 0 and part 1 share none."""
    start = torch.randperm(vocab, generator=torch.Generator().manual_seed(0))[part * n:(part + 1) * n, None]
    return (start + torch.arange(T)) % vocab


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    out = {}
    for by in ("position", "token"):
        model = Planted(by)
        ctrl = fca.Controller.from_modules(model, "exits.*", kind="exit_depth")
        out[by] = fca.audit(model, ctrl, counting(0), counting(1), randomizations=3, seed=0,
                            out=tmp_path_factory.mktemp(by) / "a", quiet=True)
    return out


def test_where_depth_follows_position_static_depth_retains_the_gap_and_cross_input_costs_nothing(planted):
    result = planted["position"]
    pen = result.penalties()
    assert result.replay.passed and result.replay.bit_equal
    assert pen["CrossInput"].statistic == 0 and pen["StaticDepth"].statistic == 0  # the same depths, exactly
    assert pen["RandomExit"].confidence_interval.low > 0.5 and pen["TokenShuffle"].statistic > 0.5
    retention = result.retention()
    assert retention.condition == "StaticDepth" and retention.statistic == pytest.approx(1.0)
    assert result.verdicts()[0]["met"] is True  # StaticDepth practically small


def test_where_depth_follows_content_the_penalties_show_it(planted):
    pen = planted["token"].penalties()
    for name in ("CrossInput", "StaticDepth", "RandomExit", "TokenShuffle"):
        assert pen[name].confidence_interval.low > 0.5, name
    retention = planted["token"].retention()
    assert not retention.statistic > 0.5  # a static depth profile does not replace content-dependent exits


# ---- causality, and what does not go together ----------------------------------------------------------------

def test_the_causality_check_reads_depth_decisions(tmp_path):
    """The early-exit family's exits read each token's own state (causal attention): decodable. A block skipped per
    window from its mean state reads every token of it."""
    flips = {}
    for kind in ("exit_depth", "skip_window"):
        model, ctrl = CASES[kind]
        result = fca.audit(model, ctrl, windows(), windows(seed=1), randomizations=1, out=tmp_path / kind, quiet=True)
        flips[kind] = result.replay.later_token_flips
        assert result.replay.bit_equal and result.replay.route_flips == 0
    assert flips["exit_depth"] == 0 and flips["skip_window"] > 0


def test_a_depth_kind_is_its_controllers_only_kind_and_takes_its_own_codec():
    model, ctrl = CASES["skip_mask"]
    gates = fca.Controller.from_modules(model, "blocks.*", layout="batch token d", kind="vector_gate")
    with pytest.raises(FcauditError, match="cannot be audited together"):
        fca.Controller.merge(ctrl, gates)
    with pytest.raises(FcauditError, match="drop the layout"):
        fca.Controller.from_modules(model, "routers.*", layout="batch token", kind="skip_mask")
    with pytest.raises(FcauditError, match=r"Decisions\(window=True\)"):
        ids = windows()
        block = fca.Controller.from_modules(CASES["skip_window"][0], "routers.*", kind="skip_mask")
        with torch.inference_mode(), block.capture(*ids.shape):
            CASES["skip_window"][0](ids)


# ---- a third-party PonderNet, as written ----------------------------------------------------------------------

def test_a_third_party_pondernet_is_refused_for_its_sampled_halt_and_audited_when_seeded_per_pass(tmp_path):
    """ponder-transformer (PyPI) halts each sequence by sampling from its PonderNet distribution in eval mode. Its
    halting decisions are the `<=` of a uniform draw and the halting probability in its forward: one site per step
    but the last (the last step always ends it)."""
    from contextlib import contextmanager

    ponder_transformer = pytest.importorskip("ponder_transformer")  # the test extra installs it
    torch.manual_seed(0)
    ponder = ponder_transformer.PonderTransformer(num_tokens=64, dim=16, max_seq_len=T, dim_head=8, heads=2,
                                                  ponder_epsilon=0.55).eval()  # 2 steps: one halting decision
    net = nn.Sequential(ponder)  # a module path for the decisions made in its own forward

    def halts(context=None):
        return fca.Controller.from_ops(net, "0", "le", codec=Decisions(window=True), kind="exit_depth", call=0,
                                       context=context)

    with pytest.raises(FcauditError, match="not deterministic in eval mode"):
        fca.audit(net, halts(), windows(), windows(seed=1), randomizations=1, out=tmp_path / "a", quiet=True)

    @contextmanager
    def seeded():  # every pass draws the same uniforms: the sampled halt becomes a fixed threshold
        with torch.random.fork_rng():
            torch.manual_seed(0)
            yield

    result = fca.audit(net, halts(seeded), windows(), windows(seed=1), randomizations=1, out=tmp_path / "b",
                       quiet=True)
    assert result.replay.bit_equal and result.replay.later_token_flips > 0  # a sequence's halt reads all its tokens
    assert 0 < result.records.active.mean() < 1  # some sequences halt after the first step
    assert any("0 by construction" in f.line for f in result.replay.findings)
    assert (result.penalties().to_frame()["statistic"] == 0).all()
