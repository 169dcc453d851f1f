"""Forward FLOPs per token, counted by torch.utils.flop_counter on the tensors that really run (the one counter
every execution view uses: models, an MoE's or a token router's conditions)."""

from __future__ import annotations

from contextlib import ExitStack

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

aten = torch.ops.aten

# The fused CPU attention kernel has no formula in torch's FLOP registry (it would count 0); count it like the CUDA
# kernels: 2 matmuls over the full T x T score matrix (the counter's convention, causal masking not discounted).
_EXTRA_FLOP_FORMULAS = {
    aten._scaled_dot_product_flash_attention_for_cpu:
        lambda q, k, v, *args, out_shape=None, **kwargs: sdpa_flop_count(q, k, v),
}


@torch.inference_mode()
def flops(model: nn.Module, ids: torch.Tensor) -> float:
    """Forward FLOPs per token (total FLOPs of model(ids) / ids.numel()), counted by FlopCounterMode: matmuls,
    convolutions and attention kernels (a multiply-add = 2 FLOPs), not elementwise ops, norms or softmax. A
    controller's own matmuls (FeatureGate's q @ k^T for its features) are counted: they are its extra work."""
    # FlopCounterMode's module tracker hooks autograd on module inputs that require grad (MUDDPythia passes its
    # dense_bs parameters into modules), which fails without a graph: freeze the parameters while counting.
    with ExitStack() as flags:
        for p in model.parameters():
            flags.callback(p.requires_grad_, p.requires_grad)
            p.requires_grad_(False)
        with FlopCounterMode(display=False, custom_mapping=_EXTRA_FLOP_FORMULAS) as counter:
            model(ids)
    return counter.get_total_flops() / ids.numel()
