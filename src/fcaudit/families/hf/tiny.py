"""Tiny Hugging Face MoE models built from configs (no download): tests, benchmarks and the byte-level demo. Each
keeps its family's router semantics (Mixtral and Qwen3-MoE renormalize the top-k weights, OLMoE and Qwen2-MoE do not,
as released; DeepSeek-V3 picks by sigmoid within groups; GPT-OSS's experts cannot skip a slot; Llama 4 scores).
"""

from __future__ import annotations

import torch

from fcaudit.errors import FcauditError
from fcaudit.families.hf.load import require_transformers

FAMILIES = ("mixtral", "olmoe", "qwen2_moe", "qwen3_moe", "deepseek_v3", "gpt_oss")  # (logits, weights, index)
SCORE_FAMILIES = ("llama4",)  # routers returning (scores, logits): ScoreRouterCodec


def tiny_moe_config(family: str, *, vocab_size: int = 256, hidden_size: int = 64, layers: int = 2, heads: int = 4,
                    experts: int = 4, top_k: int = 2, intermediate_size: int = 64, max_positions: int = 512, **overrides):
    """A transformers config of one family at toy size, experts running the eager implementation."""
    transformers = require_transformers()
    width, head_dim, groups = intermediate_size, hidden_size // heads, max(1, experts // 2)
    rope = lambda theta: {"rope_type": "default", "rope_theta": theta}  # noqa: E731
    own = {
        "mixtral": ("MixtralConfig", dict(num_local_experts=experts)),
        "olmoe": ("OlmoeConfig", dict(num_experts=experts, norm_topk_prob=False)),
        "qwen2_moe": ("Qwen2MoeConfig", dict(num_experts=experts, moe_intermediate_size=width,
                                             shared_expert_intermediate_size=width, norm_topk_prob=False)),
        "qwen3_moe": ("Qwen3MoeConfig", dict(num_experts=experts, moe_intermediate_size=width, head_dim=head_dim,
                                             norm_topk_prob=True)),
        # two experts per group: the router ranks a group by its best two
        "deepseek_v3": ("DeepseekV3Config", dict(n_routed_experts=experts, moe_intermediate_size=width,
                                                 n_shared_experts=1, first_k_dense_replace=0, n_group=groups,
                                                 topk_group=max(1, groups // 2), kv_lora_rank=16, q_lora_rank=16,
                                                 qk_rope_head_dim=8, qk_nope_head_dim=head_dim - 8,
                                                 v_head_dim=head_dim, rope_parameters=rope(10000.0))),
        "gpt_oss": ("GptOssConfig", dict(num_local_experts=experts, head_dim=head_dim, rope_parameters=rope(150000.0))),
        "llama4": ("Llama4TextConfig", dict(num_local_experts=experts, intermediate_size_mlp=width, head_dim=head_dim)),
    }
    if family not in own:
        raise FcauditError(f"unknown tiny MoE family {family!r}; use one of {', '.join(FAMILIES + SCORE_FAMILIES)}")
    common = dict(vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=layers, num_attention_heads=heads,
                  num_key_value_heads=heads, max_position_embeddings=max_positions, num_experts_per_tok=top_k,
                  intermediate_size=width, bos_token_id=None, eos_token_id=None, pad_token_id=None,
                  tie_word_embeddings=False, experts_implementation="eager")
    cls, extra = own[family]
    return getattr(transformers, cls)(**{**common, **extra, **overrides})


def tiny_moe(family: str, *, seed: int = 0, dtype: torch.dtype = torch.float32, **config):
    """A randomly initialized (seeded) causal LM of one MoE family, in eval mode. See tiny_moe_config."""
    from transformers import AutoModelForCausalLM

    cfg = tiny_moe_config(family, **config)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg)
    return model.to(dtype).eval()


# `fcaudit train --model moe --preset P`: byte-level Mixtrals (256-token vocabulary, ids are UTF-8 bytes), sized like
# the FeatureGate presets of the same name (context, depth, width): tiny for tests, demo for `fcaudit demo`.
BYTE_PRESETS = {
    "tiny": dict(hidden_size=32, layers=2, heads=2, experts=4, top_k=2, intermediate_size=64, max_positions=64),
    "demo": dict(hidden_size=96, layers=4, heads=4, experts=8, top_k=2, intermediate_size=192, max_positions=128),
}


def byte_mixtral_config(preset: str = "demo", **overrides):
    """A byte-level Mixtral config of one preset (BYTE_PRESETS), with overrides."""
    if preset not in BYTE_PRESETS:
        raise FcauditError(f"no byte-level MoE preset {preset!r}: use one of {', '.join(BYTE_PRESETS)}")
    return tiny_moe_config("mixtral", **{**BYTE_PRESETS[preset], **overrides})
