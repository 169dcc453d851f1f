"""The Hugging Face family: transformers (>= 5) causal LMs audited as they are. MoE routers are found by structure
(discover.py, their coefficients in codecs.py), every other controller by its module class's recipe (recipes.py,
find.py); benchmarks/hf_zoo.py audits every architecture transformers ships. `fcaudit train --model moe` trains a
byte-level Mixtral (tiny.py). transformers is the optional extra fcaudit[hf].
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch
from torch import nn

from fcaudit.families import Family, register
from fcaudit.families.hf.codecs import ScoreRouterCodec, SharedGateCodec, TopKRouterCodec
from fcaudit.families.hf.discover import ensure_eager_experts, is_moe, moe_controller
from fcaudit.families.hf.find import hf_controller, is_hf
from fcaudit.families.hf.execution import expert_execution
from fcaudit.families.hf.load import load_hf, looks_like_hf, looks_like_hf_moe, require_transformers
from fcaudit.families.hf.tiny import BYTE_PRESETS, byte_mixtral_config


def _label(model: nn.Module) -> str:
    """Its model_type (its class name where it has none), "moe-" before it where it holds MoE routers."""
    return ("moe-" if is_moe(model) else "") + (getattr(getattr(model, "config", None), "model_type", None)
                                                or type(model).__name__)


def _load(dir: Path, device: torch.device, dtype: torch.dtype | None, **placed) -> tuple[nn.Module, dict]:
    model = load_hf(dir, dtype=dtype, device=device, **placed)
    return model, {"model_type": model.config.model_type, "variant": _label(model)}


def _build(cfg) -> nn.Module:
    require_transformers("training a Hugging Face MoE model (--model moe)")
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(byte_mixtral_config(cfg.preset, output_router_logits=True))


def _save(model: nn.Module, out: Path, meta: dict) -> None:
    """save_pretrained into a temp directory, then each file moved into place: weights first, config.json last."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model.config.output_router_logits = False  # audits and evaluation use the LM output only
    with tempfile.TemporaryDirectory(dir=out, prefix=".save-") as tmp:
        model.save_pretrained(tmp)
        for f in sorted(Path(tmp).iterdir(), key=lambda p: p.name == "config.json"):
            os.replace(f, out / f.name)


register(Family(
    name="hf",
    accepts=looks_like_hf,
    load=_load,
    # by structure, whatever the class's module: a checkpoint's own code (transformers_modules...) or a user's
    matches=is_hf,
    controller=hf_controller,
    label=_label,
    trains=("moe",),
    presets=tuple(BYTE_PRESETS),
    build=_build,
    save=_save,
    # the language-modelling loss plus the load-balancing loss (router_aux_loss_coef), as in training
    train_loss=lambda model, ids: model(input_ids=ids, labels=ids, output_router_logits=True).loss,
    # experts run and expert FLOPs per token against running every expert, live or with coefficients replayed
    execution=lambda model, ids, controller=None, coefficients=None: expert_execution(
        model, ids, controller, coefficients).summary() if is_moe(model) else {},
    device_maps=True,
))

__all__ = ["TopKRouterCodec", "ScoreRouterCodec", "SharedGateCodec", "hf_controller", "moe_controller",
           "ensure_eager_experts", "load_hf", "looks_like_hf", "looks_like_hf_moe", "require_transformers"]
