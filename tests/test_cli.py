"""The fcaudit command end to end on tiny models: train, audit, summarize, report; bad input -> one line, exit 2."""

import json

import pytest
import torch
from typer.testing import CliRunner

from fcaudit import data
from fcaudit.cli import app
from fcaudit.models.checkpoint import save_checkpoint
from fcaudit.models.featuregate import FeatureGateGPT, config_for

runner = CliRunner()


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


def one_line_error(result, *fragments):
    assert result.exit_code == 2, result.output
    lines = [l for l in result.output.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    for f in fragments:
        assert f in lines[0], lines[0]


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("ckpt") / "fg"
    save_checkpoint(path, FeatureGateGPT(config_for("tiny", "featuregate")), {"variant": "featuregate"})
    return path


def test_train_audit_summarize_report(tmp_path):
    r = run("train", "--model", "layerstatic", "--preset", "tiny", "--steps", "3", "--out", tmp_path / "ls")
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "ls" / "metrics.json").read_text())["byte_ppl"] > 1
    r = run("audit", tmp_path / "ls", "--out", tmp_path / "a", "--eval", 4, "--calib", 4, "--window", 32,
            "--randomizations", 2, "--batch-size", 2, "--quiet")
    assert r.exit_code == 0, r.output
    replay = json.loads((tmp_path / "a" / "replay.json").read_text())
    assert replay["passed"] and replay["max_abs_dlogit"] == 0.0
    r = run("summarize", tmp_path / "a", "--out", tmp_path / "s")
    assert r.exit_code == 0, r.output
    r = run("report", tmp_path / "ls", tmp_path / "s", "--out", tmp_path / "rep")
    assert r.exit_code == 0, r.output
    assert (tmp_path / "rep" / "report.html").is_file()


def test_unknown_model_writes_nothing(tmp_path):
    one_line_error(run("train", "--model", "gpt-9", "--out", tmp_path / "x"), "unknown model")
    assert not (tmp_path / "x").exists()


def test_missing_and_corrupt_checkpoints(tmp_path, tiny_ckpt):
    one_line_error(run("audit", tmp_path / "nope", "--out", tmp_path / "a"), "no checkpoint directory")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((tiny_ckpt / "config.json").read_text())
    (bad / "model.safetensors").write_bytes(b"not a safetensors file")
    one_line_error(run("audit", bad, "--out", tmp_path / "a"))
    mism = tmp_path / "mism"
    mism.mkdir()
    cfg = json.loads((tiny_ckpt / "config.json").read_text())
    cfg["d_model"] = 48
    (mism / "config.json").write_text(json.dumps(cfg))
    (mism / "model.safetensors").write_bytes((tiny_ckpt / "model.safetensors").read_bytes())
    one_line_error(run("audit", mism, "--out", tmp_path / "a"))
    assert not (tmp_path / "a").exists()


def test_offline_corpus_and_long_window(tmp_path, tiny_ckpt, monkeypatch):
    monkeypatch.setattr(data, "hub_reachable", lambda: False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    one_line_error(run("audit", tiny_ckpt, "--corpus", "wikitext-103", "--out", tmp_path / "a"), "--corpus PATH")
    small = tmp_path / "small.txt"
    small.write_text("x" * 2000)
    one_line_error(run("audit", tiny_ckpt, "--corpus", small, "--window", 128, "--eval", 4, "--calib", 4,
                       "--out", tmp_path / "a"), "longer than")
    assert not (tmp_path / "a").exists()


def test_one_eval_window_is_refused(tmp_path, tiny_ckpt):
    one_line_error(run("audit", tiny_ckpt, "--eval", 1, "--calib", 2, "--window", 32, "--out", tmp_path / "a"),
                   "derangement")
    assert not (tmp_path / "a").exists()


def test_dry_run_prints_plan(tmp_path, tiny_ckpt):
    r = run("audit", tiny_ckpt, "--eval", 8, "--calib", 8, "--window", 32, "--dry-run", "--out", tmp_path / "a")
    assert r.exit_code == 0, r.output
    assert "store" in r.output.lower() and not (tmp_path / "a").exists()
    assert "note:" not in r.output


def test_a_corpus_too_repetitive_for_the_windows_asked_is_refused_alike_by_a_dry_run_and_the_run(tmp_path, tiny_ckpt):
    (tmp_path / "repeats.txt").write_text("abcd" * 20_000)  # every window of its splits is the same text
    args = ("audit", tiny_ckpt, "--corpus", tmp_path / "repeats.txt", "--eval", 8, "--calib", 8, "--window", 32)
    for dry in (("--dry-run",), ()):
        one_line_error(run(*args, *dry, "--out", tmp_path / "a"),
                       "the test split has only 1 window(s) of 32 tokens whose text is distinct, not 8")
        assert not (tmp_path / "a").exists()


def test_hf_checkpoints_audited_under_one_family_are_pooled_as_seeds_and_a_moved_one_resumes(tmp_path, monkeypatch):
    """Hugging Face checkpoints carry no variant: without --family each is its own family (its directory name);
    --family pools them. A checkpoint moved after its audit (or named as ./dir) resumes that audit."""
    from fcaudit.families.hf.tiny import tiny_moe

    for seed in (0, 1):
        tiny_moe("mixtral", seed=seed).save_pretrained(tmp_path / f"mix-s{seed}")
    args = ["--eval", 4, "--calib", 4, "--window", 16, "--randomizations", 1, "--batch-size", 2, "--quiet"]
    for seed in (0, 1):
        r = run("audit", tmp_path / f"mix-s{seed}", "--out", tmp_path / f"a{seed}", "--family", "mixtral seeds", *args)
        assert r.exit_code == 0, r.output
    assert run("summarize", tmp_path / "a0", tmp_path / "a1", "--out", tmp_path / "s").exit_code == 0
    groups = json.loads((tmp_path / "s" / "summary.json").read_text())["groups"]
    assert list(groups) == ["mixtral seeds"] and groups["mixtral seeds"]["n_checkpoints"] == 2
    records = {p: p.stat().st_mtime_ns for p in (tmp_path / "a0" / "records").rglob("*.parquet")}
    (tmp_path / "mix-s0").rename(tmp_path / "moved")
    monkeypatch.chdir(tmp_path)
    r = run("audit", "./moved", "--out", tmp_path / "a0", "--family", "mixtral seeds", *args)
    assert r.exit_code == 0, r.output
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "a0" / "records").rglob("*.parquet")} == records
    assert json.loads((tmp_path / "a0" / "config.json").read_text())["model"]["checkpoint"] == "./moved"


def test_a_full_disk_is_one_line_that_says_the_rerun_resumes(tiny_ckpt, tmp_path, monkeypatch):
    import errno

    from fcaudit.auditor import files

    def full(path, *a, **k):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(files, "write_tensors", full)
    r = run("audit", tiny_ckpt, "--out", tmp_path / "a", "--eval", 4, "--calib", 4, "--window", 16,
            "--randomizations", 1, "--quiet")
    one_line_error(r, "no space left on the device", ".safetensors", "resumes")


def test_a_dry_run_into_an_existing_audit_says_whether_the_real_run_resumes_or_refuses_it(tiny_ckpt, tmp_path):
    args = ["--out", tmp_path / "a", "--eval", 4, "--calib", 4, "--window", 16, "--randomizations", 1]
    assert run("audit", tiny_ckpt, *args, "--quiet").exit_code == 0
    same = run("audit", tiny_ckpt, *args, "--dry-run")
    assert same.exit_code == 0 and "holds this audit: the real run resumes it" in same.output
    other = run("audit", tiny_ckpt, *args, "--seed", 3, "--dry-run")
    assert other.exit_code == 0 and "differs in ['seed', 'windows']" in other.output, other.output
    assert run("audit", tiny_ckpt, *args[:1], tmp_path / "new", *args[2:], "--dry-run").output.count("note:") == 0
