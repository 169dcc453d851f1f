"""Algorithm 1 (Frozen-Controller Audit): capture, exact replay check, calibration profiles, interventions.

Every finished unit is written atomically and skipped on a rerun: a capture batch (its coefficient chunk plus its
Correct records), the profiles, and each (condition, randomization) over all batches. Randomness is keyed by
(seed, randomization, example), so a resumed audit yields the same records bit for bit as an uninterrupted one.
"""

from __future__ import annotations

import hashlib
import json
import math
import resource
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

import numpy as np
import pandas as pd
import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table
from torch import nn

from fcaudit.audit.interventions import RANDOMIZED, STATIC, ProfileAccumulator, Profiles, derangement, randomized
from fcaudit.audit.results import AuditResult, records_frame, write_records
from fcaudit.audit.store import CoefficientStore, check_finite
from fcaudit.controllers.site import Controller
from fcaudit.errors import FcauditError
from fcaudit.io import read_json, write_json
from fcaudit.loss import logits_of, token_nll
from fcaudit.provenance import provenance

LossFn = Callable[[object, torch.Tensor], torch.Tensor]


# ---- inputs -----------------------------------------------------------------------------------------------------

def as_windows(windows, what: str) -> tuple[torch.Tensor, object | None]:
    """ids [N, T] int64 from a tensor, a list of rows, or a WindowSet (anything with `.ids`)."""
    window_set = windows if hasattr(windows, "ids") else None
    ids = windows.ids if window_set is not None else windows
    if isinstance(ids, (list, tuple)):
        lengths = sorted({len(row) for row in ids})
        if len(lengths) > 1:
            raise FcauditError(f"{what} windows have unequal lengths {lengths[:4]}; cut every window to one length (--window)")
        ids = torch.stack([torch.as_tensor(row) for row in ids]) if ids else torch.empty(0, 0, dtype=torch.long)
    ids = torch.as_tensor(ids)
    if ids.dim() != 2 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise FcauditError(f"{what} windows must be an integer tensor [N, T] of token ids, got {ids.dtype} {tuple(ids.shape)}")
    return ids.long().cpu(), window_set


def check_windows(ev: torch.Tensor, ca: torch.Tensor, ev_set, ca_set) -> None:
    if ev.shape[0] < 2:
        raise FcauditError(f"{ev.shape[0]} evaluation window(s): CrossInput needs a derangement, so pass at least 2 (--eval)")
    if ca.shape[0] < 1:
        raise FcauditError("no calibration windows: static profiles need at least 1 (--calib)")
    if ev.shape[1] != ca.shape[1]:
        raise FcauditError(f"evaluation windows have length {ev.shape[1]} but calibration windows {ca.shape[1]}; "
                           "use one window length for both (--window)")
    if ev.shape[1] < 2:
        raise FcauditError("windows need at least 2 tokens for a next-token NLL; pass a longer --window")
    ev_rows = {row.tobytes() for row in ev.numpy()}
    shared = sum(row.tobytes() in ev_rows for row in ca.numpy())
    if shared:
        raise FcauditError(f"{shared} calibration window(s) equal evaluation windows; draw calibration windows "
                           "from a different split (e.g. validation) than the evaluation windows (test)")
    starts = [getattr(s, "starts", None) for s in (ev_set, ca_set)]
    if all(s is not None for s in starts) and ev_set.split == ca_set.split:
        t = ev.shape[1]
        e = np.sort(np.asarray(starts[0]))
        c = np.asarray(starts[1])
        # a calibration window [c, c+t) overlaps an eval window [e, e+t) iff some e lies in (c-t, c+t)
        nxt = np.searchsorted(e, c - t + 1)
        if np.any((nxt < len(e)) & (e[np.minimum(nxt, len(e) - 1)] < c + t)):
            raise FcauditError(f"calibration windows overlap evaluation windows in split {ev_set.split!r}; "
                               "take them from another split or non-overlapping ranges")


# ---- model helpers ----------------------------------------------------------------------------------------------

def model_device(model: nn.Module) -> torch.device:
    p = next(iter(model.parameters()), None)
    return p.device if p is not None else torch.device("cpu")


def parameter_hash(model: nn.Module) -> str:
    h = hashlib.sha256()
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        h.update(name.encode())
        h.update(str(t.dtype).encode())
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def tensor_hash(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest()


def forward_nll(model: nn.Module, ids: torch.Tensor, loss_fn: LossFn | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits, mean NLL per predicted token per window, float64 on CPU)."""
    out = model(ids)
    nll = loss_fn(out, ids) if loss_fn is not None else token_nll(logits_of(out), ids).mean(1)
    return logits_of(out), nll.detach().double().cpu()


def capture_batch(model: nn.Module, controller: Controller, ids: torch.Tensor, loss_fn) -> tuple[list, torch.Tensor, torch.Tensor]:
    with controller.capture(ids.shape[0], ids.shape[1]) as found:
        logits, nll = forward_nll(model, ids, loss_fn)
    missing = [s.path for s, c in zip(controller.sites, found) if c is None]
    if missing:
        raise FcauditError(f"sites {missing[:3]} did not run in the forward pass; pick modules the model calls")
    return list(found), logits, nll


# ---- plan -------------------------------------------------------------------------------------------------------

@dataclass
class AuditPlan:
    """Sizes of an audit, from one 1-window forward pass."""

    n_eval: int
    n_calib: int
    window: int
    batch_size: int
    randomizations: int
    layer_shapes: list[list[int]]  # canonical [token, stream, source] per layer
    coeff_dtype: str
    store_bytes: int
    forward_passes: int
    peak_memory_bytes: int  # estimate: parameters + activations of one batch + coefficients of one batch (x3)

    def __str__(self) -> str:
        return (f"{len(self.layer_shapes)} sites, store {self.store_bytes / 2**20:.1f} MiB, "
                f"{self.forward_passes} forward passes, peak memory ~{self.peak_memory_bytes / 2**30:.2f} GiB")


def forward_passes(n_eval: int, n_calib: int, batch_size: int, randomizations: int) -> int:
    """Calibration + capture + replay check + 3R randomized + 3 static passes per batch."""
    eval_batches = math.ceil(n_eval / batch_size)
    return math.ceil(n_calib / batch_size) + eval_batches * (2 + 3 * randomizations + len(STATIC))


def plan(model: nn.Module, controller: Controller, eval_windows, calib_windows=None, *, batch_size: int = 8,
         randomizations: int = 20) -> AuditPlan:
    ev, _ = as_windows(eval_windows, "evaluation")
    n_calib = 0 if calib_windows is None else as_windows(calib_windows, "calibration")[0].shape[0]
    device = model_device(model)
    one = ev[:1].to(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    with torch.inference_mode():
        coeffs, logits, _ = capture_batch(model, controller, one, None)
    check_finite(coeffs, "a 1-window forward")
    per_window = sum(c.numel() * c.element_size() for c in coeffs)
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    if device.type == "cuda":
        activations = torch.cuda.max_memory_allocated(device) - base
    else:  # no allocator statistics on CPU: growth of peak RSS, at least the logits and their float32 copy
        grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss
        activations = max(grown, logits.numel() * (logits.element_size() + 4) + per_window)
    return AuditPlan(ev.shape[0], n_calib, ev.shape[1], batch_size, randomizations,
                     [list(c.shape[1:]) for c in coeffs], str(coeffs[0].dtype).replace("torch.", ""),
                     per_window * ev.shape[0], forward_passes(ev.shape[0], n_calib, batch_size, randomizations),
                     param_bytes + batch_size * (activations + 3 * per_window))


dry_run = plan


# ---- the audit --------------------------------------------------------------------------------------------------

def _config(model, controller, ev, ca, ev_set, ca_set, *, randomizations, seed, batch_size, tolerance, loss_fn,
            criteria, model_info, coeff_dtype) -> dict:
    from fcaudit.stats.summary import Criteria

    crit = criteria if isinstance(criteria, Criteria) else Criteria.from_dict(criteria or {})
    windows = {"n_eval": int(ev.shape[0]), "n_calib": int(ca.shape[0]), "window": int(ev.shape[1]),
               "eval_sha256": tensor_hash(ev), "calib_sha256": tensor_hash(ca)}
    for name, s in (("eval", ev_set), ("calib", ca_set)):
        if s is not None and getattr(s, "split", None) is not None:
            windows[f"{name}_split"] = s.split
    model_desc = {**(model_info or {}), "class": type(model).__name__,
                  "n_params": sum(p.numel() for p in model.parameters()), "params_sha256": parameter_hash(model),
                  "dtype": next((str(p.dtype).replace("torch.", "") for p in model.parameters()), None),
                  "device_type": model_device(model).type, "coeff_dtype": coeff_dtype}
    return {"seed": int(seed), "randomizations": int(randomizations), "batch_size": int(batch_size),
            "tolerance": float(tolerance), "windows": windows, "model": model_desc,
            "controller": controller.describe(), "labels": controller.labels,
            "loss": "token_nll" if loss_fn is None else getattr(loss_fn, "__qualname__", repr(loss_fn)),
            "criteria": crit.to_dict()}


def _hash(config: dict) -> str:
    return hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()


def _open_dir(out: Path, config: dict) -> None:
    digest = _hash(config)
    path = out / "config.json"
    if path.exists():
        for stale in out.rglob(".*.tmp"):  # temp files of a run killed mid-write
            stale.unlink()
    finished = [p for p in out.rglob("*") if p.suffix in (".parquet", ".safetensors") and not p.name.startswith(".")]
    if path.exists() and not finished:  # e.g. a failed replay check: nothing to mix, start afresh
        path.unlink()
        (out / "replay.json").unlink(missing_ok=True)
    if path.exists():
        old = read_json(path)
        if old.get("config_hash") != digest:
            old = {**old, "criteria": {k: v for k, v in (old.get("criteria") or {}).items() if k != "fixed_at"}}
            changed = sorted(k for k in config if old.get(k) != config[k])
            raise FcauditError(f"{out} holds an audit with a different configuration (differs in {changed}); "
                               "pass a new --out directory or delete the old one")
        return
    if out.exists() and any(p.is_file() for p in out.rglob("*")):
        raise FcauditError(f"{out} exists and is not an audit directory; pass an empty or new --out directory")
    now = datetime.now(timezone.utc).isoformat(timespec="seconds")
    write_json(path, {**config, "config_hash": digest, "created_at": now,
                      "criteria": {**config["criteria"], "fixed_at": now}, "provenance": provenance()})


def _progress(quiet: bool) -> Progress:
    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    TimeRemainingColumn(), disable=quiet, transient=False)


def audit(model: nn.Module, controller: Controller, eval_windows, calib_windows, randomizations: int = 20,
          seed: int = 0, out: str | Path | None = None, *, batch_size: int = 8, tolerance: float = 0.0,
          loss_fn: LossFn | None = None, criteria=None, model_info: dict | None = None,
          quiet: bool = False) -> AuditResult:
    """Run (or resume) a Frozen-Controller Audit of `model` and return its results (also written to `out`).

    eval_windows / calib_windows: int tensors [N, T] of token ids or `fcaudit.data.WindowSet`s.
    tolerance: 0 demands bit-equal replay of logits and NLL; a positive value accepts max |Δlogit| and
    max |ΔNLL| up to it (recorded in replay.json). loss_fn(output, ids) -> [B] replaces the next-token NLL.
    """
    if randomizations < 1 or batch_size < 1:
        raise FcauditError("randomizations and batch size must be at least 1 (--randomizations, --batch-size)")
    if not (tolerance >= 0):
        raise FcauditError(f"tolerance must be >= 0, got {tolerance}")
    ev, ev_set = as_windows(eval_windows, "evaluation")
    ca, ca_set = as_windows(calib_windows, "calibration")
    check_windows(ev, ca, ev_set, ca_set)
    out = Path(out) if out is not None else Path(tempfile.mkdtemp(prefix="fcaudit-audit-"))
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            # probe: layouts, non-finite values and site coverage are checked before anything is written
            probe, _, _ = capture_batch(model, controller, ev[:1].to(model_device(model)), loss_fn)
            check_finite(probe, "the first evaluation window")
            config = _config(model, controller, ev, ca, ev_set, ca_set, randomizations=randomizations, seed=seed,
                             batch_size=batch_size, tolerance=tolerance, loss_fn=loss_fn, criteria=criteria,
                             model_info=model_info, coeff_dtype=str(probe[0].dtype).replace("torch.", ""))
            _open_dir(out, config)
            _Run(model, controller, ev, ca, out, randomizations, seed, batch_size, tolerance, loss_fn,
                 [c.dtype for c in probe], quiet).run()
    finally:
        model.train(was_training)
    result = AuditResult.load(out)
    if not quiet:
        print_summary(result)
    return result


class _Run:
    def __init__(self, model, controller, ev, ca, out, randomizations, seed, batch_size, tolerance, loss_fn, dtypes,
                 quiet):
        self.model, self.controller, self.ev, self.ca, self.out = model, controller, ev, ca, out
        self.R, self.seed, self.B, self.tol, self.loss_fn, self.dtypes, self.quiet = (
            randomizations, seed, batch_size, tolerance, loss_fn, dtypes, quiet)
        self.device = model_device(model)
        self.store = CoefficientStore(out / "coeffs")
        self.starts = np.arange(0, ev.shape[0], batch_size)
        self.records = out / "records"
        self._perm: tuple[int, np.ndarray | None] = (-1, None)

    def batches(self, ids: torch.Tensor):
        for b0 in range(0, ids.shape[0], self.B):
            yield b0, np.arange(b0, min(b0 + self.B, ids.shape[0]))

    def batch_ids(self, ids: torch.Tensor, b0: int) -> torch.Tensor:
        return ids[b0:b0 + self.B].to(self.device)

    def run(self) -> None:
        n_batches = len(self.starts)
        total = forward_passes(self.ev.shape[0], self.ca.shape[0], self.B, self.R)
        with _progress(self.quiet) as progress:
            task = progress.add_task("audit (forward passes)", total=total)
            step = lambda n=1: progress.advance(task, n)  # noqa: E731
            self.capture(step)
            profiles = self.profiles(step)
            units = [(c, 0) for c in STATIC] + [(c, r) for r in range(self.R) for c in RANDOMIZED]
            todo = [(c, r) for c, r in units if not self.unit_path(c, r).exists()]
            step(n_batches * (len(units) - len(todo)))
            # a worker thread prepares the next batch's coefficients (store reads, permutations) while the model
            # runs the current one; the work is a pure function of (condition, r, examples), so order is irrelevant
            jobs = [(c, r, b0, examples) for c, r in todo for b0, examples in self.batches(self.ev)]
            with ThreadPoolExecutor(max_workers=1) as pool:
                pending = pool.submit(self.coeffs, profiles, *jobs[0]) if jobs else None
                nlls = []
                for i, (cond, r, b0, examples) in enumerate(jobs):
                    coeffs = pending.result()
                    if i + 1 < len(jobs):
                        pending = pool.submit(self.coeffs, profiles, *jobs[i + 1])
                    ids = self.batch_ids(self.ev, b0)
                    with self.controller.replay(coeffs):
                        _, nll = forward_nll(self.model, ids, self.loss_fn)
                    nlls.append(nll)
                    step()
                    if examples[-1] == self.ev.shape[0] - 1:  # the unit's last batch: write its records
                        write_records(self.unit_path(cond, r), records_frame(
                            np.arange(self.ev.shape[0]), cond, r, torch.cat(nlls), self.ev.shape[1] - 1))
                        nlls = []
        self.write_variation()

    def unit_path(self, condition: str, r: int) -> Path:
        return self.records / condition / f"r{r:04d}.parquet"

    def coeffs(self, profiles: Profiles, condition: str, r: int, b0: int, examples: np.ndarray) -> list[torch.Tensor]:
        """Replay coefficients of one batch under (condition, randomization r), on the model's device."""
        if condition not in RANDOMIZED:
            return profiles.coeffs(condition, len(examples), self.dtypes, self.device)
        if self._perm[0] != r:  # one derangement per randomization, shared by CrossInput and CrossShuffle
            self._perm = (r, derangement(self.ev.shape[0], self.seed, r))
        coeffs = randomized(condition, lambda e: self.store.take(e, self.starts), examples, self._perm[1], self.seed, r)
        return [c.to(self.device, non_blocking=True) for c in coeffs]

    def capture(self, step) -> None:
        """Stage 1 + exact replay check, one atomic unit per batch (coefficient chunk, then Correct records);
        at the end the per-batch Correct records are merged into one file like every other condition's."""
        merged = self.records / "Correct" / "r0000.parquet"
        if merged.exists() and all(self.store.has(int(b0)) for b0 in self.starts):
            for leftover in merged.parent.glob("chunk_*.parquet"):  # killed between merge and clean-up
                leftover.unlink()
            step(2 * len(self.starts))
            return self.write_replay()
        for b0, examples in self.batches(self.ev):
            rec = self.records / "Correct" / f"chunk_{b0:07d}.parquet"
            if rec.exists() and self.store.has(b0):
                step(2)
                continue
            ids = self.batch_ids(self.ev, b0)
            coeffs, logits, nll = capture_batch(self.model, self.controller, ids, self.loss_fn)
            check_finite(coeffs, f"evaluation windows {b0}..{b0 + len(examples) - 1}")
            step()
            with self.controller.replay(coeffs):
                logits_r, nll_r = forward_nll(self.model, ids, self.loss_fn)
            step()
            dlogit = float((logits_r.float() - logits.float()).abs().max())
            dnll = float((nll_r - nll).abs().max())
            exact = torch.equal(logits_r, logits) and torch.equal(nll_r, nll)
            passed = exact if self.tol == 0 else (dlogit <= self.tol and dnll <= self.tol)
            if not passed:
                write_json(self.out / "replay.json", {"max_abs_dlogit": dlogit, "delta_nll": dnll, "passed": False,
                                                      "bit_equal": exact, "tolerance": self.tol, "windows": [b0, int(examples[-1])]})
                raise FcauditError(f"exact replay failed on windows {b0}..{examples[-1]}: max |Δlogit| = {dlogit:.3g}, "
                                   f"ΔNLL = {dnll:.3g} (tolerance {self.tol:g}); make the output path independent of "
                                   "the controller's computation (and deterministic), or pass a tolerance")
            self.store.write(b0, coeffs, metadata={"max_abs_dlogit": repr(dlogit), "delta_nll": repr(dnll),
                                                   "bit_equal": str(exact)})
            write_records(rec, records_frame(examples, "Correct", 0, nll, ids.shape[1] - 1))
        parts = [self.records / "Correct" / f"chunk_{int(b0):07d}.parquet" for b0 in self.starts]
        write_records(merged, pd.concat([pd.read_parquet(p) for p in parts], ignore_index=True))
        for p in parts:
            p.unlink()
        self.write_replay()

    def write_replay(self) -> None:
        meta = [self.store.metadata(int(b0)) for b0 in self.starts]
        write_json(self.out / "replay.json", {
            "max_abs_dlogit": max(float(m["max_abs_dlogit"]) for m in meta),
            "delta_nll": max(float(m["delta_nll"]) for m in meta),
            "bit_equal": all(m["bit_equal"] == "True" for m in meta), "passed": True, "tolerance": self.tol,
            "windows": int(self.ev.shape[0])})

    def profiles(self, step) -> Profiles:
        path = self.out / "profiles.safetensors"
        n = math.ceil(self.ca.shape[0] / self.B)
        if path.exists():
            step(n)
            return Profiles.load(path)
        acc = ProfileAccumulator()
        for b0, _ in self.batches(self.ca):
            coeffs, _, _ = capture_batch(self.model, self.controller, self.batch_ids(self.ca, b0), self.loss_fn)
            check_finite(coeffs, "calibration windows")
            acc.add(coeffs)
            step()
        profiles = acc.profiles(self.controller.reference)
        profiles.save(path)
        return profiles

    def write_variation(self) -> None:
        path = self.out / "variation.json"
        if not path.exists():
            from fcaudit.audit.results import variation

            write_json(path, variation(self.store, self.starts))


def print_summary(result: AuditResult, console: Console | None = None) -> None:
    """Mean ΔNLL per condition (rich table), with the replay check on top."""
    console = console or Console()
    rep = result.replay
    console.print(f"exact replay: passed={rep['passed']} bit_equal={rep.get('bit_equal')} "
                  f"max|Δlogit|={rep['max_abs_dlogit']:.3g} ΔNLL={rep['delta_nll']:.3g}")
    table = Table(title=f"FCA penalties ({result.path})")
    for col in ("condition", "mean ΔNLL", f"{100 * result.penalties_confidence:g}% CI", "MC SE"):
        table.add_column(col, justify="left" if col == "condition" else "right", no_wrap=True)
    for _, row in result.penalties().iterrows():
        name = row["condition"] if row["label"] == row["condition"] else f"{row['condition']} ({row['label']})"
        table.add_row(name, f"{row['mean']:.6f}", f"[{row['ci_low']:.6f}, {row['ci_high']:.6f}]",
                      "" if not np.isfinite(row["mc_se"]) else f"{row['mc_se']:.2g}")
    console.print(table)
