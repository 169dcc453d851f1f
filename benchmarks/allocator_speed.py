"""What `fcaudit.allocator.keep_freed_memory` changes: glibc's defaults against the kept freed memory.

    python benchmarks/allocator_speed.py [--pairs 3] [--forwards 30] [--steps 20]

The malloc settings hold for a whole process, so each measurement is a fresh process, and the two settings
alternate (default, kept, default, kept, ...; one torch thread). Each process builds Dense and FeatureGate at the
demo preset and measures first their inference forwards (batch 8 x 128) interleaved, as `fcaudit execution` times
models (three rounds of 20 forwards of each, alternating models: median ms and minor page faults per forward), then
per model: the median of its forwards run on their own, the median AdamW training step (batch 16 x 128, forward +
backward + step) with its faults, and one audit (FeatureGate only: 32 + 32 windows, R = 4). Printed: the median over pairs of each quantity and of the per-pair ratio kept /
default, and the load average before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def child(forwards: int, steps: int) -> dict:
    import torch

    import fcaudit as fca
    from fcaudit.allocator import keep_freed_memory
    from fcaudit.loss import token_nll
    from fcaudit.models.featuregate import FeatureGateGPT, config_for

    kept = keep_freed_memory()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    out = {"kept": kept}
    models = {v: FeatureGateGPT(config_for("demo", v)) for v in ("dense", "featuregate")}
    x = torch.randint(0, 256, (8, 128))
    times = {v: [] for v in models}
    faults = dict.fromkeys(models, 0)
    with torch.inference_mode():
        for _ in range(3):
            for v, model in models.items():
                model(x)  # untimed: the switch from the other model
                f0 = _faults()
                for _ in range(20):
                    t0 = time.perf_counter()
                    model(x)
                    times[v].append(time.perf_counter() - t0)
                faults[v] += _faults() - f0
    for v in models:
        out[f"{v} interleaved ms"] = statistics.median(times[v]) * 1e3
        out[f"{v} interleaved faults"] = faults[v] / len(times[v])
    for variant, model in models.items():
        times, f0 = [], None
        with torch.inference_mode():
            for i in range(forwards + 3):
                if i == 3:
                    f0 = _faults()
                t0 = time.perf_counter()
                model(x)
                times.append(time.perf_counter() - t0)
        out[f"{variant} forward ms"] = statistics.median(times[3:]) * 1e3
        out[f"{variant} forward faults"] = (_faults() - f0) / forwards
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        batch = torch.randint(0, 256, (16, 128))
        times = []
        for i in range(steps + 3):
            if i == 3:
                f0 = _faults()
            t0 = time.perf_counter()
            loss = token_nll(model(batch), batch).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            times.append(time.perf_counter() - t0)
        out[f"{variant} train step ms"] = statistics.median(times[3:]) * 1e3
        out[f"{variant} train faults"] = (_faults() - f0) / steps
    model = model.eval()
    g = torch.Generator().manual_seed(0)
    ev, ca = torch.randint(0, 256, (32, 128), generator=g), torch.randint(0, 256, (32, 128), generator=g)
    for timed in (False, True):  # the first is a warm-up (imports)
        with tempfile.TemporaryDirectory() as d:
            t0 = time.perf_counter()
            fca.audit(model, fca.controller_for(model), ev if timed else ev[:8], ca if timed else ca[:8],
                      randomizations=4 if timed else 1, out=d, quiet=True)
            out["featuregate audit s"] = time.perf_counter() - t0
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--forwards", type=int, default=30)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.forwards, args.steps)))
        return
    print(f"load before: {os.getloadavg()[0]:.2f}; demo preset, one thread, a fresh process per measurement, "
          f"{args.pairs} pairs", flush=True)
    runs: dict[str, list[dict]] = {"default": [], "kept": []}
    for _ in range(args.pairs):
        for setting in runs:
            env = dict(os.environ, FCAUDIT_MALLOC="default" if setting == "default" else "")
            cmd = [sys.executable, __file__, "--child", "--forwards", str(args.forwards), "--steps", str(args.steps)]
            r = json.loads(subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
                           .strip().splitlines()[-1])
            if r.pop("kept") != (setting == "kept"):
                sys.exit(f"the {setting} process did not get its setting (a MALLOC_* variable in the environment?)")
            runs[setting].append(r)
    print(f"  {'quantity':<30} {'default':>10} {'kept':>10} {'kept/default':>13}")
    for key in runs["default"][0]:
        d, k = ([r[key] for r in runs[s]] for s in runs)
        ratios = [b / a if a else float("nan") for a, b in zip(d, k)]
        print(f"  {key:<30} {statistics.median(d):>10.2f} {statistics.median(k):>10.2f} "
              f"{statistics.median(ratios):>13.3f}")
    print(f"load after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
