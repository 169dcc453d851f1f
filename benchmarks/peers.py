"""fcaudit's audit beside the same audit written without it: with plain PyTorch hooks (the floor: the forward passes an
audit must run, its gates' forwards replaced by the replayed values, nothing written) and with nnsight (the tool a
researcher would otherwise reach for: `.output.save()` to capture, `.skip(value)` to replay).

All three run the same forward passes on the same batches: per evaluation batch a capture and an exact-replay check
(bit-equal logits), per calibration batch a capture, then per (condition, randomization, batch) a replay. The
replayed coefficients are made by fcaudit's own condition registry from the captured ones (a peer's job is the
forward passes, not the draws), so the three must give the same records bit for bit; the script checks it. Timed
A B C, then the order rotated (C A B, B C A, ...), one thread, wall time of each whole audit; printed per model:
each arm's forward passes (counted in the warm-up), each run's seconds and the median of the per-round ratios
fcaudit / hooks and fcaudit / nnsight, with the load.
Usage: python benchmarks/peers.py [--models tiny demo] [--reps 3] [--n-eval 64] [--randomizations 4]
"""

from __future__ import annotations

import argparse
import copy
import functools
import os
import statistics
import tempfile
import time
from contextlib import contextmanager

import numpy as np
import torch

import fcaudit as fca
from fcaudit import protocol
from fcaudit.loss import logits_of, token_nll


def build(preset: str):
    from fcaudit.models.featuregate import FeatureGateGPT, config_for

    torch.manual_seed(0)
    model = FeatureGateGPT(config_for(preset, "featuregate")).eval()
    return model, fca.controller_for(model)


class Context:
    """fcaudit.protocol.ReplayContext over the peer's in-memory captures."""

    def __init__(self, coeffs: list[torch.Tensor], info, seed: int, profiles: dict):
        self.coeffs, self.info, self.seed, self.profiles = coeffs, info, seed, profiles

    def take(self, examples):
        return [c[torch.from_numpy(np.asarray(examples))] for c in self.coeffs]

    @functools.cache
    def derangement(self, r: int):
        return protocol.derangement(self.coeffs[0].shape[0], self.seed, r)

    def static(self, name: str, batch: int):
        return [protocol.expand(p, batch, self.coeffs[0].shape[1]) for p in self.profiles[name]]


class Hooks:
    """Plain PyTorch: a forward hook captures each gate's output; a replay replaces the gate's forward."""

    def __init__(self, model, paths):
        self.model, self.gates = model, [model.get_submodule(p) for p in paths]

    def capture(self, ids):
        found = []
        handles = [g.register_forward_hook(lambda m, a, out: found.append(out.detach().clone())) for g in self.gates]
        try:
            logits = logits_of(self.model(ids))
        finally:
            for h in handles:
                h.remove()
        return found, logits

    def replay(self, ids, values):
        for g, v in zip(self.gates, values):
            g.forward = lambda *a, _v=v, **k: _v
        try:
            return logits_of(self.model(ids))
        finally:
            for g in self.gates:
                del g.forward


class NNsight:
    """nnsight 0.8: `.output.save()` captures, `.skip(value)` replays (the gate's forward does not run)."""

    def __init__(self, model, paths):
        from nnsight import NNsight as Wrap

        self.model, self.wrapped = model, Wrap(model)
        self.envoys = [functools.reduce(lambda e, part: e[int(part)] if part.isdigit() else getattr(e, part),
                                        p.split("."), self.wrapped) for p in paths]

    def capture(self, ids):
        import nnsight

        with self.wrapped.trace(ids):  # the body runs in another frame: what leaves it is saved
            found = nnsight.save([])
            for e in self.envoys:
                found.append(e.output)
            out = self.wrapped.output.save()
        return [f.detach().clone() for f in found], logits_of(out)

    def replay(self, ids, values):
        with self.wrapped.trace(ids):
            for e, v in zip(self.envoys, values):
                e.skip(v)
            out = self.wrapped.output.save()
        return logits_of(out)


def peer_audit(backend, ctrl, ev, ca, batch: int, R: int, seed: int = 0) -> dict:
    """The audit's records {(condition, r): NLL per window} with `backend`'s capture and replay."""
    nll = lambda logits, ids: token_nll(logits, ids).mean(1).double()  # noqa: E731
    canonical = lambda raw: raw[..., None, None]  # noqa: E731 (a "batch token" gate)
    records, stored = {}, []
    with torch.inference_mode():
        for start in range(0, ev.shape[0], batch):
            ids = ev[start:start + batch]
            found, logits = backend.capture(ids)
            if not torch.equal(backend.replay(ids, found), logits):
                raise SystemExit("exact replay failed")
            stored.append([canonical(f) for f in found])
            records.setdefault(("Correct", 0), []).append(nll(logits, ids))
        parts = []
        for start in range(0, ca.shape[0], batch):
            found, _ = backend.capture(ca[start:start + batch])
            parts.append((protocol.batch_sums([canonical(f) for f in found]), found[0].shape[0]))
        coeffs = [torch.cat(layer) for layer in zip(*stored)]
        profiles = {name: [p.to(c.dtype) for p, c in zip(ps, coeffs)]
                    for name, ps in protocol.static_profiles(parts, ctrl.info).items()}
        ctx = Context(coeffs, ctrl.info, seed, profiles)
        for name in protocol.for_controller(ctrl.info)[1:]:
            condition = protocol.REGISTRY[name]
            for r in range(R if condition.randomized else 1):
                for start in range(0, ev.shape[0], batch):
                    ids, examples = ev[start:start + batch], np.arange(start, min(start + batch, ev.shape[0]))
                    values = [c[..., 0, 0].contiguous() for c in condition.make(ctx, r, examples)]
                    records.setdefault((name, r), []).append(nll(backend.replay(ids, values), ids))
    return {key: torch.cat(parts).numpy() for key, parts in records.items()}


def fcaudit_audit(model, ctrl, ev, ca, batch: int, R: int) -> dict:
    with tempfile.TemporaryDirectory() as out:
        result = fca.audit(model, ctrl, ev, ca, randomizations=R, out=out, batch_size=batch, quiet=True)
        rec = result.records.sort_values("example")
        return {(c, int(r)): g["nll"].to_numpy() for (c, r), g in rec.groupby(["condition", "randomization"])}


@contextmanager
def clock(into: list):
    t0 = time.perf_counter()
    yield
    into.append(time.perf_counter() - t0)


def compare(preset: str, args) -> dict:
    """One model: the records of each peer against fcaudit's, then the interleaved timings; a row of results."""
    model, ctrl = build(preset)
    g = torch.Generator().manual_seed(0)
    ev = torch.randint(0, 256, (args.n_eval, args.window), generator=g)
    ca = torch.randint(0, 256, (args.n_calib, args.window), generator=g)
    paths = [s.path for s in ctrl.sites]
    # each tool its own copy of the model (the same weights): nnsight wraps the modules it traces once and for all
    peers = {"hooks": Hooks(copy.deepcopy(model), paths)}
    try:
        peers["nnsight"] = NNsight(copy.deepcopy(model), paths)
    except ImportError:
        print(f"{preset:<5} nnsight: not installed (make bench installs it: pip install -e '.[bench]')", flush=True)
    runs = {"fcaudit": lambda: fcaudit_audit(model, ctrl, ev, ca, args.batch_size, args.randomizations),
            **{name: functools.partial(peer_audit, peer, ctrl, ev, ca, args.batch_size, args.randomizations)
               for name, peer in peers.items()}}
    passes = {}  # the warm-up counts each arm's forward passes (a hook on its model), the timed runs run without it
    counted = {"fcaudit": model, "hooks": peers["hooks"].model, "nnsight": getattr(peers.get("nnsight"), "model", None)}
    records = {}
    for name, run in runs.items():  # warm-up, and the records compared
        calls = [0]
        handle = counted[name].register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
        try:
            records[name] = run()
        finally:
            handle.remove()
        passes[name] = calls[0]
    print(f"{preset:<5} forward passes: " + ", ".join(f"{name} {n}" for name, n in passes.items())
          + " (fcaudit's more: its checks before anything is written, and the first batch's Correct pass repeated "
          "at the end)", flush=True)
    row = {"model": preset, "identical": {}, "ratios": {}, "passes": passes}
    for name in peers:
        same = records[name].keys() == records["fcaudit"].keys() and all(
            np.array_equal(records[name][k], records["fcaudit"][k]) for k in records["fcaudit"])
        row["identical"][name] = same
        print(f"{preset:<5} {name} records: {'identical to fcaudit' if same else 'DIFFER'} "
              f"({len(records[name])} (condition, r) sets of {args.n_eval} windows)", flush=True)
    times = {name: [] for name in runs}
    order = list(runs)
    for i in range(args.reps):  # the order rotates each round, so an effect of running first or last cancels
        for name in order[i % len(order):] + order[:i % len(order)]:
            with clock(times[name]):
                runs[name]()
    for name in peers if args.reps else ():
        ratios = [a / b for a, b in zip(times["fcaudit"], times[name])]
        row["ratios"][name] = ratios
        print(f"{preset:<5} fcaudit / {name:<8} median {statistics.median(ratios):.3f} (runs "
              f"{', '.join(f'{r:.3f}' for r in ratios)}); seconds fcaudit {statistics.median(times['fcaudit']):.2f}, "
              f"{name} {statistics.median(times[name]):.2f}", flush=True)
    return row


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["tiny", "demo"], choices=["tiny", "demo"])
    p.add_argument("--n-eval", type=int, default=64)
    p.add_argument("--n-calib", type=int, default=64)
    p.add_argument("--window", type=int, default=64)
    p.add_argument("--randomizations", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    print(f"load before: {os.getloadavg()[0]:.2f} (1-min average, {os.cpu_count()} cpus); one thread; "
          f"{args.n_eval}+{args.n_calib} windows of {args.window}, R={args.randomizations}, batch {args.batch_size}",
          flush=True)
    rows = [compare(preset, args) for preset in args.models]
    print(f"load after: {os.getloadavg()[0]:.2f}")
    return rows


if __name__ == "__main__":
    main()
