"""Capture and exact replay: the controller frozen and restored, the exact replay check, and the site check's notice
for a model that does not read what its sites return."""

import pytest
import torch

from fcaudit.errors import FcauditError
from conftest import Block, Gate, Leaky, T, ToyGated, gated, run, windows


def test_replay_disables_controller_and_restores_model():
    model = ToyGated().eval()
    ctrl = gated(model)
    ids = windows(2, 0)
    with torch.no_grad(), ctrl.capture(2, T) as found:
        ref = model(ids)
    calls = [b.gate.calls for b in model.blocks]
    with torch.no_grad(), ctrl.replay(found):
        out = model(ids)
    assert torch.equal(out, ref)
    assert [b.gate.calls for b in model.blocks] == calls  # the controller did not run
    assert all("forward" not in b.gate.__dict__ for b in model.blocks)
    with pytest.raises(RuntimeError, match="boom"), ctrl.replay([torch.zeros_like(c) for c in found], found.decoding):
        raise RuntimeError("boom")
    assert all("forward" not in b.gate.__dict__ for b in model.blocks)
    with torch.no_grad():
        assert torch.equal(model(ids), ref)
        model.blocks[0].gate.calls = 0
        model(ids)
        assert model.blocks[0].gate.calls == 1


def test_failed_exact_replay_stops_audit(tmp_path):
    model = Leaky()
    with pytest.raises(FcauditError, match=r"exact replay failed.*max \|Δlogit\|"):
        run(model, gated(model), tmp_path / "leak")
    import json
    report = json.loads((tmp_path / "leak" / "replay.json").read_text())
    assert report["passed"] is False and report["max_abs_dlogit"] > 0
    assert not list((tmp_path / "leak").rglob("*.parquet")) and not list((tmp_path / "leak").rglob("*.safetensors"))
    res = run(model, gated(model), tmp_path / "leak", tolerance=1e-2)  # same directory: nothing there to mix
    assert res.replay.tolerance == 1e-2 and res.replay.passed and not res.replay.bit_equal
    assert "replay passed=True" in repr(res)


class KeptGate(Gate):
    """A gate whose block reads the value it kept, not the one it returns: a replay changes nothing."""

    def forward(self, h):
        self.kept = super().forward(h)
        return self.kept


class KeptBlock(Block):
    def forward(self, h):
        mix = h.cumsum(1) / torch.arange(1, h.shape[1] + 1, device=h.device)[:, None]
        self.gate(h)
        return h + self.gate.kept[..., None] * self.mlp(torch.cat([self.ln(h), mix], -1))


def test_a_model_that_does_not_read_what_its_sites_return_gets_a_notice_and_fails_the_exact_replay(tmp_path, capsys):
    """The logits of a zero replay cannot tell such a model from one whose coefficients have no effect (gated
    branches that output zero), a legitimate audit: a notice, printed even when quiet. The exact replay check then
    stops it: the window the site check captured alone left its own values in the gates' attribute."""
    model = ToyGated()
    for b in model.blocks:
        b.__class__, b.gate.__class__ = KeptBlock, KeptGate
    with pytest.raises(FcauditError, match="exact replay failed on windows 0..3"):
        run(model, gated(model), tmp_path / "a")  # quiet
    assert "replaying zeros for every coefficient leaves the logits unchanged" in capsys.readouterr().err
    plain = ToyGated()
    run(plain, gated(plain), tmp_path / "b")
    assert "replaying zeros" not in capsys.readouterr().err


def test_a_model_whose_gated_branches_output_zero_audits_with_the_notice(tmp_path, capsys):
    model = ToyGated()
    with torch.no_grad():
        for b in model.blocks:  # zero-initialized output projections: the gates scale nothing
            b.mlp[-1].weight.zero_(), b.mlp[-1].bias.zero_()
    result = run(model, gated(model), tmp_path / "a")
    assert "leaves the logits unchanged" in capsys.readouterr().err
    assert result.replay.bit_equal and (result.penalties().to_frame()["statistic"] == 0).all()
