"""Engine v2's promises about audit directories: the records of the v1 engine, bit for bit; a lock against concurrent
writers; directories fcaudit did not create are never touched; torn or corrupt files are recomputed; unfinished audits
are refused unless asked for; pooled checkpoints must be independent; retention is undefined on a zero gap."""

import json
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from typer.testing import CliRunner

import fcaudit as fca
from fcaudit.auditor import AuditResult, audit
from fcaudit.cli import app
from fcaudit.controllers import Controller
from fcaudit.auditor.state import STATE_CHECK_PASSES
from fcaudit.controllers.checks import BATCH_CHECK_PASSES, FLOW_CHECK_PASSES, SITE_CHECK_PASSES
from fcaudit.errors import FcauditError
from fcaudit.loss import token_nll
from fcaudit.families import load_model
from fcaudit.summary import summarize

sys.path.insert(0, str(Path(__file__).parent))
import conftest as toys  # noqa: E402

DATA = Path(__file__).parent / "data" / "v1"


# ---- the records of the engine before the restructure ------------------------------------------------------------

@pytest.mark.parametrize("family", ["featuregate", "mudd"])
def test_records_equal_the_v1_engine_bit_for_bit(family, tmp_path):
    """tests/data/v1/FAMILY holds a tiny trained checkpoint, its windows, and the records the v1 engine (b222979)
    wrote for it (R = 2, seed 0, batch 4). The v2 engine must reproduce every one of them exactly."""
    model, _ = load_model(DATA / family)
    windows = load_file(str(DATA / family / "windows.safetensors"))
    ev, ca = windows["eval"], windows["calib"]
    old = pd.read_parquet(DATA / family / "records.parquet")
    with torch.inference_mode():  # a precondition, not the test: does this CPU round like the fixture's?
        plain = torch.cat([token_nll(model(b), b).mean(1).double() for b in ev.split(4)]).numpy()
    if not np.array_equal(plain, old[old.condition == "Correct"].sort_values("example").nll.to_numpy()):
        pytest.skip("this CPU's kernels round differently from the machine that wrote the v1 fixture")
    new = audit(model, fca.controller_for(model), ev, ca, randomizations=2, seed=0, out=tmp_path / "v1", batch_size=4,
                quiet=True).records
    assert set(new.condition) - set(old.condition) == {"TokenResamplePast"}
    keys = ["condition", "randomization", "example"]
    merged = old.merge(new, on=keys, suffixes=("_v1", "_v2"), validate="one_to_one")
    assert len(merged) == len(old) == 12 * (1 + 3 * 2 + 3)
    assert (merged.nll_v1.to_numpy() == merged.nll_v2.to_numpy()).all()
    assert (merged.groupby("condition").nll_v2.mean() != merged.nll_v2[merged.condition == "Correct"].mean()).sum() > 3


# ---- concurrent writers, foreign directories, killed first writes -------------------------------------------------

JOB = """
import sys, torch
sys.path.insert(0, {tests!r})
torch.set_num_threads(1)
import conftest as t
model = t.ToyGated(sleep=float(sys.argv[2]))
try:
    t.run(model, t.gated(model), sys.argv[1], n_eval=8, R=3)
except Exception as e:
    print("error:", e, file=sys.stderr)
    sys.exit(2)
"""


@pytest.mark.slow  # two processes (the lock's smoke test is test_train's in-process one)
def test_a_second_audit_into_the_same_directory_fails_at_once(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(JOB.format(tests=str(Path(__file__).parent)))
    out = tmp_path / "shared"
    first = subprocess.Popen([sys.executable, str(script), str(out), "0.25"], stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while not (out / "config.json").exists() and time.time() < deadline and first.poll() is None:
        time.sleep(0.01)
    assert first.poll() is None, first.stderr.read()
    t0 = time.time()
    second = subprocess.run([sys.executable, str(script), str(out), "0.0"], capture_output=True, text=True)
    assert second.returncode == 2 and "being written by another fcaudit process" in second.stderr
    assert first.poll() is None, "the first audit finished before the second was refused: the test proves nothing"
    assert first.wait(timeout=120) == 0, first.stderr.read()
    model = toys.ToyGated()
    solo = toys.run(model, toys.gated(model), tmp_path / "solo", n_eval=8, R=3)
    pd.testing.assert_frame_equal(AuditResult.load(out).records, solo.records, check_exact=True)
    assert time.time() - t0 < 60


def test_a_directory_fcaudit_did_not_create_is_left_untouched(tmp_path):
    model = toys.ToyGated()
    theirs = tmp_path / "checkpoint"
    theirs.mkdir()
    (theirs / "config.json").write_text('{"mine": true}')
    before = {p.name: p.read_bytes() for p in theirs.iterdir()}
    with pytest.raises(FcauditError, match="not an fcaudit audit directory"):
        toys.run(model, toys.gated(model), theirs)
    assert {p.name: p.read_bytes() for p in theirs.iterdir()} == before  # nothing deleted, changed or added
    a_file = tmp_path / "notes.txt"
    a_file.write_text("x")
    for out, why in ((a_file, "is an existing file"), (a_file / "sub", "below the file")):
        with pytest.raises(FcauditError, match=why):
            toys.run(model, toys.gated(model), out)
    assert a_file.read_text() == "x"


def test_a_kill_during_the_first_write_resumes(tmp_path):
    model = toys.ToyGated()
    out = tmp_path / "a"
    out.mkdir()
    (out / ".lock").write_text("pid 1")
    (out / ".config.json.abc123.tmp").write_text('{"half')  # what a kill inside the first atomic write leaves
    res = toys.run(model, toys.gated(model), out)
    assert res.replay.passed and not list(out.rglob("*.tmp"))
    (out / "config.json").unlink()  # killed after the marker, before the config: the same command resumes
    again = toys.run(model, toys.gated(model), out)
    pd.testing.assert_frame_equal(again.records, res.records, check_exact=True)


# ---- torn, truncated and edited files ---------------------------------------------------------------------------

def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def test_damaged_files_are_recomputed_and_reported(tmp_path, capsys):
    model = toys.ToyGated()
    out = tmp_path / "a"
    first = toys.run(model, toys.gated(model), out, R=2)
    variation = (out / "variation.json").read_bytes()
    chunk = out / "coeffs" / "chunk_0000004.safetensors"
    chunk_bytes = chunk.read_bytes()
    _truncate(out / "records" / "CrossInput" / "r0001.parquet")
    _truncate(chunk)
    _truncate(out / "profiles.safetensors")
    (out / "variation.json").write_text(variation.decode()[:40])
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(config)[:-30])  # a torn config.json
    with pytest.raises(FcauditError, match="rerun the audit command"):
        AuditResult.load(out)
    capsys.readouterr()
    calls = []
    model.register_forward_hook(lambda *a: calls.append(1))
    again = toys.run(model, toys.gated(model), out, R=2)
    err = capsys.readouterr().err
    assert "recomputed 5 damaged file(s)" in err and "config.json" in err
    # probe and its checks, the chunk's capture + check, calibration, CrossInput r1 (2 batches), the state check
    checks = SITE_CHECK_PASSES + FLOW_CHECK_PASSES + BATCH_CHECK_PASSES + STATE_CHECK_PASSES
    assert len(calls) == 1 + checks + 2 + 1 + 2
    pd.testing.assert_frame_equal(again.records, first.records, check_exact=True)
    assert chunk.read_bytes() == chunk_bytes and (out / "variation.json").read_bytes() == variation
    # an edited (not truncated) record is caught by its content hash
    frame = pd.read_parquet(out / "records" / "StaticProfile" / "r0000.parquet")
    frame.loc[0, "nll"] += 1.0
    import pyarrow as pa
    import pyarrow.parquet as pq
    table = pa.Table.from_pandas(frame, preserve_index=False)
    meta = pq.read_schema(out / "records" / "StaticProfile" / "r0000.parquet").metadata
    pq.write_table(table.replace_schema_metadata(meta), out / "records" / "StaticProfile" / "r0000.parquet")
    edited = AuditResult.load(out)  # complete by its files' metadata; the records are read when first used
    with pytest.raises(FcauditError, match="damaged"):
        edited.records
    fixed = toys.run(model, toys.gated(model), out, R=2)
    pd.testing.assert_frame_equal(fixed.records, first.records, check_exact=True)


def test_identical_audits_write_identical_files(tmp_path):
    model = toys.ToyGated()
    for name in ("a", "b"):
        toys.run(model, toys.gated(model), tmp_path / name, R=2)
    skip = {"config.json", ".lock"}  # the config records when it was written
    files_a = sorted(p.relative_to(tmp_path / "a") for p in (tmp_path / "a").rglob("*")
                     if p.is_file() and p.name not in skip)
    files_b = sorted(p.relative_to(tmp_path / "b") for p in (tmp_path / "b").rglob("*")
                     if p.is_file() and p.name not in skip)
    # marker, 2 chunks, profiles, replay, variation, 12 records and their 12 sidecar hashes
    assert files_a == files_b and len(files_a) == 30
    for rel in files_a:
        assert (tmp_path / "a" / rel).read_bytes() == (tmp_path / "b" / rel).read_bytes(), rel


@pytest.mark.parametrize("rows, name", [(1, "Correct"), (4096, "TokenShuffle"), (9001, "Ünïcode"), (5, "")])
def test_a_constant_column_is_written_as_its_full_array_would_be(tmp_path, rows, name):
    """Records name their condition in every row; it is passed as one str (no numpy array of rows x 4 bytes per
    character) and dictionary-encoded. The content read back is the full array's."""
    from fcaudit.auditor import files

    cols = {"example": np.arange(rows), "condition": np.full(rows, name), "nll": np.random.default_rng(0).random(rows)}
    files.write_columns(tmp_path / "array.parquet", cols)
    files.write_columns(tmp_path / "str.parquet", dict(cols, condition=name))
    frame = files.read_frame(tmp_path / "str.parquet")  # checks the recorded hash against the file's bytes
    pd.testing.assert_frame_equal(frame, files.read_frame(tmp_path / "array.parquet"), check_exact=True)
    assert list(frame["condition"]) == [name] * rows


def _flipped(path: Path, offset: int, bit: int = 0) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 1 << bit
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("stride", [pytest.param(1, marks=pytest.mark.slow), 29])
def test_a_bit_flip_anywhere_in_a_records_or_safetensors_file_is_damage(stride, tmp_path):
    """The hash covers every byte: page headers, data, statistics, the footer's schema, column names and metadata
    of a Parquet file; the header and data of a safetensors file. A flipped bit is found by the engine's and the
    reader's one check: at every `stride`-th byte, and at each of the last 48 (Parquet's footer length, magic and
    metadata) and the footer's column name."""
    from fcaudit.auditor import files

    parquet, tensors = tmp_path / "r0000.parquet", tmp_path / "b.safetensors"
    files.write_columns(parquet, {"example": np.arange(6), "condition": "CrossInput",
                                  "nll": np.random.default_rng(0).random(6)})
    files.write_tensors(tensors, {"example": torch.arange(4), "nll": torch.rand(4, dtype=torch.float64)}, {"count": 4})
    footer = parquet.read_bytes().rindex(b"nll")  # a column name in the footer's schema
    assert footer > len(parquet.read_bytes()) // 2
    for path, read, named in ((parquet, files.read_frame, footer + 1), (tensors, files.read_tensors, 0)):
        clean = path.read_bytes()
        read(path)
        for offset in sorted({*range(0, len(clean), stride), *range(len(clean) - 48, len(clean)), named}):
            for bit in (0, 5):
                _flipped(path, offset, bit)
                with pytest.raises(files.Damaged):
                    read(path)
                path.write_bytes(clean)


def test_a_records_file_rewritten_by_another_program_is_recomputed_with_one_line(tmp_path, capsys):
    """pandas rewrites a records file (every NLL + 1), another one loses its sidecar hash: `summarize` calls each
    damaged, the next audit run recomputes both and says so in one line, and `summarize` then accepts the audit."""
    model = toys.ToyGated()
    out = tmp_path / "a"
    first = toys.run(model, toys.gated(model), out, R=2)
    edited = out / "records" / "StaticProfile" / "r0000.parquet"
    frame = pd.read_parquet(edited)
    frame["nll"] += 1.0
    frame.to_parquet(edited)
    (out / "records" / "CrossInput" / "r0001.parquet.sha256").unlink()
    capsys.readouterr()
    for args in (["summarize", str(out), "--out", str(tmp_path / "s")], ["report", str(out), "--out",
                                                                          str(tmp_path / "r")]):
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 2 and "is damaged" in result.output and "rerun the audit command" in result.output
    again = toys.run(model, toys.gated(model), out, R=2)
    lines = [line for line in capsys.readouterr().err.splitlines() if "recomputed" in line]
    assert len(lines) == 1 and "recomputed 2 damaged file(s)" in lines[0], lines
    assert "records/StaticProfile/r0000.parquet" in lines[0] and "no recorded sha256" in lines[0]
    pd.testing.assert_frame_equal(again.records, first.records, check_exact=True)
    pd.testing.assert_frame_equal(AuditResult.load(out).records, first.records, check_exact=True)
    result = CliRunner().invoke(app, ["summarize", str(out), "--out", str(tmp_path / "s")])
    assert result.exit_code == 0, result.output


def test_an_audit_without_variation_json_is_unfinished(tmp_path):
    """A kill between replay.json and variation.json: summarize and report refuse the audit as unfinished, as one
    that lacks a records file; the rerun writes variation.json."""
    model = toys.ToyGated()
    out = tmp_path / "a"
    toys.run(model, toys.gated(model), out, R=2)
    variation = (out / "variation.json").read_bytes()
    (out / "variation.json").unlink()
    with pytest.raises(FcauditError, match=r"unfinished audit \(lacks variation.json\); rerun the audit command"):
        AuditResult.load(out)
    assert AuditResult.load(out, allow_partial=True).partial
    for cmd in ("summarize", "report"):
        result = CliRunner().invoke(app, [cmd, str(out), "--out", str(tmp_path / cmd)])
        assert result.exit_code == 2 and "unfinished audit (lacks variation.json)" in result.output, result.output
    toys.run(model, toys.gated(model), out, R=2)
    assert (out / "variation.json").read_bytes() == variation and not AuditResult.load(out).partial


@pytest.mark.parametrize("name", ["replay.json", "variation.json"])
@pytest.mark.parametrize("unhashed", [False, True])
def test_a_hand_edited_json_file_is_called_damaged_and_recomputed(name, unhashed, tmp_path, capsys):
    """An edited value under the recorded _sha256, or the _sha256 taken out: damaged (not missing) for the reader,
    recomputed by the next audit run, with one line."""
    model = toys.ToyGated()
    out = tmp_path / "a"
    toys.run(model, toys.gated(model), out, R=2)
    clean = (out / name).read_bytes()
    obj = json.loads(clean)
    obj["max_abs_dlogit" if name == "replay.json" else "windows"] = 7
    if unhashed:
        del obj["_sha256"]
    (out / name).write_text(json.dumps(obj))
    why = "it has no recorded _sha256" if unhashed else "content hash does not match"
    with pytest.raises(FcauditError, match=f"{name} is damaged \\({why}\\); rerun"):
        AuditResult.load(out)
    capsys.readouterr()
    toys.run(model, toys.gated(model), out, R=2)
    assert f"recomputed 1 damaged file(s): {name} ({why})" in capsys.readouterr().err
    assert (out / name).read_bytes() == clean


# ---- unfinished audits, pooled checkpoints ------------------------------------------------------------------------

def test_an_unfinished_audit_is_refused_unless_asked_for(tmp_path):
    model = toys.ToyGated()
    out = tmp_path / "a"
    toys.run(model, toys.gated(model), out, R=2)
    (out / "records" / "CrossInput" / "r0001.parquet").unlink()
    with pytest.raises(FcauditError, match=r"unfinished audit \(lacks CrossInput r1\); rerun the audit command"):
        AuditResult.load(out)
    with pytest.raises(FcauditError, match="unfinished audit"):
        summarize([out])
    part = AuditResult.load(out, allow_partial=True)
    assert part.partial and "PARTIAL" in repr(part)
    summary = summarize([part])
    assert "[PARTIAL]" in str(summary) and next(iter(summary.values())).partial
    result = CliRunner().invoke(app, ["summarize", str(out), "--out", str(tmp_path / "s")])
    assert result.exit_code == 2 and "unfinished audit" in result.output and not (tmp_path / "s").exists()
    result = CliRunner().invoke(app, ["report", str(out), "--out", str(tmp_path / "r")])
    assert result.exit_code == 2 and "unfinished audit" in result.output
    result = CliRunner().invoke(app, ["report", str(out), "--out", str(tmp_path / "r"), "--allow-partial"])
    assert result.exit_code == 0, result.output
    assert "[PARTIAL]" in (tmp_path / "r" / "report.md").read_text()


def test_summarize_refuses_audits_that_are_not_independent_checkpoints(tmp_path):
    model = toys.ToyGated()
    a = toys.run(model, toys.gated(model), tmp_path / "a", R=2)
    b = audit(model, toys.gated(model), toys.windows(8, 0), toys.windows(4, 1), randomizations=2, seed=7,
              out=tmp_path / "b", batch_size=4, quiet=True)
    with pytest.raises(FcauditError, match="audit the same checkpoint") as err:
        summarize([a, b])
    assert str(tmp_path / "a") in str(err.value) and str(tmp_path / "b") in str(err.value)
    relabelled = audit(model, toys.gated(model), toys.windows(8, 0), toys.windows(4, 1), randomizations=2,
                       out=tmp_path / "r", batch_size=4, quiet=True, model_info={"family": "another name"})
    with pytest.raises(FcauditError, match="whatever their family labels"):
        summarize([a, relabelled])
    other = toys.ToyGated()
    with torch.no_grad():
        other.head.bias.add_(0.01)  # another checkpoint, audited on other windows
    c = audit(other, toys.gated(other), toys.windows(8, 5), toys.windows(4, 1), randomizations=2, seed=0,
              out=tmp_path / "c", batch_size=4, quiet=True)
    with pytest.raises(FcauditError, match=r"audited differently \(windows\)"):
        summarize([a, c])


# ---- retention on a zero gap --------------------------------------------------------------------------------------

class ScaleFree(nn.Module):
    """A gated model whose output does not depend on the gate's scale: the gate multiplies the hidden state right
    before a LayerNorm, so every intervention's ΔNLL is rounding-sized."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.emb = nn.Embedding(toys.V, 16)
        self.gate = toys.Gate(16)
        self.norm = nn.LayerNorm(16, eps=0.0)
        self.head = nn.Linear(16, toys.V)

    def forward(self, ids):
        h = self.emb(ids)
        return self.head(self.norm(self.gate(h)[..., None] * h))


def test_a_gate_scale_invariant_model_has_undefined_retention(tmp_path, capsys):
    model = ScaleFree()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        res = audit(model, Controller.from_modules(model, "gate", "batch token"), toys.windows(16, 0),
                    toys.windows(8, 1), randomizations=2, out=tmp_path / "a", batch_size=8, quiet=False)
        pen = res.penalties().to_frame()
        assert pen["statistic"].abs().max() < 1e-5  # rounding only
        ret = res.retention()
        s = summarize([res])
    assert np.isnan(ret.statistic) and "not above the practically-small bound" in ret.reason
    assert np.isnan(s.retention["statistic"]).all() and (s.retention["note"] != "").all()
    out = capsys.readouterr().out
    assert "retention StaticProfile vs GlobalMean: undefined" in out and "ΔNLL" in out
    assert "undefined" in str(s) and not any(c["met"] for c in s.verdicts if c["name"] == "high retention")


# ---- what a resume compares ----------------------------------------------------------------------------------

def test_a_checkpoint_read_from_another_path_or_relabelled_resumes_and_config_json_says_so(tmp_path):
    """Where a checkpoint was read from and the family it is summarized under describe it; its parameters identify
    it. A moved checkpoint (or "./ckpt" for "ckpt") resumes its audit; other parameters are refused by name."""
    model = toys.ToyGated()
    out = tmp_path / "a"
    first = toys.run(model, toys.gated(model), out, model_info={"checkpoint": "runs/s0", "family": "toy"})
    records = {p: p.stat().st_mtime_ns for p in (out / "records").rglob("*.parquet")}
    calls = []
    model.register_forward_hook(lambda *a: calls.append(1))
    again = toys.run(model, toys.gated(model), out, model_info={"checkpoint": "/scratch/s0", "family": "toy seeds"})
    # the probe, its checks and the state check's repeated pass: every unit was done
    assert len(calls) == 1 + SITE_CHECK_PASSES + FLOW_CHECK_PASSES + BATCH_CHECK_PASSES + STATE_CHECK_PASSES
    assert {p: p.stat().st_mtime_ns for p in (out / "records").rglob("*.parquet")} == records
    pd.testing.assert_frame_equal(again.records, first.records, check_exact=True)
    saved = json.loads((out / "config.json").read_text())["model"]
    assert (saved["checkpoint"], saved["family"]) == ("/scratch/s0", "toy seeds")
    with torch.no_grad():
        next(model.parameters()).add_(1.0)
    with pytest.raises(FcauditError, match=r"differs in \['model.params_sha256'\]"):
        toys.run(model, toys.gated(model), out, model_info={"checkpoint": "/scratch/s0", "family": "toy seeds"})


def _as_earlier(out: Path, how: str) -> None:
    """The finished audit in `out` rewritten as an earlier fcaudit's: its format number 1, or ("hash") its
    configuration hashed the earlier way (every field, the descriptive ones too); each of its files bound to that
    configuration's hash, as that fcaudit wrote them."""
    import hashlib

    from fcaudit.auditor import files
    from fcaudit.auditor.directory import MARKER, config_hash
    from fcaudit.io import write_json

    config = files.read_json(out / "config.json")
    bare = {k: v for k, v in config.items() if k not in ("config_hash", "created_at", "provenance")}
    if how == "format":
        bare["format"] = 1
        digest = config_hash(bare)
    else:
        bare["criteria"] = {k: v for k, v in bare["criteria"].items() if k != "fixed_at"}
        digest = hashlib.sha256(json.dumps(bare, sort_keys=True, default=str).encode()).hexdigest()
    write_json(out / "config.json", {**config, "format": bare["format"], "config_hash": digest}, hashed=True)
    write_json(out / MARKER, {"format": bare["format"], "config_hash": digest}, hashed=True)
    for name in ("replay.json", "variation.json"):
        write_json(out / name, {**files.read_json(out / name), "audit": digest}, hashed=True)
    for path in out.rglob("*.safetensors"):
        tensors, meta = files.read_tensors(path)
        files.write_tensors(path, tensors, {**meta, "audit": digest})
    for path in out.rglob("*.parquet"):
        frame, meta = files.read_table(path)
        files.write_columns(path, {k: v.to_numpy() for k, v in frame.items()}, {**meta, "audit": digest})


@pytest.mark.parametrize("how", ["format", "hash"])
def test_an_earlier_fcaudits_audit_is_refused_in_one_line_and_the_rerun_it_names_recomputes_it(how, tmp_path):
    """fcaudit is unreleased: an audit directory an earlier version wrote is never migrated. Its readers refuse it in
    one line that says to rerun the audit; the same audit rerun into that directory (or a fresh one) recomputes it."""
    from fcaudit.auditor import files
    from fcaudit.auditor.directory import FORMAT, MARKER, config_hash
    from harness import api_refusal, cli, refusal

    model = toys.ToyGated()
    out = tmp_path / "a"
    first = toys.run(model, toys.gated(model), out, model_info={"checkpoint": "runs/s0"})
    digest = json.loads((out / "config.json").read_text())["config_hash"]
    _as_earlier(out, how)
    if how == "format":  # an earlier hash alone leaves a consistent directory: its files are bound to that hash
        line = (f"{out} holds an audit written by another version of fcaudit (format 1, this fcaudit's is {FORMAT}); "
                f"rerun the audit command with --out {out} to recompute it")
        assert api_refusal(lambda: AuditResult.load(out)) == line
        assert refusal(cli("summarize", out, "--out", tmp_path / "s")) == f"error: {line}"
    calls = []
    model.register_forward_hook(lambda *a: calls.append(1))
    again = toys.run(model, toys.gated(model), out, model_info={"checkpoint": "runs/s0"})
    assert len(calls) > 1 + SITE_CHECK_PASSES + 10  # not resumed: every unit recomputed
    pd.testing.assert_frame_equal(again.records, first.records, check_exact=True)
    assert files.read_json(out / MARKER) == {"format": FORMAT, "config_hash": digest}
    written = files.read_json(out / "config.json")
    assert written["format"] == FORMAT and written["config_hash"] == digest == config_hash(
        {k: v for k, v in written.items() if k not in ("config_hash", "created_at", "provenance")})
    pd.testing.assert_frame_equal(AuditResult.load(out).records, first.records, check_exact=True)
    fresh = toys.run(model, toys.gated(model), tmp_path / "fresh", model_info={"checkpoint": "runs/s0"})
    pd.testing.assert_frame_equal(fresh.records, first.records, check_exact=True)


def test_replay_json_without_findings_and_records_without_active_are_refused_and_the_rerun_recomputes_them(tmp_path):
    """What an earlier fcaudit wrote into this format's directory (replay.json before its findings, records before
    their `active` column) is refused by the reader in one line, never filled in; the rerun it names recomputes it."""
    from fcaudit.auditor import files
    from fcaudit.io import write_json
    from harness import api_refusal

    model = toys.ToyGated()
    out = tmp_path / "a"
    first = toys.run(model, toys.gated(model), out, R=2)
    replay = files.read_json(out / "replay.json")
    write_json(out / "replay.json", {k: v for k, v in replay.items() if k != "findings"}, hashed=True)
    assert "replay.json is damaged (it lacks the pre-write checks' findings (an earlier fcaudit's)); rerun the " \
           "audit command" in api_refusal(lambda: AuditResult.load(out))
    toys.run(model, toys.gated(model), out, R=2)
    records = out / "records" / "CrossInput" / "r0001.parquet"
    frame, meta = files.read_table(records)
    files.write_columns(records, {k: v.to_numpy() for k, v in frame.items() if k != "active"}, meta)
    assert "r0001.parquet is damaged (it lacks the records columns ['active']); rerun the audit command" in \
           api_refusal(lambda: AuditResult.load(out).records)
    again = toys.run(model, toys.gated(model), out, R=2)
    pd.testing.assert_frame_equal(again.records, first.records, check_exact=True)
    assert files.read_json(out / "replay.json") == replay


def test_bytes_appended_to_a_store_chunk_or_the_profiles_make_them_damaged_and_recomputed(tmp_path):
    """safetensors' own reader refuses a file longer than its header says; so does fcaudit, at every read, so the
    rerun recomputes it instead of failing in stage 2."""
    model = toys.ToyGated()
    out = tmp_path / "a"
    first = toys.run(model, toys.gated(model), out, R=2)
    chunk, profiles = out / "coeffs" / "chunk_0000004.safetensors", out / "profiles.safetensors"
    good = chunk.read_bytes(), profiles.read_bytes()
    for f in (chunk, profiles):
        with open(f, "ab") as fh:
            fh.write(b"garbage\n")
    again = toys.run(model, toys.gated(model), out, R=2)
    assert (chunk.read_bytes(), profiles.read_bytes()) == good
    load_file(chunk), load_file(profiles)  # readable by safetensors again
    pd.testing.assert_frame_equal(again.records, first.records, check_exact=True)


def test_ranks_with_other_configurations_are_told_which_fields_differ_and_a_corpus_path_is_descriptive():
    from fcaudit.auditor.driver import check_same

    base = {"seed": 0, "windows": {"n_eval": 8, "eval_sha256": "a"},
            "model": {"params_sha256": "p", "checkpoint": "/node0/ckpt", "corpus": "/node0/text.txt"}}
    moved = {**base, "model": {**base["model"], "checkpoint": "/node1/ckpt", "corpus": "/node1/text.txt"}}
    check_same([base, moved])  # the same checkpoint and text at other paths: one audit
    other = {**moved, "windows": {"n_eval": 8, "eval_sha256": "b"}, "model": {**moved["model"], "params_sha256": "q"}}
    with pytest.raises(FcauditError, match=r"rank 2 has another audit configuration than rank 0 \(differs in "
                                           r"\['model.params_sha256', 'windows'\]\)"):
        check_same([base, moved, other])
