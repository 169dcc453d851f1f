"""How close an audit is to its floor: the forward passes it must run, and nothing else.

For each model (FeatureGate demo preset, a user's own gated LM described with Controller.from_modules, the MUDD
of the full demo (demo preset) and, as mudd-tiny, the quick demo's;
`--models moe` adds the demo's byte-level Mixtral, whose bare loop replays the captured routing of k experts in every
pass while the audit's dense static conditions run every expert: its forward halves differ by that work, its rest is
the comparable number),
one audit (64 + 64 windows, R = 20 by default, a fresh directory each time) is timed against a bare loop of the same
forward passes: per evaluation batch a capture pass and a replay pass, per calibration batch a capture pass, and one
replay pass per (condition, randomization, batch), each with its NLL (the quantity an audit must compute) and within
the controller's capture or replay context as in the audit, with
coefficients prepared once beforehand, and nothing written.
Audit and bare loop alternate (A B B A A B ...: each pair's order alternates, so an effect of running first or
second cancels), one thread; printed: the median of the per-pair ratios audit / bare, and
the ratio of the two minima (the least disturbed run of each, steadier on a shared machine), in wall time and in
CPU time of the process (all its threads; it leaves out time spent waiting for a core or for the disk); and each pair
split in two: the audit's own forward passes (with each replay's context, as in the bare loop) / the bare loop (about 1
when the machine kept its speed between the two runs: the pair's noise), and the rest of the audit / the bare loop (its
overhead; a timer per forward pass); and per pair the audit's median replay against the bare loop's (steadier than the
sums: a slow spell of the machine moves a median less).
With --parts, one more audit per model is timed by parts (the public functions and methods the engine calls wrapped
with timers, each step's own CPU time, steadier than wall time on a shared machine; --reps 0 for the parts alone): the
forward passes with their NLLs, making the replayed coefficients, reading the store, records files, decoding the
coefficients into each replay, counting active sources, stage 1's checks and writes (captures beside their forward
passes, the store's chunks, part files), setting up and finishing (the directory, profiles, variation, JSON files),
and the rest (the inputs' checks and the probe, the replays' loop and contexts); then a bare loop right after, in CPU time, and the audit, its forward passes and the rest against it.
Usage: python benchmarks/audit_floor.py [--reps 3] [--randomizations 20] [--models featuregate own mudd mudd-tiny] [--parts]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections import Counter
from contextlib import contextmanager
from typing import Iterator

import numpy as np
import torch
from torch import nn

import fcaudit as fca
from fcaudit import protocol
from fcaudit.auditor.units import Schedule
from fcaudit.controllers import Controller
from fcaudit.loss import logits_of, token_nll


class OwnGate(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.proj = nn.Linear(d, 1)

    def forward(self, h):
        return torch.sigmoid(self.proj(h)).squeeze(-1)


class OwnBlock(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln, self.gate = nn.LayerNorm(d), OwnGate(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, h):
        return h + self.gate(h)[..., None] * self.mlp(self.ln(h))


class OwnGatedLM(nn.Module):
    """A user's own gated LM: embedding, 4 gated MLP blocks with causal mean mixing, a head."""

    def __init__(self, vocab=256, d=96, layers=4):
        super().__init__()
        self.emb, self.head = nn.Embedding(vocab, d), nn.Linear(d, vocab)
        self.blocks = nn.ModuleList(OwnBlock(d) for _ in range(layers))

    def forward(self, ids):
        h = self.emb(ids)
        for b in self.blocks:
            h = b(h.cumsum(1) / torch.arange(1, h.shape[1] + 1)[:, None])
        return self.head(h)


def build(name: str) -> tuple[nn.Module, Controller, int]:
    torch.manual_seed(0)
    if name == "featuregate":
        from fcaudit.models.featuregate import FeatureGateGPT, config_for

        model = FeatureGateGPT(config_for("demo", "featuregate")).eval()
        return model, fca.controller_for(model), 128
    if name == "own":
        model = OwnGatedLM().eval()
        return model, Controller.from_modules(model, "blocks.*.gate", layout="batch token"), 128
    if name == "moe":  # the demo's byte-level Mixtral (transformers), at random weights
        from transformers import AutoModelForCausalLM

        from fcaudit.families.hf.tiny import byte_mixtral_config

        model = AutoModelForCausalLM.from_config(byte_mixtral_config("demo")).eval()
        return model, fca.controller_for(model), 128
    from fcaudit.models.muddpythia import BYTE_PRESETS, MUDDPythia

    preset = "tiny" if name == "mudd-tiny" else "demo"  # the quick demo's MUDD, or the full demo's
    model = MUDDPythia(BYTE_PRESETS[preset]).eval()
    with torch.no_grad():  # a silent controller at init: give it something to say
        for dd in model.dynamic_dense:
            dd.w2.weight.normal_(0, 0.02)
    return model, fca.controller_for(model), BYTE_PRESETS[preset].block_size


def bare_loop(model, ctrl, ev, ca, batch: int, R: int, replays: list[float] | None = None) -> np.ndarray:
    """The audit's forward passes and their NLLs with nothing else: (wall, CPU) seconds. `replays` gets each replay's
    seconds (its context and forward pass, as `audit_split` times the audit's)."""
    sched = Schedule(ev.shape[0], ca.shape[0], batch, R, tuple(protocol.for_controller(ctrl.info)))
    nll = lambda ids: token_nll(logits_of(model(ids)), ids).mean(1)  # noqa: E731
    with torch.inference_mode():
        with ctrl.capture(batch, ev.shape[1]) as found:
            model(ev[:batch])
        coeffs, decoding = list(found), found.decoding
        t0 = clock()
        with ctrl.capture(1, ev.shape[1]):  # the site checks (controllers.checks): window 0 captured alone,
            nll(ev[:1])
        with timed(replays), ctrl.replay([torch.zeros_like(c[:1]) for c in coeffs], decoding):  # then replayed
            nll(ev[:1])
        for u in sched.iter_stage1():
            ids = (ev if u.kind == "capture" else ca)[u.start:u.start + batch]
            with ctrl.capture(*ids.shape):  # the audit's capture pass: within the controller's context, as a replay
                nll(ids)
            if u.kind == "capture":
                with timed(replays), ctrl.replay([c[: ids.shape[0]] for c in coeffs], decoding):
                    nll(ids)
        for u in sched.iter_stage2():
            ids = ev[u.start:u.start + batch]
            with timed(replays), ctrl.replay([c[: ids.shape[0]] for c in coeffs], decoding):
                nll(ids)
        return clock() - t0


@contextmanager
def timed(seconds: list[float] | None) -> Iterator[None]:
    """Append the block's seconds to `seconds` (when given)."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        if seconds is not None:
            seconds.append(time.perf_counter() - t0)


@contextmanager
def timed_parts() -> Iterator[Counter]:
    """CPU seconds spent in the engine's steps while the block runs (each step's callable wrapped, restored after). Each
    step's time is its own: what steps called within it took is theirs (the forward passes within stage 1, the store
    reads within making coefficients), so the parts add up. The steps are the public functions and methods the engine
    calls (the engine's own private steps are left as they are)."""
    from fcaudit.auditor import engine, files
    from fcaudit.auditor.directory import AuditDir
    from fcaudit.auditor.results import AuditResult
    from fcaudit.auditor.store import CoefficientStore
    from fcaudit.controllers.sites import Site
    from fcaudit.kinds import Description

    spent: Counter = Counter()
    finishing = "setting up and finishing"
    steps = [(engine, "forward_nll", "forward passes and NLLs"), (engine.Engine, "take", "reading the store"),
             (files, "write_columns", "records files"), (Site, "decode", "decoding into each replay"),
             (Description, "active", "counting active sources")]
    steps += [(owner, attr, "stage 1's checks and writes") for owner, attr in (
        (engine, "capture_batch"), (engine, "check_finite"), (CoefficientStore, "write"), (files, "write_tensors"))]
    steps += [(condition, "make", "making coefficients") for condition in protocol.REGISTRY.values()]
    steps += [(owner, attr, finishing) for owner, attr in (
        (AuditDir, "check"), (AuditDir, "lock"), (AuditDir, "open"), (AuditDir, "check_strays"), (AuditDir, "unlock"),
        (protocol, "static_profiles"), (engine, "variation"), (AuditDir, "write_json"), (files, "read_tensors"),
        (AuditResult, "load"))]
    # what each step's owner holds under its name (a class keeps its classmethod, not a method bound to it)
    saved = [(owner, attr, vars(owner)[attr] if attr in vars(owner) else getattr(owner, attr))
             for owner, attr, _ in steps]
    inner = [0.0]  # seconds the steps running within the current one took

    def timer(fn, part):
        def run(*args, **kwargs):
            outer, inner[0] = inner[0], 0.0
            t0 = time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                took = time.process_time() - t0
                spent[part] += took - inner[0]
                inner[0] = outer + took
        return run

    def put(owner, attr, fn):  # conditions are frozen dataclasses
        (object.__setattr__ if isinstance(owner, protocol.Condition) else setattr)(owner, attr, fn)

    for (owner, attr, part), (_, _, fn) in zip(steps, saved):
        put(owner, attr, timer(getattr(owner, attr), part))
    try:
        yield spent
    finally:
        for owner, attr, fn in saved:
            put(owner, attr, fn)


PARTS = ("forward passes and NLLs", "making coefficients", "reading the store", "records files",
         "decoding into each replay", "counting active sources", "stage 1's checks and writes",
         "setting up and finishing")


def parts_line(model, ctrl, ev, ca, batch: int, R: int) -> str:
    with timed_parts() as spent:
        total = audit_once(model, ctrl, ev, ca, batch, R)[1]
    bare = bare_loop(model, ctrl, ev, ca, batch, R)[1]  # right after, in CPU time: what the forward passes cost
    rest = total - sum(spent.values())  # the replays' loop and contexts, the engine's set-up
    beside = total - spent["forward passes and NLLs"]
    return (f"audit {total:.3f} CPU s: " + ", ".join(f"{part} {spent[part]:.3f} s" for part in PARTS)
            + f", the rest {rest:.3f} s; bare loop {bare:.3f} CPU s: audit / bare {total / bare:.3f}, the audit's "
            f"forward passes / bare {spent['forward passes and NLLs'] / bare:.3f}, the rest / bare {beside / bare:.3f}")


def clock() -> np.ndarray:
    """(wall, process CPU) seconds."""
    return np.array([time.perf_counter(), time.process_time()])


def audit_once(model, ctrl, ev, ca, batch: int, R: int) -> np.ndarray:
    with tempfile.TemporaryDirectory() as out:
        t0 = clock()
        fca.audit(model, ctrl, ev, ca, randomizations=R, out=out, batch_size=batch, quiet=True)
        return clock() - t0


def audit_split(model, ctrl, ev, ca, batch: int, R: int,
                replays: list[float] | None = None) -> tuple[np.ndarray, float]:
    """`audit_once` and the wall seconds of what the bare loop also runs: each replay's context with its forward
    pass and NLL, and the capture passes with their NLLs (a timer around each). `replays` gets each replay's
    seconds."""
    from fcaudit.auditor import engine
    from fcaudit.controllers import Controller

    inner, replay, spent, depth = engine.forward_nll, Controller.replay, [0.0], [0]

    def forward(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            if not depth[0]:  # within a replay the replay's timer counts it
                spent[0] += time.perf_counter() - t0

    @contextmanager
    def timed_replay(self, *args, **kwargs):
        t0 = time.perf_counter()
        depth[0] += 1
        try:
            with replay(self, *args, **kwargs):
                yield
        finally:
            depth[0] -= 1
            took = time.perf_counter() - t0
            spent[0] += took
            if replays is not None:
                replays.append(took)

    engine.forward_nll, Controller.replay = forward, timed_replay  # the controller is frozen: its class's method
    try:
        return audit_once(model, ctrl, ev, ca, batch, R), spent[0]
    finally:
        engine.forward_nll, Controller.replay = inner, replay


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["featuregate", "own", "mudd", "mudd-tiny"],
                   choices=["featuregate", "own", "mudd", "mudd-tiny", "moe"])
    p.add_argument("--n-eval", type=int, default=64)
    p.add_argument("--n-calib", type=int, default=64)
    p.add_argument("--randomizations", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--parts", action="store_true", help="also time one audit by parts")
    args = p.parse_args()
    torch.set_num_threads(1)
    print(f"load before: {os.getloadavg()[0]:.2f} (1-min average, {os.cpu_count()} cpus); one thread; "
          f"{args.n_eval}+{args.n_calib} windows, R={args.randomizations}, batch {args.batch_size}", flush=True)
    for name in args.models:
        model, ctrl, T = build(name)
        g = torch.Generator().manual_seed(0)
        ev = torch.randint(0, 256, (args.n_eval, T), generator=g)
        ca = torch.randint(0, 256, (args.n_calib, T), generator=g)
        audit_once(model, ctrl, ev[:16], ca[:8], args.batch_size, 1)  # warm-up: imports, lazy tables
        audits, forwards, bares, per_replay = [], [], [], []
        for i in range(args.reps):  # A B, B A, A B, ...: the order within a pair alternates, so an order effect cancels
            mine, theirs = [], []
            if i % 2:
                bares.append(bare_loop(model, ctrl, ev, ca, args.batch_size, args.randomizations, theirs))
            audit, forward = audit_split(model, ctrl, ev, ca, args.batch_size, args.randomizations, mine)
            audits.append(audit)
            forwards.append(forward)
            if not i % 2:
                bares.append(bare_loop(model, ctrl, ev, ca, args.batch_size, args.randomizations, theirs))
            per_replay.append(statistics.median(mine) / statistics.median(theirs))
        if args.parts:
            print(f"{name:<12} parts: {parts_line(model, ctrl, ev, ca, args.batch_size, args.randomizations)} "
                  f"(load {os.getloadavg()[0]:.2f})", flush=True)
        if not audits:
            continue
        for i, what in enumerate(("wall", "CPU")):
            a, b = [t[i] for t in audits], [t[i] for t in bares]
            ratios = [x / y for x, y in zip(a, b)]
            print(f"{name:<12} {what:<4} audit {statistics.median(a):7.2f} s  bare loop {statistics.median(b):7.2f} s  "
                  f"ratio median {statistics.median(ratios):.3f}, of the minima {min(a) / min(b):.3f} "
                  f"(runs {', '.join(f'{r:.3f}' for r in ratios)})", flush=True)
        # where each pair's ratio comes from: the audit's forward passes (with each replay's context, as the bare loop
        # times them) against the bare loop (the machine's speed drifting between the two runs moves this), and the
        # audit's time outside them
        own = [f / b[0] for f, b in zip(forwards, bares)]
        rest = [(a[0] - f) / b[0] for a, f, b in zip(audits, forwards, bares)]
        print(f"{name:<12} split: the audit's forward passes / bare loop median {statistics.median(own):.3f} (runs "
              f"{', '.join(f'{r:.3f}' for r in own)}); the rest of the audit / bare loop median "
              f"{statistics.median(rest):.3f} (runs {', '.join(f'{r:.3f}' for r in rest)})", flush=True)
        # a median replay is what a replay costs when the machine is not in one of its slow spells: the audit's
        # against the bare loop's within each pair says whether the audit's forward passes themselves are slower
        print(f"{name:<12} replays: the audit's median replay / the bare loop's median {statistics.median(per_replay):.3f} "
              f"(runs {', '.join(f'{r:.3f}' for r in per_replay)})", flush=True)
    print(f"load after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    sys.exit(main())
