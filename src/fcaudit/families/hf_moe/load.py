"""Loading Hugging Face MoE checkpoints (config.json + safetensors [+ tokenizer]) with transformers, an optional
extra: `pip install 'fcaudit[hf]'`."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from fcaudit.errors import FcauditError

MIN_TRANSFORMERS = 5  # the MoE refactor: routers return (logits, top-k weights, top-k index), experts as 3-D weights


def require_transformers():
    """The transformers module, or a one-line error naming the install command."""
    try:
        import transformers
    except ImportError:
        raise FcauditError("auditing Hugging Face MoE models needs transformers: pip install 'fcaudit[hf]'") from None
    transformers.utils.logging.disable_progress_bar()  # fcaudit shows its own progress
    major = int(transformers.__version__.split(".")[0])
    if major < MIN_TRANSFORMERS:
        raise FcauditError(f"transformers {transformers.__version__} is too old for MoE audits (needs >= "
                           f"{MIN_TRANSFORMERS}): pip install -U 'fcaudit[hf]'")
    return transformers


def looks_like_hf_moe(config: dict) -> bool:
    """Whether a config.json describes a transformers MoE model (top-k routing over several experts)."""
    experts = next((config[k] for k in ("num_experts", "num_local_experts", "n_routed_experts") if k in config), None)
    return isinstance(config.get("model_type"), str) and bool(config.get("num_experts_per_tok")) and bool(experts)


def load_hf_moe(path_or_id: str | os.PathLike, *, dtype: torch.dtype | None = None, device: str | torch.device = "cpu",
                revision: str | None = None):
    """(model in eval mode with eager experts, tokenizer or None for byte-level checkpoints) from a checkpoint
    directory or hub id. A hub id offline fails in seconds (fcaudit.hub) unless it is in the local cache."""
    require_transformers()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fcaudit.hub import resolve

    dir = resolve(path_or_id, revision)
    if not (dir / "config.json").is_file():
        raise FcauditError(f"{dir} has no config.json: pass a Hugging Face checkpoint directory (config.json + safetensors)")
    try:
        model = AutoModelForCausalLM.from_pretrained(dir, dtype=dtype if dtype is not None else "auto",
                                                     experts_implementation="eager")
    except (OSError, ValueError, KeyError) as e:
        msg = " ".join(str(e).split())[:160]
        raise FcauditError(f"transformers cannot load {dir} ({type(e).__name__}: {msg}): pass a complete checkpoint "
                           f"directory of a transformers>=5 MoE model") from None
    tokenizer = AutoTokenizer.from_pretrained(dir) if _has_tokenizer(dir) else None
    return model.to(device).eval(), tokenizer


def _has_tokenizer(dir: Path) -> bool:
    return any((dir / n).is_file() for n in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))
