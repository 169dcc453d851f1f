"""Forward latency of Dense, Uniform, LayerStatic and FeatureGate at batch 8, as the paper reports it (section 4.5).

    python benchmarks/forward_speed.py [--preset demo paper-76m] [--reps 7] [--threads 1] [--json OUT]

Every variant computes its attention output by the same operation, so the ratios to Dense measure the gates: a
scalar multiply for Uniform and LayerStatic, the controller (its features and MLP) for FeatureGate. The variants of a
preset share Dense's weights (gates apart) and are timed interleaved, one measurement each per round after one
untimed forward, so load drift on a shared machine hits all alike. Printed per variant: the median and min wall ms
per batch over rounds, the median of each round's ratio to Dense, and the same in CPU time of the computing threads
(which leaves out time spent waiting for a core); the load average before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from fcaudit.models.featuregate import FeatureGateGPT, config_for

VARIANTS = ("dense", "uniform", "layerstatic", "featuregate")


def share_weights(models: dict[str, torch.nn.Module]) -> None:
    """Every variant computes with Dense's weights (gates keep their own), so each round reads the same memory."""
    base = dict(models["dense"].named_parameters(remove_duplicate=False))
    for model in models.values():
        for name, _ in list(model.named_parameters(remove_duplicate=False)):
            if name in base:
                owner, _, attr = name.rpartition(".")
                setattr(model.get_submodule(owner), attr, base[name])


def load() -> str:
    return "load average %.2f %.2f %.2f" % os.getloadavg()


def bench_preset(preset: str, reps: int, batch: int, device: torch.device) -> dict:
    cfg = config_for(preset, "dense")
    ids = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size), generator=torch.Generator().manual_seed(0))
    ids = ids.to(device)
    models = {}
    for name in VARIANTS:
        torch.manual_seed(0)
        models[name] = FeatureGateGPT(config_for(preset, name)).to(device).eval()
    share_weights(models)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def once(name: str, n: int) -> tuple[float, float]:
        """(wall, CPU time of this process) per forward."""
        with torch.inference_mode():
            sync()
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(n):
                models[name](ids)
            sync()
            return (time.perf_counter() - t0) / n, (time.process_time() - c0) / n

    for name in VARIANTS:  # warm-up (allocator, kernel selection)
        once(name, 1)
    inner = max(1, round(0.25 / once("dense", 1)[0]))  # >= ~0.25 s per measurement
    wall = {name: [] for name in VARIANTS}
    cpu = {name: [] for name in VARIANTS}
    for _ in range(reps):
        for name in VARIANTS:
            once(name, 1)
            w, c = once(name, inner)
            wall[name].append(w)
            cpu[name].append(c)
    rows = {}
    for name in VARIANTS:
        rows[name] = {"median_ms": 1e3 * statistics.median(wall[name]), "min_ms": 1e3 * min(wall[name]),
                      "ratio": statistics.median(a / d for a, d in zip(wall[name], wall["dense"])),
                      "cpu_median_ms": 1e3 * statistics.median(cpu[name]),
                      "cpu_ratio": statistics.median(a / d for a, d in zip(cpu[name], cpu["dense"]))}
    return {"preset": preset, "batch": batch, "tokens": cfg.block_size, "reps": reps, "inner": inner, "rows": rows}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", nargs="+", default=["demo", "paper-76m"])
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    results = []
    for preset in args.preset:
        before = load()
        r = bench_preset(preset, args.reps, args.batch, device)
        r.update(load_before=before, load_after=load(), threads=args.threads, device=str(device),
                 torch=torch.__version__)
        results.append(r)
        print(f"\n{preset}: batch {r['batch']} x {r['tokens']} tokens, {device}, {args.threads} thread(s), "
              f"{r['reps']} rounds x {r['inner']} forward(s); {before} -> {r['load_after']}")
        print(f"  {'variant':12s} {'median ms':>10s} {'min ms':>10s} {'x Dense':>8s}   {'CPU ms':>10s} {'x Dense':>8s}")
        for name, row in r["rows"].items():
            print(f"  {name:12s} {row['median_ms']:10.2f} {row['min_ms']:10.2f} {row['ratio']:8.3f}   "
                  f"{row['cpu_median_ms']:10.2f} {row['cpu_ratio']:8.3f}")
        fg = r["rows"]["featuregate"]
        print(f"  FeatureGate's overhead against Dense: {100 * (fg['ratio'] - 1):+.1f}% wall, "
              f"{100 * (fg['cpu_ratio'] - 1):+.1f}% CPU time")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
