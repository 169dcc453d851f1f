"""Forward-pass wall time, measured round-robin over models so that a change of the machine's load hits every
model alike (the one timing both execution views use: models, and an MoE under the audit's static conditions)."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
from torch import nn

from fcaudit.errors import FcauditError
from fcaudit.families import context_length
from fcaudit.placement import input_device


@dataclass(frozen=True)
class Timing:
    """How long and how often each model is timed."""

    min_run_time: float = 1.0  # seconds per model, over all repetitions
    repetitions: int = 10
    warmup: int = 3  # untimed forwards first: allocator, kernel selection, lazy tables
    seed: int = 0  # of the random token ids

    def __post_init__(self):
        if not (isinstance(self.min_run_time, (int, float)) and math.isfinite(self.min_run_time)
                and self.min_run_time > 0) or self.repetitions < 1 or self.warmup < 0:
            raise FcauditError(f"min_run_time {self.min_run_time} / repetitions {self.repetitions} / warmup "
                               f"{self.warmup}: pass a positive number of seconds and repetitions")


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
        """The spread over repetitions (max - min) exceeds the median: the load changed while timing."""
        return self.max_ms - self.min_ms > self.ms_per_batch

    def columns(self) -> dict:
        """The columns of an execution table."""
        return {"latency_ms": self.ms_per_batch, "latency_iqr_ms": self.iqr_ms, "latency_min_ms": self.min_ms,
                "latency_max_ms": self.max_ms, "latency_noisy": self.noisy, "tokens_per_s": self.tokens_per_s,
                "measurements": self.measurements, "forwards_per_measurement": self.forwards}


def random_ids(model: nn.Module, batch_size: int, window: int, device: torch.device, seed: int = 0) -> torch.Tensor:
    """A [batch_size, window] batch of token ids of the model's vocabulary, the same for every model of one vocab."""
    vocab = int(getattr(getattr(model, "config", None), "vocab_size", 256))
    return torch.randint(0, vocab, (batch_size, window), generator=torch.Generator().manual_seed(seed)).to(device)


def _seconds(model: nn.Module, ids: torch.Tensor, n: int) -> float:
    """Seconds per forward of model(ids), averaged over n calls (CUDA synchronized around them)."""
    sync = torch.cuda.synchronize if ids.is_cuda else (lambda: None)
    with torch.inference_mode():
        sync()
        t0 = time.perf_counter()
        for _ in range(n):
            model(ids)
        sync()
    return (time.perf_counter() - t0) / n


def latencies(models: Sequence[nn.Module], batch_size: int = 8, window: int | None = None,
              device: str | torch.device | None = None, timing: Timing = Timing()) -> list[Latency]:
    """Forward-pass wall time of each model (on `device`, default its own) on a [batch_size, window] batch of random
    token ids (`window`: default its context), timed round-robin: repetition r of every model runs before repetition
    r + 1 of any, so a change of the machine's load hits every model alike. A repetition is enough forwards to fill
    min_run_time / repetitions seconds (estimated after the warmup)."""
    if batch_size < 1:
        raise FcauditError(f"batch size {batch_size} for latency: pass a batch size of at least 1")
    runs = []
    for model in models:
        dev = torch.device(device) if device is not None else input_device(model)
        model = model.to(dev).eval()
        w = window or context_length(model) or 128
        runs.append((model, random_ids(model, batch_size, w, dev, timing.seed)))
    return timed(runs, timing)


def timed(runs: Sequence[tuple[nn.Module, torch.Tensor]], timing: Timing = Timing()) -> list[Latency]:
    """The wall time of each model(ids) of `runs` (model, ids), on ids' device, timed round-robin as `latencies`."""
    forwards = []
    for model, ids in runs:
        if timing.warmup:
            _seconds(model, ids, timing.warmup)
        forwards.append(max(1, math.ceil(timing.min_run_time / timing.repetitions / _seconds(model, ids, 1))))
    times: list[list[float]] = [[] for _ in runs]
    for _ in range(timing.repetitions):
        for t, (model, ids), n in zip(times, runs, forwards):
            t.append(_seconds(model, ids, n))
    out = []
    for (_, ids), t, n in zip(runs, times, forwards):
        ms = np.asarray(t) * 1e3
        q1, median, q3 = np.percentile(ms, [25, 50, 75])
        out.append(Latency(ms_per_batch=float(median), iqr_ms=float(q3 - q1), min_ms=float(ms.min()),
                           max_ms=float(ms.max()), tokens_per_s=ids.numel() / (median / 1e3), batch_size=ids.shape[0],
                           window=ids.shape[1], device=str(ids.device), threads=torch.get_num_threads(),
                           measurements=len(t), forwards=n))
    return out
