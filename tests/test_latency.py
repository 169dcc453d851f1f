"""Latency measurement: models are timed round-robin, and a spread larger than the median is flagged."""

import torch
from torch import nn

from fcaudit.execution.latency import Latency, Timing, latencies


class Recorder(nn.Module):
    """A model that records each forward call in a shared log."""

    def __init__(self, name: str, log: list):
        super().__init__()
        self.name, self.log = name, log
        self.w = nn.Parameter(torch.ones(1))

    def forward(self, ids):
        self.log.append(self.name)
        return self.w * ids.float()


def test_models_are_timed_round_robin():
    log: list = []
    lats = latencies([Recorder("a", log), Recorder("b", log)], batch_size=1, window=4,
                     timing=Timing(min_run_time=1e-9, repetitions=3, warmup=0))
    # calibration (one call each), then repetition r of every model before repetition r + 1 of any
    assert log == ["a", "b"] + ["a", "b"] * 3
    assert [l.measurements for l in lats] == [3, 3] and all(l.forwards == 1 for l in lats)
    assert all(l.min_ms <= l.ms_per_batch <= l.max_ms and l.iqr_ms >= 0 for l in lats)


def test_a_spread_beyond_the_median_is_flagged():
    common = dict(tokens_per_s=1.0, batch_size=1, window=2, device="cpu", threads=1, measurements=10)
    assert Latency(ms_per_batch=2.0, iqr_ms=0.5, min_ms=1.0, max_ms=4.0, **common).noisy
    assert not Latency(ms_per_batch=2.0, iqr_ms=0.1, min_ms=1.8, max_ms=2.5, **common).noisy
