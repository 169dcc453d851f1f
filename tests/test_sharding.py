"""Sharded audits (issue 10): `torchrun -m fcaudit audit` over gloo ranks on the CPU leaves the audit directory a
one-process audit leaves, bit for bit; a failing rank stops every rank with one line; a killed rank resumes at any
world size."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from typer.testing import CliRunner

import fcaudit
from fcaudit import data
from fcaudit.auditor.directory import AuditDir
from fcaudit.auditor.units import Schedule, share
from fcaudit.cli import app
from fcaudit.errors import FcauditError
from fcaudit.models.checkpoint import save_checkpoint
from fcaudit.models.featuregate import FeatureGateGPT, config_for

pytestmark = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                                reason="needs torch.distributed with gloo")

N_EVAL, N_CALIB, WINDOW, R, B = 12, 6, 32, 2, 2
ARGS = ["--eval", N_EVAL, "--calib", N_CALIB, "--window", WINDOW, "--randomizations", R, "--batch-size", B]
SRC = str(Path(fcaudit.__file__).parents[1])


def env() -> dict:
    """The ranks import this fcaudit, one torch thread each, and know of no launcher but torchrun."""
    e = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR",
                                                         "MASTER_PORT")}
    e["PYTHONPATH"] = os.pathsep.join([SRC, *filter(None, [e.get("PYTHONPATH")])])
    e["OMP_NUM_THREADS"] = "1"
    return e


def torchrun_cmd(n: int, ckpt: Path, out: Path, args=ARGS, log_dir: Path | None = None) -> list[str]:
    logs = ["--log-dir", str(log_dir), "--redirects", "3"] if log_dir else []
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}", *logs,
            "-m", "fcaudit", "audit", str(ckpt), "--out", str(out), *map(str, args)]


def torchrun(n: int, ckpt: Path, out: Path, *extra, args=ARGS, log_dir: Path | None = None):
    return subprocess.run(torchrun_cmd(n, ckpt, out, [*args, *extra], log_dir), env=env(), capture_output=True,
                          text=True, timeout=300)


def one_process(ckpt: Path, out: Path, *extra, args=ARGS):
    return CliRunner().invoke(app, ["audit", str(ckpt), "--out", str(out), *map(str, args), *extra])


def assert_same_audit(a: Path, b: Path) -> None:
    """Every file of the two audit directories equal byte for byte; config.json up to its creation time."""
    def listing(d):
        return sorted(str(p.relative_to(d)) for p in d.rglob("*") if p.is_file() and p.name != ".lock")

    assert listing(a) == listing(b)
    assert any(n.startswith("records/") for n in listing(a)) and "profiles.safetensors" in listing(a)
    for name in listing(a):
        if name == "config.json":
            def fixed(p):
                c = json.loads((p / name).read_text())
                del c["created_at"], c["criteria"]["fixed_at"], c["_sha256"]
                return c
            assert fixed(a) == fixed(b)
        else:
            assert (a / name).read_bytes() == (b / name).read_bytes(), name


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("ckpt") / "fg"
    save_checkpoint(path, FeatureGateGPT(config_for("tiny", "featuregate")), {"variant": "featuregate"})
    return path


@pytest.fixture(scope="module")
def reference(ckpt, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ref") / "a"
    r = one_process(ckpt, out, "--quiet")
    assert r.exit_code == 0, r.output
    return out


def test_two_ranks_equal_one_process(ckpt, reference, tmp_path):
    r = torchrun(2, ckpt, tmp_path / "a")
    assert r.returncode == 0, r.stderr[-3000:]
    assert_same_audit(reference, tmp_path / "a")
    assert r.stdout.count("exact replay: passed=True") == 1  # rank 0 alone prints the summary
    # rank 0's progress bar counts its own share of the forward passes, not all of them
    conditions = tuple(json.loads((reference / "config.json").read_text())["conditions"])
    sched = Schedule(N_EVAL, N_CALIB, B, R, conditions)
    share0 = sum(u.passes for stage in (sched.iter_stage1(), sched.iter_stage2()) for u in share(stage, 0, 2))
    assert share0 < sched.forward_passes() and f"{share0}/{share0}" in r.stderr, r.stderr[-2000:]


def test_dry_run_prints_the_split(ckpt, tmp_path):
    r = one_process(ckpt, tmp_path / "a", "--dry-run", "--world-size", 3)
    assert r.exit_code == 0, r.output
    per_rank = json.loads(re.search(r"3 processes: forward passes per rank (\[[\d, ]+\])", r.output).group(1))
    total = int(re.search(r"(\d+) forward passes", r.output).group(1))
    assert len(per_rank) == 3 and sum(per_rank) == total and max(per_rank) - min(per_rank) <= 2
    assert not (tmp_path / "a").exists()
    r = one_process(ckpt, tmp_path / "a", "--world-size", 3)  # a real run of one process
    assert r.exit_code == 2 and len(r.output.strip().splitlines()) == 1
    assert r.output.startswith("error: --world-size 3 but this run has 1 process")


@pytest.mark.slow
def test_three_ranks_equal_one_process(ckpt, reference, tmp_path):
    r = torchrun(3, ckpt, tmp_path / "a", "--quiet")
    assert r.returncode == 0, r.stderr[-3000:]
    assert_same_audit(reference, tmp_path / "a")


# ---- a failing rank ---------------------------------------------------------------------------------------------

def byte_of_rank(rank: int, world: int) -> tuple[int, list[int]]:
    """A byte that only `rank`'s stage-1 units see (in no other rank's windows, nor in the probed first batch), and
    the evaluation batches of that rank that hold it."""
    ev, ca = data.audit_windows(data.load_corpus("embedded", splits=("validation", "test")), N_EVAL, N_CALIB, WINDOW, 0)
    sched = Schedule(N_EVAL, N_CALIB, B, R, ("Correct",))

    def seen(units):
        return set(torch.cat([(ev.ids if u.kind == "capture" else ca.ids)[u.start:u.start + B]
                              for u in units]).flatten().tolist())

    others = set().union(*(seen(share(sched.iter_stage1(), k, world)) for k in range(world) if k != rank))
    mine = list(share(sched.iter_stage1(), rank, world))
    only = sorted(seen(mine) - others)
    assert only, "no byte is seen by this rank alone; change N_EVAL or the seed"
    x = only[0]
    return x, [u.start for u in mine if u.kind == "capture" and x in ev.ids[u.start:u.start + B]]


@pytest.mark.slow  # torchrun (its smoke test: test_two_ranks_equal_one_process)
def test_failing_rank_stops_every_rank_with_one_line(tmp_path):
    """A huge embedding row for one byte makes the coefficients of the windows holding it non-finite (the logits of
    the other windows stay finite): only rank 1 captures those windows, and both ranks stop with its error."""
    x, batches = byte_of_rank(1, 2)
    torch.manual_seed(0)
    model = FeatureGateGPT(config_for("tiny", "featuregate"))
    with torch.no_grad():
        model.wte.weight[x] = 1e30 * torch.randn(model.wte.weight.shape[1])
    bad = save_checkpoint(tmp_path / "bad", model, {"variant": "featuregate"})

    r = torchrun(2, bad, tmp_path / "a", "--quiet", log_dir=tmp_path / "logs")
    assert r.returncode != 0
    exits = set(re.findall(r"rank\s*: (\d+) \(local_rank.*\n\s*exitcode\s*: (\d+)", r.stderr))
    assert exits == {("0", "2"), ("1", "2")}, r.stderr[-3000:]  # torchrun's report: both ranks exited 2
    logs = sorted((tmp_path / "logs").rglob("attempt_0/*/stderr.log"))
    lines = [p.read_text().splitlines() for p in logs]
    assert len(lines) == 2 and lines[0] == lines[1] and len(lines[0]) == 1, lines
    line = lines[0][0]
    assert line.startswith("error: non-finite coefficients") and f"windows {batches[0]}..{batches[0] + B - 1}" in line
    assert batches[0] > 0  # a batch of rank 1, not the first batch every rank probes
    # nothing half-written is consumed: no profiles, no records; one process stops with the same line
    assert not (tmp_path / "a" / "profiles.safetensors").exists() and not (tmp_path / "a" / "records").exists()
    one = one_process(bad, tmp_path / "b", "--quiet")
    assert one.exit_code == 2 and one.output.strip() == line


@pytest.mark.slow
def test_lock_held_elsewhere_stops_every_rank(ckpt, tmp_path):
    """Rank 0 takes the lock inside an agreed phase: when another process holds it, no rank is left waiting."""
    held = AuditDir(tmp_path / "a")
    held.lock()
    try:
        r = torchrun(2, ckpt, tmp_path / "a", "--quiet", log_dir=tmp_path / "logs")
    finally:
        held.unlock()
    assert r.returncode != 0
    lines = [p.read_text().splitlines() for p in sorted((tmp_path / "logs").rglob("attempt_0/*/stderr.log"))]
    assert len(lines) == 2 and lines[0] == lines[1] and len(lines[0]) == 1, lines
    assert "being written by another fcaudit process" in lines[0][0]


# ---- a rank killed mid-audit, resumed at another world size ---------------------------------------------------

KILL_ARGS = ["--eval", 24, "--calib", 6, "--window", 64, "--randomizations", 6, "--batch-size", 2]


def worker_pid(agent: int, rank: int) -> int | None:
    """The pid of torchrun's worker of `rank` (a child of the agent process with RANK=rank)."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            environ = (proc / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == agent and f"RANK={rank}".encode() in environ:
            return int(proc.name)
    return None


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds torchrun's workers through /proc")
def test_killed_rank_resumes_at_another_world_size(ckpt, tmp_path):
    ref = tmp_path / "ref"
    r = one_process(ckpt, ref, "--quiet", args=KILL_ARGS)
    assert r.exit_code == 0, r.output
    out = tmp_path / "a"
    agent = subprocess.Popen(torchrun_cmd(2, ckpt, out, [*KILL_ARGS, "--quiet"]), env=env(),
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        # wait for stage 2 to start: rank 0 reduces the profiles once every rank is through stage 1 (a rank's
        # stage 2 writes its part files when a chunk of its units ends: here, at its end)
        while agent.poll() is None and time.monotonic() < deadline:
            if (out / "profiles.safetensors").exists():
                break
            time.sleep(0.005)
        assert agent.poll() is None, "the audit ended before it could be killed"
        with pytest.raises(FcauditError, match="another fcaudit process"):
            AuditDir(out).lock()  # rank 0 holds the lock: an independent process fails at once
        victim = worker_pid(agent.pid, 1)
        assert victim is not None
        os.kill(victim, signal.SIGKILL)
        _, err = agent.communicate(timeout=120)
    finally:
        if agent.poll() is None:
            agent.kill()
    assert agent.returncode != 0 and not (out / "records").exists(), err[-2000:]  # killed before the merge
    shutil.copytree(out, tmp_path / "b")
    r = torchrun(3, ckpt, out, "--quiet", args=KILL_ARGS)
    assert r.returncode == 0, r.stderr[-3000:]
    assert_same_audit(ref, out)
    r = one_process(ckpt, tmp_path / "b", "--quiet", args=KILL_ARGS)  # the same killed state, resumed by one process
    assert r.exit_code == 0, r.output
    assert_same_audit(ref, tmp_path / "b")


# ---- the library under torchrun --------------------------------------------------------------------------------

LIBRARY_SCRIPT = """
import json, sys
sys.path.insert(0, {tests!r})
from conftest import Leaky, gated, windows
from fcaudit.auditor import audit, group_from_env
from fcaudit.errors import FcauditError

group = group_from_env()
model = Leaky()
try:
    audit(model, gated(model), windows(8, 0), windows(4, 1), randomizations=1, out={out!r}, batch_size=2,
          quiet=True, group=group)
except FcauditError as e:
    # one write per line: print writes the newline apart, and two ranks share the pipe
    sys.stdout.write(json.dumps({{"rank": group.rank, "error": str(e)}}) + "\\n")
finally:
    group.close()
"""


@pytest.mark.slow
def test_library_ranks_failing_at_once_leave_one_consistent_report(tmp_path):
    """Every rank fails the exact replay check of its first batch: the error raised everywhere is rank 0's, and so
    is the one replay.json (it used to be whichever rank wrote last)."""
    script = tmp_path / "leak.py"
    script.write_text(LIBRARY_SCRIPT.format(tests=str(Path(__file__).parent), out=str(tmp_path / "a")))
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                        str(script)], env=env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    outcomes = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert sorted(o["rank"] for o in outcomes) == [0, 1] and len({o["error"] for o in outcomes}) == 1
    assert "exact replay failed on windows 0..1" in outcomes[0]["error"]
    assert json.loads((tmp_path / "a" / "replay.json").read_text())["windows"] == [0, 1]


@pytest.mark.slow  # rank 1 looks for rank 0's token for about a minute (network filesystems cache "not found")
def test_ranks_that_do_not_share_the_out_directory_are_stopped_before_any_work(ckpt, tmp_path):
    """--out on a node-local disk (here: another path per rank) would split the audit's files between the ranks."""
    script = tmp_path / "rank.sh"
    script.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m fcaudit audit "{ckpt}" --out "{tmp_path}/out$RANK" '
                      + " ".join(map(str, ARGS)) + " --quiet\n")
    script.chmod(0o755)
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                        "--no-python", str(script)], env=env(), capture_output=True, text=True, timeout=300)
    assert r.returncode != 0
    assert "error: rank 1 does not see rank 0's audit directory" in r.stderr, r.stderr[-2000:]
    assert not list((tmp_path / "out0").glob("coeffs/*")) and not (tmp_path / "out0" / "records").exists()


class _Rank(fcaudit.auditor.Group):
    """Rank `rank` of 2 in this process: rank 0's token is `token`; phases run here, main-only ones on rank 0."""

    def __init__(self, rank: int, token: str):
        self.rank, self.world, self.token = rank, 2, token

    def gather(self, obj):
        return [self.token, obj] if self.rank else [obj, self.token]

    def run(self, phase, main_only=False):
        return phase() if self.is_main or not main_only else None


def test_the_shared_directory_check_reads_rank_0s_token_and_leaves_no_file(tmp_path, monkeypatch):
    from fcaudit.auditor import driver

    monkeypatch.setattr(driver, "SHARED_WAIT", (0.0, 0.01))
    monkeypatch.setattr(driver.secrets, "token_hex", lambda n: "b" * 16)
    adir = AuditDir(tmp_path / "a")
    adir.root.mkdir()
    driver.check_shared(adir, _Rank(0, "unused"))  # rank 0 writes its token, reads it back, removes it
    assert not (adir.root / driver.SHARED_CHECK).exists()
    (adir.root / driver.SHARED_CHECK).write_text("a" * 16)  # rank 0's token, as rank 1 finds it on a shared disk
    driver.check_shared(adir, _Rank(1, "a" * 16))
    with pytest.raises(FcauditError, match=r"rank 1 does not see rank 0.s audit directory at .* \(another audit is there\)"):
        driver.check_shared(adir, _Rank(1, "c" * 16))
    (adir.root / driver.SHARED_CHECK).unlink()
    with pytest.raises(FcauditError, match="its check file is missing"):
        driver.check_shared(adir, _Rank(1, "a" * 16))
