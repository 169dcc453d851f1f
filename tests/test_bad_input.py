"""Bad input through the `fcaudit` command: one line `error: ...` that names the fix, exit code 2, nothing left behind.

Each row builds its inputs in the test's own directory and runs one command; the whole directory must be the same
before and after (no output directory, no stray file, no changed input).
"""

from __future__ import annotations

import json
import os
import tempfile
from fractions import Fraction
from pathlib import Path
from typing import Callable

import pytest
import torch

from fcaudit.errors import FcauditError
from fcaudit.models.featuregate import FeatureGateGPT, config_for
from fcaudit.models.muddpythia import BYTE_PRESETS, MUDDPythia
from harness import an_audit, api_refusal, cli, fg_ckpt, moe_ckpt, mudd_ckpt, ok, refusal, tree, user_file


# ---- inputs ---------------------------------------------------------------------------------------------------

def mudd_pickle_shard(tmp: Path) -> Path:
    """A MUDD checkpoint whose weights are one pickle shard listed in pytorch_model.bin.index.json."""
    d = mudd_ckpt(tmp)
    state = MUDDPythia(BYTE_PRESETS["tiny"]).state_dict()
    (d / "model.safetensors").unlink()
    shard = "pytorch_model-00001-of-00001.bin"
    torch.save({**state, "extra": Fraction(1, 3)}, d / shard)  # a global that weights_only=True refuses
    (d / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": {k: shard for k in state}}))
    return d


def truncated(d: Path) -> Path:
    """`d` with its weights file cut short."""
    weights = d / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    return d


def with_tokenizer(d: Path, text: str) -> Path:
    (d / "tokenizer.json").write_text(text)
    return d


def device_map_file(tmp: Path, text: str | None = None) -> Path:
    """A --device-map JSON file: by default one that puts the tiny Mixtral's second layer on disk."""
    f = tmp / "map.json"
    f.write_text(text if text is not None else json.dumps(
        {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk",
         "model.norm": "cpu", "lm_head": "cpu"}))
    return f


def small_text(tmp: Path) -> Path:
    f = tmp / "small.txt"
    f.write_text("a few words of text, repeated. " * 16)  # 5% of it validates: 25 bytes
    return f


def a_file(tmp: Path) -> Path:
    return user_file(tmp, "taken.txt", "a file the user made\n")


def garbage_summary(tmp: Path) -> Path:
    d = tmp / "summary"
    d.mkdir()
    (d / "summary.json").write_text("{ this is not json")
    return d


def wrong_summary(tmp: Path) -> Path:
    d = tmp / "summary2"
    d.mkdir()
    (d / "summary.json").write_text(json.dumps({"groups": {}, "conditions": "nope"}))
    return d


def read_only_dir(tmp: Path) -> Path:
    """A directory nobody may write to: chmod 555 for a normal user; root ignores modes, so root gets /sys."""
    if os.geteuid() != 0:
        d = tmp / "ro"
        d.mkdir()
        d.chmod(0o555)
        return d
    try:
        tempfile.TemporaryFile(dir="/sys").close()
    except OSError:
        return Path("/sys")
    pytest.skip("no read-only directory available to root here")


# ---- the table ------------------------------------------------------------------------------------------------
# (id, args built from the test directory, fragment of the error line)
Row = tuple[str, Callable[[Path], list], str]

TRAIN = "train --preset tiny --steps 6".split()
ROWS: list[Row] = [
    # training hyperparameters and hints
    ("train-negative-lr", lambda t: [*TRAIN, "--lr", -1, "--out", t / "run"], "--lr -1.0"),
    ("train-diverging-lr", lambda t: [*TRAIN, "--lr", 1e6, "--out", t / "run"], "smaller --lr"),
    ("train-zero-steps", lambda t: ["train", "--steps", 0, "--out", t / "run"], "--steps 0"),
    ("train-fixeddepth-without-depth", lambda t: ["train", "--model", "fixeddepth", "--out", t / "run"], "--depth K"),
    ("train-uniform-matched-without-mass", lambda t: ["train", "--model", "uniform-matched", "--out", t / "run"],
     "--matched-to"),
    ("train-gate-value-out-of-range", lambda t: ["train", "--model", "uniform-fixed", "--gate-value", 1.5,
                                                 "--out", t / "run"], "--gate-value 1.5"),
    ("train-zero-threads", lambda t: [*TRAIN, "--threads", 0, "--out", t / "run"], "--threads 0"),
    ("train-corpus-too-small", lambda t: [*TRAIN, "--corpus", small_text(t), "--out", t / "run"],
     "shorter than one window"),
    ("train-negative-seed", lambda t: [*TRAIN, "--seed", -1, "--out", t / "run"], "--seed -1"),
    ("train-depth-for-another-model", lambda t: [*TRAIN, "--depth", 2, "--out", t / "run"], "--depth is for"),
    ("train-gate-value-for-another-model", lambda t: [*TRAIN, "--gate-value", 0.5, "--out", t / "run"],
     "--gate-value is for"),
    # --out that cannot be written
    ("train-out-is-a-file", lambda t: [*TRAIN, "--out", a_file(t)], "existing file"),
    ("train-out-below-a-file", lambda t: [*TRAIN, "--out", a_file(t) / "run"], "below the file"),
    ("train-out-read-only", lambda t: [*TRAIN, "--out", read_only_dir(t) / "run"], "cannot write"),
    ("train-out-holds-a-checkpoint", lambda t: [*TRAIN, "--out", moe_ckpt(t)], "not an fcaudit training run directory"),
    ("train-out-holds-an-audit", lambda t: [*TRAIN, "--out", an_audit(t)], "not an fcaudit training run directory"),
    ("summarize-out-is-a-file", lambda t: ["summarize", t, "--out", a_file(t)], "existing file"),
    ("summarize-out-read-only", lambda t: ["summarize", t, "--out", read_only_dir(t) / "s"], "cannot write"),
    ("report-out-is-a-file", lambda t: ["report", fg_ckpt(t), "--out", a_file(t)], "existing file"),
    ("report-out-below-a-file", lambda t: ["report", fg_ckpt(t), "--out", a_file(t) / "r"], "below the file"),
    ("report-out-read-only", lambda t: ["report", fg_ckpt(t), "--out", read_only_dir(t) / "r"], "cannot write"),
    ("execution-out-is-a-file", lambda t: ["execution", fg_ckpt(t), "--out", a_file(t)], "existing file"),
    ("execution-out-read-only", lambda t: ["execution", fg_ckpt(t), "--out", read_only_dir(t) / "e"],
     "cannot write"),
    # --out holding another command's output
    ("summarize-out-holds-a-checkpoint", lambda t: ["summarize", t, "--out", fg_ckpt(t)], "holds a checkpoint"),
    ("report-out-holds-a-checkpoint", lambda t: ["report", fg_ckpt(t), "--out", fg_ckpt(t)], "holds a checkpoint"),
    ("execution-out-holds-a-checkpoint", lambda t: ["execution", fg_ckpt(t), "--out", fg_ckpt(t)],
     "is the checkpoint"),
    ("summarize-a-checkpoint", lambda t: ["summarize", fg_ckpt(t), "--out", t / "s"], "audit it first"),
    # report inputs
    ("report-garbage-summary", lambda t: ["report", garbage_summary(t), "--out", t / "rep"],
     "not a summary written by fcaudit"),
    ("report-summary-without-tables", lambda t: ["report", wrong_summary(t), "--out", t / "rep"],
     "not a summary written by fcaudit"),
    # execution options
    ("execution-negative-threshold-windows", lambda t: ["execution", fg_ckpt(t), "--threshold", 0.5,
                                                        "--threshold-windows", -1, "--out", t / "e"],
     "--threshold-windows -1"),
    ("execution-same-checkpoint-twice", lambda t: ["execution", fg_ckpt(t), fg_ckpt(t), "--out", t / "e"],
     "given twice"),
    ("execution-zero-min-run-time", lambda t: ["execution", fg_ckpt(t), "--min-run-time", 0, "--out", t / "e"],
     "--min-run-time 0"),
    # weights stored as pickle
    ("audit-pickle-shard", lambda t: ["audit", mudd_pickle_shard(t), "--out", t / "a"], "not a plain weights file"),
]
# config.json values that no model can have, for both families and both commands that load checkpoints
for family, make in (("featuregate", fg_ckpt), ("mudd", mudd_ckpt)):
    for field, value in (("n_head", 0), ("block_size", -1), ("norm_eps", "abc")):
        for cmd in ("audit", "execution"):
            ROWS.append((f"{cmd}-{family}-{field}",
                         lambda t, make=make, field=field, value=value, cmd=cmd: [cmd, make(t, **{field: value}),
                                                                                  "--out", t / "out"],
                         field))

# Audit cases: settings, bounds, output directories, checkpoints that do not load.
AUDIT = ["--eval", 4, "--calib", 4, "--window", 32]
ENGINE_ROWS: list[Row] = [
    ("audit-one-eval-window", lambda t: ["audit", fg_ckpt(t), "--eval", 1, "--calib", 2, "--window", 32,
                                         "--out", t / "a"], "derangement"),
    ("audit-zero-eval-windows", lambda t: ["audit", fg_ckpt(t), "--eval", 0, "--calib", 2, "--window", 32,
                                           "--out", t / "a"], "--eval"),
    ("audit-zero-calib-windows", lambda t: ["audit", fg_ckpt(t), "--eval", 4, "--calib", 0, "--window", 32,
                                            "--out", t / "a"], "--calib"),
    ("audit-zero-randomizations", lambda t: ["audit", fg_ckpt(t), *AUDIT, "--randomizations", 0, "--out", t / "a"],
     "--randomizations 0: pass an integer >= 1"),
    ("audit-dry-run-negative-randomizations", lambda t: ["audit", fg_ckpt(t), *AUDIT, "--randomizations", -1,
                                                         "--dry-run", "--out", t / "a"], "randomizations"),
    ("audit-zero-batch-size", lambda t: ["audit", fg_ckpt(t), *AUDIT, "--batch-size", 0, "--out", t / "a"],
     "--batch-size 0: pass an integer >= 1"),
    ("audit-out-is-a-file", lambda t: ["audit", fg_ckpt(t), *AUDIT, "--out", a_file(t)], "existing file"),
    ("audit-out-below-a-file", lambda t: ["audit", fg_ckpt(t), *AUDIT, "--out", a_file(t) / "x"], "below the file"),
    ("audit-out-read-only", lambda t: ["audit", fg_ckpt(t), *AUDIT, "--out", read_only_dir(t) / "a"],
     "cannot write"),
    ("audit-out-someone-elses-directory", lambda t: ["audit", fg_ckpt(t), *AUDIT, "--out", fg_ckpt(t)],
     "is the checkpoint"),
    # --device-map (accelerate spreading a Hugging Face model)
    # Hugging Face checkpoints that do not load or route
    ("audit-moe-config-not-fitting-weights", lambda t: ["audit", moe_ckpt(t, num_local_experts=6), *AUDIT,
                                                       "--out", t / "a"], "config.json does not fit the weights"),
    ("audit-moe-truncated-weights", lambda t: ["audit", truncated(moe_ckpt(t)), *AUDIT, "--out", t / "a"],
     "SafetensorError"),
    ("audit-moe-top-k-above-experts", lambda t: ["audit", moe_ckpt(t, num_experts_per_tok=5), *AUDIT,
                                                 "--out", t / "a"], "top_k 5 of 4 experts"),
    ("audit-window-beyond-the-context", lambda t: ["audit", moe_ckpt(t, max_position_embeddings=16), *AUDIT,
                                                   "--out", t / "a"], "exceed the model's context of 16"),
    ("audit-dry-run-window-beyond-the-context", lambda t: ["audit", moe_ckpt(t, max_position_embeddings=16), *AUDIT,
                                                           "--dry-run", "--out", t / "a"], "--window 16"),
    ("audit-moe-torn-tokenizer", lambda t: ["audit", with_tokenizer(moe_ckpt(t), "{}"), *AUDIT, "--out", t / "a"],
     "not a tokenizers JSON file"),
    ("audit-negative-seed", lambda t: ["audit", fg_ckpt(t), *AUDIT, "--seed", -1, "--out", t / "a"],
     "--seed -1: pass an integer >= 0"),
    # bounds (fcaudit.config): refused before the checkpoint is read, so a dry run answers at once
    ("audit-randomizations-above-the-limit", lambda t: ["audit", fg_ckpt(t), *AUDIT, "--randomizations", 10**6,
                                                        "--out", t / "a"], "--randomizations 1000000: pass an "
                                                                           "integer <= 10000 (fcaudit's limit)"),
    ("audit-dry-run-a-billion-randomizations", lambda t: ["audit", fg_ckpt(t), *AUDIT, "--randomizations", 10**9,
                                                          "--dry-run", "--out", t / "a"], "integer <= 10000"),
    ("audit-eval-above-the-limit", lambda t: ["audit", fg_ckpt(t), "--eval", 2**20 + 1, "--calib", 4, "--window", 32,
                                              "--out", t / "a"], "--eval 1048577: pass an integer <= 1048576"),
    ("audit-calib-above-the-limit", lambda t: ["audit", fg_ckpt(t), "--eval", 4, "--calib", 2**20 + 1, "--window", 32,
                                               "--dry-run", "--out", t / "a"], "--calib 1048577: pass an integer <="),
    ("audit-window-above-the-limit", lambda t: ["audit", fg_ckpt(t), "--eval", 4, "--calib", 4, "--window",
                                                2**17 + 1, "--out", t / "a"], "--window 131073: pass an integer <="),
    ("audit-window-zero", lambda t: ["audit", fg_ckpt(t), "--eval", 4, "--calib", 4, "--window", 0, "--out", t / "a"],
     "--window 0: pass an integer >= 2"),
    ("audit-window-negative", lambda t: ["audit", fg_ckpt(t), "--eval", 4, "--calib", 4, "--window", -64,
                                         "--out", t / "a"], "--window -64: pass an integer >= 2"),
    ("audit-window-one", lambda t: ["audit", fg_ckpt(t), "--eval", 4, "--calib", 4, "--window", 1, "--out", t / "a"],
     "--window 1: pass an integer >= 2"),
    ("audit-batch-size-above-the-limit", lambda t: ["audit", fg_ckpt(t), *AUDIT, "--batch-size", 4097,
                                                    "--out", t / "a"], "--batch-size 4097: pass an integer <= 4096"),
    ("audit-dry-run-world-size-above-the-limit", lambda t: ["audit", fg_ckpt(t), *AUDIT, "--dry-run", "--world-size",
                                                            10**6, "--out", t / "a"], "--world-size 1000000: pass"),
    ("audit-seed-above-int64", lambda t: ["audit", fg_ckpt(t), *AUDIT, "--seed", 2**63, "--out", t / "a"],
     f"--seed {2**63}: pass an integer <= {2**63 - 1}"),
    ("audit-revision-of-a-local-directory", lambda t: ["audit", fg_ckpt(t), *AUDIT, "--revision", "abc",
                                                       "--out", t / "a"], "is a local directory: drop --revision"),
    ("audit-offload-folder-without-device-map", lambda t: ["audit", moe_ckpt(t), *AUDIT, "--offload-folder",
                                                           t / "off", "--out", t / "a"], "pass --device-map too"),
    ("audit-dry-run-device-map-for-two-ranks", lambda t: ["audit", moe_ckpt(t), *AUDIT, "--device-map", "auto",
                                                          "--dry-run", "--world-size", 2, "--out", t / "a"],
     "plans a run that would be refused"),
    ("audit-device-map-unknown", lambda t: ["audit", moe_ckpt(t), *AUDIT, "--device-map", "fastest",
                                            "--out", t / "a"], "a JSON file of"),
    ("audit-device-map-not-json", lambda t: ["audit", moe_ckpt(t), *AUDIT, "--device-map",
                                             device_map_file(t, "{layers: 0"), "--out", t / "a"], "not valid JSON"),
    ("audit-device-map-not-an-object", lambda t: ["audit", moe_ckpt(t), *AUDIT, "--device-map",
                                                  device_map_file(t, "[0, 1]"), "--out", t / "a"], "JSON object"),
    ("audit-device-map-and-device", lambda t: ["audit", moe_ckpt(t), *AUDIT, "--device-map", "auto", "--device",
                                               "cpu", "--out", t / "a"], "pass one"),
    ("audit-device-map-of-featuregate", lambda t: ["audit", fg_ckpt(t), *AUDIT, "--device-map", "auto",
                                                   "--out", t / "a"], "runs on one device"),
    ("audit-device-map-on-cuda-without-cuda", lambda t: ["audit", moe_ckpt(t), *AUDIT, "--device-map",
                                                         device_map_file(t, '{"": "cuda:0"}'), "--out", t / "a"],
     "no CUDA device is visible"),
    ("audit-device-map-unknown-device", lambda t: ["audit", moe_ckpt(t), *AUDIT, "--device-map",
                                                   device_map_file(t, '{"": "gpu7"}'), "--out", t / "a"],
     "unknown device 'gpu7'"),
    ("audit-device-map-leaving-modules-out", lambda t: [
        "audit", moe_ckpt(t), *AUDIT, "--device-map", device_map_file(t, '{"model.layers.1": "disk", "lm_head": "cpu"}'),
        "--offload-folder", t / "off", "--out", t / "a"], "give every module a device"),
    ("audit-offload-folder-is-the-out", lambda t: ["audit", moe_ckpt(t), *AUDIT, "--device-map", device_map_file(t),
                                                   "--offload-folder", t / "a", "--out", t / "a"],
     "is the audit's --out or the checkpoint"),
    ("audit-device-map-disk-without-folder", lambda t: ["audit", moe_ckpt(t), *AUDIT, "--device-map",
                                                        device_map_file(t), "--out", t / "a"], "--offload-folder"),
]


@pytest.mark.parametrize("name, build, fragment", ROWS + ENGINE_ROWS, ids=[r[0] for r in ROWS + ENGINE_ROWS])
def test_bad_input_is_one_line_exit_2_and_leaves_nothing(tmp_path, name, build, fragment):
    args = build(tmp_path)
    before = tree(tmp_path)
    line = refusal(cli(*args))
    assert fragment in line, line
    assert tree(tmp_path) == before, "a failed command left something behind or changed its input"


def test_a_failed_train_does_not_block_the_corrected_command(tmp_path):
    """The issue's sequence: a diverging --lr, then the same command with a sane one, in the same --out."""
    out = tmp_path / "run"
    refusal(cli(*TRAIN, "--lr", "1e6", "--out", out))
    ok(cli(*TRAIN, "--steps", "2", "--out", out))
    assert (out / "metrics.json").is_file()


def test_divergence_after_a_checkpoint_keeps_the_last_good_state(tmp_path, monkeypatch):
    from fcaudit import train as train_mod
    from fcaudit.io import read_json

    real = train_mod.token_nll
    calls = {"n": 0}

    def nan_after_first_eval(logits, ids):  # finite for 3 training steps (+ 1 validation pass), then NaN
        calls["n"] += 1
        nll = real(logits, ids)
        return nll * float("nan") if calls["n"] > 4 else nll

    monkeypatch.setattr(train_mod, "token_nll", nan_after_first_eval)
    cfg = train_mod.TrainConfig(model="dense", preset="tiny", steps=6, eval_interval=3, eval_windows=1,
                                test_windows=2, batch_size=2, out=str(tmp_path / "run"), progress=False)
    with pytest.raises(train_mod.FcauditError, match=r"step 3\) is kept"):
        train_mod.train(cfg)
    assert read_json(tmp_path / "run" / "latest.json")["step"] == 3
    assert not (tmp_path / "run" / "metrics.json").exists()


def test_resume_removes_stale_temp_files(tmp_path):
    from fcaudit.io import OutDir
    from fcaudit.train import TrainConfig, train

    cfg = dict(model="dense", preset="tiny", steps=2, eval_interval=1, eval_windows=1, test_windows=2, batch_size=2,
               out=str(tmp_path / "run"), progress=False)
    run = tmp_path / "run"
    OutDir(run, "training run").claim()  # a run marks its directory first
    (run / "ckpt" / ".tmp-step-000002").mkdir(parents=True)  # as left by a kill inside _save_state
    (run / "train_config.json").write_text("{}")  # a run writes it before its first step
    (run / ".model.safetensors.abcd1234.tmp").write_bytes(b"half")  # as left by a kill inside atomic_write
    (run / "notes.tmp").write_text("the user's own file")  # not fcaudit's pattern: must survive
    train(TrainConfig(**cfg))
    assert not (run / "ckpt" / ".tmp-step-000002").exists() and not (run / ".model.safetensors.abcd1234.tmp").exists()
    assert (run / "notes.tmp").read_text() == "the user's own file"


# ---- the Python API: fcaudit.audit(...) ---------------------------------------------------------------------------

def _api_case(tmp: Path, **change):
    """Arguments of a good fca.audit call on a tiny FeatureGate, with `change` applied."""
    import fcaudit as fca

    torch.manual_seed(0)
    model = FeatureGateGPT(config_for("tiny", "featuregate"))
    ids = lambda n, seed: torch.randint(0, 256, (n, 16), generator=torch.Generator().manual_seed(seed))  # noqa: E731
    kw = dict(model=model, controller=fca.controller_for(model), eval_windows=ids(4, 0), calib_windows=ids(2, 1),
              randomizations=1, out=tmp / "a", quiet=True)
    kw.update({k: (v(kw) if callable(v) and k != "loss_fn" else v) for k, v in change.items()})
    return kw


def _nan_head(kw):
    """NaN in the output path only (the LM head), the controller untouched."""
    model = kw["model"]
    with torch.no_grad():
        model.ln_f.bias.fill_(float("nan"))
    return model


API_ROWS = [
    ("negative-token-ids", dict(eval_windows=lambda kw: kw["eval_windows"] - 300), "token ids range"),
    ("token-ids-beyond-the-vocabulary", dict(eval_windows=lambda kw: kw["eval_windows"] + 256), "token ids range"),
    ("out-is-a-file", dict(out=lambda kw: a_file(kw["out"].parent)), "existing file"),
    ("fractional-randomizations", dict(randomizations=2.5), "randomizations must be an integer"),
    ("randomizations-above-the-limit", dict(randomizations=10**9), "randomizations must be at most 10000"),
    ("seed-above-int64", dict(seed=2**64), f"seed must be at most {2**63 - 1}"),
    ("float-seed", dict(seed=1e23), "seed must be an integer >= 0"),
    ("scalar-loss", dict(loss_fn=lambda out, ids: out.float().mean()), "loss_fn returned ()"),
    ("nan-only-in-the-output-path", dict(model=_nan_head), "logits on the first evaluation batch are non-finite"),
    ("one-evaluation-window", dict(eval_windows=lambda kw: kw["eval_windows"][:1]), "at least 2"),
    ("not-a-controller", dict(controller="blocks.*.gate"), "must be a fcaudit.Controller"),
    ("unknown-criteria", dict(criteria={"small": 1}), "unknown criteria keys"),
]


@pytest.mark.parametrize("name, change, fragment", API_ROWS, ids=[r[0] for r in API_ROWS])
def test_bad_python_api_input_is_one_line_and_leaves_nothing(tmp_path, name, change, fragment):
    import fcaudit as fca

    kw = _api_case(tmp_path, **change)
    before = tree(tmp_path)
    assert fragment in api_refusal(lambda: fca.audit(**kw))
    assert tree(tmp_path) == before, "a failed audit left something behind"


def test_a_mistyped_path_beside_an_existing_directory_is_named_as_such(tmp_path, monkeypatch):
    """"runs/fg-s9" with runs/ here: a path with a typo, most likely, though a hub repository of that name is tried
    first (a folder named after a hub organization may be beside it)."""
    from fcaudit import hub

    (tmp_path / "runs").mkdir()
    monkeypatch.chdir(tmp_path)

    def offline(name, *a, **k):
        raise FcauditError(f"cannot fetch {name} from the Hugging Face hub")

    monkeypatch.setattr(hub, "snapshot", offline)
    line = refusal(cli("audit", "runs/fg-s9", "--out", "a"))
    assert "in the existing directory runs, nor a hub repository" in line and "check the path" in line
