"""Does `fcaudit audit --dry-run` predict an audit's peak memory? Estimate vs measurement, on the CPU.

Builds MUDDPythia with the public 1.4B configuration (random weights, bf16, as the published checkpoint) and asks
`fca.plan` for the peak memory of an audit at batch B and window T (parameters, plus what a pass allocates once and,
times B, the activations per window, from a one- and a two-window pass, plus three batches of coefficients). Then it
measures the real peak of what an audit does per batch, a capture pass and an exact-replay pass, as the growth of the
resident set above the parameters (Linux VmHWM, reset before; glibc's freed heap memory counts there, not in the
estimate: MALLOC_MMAP_THRESHOLD_=65536 leaves the tensors alone). The paper's window is 2048; the CPU here takes windows of --window tokens (default 256).
Usage: python benchmarks/dry_run_memory.py [--window 256] [--batch-size 8] [--layers 24]
"""

from __future__ import annotations

import argparse
import os
import time

import torch


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--layers", type=int, default=24, help="n_layer of the 1.4B config (fewer: a quicker check)")
    args = p.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    import fcaudit as fca
    from fcaudit.auditor.engine import capture_batch, forward_nll
    from fcaudit.models.muddpythia import MUDDConfig, MUDDPythia

    cfg = MUDDConfig(n_layer=args.layers, use_qk_norm=True, expand_last=True, round64=True, torch_dtype="bfloat16")
    torch.manual_seed(0)
    model = MUDDPythia(cfg).to(torch.bfloat16).eval()
    ctrl = fca.controller_for(model)
    ids = torch.randint(0, 50000, (args.batch_size, args.window), generator=torch.Generator().manual_seed(0))
    t0 = time.perf_counter()
    plan = fca.plan(model, ctrl, ids, ids[:1], batch_size=args.batch_size, randomizations=20)
    print(f"plan ({time.perf_counter() - t0:.0f} s): {plan}", flush=True)
    with torch.inference_mode():
        with open("/proc/self/clear_refs", "w") as f:  # the peak reset (Linux): the growth below is this batch's own
            f.write("5")
        base = _status("VmRSS")
        t0 = time.perf_counter()
        coeffs, _, _ = capture_batch(model, ctrl, ids, None, decoding=True)
        with ctrl.replay(coeffs):
            forward_nll(model, ids, None)
        peak = _status("VmHWM") - base
    params = plan.param_bytes
    estimate = plan.peak_memory_bytes - params
    print(f"one batch ({time.perf_counter() - t0:.0f} s): measured peak above the parameters {peak / 2**30:.2f} GiB, "
          f"estimated {estimate / 2**30:.2f} GiB (ratio {estimate / peak:.2f}); with the parameters "
          f"({params / 2**30:.2f} GiB) the totals are {(peak + params) / 2**30:.2f} vs "
          f"{plan.peak_memory_bytes / 2**30:.2f} GiB (ratio {plan.peak_memory_bytes / (peak + params):.2f})")


if __name__ == "__main__":
    main()
