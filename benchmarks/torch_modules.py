"""What an audit of a model built from torch's own attention modules costs: `fca.audit` of a gated Transformer whose
blocks are nn.MultiheadAttention (`mha`) or nn.TransformerEncoderLayer (`encoder`), batch_first and in eval mode, so
that torch runs their fused fast path, against a bare loop of as many forward passes with their NLLs on the plain
model.

Each block's update is scaled by a per-token sigmoid gate, a submodule reached with Controller.from_modules. The
audit's forward passes are counted by a hook and must equal `fca.plan`'s count (its checks' passes included); the
bare loop runs as many plain passes over the evaluation batches. Audit and bare loop alternate in pairs whose order
alternates (A B B A ...), one torch thread; printed per model: the load, how many of the audit's passes ran the fused
kernel (the Flow check's pass and the causality check's run under a TorchFunctionMode, which turns it off), whether
the replay was bit-exact, each pair's ratio audit / bare in wall and in process CPU time, their medians and the
ratios of the minima. --smoke runs a tiny model once (what the tests run).
Usage: python benchmarks/torch_modules.py [--reps 3] [--randomizations 20] [--eval 64] [--calib 64] [--window 128]
       [--models mha encoder] [--smoke]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
from torch import nn

import fcaudit as fca
from fcaudit.loss import logits_of, token_nll

FUSED = {"mha": "_native_multi_head_attention", "encoder": "_transformer_encoder_layer_fwd"}


def causal(t: int) -> torch.Tensor:
    return torch.ones(t, t, dtype=torch.bool).triu(1)  # a bool mask: the fast path takes it


class AttnBlock(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.gate = nn.Sequential(nn.Linear(d, 1), nn.Sigmoid())
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        h = self.ln1(x)
        a, _ = self.attn(h, h, h, attn_mask=causal(x.shape[1]), need_weights=False)
        x = x + self.gate(h) * a
        return x + self.mlp(self.ln2(x))


class EncoderBlock(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(d, heads, dim_feedforward=4 * d, batch_first=True)
        self.gate = nn.Sequential(nn.Linear(d, 1), nn.Sigmoid())

    def forward(self, x):
        return x + self.gate(x) * (self.layer(x, src_mask=causal(x.shape[1]), is_causal=True) - x)


class GatedLM(nn.Module):
    def __init__(self, block: type, vocab: int = 256, d: int = 128, heads: int = 4, layers: int = 4, ctx: int = 128):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList(block(d, heads) for _ in range(layers))
        self.head = nn.Linear(d, vocab)

    def forward(self, ids):
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def clock() -> torch.Tensor:
    """(wall, process CPU) seconds."""
    return torch.tensor([time.perf_counter(), time.process_time()], dtype=torch.float64)


def bare_loop(model: nn.Module, ev: torch.Tensor, batch: int, passes: int) -> torch.Tensor:
    """`passes` plain forward passes with their NLLs, over the evaluation batches in turn."""
    batches = [ev[i:i + batch] for i in range(0, ev.shape[0], batch)]
    t0 = clock()
    with torch.inference_mode():
        for i in range(passes):
            ids = batches[i % len(batches)]
            token_nll(logits_of(model(ids)), ids).mean(1)
    return clock() - t0


def audit_once(model, ctrl, ev, ca, batch: int, R: int, fused: str) -> tuple[torch.Tensor, int, int, bool]:
    """(seconds, forward passes, passes that ran the fused kernel, replay bit-exact) of one audit."""
    passes, calls, kernel = [0], [0], getattr(torch, fused)

    def counted(*args, **kwargs):
        calls[0] += 1
        return kernel(*args, **kwargs)

    hook = model.register_forward_pre_hook(lambda *_: passes.__setitem__(0, passes[0] + 1))
    setattr(torch, fused, counted)  # the module looks the kernel up on torch at each call
    try:
        with tempfile.TemporaryDirectory() as out:
            t0 = clock()
            result = fca.audit(model, ctrl, ev, ca, randomizations=R, out=out, batch_size=batch, quiet=True)
            took = clock() - t0
    finally:
        setattr(torch, fused, kernel)
        hook.remove()
    exact = bool(result.replay.passed and result.replay.bit_equal)
    return took, passes[0], calls[0] // len(model.blocks), exact


def run(name: str, a: argparse.Namespace) -> dict:
    torch.manual_seed(0)
    block = AttnBlock if name == "mha" else EncoderBlock
    model = GatedLM(block, d=a.width, layers=a.layers, ctx=a.window).eval()
    ctrl = fca.Controller.from_modules(model, "blocks.*.gate", layout="batch token 1")
    g = torch.Generator().manual_seed(0)
    ev = torch.randint(0, 256, (a.eval, a.window), generator=g)
    ca = torch.randint(0, 256, (a.calib, a.window), generator=g)
    planned = fca.plan(model, ctrl, ev, ca, randomizations=a.randomizations, batch_size=a.batch).forward_passes
    if not a.smoke:
        audit_once(model, ctrl, ev[:8], ca[:4], a.batch, 1, FUSED[name])  # warm-up: imports, allocator
    row = {"model": name, "planned_passes": planned, "ratios": []}
    audits, bares = [], []
    for rep in range(a.reps):
        order = ("audit", "bare") if rep % 2 == 0 else ("bare", "audit")
        for kind in order:
            if kind == "audit":
                took, passes, fast, exact = audit_once(model, ctrl, ev, ca, a.batch, a.randomizations, FUSED[name])
                audits.append(took)
                row.update(forward_passes=passes, fused_passes=fast, replay_exact=exact)
            else:
                bares.append(bare_loop(model, ev, a.batch, planned))
        r = audits[-1] / bares[-1]
        row["ratios"].append(r.tolist())
        print(f"{name:8s} pair {rep}: audit {audits[-1][0]:.3f} s (CPU {audits[-1][1]:.3f} s), bare {bares[-1][0]:.3f}"
              f" s (CPU {bares[-1][1]:.3f} s), ratio wall {r[0]:.3f}, CPU {r[1]:.3f} (load {os.getloadavg()[0]:.2f})",
              flush=True)
    ratios = torch.stack([x / y for x, y in zip(audits, bares)])
    low = torch.stack(audits).min(0).values / torch.stack(bares).min(0).values
    print(f"{name:8s} audit / bare loop of {planned} forward passes: median of pairs wall "
          f"{statistics.median(ratios[:, 0].tolist()):.3f}, CPU {statistics.median(ratios[:, 1].tolist()):.3f}; ratio "
          f"of minima wall {low[0]:.3f}, CPU {low[1]:.3f}; fused kernel in {row['fused_passes']} of "
          f"{row['forward_passes']} passes; replay bit-exact {row['replay_exact']}; load {os.getloadavg()[0]:.2f}")
    return row


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--randomizations", type=int, default=20)
    p.add_argument("--eval", type=int, default=64)
    p.add_argument("--calib", type=int, default=64)
    p.add_argument("--window", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--models", nargs="+", choices=sorted(FUSED), default=["mha", "encoder"])
    p.add_argument("--smoke", action="store_true", help="a tiny model, one pair, R = 1 (what the tests run)")
    a = p.parse_args(argv)
    if a.smoke:
        a.reps, a.randomizations, a.eval, a.calib, a.window, a.batch, a.width, a.layers = 1, 1, 4, 2, 16, 2, 16, 2
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        print(f"load {os.getloadavg()[0]:.2f}; width {a.width}, {a.layers} layers, {a.eval} + {a.calib} windows of "
              f"{a.window}, batch {a.batch}, R = {a.randomizations}, 1 thread")
        return [run(name, a) for name in a.models]
    finally:
        torch.set_num_threads(threads)


if __name__ == "__main__":
    main()
