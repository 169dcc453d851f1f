"""A kind is one object (fcaudit.kinds.Kind): a new kind written here, in one class, is registered and audits a model
with exact replay, its own validation, conditions, budget and active count, without touching fcaudit's source."""

import numpy as np
import pytest
import torch
from harness import api_refusal
from torch import nn

import fcaudit as fca
from fcaudit.errors import FcauditError
from fcaudit.kinds import KINDS, RANDOMIZED, Kind, register, unregister

V, D, T = 32, 16, 12


class OnOff(Kind):
    """A hard gate per (layer, token): 0 or 1, a block runs or not. Offers the randomized conditions only (a mean of
    0/1 is no decision), keeps each window's count of open gates under CrossInput, and refuses soft values."""

    name = "on_off"
    conditions = RANDOMIZED
    references = ("GlobalMean",)
    router = True

    def decisions(self, c):
        return c > 0.5

    def check(self, site, c, window):
        if not ((c == 0) | (c == 1)).all():
            raise FcauditError(f"site {site!r}: on_off gates are 0 or 1; declare soft gates as kind='scalar_gate'")

    def budget(self, info, coeffs):
        return sum(c.reshape(c.shape[0], -1).sum(1).long() for c in coeffs).cpu().numpy()

    def keep(self, ctx, coeffs, r, examples, tag):
        """A donor's gates with as many open as the window's own: the first that differ are flipped."""
        want = self.budget(ctx.info, ctx.take(examples))
        flat = torch.cat([c.reshape(c.shape[0], -1) for c in coeffs], 1).clone()
        for b, n in enumerate(want):
            diff = int(flat[b].sum()) - int(n)
            where = torch.nonzero(flat[b] == (1 if diff > 0 else 0)).flatten()[:abs(diff)]
            flat[b, where] = 0 if diff > 0 else 1
        return [p.reshape(c.shape) for p, c in zip(flat.split([c[0].numel() for c in coeffs], 1), coeffs)]


class HardGated(nn.Module):
    """Blocks a threshold decides to run per token."""

    def __init__(self, soft=False):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.head = nn.Embedding(V, D), nn.Linear(D, V)
        self.blocks = nn.ModuleList(nn.Linear(D, D) for _ in range(2))
        self.gates = nn.ModuleList(Threshold(soft) for _ in range(2))

    def forward(self, ids):
        h = self.emb(ids)
        for block, gate in zip(self.blocks, self.gates):
            h = h + gate(h)[..., None] * torch.tanh(block(h))
        return self.head(h)


class Threshold(nn.Module):
    def __init__(self, soft):
        super().__init__()
        self.score, self.soft = nn.Linear(D, 1), soft

    def forward(self, h):
        s = self.score(h)[..., 0]
        return torch.sigmoid(s) if self.soft else (s > 0).float()


def windows(n, seed):
    return torch.randint(0, V, (n, T), generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def on_off():
    kind = register(OnOff())
    yield kind
    unregister(kind.name)


def test_a_new_kind_in_one_class_is_registered_and_audits_a_model(on_off, tmp_path):
    model = HardGated().eval()
    ctrl = fca.Controller.from_modules(model, "gates.*", layout="batch token", kind="on_off")
    assert ctrl.info.lead is on_off and ctrl.info.routers == (0, 1) and ctrl.info.static == "StaticProfile"
    result = fca.audit(model, ctrl, windows(8, 0), windows(4, 1), randomizations=2, seed=0, out=tmp_path / "a",
                       batch_size=4, quiet=True)
    assert result.replay.bit_equal
    assert list(result.penalties()) == ["CrossInput", "TokenShuffle", "CrossShuffle", "TokenResamplePast"]
    records = result.records
    own = records[records.condition == "Correct"].set_index("example").active
    for condition in ("CrossInput", "TokenShuffle"):  # the kind's budget: open gates per window, kept
        moved = records[(records.condition == condition)].groupby("example").active.agg(["min", "max"])
        assert np.allclose(moved["min"], own.sort_index()) and np.allclose(moved["max"], own.sort_index())
    assert result.penalties()["TokenShuffle"].statistic != 0


def test_a_new_kind_validates_what_it_captures_and_leaves_with_its_registration(on_off, tmp_path):
    model = HardGated(soft=True).eval()
    ctrl = fca.Controller.from_modules(model, "gates.*", layout="batch token", kind="on_off")
    line = api_refusal(lambda: fca.audit(model, ctrl, windows(8, 0), windows(4, 1), randomizations=1,
                                         out=tmp_path / "a", quiet=True))
    assert "on_off gates are 0 or 1; declare soft gates as kind='scalar_gate'" in line
    unregister("on_off")
    assert "on_off" not in KINDS
    assert "unknown kind 'on_off'" in api_refusal(
        lambda: fca.Controller.from_modules(model, "gates.*", layout="batch token", kind="on_off"))
