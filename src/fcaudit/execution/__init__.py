"""Execution measurements (question 3): executed blocks, FLOPs, latency/throughput, post-training thresholding."""

from fcaudit.execution.measure import (BlockCount, Latency, block_pattern, executed_blocks, flops, latency,
                                       measure_execution)
from fcaudit.execution.threshold import thresholding

__all__ = ["BlockCount", "Latency", "block_pattern", "executed_blocks", "flops", "latency", "measure_execution",
           "thresholding"]
