"""Whole audits of tiny models: exact zeros for static controllers, planted dependence found, MoE and ragged sites,
the records' columns and counts, and the mistakes refused before anything is written."""

import warnings

import numpy as np
import pandas as pd
import pytest
import torch
from torch import nn

from fcaudit import audit
from fcaudit.controllers import Controller
from fcaudit.auditor.state import STATE_CHECK_PASSES
from fcaudit.controllers.checks import BATCH_CHECK_PASSES, FLOW_CHECK_PASSES, SITE_CHECK_PASSES
from fcaudit.errors import FcauditError
from fcaudit.families import controller_for
from fcaudit.models.featuregate import FeatureGateGPT, config_for
from conftest import T, ToyGated, ToyMoE, ToyMudd, V, gated, randomized_means, run, windows


class ParityGate(nn.Module):
    def __init__(self, constant):
        super().__init__()
        self.table = nn.Parameter(torch.tensor([6.0 if i % 2 else -6.0 for i in range(V)]))
        self.constant = constant

    def forward(self, ids):
        return torch.full(ids.shape, 0.5) if self.constant else torch.sigmoid(self.table[ids])


NEXT_ODD = np.random.default_rng(1).integers(0, V, V)
NEXT_EVEN = np.random.default_rng(2).integers(0, V, V)


class Planted(nn.Module):
    """Predictions depend by construction on per-token coefficient alignment: the gate of token t picks which of
    two lookup tables predicts t+1 (odd ids use one rule, even ids the other)."""

    def __init__(self, constant=False):
        super().__init__()
        self.gate = ParityGate(constant)
        self.odd = nn.Parameter(8.0 * torch.eye(V)[NEXT_ODD])
        self.even = nn.Parameter(8.0 * torch.eye(V)[NEXT_EVEN])

    def forward(self, ids):
        g = self.gate(ids)[..., None]
        return g * self.odd[ids] + (1 - g) * self.even[ids]


def planted_windows(n, seed):
    rng = np.random.default_rng(seed)
    out = np.zeros((n, T), dtype=np.int64)
    out[:, 0] = rng.integers(0, V, n)
    for t in range(1, T):
        prev = out[:, t - 1]
        out[:, t] = np.where(prev % 2 == 1, NEXT_ODD[prev], NEXT_EVEN[prev])
        jump = rng.random(n) < 0.2  # restarts keep the sequences from collapsing into one short cycle
        out[jump, t] = rng.integers(0, V, jump.sum())
    return torch.from_numpy(out)


def test_static_controller_gives_exact_zero(tmp_path):
    model = ToyGated(static=True)
    res = run(model, gated(model), tmp_path / "a")
    warnings.simplefilter("ignore", RuntimeWarning)  # some windows gain from GlobalMean: undefined retention CI
    assert res.replay.passed and res.replay.bit_equal and res.replay.max_abs_dlogit == 0.0
    m = randomized_means(res)
    assert m["CrossInput"] == 0.0 and m["TokenShuffle"] == 0.0 and m["CrossShuffle"] == 0.0
    assert m["TokenResamplePast"] == 0.0
    assert m["StaticProfile"] == 0.0 and m["StructureRemoved"] > 0  # LayerStatic needs its depth profile
    assert set(res.records.columns) == {"example", "condition", "randomization", "nll", "tokens", "active"}
    assert len(res.records) == 8 * (1 + 4 * 3 + 3) and (res.records["tokens"] == T - 1).all()
    assert (res.records["active"] == 1.0).all()  # one nonzero gate per (layer, token)
    ret = res.retention("LayerMean")  # GlobalMean helps some windows of this random model: no clear gap
    assert np.isnan(ret.statistic) and "not above the practically-small bound" in ret.reason and ret.delta_reference > 0
    assert (res.factor_effects().to_frame()["statistic"] == 0.0).all()
    var = res.variation()
    assert len(var.layers) == 3 and var.layers[0]["sd"] == 0.0


def test_real_featuregate_layerstatic_and_uniform_exact_zero(tmp_path):
    for variant in ("layerstatic", "uniform"):
        model = FeatureGateGPT(config_for("tiny", variant))
        ev = torch.randint(0, 256, (6, T), generator=torch.Generator().manual_seed(0))
        ca = torch.randint(0, 256, (3, T), generator=torch.Generator().manual_seed(1))
        res = audit(model, controller_for(model), ev, ca, randomizations=2, out=tmp_path / variant, batch_size=3, quiet=True)
        m = randomized_means(res)
        assert res.replay.bit_equal
        assert m["CrossInput"] == 0.0 and m["TokenShuffle"] == 0.0 and m["CrossShuffle"] == 0.0
        assert res.config["labels"]["StaticProfile"] == "LayerMean"


def test_planted_dependence_detected_and_constant_twin_zero(tmp_path):
    ev, ca = planted_windows(16, 0), planted_windows(8, 1)
    model = Planted()
    ctrl = Controller.from_modules(model, "gate", "batch token")
    res = audit(model, ctrl, ev, ca, randomizations=3, out=tmp_path / "p", batch_size=8, quiet=True)
    m = randomized_means(res)
    assert res.replay.bit_equal
    assert m["CrossInput"] > 1.0 and m["TokenShuffle"] > 1.0 and m["CrossShuffle"] > 1.0 and m["StaticProfile"] > 0.1
    assert m["TokenResamplePast"] > 1.0
    twin = Planted(constant=True)
    res = audit(twin, Controller.from_modules(twin, "gate", "batch token"), ev, ca, randomizations=3,
                out=tmp_path / "c", batch_size=8, quiet=True)
    assert (randomized_means(res) == 0.0).all()


def test_moe_through_from_modules_alone(tmp_path):
    model = ToyMoE()
    ctrl = Controller.from_modules(model, "layers.*.router", "(batch token) expert", reference="SourceUniformMean")
    res = run(model, ctrl, tmp_path / "moe", R=2)
    assert res.replay.passed and res.replay.bit_equal and res.replay.max_abs_dlogit == 0.0
    m = randomized_means(res)
    assert m["CrossInput"] != 0.0 and m["StructureRemoved"] != 0.0
    assert res.config["labels"]["StructureRemoved"] == "SourceUniformMean"
    assert res.variation().layers[0]["shape"] == [1, 4]
    assert "factor_effects" not in res.config and set(res.factor_effects().to_frame().index) == {"input", "token", "interaction"}


def test_ragged_multi_stream_sites(tmp_path):
    model = ToyMudd()
    ctrl = Controller.from_modules(model, "dynamic_dense.*", "stream batch token source",
                                   static_name="StaticMixMean", reference="SourceUniformMean")
    res = run(model, ctrl, tmp_path / "mudd", R=2)
    warnings.simplefilter("ignore", RuntimeWarning)  # untrained: SourceUniformMean may not hurt, retention undefined
    assert res.replay.bit_equal
    assert [l["shape"] for l in res.variation().layers] == [[2, 2], [2, 3], [1, 4]]
    assert abs(sum(res.variation().values()) - 1) < 1e-9 and "slice" in res.variation().decomposed
    m = randomized_means(res)
    assert m["CrossInput"] != 0 and m["TokenShuffle"] != 0 and m["StructureRemoved"] != 0
    assert res.retention("StaticMixMean").reference_label == "SourceUniformMean"
    from safetensors.torch import load_file
    prof = load_file(str(tmp_path / "mudd" / "profiles.safetensors"))
    assert prof["StaticProfile.2"].dtype == torch.float64 and prof["LayerPositionMean.1"].shape == (T, 2, 3)


def test_summary_printed_unless_quiet(tmp_path, capsys):
    model = ToyGated()
    audit(model, gated(model), windows(4, 0), windows(2, 1), randomizations=2, out=tmp_path / "s", quiet=False)
    text = capsys.readouterr().out
    assert "exact replay: passed=True" in text and "Cross+shuffle" in text and "LayerMean" in text
    assert "Token-resample-past" in text and "retention LayerMean vs GlobalMean" in text


def test_hf_style_output_and_custom_loss(tmp_path):
    model = ToyGated(hf=True)
    res = run(model, gated(model), tmp_path / "hf", R=1)
    plain = ToyGated()
    ref = run(plain, gated(plain), tmp_path / "plain", R=1)
    pd.testing.assert_frame_equal(res.records, ref.records)
    calls = []

    def loss_fn(out, ids):
        calls.append(1)
        return (out.logits[:, :-1].float() ** 2).mean((1, 2))

    res = run(model, gated(model), tmp_path / "custom", R=1, loss_fn=loss_fn)
    assert calls and not np.allclose(res.records["nll"], ref.records["nll"])


def test_an_audit_runs_its_schedules_forward_passes_and_no_more(tmp_path):
    """The probe's capture of the first batch is that batch's stage 1 capture: the first batch is not run twice."""
    from fcaudit.auditor.units import Schedule

    model = ToyGated()
    calls = []
    model.register_forward_hook(lambda *a: calls.append(1))
    result = run(model, gated(model), tmp_path / "a", n_eval=10, n_calib=5)
    sched = Schedule(10, 5, 4, 3, tuple(result.config["conditions"]))
    # its gates are followed by the Flow pass (none is ranked); the batch-composition check's two, the state check's
    checks = SITE_CHECK_PASSES + FLOW_CHECK_PASSES + BATCH_CHECK_PASSES + STATE_CHECK_PASSES
    assert len(calls) == checks + sum(u.passes for u in (*sched.iter_stage1(), *sched.iter_stage2()))
    # a capture pass per evaluation and calibration batch, the site check's capture of window 0 alone, the
    # pre-write checks' two passes of the first batch (one as the probe's, one under the Flow mode), the
    # batch-composition check's two and the state check's repeated pass
    assert [b.gate.calls for b in model.blocks] == [3 + 2 + 1 + 2 + BATCH_CHECK_PASSES + STATE_CHECK_PASSES] * 3


def test_replays_free_each_batchs_logits_before_the_next_forward(tmp_path, monkeypatch):
    """Stage 2 keeps no replay's logits alive into the next forward pass (at a 50k vocabulary and 8 x 2048 tokens
    they are 3.3 GB in float32, and the peak would hold two batches of them)."""
    import weakref

    model = ToyGated()
    previous, passes = [None], []  # per forward pass: (a replay, the previous pass's logits still alive)
    forward = model.forward

    def watched(ids):
        alive = previous[0] is not None and previous[0]() is not None
        calls = model.blocks[0].gate.calls
        out = forward(ids)
        passes.append((model.blocks[0].gate.calls == calls, alive))  # a replay runs no gate
        previous[0] = weakref.ref(out)
        return out

    monkeypatch.setattr(model, "forward", watched)  # the test's own model, watched
    run(model, gated(model), tmp_path / "a", n_eval=8, R=2)
    *_, last_capture, repeated = (i for i, (replay, _) in enumerate(passes) if not replay)  # then the state check
    stage2 = [alive for _, alive in passes[last_capture + 1:repeated]]  # the replays after stage 1's last capture
    assert len(stage2) > 10 and not any(stage2[1:])  # the first replay follows stage 1's last capture


def test_records_independent_of_batch_size(tmp_path):
    # dynamic gates: a derangement or permutation keyed by batch position instead of example would change the NLLs
    model = ToyGated()
    a = run(model, gated(model), tmp_path / "a", batch_size=4)
    b = run(model, gated(model), tmp_path / "b", batch_size=3)
    assert (a.penalties().to_frame()["statistic"].abs() > 1e-4).sum() >= 5  # the conditions do move NLL
    # equal up to the rounding of batched kernels and of the calibration sums' order
    pd.testing.assert_frame_equal(a.records, b.records, check_exact=False, rtol=1e-5, atol=1e-7)


def test_bad_inputs_leave_nothing(tmp_path):
    model = ToyGated()
    ctrl = gated(model)
    out = tmp_path / "x"
    cases = [
        (dict(eval_windows=windows(1, 0)), "at least 2"),
        (dict(eval_windows=[torch.zeros(T, dtype=torch.long), torch.zeros(T + 1, dtype=torch.long)]), "unequal lengths"),
        (dict(calib_windows=torch.cat([windows(3, 1), windows(8, 0)[2:3]])), "equal evaluation windows"),
        (dict(calib_windows=windows(4, 1)[:, :8]), "length"),
    ]
    for kw, msg in cases:
        args = dict(eval_windows=windows(8, 0), calib_windows=windows(4, 1)) | kw
        with pytest.raises(FcauditError, match=msg):
            audit(model, ctrl, args["eval_windows"], args["calib_windows"], out=out, quiet=True)
        assert not out.exists()
    from fcaudit.data import WindowSet
    ev = WindowSet(windows(8, 0), np.arange(8) * 100, "test")
    ca = WindowSet(windows(4, 1), np.array([1000, 1100, 705, 1300]), "test")
    with pytest.raises(FcauditError, match="overlap"):
        audit(model, ctrl, ev, ca, out=out, quiet=True)
    ok = WindowSet(windows(4, 1), np.array([705, 1100, 1200, 1300]), "validation")
    assert audit(model, ctrl, ev, ok, randomizations=1, out=tmp_path / "ok", quiet=True).replay.passed
    moe = ToyMoE()
    with pytest.raises(FcauditError, match="does not fit layout"):
        audit(moe, Controller.from_modules(moe, "layers.*.router", "batch token"), windows(4, 0), windows(2, 1),
              out=out, quiet=True)
    assert not out.exists()


def test_non_finite_coefficients(tmp_path):
    model = ToyGated()
    model.blocks[1].gate.proj.bias.data.fill_(float("nan"))
    with pytest.raises(FcauditError, match="non-finite"):
        run(model, gated(model), tmp_path / "nan")
    assert not (tmp_path / "nan").exists()
    # non-finite only in a later batch: whole chunks before it, nothing partial
    model = ToyGated()
    orig = model.blocks[0].gate.forward
    model.blocks[0].gate.forward = lambda h: orig(h).masked_fill(h[..., 0] > 1e3, float("nan"))
    ev = windows(8, 0)
    ev[ev == V - 1] = 0
    ev[5, 3] = V - 1
    model.emb.weight.data[V - 1] = 1e4  # a token only in a later window drives the gate to nan
    with pytest.raises(FcauditError, match="non-finite"):
        audit(model, gated(model), ev, windows(4, 1), randomizations=1, out=tmp_path / "late", batch_size=4, quiet=True)
    assert not list((tmp_path / "late").rglob("*.tmp")) and not list((tmp_path / "late").rglob("*CrossInput*"))


@pytest.mark.parametrize("wrap", [lambda x: {"logits": x}, lambda x: (x, None)], ids=["dict", "tuple"])
def test_a_model_returning_a_dict_or_a_tuple_is_read_for_its_logits(tmp_path, wrap):
    class Wrapped(ToyGated):
        def forward(self, ids):
            return wrap(super().forward(ids))

    plain, wrapped = ToyGated(), Wrapped()
    a, b = run(plain, gated(plain), tmp_path / "a"), run(wrapped, gated(wrapped), tmp_path / "b")
    pd.testing.assert_frame_equal(a.records, b.records, check_exact=True)


def test_model_mistakes_get_one_line_each(tmp_path):
    class Opaque(ToyGated):
        def forward(self, ids):
            return {"scores": super().forward(ids)}

    opaque = Opaque()
    with pytest.raises(FcauditError, match="returned dict, in which fcaudit finds no logits"):
        run(opaque, gated(opaque), tmp_path / "a")
    model, other = ToyGated(), ToyGated()
    with pytest.raises(FcauditError, match="module of another model instance"):
        run(model, gated(other), tmp_path / "b")
    shared = ToyGated()
    for b in shared.blocks:
        b.gate = shared.blocks[0].gate
    with pytest.raises(FcauditError, match="also at another path"):
        gated(shared)

    class Positions(ToyGated):  # a position table of 8 rows that the model does not declare
        def __init__(self):
            super().__init__()
            self.pos = nn.Embedding(8, 16)

        def forward(self, ids):
            self.pos(torch.arange(ids.shape[1]))
            return super().forward(ids)

    short = Positions()
    with pytest.raises(FcauditError, match=r"first evaluation batch \(4 windows of 16 tokens\) failed \(IndexError"):
        run(short, gated(short), tmp_path / "c")
