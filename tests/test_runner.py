"""fcaudit.audit and fcaudit.plan from the caller's side: the model's mode around them, and which calibration windows
of the evaluation windows' split they refuse as overlapping."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import fcaudit as fca
from fcaudit.data import WindowSet

T = 8


class DropoutGated(nn.Module):
    """Gated residual updates behind a dropout: in train mode two passes differ, so no replay would be exact."""

    def __init__(self, d: int = 8):
        super().__init__()
        self.embed, self.head, self.drop = nn.Embedding(256, d), nn.Linear(d, 256), nn.Dropout(0.5)
        self.mlp = nn.Linear(d, d)
        self.gates = nn.ModuleList(nn.Sequential(nn.Linear(d, 1), nn.Sigmoid(), nn.Flatten(-2)) for _ in range(2))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.drop(self.embed(ids))
        for gate in self.gates:
            h = h + gate(h).unsqueeze(-1) * self.mlp(h)
        return self.head(h)


def ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n, T), generator=torch.Generator().manual_seed(seed))


def model_and_controller():
    torch.manual_seed(0)
    model = DropoutGated()
    return model, fca.Controller.from_modules(model, "gates.*", layout="batch token")


def test_audit_and_plan_run_in_eval_mode_and_leave_the_mode_as_it_was(tmp_path):
    model, ctrl = model_and_controller()
    model.train()
    result = fca.audit(model, ctrl, ids(4, 0), ids(2, 1), randomizations=1, out=tmp_path / "a", quiet=True)
    assert result.replay.passed and result.replay.bit_equal  # dropout off: the replay is exact
    assert model.training and model.drop.training
    fca.plan(model, ctrl, ids(4, 0), ids(2, 1), randomizations=1)
    assert model.training
    model.eval()
    fca.plan(model, ctrl, ids(4, 0), ids(2, 1), randomizations=1)
    assert not model.training


# evaluation windows start at 0, 100, 200, 300: a calibration window [c, c + T) overlaps [100, 100 + T) iff
# 100 - T < c < 100 + T
@pytest.mark.parametrize("start, overlaps", [(100 - T, False), (100 - T + 1, True), (100, True), (100 + T - 1, True),
                                             (100 + T, False)])
def test_calibration_windows_overlapping_evaluation_windows_of_their_split_are_refused(tmp_path, start, overlaps):
    model, ctrl = model_and_controller()
    ev = WindowSet(ids(4, 0), np.array([0, 100, 200, 300]), "test")
    ca = WindowSet(ids(2, 1), np.array([500, start]), "test")
    out = tmp_path / "a"
    if overlaps:
        with pytest.raises(fca.FcauditError, match="calibration windows overlap evaluation windows in split 'test'"):
            fca.audit(model, ctrl, ev, ca, randomizations=1, out=out, quiet=True)
        assert not out.exists()
    else:
        assert fca.audit(model, ctrl, ev, ca, randomizations=1, out=out, quiet=True).replay.passed


def test_the_printout_is_the_results_str_and_results_compare_by_identity(tmp_path, capsys):
    model, ctrl = model_and_controller()
    result = fca.audit(model.eval(), ctrl, ids(4, 0), ids(2, 1), randomizations=2, out=tmp_path / "a")
    out = capsys.readouterr().out
    assert out.endswith(str(result) + "\n")  # `fcaudit audit` prints the same
    lines = str(result).splitlines()
    assert [line.split()[0] for line in lines[:4]] == ["three", "variation", "dependence", "execution"]
    lines = lines[4:]  # then the evidence
    assert lines[0] == "exact replay: passed=True bit_equal=True max|Δlogit|=0 ΔNLL=0"
    assert lines[1] == f"FCA penalties ({result.path})" and lines[2].startswith("PenaltiesResult: mean ΔNLL")
    assert lines[3].split()[:4] == ["condition", "ΔNLL", "95%", "interval"] and lines[4].split()[0] == "Cross-input"
    assert [line.split(":")[0] for line in lines[-4:]] == [
        "retention Layer×PositionMean vs GlobalMean", "retention StaticProfile vs GlobalMean",
        "criterion 'practically small' (upper 95% bound of the StaticProfile ΔNLL < 0.002; window-level (one "
        "checkpoint))", "criterion 'high retention' (lower 95% bound of the StaticProfile retention > 95%; "
        "window-level (one checkpoint))"]
    again = fca.AuditResult.load(result.path)
    assert again.records.shape == result.records.shape  # both have their records loaded: == compares identity
    assert result == result and result != again and result.replay != again.replay
    assert result.penalties() is result.penalties() and result.penalties() is not again.penalties()
    assert result.penalties(confidence=0.9)["CrossInput"].confidence_level == 0.9
