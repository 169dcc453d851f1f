"""Execution measurements (question 3): decided against executed work (`fca.execution`), executed blocks, FLOPs,
latency/throughput, KV-cache decoding, post-training thresholding."""

import sys
import types

from fcaudit.execution.blocks import block_pattern
from fcaudit.execution.decided import ExecutionResult, ExecutionSettings, execution
from fcaudit.execution.latency import Latency, Timing, latencies
from fcaudit.execution.measure import BlockCount, ExecutionConfig, executed_blocks, flops, measure_execution
from fcaudit.execution.threshold import thresholding

__all__ = ["BlockCount", "ExecutionConfig", "ExecutionResult", "ExecutionSettings", "Latency", "Timing",
           "block_pattern", "executed_blocks", "execution", "flops", "latencies", "measure_execution",
           "thresholding"]


class _Callable(types.ModuleType):
    """`fca.execution(model, ctrl, windows)` is this package once it is imported (Python binds a subpackage to its
    parent's attribute), so the package calls the function of the same name."""

    def __call__(self, *args, **kwargs) -> ExecutionResult:
        return execution(*args, **kwargs)


sys.modules[__name__].__class__ = _Callable
