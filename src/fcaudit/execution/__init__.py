"""Execution measurements (question 3): executed blocks, FLOPs, latency/throughput, post-training thresholding."""

from fcaudit.execution.blocks import block_pattern
from fcaudit.execution.latency import Latency, Timing, latencies
from fcaudit.execution.measure import BlockCount, ExecutionConfig, executed_blocks, flops, measure_execution
from fcaudit.execution.threshold import thresholding

__all__ = ["BlockCount", "ExecutionConfig", "Latency", "Timing", "block_pattern", "executed_blocks", "flops",
           "latencies", "measure_execution", "thresholding"]
