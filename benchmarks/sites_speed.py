"""What an op site costs: `fca.audit` of a controller reached through `Controller.from_ops` against a bare loop of the
same forward passes.

The model is a user's gated LM whose gate is a local `torch.sigmoid(...)` inside each block's forward (no submodule
returns it), so the site's TorchFunctionMode is active for the whole block: every torch call of the block passes
through it, in capture and in replay. The bare loop runs the audit's forward passes with their NLLs on the plain
model (no controller, no mode): the pre-write checks' passes, a capture per evaluation and calibration batch, the
exact replay check and one pass per (condition, randomization, batch). Audit and bare loop alternate in pairs whose
order alternates (A B B A ...), one torch thread; printed: the load, each pair's ratio in wall and in process CPU
time (which leaves out waiting for a core on a shared machine), their medians and the ratios of the minima; then
the hot path alone: one replay pass of a batch under the op site against one plain forward pass, alternated many
times (median ratio), beside a bare TorchFunctionMode around each block (what any op site built on such a
mode pays). With --baseline the same is measured for the model whose gate is a submodule, audited with
Controller.from_modules (the engine's own share, without the op mode).
Usage: python benchmarks/sites_speed.py [--reps 3] [--randomizations 20] [--eval 64] [--calib 64] [--baseline]
       [--width 96] [--hot-path-only]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

import fcaudit as fca
from fcaudit import protocol
from fcaudit.auditor.units import Schedule
from fcaudit.loss import logits_of, token_nll


class InlineGateBlock(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.ln, self.gate_proj = nn.LayerNorm(d), nn.Linear(d, 1)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, h):
        g = torch.sigmoid(self.gate_proj(h))  # the coefficient: a local tensor of forward
        return h + g * self.mlp(self.ln(h))


class ModuleGateBlock(InlineGateBlock):
    """The same block with its gate a submodule's output: the from_modules baseline (no op mode)."""

    def __init__(self, d: int):
        super().__init__(d)
        self.gate = nn.Sequential(self.gate_proj, nn.Sigmoid())

    def forward(self, h):
        return h + self.gate(h) * self.mlp(self.ln(h))


class InlineGatedLM(nn.Module):
    def __init__(self, vocab: int = 256, d: int = 96, layers: int = 4, block: type = InlineGateBlock):
        super().__init__()
        self.emb, self.head = nn.Embedding(vocab, d), nn.Linear(d, vocab)
        self.blocks = nn.ModuleList(block(d) for _ in range(layers))

    def forward(self, ids):
        h = self.emb(ids)
        for b in self.blocks:
            h = b(h.cumsum(1) / torch.arange(1, h.shape[1] + 1)[:, None])
        return self.head(h)


def clock() -> torch.Tensor:
    """(wall, process CPU) seconds."""
    return torch.tensor([time.perf_counter(), time.process_time()], dtype=torch.float64)


def bare_loop(model: nn.Module, ctrl: fca.Controller, ev: torch.Tensor, ca: torch.Tensor, batch: int,
              R: int) -> torch.Tensor:
    sched = Schedule(ev.shape[0], ca.shape[0], batch, R, tuple(protocol.for_controller(ctrl.info)))
    nll = lambda ids: token_nll(logits_of(model(ids)), ids).mean(1)  # noqa: E731
    t0 = clock()
    with torch.inference_mode():
        nll(ev[:batch])  # the audit's probe of the first batch
        nll(ev[:batch])  # the pre-write checks' passes: one as the probe, one under the Flow mode
        nll(ev[:batch])
        nll(ev[:1])  # check_sites_read: window 0 alone, then replayed with zeros
        nll(ev[:1])
        for u in sched.iter_stage1():
            ids = (ev if u.kind == "capture" else ca)[u.start:u.start + batch]
            nll(ids)
            if u.kind == "capture":
                nll(ids)  # the exact replay check
        for u in sched.iter_stage2():
            nll(ev[u.start:u.start + batch])
    return clock() - t0


def audit_once(model, ctrl, ev, ca, batch: int, R: int) -> torch.Tensor:
    with tempfile.TemporaryDirectory() as out:
        t0 = clock()
        result = fca.audit(model, ctrl, ev, ca, randomizations=R, out=out, batch_size=batch, quiet=True)
        took = clock() - t0
    assert result.replay.bit_equal, result.replay
    return took


def hot_path(model, ctrl, ids: torch.Tensor, n: int) -> float:
    """Median over n alternated pairs of (a replay pass under the op site) / (a plain forward pass), CPU time."""
    with torch.inference_mode():
        with ctrl.capture(*ids.shape) as found:
            model(ids)
        coeffs, ratios = found, []
        for i in range(n):
            times = {}
            for kind in (("replay", "plain") if i % 2 == 0 else ("plain", "replay")):
                t0 = time.process_time()
                if kind == "replay":
                    with ctrl.replay(coeffs):
                        model(ids)
                else:
                    model(ids)
                times[kind] = time.process_time() - t0
            ratios.append(times["replay"] / times["plain"])
    return statistics.median(ratios)


class BareMode(TorchFunctionMode):
    """Passes every call through: the floor that any op site built on a TorchFunctionMode pays."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def bare_mode_path(model, ids: torch.Tensor, n: int) -> float:
    """Median over n alternated pairs of (a forward pass with BareMode around each block's forward, where the op
    site's mode is) / (a plain forward pass), CPU time."""
    def moded(block):
        return lambda *args, **kwargs: _under_mode(block, args, kwargs)

    ratios = []
    with torch.inference_mode():
        for i in range(n):
            times = {}
            for kind in (("mode", "plain") if i % 2 == 0 else ("plain", "mode")):
                for b in model.blocks if kind == "mode" else ():
                    b.forward = moded(b)
                t0 = time.process_time()
                model(ids)
                times[kind] = time.process_time() - t0
                for b in model.blocks if kind == "mode" else ():
                    del b.forward
            ratios.append(times["mode"] / times["plain"])
    return statistics.median(ratios)


def _under_mode(block, args, kwargs):
    with BareMode():
        return type(block).forward(block, *args, **kwargs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--randomizations", type=int, default=20)
    p.add_argument("--eval", type=int, default=64)
    p.add_argument("--calib", type=int, default=64)
    p.add_argument("--window", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--baseline", action="store_true", help="a submodule gate through from_modules instead")
    p.add_argument("--width", type=int, default=96, help="the model's hidden width")
    p.add_argument("--hot-path-only", action="store_true", help="time the hot path alone (no audits)")
    a = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    if a.baseline:
        model = InlineGatedLM(d=a.width, block=ModuleGateBlock).eval()
        ctrl = fca.Controller.from_modules(model, "blocks.*.gate", "batch token ()")
    else:
        model = InlineGatedLM(d=a.width).eval()
        ctrl = fca.Controller.from_ops(model, "blocks.*", "sigmoid", "batch token ()")
    kind = "from_modules (baseline)" if a.baseline else "from_ops"
    g = torch.Generator().manual_seed(0)
    ev = torch.randint(0, 256, (a.eval, a.window), generator=g)
    ca = torch.randint(0, 256, (a.calib, a.window), generator=g)
    if a.hot_path_only:
        print(f"load {os.getloadavg()[0]:.2f}; width {a.width}; hot path: replay pass of {kind} / plain forward pass, "
              f"median of 200 alternated pairs (CPU): {hot_path(model, ctrl, ev[:a.batch], 200):.3f}; a bare "
              f"TorchFunctionMode around each block / plain: {bare_mode_path(model, ev[:a.batch], 200):.3f}; load "
              f"{os.getloadavg()[0]:.2f}")
        return
    audit_once(model, ctrl, ev[:8], ca[:4], a.batch, 2)  # warm-up: imports, allocator
    bare_loop(model, ctrl, ev[:8], ca[:4], a.batch, 2)
    print(f"load {os.getloadavg()[0]:.2f}; width {a.width}, {a.eval} + {a.calib} windows of {a.window}, batch {a.batch}, "
          f"R = {a.randomizations}, 1 thread")
    audits, bares = [], []
    for rep in range(a.reps):
        first, second = (audit_once, bare_loop) if rep % 2 == 0 else (bare_loop, audit_once)
        t1 = first(model, ctrl, ev, ca, a.batch, a.randomizations)
        t2 = second(model, ctrl, ev, ca, a.batch, a.randomizations)
        t_audit, t_bare = (t1, t2) if first is audit_once else (t2, t1)
        audits.append(t_audit)
        bares.append(t_bare)
        r = t_audit / t_bare
        print(f"pair {rep}: audit {t_audit[0]:.3f} s (CPU {t_audit[1]:.3f} s), bare {t_bare[0]:.3f} s (CPU "
              f"{t_bare[1]:.3f} s), ratio wall {r[0]:.3f}, CPU {r[1]:.3f} (load {os.getloadavg()[0]:.2f})", flush=True)
    ratios = torch.stack([x / y for x, y in zip(audits, bares)])
    low = torch.stack(audits).min(0).values / torch.stack(bares).min(0).values
    print(f"{kind} audit / bare loop (goal <= 1.10): median of pairs wall {statistics.median(ratios[:, 0].tolist()):.3f}, "
          f"CPU {statistics.median(ratios[:, 1].tolist()):.3f}; ratio of minima wall {low[0]:.3f}, CPU {low[1]:.3f}; load "
          f"{os.getloadavg()[0]:.2f}")
    print(f"hot path: replay pass of {kind} / plain forward pass, median of 200 alternated pairs (CPU): "
          f"{hot_path(model, ctrl, ev[:a.batch], 200):.3f}; a bare TorchFunctionMode around each block / plain: "
          f"{bare_mode_path(model, ev[:a.batch], 200):.3f}; load {os.getloadavg()[0]:.2f}")

if __name__ == "__main__":
    main()
