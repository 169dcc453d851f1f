"""Models that misbehave quietly (issue 48): a controller coupled across the windows of a batch, a model whose state
changes during the audit, duplicated or near-duplicated windows. Each model is written here as a researcher would
write it, audited for real, and refused (or flagged) in one line."""

import numpy as np
import pytest
import torch
from torch import nn

import fcaudit as fca
from fcaudit.controllers.checks import BATCH_CHECK_PASSES, SITE_CHECK_PASSES
from harness import api_refusal

V, T = 256, 32


def ids(n, seed):
    return torch.randint(0, V, (n, T), generator=torch.Generator().manual_seed(seed))


class GatedLM(nn.Module):
    """The README's two-layer gated LM."""

    def __init__(self, d=16):
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.head = nn.Embedding(V, d), nn.Linear(d, V)
        self.mlps = nn.ModuleList(nn.Linear(d, d) for _ in range(2))
        self.gates = nn.ModuleList(nn.Sequential(nn.Linear(d, 1), nn.Sigmoid(), nn.Flatten(-2)) for _ in range(2))

    def forward(self, x):
        h = self.embed(x)
        for mlp, gate in zip(self.mlps, self.gates):
            h = h + gate(h).unsqueeze(-1) * mlp(h)
        return self.head(h)


# ---- a controller over the flattened batch -------------------------------------------------------------------------

class TopHalf(nn.Module):
    """Keeps the top half of all batch x token scores (a capacity over the flattened batch), as a soft gate."""

    def __init__(self, d):
        super().__init__()
        self.score = nn.Linear(d, 1)

    def forward(self, h):
        s = self.score(h).squeeze(-1)  # [batch, token]
        cut = s.flatten().kthvalue(s.numel() // 2).values
        return torch.sigmoid(s) * (s > cut)


class BatchCapacityLM(GatedLM):
    def __init__(self, d=16):
        super().__init__(d)
        self.gates = nn.ModuleList(TopHalf(d) for _ in range(2))


def test_capacity_over_the_flattened_batch_is_refused(tmp_path):
    model = BatchCapacityLM().eval()
    ctrl = fca.Controller.from_modules(model, "gates.*", layout="batch token")
    line = api_refusal(lambda: fca.audit(model, ctrl, ids(8, 0), ids(4, 1), randomizations=1, batch_size=4,
                                         out=tmp_path / "a", quiet=True))
    assert "site 'gates.0'" in line and "other windows of its batch" in line and "batch_size=1" in line
    assert not (tmp_path / "a" / "records").exists()


def test_the_same_model_with_a_capacity_per_window_passes(tmp_path):
    """The cut taken per window (a well-behaved router) passes: the check compares bit-equal rows."""

    class PerWindow(TopHalf):
        def forward(self, h):
            s = self.score(h).squeeze(-1)
            cut = s.kthvalue(s.shape[1] // 2, dim=1, keepdim=True).values
            return torch.sigmoid(s) * (s > cut)

    model = BatchCapacityLM().eval()
    model.gates = nn.ModuleList(PerWindow(16) for _ in range(2))
    ctrl = fca.Controller.from_modules(model, "gates.*", layout="batch token")
    result = fca.audit(model, ctrl, ids(8, 0), ids(4, 1), randomizations=1, batch_size=4, out=tmp_path / "a",
                       quiet=True)
    assert result.replay.passed and result.replay.finding("batch") is None


def test_well_behaved_gated_lm_passes_the_batch_check(tmp_path):
    model = GatedLM().eval()
    ctrl = fca.Controller.from_modules(model, "gates.*", layout="batch token")
    result = fca.audit(model, ctrl, ids(8, 0), ids(4, 1), randomizations=1, batch_size=8, out=tmp_path / "a",
                       quiet=True)
    assert result.replay.passed and not result.notices


# ---- state that changes during the audit ----------------------------------------------------------------------------

class FlipsAfter40(GatedLM):
    """A counter in a Python attribute: after 40 forward calls the model switches its second gate off."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        h = self.embed(x)
        for i, (mlp, gate) in enumerate(zip(self.mlps, self.gates)):
            g = gate(h) * (0.0 if (i == 1 and self.calls > 40) else 1.0)
            h = h + g.unsqueeze(-1) * mlp(h)
        return self.head(h)


class FlipsAfter40Buffer(GatedLM):
    """The same switch, held in a buffer the model updates."""

    def __init__(self):
        super().__init__()
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        self.calls += 1
        return super().forward(x) * (0.5 if self.calls > 40 else 1.0)


class FakeQuant(nn.Module):
    """A max-abs fake-quant observer left on in eval: the scale follows the largest value seen so far."""

    def __init__(self):
        super().__init__()
        self.register_buffer("max_abs", torch.tensor(1e-3))

    def forward(self, h):
        self.max_abs.copy_(torch.maximum(self.max_abs, h.detach().abs().max()))
        scale = self.max_abs / 127
        return torch.round(h / scale) * scale


class ObservedLM(GatedLM):
    def __init__(self):
        super().__init__()
        self.quant = FakeQuant()

    def forward(self, x):
        h = self.embed(x)
        for mlp, gate in zip(self.mlps, self.gates):
            h = h + gate(h).unsqueeze(-1) * mlp(h)
        return self.head(self.quant(h))


def audit_of(model, out, **kw):
    ctrl = fca.Controller.from_modules(model, "gates.*", layout="batch token")
    return fca.audit(model, ctrl, ids(8, 0), ids(4, 1), randomizations=kw.pop("randomizations", 3), batch_size=4,
                     out=out, quiet=True, **kw)


def nothing_kept(out):
    return not any(p.suffix in (".parquet", ".safetensors") for p in out.rglob("*")) and not (out / "replay.json").exists()


def test_a_flag_in_a_python_attribute_is_caught_by_the_repeated_correct_pass(tmp_path):
    model = FlipsAfter40().eval()
    line = api_refusal(lambda: audit_of(model, tmp_path / "a", randomizations=6))
    assert model.calls > 40  # it flipped during the audit
    assert "Correct pass, repeated at the end" in line and "max |ΔNLL| =" in line and "no rerun helps" in line
    assert nothing_kept(tmp_path / "a")
    with pytest.raises(fca.FcauditError):  # the directory holds nothing valid: a rerun recomputes, and is refused
        fca.AuditResult.load(tmp_path / "a")


def test_a_flag_in_a_buffer_is_named(tmp_path):
    line = api_refusal(lambda: audit_of(FlipsAfter40Buffer().eval(), tmp_path / "a", randomizations=6))
    assert "the model's buffer 'calls' changed during the audit (after stage 1)" in line and "no rerun" in line
    assert nothing_kept(tmp_path / "a")


def test_a_fake_quant_observer_left_on_is_named(tmp_path):
    line = api_refusal(lambda: audit_of(ObservedLM().eval(), tmp_path / "a"))
    assert "buffer 'quant.max_abs' changed during the audit" in line, line


def test_a_state_change_after_a_finished_audit_removes_it(tmp_path):
    """A resumed audit whose model now changes itself keeps nothing: its earlier records are not valid either."""
    out = tmp_path / "a"
    model = FlipsAfter40().eval()
    audit_of(model, out, randomizations=1)  # fewer than 40 calls: it does not flip
    assert (out / "replay.json").exists() and model.calls < 40
    model.calls = 40 - (1 + SITE_CHECK_PASSES + BATCH_CHECK_PASSES)  # flips after the probe and the checks
    line = api_refusal(lambda: audit_of(model, out, randomizations=1))
    assert "repeated at the end" in line and nothing_kept(out)
