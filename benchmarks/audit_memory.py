"""Does an audit's memory grow with the number of evaluation windows? Peak RSS above the level before the audit.

Each window count runs in a fresh process (tiny FeatureGate preset, T = 64, R = 20, 64 calibration windows, batch 8):
the model is built and warmed up, the peak resident set is reset (Linux /proc/self/clear_refs), the audit runs into a
fresh directory, and the growth of the peak over the pre-audit level is reported with the on-disk store size. For
the replays (stage 2, the part whose work grows with windows x R) it also reports their peak above the level they
start at and the median of the resident set after each (condition, r): a peak is the running maximum of a level that
glibc moves up and down by MiBs, so it creeps up as a run gets longer even when the level does not grow.
With --heap (needs `pip install memray`), each row is a second fresh process that counts instead the live
allocations made during the audit at their peak (memray's high-water mark): what the audit holds, apart from the
free memory the allocator keeps resident (which the peak RSS includes).
Usage: python benchmarks/audit_memory.py [--n-eval 64 512 2048] [--heap]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))


def child(n_eval: int, randomizations: int, heap: bool) -> dict:
    import torch

    import fcaudit as fca
    from fcaudit.models.featuregate import FeatureGateGPT, config_for

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = FeatureGateGPT(config_for("tiny", "featuregate")).eval()
    g = torch.Generator().manual_seed(0)
    ev = torch.randint(0, 256, (n_eval, 64), generator=g)
    ca = torch.randint(0, 256, (64, 64), generator=g)
    with tempfile.TemporaryDirectory() as warm:  # imports, lazy tables
        fca.audit(model, fca.controller_for(model), ev[:16], ca[:8], randomizations=1, out=warm, quiet=True)
    run = lambda out: fca.audit(model, fca.controller_for(model), ev, ca, randomizations=randomizations,  # noqa: E731
                                out=out, quiet=True)
    if heap:
        import memray

        with tempfile.TemporaryDirectory() as out, tempfile.TemporaryDirectory() as trace:
            with memray.Tracker(Path(trace) / "audit.bin"):
                run(out)
            peak = memray.FileReader(Path(trace) / "audit.bin").metadata.peak_memory
        return {"n_eval": n_eval, "heap_peak_mib": peak / 2**20}
    from fcaudit.auditor import files

    write_tensors, write_columns, marks, levels = files.write_tensors, files.write_columns, {}, []

    def profiles_then_replays(path, *args, **kwargs):  # the static profiles are the last write before the replays
        written = write_tensors(path, *args, **kwargs)
        if Path(path).name == "profiles.safetensors":  # the replays (stage 2): what scales with windows x R
            marks["peak_before"], marks["start"] = _reset_peak(), _status("VmRSS")
        return written

    def one_run(path, *args, **kwargs):  # the resident set after each (condition, r)'s records, written as it ends
        written = write_columns(path, *args, **kwargs)
        if Path(path).parent.name != "Correct":  # Correct's records are stage 1's, merged at the end
            levels.append(_status("VmRSS") - marks["start"])
            marks["replays"] = _status("VmHWM") - marks["start"]  # the peak up to the last replay's records
        return written

    files.write_tensors, files.write_columns = profiles_then_replays, one_run
    _reset_peak()
    before = _status("VmRSS")
    with tempfile.TemporaryDirectory() as out:
        run(out)
        store = sum(p.stat().st_size for p in (Path(out) / "coeffs").iterdir())
    peak = max(marks["peak_before"], _status("VmHWM"))
    return {"n_eval": n_eval, "rss_before_mib": before / 2**20, "peak_growth_mib": (peak - before) / 2**20,
            "replays_growth_mib": marks["replays"] / 2**20, "replays_median_mib": statistics.median(levels) / 2**20,
            "store_mib": store / 2**20}


def _reset_peak() -> int:
    """Reset the peak resident set size (VmHWM) to the current one; returns the peak before."""
    peak = _status("VmHWM")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return peak


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n-eval", type=int, nargs="+", default=[64, 512, 2048])
    p.add_argument("--randomizations", type=int, default=20)
    p.add_argument("--heap", action="store_true", help="also the live allocations' peak (memray)")
    p.add_argument("--child", type=int, help=argparse.SUPPRESS)
    p.add_argument("--child-heap", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.randomizations, args.child_heap)))
        return
    print(f"load before: {os.getloadavg()[0]:.2f}; tiny FeatureGate, T=64, R={args.randomizations}, 64 calibration "
          "windows, batch 8, one thread, a fresh process per row", flush=True)
    for n in args.n_eval:
        r = _run_child(n, args.randomizations, heap=False)
        line = (f"{r['n_eval']:>6} windows: peak RSS +{r['peak_growth_mib']:.1f} MiB above {r['rss_before_mib']:.0f} "
                f"MiB; replays: peak +{r['replays_growth_mib']:.2f}, median {r['replays_median_mib']:+.2f} MiB above "
                f"their start (store on disk {r['store_mib']:.2f} MiB)")
        if args.heap:
            heap = _run_child(n, args.randomizations, heap=True)["heap_peak_mib"]
            line += f"; live allocations at their peak {heap:.3f} MiB"
        print(line, flush=True)


def _run_child(n: int, randomizations: int, heap: bool) -> dict:
    cmd = [sys.executable, __file__, "--child", str(n), "--randomizations", str(randomizations)]
    out = subprocess.run(cmd + (["--child-heap"] if heap else []), capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


if __name__ == "__main__":
    main()
