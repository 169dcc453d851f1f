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
from fcaudit.controllers.findings import Finding
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

    def check(self) -> list[Finding]:
        """Refused where CrossInput, the static profiles or a next-token NLL cannot use them, where evaluation windows
        repeat (copies are one window counted several times: intervals too narrow, CrossInput pairs a window with
        itself), or where calibration windows repeat or overlap evaluation windows (a real run's check: a dry run
        prints it as a note). Returns the notice on calibration windows that share long spans with evaluation
        windows (`shared_span_notice`), if any."""
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
        digests = [hashlib.sha256(row.tobytes()).digest() for row in ev.numpy()]  # not a copy of every window
        rows: dict[bytes, int] = {}  # each distinct window's digest -> its first index
        for i, d in enumerate(digests):
            if (first := rows.setdefault(d, i)) != i:
                copies = ev.shape[0] - len(set(digests))
                raise FcauditError(f"evaluation window {i} equals window {first} ({copies} of {ev.shape[0]} "
                                   "evaluation windows repeat others): a copy counts one window twice, so the "
                                   "intervals are too narrow and CrossInput can pair a window with itself; pass "
                                   "distinct windows (where fcaudit drew them from a corpus, its text repeats: use "
                                   "longer windows (--window) or a corpus whose text does not repeat)")
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
        notice = shared_span_notice(ev.numpy(), ca.numpy())
        return [notice] if notice is not None else []


def span_length(window: int) -> int:
    """The shortest shared run of tokens that `shared_span_notice` calls long: half a window, and at least
    MIN_SHARED_SPAN tokens (shorter runs, a common phrase, recur by chance in natural text), but at most the window
    less one token (a window shifted by one always counts)."""
    return max(1, min(window - 1, max(window // 2, MIN_SHARED_SPAN)))


MIN_SHARED_SPAN = 32
_BASE = np.uint64(0x9E3779B97F4A7C15)  # odd: invertible modulo 2**64


def _span_hashes(ids: np.ndarray, span: int, rows: int = 256) -> np.ndarray:
    """[N, T - span + 1] polynomial hashes (modulo 2**64) of every run of `span` tokens of each window: one cumulative
    sum per window, each run's hash its difference, brought to a common power by the base's inverse (`rows` windows
    at a time, so the sums never take more memory than a slice of the windows)."""
    t = ids.shape[1]
    starts = np.arange(t - span + 1)
    out = np.empty((ids.shape[0], len(starts)), dtype=np.uint64)
    with np.errstate(over="ignore"):
        powers = np.cumprod(np.r_[np.uint64(1), np.full(t, _BASE)], dtype=np.uint64)
        inverses = np.cumprod(np.r_[np.uint64(1), np.full(t, np.uint64(pow(int(_BASE), -1, 1 << 64)))],
                              dtype=np.uint64)
        for i in range(0, ids.shape[0], rows):
            sums = np.zeros((min(rows, ids.shape[0] - i), t + 1), dtype=np.uint64)
            sums[:, 1:] = np.cumsum((ids[i:i + rows].astype(np.uint64) + np.uint64(1)) * powers[:t], axis=1,
                                    dtype=np.uint64)
            out[i:i + rows] = (sums[:, starts + span] - sums[:, starts]) * inverses[starts]
    return out


def shared_span_notice(ev: np.ndarray, ca: np.ndarray) -> Finding | None:
    """A notice naming the calibration windows that share a run of at least `span_length` tokens with an evaluation
    window (one shifted by a token, or with a token changed): static profiles then hold part of the evaluation text.
    Runs are found by their hashes and each one counted is compared token by token."""
    span = span_length(ev.shape[1])
    if ev.size == 0 or ca.size == 0:
        return None
    he, hc = _span_hashes(ev, span), _span_hashes(ca, span)
    order = np.argsort(he, axis=None)
    flat = he.reshape(-1)[order]
    hit = np.isin(hc, flat)
    shared = []
    for row in np.flatnonzero(hit.any(1)):
        at = int(np.argmax(hit[row]))
        where = order[np.searchsorted(flat, hc[row, at])]  # an evaluation run with the same hash
        e, s = divmod(int(where), he.shape[1])
        if np.array_equal(ca[row, at:at + span], ev[e, s:s + span]):  # the hash's word checked
            shared.append((int(row), e))
    if not shared:
        return None
    (c, e) = shared[0]
    return Finding.notice("windows", f"note: {len(shared)} of {ca.shape[0]} "
                          "calibration windows share a run of at least "
                          f"{span} tokens (half a window, at least {MIN_SHARED_SPAN} and at most the window less "
                          f"one) with an evaluation window (calibration window {c} with evaluation window {e}): the "
                          "static profiles then hold part of the evaluation text; draw calibration windows from text "
                          "that does not repeat the evaluation text",
                          {"calibration_windows": len(shared), "span": span, "first": [c, e]})


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
