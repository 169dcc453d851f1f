"""Models that misbehave quietly (issue 48): integer and bool gates, logits that are not a tuple's first element, a
masked vocabulary entry, an NLL that is finite under Correct but not under an intervention, a model that fails on a
later batch, and a result whose directory went away. Each is refused in one line that names the fix (and following
it leads out), or audited with the numbers of the well-behaved model it equals."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from torch import nn

import fcaudit as fca
from fcaudit.auditor.state import STATE_CHECK_PASSES
from fcaudit.loss import token_nll
from harness import api_refusal

VOCAB = 64


def ids(n: int, seed: int, window: int = 16) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n, window), generator=torch.Generator().manual_seed(seed))


class HardGate(nn.Module):
    """A 0/1 decision per token, emitted in `dtype` (int64, bool, or float for the cast the refusal names)."""

    def __init__(self, d, dtype):
        super().__init__()
        self.score, self.dtype = nn.Linear(d, 1), dtype

    def forward(self, h):
        return (self.score(h).squeeze(-1) > 0).to(self.dtype)


class SoftGate(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.score = nn.Linear(d, 1)

    def forward(self, h):
        return torch.sigmoid(self.score(h)).squeeze(-1)


class TinyLM(nn.Module):
    """Residual MLPs scaled by a gate each; `out` says what forward returns."""

    def __init__(self, gate=SoftGate, d=16, n=2, out="logits", **gate_kw):
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.head = nn.Embedding(VOCAB, d), nn.Linear(d, VOCAB)
        self.mlps = nn.ModuleList(nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d)) for _ in range(n))
        self.gates = nn.ModuleList(gate(d, **gate_kw) for _ in range(n))
        self.wide = nn.Linear(d, 48)  # a hidden state of its own width, for the tuple outputs
        self.out = out

    def forward(self, x):
        h = self.embed(x)
        for mlp, gate in zip(self.mlps, self.gates):
            h = h + gate(h).unsqueeze(-1) * mlp(h)
        logits = self.head(h)
        if self.out == "hidden-first":
            return self.wide(h), logits
        if self.out == "two-logits":
            return logits, logits.flip(-1)
        if self.out == "no-logits":
            return self.wide(h), logits.sum()
        if self.out == "masked":  # token 0 never predicted: its logit -inf, every window free of it
            return logits.masked_fill(torch.arange(VOCAB) == 0, float("-inf"))
        return logits


def audit(model, out, ctrl=None, ev=None, ca=None, **kw):
    ctrl = ctrl or fca.Controller.from_modules(model, "gates.*", layout="batch token")
    ev = ids(8, 0) if ev is None else ev
    ca = ids(4, 1) if ca is None else ca
    kw = {"randomizations": 1, "batch_size": 4, "quiet": True, **kw}
    return fca.audit(model, ctrl, ev, ca, out=out, **kw)


def nll(result) -> np.ndarray:
    return result.records["nll"].to_numpy()


# ---- 1, 10: integer and bool gates --------------------------------------------------------------------------------

class _Zero(nn.Module):
    def forward(self, h):
        return h.new_zeros(h.shape[:2])


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool, torch.uint8])
def test_an_integer_or_bool_gate_is_refused_and_either_fix_it_names_audits(tmp_path, dtype):
    """A static mean cast back to an integer gate becomes 0 (every gate off); a bool gate broke a pre-write check."""
    model = TinyLM(HardGate, dtype=dtype).eval()
    line = api_refusal(lambda: audit(model, tmp_path / "a"))
    assert f"emits {str(dtype)[6:]} coefficients" in line and 'kind="skip_mask"' in line and "float" in line
    assert not (tmp_path / "a").exists()
    # the fixes it names: run/skip decisions, or the gate emitted as float
    mask = fca.Controller.from_modules(model, "gates.*", kind="skip_mask")
    assert audit(model, tmp_path / "mask", mask).replay.passed
    as_float = TinyLM(HardGate, dtype=torch.float32).eval()
    result = audit(as_float, tmp_path / "float")
    assert result.replay.passed
    static = result.records.query("condition == 'StaticProfile'")["nll"].to_numpy()
    off = TinyLM(HardGate, dtype=torch.float32).eval()
    off.gates = nn.ModuleList(_Zero() for _ in off.gates)
    with torch.no_grad():
        all_off = token_nll(off(ids(8, 0)), ids(8, 0)).mean(1).double().numpy()
    assert not np.allclose(static, all_off)  # a mean profile, not "every gate off"


# ---- 4: logits found by shape -------------------------------------------------------------------------------------

def test_logits_that_are_not_a_tuples_first_element_are_found_by_the_vocabulary(tmp_path):
    plain = audit(TinyLM().eval(), tmp_path / "plain")
    second = audit(TinyLM(out="hidden-first").eval(), tmp_path / "tuple")
    assert np.array_equal(nll(plain), nll(second))  # bit for bit: the logits, not the hidden state, scored


@pytest.mark.parametrize("out, fragment", [
    ("two-logits", "in which 2 tensors have the logits' shape [batch, token, 64]"),
    ("no-logits", "in which no tensors have the logits' shape")])
def test_a_tuple_with_no_or_several_logits_is_refused_naming_how_to_return_them(tmp_path, out, fragment):
    line = api_refusal(lambda: audit(TinyLM(out=out).eval(), tmp_path / "a"))
    assert fragment in line and "dict entry 'logits'" in line
    assert not (tmp_path / "a").exists()


# ---- 11: a masked vocabulary entry --------------------------------------------------------------------------------

def test_a_masked_entry_of_minus_inf_is_audited_when_every_nll_is_finite(tmp_path):
    ev, ca = ids(8, 0).clamp(min=1), ids(4, 1).clamp(min=1)  # token 0, the masked one, is never a next token
    result = audit(TinyLM(out="masked").eval(), tmp_path / "a", ev=ev, ca=ca)
    assert result.replay.passed and result.replay.max_abs_dlogit == 0.0 and np.isfinite(nll(result)).all()
    # a next token of probability 0 is a non-finite NLL: refused, naming it
    ev[0, 5] = 0
    line = api_refusal(lambda: audit(TinyLM(out="masked").eval(), tmp_path / "b", ev=ev, ca=ca))
    assert "NLL on the first evaluation batch is non-finite" in line and "-inf" in line


# ---- 8: an NLL that is non-finite under one condition only ---------------------------------------------------------

class FloorGate(nn.Module):
    """A gate that never falls below a floor its block recomputes: the block takes the root of the difference."""

    def __init__(self, d):
        super().__init__()
        self.floor, self.score = nn.Linear(d, 1), nn.Linear(d, 1)

    def forward(self, h):
        return (self.floor(h) + nn.functional.softplus(self.score(h))).squeeze(-1)


class RootLM(TinyLM):
    def __init__(self, clamp=False):
        super().__init__(FloorGate)
        self.clamp = clamp

    def forward(self, x):
        h = self.embed(x)
        for mlp, gate in zip(self.mlps, self.gates):
            above = gate(h) - gate.floor(h).squeeze(-1)  # >= 0 for its own gate, not for another window's
            h = h + (above.clamp(min=0) if self.clamp else above).sqrt().unsqueeze(-1) * mlp(h)
        return self.head(h)


def test_a_nan_under_one_condition_names_it_and_stops_there(tmp_path):
    line = api_refusal(lambda: audit(RootLM().eval(), tmp_path / "a"))
    assert "non-finite (nan or inf) on evaluation windows 0..3 under CrossInput r0" in line
    assert "the model itself" in line and "rerun" not in line and "dtype" not in line
    assert not (tmp_path / "a" / "records" / "CrossInput").exists()  # stopped at its first batch
    assert not (tmp_path / "a" / "records" / "TokenShuffle").exists()
    assert audit(RootLM(clamp=True).eval(), tmp_path / "new").replay.passed  # the fix the line names


# ---- 9: a failure at a later batch --------------------------------------------------------------------------------

class Fragile(TinyLM):
    """Raises on the `fail_at`-th forward call, or on any batch holding token `bad` (a bug in its own code)."""

    def __init__(self, fail_at=None, bad=None):
        super().__init__()
        self.calls, self.fail_at, self.bad = 0, fail_at, bad

    def forward(self, x):
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("out of memory")
        if self.bad is not None and (x == self.bad).any():
            raise IndexError("index 99 is out of bounds for dimension 0 with size 64")
        return super().forward(x)


def test_a_later_batch_that_fails_is_one_line_and_following_it_leads_out(tmp_path):
    ev = ids(16, 0).clamp(max=VOCAB - 2)
    ev[10, 3] = VOCAB - 1  # only window 10 holds it
    model = Fragile(bad=VOCAB - 1).eval()
    line = api_refusal(lambda: audit(model, tmp_path / "a", ev=ev))
    assert line.startswith("the model's forward pass failed on evaluation windows 8..11, capturing Correct "
                           "(IndexError: index 99") and "new --out" in line
    fixed = Fragile().eval()  # its own code fixed: the parameters are the same
    expected = nll(audit(fixed, tmp_path / "new", ev=ev))  # the line's way on
    model.bad = None  # the same --out resumes a model that computes as before
    assert np.array_equal(nll(audit(model, tmp_path / "a", ev=ev)), expected)


def failing_at_every_call(tmp_path, calls=None) -> None:
    """The model raising on its k-th forward call (a transient failure: out of memory), for each k of `calls` (negative
    from the end; default every call): one line naming where, and the same --out run again finishes with the whole
    run's records."""
    whole = Fragile().eval()
    expected = nll(audit(whole, tmp_path / "whole"))
    for k in calls or range(1, whole.calls + 1):
        k = k if k > 0 else whole.calls + 1 + k
        model = Fragile(fail_at=k).eval()
        line = api_refusal(lambda: audit(model, tmp_path / f"k{k}"))
        assert line.startswith("the model's forward pass") and "(RuntimeError: out of memory)" in line, (k, line)
        assert np.array_equal(nll(audit(model, tmp_path / f"k{k}")), expected), k


def test_a_failure_in_stage_2_names_its_condition_and_the_same_out_resumes_after_it(tmp_path):
    model = Fragile().eval()
    audit(model, tmp_path / "count")
    model = Fragile(fail_at=model.calls - STATE_CHECK_PASSES).eval()  # stage 2's last unit (the state's pass after it)
    line = api_refusal(lambda: audit(model, tmp_path / "a"))
    assert line.startswith("the model's forward pass failed on evaluation windows 4..7 under StructureRemoved r0 "
                           "(RuntimeError: out of memory)"), line
    failing_at_every_call(tmp_path / "some", [2, -1])  # a pre-write check's pass and the last: the state's repeat


@pytest.mark.slow
def test_a_failure_at_any_forward_pass_is_one_line_and_the_same_out_finishes_after_it(tmp_path):
    failing_at_every_call(tmp_path)


def test_a_target_beyond_the_logits_width_is_refused_before_anything_runs(tmp_path):
    ev = ids(16, 0)
    ev[10, 5] = VOCAB + 6
    model = TinyLM().eval()
    model.embed = nn.Embedding(VOCAB + 8, 16)  # embeds more ids than its head predicts
    line = api_refusal(lambda: audit(model, tmp_path / "a", ev=ev))
    assert line.startswith(f"evaluation window 10 has next-token id {VOCAB + 6} but the model's logits have {VOCAB}")
    assert not (tmp_path / "a").exists()


# ---- 12: a result whose directory went away -----------------------------------------------------------------------

def test_a_result_whose_directory_was_removed_says_so_in_one_line(tmp_path):
    result = audit(TinyLM().eval(), tmp_path / "a")
    shutil.rmtree(tmp_path / "a")
    for read in (result.penalties, result.variation):
        line = api_refusal(read)
        assert "is gone: the audit directory" in line and "AuditResult.load" in line
