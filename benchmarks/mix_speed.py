"""MUDDPythia's stream mixing: the published-order sum mix() against mix_stacked() (MUDDPythia(fast_mix=True)).

    python benchmarks/mix_speed.py [--reps 7] [--threads 1] [--full-1p4b]

Op level, per layer, as the forward pass runs it: mix(dw, hiddens) against writing the block output into the
stack plus mix_stacked(dw, stack), at the demo byte preset's shape and at MUDDPythia-1.4B's width (D = 2048; a
middle layer with 13 sources and the last layer, 25 sources into one stream), float32 and bfloat16. Whole forward:
the demo byte preset at batch 8 x 128 tokens, float32. Interleaved rounds; median ms and the median of per-round
speedups; the max |delta| between the two paths is printed with each row. The load average is printed.
--full-1p4b also builds MUDDPythia-1.4B (published config, random weights, a non-silent controller) in bfloat16
(~9 GiB of RAM at its peak) and prints max |delta logit| of one 1 x 64-token forward through both paths, and of
each against float32 arithmetic on the same (bf16-rounded) weights.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from fcaudit.models.muddpythia import BYTE_PRESETS, MUDDConfig, MUDDPythia, mix, mix_stacked


def timed(fn, inner: int) -> float:
    t0 = time.perf_counter()
    for _ in range(inner):
        fn()
    return (time.perf_counter() - t0) / inner


def compare(name: str, published, fast, delta: float, reps: int) -> None:
    inner = max(1, round(0.2 / timed(published, 1)))
    a, b = [], []
    for _ in range(reps):
        a.append(timed(published, inner))
        b.append(timed(fast, inner))
    speedup = statistics.median(x / y for x, y in zip(a, b))
    print(f"  {name:34s} {1e3 * statistics.median(a):9.3f} {1e3 * statistics.median(b):9.3f} {speedup:8.2f}x"
          f"   max|d| {delta:.3g}")


def op_case(B: int, T: int, D: int, J: int, C: int, L: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(0)
    hs = [torch.randn(B, T, D, generator=g).to(dtype) for _ in range(J)]
    dw = (torch.randn(C, B, T, J, generator=g) * 0.5).to(dtype)
    stack = torch.empty(B, T, L + 1, D, dtype=dtype)
    for j, h in enumerate(hs):
        stack[:, :, j] = h

    def fast():
        stack[:, :, J - 1] = hs[-1]  # the forward pass writes each block output into the stack once
        return mix_stacked(dw, stack)

    delta = max((x.float() - y.float()).abs().max().item() for x, y in zip(mix(dw, hs), fast()))
    return (lambda: mix(dw, hs)), fast, delta


def logit_deltas_1p4b() -> dict[str, float]:
    """max |delta logit| of the bf16 paths against each other and against float32 arithmetic on the same weights."""
    cfg = MUDDConfig(block_size=2048, vocab_size=50432, n_layer=24, n_head=16, dim=2048, intermediate_size=8192,
                     use_qk_norm=True, expand_last=True, round64=True)
    torch.manual_seed(0)
    model = MUDDPythia(cfg)
    with torch.no_grad():
        for dd in model.dynamic_dense:
            dd.w2.weight.normal_(std=0.02)
    ids = torch.randint(0, cfg.vocab_size, (1, 64), generator=torch.Generator().manual_seed(1))
    model = model.to(torch.bfloat16).float().eval()  # float32 arithmetic on bf16-representable weights
    exact = model(ids)
    model = model.to(torch.bfloat16)
    published = model(ids).float()
    model.fast_mix = True
    fast = model(ids).float()
    d = lambda a, b: (a - b).abs().max().item()  # noqa: E731
    return {"fast vs published": d(fast, published), "published vs float32": d(published, exact),
            "fast vs float32": d(fast, exact), "max |logit|": exact.abs().max().item()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--full-1p4b", action="store_true", help="also compare the logits of a random 1.4B model")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print("%d thread(s), torch %s; load average %.2f %.2f %.2f" % (args.threads, torch.__version__, *os.getloadavg()))
    print(f"  {'case':34s} {'mix ms':>9s} {'fast ms':>9s} {'speedup':>9s}")
    with torch.inference_mode():
        for dtype in (torch.float32, torch.bfloat16):
            tag = str(dtype).removeprefix("torch.")
            cases = {f"demo layer 3 (8x128, D=96) {tag}": (8, 128, 96, 5, 1, 4),
                     f"demo layer 2 (8x128, D=96) {tag}": (8, 128, 96, 4, 4, 4),
                     f"1.4B layer 11 (1x512, D=2048) {tag}": (1, 512, 2048, 13, 4, 24),
                     f"1.4B layer 23 (1x512, D=2048) {tag}": (1, 512, 2048, 25, 1, 24)}
            for name, shape in cases.items():
                compare(name, *op_case(*shape, dtype), args.reps)
        torch.manual_seed(0)
        model = MUDDPythia(BYTE_PRESETS["demo"]).eval()
        with torch.no_grad():  # a trained-looking controller, so the mix is not the init's one-hot
            for dd in model.dynamic_dense:
                dd.w2.weight.normal_(std=0.02)
        ids = torch.randint(0, 256, (8, 128), generator=torch.Generator().manual_seed(1))

        def run(fast: bool):
            model.fast_mix = fast
            return model(ids)

        delta = (run(False) - run(True)).abs().max().item()
        compare("whole forward, demo preset 8x128", lambda: run(False), lambda: run(True), delta, args.reps)
        if args.full_1p4b:
            deltas = ", ".join(f"{k} {v:.3g}" for k, v in logit_deltas_1p4b().items())
            print(f"  1.4B logits, 1 x 64 tokens, bfloat16 (max |delta|): {deltas}")
    print("load average %.2f %.2f %.2f" % os.getloadavg())


if __name__ == "__main__":
    main()
