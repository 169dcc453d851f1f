"""What a Python audit needs besides the engine, one call each: a model from a checkpoint (`fca.load`) and its
windows (`fca.windows`)."""

from __future__ import annotations

import os

from torch import nn

from fcaudit import data
from fcaudit.config import AuditConfig
from fcaudit.device import as_dtype, resolve_device
from fcaudit.errors import FcauditError
from fcaudit.families import load_model
from fcaudit.hub import resolve
from fcaudit.tokens import load_tokenizer


def load(path_or_id: str | os.PathLike, *, device: str = "auto", dtype: str | None = None,
         revision: str | None = None, device_map: str | dict | None = None,
         offload_folder: str | os.PathLike | None = None) -> nn.Module:
    """Load a model from a checkpoint directory or a Hugging Face hub id, in eval mode.

    Any registered family loads: a directory `fcaudit train` wrote, or a MUDDPythia or Hugging Face MoE checkpoint.
    `model.fcaudit_meta` holds what the checkpoint says about itself (variant, seed, ...) and, under "checkpoint",
    the resolved directory; `fca.controller_for(model)` gives its sites.

    Parameters
    ----------
    path_or_id
        A checkpoint directory (config.json and weights) or a hub id.
    device
        "auto", "cpu" or "cuda".
    dtype
        None keeps the checkpoint's; else e.g. "float32" or "bfloat16".
    revision
        The hub revision (branch, tag or commit) of a hub id.
    device_map
        Hugging Face checkpoints, instead of `device`: accelerate's "auto", "balanced", "sequential", or
        {module path: device}.
    offload_folder
        Where a device map keeps what it puts on "disk".

    Returns
    -------
    torch.nn.Module
        The model, in eval mode.

    Examples
    --------
    A checkpoint of a two-step training run (`fcaudit train --preset tiny --steps 2 --out DIR` writes the same):

    >>> import tempfile
    >>> from fcaudit.train import TrainConfig, train
    >>> run = tempfile.mkdtemp()
    >>> cfg = TrainConfig(model="featuregate", preset="tiny", steps=2,
    ...                   eval_windows=1, test_windows=1, out=run, progress=False)
    >>> _ = train(cfg)
    >>> model = fca.load(run, device="cpu")
    >>> type(model).__name__, model.fcaudit_meta["checkpoint"] == run
    ('FeatureGateGPT', True)

    A Hugging Face MoE spread over the GPUs (not run here: it needs the hub, GPUs and the `hf` extra):

    >>> moe = fca.load("mistralai/Mixtral-8x7B-v0.1",
    ...                dtype="bfloat16", device_map="auto")  # doctest: +SKIP
    """
    path = resolve(path_or_id, revision)
    placed = {} if device_map is None else {"device_map": device_map, "offload_folder": offload_folder}
    model, meta = load_model(path, device=resolve_device(device), dtype=None if dtype is None else as_dtype(dtype),
                             **placed)
    model.fcaudit_meta = {**meta, "checkpoint": str(path)}
    return model


def windows(corpus: str = "embedded", *, n_eval: int, n_calib: int, window: int, seed: int = 0, tokenizer=None):
    """Draw evaluation and calibration windows from a corpus, as `fcaudit audit` does.

    Non-overlapping windows, the evaluation ones from the corpus's test split, the calibration ones (the only
    ones static profiles are estimated on) from its validation split.

    Parameters
    ----------
    corpus
        "embedded" (byte-level text of the Python standard library's source, present wherever Python is), a
        local file or directory of text, "wikitext-103" or "openwebtext" (from the hub).
    n_eval, n_calib, window
        The numbers of evaluation and calibration windows, and the tokens per window.
    seed
        Which windows are drawn.
    tokenizer : tokenizers.Tokenizer or str or None
        None for byte-level models; else a `tokenizers.Tokenizer`, or a directory or hub id holding one.

    Returns
    -------
    tuple of fcaudit.data.WindowSet
        (evaluation, calibration); `.ids` is an int64 tensor [n, window] of each.

    Examples
    --------
    >>> eval_w, calib_w = fca.windows("embedded", n_eval=4, n_calib=4, window=16)
    >>> eval_w.ids.shape, eval_w.split, calib_w.split
    (torch.Size([4, 16]), 'test', 'validation')

    A tokenized model's windows take its tokenizer (not run here: both come from the hub):

    >>> eval_w, calib_w = fca.windows("wikitext-103", n_eval=64, n_calib=64, window=512,
    ...                               tokenizer="EleutherAI/pythia-1.4b")  # doctest: +SKIP
    """
    if None in (n_eval, n_calib, window):  # fcaudit audit takes None as "the model's own"; a corpus has none
        raise FcauditError(f"n_eval={n_eval}, n_calib={n_calib}, window={window}: pass a number for each, e.g. "
                           "window=512")
    AuditConfig(n_eval=n_eval, n_calib=n_calib, window=window, seed=seed)  # the bounds `fcaudit audit` has
    if isinstance(tokenizer, (str, os.PathLike)):
        tokenizer = load_tokenizer(tokenizer)
    elif tokenizer is not None and not callable(getattr(tokenizer, "encode_batch", None)):
        raise FcauditError(f"tokenizer={tokenizer!r:.40}: pass a tokenizers.Tokenizer, a directory or hub id holding "
                           "tokenizer.json, or None for a byte-level model")
    corp = data.load_corpus(corpus, tokenizer=tokenizer, splits=("validation", "test"))
    return data.audit_windows(corp, n_eval, n_calib, window, seed)
