"""Hugging Face transformers (>= 5) MoE models audited as they are: Mixtral, OLMoE, Qwen2-MoE, Qwen3-MoE and
any router with the same structure (see discover.py). Coefficient semantics: codecs.py."""

from fcaudit.families.hf_moe.codecs import SharedGateCodec, TopKRouterCodec
from fcaudit.families.hf_moe.discover import (MoeAdapter, MoeSite, ensure_eager_experts, find_routers, moe_adapter,
                                              moe_controller)
from fcaudit.families.hf_moe.load import load_hf_moe, looks_like_hf_moe, require_transformers

__all__ = ["TopKRouterCodec", "SharedGateCodec", "MoeSite", "MoeAdapter", "find_routers", "moe_adapter",
           "moe_controller", "ensure_eager_experts", "load_hf_moe", "looks_like_hf_moe", "require_transformers"]
