"""What an audit directory left in a damaged or interrupted state says, and how the rerun leads out: a marker with
flipped bits, the calibration sums a stop just after the profiles leaves, an unfinished audit given to report."""

from __future__ import annotations

import shutil
from pathlib import Path

import pandas as pd

import fcaudit as fca
from fcaudit.io import OutDir
from harness import api_refusal, cli, fg_ckpt, ok, refusal, tree

AUDIT = ["--eval", "4", "--calib", "4", "--window", "16", "--randomizations", "1", "--batch-size", "2", "--quiet",
         "--device", "cpu"]


def flipped(data: bytes, *at: int) -> bytes:
    out = bytearray(data)
    for i in at:
        out[i] ^= 1
    return bytes(out)


def records(out: Path) -> dict[str, pd.DataFrame]:
    return {str(p.relative_to(out)): pd.read_parquet(p) for p in sorted((out / "records").rglob("*.parquet"))}


def test_a_marker_with_two_flipped_bits_is_rewritten_from_config_json_and_the_audit_resumes(tmp_path):
    ckpt = fg_ckpt(tmp_path)
    ok(cli("audit", ckpt, *AUDIT, "--out", tmp_path / "a"))
    marker = tmp_path / "a" / ".fcaudit-audit"
    intact, text = marker.read_bytes(), marker.read_text()
    # one bit in the name of its hash field (so the hash goes unchecked), one in the configuration hash it holds
    marker.write_bytes(flipped(intact, text.index('"_sha256"') + 7, text.index('"config_hash": "') + 16))
    kept = tree(tmp_path / "a" / "records")
    r = cli("audit", ckpt, *[a for a in AUDIT if a != "--quiet"], "--out", tmp_path / "a")  # says what it redid
    ok(r)
    assert ".fcaudit-audit (damaged or cut short: rewritten with config.json's hash)" in r.output
    assert "config.json unreadable" not in r.output
    assert marker.read_bytes() == intact and tree(tmp_path / "a" / "records") == kept
    # another configuration over it is refused with what really differs
    marker.write_bytes(flipped(intact, text.index('"_sha256"') + 7, text.index('"config_hash": "') + 16))
    line = refusal(cli("audit", ckpt, *AUDIT, "--seed", "1", "--out", tmp_path / "a"))
    assert "holds an audit with a different configuration (differs in ['seed'" in line


def test_report_on_an_unfinished_audit_says_what_summarize_says(tmp_path):
    ok(cli("audit", fg_ckpt(tmp_path), *AUDIT, "--out", tmp_path / "a"))
    shutil.rmtree(tmp_path / "a" / "records")  # stopped in stage 2: its part files, no records yet
    for name in ("replay.json", "variation.json"):
        (tmp_path / "a" / name).unlink()
    said = refusal(cli("summarize", tmp_path / "a", "--out", tmp_path / "s"))
    assert "is an unfinished audit" in said
    assert refusal(cli("report", tmp_path / "a", "--out", tmp_path / "r")) == said
    assert refusal(cli("report", tmp_path, "--out", tmp_path / "r")) == said  # found below a directory too


def test_windows_refuses_a_tokenizer_that_is_not_one():
    line = api_refusal(lambda: fca.windows(n_eval=2, n_calib=2, window=8, tokenizer=5))
    assert line.startswith("tokenizer=5: pass a tokenizers.Tokenizer")


def test_calibration_sums_left_by_a_stop_just_after_the_profiles_are_removed_by_the_rerun(tmp_path, monkeypatch):
    """The state a SIGINT between writing profiles.safetensors and removing calib/ leaves, made by stopping there."""
    ckpt = fg_ckpt(tmp_path)
    ok(cli("audit", ckpt, *AUDIT, "--out", tmp_path / "whole"))
    remove_tree = OutDir.remove_tree

    def interrupted(self, path):
        if Path(path).name == "calib":
            raise KeyboardInterrupt
        return remove_tree(self, path)

    with monkeypatch.context() as m:
        m.setattr(OutDir, "remove_tree", interrupted)
        r = cli("audit", ckpt, *AUDIT, "--out", tmp_path / "a")
    assert r.exit_code == 130, r.output
    assert (tmp_path / "a" / "profiles.safetensors").is_file()
    assert sorted(p.name for p in (tmp_path / "a" / "calib").iterdir()) == ["sum_0000000.safetensors",
                                                                            "sum_0000002.safetensors"]
    ok(cli("audit", ckpt, *AUDIT, "--out", tmp_path / "a"))
    assert not (tmp_path / "a" / "calib").exists()
    got, whole = records(tmp_path / "a"), records(tmp_path / "whole")
    assert got.keys() == whole.keys() and all(got[k].equals(whole[k]) for k in got)
