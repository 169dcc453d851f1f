"""Next-token negative log-likelihood within a window: the quantity every part of FCA compares."""

import torch
import torch.nn.functional as F


def token_nll(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Per-token NLL [B, T-1] in float32: position t predicts ids[:, t+1] (targets shifted by one)."""
    if logits.dim() != 3 or ids.shape != logits.shape[:2]:
        raise ValueError(f"logits {tuple(logits.shape)} do not match ids {tuple(ids.shape)}")
    pred = logits[:, :-1].float()
    return F.cross_entropy(pred.reshape(-1, pred.size(-1)), ids[:, 1:].reshape(-1), reduction="none").view(pred.shape[:2])


def logits_of(output) -> torch.Tensor:
    """Models may return a tensor or an object with `.logits` (HF style)."""
    return output if isinstance(output, torch.Tensor) else output.logits
