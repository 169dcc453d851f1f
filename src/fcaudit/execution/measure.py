"""Question 3 of the paper (section 4.5): does the mechanism actually skip work?

Coefficient variation and functional dependence say nothing about execution, so this module measures what really
runs, on any PyTorch model:

    executed_blocks   forward hooks on the block modules count the block forwards of one forward pass
    flops             torch.utils.flop_counter.FlopCounterMode: forward FLOPs per token
    latencies         wall time per forward (warm-up, inference_mode, CUDA synchronized), all models round-robin:
                      median, IQR, min and max over repetitions, tokens/s
    measure_execution all of the above for a list of checkpoints -> execution.csv / execution.json, with ratios to
                      Dense when a Dense model of the same architecture is among the inputs

A soft gate (FeatureGate, Uniform, LayerStatic) multiplies a block's update; it never removes the block, so these
models execute every block and pay for their controller on top. FixedDepth-k executes k blocks.
"""

from __future__ import annotations

import fnmatch
import functools
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import pandas as pd
import torch
from rich.console import Console
from torch import nn
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

from fcaudit.device import resolve_device
from fcaudit.errors import FcauditError
from fcaudit.families import DEFAULT_WINDOW_CAP
from fcaudit.io import atomic_write, claim_out, prepare_out, read_json, remove_file, write_json
from fcaudit.placement import input_device
from fcaudit.provenance import provenance
from fcaudit.threads import using_threads

aten = torch.ops.aten

# The fused CPU attention kernel has no formula in torch's FLOP registry (it would count 0); count it like the CUDA
# kernels: 2 matmuls over the full T x T score matrix (the counter's convention, causal masking not discounted).
_EXTRA_FLOP_FORMULAS = {
    aten._scaled_dot_product_flash_attention_for_cpu:
        lambda q, k, v, *args, out_shape=None, **kwargs: sdpa_flop_count(q, k, v),
}


# ---- which modules are the blocks ---------------------------------------------------------------------------------

def _path_matches(name: str, pattern: str) -> bool:
    """Glob per path segment: "blocks.*" matches "blocks.3" but not "blocks.3.attn" (fnmatch's * would cross dots)."""
    parts, pats = name.split("."), pattern.split(".")
    return len(parts) == len(pats) and all(fnmatch.fnmatchcase(p, q) for p, q in zip(parts, pats))


def block_pattern(model: nn.Module) -> str:
    """The path pattern of a model's blocks: the children of its ModuleList that holds the most parameters
    ("blocks.*" for FeatureGateGPT, "layers.*" for MUDDPythia, "model.layers.*" for HF decoders)."""
    lists = [(sum(p.numel() for p in m.parameters()), name) for name, m in model.named_modules()
             if name and isinstance(m, nn.ModuleList) and len(m)]
    if not lists:
        raise FcauditError(f"{type(model).__name__} has no nn.ModuleList of blocks; pass the block pattern, e.g. 'blocks.*'")
    return f"{max(lists)[1]}.*"


def block_modules(model: nn.Module, pattern: str | None = None) -> list[tuple[str, nn.Module]]:
    pattern = pattern or block_pattern(model)
    found = [(name, m) for name, m in model.named_modules() if name and _path_matches(name, pattern)]
    if not found:
        sample = [n for n, _ in model.named_modules() if n][:6]
        raise FcauditError(f"block pattern {pattern!r} matches no module of {type(model).__name__}; "
                           f"module paths look like {sample}")
    return found


# ---- executed blocks ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class BlockCount:
    """Blocks of a model and how many of them ran in one forward pass."""

    pattern: str
    n_blocks: int  # modules matching the pattern
    executed: int  # block forward calls in one model forward pass
    skipped: tuple[str, ...]  # blocks that did not run at all


@torch.inference_mode()
def executed_blocks(model: nn.Module, ids: torch.Tensor, pattern: str | None = None) -> BlockCount:
    """Run model(ids) once with a forward hook on every block; count the block forwards that really ran.

    A block that is called but whose output is scaled by 0 still counts: it was executed. Only a block whose forward
    is not called at all (skipped in the execution graph) lowers the count.
    """
    pattern = pattern or block_pattern(model)
    blocks = block_modules(model, pattern)
    calls = {name: 0 for name, _ in blocks}

    def hook_for(name):
        def hook(module, args, out):
            calls[name] += 1
        return hook

    handles = [m.register_forward_hook(hook_for(name)) for name, m in blocks]
    try:
        model(ids)
    finally:
        for h in handles:
            h.remove()
    return BlockCount(pattern, len(blocks), sum(calls.values()), tuple(n for n, c in calls.items() if c == 0))


# ---- FLOPs --------------------------------------------------------------------------------------------------------

@torch.inference_mode()
def flops(model: nn.Module, ids: torch.Tensor) -> float:
    """Forward FLOPs per token (total FLOPs of model(ids) / ids.numel()), counted by FlopCounterMode.

    Counts matmuls, convolutions and attention kernels (a multiply-add = 2 FLOPs); elementwise ops, norms and
    softmax are not counted, as in torch's counter. The FeatureGate controller's explicit attention recomputation
    (q @ k^T for its features) is a matmul and is counted: it is the controller's extra work. FeatureGate is counted
    with its output from the fused kernel (`featuregate.fused_output`), so that its attention is counted like Dense's;
    in inference on the CPU its tiled pass (`attend`) shares q @ k^T between the output and the features and
    executes less than that count.
    """
    from fcaudit.models.featuregate import fused_output

    # FlopCounterMode's module tracker hooks autograd on module inputs that require grad (MUDDPythia passes its
    # dense_bs parameters into modules), which fails without a graph: freeze the parameters while counting.
    flags = [(p, p.requires_grad) for p in model.parameters()]
    try:
        for p, _ in flags:
            p.requires_grad_(False)
        with fused_output(), FlopCounterMode(display=False, custom_mapping=_EXTRA_FLOP_FORMULAS) as counter:
            model(ids)
    finally:
        for p, flag in flags:
            p.requires_grad_(flag)
    return counter.get_total_flops() / ids.numel()


# ---- latency ------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Latency:
    """Wall time of one forward pass over `measurements` repetitions (each the mean of `forwards` calls)."""

    ms_per_batch: float  # median over repetitions
    iqr_ms: float  # interquartile range over repetitions
    min_ms: float
    max_ms: float
    tokens_per_s: float  # batch_size * window / median
    batch_size: int
    window: int
    device: str
    threads: int
    measurements: int  # repetitions
    forwards: int = 1  # forward calls per repetition

    @property
    def noisy(self) -> bool:
        """The spread over repetitions (max - min) exceeds the median: the machine's load changed while timing,
        so single ratios are doubtful (rerun with --threads 1 on a quieter machine)."""
        return self.max_ms - self.min_ms > self.ms_per_batch


def model_window(model: nn.Module, default: int = 128) -> int:
    from fcaudit.families import context_length

    return context_length(model) or default


def model_vocab(model: nn.Module, default: int = 256) -> int:
    return int(getattr(getattr(model, "config", None), "vocab_size", default))


def latencies(models: Sequence[nn.Module], batch_size: int = 8, window: int | None = None,
              device: str | torch.device | None = None, *, min_run_time: float = 1.0, repetitions: int = 10,
              warmup: int = 3, seed: int = 0) -> list[Latency]:
    """Forward-pass wall time of each model on a [batch_size, window] batch of random token ids, measured
    round-robin: repetition r of every model runs before repetition r + 1 of any, so a change of the machine's
    load hits every model alike and their ratios stay fair.

    Each model gets `repetitions` timed repetitions of about min_run_time / repetitions seconds each (enough
    forward calls to fill it, estimated after `warmup` forwards), so about `min_run_time` seconds in all; CUDA is
    synchronized around every repetition; torch runs with its current number of threads.
    """
    if batch_size < 1:
        raise FcauditError(f"batch size {batch_size} for latency: pass a batch size of at least 1")
    if not (min_run_time > 0 and math.isfinite(min_run_time)) or repetitions < 1:
        raise FcauditError(f"min_run_time {min_run_time} / repetitions {repetitions}: pass positive values")
    runs = []
    for i, model in enumerate(models):
        dev = torch.device(device) if device is not None else input_device(model)
        model = model.to(dev).eval()
        w = window or model_window(model)
        gen = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, model_vocab(model), (batch_size, w), generator=gen).to(dev)
        runs.append((model, ids, dev, w))

    def timed(model, ids, dev, n: int) -> float:
        """Seconds per forward, averaged over n calls."""
        sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
        with torch.inference_mode():
            sync()
            t0 = time.perf_counter()
            for _ in range(n):
                model(ids)
            sync()
        return (time.perf_counter() - t0) / n

    forwards = []
    for model, ids, dev, _ in runs:
        timed(model, ids, dev, warmup) if warmup else None  # allocator, kernel selection, lazy tables
        forwards.append(max(1, math.ceil(min_run_time / repetitions / timed(model, ids, dev, 1))))
    times: list[list[float]] = [[] for _ in runs]
    for _ in range(repetitions):
        for i, (model, ids, dev, _) in enumerate(runs):
            times[i].append(timed(model, ids, dev, forwards[i]))

    out = []
    for (model, ids, dev, w), t, n in zip(runs, times, forwards):
        ms = np.asarray(t) * 1e3
        q1, median, q3 = np.percentile(ms, [25, 50, 75])
        out.append(Latency(ms_per_batch=float(median), iqr_ms=float(q3 - q1), min_ms=float(ms.min()),
                           max_ms=float(ms.max()), tokens_per_s=batch_size * w / (median / 1e3),
                           batch_size=batch_size, window=w, device=str(dev), threads=torch.get_num_threads(),
                           measurements=len(t), forwards=n))
    return out


def latency(model: nn.Module, batch_size: int = 8, window: int | None = None, device: str | torch.device | None = None,
            *, min_run_time: float = 1.0, warmup: int = 3, seed: int = 0, repetitions: int = 10) -> Latency:
    """Median wall time of one forward pass of one model (see `latencies`; the model is moved to `device`,
    default: where its parameters are)."""
    return latencies([model], batch_size, window, device, min_run_time=min_run_time, repetitions=repetitions,
                     warmup=warmup, seed=seed)[0]


# ---- many checkpoints ---------------------------------------------------------------------------------------------

def model_label(model: nn.Module, meta: dict) -> str:
    """The family's label (featuregate, dense, fixeddepth-k, mudd, ...), else the class name."""
    from fcaudit import families

    return families.label(model)


def _architecture(model: nn.Module) -> str:
    """Models comparable to one Dense reference: same class, width, heads, context and vocabulary (depth and gate
    may differ, so FixedDepth-k is compared with the full-depth Dense)."""
    c = getattr(model, "config", None)
    keys = ("d_model", "dim", "n_head", "block_size", "vocab_size")
    return type(model).__name__ + ":" + ",".join(f"{k}={getattr(c, k)}" for k in keys if hasattr(c, k))


def default_window(block_sizes) -> int:
    """One window for every model measured: the smallest context, at most DEFAULT_WINDOW_CAP tokens."""
    return min(*block_sizes, DEFAULT_WINDOW_CAP)


def _block_size(checkpoint: Path) -> int:
    path = checkpoint / "config.json"
    if not path.is_file():
        raise FcauditError(f"{checkpoint} has no config.json: pass a checkpoint directory written by `fcaudit train`")
    config = read_json(path)
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}  # a multimodal checkpoint
    size = next((c[k] for c in (config, text) for k in ("block_size", "max_position_embeddings", "n_positions")
                 if k in c), None)
    if not isinstance(size, int) or size < 2:
        raise FcauditError(f"{path} has no valid block_size: use the config.json written with the checkpoint")
    return size


def _metrics(checkpoint: Path) -> dict:
    path = checkpoint / "metrics.json"
    return read_json(path) if path.is_file() else {}


def static_measures(model: nn.Module, *, batch_size: int, window: int, device: torch.device,
                    pattern: str | None = None) -> dict:
    """Executed blocks, parameters and FLOPs/token of a loaded model (already on `device`): what does not
    depend on the machine's load."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model_vocab(model), (batch_size, window), generator=gen).to(device)
    count = executed_blocks(model, ids, pattern)
    return {"block_pattern": count.pattern, "n_blocks": count.n_blocks, "executed_blocks": count.executed,
            "n_params": sum(p.numel() for p in model.parameters()), "flops_per_token": flops(model, ids[:1])}


def latency_columns(lat: Latency) -> dict:
    return {"latency_ms": lat.ms_per_batch, "latency_iqr_ms": lat.iqr_ms, "latency_min_ms": lat.min_ms,
            "latency_max_ms": lat.max_ms, "latency_noisy": lat.noisy, "tokens_per_s": lat.tokens_per_s,
            "measurements": lat.measurements, "forwards_per_measurement": lat.forwards}


def measure_checkpoint(model: nn.Module, *, batch_size: int, window: int, device: torch.device,
                       min_run_time: float, pattern: str | None = None) -> dict:
    """One row of execution.csv for a loaded model (already on `device`), timed on its own."""
    row = static_measures(model, batch_size=batch_size, window=window, device=device, pattern=pattern)
    return {**row, **latency_columns(latency(model, batch_size, window, device, min_run_time=min_run_time))}


def add_dense_ratios(df: pd.DataFrame) -> pd.DataFrame:
    """Ratios to the mean Dense model of the same architecture (NaN where there is none)."""
    df = df.copy()
    for col in ("latency_vs_dense", "throughput_vs_dense", "flops_vs_dense", "executed_vs_dense"):
        df[col] = math.nan
    for arch, group in df.groupby("architecture"):
        dense = group[group["model"] == "dense"]
        if dense.empty:
            continue
        idx = group.index
        df.loc[idx, "latency_vs_dense"] = group["latency_ms"] / dense["latency_ms"].mean()
        df.loc[idx, "throughput_vs_dense"] = group["tokens_per_s"] / dense["tokens_per_s"].mean()
        df.loc[idx, "flops_vs_dense"] = group["flops_per_token"] / dense["flops_per_token"].mean()
        df.loc[idx, "executed_vs_dense"] = group["executed_blocks"] / dense["executed_blocks"].mean()
    return df


def measure_execution(checkpoint_dirs: Sequence[str | os.PathLike], out: str | os.PathLike, *, batch_size: int = 8,
                      window: int | None = None, device: str = "auto", min_run_time: float = 1.0,
                      thresholds: Sequence[float] = (), corpus: str = "embedded", threshold_windows: int = 32,
                      threads: int | None = None, progress: bool = True) -> pd.DataFrame:
    """Executed blocks, parameters, FLOPs/token, latency (ms per batch) and throughput of each checkpoint.

    Writes `out/execution.csv` and `out/execution.json` (settings, rows, provenance), each atomically. All models run
    with one window (default: the smallest block_size among them, at most 2048) so their rows compare. With `thresholds`, every
    scalar-gated model is also thresholded after training (see fcaudit.execution.threshold) on up to
    `threshold_windows` contiguous test windows of `corpus`, written to `out/thresholding.csv`.
    Latencies are measured round-robin over all models (see `latencies`): every model stays loaded until then.
    `threads` sets torch's CPU threads for the measurement (restored afterwards): on a shared machine, 1 thread
    gives far steadier CPU latencies than competing for every core.
    """
    from fcaudit.hub import resolve as resolve_checkpoint  # models are loaded only when measuring

    if not checkpoint_dirs:
        raise FcauditError("no checkpoints to measure: pass one or more checkpoint directories")
    if batch_size < 1:
        raise FcauditError(f"batch size {batch_size}: pass --batch-size 1 or more")
    if threads is not None and threads < 1:
        raise FcauditError(f"threads {threads}: pass --threads 1 or more")
    if not (isinstance(min_run_time, (int, float)) and math.isfinite(min_run_time) and min_run_time > 0):
        raise FcauditError(f"--min-run-time {min_run_time}: pass a positive number of seconds")
    if window is not None and window < 2:
        raise FcauditError(f"--window {window}: pass 2 or more tokens (or leave it out for the smallest block_size)")
    if threshold_windows < 1:
        raise FcauditError(f"--threshold-windows {threshold_windows}: pass 1 or more test windows")
    if not all(math.isfinite(float(t)) for t in thresholds):
        raise FcauditError(f"--threshold {list(thresholds)}: pass finite thresholds, e.g. 0.3")
    out = prepare_out(out, "execution results", avoid=checkpoint_dirs)
    dev = resolve_device(device)
    # Read every config first (models are loaded one at a time below): one common window, bad paths fail early.
    paths = [resolve_checkpoint(p) for p in checkpoint_dirs]
    if len({p.resolve() for p in paths}) != len(paths):
        raise FcauditError("the same checkpoint was given twice: pass each checkpoint once")
    contexts = {p: _block_size(p) for p in paths}
    window = window or default_window(contexts.values())
    too_short = [str(p) for p, size in contexts.items() if size < window]
    if too_short:
        raise FcauditError(f"window {window} exceeds the block_size of {too_short[0]}: pass a shorter --window")

    with using_threads(threads) as n_threads:
        rows, sweeps, conditions = _measure_all(checkpoint_dirs, paths, dev, batch_size, window, min_run_time,
                                                thresholds, corpus, threshold_windows, progress)
    df = add_dense_ratios(pd.DataFrame(rows))
    claim_out(out, "execution results")
    settings = {"batch_size": batch_size, "window": window, "device": str(dev), "min_run_time": min_run_time,
                "latency": "round-robin over models, median of repetitions", "threads": n_threads,
                "thresholds": list(thresholds),
                "corpus": corpus, "threshold_windows": threshold_windows}
    payload = {"settings": settings, "rows": df.to_dict(orient="records"), **provenance()}
    if sweeps:
        sweep_df = pd.concat(sweeps, ignore_index=True)
        atomic_write(out / "thresholding.csv", lambda p: sweep_df.to_csv(p, index=False))
        payload["thresholding"] = sweep_df.to_dict(orient="records")
    else:  # a sweep left by an earlier run with other settings must not sit next to these results
        remove_file(out / "thresholding.csv")
    if conditions:  # routed models: experts, expert FLOPs and latency under Correct and each static condition
        cond_df = pd.concat(conditions, ignore_index=True)
        atomic_write(out / "conditions.csv", lambda p: cond_df.to_csv(p, index=False))
        payload["conditions"] = cond_df.to_dict(orient="records")
    else:
        remove_file(out / "conditions.csv")
    atomic_write(out / "execution.csv", lambda p: df.to_csv(p, index=False))
    write_json(out / "execution.json", payload)
    return df


def _measure_all(checkpoint_dirs, paths, dev, batch_size, window, min_run_time, thresholds, corpus, threshold_windows,
                 progress) -> tuple[list[dict], list[pd.DataFrame], list[pd.DataFrame]]:
    """Load every model first (a bad checkpoint fails before anything is printed or measured), then blocks, FLOPs
    and thresholding model by model, then the latencies of all models round-robin."""
    from fcaudit.models.checkpoint import load_model

    from fcaudit import families
    from fcaudit.execution.conditions import condition_execution

    loaded = [load_model(path, device=dev) for path in paths]
    rows, sweeps, models, conditions = [], [], [], []

    @functools.cache
    def test_windows() -> torch.Tensor:  # loaded once, and only when a scalar-gated model is thresholded
        from fcaudit.data import all_windows, load_corpus

        return all_windows(load_corpus(corpus).test, window, limit=threshold_windows)

    @functools.cache
    def calib_windows() -> torch.Tensor:  # static profiles of routed models, from the validation split as in audits
        from fcaudit.data import all_windows, load_corpus

        return all_windows(load_corpus(corpus).validation, window, limit=threshold_windows)

    console = Console(stderr=True, quiet=not progress)
    labels = [model_label(model, meta) for model, meta in loaded]
    # checkpoints of one label (seeds, a model and its copy) are told apart by their directory names
    labels = [f"{l} ({Path(str(g)).name})" if labels.count(l) > 1 else l for l, g in zip(labels, checkpoint_dirs)]
    for given, path, (model, meta), label in zip(checkpoint_dirs, paths, loaded, labels):
        console.print(f"execution: {given}", highlight=False)
        metrics = _metrics(path)
        row = {"checkpoint": str(given), "model": label, "architecture": _architecture(model),
               "seed": metrics.get("seed", meta.get("seed")), "byte_ppl": metrics.get("byte_ppl", meta.get("byte_ppl")),
               "gate_mass": metrics.get("gate_mass", meta.get("gate_mass")), "batch_size": batch_size,
               "window": window, "device": str(dev), "threads": torch.get_num_threads()}
        row.update(static_measures(model, batch_size=batch_size, window=window, device=dev))
        family = families.for_model(model)
        if family is not None and family.execution is not None:
            ids = torch.randint(0, model_vocab(model), (batch_size, window),
                                generator=torch.Generator().manual_seed(0)).to(dev)
            row.update(family.execution(model, ids))
            conditions.append(condition_execution(model, family, calib_windows(), batch_size=batch_size,
                                                  window=window, device=dev, min_run_time=min_run_time)
                              .assign(checkpoint=str(given), model=row["model"]))
        rows.append(row)
        models.append(model)
        if thresholds:
            sweep = _threshold_checkpoint(model, thresholds, test_windows, batch_size)
            if sweep is not None:
                sweeps.append(sweep.assign(checkpoint=str(given), model=row["model"]))
            else:
                console.print(f"thresholding: {label} has no scalar gates to threshold; skipped", highlight=False)
    console.print(f"latency: {len(models)} model(s) round-robin, about {min_run_time:g} s each", highlight=False)
    for row, lat in zip(rows, latencies(models, batch_size, window, dev, min_run_time=min_run_time)):
        row.update(latency_columns(lat))
    return rows, sweeps, conditions


def _threshold_checkpoint(model: nn.Module, thresholds, windows, batch_size: int) -> pd.DataFrame | None:
    """Thresholding sweep for a scalar-gated model; None for models without scalar gates (Dense, MUDD)."""
    from fcaudit.controllers import controller_for
    from fcaudit.execution.threshold import scalar_gate_controller, thresholding

    try:
        controller = scalar_gate_controller(controller_for(model))
    except FcauditError:
        return None
    return thresholding(model, controller, windows(), thresholds, batch_size=batch_size)
