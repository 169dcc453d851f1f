"""Next-token negative log-likelihood within a window: the quantity every part of FCA compares."""

import torch
import torch.nn.functional as F

from fcaudit.errors import FcauditError


def token_nll(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Per-token NLL [B, T-1] in float32: position t predicts ids[:, t+1]. Computed over all B*T rows of the logits
    as they are (no copy of the [B, T-1, V] slice), each row independent of the others; the last is dropped."""
    if logits.dim() != 3 or ids.shape != logits.shape[:2]:
        raise ValueError(f"logits {tuple(logits.shape)} do not match ids {tuple(ids.shape)}")
    B, T, V = logits.shape
    targets = torch.cat([ids[:, 1:], ids.new_full((B, 1), -100)], dim=1)  # -100: cross_entropy's ignore_index
    nll = F.cross_entropy(logits.reshape(B * T, V).float(), targets.reshape(-1), reduction="none")
    return nll.view(B, T)[:, :-1]


def logits_of(output) -> torch.Tensor:
    """The logits in a model's output: the tensor itself, its `.logits` (HF style), its "logits" entry (a dict), or
    its first element (a tuple or list, as `return_dict=False` gives)."""
    if isinstance(output, torch.Tensor):
        return output
    found = getattr(output, "logits", None)
    if found is None and isinstance(output, dict):
        found = output.get("logits")
    if found is None and isinstance(output, (tuple, list)) and output:
        found = output[0]
    if not isinstance(found, torch.Tensor):
        raise FcauditError(f"the model returned {type(output).__name__}, in which fcaudit finds no logits: return "
                           "them as a tensor, an attribute or dict entry 'logits', or a tuple's first element")
    return found
