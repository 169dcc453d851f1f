"""Models that misbehave quietly (issue 48): a controller coupled across the windows of a batch, a model whose state
changes during the audit, duplicated or near-duplicated windows. Each model is written here as a researcher would
write it, audited for real, and refused (or flagged) in one line."""

import numpy as np
import pytest
import torch
from torch import nn

import fcaudit as fca
from fcaudit.controllers.checks import BATCH_CHECK_PASSES, FLOW_CHECK_PASSES, SITE_CHECK_PASSES
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


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool])
def test_integer_and_bool_decisions_are_compared_for_equality(dtype):
    """The batch and layout checks compare 0/1 decisions exactly (no tolerance, no float ops on bools): one changed
    decision is one disagreeing position."""
    from fcaudit.controllers.coefficient_checks import agreeing

    a = (torch.rand(2, 8, 1, 1, generator=torch.Generator().manual_seed(0)) > 0.5).to(dtype)
    b = a.clone()
    b[1, 3] = 1 - b[1, 3] if dtype != torch.bool else ~b[1, 3]
    same = agreeing(a, b, None)
    assert same.shape == (2, 8, 1) and int((~same).sum()) == 1 and not bool(same[1, 3])


def test_a_capacity_router_filled_over_the_flattened_batch_is_refused(tmp_path):
    """GShard-style slots by a cumulative sum, but the capacity's count runs over the whole batch in batch order: a
    window's drops depend on the windows before it (the tutorial's capacity router, made batch-wide). Window 0
    comes first, so alone it is routed as in its batch and the layout check passes it."""
    import torch.nn.functional as F

    from test_capacity import CapacityRouter, controller, tiny, windows

    class PooledRouter(CapacityRouter):
        def forward(self, x):
            probs = self.wg(x).softmax(-1)
            mask = torch.zeros_like(probs).scatter_(-1, probs.topk(2, dim=-1).indices, 1.0)
            b, t, e = mask.shape
            pooled = mask.reshape(1, b * t, e).cumsum(1).reshape(b, t, e) - 1  # places over the whole batch
            mask = mask * (pooled < 4 * self.capacity)  # one pool of slots per expert for the whole batch
            location = mask.cumsum(1) - 1
            mask = mask * (location < self.capacity)
            gates = probs * mask
            gates = gates / gates.sum(-1, keepdim=True).clamp_min(1e-9)
            slot = F.one_hot(location.clamp(0, self.capacity - 1).long(), self.capacity).to(x.dtype) * mask[..., None]
            return slot.bool(), gates[..., None] * slot

    model = tiny()
    for layer in model.layers:
        layer.moe.router.__class__ = PooledRouter
    line = api_refusal(lambda: fca.audit(model, controller(model), windows(8, 0), windows(4, 1), randomizations=1,
                                         batch_size=8, out=tmp_path / "a", quiet=True))
    assert "site 'layers.0.moe.router'" in line and "change when the other windows of its batch change" in line
    # the model as it was: a capacity per window passes
    model = tiny()
    assert fca.audit(model, controller(model), windows(8, 0), windows(4, 1), randomizations=1, batch_size=8,
                     out=tmp_path / "b", quiet=True).replay.passed


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
    model.calls = 40 - (1 + SITE_CHECK_PASSES + FLOW_CHECK_PASSES + BATCH_CHECK_PASSES)  # flips after the checks
    line = api_refusal(lambda: audit_of(model, out, randomizations=1))
    assert "repeated at the end" in line and nothing_kept(out)


# ---- Monte Carlo SE from few randomizations ---------------------------------------------------------------------------

def test_the_monte_carlo_interval_is_scipys_t_interval():
    from scipy import stats

    from fcaudit.stats.inference import mc_interval, mc_se

    draws = np.array([0.0021, 0.0017, 0.0030, 0.0012])
    est = mc_interval(draws, 0.95)
    low, high = stats.t.interval(0.95, df=3, loc=draws.mean(), scale=stats.sem(draws))
    assert np.isclose(mc_se(draws), stats.sem(draws), rtol=1e-12, atol=0)
    assert np.allclose(est.confidence_interval, (low, high), rtol=1e-12, atol=0) and est.n == 4
    assert "3 degrees of freedom" in est.method
    assert not mc_interval([0.1]).has_interval


def test_the_t_interval_covers_where_the_normal_one_does_not():
    """With R = 4 normal draws, mean ± 1.96 SE covers the true mean ~88% of the time, the t interval 95%."""
    from fcaudit.stats.inference import mc_interval

    rng = np.random.default_rng(0)
    draws = rng.normal(0.0, 1.0, size=(4000, 4))
    covered = np.mean([mc_interval(d).confidence_interval.low <= 0 <= mc_interval(d).confidence_interval.high
                       for d in draws])
    normal = np.mean(np.abs(draws.mean(1)) <= 1.96 * draws.std(1, ddof=1) / 2)
    assert abs(covered - 0.95) < 0.015 and normal < 0.91, (covered, normal)


def test_an_audit_of_few_randomizations_says_its_mc_se_is_rough(tmp_path):
    from fcaudit.stats.inference import mc_note

    few = audit_of(GatedLM().eval(), tmp_path / "a", randomizations=4)
    line = next(x for x in str(few).splitlines() if "randomizations" in x and x.startswith("note: R = 4"))
    assert "3 degrees of freedom" in line and "± 3.18 × MC SE" in line and "R = 20" in line
    assert mc_note(10) is None and mc_note(1) is None and mc_note(9) is not None


# ---- duplicated and near-duplicated windows ---------------------------------------------------------------------------

def test_duplicated_evaluation_windows_are_refused(tmp_path):
    model = GatedLM().eval()
    ctrl = fca.Controller.from_modules(model, "gates.*", layout="batch token")
    one = ids(1, 0).repeat(16, 1)
    line = api_refusal(lambda: fca.audit(model, ctrl, one, ids(4, 1), randomizations=1, out=tmp_path / "a",
                                         quiet=True))
    assert line.startswith("evaluation window 1 equals window 0 (15 of 16 evaluation windows repeat others)")
    twice = torch.cat([ids(8, 0), ids(8, 0)])
    line = api_refusal(lambda: fca.audit(model, ctrl, twice, ids(4, 1), randomizations=1, out=tmp_path / "b",
                                         quiet=True))
    assert line.startswith("evaluation window 8 equals window 0 (8 of 16")


@pytest.mark.parametrize("how, t", [("shifted", 32), ("shifted", 64), ("one token changed", 64)])
def test_calibration_windows_sharing_long_spans_with_evaluation_windows_are_flagged(tmp_path, how, t):
    """A long span is half a window and at least 32 tokens (at most the window less one): from 64 tokens on, a window
    with one token changed shares a run of half of it; a window shifted by one token always counts."""
    model = GatedLM().eval()
    ctrl = fca.Controller.from_modules(model, "gates.*", layout="batch token")
    gen = torch.Generator().manual_seed(0)
    ev, ca = torch.randint(0, V, (8, t), generator=gen), torch.randint(0, V, (4, t), generator=gen)
    if how == "shifted":
        ca[3] = torch.cat([ev[5][1:], ca[3][:1]])
    else:
        ca[3] = ev[5]
        ca[3, t // 2] = (ev[5, t // 2] + 1) % V
    result = fca.audit(model, ctrl, ev, ca, randomizations=1, out=tmp_path / "a", quiet=True)
    (line,) = [n for n in result.notices if "share a run" in n]
    assert line.startswith(f"note: 1 of 4 calibration windows share a run of at least {min(t - 1, max(t // 2, 32))} "
                           "tokens") and "(calibration window 3 with evaluation window 5)" in line
    assert result.replay.finding("windows").data["calibration_windows"] == 1


def test_spans_are_found_by_hash_and_checked(tmp_path):
    """Long windows: the span is half a window; unrelated windows share none; a changed token is still found."""
    from fcaudit.auditor.inputs import shared_span_notice, span_length

    assert [span_length(t) for t in (2, 16, 33, 64, 100, 512)] == [1, 15, 32, 32, 50, 256]
    rng = np.random.default_rng(0)
    ev, ca = rng.integers(0, 50_000, (64, 512)), rng.integers(0, 50_000, (64, 512))
    assert shared_span_notice(ev, ca) is None
    ca[7] = np.roll(ev[40], 200)  # a rotated window: runs of 312 and 200 tokens
    ca[9] = ev[2]
    ca[9, 255] += 1  # one token changed: runs of 255 and 256
    notice = shared_span_notice(ev, ca)
    assert notice.data == {"calibration_windows": 2, "span": 256, "first": [7, 40]}
