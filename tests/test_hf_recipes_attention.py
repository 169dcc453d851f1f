"""Attention-side controllers of Hugging Face architectures audited with zero code (families/hf/recipes.py,
ATTENTION and UNAUDITED_ATTENTION): each model is built tiny from its transformers config here, saved with
save_pretrained, loaded back with fca.load and audited through fca.controller_for, the CLI for one of them."""

import json
from collections import Counter

import pytest
import torch

import transformers

import fcaudit as fca
from fcaudit.families.hf.find import recipe_sites
from harness import api_refusal, cli, ok

SMALL = dict(vocab_size=256, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
             head_dim=16, intermediate_size=64, max_position_embeddings=256, pad_token_id=None, bos_token_id=None,
             eos_token_id=None, tie_word_embeddings=False)
MOE = dict(num_experts_per_tok=2, moe_intermediate_size=32)
MLA = dict(q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=16)


def saved(tmp_path, config):
    """A randomly initialised (seeded) causal LM of `config`, saved as a checkpoint directory."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(tmp_path / "ckpt")
    return tmp_path / "ckpt"


def windows(n, seed):
    return torch.randint(0, 256, (n, 16), generator=torch.Generator().manual_seed(seed))


def sites(ctrl) -> Counter:
    """(kind, layout) -> how many sites."""
    return Counter((s.kind, getattr(s.codec, "given", None) or getattr(s.codec, "pattern", type(s.codec).__name__))
                   for s in ctrl.sites)


def audited(ckpt, tmp_path):
    """The checkpoint loaded as a user would, its controller found, and audited (4 + 4 windows of 16, R = 2)."""
    model = fca.load(ckpt, device="cpu")
    ctrl = fca.controller_for(model)
    res = fca.audit(model, ctrl, windows(4, 1), windows(4, 2), randomizations=2, out=tmp_path / "audit",
                    batch_size=4, quiet=True)
    assert res.replay.bit_equal and res.replay.max_abs_dlogit == 0.0
    return model, ctrl, res


def assert_input_dependent(model, ctrl):
    """Every site found by recipe gives different coefficients to different tokens of one window."""
    ids = windows(2, 3)
    with torch.no_grad(), ctrl.capture(*ids.shape) as found:
        model(ids)
    recipe = {s.path for _, s in recipe_sites(model)}
    for site, c in zip(ctrl.sites, found):
        if site.path in recipe:
            assert c.float().std(dim=1).max() > 0, site.name


def test_qwen3_next_output_gates_and_gated_delta_net_audit_from_the_cli_with_its_routers(tmp_path):
    config = transformers.Qwen3NextConfig(**SMALL, **MOE, num_experts=4, shared_expert_intermediate_size=32,
                                          linear_num_value_heads=2, linear_num_key_heads=2, linear_key_head_dim=16,
                                          linear_value_head_dim=16, layer_types=["linear_attention", "full_attention"])
    ckpt = saved(tmp_path, config)
    ok(cli("audit", ckpt, "--eval", 4, "--calib", 4, "--window", 16, "--randomizations", 2, "--batch-size", 4,
           "--quiet", "--device", "cpu", "--out", tmp_path / "a"))
    replay = json.loads((tmp_path / "a" / "replay.json").read_text())
    assert replay["passed"] and replay["max_abs_dlogit"] == 0.0
    model = fca.load(ckpt, device="cpu")
    ctrl = fca.controller_for(model)
    # the attention gate shares q_proj with the query: its sigmoid is the site; β and the decay's input come from
    # in_proj_ba; the output gate z shares in_proj_qkvz with q, k and v: SiLU(z) in the gated norm is the site
    gdn = "model.layers.0.linear_attn"
    assert {s.name for s in ctrl.sites if s.kind == "vector_gate"} == {f"{gdn}.in_proj_ba", f"{gdn}.norm:silu",
                                                                        "model.layers.1.self_attn:sigmoid"}
    assert sites(ctrl) == {("expert_router", "TopKRouterCodec"): 2, ("scalar_gate", "SharedGateCodec"): 2,
                           ("vector_gate", "batch token channel"): 2, ("vector_gate", "(batch token head) channel"): 1}
    assert ctrl.notes == () and len({s.group for s in ctrl.sites if s.path.startswith(gdn)}) == 1
    assert_input_dependent(model, ctrl)
    assert_silu_of_z_per_token(model, ctrl, gdn)


def assert_silu_of_z_per_token(model, ctrl, gdn):
    """The gated norm's site holds SiLU(z) of each (window, token) in its place, heads side by side: the norm sees it
    flattened over batch, token and head, so a wrong axis order would move coefficients between tokens."""
    ids, layer, seen = windows(2, 4), model.get_submodule(gdn), []
    hook = layer.register_forward_pre_hook(lambda m, args, kw: seen.append(kw["hidden_states"]), with_kwargs=True)
    with torch.no_grad(), ctrl.capture(*ids.shape) as found:
        model(ids)
    hook.remove()
    with torch.no_grad():
        z = layer.fix_query_key_value_ordering(layer.in_proj_qkvz(seen[0]), layer.in_proj_ba(seen[0]))[3]
    got = found[[s.name for s in ctrl.sites].index(f"{gdn}.norm:silu")]
    assert got.shape == (2, 16, 1, 32)
    torch.testing.assert_close(got[:, :, 0], torch.nn.functional.silu(z.float()).reshape(2, 16, 32), rtol=0, atol=1e-6)


def test_qwen3_5_gated_delta_net_beta_decay_and_output_gate_are_projections_of_their_own(tmp_path):
    config = transformers.Qwen3_5TextConfig(**SMALL, linear_num_value_heads=2, linear_num_key_heads=2,
                                            linear_key_head_dim=16, linear_value_head_dim=8,
                                            layer_types=["linear_attention", "full_attention"])
    model, ctrl, res = audited(saved(tmp_path, config), tmp_path)
    gdn = [f"model.layers.0.linear_attn.in_proj_{x}" for x in "baz"]
    assert [s.name for s in ctrl.sites] == [*gdn, "model.layers.1.self_attn:sigmoid"]
    assert sites(ctrl) == {("vector_gate", "batch token head"): 2, ("vector_gate", "batch token channel"): 2}
    assert res.notices == () and ctrl.notes == ()
    assert_input_dependent(model, ctrl)


def test_minimax_output_gate_is_its_own_projection(tmp_path):
    config = transformers.MiniMaxConfig(**SMALL, **MOE, num_local_experts=4,
                                        layer_types=["full_attention", "linear_attention"])
    model, ctrl, res = audited(saved(tmp_path, config), tmp_path)
    assert [s.name for s in ctrl.sites if s.kind == "vector_gate"] == ["model.layers.1.self_attn.output_gate"]
    assert sites(ctrl) == {("expert_router", "TopKRouterCodec"): 2, ("vector_gate", "batch token channel"): 1}
    assert_input_dependent(model, ctrl)


def test_kimi_delta_attention_forget_gate_beta_and_output_gate(tmp_path):
    config = transformers.KimiLinearConfig(**SMALL, **MOE, num_local_experts=4, **MLA, linear_head_dim=8,
                                           linear_num_heads=2, layer_types=["linear_attention", "full_attention"])
    model, ctrl, res = audited(saved(tmp_path, config), tmp_path)
    assert sites(ctrl) == {("expert_router", "TopKRouterCodec"): 1, ("vector_gate", "batch token (head channel)"): 1,
                           ("vector_gate", "batch token head"): 1, ("vector_gate", "batch token channel"): 1}
    assert "model.layers.0.self_attn.forget_gate" in {s.name for s in ctrl.sites}
    assert_input_dependent(model, ctrl)


def test_gemma3n_altup_prediction_and_correction_coefficients(tmp_path):
    config = transformers.Gemma3nTextConfig(**SMALL | dict(intermediate_size=[64, 64]), num_kv_shared_layers=0,
                                            layer_types=["sliding_attention", "full_attention"], laurel_rank=4,
                                            vocab_size_per_layer_input=256, hidden_size_per_layer_input=8,
                                            activation_sparsity_pattern=[0.0, 0.0])
    model, ctrl, res = audited(saved(tmp_path, config), tmp_path)
    assert [s.name for s in ctrl.sites] == [f"model.layers.{i}.altup.{c}_coefs" for i in (0, 1)
                                            for c in ("prediction", "correction")]
    assert sites(ctrl) == {("vector_gate", "batch token channel"): 4}
    assert_input_dependent(model, ctrl)


def test_hy_v4_hyper_connections_are_source_mixtures_and_its_indexer_is_named(tmp_path):
    config = transformers.HYV4Config(**SMALL, **MOE, n_routed_experts=4, n_group=1, topk_group=1, **MLA,
                                     index_topk=8, index_head_dim=16, index_n_heads=2)
    model, ctrl, res = audited(saved(tmp_path, config), tmp_path)
    # per layer two hyper-connections (pre: a mixture over the streams, post: a weight per stream), one head
    assert sites(ctrl) == {("expert_router", "TopKRouterCodec"): 1, ("source_mixture", "batch token source"): 5,
                           ("vector_gate", "batch token channel"): 6}
    assert sum("not audited: 2 HYV4Indexer" in line and "key selection" in line for line in res.notices) == 1
    assert_input_dependent(model, ctrl)


def test_a_sparse_attention_indexer_is_named_in_a_notice_and_its_routers_audit(tmp_path):
    config = transformers.DeepseekV32Config(**SMALL, **MOE, n_routed_experts=4, n_group=1, topk_group=1,
                                            first_k_dense_replace=0, **MLA, index_topk=8, index_head_dim=16,
                                            index_n_heads=2)
    model, ctrl, res = audited(saved(tmp_path, config), tmp_path)
    assert sites(ctrl) == {("expert_router", "TopKRouterCodec"): 2}
    assert ctrl.notes == ("not audited: 2 DeepseekV32Indexer (model.layers.0.self_attn.indexer, ...): sparse-attention "
                          "key selection (an indexer's top-k picks each query's keys): fcaudit has no kind for key "
                          "selection yet",)
    assert sum(line == ctrl.notes[0] for line in res.notices) == 1


def test_an_output_gate_the_config_turns_off_is_no_site():
    on, off = (transformers.Lfm3Config(**SMALL, layer_types=["full_attention", "full_attention"],
                                       use_attention_gate=g) for g in (True, False))
    torch.manual_seed(0)
    gated = transformers.AutoModelForCausalLM.from_config(on).eval()
    assert [s.name for _, s in recipe_sites(gated)] == [f"model.layers.{i}.self_attn.g_proj" for i in (0, 1)]
    plain = transformers.AutoModelForCausalLM.from_config(off).eval()
    assert "no controller fcaudit finds" in api_refusal(lambda: fca.controller_for(plain))
