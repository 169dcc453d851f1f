"""Sharded audit speed: wall time of one audit at world size 1 (one process) and 2 (torchrun, gloo, CPU).

Each run is a fresh process (world 1) or torchrun group (world 2) with one torch thread per process, on a demo-preset
FeatureGate (64 + 64 windows of 128 tokens, R = 5, batch 8). Runs alternate 1, 2, 1, 2, ... so a change in the
machine's load hits both; the table gives medians, the speed-up (world-1 time / world-2 time) and the 1-minute load
average around each run. "audit" is timed inside the processes (from a barrier before audit() to a barrier after it);
"command" is the whole command, with interpreter start, imports and torchrun's rendezvous. The records of every run
are checked equal byte for byte.

Usage: python benchmarks/shard_speed.py [--reps 3] [--json out.json]

Measured on the 2-core development machine, shared with other jobs (1-minute load 3.0-3.5 throughout), two
invocations of --reps 3 (2026-11-29): audit median 10.13 s (world 1) vs 7.52 s (world 2), speed-up 1.35x; and
9.62 s vs 8.47 s, 1.14x; single interleaved pairs ranged 0.97x-1.47x. The whole command is slower at world 2
(19.5-21.2 s vs 14.3-16.9 s). What limits it, from the per-phase table:
- the cores: at world 2 each process spends 4.3-6.0 s inside model.forward for half of the passes that take 5.7-7.8 s
  in one process, i.e. the two ranks share two cores that other jobs also load (load > 2), so a pass runs slower;
- the serial parts: rank 0's merge (about 0.7-1.0 s, the other rank waits at the barrier), the probe and the
  configuration that every rank computes, and AuditResult.load; the barriers themselves cost milliseconds (the
  stage-1 and stage-2 waits are 0.01-0.2 s, as the units split evenly);
- the command: every rank imports torch and fcaudit and torchrun adds its rendezvous and teardown (about 7 s here),
  which a 10 s audit cannot repay; sharding is meant for audits of minutes to hours (not measured here).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SRC = str(Path(__file__).resolve().parents[1] / "src")


PHASES = ["prepare", "same config", "lock + config", "stage 1", "profiles", "stage 2", "merge"]


class TimedGroup:
    """The group, with each phase's own time and its wait at the barrier after it (the other ranks' work)."""

    def __init__(self, group):
        self.group, self.phases = group, []

    def __getattr__(self, name):
        return getattr(self.group, name)

    def run(self, phase, main_only=False):
        own = [0.0]

        def timed():
            t0 = time.perf_counter()
            try:
                return phase()
            finally:
                own[0] = time.perf_counter() - t0

        t0 = time.perf_counter()
        try:
            return self.group.run(timed, main_only)
        finally:
            self.phases.append((own[0], time.perf_counter() - t0 - own[0]))


def child(args) -> None:
    """One audit, run by every rank; rank 0 prints one JSON line."""
    import torch

    from fcaudit.auditor import audit, group_from_env
    from fcaudit.families import controller_for
    from fcaudit.models.featuregate import FeatureGateGPT, config_for
    import fcaudit.stats.inference  # noqa: F401  (scipy's import time is per process, not per audit)

    torch.set_num_threads(1)
    base = group_from_env()
    group = TimedGroup(base)
    torch.manual_seed(0)
    cfg = config_for(args.preset, "featuregate")
    model = FeatureGateGPT(cfg).eval()
    g = torch.Generator().manual_seed(0)
    ev = torch.randint(0, cfg.vocab_size, (args.n_eval, args.window), generator=g)
    ca = torch.randint(0, cfg.vocab_size, (args.n_calib, args.window), generator=g)
    inside = [0.0, 0.0]  # seconds inside model.forward, start of the current call
    model.register_forward_pre_hook(lambda m, a: inside.__setitem__(1, time.perf_counter()))
    model.register_forward_hook(lambda m, a, o: inside.__setitem__(0, inside[0] + time.perf_counter() - inside[1]))
    group.gather(None)  # start together
    t0 = time.perf_counter()
    audit(model, controller_for(model), ev, ca, randomizations=args.randomizations, seed=0, out=args.out,
          batch_size=args.batch_size, quiet=True, group=group)
    mine = time.perf_counter() - t0  # this rank's own time, before waiting for the others to leave
    forward = group.gather(inside[0])
    own = group.gather(mine)
    phases = group.gather(group.phases)
    wall = time.perf_counter() - t0
    if group.is_main:
        print(json.dumps({"world": group.world, "audit_s": wall, "forward_s_per_rank": forward,
                          "rank_s": own, "phases_per_rank": phases}))
    base.close()


def records_digest(out: Path) -> str:
    h = hashlib.sha256()
    for p in sorted((out / "records").rglob("*.parquet")) + [out / "profiles.safetensors"]:
        h.update(str(p.relative_to(out)).encode())
        h.update(p.read_bytes())
    return h.hexdigest()


def run_once(world: int, args) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([SRC, *filter(None, [os.environ.get("PYTHONPATH")])])}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "audit"
        own = [__file__, "--child", "--out", str(out)] + [
            f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k in
            ("preset", "window", "batch_size", "randomizations", "n_eval", "n_calib")]
        launch = [sys.executable] if world == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                      f"--nproc_per_node={world}"]
        load = os.getloadavg()[0]
        t0 = time.perf_counter()
        proc = subprocess.run(launch + own, env=env, capture_output=True, text=True)
        command = time.perf_counter() - t0
        if proc.returncode:
            sys.exit(proc.stderr[-3000:])
        row = json.loads(proc.stdout.strip().splitlines()[-1])
        return {**row, "command_s": command, "load_before": load, "load_after": os.getloadavg()[0],
                "digest": records_digest(out)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="demo")
    p.add_argument("--window", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--randomizations", type=int, default=5)
    p.add_argument("--n-eval", type=int, default=64)
    p.add_argument("--n-calib", type=int, default=64)
    p.add_argument("--reps", type=int, default=3, help="runs per world size, interleaved")
    p.add_argument("--json", help="also write the runs to this file")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args)
        return
    runs = []
    for rep in range(args.reps):
        for world in (1, 2):
            r = run_once(world, args)
            runs.append(r)
            print(f"rep {rep} world {world}: audit {r['audit_s']:.2f} s, command {r['command_s']:.2f} s, "
                  f"forward per rank {[round(f, 2) for f in r['forward_s_per_rank']]} s, "
                  f"load {r['load_before']:.2f} -> {r['load_after']:.2f}", flush=True)
    assert len({r["digest"] for r in runs}) == 1, "records or profiles differ between runs"
    med = {w: {k: statistics.median(r[k] for r in runs if r["world"] == w) for k in ("audit_s", "command_s")}
           for w in (1, 2)}
    print(f"\npreset={args.preset} eval={args.n_eval} calib={args.n_calib} window={args.window} "
          f"batch={args.batch_size} R={args.randomizations}, one thread per process, {os.cpu_count()} CPUs, "
          f"{args.reps} runs per world size; records and profiles equal byte for byte in every run")
    print(f"{'':>8} {'world 1':>9} {'world 2':>9} {'speed-up':>9}")
    for k, name in (("audit_s", "audit"), ("command_s", "command")):
        print(f"{name:>8} {med[1][k]:>8.2f}s {med[2][k]:>8.2f}s {med[1][k] / med[2][k]:>8.2f}x")
    print("\nper phase, median over runs: own work / wait at the barrier after it, seconds, per rank")
    for w in (1, 2):
        rows = [r["phases_per_rank"] for r in runs if r["world"] == w]
        for i, name in enumerate(PHASES):
            med = [[statistics.median(x[k][i][j] for x in rows) for j in (0, 1)] for k in range(w)]
            cells = [f"{own:6.2f} / {wait:5.2f}" for own, wait in med]
            print(f"  world {w} {name:<14} " + "   ".join(f"rank {k}: {c}" for k, c in enumerate(cells)))
    loads = [x for r in runs for x in (r["load_before"], r["load_after"])]
    print(f"1-minute load average during the runs: {min(loads):.2f} .. {max(loads):.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "runs": runs, "medians": med}, indent=2) + "\n")


if __name__ == "__main__":
    main()
