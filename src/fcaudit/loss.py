"""Next-token negative log-likelihood within a window: the quantity every part of FCA compares, and where a model's
output holds the logits it is computed from."""

import math

import torch
import torch.nn.functional as F
from torch import nn

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


def usable_logits(logits: torch.Tensor) -> bool:
    """No nan and no +inf in `logits`: -inf is a masked entry (probability 0), which a finite NLL allows. From the
    maximum, which nan carries through: one pass and no boolean copy of a batch's logits."""
    if not logits.is_floating_point() or not logits.numel():
        return True
    top = float(logits.max())
    return not math.isnan(top) and top != math.inf


def vocab_size(model: nn.Module) -> int | None:
    """The number of token ids the model embeds (input embedding rows), when it has one."""
    get = getattr(model, "get_input_embeddings", None)
    emb = get() if callable(get) else next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    return int(emb.num_embeddings) if isinstance(emb, nn.Embedding) else None


def logits_width(model: nn.Module) -> int | None:
    """The width of the model's logits: its output embedding's (Hugging Face's `get_output_embeddings`), its config's
    vocab_size, else the ids it embeds (a language model predicts the ids it reads); None when nothing says."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if isinstance(head, nn.Linear):
        return int(head.out_features)
    width = getattr(getattr(model, "config", None), "vocab_size", None)
    return width if isinstance(width, int) and not isinstance(width, bool) else vocab_size(model)


def _by_shape(output: tuple | list, model: nn.Module | None, ids: torch.Tensor | None) -> torch.Tensor:
    """The one tensor of a tuple or list that has the logits' shape: [batch, token] of `ids` (when given), then the
    model's vocabulary (`logits_width`, when known). None of them, or several, is refused in one line."""
    width = logits_width(model) if model is not None else None
    found = [t for t in output if isinstance(t, torch.Tensor) and t.dim() == 3
             and (ids is None or t.shape[:2] == ids.shape) and (width is None or t.shape[-1] == width)]
    if len(found) == 1:
        return found[0]
    shapes = ", ".join(str(list(t.shape)) if isinstance(t, torch.Tensor) else type(t).__name__ for t in output)
    want = f"[batch, token, {width if width is not None else 'vocab'}]"
    raise FcauditError(f"the model returned a {type(output).__name__} ({shapes}) in which "
                       f"{'no' if not found else len(found)} tensors have the logits' shape {want}; return the logits "
                       "alone or as an attribute or dict entry 'logits' (e.g. a wrapper module whose forward returns "
                       "them)")


def logits_of(output, model: nn.Module | None = None, ids: torch.Tensor | None = None) -> torch.Tensor:
    """The logits in a model's output: the tensor itself, its `.logits` (HF style), its "logits" entry (a dict), or
    the one element of a tuple or list (as `return_dict=False` gives) whose shape is that of logits for `ids` and the
    vocabulary of `model` (`_by_shape`)."""
    if isinstance(output, torch.Tensor):
        return output
    found = getattr(output, "logits", None)
    if found is None and isinstance(output, dict):
        found = output.get("logits")
    if found is None and isinstance(output, (tuple, list)) and output:
        found = _by_shape(output, model, ids)
    if not isinstance(found, torch.Tensor):
        raise FcauditError(f"the model returned {type(output).__name__}, in which fcaudit finds no logits: return "
                           "them as a tensor, an attribute or dict entry 'logits', or a tuple's element")
    return found
