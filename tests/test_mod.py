"""Mixture-of-Depths: exact replay through its token router, and every condition keeping each window's budget."""

import numpy as np
import pandas as pd
import pytest
import torch

import fcaudit as fca
from fcaudit import protocol
from fcaudit.controllers.flow_checks import check_causality
from fcaudit.families.mod import causal, controller
from fcaudit.kinds import TOKEN_NOTE, chosen
from fcaudit.models.mod import MoDGPT, config_for


@pytest.fixture(scope="module")
def windows():
    return fca.windows("embedded", n_eval=6, n_calib=6, window=64)


def tiny_mod(seed: int = 0) -> MoDGPT:
    torch.manual_seed(seed)
    model = MoDGPT(config_for("tiny", "mod")).eval()
    for block in model.blocks:  # an untrained predictor says no to every token: make it choose, differently per window
        if block.router is not None:
            for layer in (block.router.predictor[0], block.router.predictor[2]):
                torch.nn.init.normal_(layer.weight, std=3.0)
                torch.nn.init.zeros_(layer.bias)
    return model


@pytest.mark.parametrize("routing", ["topk", "predictor"])
def test_mod_audits_with_an_exact_replay_and_its_token_conditions(tmp_path, windows, routing):
    model = tiny_mod()
    if routing == "predictor":
        causal(model)
    result = fca.audit(model, controller(model), *windows, randomizations=2, seed=0, out=tmp_path / "a", quiet=True)
    assert result.replay.passed and result.replay.max_abs_dlogit == 0.0
    ran = set(result.records["condition"])
    assert {"StaticTopK", "RandomRoute", "TokenResamplePast"} <= ran
    assert not ran & {"StaticProfile", "LayerPositionMean", "StructureRemoved"}  # degenerate for sets


def captured(model, ids):
    ctrl = controller(model)
    with torch.inference_mode(), ctrl.capture(*ids.shape) as found:
        model(ids)
    return found


def test_every_token_condition_keeps_each_windows_budget(windows):
    model = causal(tiny_mod())  # the predictor's k differs between windows: the harder case
    ids = windows[0].ids
    coeffs = captured(model, ids)
    k = [chosen(c).sum(1) for c in coeffs]
    assert len({int(x) for x in k[0]}) > 1, "the predictor should choose different budgets per window"
    examples = np.arange(ids.shape[0])
    cal = protocol.Calibration([c.double().sum(0) for c in coeffs], ids.shape[0], (None,) * len(coeffs))
    static = [protocol.expand(p, ids.shape[0], ids.shape[1]) for p in cal.layer_position_mean()]
    made = {
        "TokenShuffle": protocol.shuffle_tokens(coeffs, examples, 0, 1),
        "TokenResamplePast": protocol.routes_past(coeffs, examples, 0, 1),
        "RandomRoute": protocol.random_routes(coeffs, examples, 0, 1),
        "StaticTopK": protocol.static_routes(static, coeffs),
    }
    for name, new in made.items():
        for before, after in zip(k, new):
            assert torch.equal(chosen(after).sum(1), before), name
        assert all(((c[:, :, 0, 1] == 0) | (c[:, :, 0, 1] == 1)).all() for c in new), name


def test_resample_past_only_moves_choices_later(windows):
    model = tiny_mod()
    ids = windows[0].ids
    coeffs = captured(model, ids)
    moved = protocol.routes_past(coeffs, np.arange(ids.shape[0]), 0, 3)
    for before, after in zip(coeffs, moved):
        for b, a in zip(chosen(before), chosen(after)):
            old, new = np.flatnonzero(b.numpy()), np.flatnonzero(a.numpy())
            assert len(old) == len(new) and (new >= old).all()  # the j-th choice never moves earlier
        kept = before[:, :, 0, 0][chosen(before)].sort().values
        assert torch.equal(after[:, :, 0, 0][chosen(after)].sort().values, kept)  # the scores move along


def test_the_causality_check_flags_top_k_over_the_window_and_clears_the_causal_predictor(windows):
    model = tiny_mod()
    ids = windows[0].ids
    with torch.inference_mode():
        assert check_causality(model, controller(model), ids, 256).data["later_token_flips"] > 0  # top-k: later
        causal(model)
        assert check_causality(model, controller(model), ids, 256).data["later_token_flips"] == 0


@pytest.fixture(scope="module")
def audited(tmp_path_factory, windows):
    """A tiny MoD audited through its top-k router, with every condition's records."""
    model = tiny_mod()
    out = tmp_path_factory.mktemp("mod") / "a"
    return fca.audit(model, controller(model), *windows, randomizations=2, seed=0, out=out, quiet=True)


def test_active_is_the_fraction_of_tokens_chosen_under_every_condition(audited):
    capacity = config_for("tiny", "mod").capacity  # 16 of 64 tokens: exact
    active = audited.records.groupby("condition")["active"]
    assert (active.min() == capacity).all() and (active.max() == capacity).all(), active.describe()
    assert audited.replay.route_flips == 0  # token routers are routers: the live router agrees with the cache


def test_retention_is_against_random_route_and_the_routing_checks_are_recorded(audited):
    (ret,) = audited.statistics(n_resamples=200).retentions()
    assert (ret.condition, ret.reference) == ("StaticTopK", "RandomRoute")
    assert any(line.startswith("retention StaticTopK vs RandomRoute") for line in audited.retention_lines())
    rep = audited.replay
    assert rep.later_token_flips > 0 and TOKEN_NOTE in audited.notices  # top-k sees later tokens
    assert any(line.startswith("routing depends on later tokens") for line in audited.notices)
    assert "routing" not in audited.config  # a measurement, not part of the configuration
    assert audited.config["controller"]["static"] == "StaticTopK"


def test_the_causal_predictor_is_recorded_as_causal(tmp_path, windows):
    model = causal(tiny_mod())
    result = fca.audit(model, controller(model), *windows, randomizations=1, seed=0, out=tmp_path / "a", quiet=True)
    assert result.replay.later_token_flips == 0 and result.replay.finding("causality").line == ""  # nothing to say


def test_the_cli_and_the_report_say_routing_depends_on_later_tokens(tmp_path):
    from typer.testing import CliRunner

    from fcaudit.cli import app
    from fcaudit.families.mod import save

    save(tiny_mod(), tmp_path / "ckpt", {})
    runner = CliRunner()
    res = runner.invoke(app, ["audit", str(tmp_path / "ckpt"), "--out", str(tmp_path / "a"), "--eval", "6",
                              "--calib", "6", "--randomizations", "2", "--window", "64"])
    assert res.exit_code == 0, res.output
    text = " ".join(res.output.split())
    assert "routing depends on later tokens" in text and "not offered" in text and "retention StaticTopK" in text
    res = runner.invoke(app, ["report", str(tmp_path / "a"), "--out", str(tmp_path / "r")])
    assert res.exit_code == 0, res.output
    report = (tmp_path / "r" / "report.md").read_text()
    assert "routing depends on later tokens" in report and "RandomRoute" in report


def test_execution_of_a_tiny_mod_skips_token_block_pairs_beside_its_dense(tmp_path):
    from fcaudit.execution import ExecutionConfig, measure_execution
    from fcaudit.families.mod import save
    from fcaudit.models.checkpoint import save_checkpoint
    from fcaudit.models.featuregate import FeatureGateGPT, config_for as gpt_config

    save(tiny_mod(), tmp_path / "mod", {})
    torch.manual_seed(0)
    save_checkpoint(tmp_path / "dense", FeatureGateGPT(gpt_config("tiny", "dense")).eval(), {})
    df = measure_execution(ExecutionConfig([tmp_path / "mod", tmp_path / "dense"], tmp_path / "ex", batch_size=2,
                                           min_run_time=0.05, threshold_windows=4, progress=False))
    mod, dense = (df[df["model"] == m].iloc[0] for m in ("mod", "dense"))
    capacity = config_for("tiny", "mod").capacity
    assert mod["architecture"] == dense["architecture"]  # FeatureGate's Dense of the same shape is its baseline
    assert mod["token_fraction"] == capacity and mod["token_fraction_by_block"] == f"[1.0, {capacity}]"
    assert mod["token_block_fraction"] == (1 + capacity) / 2
    assert mod["flops_vs_dense"] < 1 and np.isfinite(mod["latency_vs_dense"]) and mod["latency_ms"] > 0
    conds = pd.read_csv(tmp_path / "ex" / "conditions.csv")
    assert list(conds["condition"]) == ["Correct", "StaticTopK", "RandomRoute"]
    assert (conds["token_fraction"] == capacity).all()  # every condition keeps the budget, so
    assert np.allclose(conds["flops_vs_correct"], 1.0) and (conds["latency_ms"] > 0).all()  # equal FLOPs


def test_a_causal_copy_routes_by_the_predictor_and_claims_no_byte_ppl(tmp_path):
    from fcaudit.families import load_model
    from fcaudit.families.mod import causal_checkpoint, save

    model = tiny_mod()
    save(model, tmp_path / "mod", {"byte_ppl": 3.0, "seed": 0})
    copy, meta = load_model(causal_checkpoint(tmp_path / "mod", tmp_path / "causal"))
    assert copy.config.routing == "predictor" and "byte_ppl" not in meta and meta["seed"] == 0
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), copy.state_dict().values()))
    assert controller(copy).description != controller(model).description  # two controllers of one checkpoint
