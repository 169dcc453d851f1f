"""Forward latency of Dense, Uniform, LayerStatic and FeatureGate at batch 8, as the paper reports it (section 4.5).

    python benchmarks/forward_speed.py [--preset demo paper-76m] [--reps 7] [--threads 1] [--json OUT]

FeatureGate runs four times: as it is (in inference on the CPU each block's attention output and its gate's
statistics come from one pass, `attend`, by the C++ kernel of fcaudit/models/kernel.py where it is built), as
"featuregate-ops" (that pass in torch ops over tiles of scores: the inference forward before the kernel, and where
no compiler is found), as "featuregate-fused" (the output from torch's fused attention kernel and the statistics
from the gate's own tiled pass: the forward with gradients, and an audit's capture), and as "featuregate-ref" (fused
output, features of the first, map-based implementation `reference_gate_features`, the first "before"). All models
of a preset are built once and timed interleaved, one forward each per round (several when a forward is short), so
load drift on a shared machine hits every variant alike; every variant computes with Dense's weights (gates apart),
and each timing is preceded by one untimed forward of the same model. The table gives the median and min wall ms per
batch over rounds and the median over rounds of each round's ratio to Dense, then the same median ms and ratio in
CPU time of the (one) computing thread, which leaves out time spent waiting for a core.
The load average is printed before and after.
The paper (GPU, 76M, batch 8): Dense 19.36 ms, Uniform 23.00, LayerStatic 24.10, FeatureGate 25.31 (1.308).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from contextlib import contextmanager, nullcontext

import torch

import fcaudit.models.featuregate as fg
from fcaudit.models import kernel
from fcaudit.models.featuregate import FeatureGateGPT, config_for

VARIANTS = ("dense", "uniform", "layerstatic", "featuregate", "featuregate-ops", "featuregate-fused",
            "featuregate-ref")


@contextmanager
def features_of(name: str):
    """-ops: the torch-op pass instead of the C++ kernel; -fused: the fused kernel's output path; -ref: that and the
    map-based reference features (the module looks all of them up at call time)."""
    fast, applies = fg.gate_features, kernel.applies
    if name.endswith("-ref"):
        fg.gate_features = fg.reference_gate_features
    if name.endswith("-ops"):
        kernel.applies = lambda *tensors: False
    try:
        with fg.fused_output() if name.endswith(("-fused", "-ref")) else nullcontext():
            yield
    finally:
        fg.gate_features, kernel.applies = fast, applies


def share_weights(models: dict[str, torch.nn.Module]) -> None:
    """Every variant computes with Dense's weights (gates keep their own parameters), so each round touches the same
    weights in every variant and none is timed on memory left idle by the others: on the shared VM memory idle for
    20-100 s was 2-3x slower to read once (a 1 GiB sum: 0.08 s warm, 0.16-0.24 s after the idle time)."""
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
        models[name] = FeatureGateGPT(config_for(preset, name.split("-")[0])).to(device).eval()
    share_weights(models)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def once(name: str, n: int) -> tuple[float, float]:
        """(wall, CPU time of this thread) per forward: with one thread, the CPU time leaves out the time this
        process waited for a core, so it is the steadier measure on a shared machine."""
        with features_of(name), torch.inference_mode():
            sync()
            t0, c0 = time.perf_counter(), time.thread_time()
            for _ in range(n):
                models[name](ids)
            sync()
            return (time.perf_counter() - t0) / n, (time.thread_time() - c0) / n

    for name in VARIANTS:  # warm-up (allocator, kernels)
        once(name, 1)
    inner = max(1, round(0.25 / once("dense", 1)[0]))  # >= ~0.25 s per measurement
    wall = {name: [] for name in VARIANTS}
    cpu = {name: [] for name in VARIANTS}
    for _ in range(reps):
        for name in VARIANTS:
            # one untimed forward first: with several models alive, memory a model has not touched for a few seconds
            # was slow to touch again on the shared VM (up to +30% on the next forward), unlike on a dedicated machine
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
                 torch=torch.__version__, kernel=kernel.library() is not None)
        results.append(r)
        print(f"\n{preset}: batch {r['batch']} x {r['tokens']} tokens, {device}, {args.threads} thread(s), "
              f"{r['reps']} rounds x {r['inner']} forward(s), attention kernel "
              f"{'built' if r['kernel'] else 'not available'}; {before} -> {r['load_after']}")
        print(f"  {'variant':16s} {'median ms':>10s} {'min ms':>10s} {'x Dense':>8s}   {'CPU ms':>10s} {'x Dense':>8s}")
        for name, row in r["rows"].items():
            print(f"  {name:16s} {row['median_ms']:10.2f} {row['min_ms']:10.2f} {row['ratio']:8.3f}   "
                  f"{row['cpu_median_ms']:10.2f} {row['cpu_ratio']:8.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
