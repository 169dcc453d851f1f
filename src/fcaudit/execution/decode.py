"""Token-by-token decoding with a KV cache, where per-token early exit saves work (scoring a window computes every
position at every block). A model decodes if it has `start_decoding(batch, window)` and takes
`model(ids[:, t:t+1], cache=state)`: fcaudit's Dense, FeatureGate and its variants, MoD routing by its causal
predictor, and early exit, all on FeatureGate's blocks and cache, so their ratios measure the mechanisms. A Hugging
Face model that generates decodes through its own cache (the one it makes on the first step, `use_cache=True`), and
what its blocks computed per token is observed (fcaudit.execution.rows): the rows that entered each block's weights.

Decoding runs on text (an exit rule decides differently on random bytes), one sequence, as one user's generation
(batch rows decoded in lockstep would run a block while any of them still needs it), teacher-forced: the logits equal
the window's forward up to float rounding, which every row reports (`decode_max_abs_dlogit`) and which is checked:
beyond it, the decoding of that model is not measured (`not_rounding`).
"""

from __future__ import annotations

import inspect
import math
from collections import Counter
from typing import Callable

import torch
from torch import nn

from fcaudit.controllers.rows import counting_rows
from fcaudit.errors import FcauditError, one_line
from fcaudit.execution.blocks import block_modules, block_pattern
from fcaudit.execution.flops import flops
from fcaudit.execution.latency import Timing, timed
from fcaudit.loss import logits_of

DECODE_BATCH = 1  # sequences decoded at once
CACHE_NAMES = ("cache", "past_key_values", "state", "cache_params")  # what a transformers model hands its cache as
COLUMNS = ("executed_layer_fraction", "decode_flops_per_token", "decode_max_abs_dlogit", "decode_ms_per_token",
           "decode_ms_iqr_per_token")


def _hugging_face(model: nn.Module) -> bool:
    """A transformers model that generates: it decodes with its own cache."""
    return not hasattr(model, "start_decoding") and callable(getattr(model, "can_generate", None)) \
        and bool(model.can_generate())


def not_decodable(model: nn.Module) -> str | None:
    """Why `model` has no KV-cache decoding in fcaudit, or None when it has."""
    if _hugging_face(model):
        return None
    start = getattr(model, "start_decoding", None)
    if start is None:
        return (f"{type(model).__name__} has no KV-cache decoding path fcaudit knows (neither fcaudit's "
                "`start_decoding` nor a Hugging Face model's own cache): scoring only")
    try:
        start(1, 1)
    except FcauditError as e:
        return str(e)
    return None


@torch.inference_mode()
def decode(model: nn.Module, ids: torch.Tensor, before_step: Callable[[], None] = lambda: None):
    """(logits [B, T, V], the decoding state) of decoding ids [B, T] token by token with the model's KV cache, token t
    being ids[:, t]; the state's `executed()` counts the (token, block) pairs each block computed. A Hugging Face
    model's state is its cache, and None stands for its count (observed instead: `decoded_rows`). `before_step` is
    called before each token's step."""
    if _hugging_face(model):
        # the model makes the cache of its own kind (MiniMax's, xLSTM's, RWKV's state) on the first step and hands it
        # back; transformers renamed `past_key_values` to `cache` (5.25 warns on the old name): the name it takes
        taken = inspect.signature(model.forward).parameters
        name = next((n for n in CACHE_NAMES if n in taken), None)
        cache, steps = {}, []
        for t in range(ids.shape[1]):
            before_step()
            out = model(input_ids=ids[:, t:t + 1], use_cache=True, **cache)
            steps.append(out.logits)
            held = next((getattr(out, n) for n in CACHE_NAMES if getattr(out, n, None) is not None), None)
            cache = {name: held} if name is not None and held is not None else cache
        return torch.cat(steps, dim=1), None
    state = model.start_decoding(ids.shape[0], ids.shape[1])
    steps = []
    for t in range(ids.shape[1]):
        before_step()
        steps.append(logits_of(model(ids[:, t:t + 1], cache=state)))
    return torch.cat(steps, dim=1), state


def decoded_rows(model: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(logits decoded, logits of the window's forward, the fraction of (block, token) pairs computed) of decoding
    ids, observed at every block's weights: in each token's step a block computed the rows the busiest of its modules
    took, at most one per sequence (experts that take k rows per token, a looped layer that takes n, computed the
    token once; a module whose weights the model reads without calling it takes none, and its neighbours tell)."""
    blocks = [m for _, m in block_modules(model, block_pattern(model))]
    with counting_rows(blocks) as counts:
        seen: list[list[Counter]] = []
        logits, _ = decode(model, ids, lambda: seen.append([Counter(c) for c in counts]))
        seen.append([Counter(c) for c in counts])
    with torch.inference_mode():
        full = logits_of(model(ids))
    computed = sum(min(ids.shape[0], max((after - before).values(), default=0))
                   for step, next_ in zip(seen, seen[1:]) for before, after in zip(step, next_))
    return logits, full, computed / (len(blocks) * ids.numel())


class Decoder(nn.Module):
    """`model` scoring ids by decoding them, for the FLOP counter and the timer (which call forward(ids))."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return decode(self.model, ids)[0]


def decoding_columns(model: nn.Module, ids: torch.Tensor) -> dict:
    """What decoding ids [B, T] runs (its timing columns NaN until decode_latencies): the fraction of (block, token)
    pairs computed (`executed_layer_fraction`: 1.0 where every block runs), FLOPs per token, and the largest |logit
    difference| from the window's forward. NaN, with `decode_note` saying why, for a model that cannot decode."""
    untimed = {**dict.fromkeys(COLUMNS, math.nan), "decode_noisy": False}
    if (reason := not_decodable(model)) is not None:
        return {**untimed, "decode_note": reason}
    if _hugging_face(model):
        try:
            logits, full, fraction = decoded_rows(model, ids)
        except Exception as e:  # the model's own code refuses to decode token by token: its scoring stands
            return {**untimed, "decode_note": f"not measured: decoding token by token fails in the model "
                                              f"({type(e).__name__}: {one_line(e, 160)})"}
    else:
        logits, state = decode(model, ids)
        fraction = sum(state.executed()) / (len(state.caches) * ids.numel())
        with torch.inference_mode():
            full = logits_of(model(ids))
    dlogit = float((logits.float() - full.float()).abs().max())
    if (beyond := not_rounding(dlogit, full)) is not None:
        return {**untimed, "decode_max_abs_dlogit": dlogit, "decode_note": beyond}
    return {**untimed, "executed_layer_fraction": fraction, "decode_flops_per_token": flops(Decoder(model), ids),
            "decode_max_abs_dlogit": dlogit, "decode_note": ""}


def not_rounding(dlogit: float, full: torch.Tensor) -> str | None:
    """Why decoding is not measured when its logits differ from the window's forward by more than float rounding
    (a thousandth of the logits' scale, or 64 ulps in a 16-bit dtype): then the cache path computes another function
    (a model keeping state the cache does not reset), and its rows and times would be of that one. None where within."""
    scale = max(1.0, float(full.float().abs().max()))
    if math.isfinite(dlogit) and dlogit <= max(1e-3, 64 * torch.finfo(full.dtype).eps) * scale:
        return None
    return (f"not measured: decoding token by token gives logits up to {dlogit:.3g} from the window's forward (logits "
            f"up to {scale:.3g}), beyond {full.dtype} rounding: this model's cache path does not compute what its "
            "forward computes as fcaudit drives it (state kept outside the cache), so its decoding is not reported")


def decode_latencies(models: list[nn.Module], ids: torch.Tensor, timing: Timing) -> list[dict]:
    """Each model's wall time per decoded token (median and IQR over repetitions) on ids, timed round-robin."""
    T = ids.shape[1]
    return [{"decode_ms_per_token": lat.ms_per_batch / T, "decode_ms_iqr_per_token": lat.iqr_ms / T,
             "decode_noisy": lat.noisy} for lat in timed([(Decoder(m), ids) for m in models], timing)]
