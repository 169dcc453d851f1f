"""Hugging Face MoE leftovers: routers of other shapes, encoder-decoder MoEs through their decoder, zero-initialised
routers, and the merge of an op site with a site nested in the module it watches. Tiny models built here from
transformers configs (or plain torch), real forward passes, exact replay asserted."""

import tempfile

import torch
from torch import nn

import transformers

import fcaudit as fca
from fcaudit.families.hf import hf_controller, moe_controller
from fcaudit.families.hf.codecs import SwitchRoute
from fcaudit.families.hf.seq2seq import DecoderLM

from harness import api_refusal, cli, refusal


def small(cls, **extra):
    """A transformers config at toy size: 2 layers, width 32, 8 experts, top-2, no special tokens."""
    base = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=4, max_position_embeddings=64, bos_token_id=None, eos_token_id=None,
                pad_token_id=None)
    return cls(**{**base, **extra})


def causal_lm(config, seed=0):
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def windows(n=4, length=12, vocab=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n, length), generator=g), torch.randint(0, vocab, (n, length), generator=g)


def audited(model, controller, **kw):
    ev, ca = windows(**kw)
    with tempfile.TemporaryDirectory() as out:
        return fca.audit(model, controller, ev, ca, randomizations=2, out=out, batch_size=2, quiet=True)


def notices(result) -> str:
    return " ".join(f.line for f in result.replay.findings if f.line)


# ---- zero-initialised routers -------------------------------------------------------------------------------------

def test_a_router_whose_weights_are_all_zero_gets_the_constant_coefficients_notice():
    model = causal_lm(small(transformers.MixtralConfig, num_local_experts=8, num_experts_per_tok=2))
    live = audited(model, moe_controller(model))
    assert live.replay.bit_equal and "the same for every window and token" not in notices(live)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.zero_()
    dead = audited(model, moe_controller(model))
    assert dead.replay.bit_equal
    assert "the same for every window and token" in notices(dead)


# ---- an op site numbered across a nested site ---------------------------------------------------------------------

class Squash(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.proj = nn.Linear(d, d)

    def forward(self, x):
        return torch.sigmoid(self.proj(x))


class GatedBlock(nn.Module):
    """Three sigmoid gates; the middle one computed by a submodule."""

    def __init__(self, d):
        super().__init__()
        self.a, self.b, self.mid, self.ff = nn.Linear(d, d), nn.Linear(d, d), Squash(d), nn.Linear(d, d)

    def forward(self, x):
        first = torch.sigmoid(self.a(x))
        middle = self.mid(x)
        last = torch.sigmoid(self.b(x))
        return x + self.ff(x) * first * middle * last


class GatedLM(nn.Module):
    def __init__(self, vocab=64, d=16):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList([GatedBlock(d) for _ in range(2)])
        self.head = nn.Linear(d, vocab)

    def forward(self, ids):
        h = self.emb(ids)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def test_merge_refuses_an_op_site_numbered_across_a_nested_module_site():
    torch.manual_seed(0)
    model = GatedLM().eval()
    last = fca.Controller.from_ops(model, "blocks.*", "sigmoid", layout="batch token channel", call=2)
    mids = fca.Controller.from_modules(model, "blocks.*.mid", layout="batch token channel")
    line = api_refusal(lambda: fca.Controller.merge(last, mids))
    assert "blocks.0:sigmoid[call=2]" in line and "blocks.0.mid" in line and "separate controllers" in line
    # the same op site alone, and a numbered op site beside a module outside its module, audit exactly
    assert audited(model, last).replay.bit_equal
    heads = fca.Controller.from_modules(model, "head", layout="batch token channel")
    assert audited(model, fca.Controller.merge(last, heads)).replay.bit_equal


# ---- encoder-decoder MoEs, through their decoder ------------------------------------------------------------------

def switch(capacity):
    """A 2 + 2 layer Switch Transformer, every FF layer sparse: 4 experts of `capacity` tokens per window."""
    config = transformers.SwitchTransformersConfig(
        vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4, num_experts=4,
        expert_capacity=capacity, encoder_sparse_step=1, decoder_sparse_step=1, decoder_start_token_id=0,
        pad_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    return transformers.SwitchTransformersForConditionalGeneration(config).eval()


def test_a_switch_transformer_audits_exactly_through_its_decoder_with_its_encoder_input_given(tmp_path):
    model = switch(capacity=2)  # 12-token windows over 4 experts: the capacity drops tokens
    lm = DecoderLM(model, encoder_ids=torch.arange(2, 14))
    ctrl = fca.Controller.from_modules(lm, "model.decoder.**.router", codec=SwitchRoute(4, 2))
    assert [s.path for s in ctrl.sites] == [f"model.decoder.block.{i}.layer.2.mlp.router" for i in (0, 1)]
    with torch.no_grad():  # the capacity drops tokens of these windows: its rule is part of what replays
        dispatch, probs, _ = model.decoder.block[0].layer[2].mlp.router(torch.randn(4, 12, 32))
    assert (dispatch.sum(-1) == 0).any() and (probs > 0).all()
    ev, ca = windows()
    result = fca.audit(lm, ctrl, ev, ca, randomizations=2, out=tmp_path / "audit", batch_size=2, quiet=True)
    assert result.replay.bit_equal and result.replay.route_flips == 0
    conditions = set(result.records.condition)
    assert "StaticTopK" in conditions and len(conditions) > 2
    assert not {"StaticProfile", "LayerPositionMean"} & conditions
    assert "not offered for Switch routers" in notices(result)
    assert "(Correct runs" in result.capacity_lines()[0] and ", drops " in result.capacity_lines()[0]


def test_the_cli_refuses_an_encoder_decoder_checkpoint_naming_the_decoder_route(tmp_path):
    switch(capacity=8).save_pretrained(tmp_path / "switch")
    line = refusal(cli("audit", tmp_path / "switch", "--out", tmp_path / "audit"))
    assert "encoder-decoder" in line and "DecoderLM" in line and "SwitchRoute" in line


# ---- routers of other shapes: grouped (JetMoE), with a state for the next router (Zaya) ---------------------------

def test_jetmoe_grouped_routers_audit_exactly_and_its_attention_experts_are_named_as_not_audited():
    model = causal_lm(small(transformers.JetMoeConfig, num_local_experts=8, num_experts_per_tok=2, kv_channels=8))
    ctrl = hf_controller(model)
    assert [s.path for s in ctrl.sites] == [f"model.layers.{i}.mlp.router" for i in (0, 1)]
    assert ctrl.sites[0].codec.top_k == 2
    assert any("JetMoeMoA" in n and "self_attention.experts.router" in n for n in ctrl.notes)
    result = audited(model, ctrl)
    assert result.replay.bit_equal and result.replay.route_flips == 0


def test_zaya_routers_that_hand_a_state_to_the_next_router_audit_exactly():
    config = small(transformers.ZayaConfig, num_experts=8, num_experts_per_tok=1, moe_intermediate_size=32,
                   head_dim=8, sliding_window=64, layer_types=["hybrid", "hybrid"])
    model = causal_lm(config)
    ctrl = moe_controller(model)
    assert [s.path for s in ctrl.sites] == [f"model.layers.{i}.mlp.gate" for i in (0, 1)]
    result = audited(model, ctrl)
    assert result.replay.bit_equal and result.replay.route_flips == 0


class StateRouter(nn.Module):
    """Top-k routing that also returns a state (its projected input)."""

    def __init__(self, d, n_experts, k):
        super().__init__()
        self.top_k, self.num_experts = k, n_experts
        self.weight = nn.Parameter(torch.randn(n_experts, d) / d ** 0.5)
        self.state = nn.Linear(d, d)

    def forward(self, x):
        logits = x @ self.weight.T
        w, idx = logits.softmax(-1).topk(self.top_k, dim=-1)
        return logits, w / w.sum(-1, keepdim=True), idx, self.state(x)


class Experts(nn.Module):
    def __init__(self, d, n_experts):
        super().__init__()
        self.num_experts = n_experts
        self.w = nn.Parameter(torch.randn(n_experts, d, d) / d ** 0.5)

    def forward(self, x, idx, w):
        out = torch.zeros_like(x)
        for e in range(self.num_experts):
            rows, slot = torch.where(idx == e)
            out.index_add_(0, rows, (x[rows] @ self.w[e]) * w[rows, slot, None])
        return out


class LeakyMoE(nn.Module):
    """An MoE block whose router's state reaches the residual stream: the state is part of the value path."""

    def __init__(self, d, n_experts=4, k=2):
        super().__init__()
        self.router, self.experts = StateRouter(d, n_experts, k), Experts(d, n_experts)

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        _, w, idx, state = self.router(flat)
        return x + (self.experts(flat, idx, w) + 0.1 * state).reshape(x.shape)


class LeakyLM(nn.Module):
    def __init__(self, vocab=64, d=16):
        super().__init__()
        self.emb, self.blocks, self.head = nn.Embedding(vocab, d), nn.ModuleList([LeakyMoE(d), LeakyMoE(d)]), \
            nn.Linear(d, vocab)

    def forward(self, ids):
        h = self.emb(ids)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def test_a_router_state_that_reaches_the_value_path_is_refused_in_one_line():
    torch.manual_seed(0)
    line = api_refusal(lambda: moe_controller(LeakyLM().eval()))
    assert "StateRouter" in line and "state beside its choices" in line and "from_modules" in line


# ---- DeepSeek-V4: hash routers (experts picked by a table of token ids) ------------------------------------------

def deepseek_v4():
    """One hash-routed MoE layer, then one learned top-k layer; the hash table is all zeros, as before a checkpoint."""
    return causal_lm(small(transformers.DeepseekV4Config, num_local_experts=8, num_experts_per_tok=2,
                           mlp_layer_types=["hash_moe", "moe"]))


def test_a_hash_router_that_names_one_expert_twice_is_named_and_the_learned_router_audited_exactly():
    model = deepseek_v4()
    controller = moe_controller(model)
    assert [s.path for s in controller.sites] == ["model.layers.1.mlp.gate"]
    assert any("DeepseekV4HashRouter" in n and "model.layers.0.mlp.gate" in n and "two slots" in n
               for n in controller.notes)
    result = audited(model, controller, n=2, length=6)
    assert result.replay.bit_equal
    assert "DeepseekV4HashRouter" in notices(result)


def test_a_hash_router_whose_table_names_distinct_experts_is_audited_exactly():
    model = deepseek_v4()
    table = model.model.layers[0].mlp.gate.tid2eid
    tokens = torch.arange(table.shape[0])
    table.copy_(torch.stack([tokens % 8, (tokens + 1 + tokens // 8 % 7) % 8], 1))  # two distinct experts per token
    controller = moe_controller(model)
    assert [s.path for s in controller.sites] == ["model.layers.0.mlp.gate", "model.layers.1.mlp.gate"]
    assert not controller.notes
    assert audited(model, controller, n=2, length=6).replay.bit_equal


def test_a_model_whose_only_routers_name_one_expert_twice_is_refused_in_one_line():
    model = causal_lm(small(transformers.DeepseekV4Config, num_local_experts=8, num_experts_per_tok=2,
                            mlp_layer_types=["hash_moe", "hash_moe"]))
    line = api_refusal(lambda: moe_controller(model))
    assert "its only routers are 2 DeepseekV4HashRouter routers" in line and "two slots" in line


# ---- Inkling: a router that returns its shared experts' weights beside its choices -------------------------------

def test_a_router_that_returns_its_shared_experts_weights_is_audited_over_its_routed_experts_exactly():
    config = small(transformers.InklingTextConfig, n_routed_experts=8, n_shared_experts=2, num_experts_per_tok=2,
                   moe_intermediate_size=32)
    model = causal_lm(config)
    assert model.model.layers[0].mlp.gate.weight.shape[0] == 10  # 8 routed experts and 2 shared ones
    controller = moe_controller(model)
    assert [s.codec.num_experts for s in controller.sites] == [8, 8]
    assert any("2 shared experts" in n and "InklingTopkRouter" in n and "live" in n for n in controller.notes)
    result = audited(model, controller, n=2, length=6)
    assert result.replay.bit_equal  # the shared experts' weights recomputed live: zeros would change every output
    assert "shared experts" in notices(result)


def test_doges_product_key_router_mixing_tokens_and_windows_is_named_not_audited_nor_passed_over():
    """Doge's CDMoE views its router logits as [2, batch * token, keys]: a token's experts depend on the other tokens
    and windows of the pass. fcaudit has nothing to replay per token there: the controller names it, and an audit of
    the rest (its dynamic-mask dt_proj, at batch size 1) says so with its results."""
    config = small(transformers.DogeConfig, is_moe=True, num_experts=16, num_experts_per_tok=2)
    model = causal_lm(config)
    ctrl = fca.controller_for(model)
    assert [s.path for s in ctrl.sites] == [f"model.layers.{i}.self_attn.dt_proj" for i in range(2)]
    assert any("not audited: 2 DogeCDMoE" in n and "rest of the batch" in n for n in ctrl.notes)
    ev, ca = windows()
    with tempfile.TemporaryDirectory() as out:
        result = fca.audit(model, ctrl, ev, ca, randomizations=1, out=out, batch_size=1, quiet=True)
        assert result.replay.bit_equal
        assert any("not audited: 2 DogeCDMoE" in n for n in result.notices)
