"""AuditConfig: one object from the CLI and the API to the engine, checked once, bounded, exact in config.json; and a
dry run whose plan is counted, not listed."""

from __future__ import annotations

import json
import re
import time
import tracemalloc

import pytest
import torch
from typer.testing import CliRunner

import fcaudit as fca
from fcaudit import config as cfg
from fcaudit import protocol
from fcaudit.auditor.planner import RUN_BYTES
from fcaudit.auditor.units import Schedule, share
from fcaudit.cli import app
from fcaudit.config import AuditConfig
from fcaudit.auditor.state import STATE_CHECK_PASSES
from fcaudit.controllers.checks import FLOW_CHECK_PASSES, SITE_CHECK_PASSES
from fcaudit.errors import FcauditError
from fcaudit.models.checkpoint import save_checkpoint
from fcaudit.models.featuregate import FeatureGateGPT, config_for

runner = CliRunner()


def tiny() -> FeatureGateGPT:
    torch.manual_seed(0)
    return FeatureGateGPT(config_for("tiny", "featuregate"))


def ids(n: int, seed: int, t: int = 16) -> torch.Tensor:
    return torch.randint(0, 256, (n, t), generator=torch.Generator().manual_seed(seed))


# ---- one check, one line ----------------------------------------------------------------------------------------

BAD = [  # (settings, fragment of the Python-side line)
    (dict(randomizations=0), "randomizations must be an integer >= 1, got 0"),
    (dict(randomizations=2.5), "randomizations must be an integer >= 1, got 2.5"),
    (dict(randomizations=True), "randomizations must be an integer"),
    (dict(randomizations=cfg.MAX_RANDOMIZATIONS + 1), f"at most {cfg.MAX_RANDOMIZATIONS}"),
    (dict(n_eval=1), "derangement"),
    (dict(n_eval=cfg.MAX_WINDOWS + 1), f"n_eval must be at most {cfg.MAX_WINDOWS}"),
    (dict(n_calib=0), "static profiles need at least 1"),
    (dict(n_calib=cfg.MAX_WINDOWS + 1), f"n_calib must be at most {cfg.MAX_WINDOWS}"),
    (dict(window=0), "window must be an integer >= 2"),
    (dict(window=-64), "window must be an integer >= 2"),
    (dict(window=cfg.MAX_WINDOW + 1), f"window must be at most {cfg.MAX_WINDOW}"),
    (dict(batch_size=0), "batch size must be an integer >= 1"),
    (dict(batch_size=cfg.MAX_BATCH_SIZE + 1), f"at most {cfg.MAX_BATCH_SIZE}"),
    (dict(world_size=cfg.MAX_WORLD_SIZE + 1), f"at most {cfg.MAX_WORLD_SIZE}"),
    (dict(seed=-1), "numpy's generators take no negative seed"),
    (dict(seed=2**63), f"seed must be at most {2**63 - 1}"),
    (dict(seed=1e23), "seed must be an integer"),
    (dict(tolerance=-1.0), "tolerance must be a number >= 0"),
    (dict(tolerance=float("nan")), "tolerance must be a number >= 0"),
    (dict(criteria={"small": 1}), "unknown criteria keys"),
    (dict(criteria="strict"), "criteria must be a fcaudit.Criteria or a dict"),
    (dict(loss_fn="nll"), "loss_fn must be a function"),
    (dict(dtype="float8"), "unknown dtype"),
    (dict(family=" "), "--family ''"),
    (dict(offload_folder="off"), "pass --device-map too"),
    (dict(device="cpu", device_map="auto"), "pass one"),
    (dict(device_map="auto", dry_run=True, world_size=2), "plans a run that would be refused"),
]


@pytest.mark.parametrize("settings, fragment", BAD, ids=[str(b[0]) for b in BAD])
def test_each_bad_setting_is_one_line_that_names_it(settings, fragment):
    with pytest.raises(FcauditError) as err:
        AuditConfig(**settings)
    assert fragment in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_the_command_line_names_its_flags_and_the_limit():
    with pytest.raises(FcauditError, match=r"^--randomizations 1000000000: pass an integer <= 10000 "):
        AuditConfig(randomizations=10**9, flags=True)
    with pytest.raises(FcauditError, match=r"^--window 0: pass an integer >= 2 .*leave --window out"):
        AuditConfig(window=0, flags=True)
    with pytest.raises(FcauditError, match=r"^--batch-size 0: pass an integer >= 1$"):
        AuditConfig(batch_size=0, flags=True)


def test_a_paper_scale_audit_is_far_within_every_bound():
    paper = AuditConfig(n_eval=512, n_calib=512, window=2048, randomizations=20, batch_size=8, seed=0)
    assert paper.randomizations * 100 < cfg.MAX_RANDOMIZATIONS and paper.n_eval * 100 < cfg.MAX_WINDOWS
    assert paper.window * 10 < cfg.MAX_WINDOW and paper.batch_size * 100 < cfg.MAX_BATCH_SIZE


def test_settings_round_trip_through_json_exactly():
    c = AuditConfig(randomizations=3, seed=2**63 - 1, batch_size=2, tolerance=1e-3, criteria={"small_upper": 0.01})
    saved = json.loads(json.dumps(c.to_json()))
    assert saved["seed"] == 2**63 - 1 and isinstance(saved["seed"], int)
    assert AuditConfig(**{k: saved[k] for k in ("seed", "randomizations", "batch_size", "tolerance", "criteria")}) == c


# ---- the path from the CLI to the engine --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_checkpoint(tmp_path_factory.mktemp("ckpt") / "fg", tiny(), {"variant": "featuregate"})


def test_the_largest_seed_is_recorded_exactly_and_the_audit_resumes_with_it(ckpt, tmp_path):
    seed = 2**63 - 1
    args = ["audit", str(ckpt), "--out", str(tmp_path / "a"), "--eval", "4", "--calib", "4", "--window", "16",
            "--randomizations", "1", "--batch-size", "2", "--seed", str(seed), "--quiet"]
    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.output
    text = (tmp_path / "a" / "config.json").read_text()
    assert f'"seed": {seed},' in text  # an integer literal, not 9.223372036854776e+18
    assert fca.AuditResult.load(tmp_path / "a").config["seed"] == seed
    records = {p: p.stat().st_mtime_ns for p in (tmp_path / "a" / "records").rglob("*.parquet")}
    r = runner.invoke(app, args)  # the same command resumes: nothing recomputed
    assert r.exit_code == 0, r.output
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "a" / "records").rglob("*.parquet")} == records
    other = runner.invoke(app, [*args[:-2], str(seed - 1), "--quiet"])
    assert other.exit_code == 2 and "differs in ['seed', 'windows']" in other.output, other.output


def test_the_audit_runs_with_the_settings_the_api_was_given(tmp_path):
    model = tiny()
    res = fca.audit(model, fca.controller_for(model), ids(4, 0), ids(2, 1), randomizations=2, seed=5,
                    out=tmp_path / "a", batch_size=3, tolerance=0.5, quiet=True)
    assert (res.config["randomizations"], res.config["seed"], res.config["batch_size"]) == (2, 5, 3)
    assert res.path == tmp_path / "a" and res.replay.tolerance == 0.5
    assert sorted({r for _, r in res.records.groupby(["condition", "randomization"]).size().index}) == [0, 1]
    # the same settings in one AuditConfig: the same audit (it resumes: nothing recomputed)
    records = {p: p.stat().st_mtime_ns for p in (tmp_path / "a" / "records").rglob("*.parquet")}
    given = AuditConfig(randomizations=2, seed=5, out=tmp_path / "a", batch_size=3, tolerance=0.5, quiet=True)
    again = fca.audit(model, fca.controller_for(model), ids(4, 0), ids(2, 1), config=given)
    assert again.config["config_hash"] == res.config["config_hash"]
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "a" / "records").rglob("*.parquet")} == records
    # settings given with config= replace its fields: another audit, in another directory
    other = fca.audit(model, fca.controller_for(model), ids(4, 0), ids(2, 1), config=given, out=tmp_path / "b", seed=6)
    assert (other.config["seed"], other.path, other.config["batch_size"], other.replay.tolerance) == (
        6, tmp_path / "b", 3, 0.5)
    assert given.seed == 5 and (tmp_path / "b" / "variation.json").is_file()
    unknown = {"sed": "'sed'; its settings are out, randomizations, seed",
               "n_eval": "'n_eval' (`fcaudit audit CHECKPOINT`'s"}
    passes = []
    model.register_forward_pre_hook(lambda *a: passes.append(1))
    for bad, named in unknown.items():
        with pytest.raises(FcauditError, match=rf"^fca.audit has no setting {re.escape(named)}[^\n]*AuditConfig's"):
            fca.audit(model, fca.controller_for(model), ids(4, 0), ids(2, 1), config=given, **{bad: 6})
    assert not passes  # refused before any work


# ---- the dry run's plan -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("n_eval, n_calib, batch, r, world", [(8, 4, 2, 3, 1), (9, 5, 2, 2, 3), (7, 1, 3, 1, 4),
                                                               (5, 6, 8, 4, 7), (3, 2, 1, 2, 16)])
def test_passes_per_rank_are_counted_as_share_lists_them(n_eval, n_calib, batch, r, world):
    sched = Schedule(n_eval, n_calib, batch, r, tuple(protocol.REGISTRY))
    listed = [sum(u.passes for stage in (sched.iter_stage1(), sched.iter_stage2()) for u in share(stage, k, world))
              for k in range(world)]
    assert sched.passes_per_rank(world) == listed
    assert sched.runs() == len(sched.replay_keys()) and sum(listed) == sched.forward_passes()


def test_a_dry_run_at_the_bounds_is_counted_in_a_second_without_listing_its_units():
    model = tiny()
    ctrl = fca.controller_for(model)
    ev, ca = ids(64, 0), ids(8, 1)
    fca.plan(model, ctrl, ev, ca, batch_size=1)  # warm-up: lazy tables, imports
    tracemalloc.start()
    t0 = time.perf_counter()
    p = fca.plan(model, ctrl, ev, ca, batch_size=1, randomizations=cfg.MAX_RANDOMIZATIONS,
                 world_size=cfg.MAX_WORLD_SIZE)
    seconds = time.perf_counter() - t0
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    # listing the units would hold millions of them: 64 batches x (4 randomized x 10,000 + static) runs
    sched = Schedule(64, 8, 1, cfg.MAX_RANDOMIZATIONS, tuple(p.conditions))
    world = cfg.MAX_WORLD_SIZE  # each rank runs the checks, each but rank 0 a probe of its own
    # a FeatureGate's gates: followed, not ranked; batch size 1: no batch-composition check; the state check's pass
    assert p.check_passes == SITE_CHECK_PASSES + FLOW_CHECK_PASSES + STATE_CHECK_PASSES
    assert p.forward_passes == sched.forward_passes() + world * p.check_passes + world - 1 > 2_000_000
    assert sum(p.passes_per_rank) == p.forward_passes and len(p.passes_per_rank) == cfg.MAX_WORLD_SIZE
    assert peak < 4 * 2**20 and seconds < 5, (peak, seconds)
    assert "forward passes per rank" in str(p) and len(str(p)) < 1000  # a range, not 4096 numbers


def test_the_memory_estimate_includes_the_plan():
    model = tiny()
    ctrl = fca.controller_for(model)
    small = fca.plan(model, ctrl, ids(16, 0), ids(8, 1), batch_size=4, randomizations=1)
    large = fca.plan(model, ctrl, ids(16, 0), ids(8, 1), batch_size=4, randomizations=1001)
    randomized = sum(protocol.REGISTRY[c].randomized for c in small.conditions)
    assert small.plan_bytes >= (16 + 8) * 16 * 8  # the windows' int64 token ids
    assert large.plan_bytes - small.plan_bytes == 1000 * randomized * RUN_BYTES
    assert large.peak_memory_bytes >= large.param_bytes + large.plan_bytes + 4 * large.activation_bytes
    assert "plan " in str(large)


def test_a_plan_takes_the_settings_of_the_audit_it_plans(tmp_path):
    """`fca.plan(..., **settings)` and `fca.audit(..., **settings)` read the same settings: what is planned runs."""
    model = tiny()
    ctrl = fca.controller_for(model)
    settings = dict(randomizations=2, batch_size=3, seed=1, out=tmp_path / "a", quiet=True)
    planned = fca.plan(model, ctrl, ids(6, 0), ids(4, 1), **settings)
    given = fca.plan(model, ctrl, ids(6, 0), ids(4, 1), config=AuditConfig(**settings))
    assert (planned.batch_size, planned.randomizations) == (given.batch_size, given.randomizations) == (3, 2)
    with pytest.raises(FcauditError, match=r"^fca.plan has no setting 'batch'; its settings are out, randomizations"):
        fca.plan(model, ctrl, ids(6, 0), ids(4, 1), batch=3)
    passes = []
    model.register_forward_pre_hook(lambda *a: passes.append(1))
    fca.audit(model, ctrl, ids(6, 0), ids(4, 1), **settings)
    assert len(passes) == planned.forward_passes  # the checks' passes too; the probe is the first batch's capture
