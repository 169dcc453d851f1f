"""Resuming an audit: finished units skipped, part files merged, a killed audit rerun to the uninterrupted records."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import torch

from fcaudit import audit
from fcaudit.auditor.directory import AuditDir
from fcaudit.auditor.state import STATE_CHECK_PASSES
from fcaudit.controllers.checks import BATCH_CHECK_PASSES, FLOW_CHECK_PASSES, SITE_CHECK_PASSES
from fcaudit.errors import FcauditError
from conftest import Gate, ToyGated, gated, run, windows


class SparseGate(Gate):
    """Exact zeros for some tokens: the active count differs between windows."""

    def forward(self, h):
        return torch.relu(self.proj(h)).squeeze(-1)


def test_stage2_writes_each_run_once_complete_and_a_resumed_run_as_a_part(tmp_path, monkeypatch):
    """One process replays unit by unit: each (condition, r) is written once, as its whole records file. A run that
    resumes after some of its units were done writes the rest as a part file, and the records equal the
    uninterrupted audit's bit for bit (NLLs and active counts)."""
    from fcaudit.auditor import files

    model = ToyGated()
    for b in model.blocks:
        b.gate = SparseGate(16)
    written, write_columns, write_tensors = [], files.write_columns, files.write_tensors

    def watch(kind, write):  # the replays' files as they are written: (records or part, (condition, r), windows)
        def watched(path, columns, *args, **kwargs):
            rel = Path(path).relative_to(tmp_path / "a")
            if rel.parts[0] in ("records", "parts") and rel.parts[1] != "Correct":
                r = int(rel.parts[2][1:5])
                written.append((kind, (rel.parts[1], r), len(columns["example"])))
            return write(path, columns, *args, **kwargs)
        return watched

    monkeypatch.setattr(files, "write_columns", watch("records", write_columns))
    monkeypatch.setattr(files, "write_tensors", watch("part", write_tensors))
    base = run(model, gated(model), tmp_path / "a", n_eval=10, R=2)
    varies = base.records.groupby(["condition", "randomization"]).active.nunique() > 1
    assert varies.sum() >= 1 + 4 * 2  # Correct and every randomized run: the active count differs between windows
    keys = [k for _, k, _ in written]
    assert len(keys) == len(set(keys)) == len(base.records.groupby(["condition", "randomization"])) - 1  # not Correct
    assert {(kind, n) for kind, _, n in written} == {("records", 10)}
    records = tmp_path / "a" / "records" / "TokenShuffle" / "r0001.parquet"
    frame = files.read_frame(records)
    parts = tmp_path / "a" / "parts" / "TokenShuffle" / "r0001"
    write_tensors(parts / "b0000004.safetensors", {c: torch.from_numpy(frame[c].to_numpy()[4:8].copy())
                                                   for c in ("example", "nll", "active")},
                  AuditDir(tmp_path / "a").binding("TokenShuffle", 1))  # as the engine binds it
    records.unlink()
    written.clear()
    again = run(model, gated(model), tmp_path / "a", n_eval=10, R=2)
    # windows 0-3 and 8-9: one part beside the one kept, then the two merged into the records file
    assert written == [("part", ("TokenShuffle", 1), 6), ("records", ("TokenShuffle", 1), 10)]
    pd.testing.assert_frame_equal(again.records, base.records, check_exact=True)


def test_resume_skips_finished_units_and_rejects_other_config(tmp_path):
    model = ToyGated()
    first = run(model, gated(model), tmp_path / "a")
    calls = []
    model.register_forward_hook(lambda *a: calls.append(1))
    again = run(model, gated(model), tmp_path / "a")
    # only the probe, its checks and the state check's repeated pass: every unit was already on disk
    assert len(calls) == 1 + SITE_CHECK_PASSES + FLOW_CHECK_PASSES + BATCH_CHECK_PASSES + STATE_CHECK_PASSES
    pd.testing.assert_frame_equal(first.records, again.records)
    with pytest.raises(FcauditError, match=r"different configuration \(differs in \['randomizations'\]\)"):
        run(model, gated(model), tmp_path / "a", R=4)
    with pytest.raises(FcauditError, match="different configuration"):
        audit(model, gated(model), windows(8, 0), windows(4, 1), randomizations=3, seed=1, out=tmp_path / "a",
              batch_size=4, quiet=True)


def test_part_files_merge_into_the_records_and_a_window_twice_is_recomputed(tmp_path, capsys):
    from fcaudit.auditor import files

    model = ToyGated()
    expected = run(model, gated(model), tmp_path / "a").records.copy()  # 8 windows, batches of 4 (read now: lazy)
    records = tmp_path / "a" / "records" / "Correct" / "r0000.parquet"
    frame = files.read_frame(records)
    parts = tmp_path / "a" / "parts" / "Correct" / "r0000"
    parts.mkdir(parents=True)

    def part(name, rows):  # a part file as a process writes it: its windows in any order, bound to its audit
        files.write_tensors(parts / name, {c: torch.from_numpy(frame[c].to_numpy()[rows])
                                           for c in ("example", "nll", "active")},
                            AuditDir(tmp_path / "a").binding("Correct", 0))

    part("b0000004.safetensors", [6, 4, 7, 5])
    part("b0000000.safetensors", [0, 1, 2, 3])
    records.unlink()
    again = run(model, gated(model), tmp_path / "a")
    pd.testing.assert_frame_equal(expected, again.records)  # put in window order, every column as it was
    assert not (tmp_path / "a" / "parts").exists()

    part("b0000000.safetensors", [0, 1, 2, 3])
    part("b0000004.safetensors", [4, 5, 6, 7])
    part("b0000002.safetensors", [2, 3, 4, 5])  # windows 2..5 twice: no window may count twice
    records.unlink()
    capsys.readouterr()
    again = run(model, gated(model), tmp_path / "a")  # the part that is not whole batches of its own is recomputed
    assert "recomputed 1 damaged file(s): parts/Correct/r0000/b0000002.safetensors" in capsys.readouterr().err
    pd.testing.assert_frame_equal(expected, again.records)


KILL_SCRIPT = """
import sys, torch
sys.path.insert(0, {tests!r})
torch.set_num_threads({threads})
import conftest as t
from fcaudit.auditor import engine
model = t.ToyGated(sleep=float(sys.argv[2]))
t.run(model, t.gated(model), sys.argv[1], n_eval=12, R=4)
"""

def captured(out: Path, start: int) -> bool:
    """Whether a killed audit left the capture of the batch at `start` done: its chunk and its Correct records (a
    part file, or the records file the end merges them into)."""
    return (out / "coeffs" / f"chunk_{start:07d}.safetensors").exists() and (
        (out / "records" / "Correct" / "r0000.parquet").exists()
        or (out / "parts" / "Correct" / "r0000" / f"b{start:07d}.safetensors").exists())


def finished_passes(out: Path, n_eval: int, batch_size: int) -> int:
    """Forward passes whose results a killed audit left on disk, counted from its files."""
    capture = sum(captured(out, b) for b in range(0, n_eval, batch_size))
    calib = 1 if (out / "profiles.safetensors").exists() else len(list((out / "calib").glob("sum_*.safetensors")))
    from safetensors.torch import load_file

    covered = sum(len(load_file(str(p))["example"]) for p in (out / "parts").rglob("b*.safetensors")
                  if p.parts[-3] != "Correct")  # a part file holds whole batches of one (condition, r)
    # one process writes a whole (condition, r) straight to its records file
    covered += n_eval * len([p for p in (out / "records").rglob("r*.parquet") if p.parts[-2] != "Correct"])
    return 2 * capture + calib + covered // batch_size


def test_sigkill_midway_then_rerun_equals_uninterrupted(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(KILL_SCRIPT.format(tests=str(Path(__file__).parent), threads=torch.get_num_threads()))
    out = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, str(script), str(out), "0.02"])
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if len(list((out / "records").glob("*/r*.parquet"))) >= 4:  # stage 2 well under way
            break
        time.sleep(0.005)
    assert proc.poll() is None, "the audit finished (or failed) before it could be killed"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (out / "replay.json").exists()
    finished = finished_passes(out, 12, 4)
    total = 1 + 3 * (2 + 4 * 4 + 3)  # calibration, then per batch: capture + check, 4 x R=4 randomized, 3 static
    assert 0 < finished < total
    model = ToyGated()
    calls = []
    model.register_forward_hook(lambda *a: calls.append(1))
    resumed = run(model, gated(model), out, n_eval=12, R=4)  # same process settings: one thread
    # the probe (stage 1 uses it when the first batch is undone), then only the units the kill left undone
    checks = SITE_CHECK_PASSES + FLOW_CHECK_PASSES + BATCH_CHECK_PASSES + STATE_CHECK_PASSES
    assert len(calls) == checks + total - finished + captured(out, 0)
    assert not list(out.rglob("*.tmp")) and not (out / "parts").exists()
    whole = run(model, gated(model), tmp_path / "whole", n_eval=12, R=4)
    assert len(whole.records) == 12 * (1 + 4 * 4 + 3)
    pd.testing.assert_frame_equal(resumed.records, whole.records, check_exact=True)
