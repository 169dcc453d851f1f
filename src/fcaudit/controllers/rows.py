"""The rows a forward pass computed in a block, observed on the model: at every module inside the block that holds a
weight matrix (Linear, Conv1D, a custom projection), each call adding the rows of its first floating-point input (its
elements over its feature axis: the last, a convolution's channels). Blocks are often run through something other
than their own forward (a parent calling `block.mlp` on a gathered subset), so the rows are counted where the work is
done. It lives here, below execution, so that the audit's budget observation (`Controller.observing`) and
execution's measurements count rows one way."""

from __future__ import annotations

from collections import Counter
from contextlib import contextmanager
from typing import Iterator, Sequence

import torch
from torch import nn


def largest_list(model: nn.Module) -> str | None:
    """The path pattern of the children of the model's ModuleList that holds the most parameters (its blocks:
    "blocks.*", "layers.*", "model.layers.*"), or None where it has none."""
    lists = [(sum(p.numel() for p in m.parameters()), name) for name, m in model.named_modules()
             if name and isinstance(m, nn.ModuleList) and len(m)]
    return f"{max(lists)[1]}.*" if lists else None


def computing_modules(block: nn.Module) -> list[nn.Module]:
    """The modules of `block` (itself included) that hold a weight matrix of their own: where its rows are computed."""
    return [m for m in block.modules() if any(p.dim() >= 2 for p in m.parameters(recurse=False))]


def input_rows(module: nn.Module, args: tuple) -> int:
    """The rows of a call's first floating-point input: its elements over its feature axis, the last one, or for a
    convolution the channels' (torch's are channels first: [batch, channel, length] has batch x length positions)."""
    x = next((a for a in args if isinstance(a, torch.Tensor) and a.is_floating_point() and a.dim()), None)
    axis = 1 if isinstance(module, nn.modules.conv._ConvNd) and x is not None and x.dim() > 2 else -1
    return 0 if x is None or not x.shape[axis] else x.numel() // x.shape[axis]


@contextmanager
def counting_rows(blocks: Sequence[nn.Module]) -> Iterator[list[Counter]]:
    """Within the block: per block, a Counter of the rows each of its computing modules received (keyed by module),
    over every call. Hooks are removed afterwards; the forward's numerics are untouched (a pre-hook only reads)."""
    counts = [Counter() for _ in blocks]
    handles = []
    for count, block in zip(counts, blocks):
        for m in computing_modules(block):
            count[m] += 0  # a module that never runs still counts, with 0 rows

            def hook(module, args, count=count):
                count[module] += input_rows(module, args)

            handles.append(m.register_forward_pre_hook(hook))
    try:
        yield counts
    finally:
        for h in handles:
            h.remove()


def block_rows(count: Counter) -> int:
    """The rows one block computed: the most any of its computing modules took (in a block that runs only some
    tokens, every module takes those rows; a module that takes every row shows the block computed every token)."""
    return max(count.values(), default=0)


def fused_part(model: nn.Module, paths: Sequence[str], within: bool = True) -> tuple[str, str] | None:
    """(path, layer) of the first of `paths` that is an nn.TransformerEncoderLayer or lies inside one (`within`: or
    holds one), else None. A hook on any module of such a layer turns off its fused fast path, which rounds
    differently: counting rows there would change the numerics of the pass it observes."""
    layers = [n for n, m in model.named_modules() if n and isinstance(m, nn.TransformerEncoderLayer)]
    for p in paths:
        for t in layers:
            if p == t or p.startswith(t + ".") or (within and t.startswith(p + ".")):
                return p, t
    return None

