"""`fcaudit demo` end to end: the whole quick demo (slow, ~30 s), a smoke of the same code path on a one-seed plan of a
few steps (slow: every family), and in the default run the same smoke of FeatureGate alone."""

import json
import re

import pandas as pd
import pytest
import torch

from fcaudit.auditor.results import load_records
from fcaudit import demo as demo_module
from fcaudit.demo import QUICK, DemoPlan, run_demo
from fcaudit.io import read_json
from fcaudit.train import train
from fcaudit.stats.effects import delta_nll


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """The quick demo as `fcaudit demo` runs it: one torch thread, so training runs in worker processes on 2 cores."""
    out = tmp_path_factory.mktemp("demo")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run_demo(out, quick=True, device="cpu")
    finally:
        torch.set_num_threads(threads)
    return out


@pytest.mark.slow
def test_a_run_trained_by_a_worker_equals_the_same_run_trained_here(demo, tmp_path):
    for model in ("featuregate", "uniform-matched"):  # the second reads the first's gate mass
        cfg = demo_module.train_config(tmp_path, QUICK, "cpu", model, 0, progress=False)  # into tmp_path/train
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # the demo's (other thread counts round differently)
        try:
            here = train(cfg)
        finally:
            torch.set_num_threads(threads)
        assert here.byte_ppl == read_json(demo / "train" / f"{model}-s0" / "metrics.json")["byte_ppl"]
        assert (tmp_path / "train" / f"{model}-s0" / "model.safetensors").read_bytes() == (
            demo / "train" / f"{model}-s0" / "model.safetensors").read_bytes()


@pytest.mark.slow
def test_table1_has_every_method(demo):
    table = pd.read_csv(demo / "table1.csv")
    assert set(table["method"]) >= {"Dense", "Uniform", "LayerStatic", "FeatureGate", "MUDD", "MoE (Mixtral)",
                                    "MoD (Mixture-of-Depths)"}
    fg = table[table["method"] == "FeatureGate"].iloc[0]
    assert fg["n"] == QUICK.seeds and 1 < fg["byte_ppl_mean"] < 256
    assert "FeatureGate" in (demo / "table1.md").read_text()


@pytest.mark.slow
def test_every_audit_replays_exactly_and_static_controllers_give_zero(demo):
    audits = sorted((demo / "audit").iterdir())
    assert len(audits) == 3 * QUICK.seeds + 5  # + mudd, moe, mod (top-k), mod-causal (its predictor), early-exit
    for a in audits:
        replay = json.loads((a / "replay.json").read_text())
        assert replay["passed"] and replay["max_abs_dlogit"] == 0.0
        if a.name.startswith("moe"):
            assert replay["route_flips"] == 0
            moe = load_records(a)
            assert set(moe[moe.condition == "StaticTopK"].active) == {2.0}  # sparse static routing, top-2
        if a.name.startswith("mod"):
            found = {f["check"]: f for f in replay["findings"]}
            assert replay["route_flips"] == 0 and found["token routing"]["line"]
            assert (found["causality"]["data"]["later_token_flips"] > 0) == (a.name == "mod-s0")  # top-k: later
        if a.name == "mod-s0":
            assert set(load_records(a).active) == {0.25}  # the tiny preset's capacity, under every condition
        if a.name == "early-exit-s0":  # its exits replayed, and every condition keeps each window's budget
            records = load_records(a)
            assert replay["route_flips"] == 0 and records.groupby("example").active.nunique().eq(1).all()
            assert 0 < records.active.mean() < 1
        if a.name.startswith(("uniform", "layerstatic")):
            d = delta_nll(load_records(a))
            assert (d[d.condition.isin(["CrossInput", "TokenShuffle", "CrossShuffle"])]["delta"] == 0.0).all()


@pytest.mark.slow
def test_report_and_execution(demo):
    html = (demo / "report" / "report.html").read_text()
    assert "data:image/png;base64" in html and "FeatureGate" in html
    execution = pd.read_csv(demo / "execution" / "execution.csv")
    by_model = execution.set_index("model")
    assert by_model.loc["featuregate", "executed_blocks"] == by_model.loc["featuregate", "n_blocks"]
    assert by_model.loc[f"fixeddepth-{QUICK.fixed_depth}", "executed_blocks"] == QUICK.fixed_depth
    assert by_model.loc["moe-mixtral", "experts_per_token"] == 2.0  # top-2 of 4 experts
    conditions = pd.read_csv(demo / "execution" / "conditions.csv")
    moe = conditions[conditions["model"] == "moe-mixtral"].set_index("condition")
    assert moe.loc["StaticTopK", "experts_per_token"] == 2.0
    assert moe.loc["StructureRemoved", "experts_per_token"] == 4.0  # every expert runs
    assert "Routed models" in html
    mod = by_model.loc["mod"]
    assert mod["token_fraction"] == 0.25 and mod["flops_vs_dense"] < 1 and mod["latency_vs_dense"] > 0
    assert (conditions[conditions["model"] == "mod"]["token_fraction"] == 0.25).all()
    early, dense = by_model.loc["early-exit"], by_model.loc["dense"]
    assert early["executed_layer_fraction"] < 1 and early["decode_flops_vs_dense"] < 1
    assert dense["executed_layer_fraction"] == 1
    headline = (demo / "report" / "report.md").read_text().split("## Training")[0]
    assert "**mod tiny**" in headline and "**mod-causal tiny**" in headline and "**early-exit tiny**" in headline
    assert "decoding: no layer skipped" in headline and "of the (layer, token) pairs run" in headline
    assert "routing depends on later tokens" in headline and "token x block pairs run" in headline


@pytest.mark.slow  # reruns the whole quick demo (~15 s on 2 cores)
def test_rerun_resumes_without_recomputing(demo):
    before = (demo / "audit" / "featuregate-s0" / "records" / "CrossInput" / "r0000.parquet").stat().st_mtime_ns
    run_demo(demo, quick=True, device="cpu")
    after = (demo / "audit" / "featuregate-s0" / "records" / "CrossInput" / "r0000.parquet").stat().st_mtime_ns
    assert before == after


SMOKE = DemoPlan(preset="tiny", mudd_preset="tiny", seeds=1, steps=4, mudd_steps=4, moe_steps=4,
                 fixed_depth=1, n_eval=4, n_calib=4, window=32, randomizations=1, batch_size=4, thresholds=(0.5,),
                 min_run_time=0.01)


@pytest.mark.slow  # eleven models trained, eight audited, ten measured (each one's decoding timed)
def test_demo_smoke_trains_audits_and_reports_every_family(tmp_path, monkeypatch, capsys):
    """The demo's whole path on a plan a few steps long: every family trained, audited with an exact replay, measured
    and reported (the full quick demo's checks are the slow tests above), ending with its time (`done in`, as the
    README quotes the demo's times)."""
    monkeypatch.setattr(demo_module, "QUICK", SMOKE)
    run_demo(tmp_path, quick=True, device="cpu")  # torch's threads: one training process (the slow tests run workers)
    assert re.search(r"^done in \d+ s: report ", capsys.readouterr().err, re.M)  # the console prints to stderr
    methods = set(pd.read_csv(tmp_path / "table1.csv")["method"])
    assert {"Dense", "FeatureGate", "MUDD", "MoE (Mixtral)", "MoD (Mixture-of-Depths)"} <= methods
    audits = sorted(a.name for a in (tmp_path / "audit").iterdir())
    assert len(audits) == 3 + 5
    assert all(json.loads((tmp_path / "audit" / a / "replay.json").read_text())["passed"] for a in audits)
    assert (tmp_path / "report" / "report.html").is_file() and (tmp_path / "execution" / "execution.csv").is_file()
    # the report opens with the three questions, execution measured in every family's audit
    rows = json.loads((tmp_path / "report" / "report.json").read_text())["three_questions"]
    assert len(rows) == len(audits)  # one seed: every audit its own family
    assert all(r["execution"].startswith("decided ") and "(observed)" in r["execution"] for r in rows), rows


def test_demo_smoke_trains_audits_and_reports_one_family(tmp_path, monkeypatch, capsys):
    """The default run's smoke of the same entry point: the demo's lists of models cut to FeatureGate alone, which is
    trained, audited with an exact replay, measured and reported (every family: the slow smoke above)."""
    monkeypatch.setattr(demo_module, "QUICK", SMOKE)
    for models, kept in (("MULTI_SEED", ("featuregate",)), ("ONE_SEED", ()), ("AUDITED", ("featuregate",)),
                         ("MEASURED", ("featuregate",))):
        monkeypatch.setattr(demo_module, models, kept)
    run_demo(tmp_path, quick=True, device="cpu")
    assert re.search(r"^done in \d+ s: report ", capsys.readouterr().err, re.M)
    assert list(pd.read_csv(tmp_path / "table1.csv")["method"]) == ["FeatureGate"]
    assert [a.name for a in (tmp_path / "audit").iterdir()] == ["featuregate-s0"]
    assert json.loads((tmp_path / "audit" / "featuregate-s0" / "replay.json").read_text())["passed"]
    assert list(pd.read_csv(tmp_path / "execution" / "execution.csv")["model"]) == ["featuregate"]
    assert not (tmp_path / "causal").exists()  # MoD's causal copy only where MoD is trained
    rows = json.loads((tmp_path / "report" / "report.json").read_text())["three_questions"]
    assert len(rows) == 1 and rows[0]["execution"].startswith("decided ") and "(observed)" in rows[0]["execution"]
