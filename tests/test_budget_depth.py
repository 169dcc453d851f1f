"""Depth budgets observed: with `runs=` naming the blocks a depth controller's decisions run, the audit counts the
rows each block computed on the first batch of every condition and refuses a block that computed other (block, token)
pairs than the replayed decisions run in it. Written as a researcher writes an early-exit, halting or skipping net:
the stages gather the tokens still running (`h[alive]`), or mask them (`torch.where`)."""

import pytest
import torch
from harness import api_refusal
from torch import nn

import fcaudit as fca
from fcaudit.controllers import Decisions

VOCAB, WIDTH, LEN = 24, 12, 12


def prefix_mean(h):
    return h + h.cumsum(1) / torch.arange(1, h.shape[1] + 1)[None, :, None]


def stage():
    return nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.Tanh(), nn.Linear(2 * WIDTH, WIDTH))


class Leave(nn.Module):
    """An exit rule: True where the token stops after this stage."""

    def __init__(self):
        super().__init__()
        self.w = nn.Linear(WIDTH, 1)

    def forward(self, h):
        return self.w(h)[..., 0] > 0


class ExitNet(nn.Module):
    """`n` stages; exit rules after stages first .. n-2 (the first ones always run); `how`: "gather" runs a stage
    on the tokens still in (h[alive]), "mask" on every token and keeps the exited ones' states, "live" gathers by the
    exit rules' own weights (not the decisions it is given)."""

    def __init__(self, n=4, first=0, how="gather"):
        super().__init__()
        torch.manual_seed(3)
        self.embed, self.unembed = nn.Embedding(VOCAB, WIDTH), nn.Linear(WIDTH, VOCAB)
        self.stages = nn.ModuleList(stage() for _ in range(n))
        self.leaves = nn.ModuleList(Leave() for _ in range(n - 1 - first))
        self.first, self.how = first, how

    def forward(self, ids):
        h = self.embed(ids)
        out = torch.zeros(h.shape[:2], dtype=torch.bool)
        live = out.clone()
        for i, f in enumerate(self.stages):
            h = prefix_mean(h)
            alive = ~(live if self.how == "live" else out)
            if self.how == "mask":
                h = torch.where(alive[..., None], h + f(h), h)
            else:
                h = h.clone()
                h[alive] = h[alive] + f(h[alive])
            j = i - self.first
            if 0 <= j < len(self.leaves):
                out = out | self.leaves[j](h)
                live = live | (self.leaves[j].w(h)[..., 0] > 0)
        return self.unembed(h)


def windows(n, seed):
    return torch.randint(0, VOCAB, (n, LEN), generator=torch.Generator().manual_seed(seed))


def audit(model, ctrl, tmp_path):
    return fca.audit(model, ctrl, windows(8, 0), windows(8, 1), randomizations=2, out=tmp_path / "a", batch_size=4,
                     quiet=True)


def exits(model, runs="stages.*", **codec):
    return fca.Controller.from_modules(model, "leaves.*", kind="exit_depth", runs=runs,
                                       codec=Decisions(**codec) if codec else None)


def test_an_exit_net_whose_stages_gather_the_running_tokens_passes(tmp_path):
    model = ExitNet().eval()
    result = audit(model, exits(model), tmp_path)
    assert result.replay.bit_equal and "RandomExit" in result.penalties()


def test_an_exit_net_that_masks_is_refused_with_runs_and_audited_without(tmp_path):
    model = ExitNet(how="mask").eval()
    line = api_refusal(lambda: audit(model, exits(model), tmp_path))
    assert "block 'stages.1': under Correct it computed 48 rows on the first batch" in line
    assert "a model that masks rather than gathers shows every row: drop runs=" in line
    assert audit(model, exits(model, runs=None), tmp_path).replay.bit_equal  # a decision-level budget


def test_an_exit_net_that_runs_its_live_exit_rule_is_refused_under_a_moved_condition(tmp_path):
    model = ExitNet(how="live").eval()
    line = api_refusal(lambda: audit(model, exits(model), tmp_path))
    assert "under Correct" not in line and "the replayed exit_depth decisions run in it" in line


def test_exits_that_start_after_the_first_stage_must_say_so(tmp_path):
    model = ExitNet(first=1).eval()
    line = api_refusal(lambda: audit(model, exits(model), tmp_path))
    assert "runs= names 4 blocks ('stages.0'...) for the 3 that the decisions of 2 exit_depth sites run" in line
    assert "declare Decisions(always=1)" in line
    assert audit(model, exits(model, always=1), tmp_path).replay.bit_equal


class Skip(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Linear(WIDTH, 1)

    def forward(self, h):
        return self.w(h)[..., 0] > 0.1  # True: the stage runs for the token


class SkipNet(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(5)
        self.embed, self.unembed = nn.Embedding(VOCAB, WIDTH), nn.Linear(WIDTH, VOCAB)
        self.stages = nn.ModuleList(stage() for _ in range(3))
        self.skips = nn.ModuleList(Skip() for _ in range(3))

    def forward(self, ids):
        h = self.embed(ids)
        for f, s in zip(self.stages, self.skips):
            h = prefix_mean(h)
            run = s(h)
            h = h.clone()
            h[run] = h[run] + f(h[run])
        return self.unembed(h)


def test_a_skip_net_that_gathers_passes(tmp_path):
    model = SkipNet().eval()
    ctrl = fca.Controller.from_modules(model, "skips.*", kind="skip_mask", runs="stages.*")
    assert audit(model, ctrl, tmp_path).replay.bit_equal


class Ponder(nn.Module):
    """Halting weights over STEPS steps: a softmax, cut where its running sum first reaches 0.6 (the remainder at that
    step, zeros after); `uncut`: the softmax itself (nonzero at every step, whatever the net runs)."""

    def __init__(self, uncut=False):
        super().__init__()
        self.w, self.uncut = nn.Linear(WIDTH, STEPS), uncut

    def forward(self, h):
        q = self.w(h).softmax(-1)
        if self.uncut:
            return q
        stop = (q.cumsum(-1) < 0.6).sum(-1, keepdim=True)  # the first step reaching 0.6
        k = torch.arange(STEPS)
        before = torch.where(k < stop, q, 0.0)
        return torch.where(k == stop, 1 - before.sum(-1, keepdim=True), before)


STEPS = 4


class PonderNet(nn.Module):
    """A step module applied STEPS times (`shared`), or one per step; a token runs the steps up to its last nonzero
    weight (`by_sum`: until its weights' running sum reaches 0.6), and the output mixes the step states by the
    weights. `batch_wide`: every token runs until the batch's deepest token halts."""

    def __init__(self, batch_wide=False, shared=True, uncut=False, by_sum=False):
        super().__init__()
        torch.manual_seed(7)
        self.embed, self.unembed = nn.Embedding(VOCAB, WIDTH), nn.Linear(WIDTH, VOCAB)
        self.ponder = Ponder(uncut)
        if shared:
            self.step = stage()
        else:
            self.steps = nn.ModuleList(stage() for _ in range(STEPS))
        self.batch_wide, self.shared, self.by_sum = batch_wide, shared, by_sum

    def forward(self, ids):
        h = prefix_mean(self.embed(ids))
        w = self.ponder(h)
        depth = (w.cumsum(-1) < 0.6).sum(-1) + 1 if self.by_sum else STEPS - (w != 0).flip(-1).long().argmax(-1)
        mixed = torch.zeros_like(h)
        for s in range(STEPS):
            go = depth > s
            if self.batch_wide:
                go = go | bool(go.any())
            f = self.step if self.shared else self.steps[s]
            h = h.clone()
            h[go] = h[go] + f(h[go])
            mixed = mixed + w[..., s, None] * h
        return self.unembed(mixed)


def ponder(model, runs="step"):
    return fca.Controller.from_modules(model, "ponder", layout="batch token step", kind="halting", runs=runs)


def test_a_halting_net_with_one_shared_step_passes(tmp_path):
    model = PonderNet().eval()
    assert audit(model, ponder(model), tmp_path).replay.bit_equal


def test_a_halting_net_that_runs_every_token_until_the_last_halts_is_refused(tmp_path):
    model = PonderNet(batch_wide=True).eval()
    line = api_refusal(lambda: audit(model, ponder(model), tmp_path))
    assert "block 'step': under Correct it computed" in line and "halting decisions run in it" in line


def test_a_halting_net_that_stops_by_the_running_sum_is_refused_once_a_condition_moves_its_weights(tmp_path):
    model = PonderNet(by_sum=True).eval()  # the same depths as its last nonzero weight, until weights move
    line = api_refusal(lambda: audit(model, ponder(model), tmp_path))
    assert "block 'step': under StaticDepth it computed 87 rows on the first batch for the 111" in line
    assert "the model re-derives its depths" in line


def test_halting_weights_that_run_fewer_steps_than_they_say_are_refused_or_noted(tmp_path):
    model = PonderNet(uncut=True, by_sum=True).eval()  # every step has weight: the budget says every step runs
    line = api_refusal(lambda: audit(model, ponder(model), tmp_path))
    assert "under Correct it computed" in line and "the model re-derives its depths" in line
    model = PonderNet(uncut=True, by_sum=True, shared=False).eval()
    notes = audit(model, ponder(model, runs=None), tmp_path).replay.notices
    assert any("note: block steps.1 computed" in n and "the model runs less than its decisions say" in n
               for n in notes), notes


def test_without_runs_late_exits_and_gathered_blocks_are_noted(tmp_path):
    model = ExitNet(first=1).eval()
    notes = audit(model, exits(model, runs=None), tmp_path / "late").replay.notices
    assert any("the model's 4 blocks ('stages.*') are more than the 3 its exit_depth decisions run" in n
               and "pass codec=Decisions(always=1)" in n for n in notes), notes
    model = ExitNet().eval()
    notes = audit(model, exits(model, runs=None), tmp_path / "gathered").replay.notices
    assert any("pass runs='stages.*'" in n for n in notes), notes
    model = ExitNet(how="mask").eval()
    notes = audit(model, exits(model, runs=None), tmp_path / "masked").replay.notices
    assert not any("stages" in n for n in notes), notes


@pytest.mark.parametrize("runs, why", [("nothing.*", "matches no module of ExitNet")])
def test_runs_for_depth_must_match_blocks(runs, why):
    assert why in api_refusal(lambda: exits(ExitNet(), runs=runs))


def test_runs_refuses_the_blocks_of_a_fused_transformer_layer():
    class Encoder(nn.Module):  # nn.TransformerEncoderLayer takes a fused fast path that a hook turns off
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.TransformerEncoderLayer(WIDTH, 2, 24, batch_first=True) for _ in range(2))
            self.leaves = nn.ModuleList([Leave()])

    line = api_refusal(lambda: fca.Controller.from_modules(Encoder(), "leaves.*", kind="exit_depth", runs="layers.*"))
    assert "names 'layers.0', a part of nn.TransformerEncoderLayer 'layers.0'" in line and "drop runs=" in line
