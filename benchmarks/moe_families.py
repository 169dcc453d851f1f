"""Which transformers MoE families fcaudit audits: a tiny random model of each, built from its config, through
`fca.controller_for` and a whole `fca.audit` (4 + 4 windows of 16 tokens, R = 2). Prints one line per family: its
router class, the padding its experts take, and whether the exact replay held, or the one-line error it got.

The tested families (tiny.FAMILIES, tiny.SCORE_FAMILIES) are in tests/test_hf_moe.py; this adds others that
transformers ships.
Usage: python benchmarks/moe_families.py [--families glm4_moe dots1 ...]
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import warnings

import torch
import transformers

import fcaudit as fca
from fcaudit.errors import FcauditError
from fcaudit.families.hf import moe_controller
from fcaudit.families.hf.tiny import FAMILIES, SCORE_FAMILIES, tiny_moe

COMMON = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=4, max_position_embeddings=64, bos_token_id=None, eos_token_id=None,
              pad_token_id=None)
GROUPED = dict(moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
               first_k_dense_replace=0, n_shared_experts=1, head_dim=8)
# family: (config class, what differs from COMMON)
OTHERS = {
    "glm4_moe": ("Glm4MoeConfig", GROUPED),
    "dots1": ("Dots1Config", GROUPED),
    "granitemoe": ("GraniteMoeConfig", dict(num_local_experts=8, num_experts_per_tok=2)),
    "phimoe": ("PhimoeConfig", dict(num_local_experts=8, num_experts_per_tok=2)),
    "ernie4_5_moe": ("Ernie4_5_MoeConfig", dict(moe_intermediate_size=32, moe_num_experts=8, moe_k=2,
                                                moe_layer_start_index=0)),
    "hunyuan_v1_moe": ("HunYuanMoEV1Config", dict(num_experts=8, moe_topk=2, head_dim=8)),
    "minimax": ("MiniMaxConfig", dict(num_local_experts=8, num_experts_per_tok=2, head_dim=8,
                                      layer_types=["full_attention", "full_attention"])),
    "qwen3_next": ("Qwen3NextConfig", dict(num_hidden_layers=4, num_experts=8, num_experts_per_tok=2,
                                           moe_intermediate_size=32, shared_expert_intermediate_size=32, head_dim=8)),
    "deepseek_v2": ("DeepseekV2Config", dict(moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
                                             first_k_dense_replace=0, n_shared_experts=1, kv_lora_rank=16,
                                             q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8)),
    "flex_olmo": ("FlexOlmoConfig", dict(num_experts=8, num_experts_per_tok=2)),
    "jamba": ("JambaConfig", dict(num_experts=8, num_experts_per_tok=2, expert_layer_period=1, expert_layer_offset=0,
                                  attn_layer_period=1, attn_layer_offset=0, use_mamba_kernels=False)),
    # 8 experts and 2 zero-computation (identity) ones
    "longcat_flash": ("LongcatFlashConfig", dict(hidden_size=64, n_routed_experts=8, zero_expert_num=2, moe_topk=2,
                                                 num_layers=2, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=32,
                                                 head_dim=32, qk_nope_head_dim=8, v_head_dim=16, ffn_hidden_size=64,
                                                 expert_ffn_hidden_size=32)),
    # routers that say neither top-k nor expert count (Gemma-4 reads its config), or only top-k (Ergo)
    "gemma4": ("Gemma4TextConfig", dict(num_experts=8, top_k_experts=2, enable_moe_block=True, moe_intermediate_size=32,
                                        head_dim=8, global_head_dim=8, hidden_size_per_layer_input=0)),
    "ergo": ("ErgoConfig", dict(num_experts=8, num_experts_per_tok=2)),
    "jetmoe": ("JetMoeConfig", dict(num_local_experts=8, num_experts_per_tok=2, kv_channels=8)),
    # a router that hands a state to the next layer's router, and a skip expert
    "zaya": ("ZayaConfig", dict(num_experts=8, num_experts_per_tok=1, moe_intermediate_size=32, head_dim=8,
                                sliding_window=64, layer_types=["hybrid", "hybrid"])),
    "dbrx": ("DbrxConfig", dict(d_model=32, n_heads=4, n_layers=2, max_seq_len=64,
                                attn_config={"kv_n_heads": 4, "rope_theta": 10000.0, "clip_qkv": 8.0},  # None: clamp fails
                                ffn_config={"moe_num_experts": 8, "moe_top_k": 2, "ffn_hidden_size": 64})),
}


def build(family: str) -> torch.nn.Module:
    if family in FAMILIES + SCORE_FAMILIES:
        return tiny_moe(family, vocab_size=64, hidden_size=32, experts=8, top_k=2)
    cls, extra = OTHERS[family]
    torch.manual_seed(0)
    cfg = getattr(transformers, cls)(**{**COMMON, **extra})
    return transformers.AutoModelForCausalLM.from_config(cfg).eval()


def audit(family: str) -> str:
    model = build(family)
    try:
        ctrl = moe_controller(model)
    except FcauditError as e:
        return f"not audited: {e}"
    g = torch.Generator().manual_seed(0)
    ev, ca = torch.randint(0, 64, (4, 16), generator=g), torch.randint(0, 64, (4, 16), generator=g)
    with tempfile.TemporaryDirectory() as out:
        res = fca.audit(model, ctrl, ev, ca, randomizations=2, out=out, batch_size=2, quiet=True)
    routers = [s for s in ctrl.sites if s.codec.top_k is not None]
    router = type(routers[0].module).__name__
    pads = sorted({getattr(s.codec, "pad", "none (scores)") for s in routers})
    sites = f"{len(ctrl.sites)} site" + "s" * (len(ctrl.sites) != 1)
    return (f"audited: {sites} ({router}), padding {'/'.join(pads)}, exact replay "
            f"{res.replay.bit_equal}, route flips {res.replay.route_flips}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--families", nargs="+", default=[*FAMILIES, *SCORE_FAMILIES, *OTHERS])
    args = p.parse_args()
    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    logging.disable(logging.WARNING)  # transformers' notes on kernels it falls back from
    print(f"transformers {transformers.__version__}, torch {torch.__version__}")
    for family in args.families:
        print(f"{family:15s} {audit(family)}", flush=True)


if __name__ == "__main__":
    main()
