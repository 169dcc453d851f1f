"""The Hugging Face MoE family: transformers (>= 5) mixture-of-experts LMs audited as they are (Mixtral, OLMoE,
Qwen2-MoE, Qwen3-MoE, DeepSeek-V3, GPT-OSS, Llama 4 and any router with the same structure, see discover.py and
benchmarks/moe_families.py). Coefficient semantics: codecs.py.
`fcaudit train --model moe` trains a byte-level Mixtral (tiny.py); transformers is the optional extra fcaudit[hf].
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch
from torch import nn

from fcaudit.families import Family, register
from fcaudit.families.hf_moe.codecs import ScoreRouterCodec, SharedGateCodec, TopKRouterCodec
from fcaudit.families.hf_moe.discover import ensure_eager_experts, is_moe, moe_controller
from fcaudit.families.hf_moe.execution import expert_execution
from fcaudit.families.hf_moe.load import load_hf_moe, looks_like_hf_moe, require_transformers
from fcaudit.families.hf_moe.tiny import BYTE_PRESETS, byte_mixtral_config


def _is_hf_moe(model: nn.Module) -> bool:
    return type(model).__module__.startswith("transformers.") and is_moe(model)


def _load(dir: Path, device: torch.device, dtype: torch.dtype | None, **placed) -> tuple[nn.Module, dict]:
    model = load_hf_moe(dir, dtype=dtype, device=device, **placed)
    c = model.config
    return model, {"model_type": c.model_type, "variant": f"moe-{c.model_type}"}


def _build(cfg) -> nn.Module:
    require_transformers("training a Hugging Face MoE model (--model moe)")
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(byte_mixtral_config(cfg.preset, output_router_logits=True))


def _train_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The language-modelling loss plus the family's load-balancing loss (router_aux_loss_coef), as in training."""
    return model(input_ids=ids, labels=ids, output_router_logits=True).loss


def _save(model: nn.Module, out: Path, meta: dict) -> None:
    """save_pretrained into a temp directory, then each file moved into place: weights first, config.json last."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model.config.output_router_logits = False  # audits and evaluation use the LM output only
    with tempfile.TemporaryDirectory(dir=out, prefix=".save-") as tmp:
        model.save_pretrained(tmp)
        for f in sorted(Path(tmp).iterdir(), key=lambda p: p.name == "config.json"):
            os.replace(f, out / f.name)


def _execution(model: nn.Module, ids: torch.Tensor, controller=None, coefficients=None) -> dict:
    """Experts run per token and expert FLOPs per token (measured) against running every expert, for the live
    router or, with `coefficients`, replayed ones."""
    return expert_execution(model, ids, controller, coefficients).summary()


register(Family(
    name="hf_moe",
    accepts=looks_like_hf_moe,
    load=_load,
    matches=_is_hf_moe,
    controller=moe_controller,
    label=lambda model: f"moe-{model.config.model_type}",
    trains=("moe",),
    presets=tuple(BYTE_PRESETS),
    build=_build,
    save=_save,
    train_loss=_train_loss,
    execution=_execution,
    device_maps=True,
))

__all__ = ["TopKRouterCodec", "ScoreRouterCodec", "SharedGateCodec", "moe_controller", "ensure_eager_experts",
           "load_hf_moe", "looks_like_hf_moe", "require_transformers"]
