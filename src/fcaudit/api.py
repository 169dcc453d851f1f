"""One call each for what a Python audit needs besides the engine: a model from a checkpoint, and its windows.

    model = fca.load("runs/fg-s0")                           # directory written by `fcaudit train`, or a hub id
    eval_windows, calib_windows = fca.windows("embedded", n_eval=64, n_calib=64, window=128)
"""

from __future__ import annotations

import os

from torch import nn

from fcaudit import data
from fcaudit.config import AuditConfig
from fcaudit.device import as_dtype, resolve_device
from fcaudit.families import load_model
from fcaudit.hub import resolve
from fcaudit.tokens import load_tokenizer


def load(path_or_id: str | os.PathLike, *, device: str = "auto", dtype: str | None = None,
         revision: str | None = None, device_map: str | dict | None = None,
         offload_folder: str | os.PathLike | None = None) -> nn.Module:
    """The model of a checkpoint directory or Hugging Face hub id (any registered family: FeatureGate, MUDDPythia,
    Hugging Face MoE), in eval mode.

    What the checkpoint says about itself (variant, seed, ...) is in `model.fcaudit_meta`, with the resolved
    directory under "checkpoint". device: auto | cpu | cuda; dtype: None keeps the checkpoint's. device_map (Hugging
    Face checkpoints, instead of device): accelerate's "auto", "balanced", "sequential", or {module path: device};
    offload_folder holds what it puts on "disk".
    """
    path = resolve(path_or_id, revision)
    placed = {} if device_map is None else {"device_map": device_map, "offload_folder": offload_folder}
    model, meta = load_model(path, device=resolve_device(device), dtype=None if dtype is None else as_dtype(dtype),
                             **placed)
    model.fcaudit_meta = {**meta, "checkpoint": str(path)}
    return model


def windows(corpus: str = "embedded", *, n_eval: int, n_calib: int, window: int, seed: int = 0, tokenizer=None):
    """(evaluation, calibration) WindowSets as `fcaudit audit` draws them: non-overlapping windows of `window`
    tokens from the test and the validation split of `corpus` (embedded, a local path, wikitext-103, openwebtext).

    tokenizer: None for byte-level models, else a `tokenizers.Tokenizer` or a directory / hub id holding one.
    """
    AuditConfig(n_eval=n_eval, n_calib=n_calib, window=window, seed=seed)  # the bounds `fcaudit audit` has
    if isinstance(tokenizer, (str, os.PathLike)):
        tokenizer = load_tokenizer(tokenizer)
    corp = data.load_corpus(corpus, tokenizer=tokenizer, splits=("validation", "test"))
    return data.audit_windows(corp, n_eval, n_calib, window, seed)
