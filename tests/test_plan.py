"""The dry-run plan: sizes, forward passes, conditions, and where the store is held."""

import pytest
import torch
from torch import nn

import fcaudit as fca
from fcaudit import plan
from fcaudit.auditor.state import STATE_CHECK_PASSES
from fcaudit.controllers import Controller
from fcaudit.controllers.checks import BATCH_CHECK_PASSES, FLOW_CHECK_PASSES, SITE_CHECK_PASSES, routing_check_passes
from conftest import T, V, ToyGated, ToyMoE, tiny_early_exit, windows


def test_plan_reports_sizes():
    model = ToyMoE()
    ctrl = Controller.from_modules(model, "layers.*.router", "(batch token) expert")
    p = plan(model, ctrl, windows(32, 0), windows(8, 1), batch_size=8, randomizations=20)
    assert p.layer_shapes == [[T, 1, 4], [T, 1, 4]]
    assert p.store_bytes == 32 * 2 * T * 4 * 4
    # the units, then the checks: three passes, the Flow pass that follows the soft mixtures (none ranked), the
    # batch-composition check's two and the state check's repeated Correct pass
    assert p.check_passes == SITE_CHECK_PASSES + FLOW_CHECK_PASSES + BATCH_CHECK_PASSES + STATE_CHECK_PASSES
    assert p.forward_passes == 1 + 4 * (2 + 80 + 3) + p.check_passes
    assert p.conditions == ["Correct", "CrossInput", "TokenShuffle", "CrossShuffle", "TokenResamplePast",
                            "LayerPositionMean", "StaticProfile", "StructureRemoved"]  # a source mixture's
    assert p.activation_bytes > 0
    assert p.peak_memory_bytes > sum(x.numel() * 4 for x in model.parameters())
    assert p.store_device is None and "hold the store" not in str(p)  # the CPU reads the store from its files


def test_plan_names_the_device_that_holds_the_store(monkeypatch):
    """Where a GPU has room for the store (`keeps_store_on`, the engine's rule), the plan says it is held there; the
    rule's answer on a GPU stands in here, in the module that plans."""
    import sys

    asked = []
    monkeypatch.setattr(sys.modules[plan.__module__], "keeps_store_on",
                        lambda device, nbytes: asked.append(nbytes) or True)
    model = ToyMoE()
    p = plan(model, Controller.from_modules(model, "layers.*.router", "(batch token) expert"), windows(32, 0))
    assert asked == [p.store_bytes] and p.store_device == "cpu"
    assert str(p).endswith("per window); the replays also hold the store on cpu")


class RankedGate(nn.Module):
    """A block whose gate scores also pick the two tokens a second update reaches: the model ranks the gate."""

    def __init__(self, d=16):
        super().__init__()
        self.gate = nn.Linear(d, 1)
        self.up = nn.Linear(d, d)

    def forward(self, h):
        g = torch.sigmoid(self.gate(h)).squeeze(-1)
        picked = torch.zeros_like(g).scatter(1, g.topk(2, dim=1).indices, 1.0)
        return h + (g + picked).unsqueeze(-1) * self.up(h)


class RankedLM(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(2)
        self.emb = nn.Embedding(V, 16)
        self.blocks = nn.ModuleList(RankedGate() for _ in range(2))
        self.head = nn.Linear(16, V)

    def forward(self, ids):
        h = self.emb(ids)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


@pytest.mark.parametrize("case", ["gated", "ranked", "router"])
def test_the_plan_counts_every_forward_pass_the_audit_runs_the_checks_included(case, tmp_path):
    """The Flow pass follows soft coefficients (a gate); the causality check runs for routers (an exit depth) and
    for gates the model ranks: the plan finds which from one window, and counts exactly what the audit runs."""
    if case == "router":
        model = tiny_early_exit()
        ctrl, ev, ca = fca.controller_for(model), windows(6, 0), windows(2, 1)
    else:
        model = ToyGated() if case == "gated" else RankedLM().eval()
        layout = "batch token" if case == "gated" else "batch token 1"
        ctrl = Controller.from_modules(model, "blocks.*.gate", layout=layout)
        ev, ca = windows(6, 0), windows(2, 1)
    p = plan(model, ctrl, ev, ca, batch_size=3, randomizations=1)
    flow = FLOW_CHECK_PASSES if case != "router" else 0
    batch_and_state = BATCH_CHECK_PASSES + STATE_CHECK_PASSES  # a first batch of 3 windows
    assert p.check_passes == (SITE_CHECK_PASSES + flow + (routing_check_passes(6, 3) if case != "gated" else 0)
                              + batch_and_state)
    passes = []
    model.register_forward_pre_hook(lambda *a: passes.append(1))
    result = fca.audit(model, ctrl, ev, ca, batch_size=3, randomizations=1, out=tmp_path / "a", quiet=True)
    assert result.replay.passed and len(passes) == p.forward_passes
    assert ("ranked" in [f.check for f in result.replay.findings]) == (case == "ranked")
