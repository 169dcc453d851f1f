"""Audit overhead: wall time / (forward passes x plain forward time per batch), and peak RSS, for 64 vs 512 windows.

The floor is 1.0 (an audit is nothing but forward passes); the aim is <= 1.15. Each window count runs in a fresh
process so its peak RSS is its own. Usage: python benchmarks/audit_speed.py [--preset demo] [--n-eval 64 512]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import torch


def child(args) -> dict:
    from fcaudit.audit import audit
    from fcaudit.audit.runner import forward_passes
    from fcaudit.controllers import controller_for
    from fcaudit.models.featuregate import FeatureGateGPT, config_for
    import fcaudit.stats.summary  # noqa: F401  (scipy's import time is per process, not per audit)

    n_eval = args.n_eval[0]
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = config_for(args.preset, "featuregate")
    device = torch.device(args.device)
    model = FeatureGateGPT(cfg).to(device).eval()
    g = torch.Generator().manual_seed(0)
    ev = torch.randint(0, cfg.vocab_size, (n_eval, args.window), generator=g)
    ca = torch.randint(0, cfg.vocab_size, (args.n_calib, args.window), generator=g)
    batch = ev[: args.batch_size].to(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    with torch.inference_mode():
        for _ in range(5):
            model(batch)
        times = []
        for _ in range(args.timing_reps):
            sync()
            t0 = time.perf_counter()
            model(batch)
            sync()
            times.append(time.perf_counter() - t0)
    t_fwd = statistics.median(times)
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    # time spent inside model forward during the audit: a load-robust denominator on a busy machine
    inside = [0.0, 0.0]

    def enter(module, args):
        sync()
        inside[1] = time.perf_counter()

    def leave(module, args, output):
        sync()
        inside[0] += time.perf_counter() - inside[1]

    model.register_forward_pre_hook(enter)
    model.register_forward_hook(leave)
    with tempfile.TemporaryDirectory() as out:
        t0 = time.perf_counter()
        audit(model, controller_for(model), ev, ca, randomizations=args.randomizations, seed=0, out=out,
              batch_size=args.batch_size, quiet=True)
        sync()
        wall = time.perf_counter() - t0
    passes = forward_passes(n_eval, args.n_calib, args.batch_size, args.randomizations) + 1  # + the probe
    return {"n_eval": n_eval, "forward_passes": passes, "plain_forward_s": t_fwd, "audit_wall_s": wall,
            "ratio": wall / (passes * t_fwd), "forward_s_inside_audit": inside[0], "ratio_inside": wall / inside[0], "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "rss_before_audit_mib": rss_before / 2**20,
            "cuda_peak_mib": torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else None}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--preset", default="demo")
    p.add_argument("--window", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--randomizations", type=int, default=20)
    p.add_argument("--n-eval", type=int, nargs="+", default=[64, 512])
    p.add_argument("--n-calib", type=int, default=64)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--timing-reps", type=int, default=30)
    p.add_argument("--json", help="also write the rows to this file")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    rows = []
    for n in args.n_eval:
        cmd = [sys.executable, __file__, "--child", "--n-eval", str(n)] + [
            f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
            if k not in ("n_eval", "child", "json") and v is not None]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode:
            sys.exit(proc.stderr)
        out = proc.stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
    print(f"preset={args.preset} window={args.window} batch={args.batch_size} R={args.randomizations} "
          f"calib={args.n_calib} device={args.device}")
    print(f"{'n_eval':>7} {'passes':>7} {'fwd ms':>8} {'audit s':>8} {'ratio':>6} {'ratio*':>7} {'peak RSS MiB':>13} "
          f"{'RSS pre-audit':>14}")
    for r in rows:
        print(f"{r['n_eval']:>7} {r['forward_passes']:>7} {1e3 * r['plain_forward_s']:>8.2f} {r['audit_wall_s']:>8.2f} "
              f"{r['ratio']:>6.3f} {r['ratio_inside']:>7.3f} {r['peak_rss_mib']:>13.1f} {r['rss_before_audit_mib']:>14.1f}"
              + (f"  cuda peak {r['cuda_peak_mib']:.0f} MiB" if r["cuda_peak_mib"] is not None else ""))
    print("ratio = audit wall / (passes x plain forward per batch); ratio* = audit wall / time inside model.forward "
          "during the audit (robust to a busy machine)")
    if args.json:
        from fcaudit.io import write_json
        write_json(args.json, rows)


if __name__ == "__main__":
    main()
