"""The inputs of an audit and of its plan, checked before anything runs: the windows (token ids [N, T]), the
controller built from this model, token ids the model embeds, and the first forward pass; and the model helpers both
use (eval mode, the parameters' hash, the vocabulary)."""

from __future__ import annotations

import hashlib
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from fcaudit import families, placement
from fcaudit.auditor.engine import LossFn, capture_batch
from fcaudit.controllers.controller import Controller
from fcaudit.errors import FcauditError, one_line
from fcaudit.loss import vocab_size


def as_windows(windows, what: str) -> tuple[torch.Tensor, object | None]:
    """ids [N, T] int64 from a tensor, a list of rows, or a WindowSet (anything with `.ids`)."""
    window_set = windows if hasattr(windows, "ids") else None
    ids = windows.ids if window_set is not None else windows
    if ids is None:
        raise FcauditError(f"{what} windows are None: pass token ids [N, T] (a tensor, a list of rows, or a WindowSet "
                           "of fca.windows)")
    if isinstance(ids, (list, tuple)):
        if not all(hasattr(row, "__len__") for row in ids):  # [5, 7, 9]: one window's ids, not a list of windows
            raise FcauditError(f"{what} windows are a flat list of token ids; pass a list of windows (rows of ids), "
                               "e.g. [ids] for one window")
        lengths = sorted({len(row) for row in ids})
        if len(lengths) > 1:
            raise FcauditError(f"{what} windows have unequal lengths {lengths[:4]}; cut every window to one length (--window)")
    try:
        if isinstance(ids, (list, tuple)):
            ids = torch.stack([torch.as_tensor(row) for row in ids]) if ids else torch.empty(0, 0, dtype=torch.long)
        ids = torch.as_tensor(ids)
    except (TypeError, ValueError, RuntimeError):
        raise FcauditError(f"{what} windows must be token ids [N, T] (an integer tensor, a list of rows or a "
                           f"WindowSet), got {type(ids).__name__}") from None
    if ids.dim() != 2 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise FcauditError(f"{what} windows must be an integer tensor [N, T] of token ids, got {ids.dtype} {tuple(ids.shape)}")
    return ids.long().cpu(), window_set


@dataclass
class Windows:
    """An audit's evaluation and calibration ids [N, T] (int64, on the CPU) and the WindowSets they came from."""

    ev: torch.Tensor
    ev_set: object | None
    ca: torch.Tensor
    ca_set: object | None

    @classmethod
    def of(cls, eval_windows, calib_windows) -> "Windows":
        return cls(*as_windows(eval_windows, "evaluation"), *as_windows(calib_windows, "calibration"))

    def check(self) -> None:
        """Refused where CrossInput, the static profiles or a next-token NLL cannot use them, or where calibration
        windows repeat or overlap evaluation windows (a real run's check: a dry run prints it as a note)."""
        ev, ca = self.ev, self.ca
        if ev.shape[0] < 2:
            raise FcauditError(f"{ev.shape[0]} evaluation window(s): CrossInput needs a derangement, so pass at "
                               "least 2 (--eval)")
        if ca.shape[0] < 1:
            raise FcauditError("no calibration windows: static profiles need at least 1 (--calib)")
        if ev.shape[1] != ca.shape[1]:
            raise FcauditError(f"evaluation windows have length {ev.shape[1]} but calibration windows {ca.shape[1]}; "
                               "use one window length for both (--window)")
        if ev.shape[1] < 2:
            raise FcauditError("windows need at least 2 tokens for a next-token NLL; pass a longer --window")
        rows = {hashlib.sha256(row.tobytes()).digest() for row in ev.numpy()}  # not a copy of every window
        if shared := sum(hashlib.sha256(row.tobytes()).digest() in rows for row in ca.numpy()):
            raise FcauditError(f"{shared} calibration window(s) equal evaluation windows; draw calibration windows "
                               "from a different split (e.g. validation) than the evaluation windows (test), or, "
                               "when they already are (as fcaudit audit draws them), use a corpus whose text does not "
                               "repeat")
        e, c = (getattr(s, "starts", None) for s in (self.ev_set, self.ca_set))
        if e is not None and c is not None and self.ev_set.split == self.ca_set.split:
            t, e, c = ev.shape[1], np.sort(np.asarray(e)), np.asarray(c)
            # a calibration window [c, c+t) overlaps an eval window [e, e+t) iff some e lies in (c-t, c+t)
            if np.any(np.searchsorted(e, c - t, side="right") < np.searchsorted(e, c + t)):
                raise FcauditError(f"calibration windows overlap evaluation windows in split {self.ev_set.split!r}; "
                                   "take them from another split or non-overlapping ranges")


def first_forward(model: nn.Module, controller: Controller, first: torch.Tensor, loss_fn: LossFn | None,
                  decoding: bool = False) -> tuple:
    """capture_batch of the first evaluation windows, where a model that fails on them is one line (an audit's probe,
    a dry run's warm-up)."""
    try:
        return capture_batch(model, controller, first, loss_fn, decoding=decoding)
    except FcauditError:
        raise
    except Exception as e:  # e.g. windows beyond a model's position table that it does not declare
        raise FcauditError(f"the model's forward pass on the first evaluation batch ({first.shape[0]} windows of "
                           f"{first.shape[1]} tokens) failed ({type(e).__name__}: {one_line(e)}); check that the "
                           "windows fit the model (its context and vocabulary) and a batch fits in memory (batch "
                           "size)") from e  # the cause's traceback stays, for a bug in the model's own code


def check_controller(model: nn.Module, controller: Controller) -> None:
    """A Controller built from this model instance (not a pattern, nor another instance's sites)."""
    if not isinstance(controller, Controller):
        raise FcauditError(f"controller must be a fcaudit.Controller (fcaudit.controller_for(model)), got "
                           f"{type(controller).__name__}")
    modules = {id(m) for m in model.modules()}
    if foreign := [s.path for s in controller.sites if id(s.module) not in modules]:
        raise FcauditError(f"the controller's site {foreign[0]!r} is a module of another model instance; build the "
                           "controller from this model (fcaudit.controller_for(model) or Controller.from_modules)")


@contextmanager
def evaluating(model: nn.Module):
    """The model in eval mode under inference_mode, then back in the mode it was in."""
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            yield
    finally:
        model.train(was_training)


def parameter_hash(model: nn.Module) -> str:
    h = hashlib.sha256()
    for name, t in placement.named_tensors(model):  # an offloaded layer's weights too, one module at a time
        h.update(name.encode())
        h.update(str(t.dtype).encode())
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())  # the buffer: no copy
    return h.hexdigest()


def check_ids(model: nn.Module, *windows: torch.Tensor) -> None:
    """Token ids the model embeds, in windows no longer than its context (some models silently accept longer ones)."""
    vocab, context = vocab_size(model), families.context_length(model)
    for ids in windows:
        if context is not None and ids.shape[1] > context:
            raise FcauditError(f"windows of {ids.shape[1]} tokens exceed the model's context of {context} positions; "
                               f"pass windows of at most {context} tokens (--window {context})")
        if ids.numel() and (int(ids.min()) < 0 or (vocab is not None and int(ids.max()) >= vocab)):
            raise FcauditError(f"token ids range over [{int(ids.min())}, {int(ids.max())}] but the model embeds ids "
                               f"0..{vocab - 1 if vocab else '?'}; encode the windows with the model's tokenizer")


def check_targets(windows: Windows, width: int) -> None:
    """Every next token of every window is an entry of the logits (of `width`): a narrower output would fail at the
    batch that holds it, after the batches before it ran."""
    for what, ids in (("evaluation", windows.ev), ("calibration", windows.ca)):
        beyond = (ids[:, 1:] >= width).any(1).nonzero()
        if len(beyond):
            w = int(beyond[0])
            raise FcauditError(f"{what} window {w} has next-token id {int(ids[w, 1:].max())} but the model's logits "
                               f"have {width} entries (ids 0..{width - 1}); encode the windows with the model's "
                               "tokenizer, or give the model an output for every id it embeds")
