"""Capacity budgets observed: with `runs=` naming each capacity router's experts, the audit counts the rows each expert
computed on the first batch of every condition and refuses experts that ran other tokens than the slots the replayed
dispatch fills; experts that gather their slots pass, and so do experts that compute every slot of a fixed-shape
dispatch (empty ones too: rows cannot show the slots filled there)."""

import torch
import torch.nn.functional as F
from harness import api_refusal
from torch import nn

import fcaudit as fca
from fcaudit.controllers.routing import CapacityRoute

N_VOCAB, N_EMBD, N_EXP, CAP, N_CTX = 40, 10, 4, 3, 12


class Switch(nn.Module):
    """Top-2 gating, slots per expert in sequence order, the assignments past CAP dropped."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(N_EMBD, N_EXP, bias=False)

    def forward(self, x):
        p = self.gate(x).softmax(-1)
        top = torch.zeros_like(p).scatter(-1, p.topk(2, -1).indices, 1.0)
        pos = top.cumsum(1) - 1
        keep = top * (pos < CAP)
        w = p * keep / (p * keep).sum(-1, keepdim=True).clamp_min(1e-9)
        slot = F.one_hot(pos.clamp(0, CAP - 1).long(), CAP) * keep[..., None]
        return slot.bool(), w[..., None] * slot


class MoE(nn.Module):
    """how: "gather" (each expert runs the tokens in its slots), "pad" (each expert runs all CAP slots of every
    window, empty ones as zeros) or "own" (each expert runs the tokens of its own top-2 on the live gate: the
    capacity is not applied)."""

    def __init__(self, how):
        super().__init__()
        self.router, self.how = Switch(), how
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(N_EMBD, 16), nn.ReLU(), nn.Linear(16, N_EMBD))
                                     for _ in range(N_EXP))

    def forward(self, x):
        dispatch, combine = self.router(x)
        if self.how == "pad":
            slots = torch.einsum("btec,btd->becd", dispatch.float(), x)
            done = torch.stack([f(slots[:, e]) for e, f in enumerate(self.experts)], 1)
            return torch.einsum("btec,becd->btd", combine, done)
        weight = combine.sum(-1)  # [b, t, e]
        if self.how == "own":
            mine = torch.zeros_like(weight).scatter(-1, self.router.gate(x).topk(2, -1).indices, 1.0).bool()
        else:
            mine = dispatch.any(-1)
        y = torch.zeros_like(x)
        for e, f in enumerate(self.experts):
            rows = mine[:, :, e]
            y[rows] = y[rows] + weight[:, :, e][rows][:, None] * f(x[rows])
        return y


class Net(nn.Module):
    def __init__(self, how="gather"):
        super().__init__()
        torch.manual_seed(11)
        self.wte, self.lm = nn.Embedding(N_VOCAB, N_EMBD), nn.Linear(N_EMBD, N_VOCAB)
        self.moes = nn.ModuleList(MoE(how) for _ in range(2))

    def forward(self, idx):
        x = self.wte(idx)
        for moe in self.moes:
            x = x + x.cumsum(1) / torch.arange(1, idx.shape[1] + 1)[None, :, None]
            x = x + moe(x)
        return self.lm(x)


def windows(n, seed):
    return torch.randint(0, N_VOCAB, (n, N_CTX), generator=torch.Generator().manual_seed(seed))


def audit(model, tmp_path, runs="moes.*.experts.*"):
    ctrl = fca.Controller.from_modules(model, "moes.*.router", codec=CapacityRoute(N_EXP, CAP), runs=runs)
    return fca.audit(model, ctrl, windows(8, 0), windows(8, 1), randomizations=2, out=tmp_path / "a", batch_size=4,
                     quiet=True)


def test_experts_that_gather_their_slots_pass(tmp_path):
    result = audit(Net("gather").eval(), tmp_path)
    assert result.replay.bit_equal and "StaticTopK" in result.penalties()


def test_experts_that_compute_every_slot_pass(tmp_path):
    assert audit(Net("pad").eval(), tmp_path).replay.bit_equal


def test_experts_that_ignore_the_capacity_are_refused_with_the_counts(tmp_path):
    line = api_refusal(lambda: audit(Net("own").eval(), tmp_path))
    assert "site 'moes.0.router': under Correct its expert 'moes.0.experts." in line
    assert "slots the replayed decisions fill (of 12)" in line and "the experts run other tokens" in line


def test_runs_must_match_every_expert_of_every_router(tmp_path):
    line = api_refusal(lambda: audit(Net().eval(), tmp_path, runs="moes.0.experts.*"))
    assert "matches 4 modules for the 8 experts of 2 capacity routers" in line
