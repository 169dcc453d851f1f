"""A user-defined condition: registered once (a transformation of the cached coefficients per kind), it runs after
the exact replay check like every built-in one, and shows in penalties(), the records and the report; one that
changes a kind's budget is refused."""

import numpy as np
import pytest
import torch
from harness import api_refusal
from torch import nn

import fcaudit as fca
from fcaudit import protocol
from fcaudit.protocol import Condition

V, D, T = 32, 16, 12


class Gated(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.head = nn.Embedding(V, D), nn.Linear(D, V)
        self.blocks = nn.ModuleList(nn.Linear(D, D) for _ in range(2))
        self.gates = nn.ModuleList(nn.Linear(D, 1) for _ in range(2))

    def forward(self, ids):
        h = self.emb(ids)
        for block, gate in zip(self.blocks, self.gates):
            h = h + torch.sigmoid(gate(h)) * torch.tanh(block(h))
        return self.head(h)


def windows(n, seed):
    return torch.randint(0, V, (n, T), generator=torch.Generator().manual_seed(seed))


def reverse(ctx, r, examples):
    """Every window's gates in reverse token order: position t takes position T - 1 - t's gate."""
    return [c.flip(1) for c in ctx.take(examples)]


@pytest.fixture
def reversed_gates():
    condition = protocol.register(Condition("TokenReverse", "static", "Token-reverse", moves={"scalar_gate": reverse}))
    yield condition
    protocol.unregister(condition.name)


def test_a_registered_condition_is_audited_recorded_and_reported(reversed_gates, tmp_path):
    model = Gated().eval()
    ctrl = fca.Controller.from_modules(model, "gates.*", layout="batch token 1")
    result = fca.audit(model, ctrl, windows(8, 0), windows(4, 1), randomizations=2, seed=0, out=tmp_path / "a",
                       batch_size=4, quiet=True)
    assert result.replay.bit_equal
    pen = result.penalties()
    assert "TokenReverse" in pen and pen["TokenReverse"].statistic != 0
    records = result.records[result.records.condition == "TokenReverse"]
    assert sorted(records.example) == list(range(8)) and (records.randomization == 0).all()
    # its replay is what the transformation says: the reversed gates of every window, through the model
    ids = windows(8, 0)
    with torch.no_grad(), ctrl.capture(*ids.shape) as found:
        model(ids)
    with torch.no_grad(), ctrl.replay([c.flip(1) for c in found], found.decoding):
        logits = model(ids)
    nll = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, V), ids[:, 1:].reshape(-1),
                                            reduction="none").reshape(8, -1).mean(1).double()
    assert np.allclose(records.sort_values("example").nll.to_numpy(), nll.numpy(), atol=1e-6)
    fca.build_report([tmp_path / "a"], tmp_path / "report")
    assert "| Token-reverse | " in (tmp_path / "report" / "report.md").read_text()  # its row in the penalties table
    protocol.unregister("TokenReverse")  # a reader that does not know it says so, in one line
    assert "which is not registered here: register it" in api_refusal(
        lambda: fca.build_report([tmp_path / "a"], tmp_path / "report2"))


def test_a_condition_is_offered_only_for_the_kinds_it_moves_and_may_not_change_a_budget(tmp_path):
    model = Gated().eval()
    gates = fca.Controller.from_modules(model, "gates.*", layout="batch token 1")
    drop = Condition("DropOne", "static", "Drop one", moves={"exit_depth": lambda ctx, r, ex: ctx.take(ex)})
    protocol.register(drop)
    try:
        assert "DropOne" not in protocol.for_controller(gates.info)
    finally:
        protocol.unregister("DropOne")
    assert "built-in condition" in api_refusal(lambda: protocol.register(
        Condition("CrossInput", "randomized", "x", moves={"scalar_gate": reverse})))
    assert "give its moves" in api_refusal(lambda: protocol.register(Condition("Nothing", "static", "n")))


class Routed(nn.Module):
    """Mixture-of-Depths: per block a router scores the tokens and the block runs on the top 4 only."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.head = nn.Embedding(V, D), nn.Linear(D, V)
        self.blocks = nn.ModuleList(nn.Linear(D, D) for _ in range(2))
        self.routers = nn.ModuleList(Router() for _ in range(2))

    def forward(self, ids):
        h = self.emb(ids)
        for block, router in zip(self.blocks, self.routers):
            scores, index = router(h)
            chosen = torch.zeros(ids.shape).scatter(1, index, 1.0)
            h = h + (chosen * torch.sigmoid(scores))[..., None] * torch.tanh(block(h))
        return self.head(h)


class Router(nn.Module):
    def __init__(self):
        super().__init__()
        self.score = nn.Linear(D, 1)

    def forward(self, h):
        scores = self.score(h)[..., 0]
        return scores, scores.topk(4, dim=1).indices.sort(1).values


def every_token(ctx, r, examples):
    """Every token chosen, scores kept: more tokens than the router's budget."""
    out = []
    for c in ctx.take(examples):
        c = c.clone()
        c[:, :, 0, 1] = 1.0
        out.append(c)
    return out


def test_a_registered_condition_that_changes_a_token_routers_budget_is_refused(tmp_path):
    model = Routed().eval()
    ctrl = fca.Controller.from_modules(model, "routers.*", kind="token_router")
    protocol.register(Condition("EveryToken", "static", "Every token", moves={"token_router": every_token}))
    try:
        line = api_refusal(lambda: fca.audit(model, ctrl, windows(8, 0), windows(4, 1), randomizations=1,
                                             out=tmp_path / "a", batch_size=4, quiet=True))
    finally:
        protocol.unregister("EveryToken")
    assert "condition EveryToken changed window 0's token_router budget from 8 to 24" in line
