"""A model's state through an audit: Correct is measured in stage 1 and the conditions in stage 2, so a model that
changes itself between them (a running statistic or fake-quant observer left on in eval, a flag flipped by a call
counter) compares two models. Its parameters and buffers are digested before the checks and compared after stage 1
and at the end; the first batch's Correct pass is repeated at the end and must give stage 1's logits and NLL bit for
bit (it also catches state kept outside the tensors, e.g. a Python attribute)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
from torch import nn

from fcaudit import placement
from fcaudit.errors import FcauditError

STATE_CHECK_PASSES = 1  # the first batch's Correct pass, repeated at the end
NO_RERUN = ("so Correct and the conditions would be measured on different models; nothing of this audit is kept, and "
            "no rerun helps while the model changes itself:")


def changed_itself(error: Exception) -> bool:
    """Whether `error` (also as every rank raises it) is the state check's."""
    return NO_RERUN in str(error)


def tensor_digests(model: nn.Module) -> dict[str, str]:
    """'parameter NAME' / 'buffer NAME' -> the sha256 of its dtype, shape and bytes (an offloaded layer's too)."""
    kinds = {name for name, _ in model.named_parameters()}
    out = {}
    for name, t in placement.named_tensors(model):
        h = hashlib.sha256(f"{t.dtype} {tuple(t.shape)}".encode())
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
        out[f"{'parameter' if name in kinds else 'buffer'} {name!r}"] = h.hexdigest()
    return out


def logits_digest(logits: torch.Tensor) -> str:
    """The sha256 of the logits' bytes, one window at a time (no host copy of a whole batch's logits)."""
    h = hashlib.sha256(f"{logits.dtype} {tuple(logits.shape)}".encode())
    for window in logits.detach():
        h.update(window.contiguous().reshape(-1).view(torch.uint8).cpu().numpy())
    return h.hexdigest()


@dataclass(frozen=True)
class ModelState:
    """The model's tensors (a digest each) before the checks, and the first batch's Correct pass of stage 1: its
    logits' digest and its NLL [B] (float64, on the CPU)."""

    tensors: dict[str, str]
    logits: str
    nll: torch.Tensor

    @classmethod
    def of(cls, model: nn.Module, probe: tuple) -> "ModelState":
        """Taken just after the probe (the first batch's capture), so that a cache a model fills on its first call
        (a rotary table, a causal mask) is part of it."""
        return cls(tensor_digests(model), logits_digest(probe[1]), probe[2].detach().double().cpu())

    def check_tensors(self, model: nn.Module, when: str) -> None:
        """Refused, naming the first tensor that changed since the checks began."""
        now = tensor_digests(model)
        changed = [k for k in dict.fromkeys([*self.tensors, *now]) if self.tensors.get(k) != now.get(k)]
        if changed:
            more = f" (and {len(changed) - 1} more)" if len(changed) > 1 else ""
            raise FcauditError(f"the model's {changed[0]}{more} changed during the audit ({when}): the model updates "
                               f"its own state in eval mode (e.g. a running statistic, an observer or a cache left "
                               f"on), {NO_RERUN} freeze that state (e.g. turn the observer off, or set the flag) "
                               "before auditing")

    def check_pass(self, logits: torch.Tensor, nll: torch.Tensor) -> None:
        """Refused when the first batch's Correct pass, repeated, gives other logits or NLL than in stage 1."""
        nll = nll.detach().double().cpu()
        if logits_digest(logits) == self.logits and torch.equal(nll, self.nll):
            return
        how = (f"max |ΔNLL| = {float((nll - self.nll).abs().max()):.3g}" if nll.shape == self.nll.shape
               and not torch.equal(nll, self.nll) else "other logits, the same NLL")
        raise FcauditError(f"the first evaluation batch's Correct pass, repeated at the end of the audit, differs "
                           f"from stage 1's ({how}) though no parameter or buffer changed: the model's forward "
                           "depends on state outside its tensors (e.g. a call counter or a flag in a Python "
                           f"attribute that it changes), {NO_RERUN} make its eval forward a function of its inputs "
                           "and weights only")
