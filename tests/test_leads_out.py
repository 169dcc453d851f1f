"""Every message that says "rerun" leads out of the state it names: run the command, do what its one line says, run
the same command again, and it succeeds. The messages about audit directories are rows of tests/test_fuzz.py's
tables (its player follows each refusal's instruction); these are the others: training runs, output directories,
an interrupted command and a full disk."""

from __future__ import annotations

import errno
import json
import shutil
from pathlib import Path
from typing import Callable

import pytest

from fcaudit import data
from fcaudit.auditor import files
from harness import cli, fg_ckpt, ok, refusal

TRAIN = ["train", "--preset", "tiny", "--steps", "2", "--batch-size", "2"]
AUDIT = ["--eval", "2", "--calib", "2", "--window", "8", "--randomizations", "1", "--quiet"]


def trained(t: Path) -> Path:
    ok(cli(*TRAIN, "--out", t / "run"))
    return t / "run"


def lost_weights(t: Path) -> list:
    (trained(t) / "model.safetensors").unlink()
    return ["audit", t / "run", *AUDIT, "--out", t / "a"]


def torn_state(t: Path) -> list:
    run_dir = trained(t)
    (run_dir / json.loads((run_dir / "latest.json").read_text())["dir"] / "state.json").unlink()
    (run_dir / "metrics.json").unlink()  # killed before it finished
    return [*TRAIN, "--out", run_dir]


def torn_config(t: Path) -> list:
    run_dir = trained(t)
    (run_dir / "train_config.json").write_text('{"model": "featu')
    return [*TRAIN, "--out", run_dir]


def summary_json_a_directory(t: Path) -> list:
    fg_ckpt(t)
    ok(cli("audit", t / "fg", *AUDIT, "--out", t / "a"))
    ok(cli("summarize", t / "a", "--out", t / "s"))
    (t / "s" / "summary.json").unlink()
    (t / "s" / "summary.json").mkdir()
    return ["summarize", t / "a", "--out", t / "s"]


# (id, the state and the command, the fragment of its one line, what the line says to do)
Row = tuple[str, Callable[[Path], list], str, Callable[[Path], None]]
ROWS: list[Row] = [
    ("checkpoint-without-its-weights", lost_weights, "(rerun the training to write it)",
     lambda t: ok(cli(*TRAIN, "--out", t / "run"))),
    ("torn-training-state", torn_state, "is incomplete: delete", lambda t: (t / "run" / "latest.json").unlink()),
    ("torn-train-config", torn_config, "is not valid JSON: delete", lambda t: shutil.rmtree(t / "run")),
    ("a-directory-where-a-file-is-written", summary_json_a_directory, "is a directory where fcaudit writes a file: "
     "remove it and rerun", lambda t: (t / "s" / "summary.json").rmdir()),
]


@pytest.mark.parametrize("name, state, fragment, fix", ROWS, ids=[r[0] for r in ROWS])
def test_a_message_that_says_rerun_leads_out(tmp_path, name, state, fragment, fix):
    command = state(tmp_path)
    assert fragment in refusal(cli(*command))
    fix(tmp_path)
    ok(cli(*command))


def test_an_interrupted_command_says_rerun_and_the_rerun_finishes_it(tmp_path, monkeypatch):
    real, calls = data.random_batch, [0]

    def interrupted(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 2:  # during the second step, after the first was taken
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(data, "random_batch", interrupted)
    first = cli(*TRAIN, "--out", tmp_path / "run")
    assert first.exit_code == 130 and "interrupted: rerun the same command to resume" in first.output
    monkeypatch.setattr(data, "random_batch", real)
    ok(cli(*TRAIN, "--out", tmp_path / "run"))
    assert (tmp_path / "run" / "metrics.json").is_file()


def test_a_full_disk_says_rerun_and_the_rerun_gives_the_uninterrupted_records(fuzz_world, tmp_path, monkeypatch):
    from fcaudit.auditor import AuditResult

    real, calls = files.write_columns, [0]

    def fills_up(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 3:  # the disk fills up while the replays' records are written
            raise OSError(errno.ENOSPC, "No space left on device", str(args[0]))
        return real(*args, **kwargs)

    monkeypatch.setattr(files, "write_columns", fills_up)
    ckpt = fuzz_world.fg
    assert "free some space and rerun the same command" in refusal(cli("audit", ckpt, *AUDIT, "--out", tmp_path / "a"))
    monkeypatch.setattr(files, "write_columns", real)
    ok(cli("audit", ckpt, *AUDIT, "--out", tmp_path / "a"))
    ok(cli("audit", ckpt, *AUDIT, "--out", tmp_path / "b"))
    assert AuditResult.load(tmp_path / "a").records.equals(AuditResult.load(tmp_path / "b").records)


@pytest.mark.parametrize("damage", [b"", b"\x00" * 4])  # emptied; cut inside the header's length
def test_a_store_file_changed_while_the_audit_runs_says_rerun_and_the_rerun_gives_the_same_records(tmp_path, damage):
    """Something else empties the coefficient store's chunk files during the replays (here the model's own forward,
    once the first replay has run): one FcauditError line naming the file, and the same call again recomputes it and
    gives the uninterrupted audit's records."""
    import pandas as pd
    import torch

    from conftest import ToyMudd, run
    from fcaudit.controllers import Controller
    from fcaudit.errors import FcauditError

    class Damaging(ToyMudd):
        calls, armed = 0, True

        def forward(self, ids):
            self.calls += 1
            if self.armed and self.calls == 9:  # stage 1 and the exact replay check are done: a replay reads the store
                for chunk in (tmp_path / "audit" / "coeffs").glob("chunk_*.safetensors"):
                    chunk.write_bytes(damage)
            return super().forward(ids)

    torch.manual_seed(0)
    model = Damaging()
    ctrl = Controller.from_modules(model, "dynamic_dense.*", "stream batch token source", reference="SourceUniformMean")
    with pytest.raises(FcauditError, match=r"chunk_\d+\.safetensors changed while the audit ran .*: rerun the command"):
        run(model, ctrl, tmp_path / "audit", R=2)
    model.armed = False
    rerun = run(model, ctrl, tmp_path / "audit", R=2)
    fresh = run(model, ctrl, tmp_path / "fresh", R=2)
    pd.testing.assert_frame_equal(rerun.records, fresh.records, check_exact=True)
