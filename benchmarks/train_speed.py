"""Training throughput and forward latency of Dense, Uniform, LayerStatic and FeatureGate, as ratios to Dense.

    python benchmarks/train_speed.py [--preset demo] [--rounds 15] [--device cpu] [--threads N]

Training tokens/s: AdamW steps (forward, backward, clip, step) on random bytes at the preset's training batch and
block_size, median step time after warm-up. Forward latency: median no-grad forward at batch 8 over block_size
tokens (torch.utils.benchmark). Variants are interleaved round by round.
The paper (GPU, 76M) measured FeatureGate 30.8% slower than Dense in forward latency; every soft-gated variant
executes every block, so the gate only adds work.
"""

import argparse
import statistics
import time

import torch
import torch.utils.benchmark as benchmark
from rich.console import Console
from rich.table import Table

from fcaudit.loss import token_nll
from fcaudit.models.featuregate import FeatureGateGPT, config_for
from fcaudit.train import TRAIN_PRESETS, TrainConfig, make_optimizer

VARIANTS = ("dense", "uniform", "layerstatic", "featuregate")


def sync(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def make_train_step(model, batch, window, device):
    opt = make_optimizer(model, TrainConfig(preset="tiny"), device)
    ids = torch.randint(0, 256, (batch, window), device=device)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss = token_nll(model(ids), ids).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    return step


def make_forward_timer(model, window, device):
    ids = torch.randint(0, 256, (8, window), device=device)

    def forward():
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda"):
            return model(ids)

    return benchmark.Timer("forward()", globals={"forward": forward})


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="demo")
    p.add_argument("--rounds", type=int, default=15, help="interleaved rounds: one timed training step and one "
                   "forward measurement of each variant per round")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=None, help="training batch (default: the preset's)")
    p.add_argument("--min-run-time", type=float, default=0.2, help="seconds of forward timing per variant and round")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    batch = args.batch_size or TRAIN_PRESETS[args.preset]["batch_size"]

    # Variants are interleaved round by round and each reports its median, so that load from other processes
    # (a shared CPU) hits all of them alike instead of whichever ran during a busy moment.
    models = {}
    for variant in VARIANTS:
        torch.manual_seed(0)
        models[variant] = FeatureGateGPT(config_for(args.preset, variant)).to(device)
    window = models["dense"].config.block_size
    steps = {v: make_train_step(m, batch, window, device) for v, m in models.items()}
    timers = {v: make_forward_timer(m, window, device) for v, m in models.items()}
    step_s = {v: [] for v in VARIANTS}
    fwd_s = {v: [] for v in VARIANTS}
    for v in VARIANTS:
        for _ in range(args.warmup):
            steps[v]()
        timers[v].timeit(1)
    for _ in range(args.rounds):
        for v in VARIANTS:
            sync(device)
            t0 = time.perf_counter()
            steps[v]()
            sync(device)
            step_s[v].append(time.perf_counter() - t0)
            models[v].eval()
            fwd_s[v].append(timers[v].blocked_autorange(min_run_time=args.min_run_time).median)
            models[v].train()
    rows = [(v, batch * window / statistics.median(step_s[v]), statistics.median(fwd_s[v]) * 1e3) for v in VARIANTS]
    dense_tps, dense_lat = rows[0][1], rows[0][2]
    table = Table(title=f"{args.preset} on {device} ({torch.get_num_threads()} threads), train batch {batch} x {window}")
    for col in ("variant", "train tok/s", "vs Dense", "forward ms @ batch 8", "vs Dense"):
        table.add_column(col, justify="right")
    for variant, tps, lat in rows:
        table.add_row(variant, f"{tps:,.0f}", f"{tps / dense_tps:.3f}", f"{lat:.2f}", f"{lat / dense_lat:.3f}")
    Console().print(table)


if __name__ == "__main__":
    main()
