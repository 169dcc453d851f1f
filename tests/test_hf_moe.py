"""Hugging Face MoE family: router codecs, structural discovery, loading, execution measures, and whole audits
through the engine (capture on hooks, decode in place of the router's forward)."""

import json
import time

import pytest
import torch

import transformers  # noqa: E402  (a test dependency: the test extra includes the hf extra)

from fcaudit.errors import FcauditError  # noqa: E402
from fcaudit.families.hf import TopKRouterCodec, ensure_eager_experts, load_hf, moe_controller, require_transformers  # noqa: E402
from fcaudit.families.hf.discover import SUPPORTED_EXAMPLES  # noqa: E402
from fcaudit.controllers import Captured, Controller, Decoding  # noqa: E402
from fcaudit.families.hf.execution import expert_execution  # noqa: E402
from fcaudit.families.hf.tiny import FAMILIES, tiny_moe  # noqa: E402
from fcaudit.loss import token_nll  # noqa: E402

E, K = 8, 2


class Run:
    """A capture pass: its coefficients (what `Controller.capture` returned) and logits."""

    def __init__(self, coefficients: Captured, logits):
        self.coefficients, self.logits = coefficients, logits

    def like(self, coefficients) -> Captured:
        """Other coefficients, decoded as this pass's are."""
        return Captured(coefficients, self.coefficients.decoding)


def routers_of(ctrl: Controller) -> list:
    return [s for s in ctrl.sites if s.codec.top_k is not None]


def kind(site) -> str:
    return "router" if site.codec.top_k is not None else "shared_gate"


def forward_logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


def capture(model, ctrl: Controller, ids) -> Run:
    with ctrl.capture(*ids.shape) as found:
        logits = forward_logits(model, ids)
    return Run(found, logits)


def replay_logits(model, ctrl: Controller, ids, coefficients: Captured):
    with ctrl.replay(coefficients):
        return forward_logits(model, ids)


def ids_for(batch=4, token=12, seed=0):
    return torch.randint(0, 256, (batch, token), generator=torch.Generator().manual_seed(seed))


ROUTER_WEIGHTS = ("mlp.gate.weight", "mlp.router.weight")  # GPT-OSS names its router "router"
# The combine vector's mass per token: Mixtral, Qwen3-MoE, GPT-OSS renormalize (or softmax) the top-k to 1,
# DeepSeek-V3 then scales it by routed_scaling_factor; OLMoE and Qwen2-MoE keep the softmax mass of the top-k (< 1).
MASS = {"mixtral": 1.0, "qwen3_moe": 1.0, "gpt_oss": 1.0, "deepseek_v3": 2.5}
# The dtype of the top-k weights the experts receive in a bf16 model: Mixtral's and DeepSeek-V3's routers stay fp32.
WEIGHTS_DTYPE = {"mixtral": torch.float32, "deepseek_v3": torch.float32}


def spread_router(model, std=0.5):
    """Trained routers are far from uniform; the init (std 0.02) routes almost at random. Make routing matter."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(ROUTER_WEIGHTS) or name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj"):
                p.normal_(0, std, generator=torch.Generator().manual_seed(len(name)))


def zero_routers(model):
    """Every token routed alike (and every shared gate alike): routers' weights 0, their biases shared by all."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(ROUTER_WEIGHTS) or name.endswith("shared_expert_gate.weight"):
                p.zero_()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_replay_of_captured_coefficients_is_bit_exact_with_the_router_disabled(family, dtype):
    model = tiny_moe(family, dtype=dtype, experts=E, top_k=K)
    spread_router(model)
    ctrl = moe_controller(model)
    routers = routers_of(ctrl)
    assert len(routers) == 2 and all(s.codec.top_k == K for s in routers)
    ids = ids_for()
    cap = capture(model, ctrl, ids)
    for site, c in zip(ctrl.sites, cap.coefficients):
        if kind(site) == "router":
            assert c.shape == (4, 12, 1, E) and c.dtype == torch.float32
            assert ((c != 0).sum(-1) == K).all()  # k experts per token, after top-k
            total = c.sum(-1)
            if family in MASS:  # renormalized top-k
                assert torch.allclose(total, torch.full_like(total, MASS[family]), atol=1e-2)
            else:  # OLMoE / Qwen2-MoE keep the softmax mass of the top-k, below 1
                assert (total <= 1.01).all() and (total < 0.99).any()
    # The router really does not run: poisoned router weights leave the replayed logits unchanged.
    with torch.no_grad():
        for s in routers:
            s.module.weight.fill_(float("nan"))
    replayed = replay_logits(model, ctrl, ids, cap.coefficients)
    assert replayed.dtype == dtype
    assert torch.equal(replayed, cap.logits)


@pytest.mark.parametrize("family", FAMILIES)
def test_decode_rebuilds_the_router_output_the_experts_received(family):
    model = tiny_moe(family, dtype=torch.bfloat16, experts=E, top_k=K)
    spread_router(model)
    ctrl = moe_controller(model)
    site = routers_of(ctrl)[0]
    seen = []
    handle = site.module.register_forward_hook(lambda m, a, out: seen.append(out))
    forward_logits(model, ids_for())
    handle.remove()
    logits, weights, index = seen[0]
    meta = site.codec.meta(seen[0])
    assert json.loads(json.dumps(meta)) == meta  # metas are plain data: the engine may store them as JSON
    d_logits, d_weights, d_index = site.codec.decode(site.codec.encode(seen[0], 4, 12), meta)
    assert (d_logits.dtype, d_weights.dtype, d_index.dtype) == (logits.dtype, weights.dtype, index.dtype)
    assert weights.dtype == WEIGHTS_DTYPE.get(family, torch.bfloat16)
    assert d_index.shape == index.shape
    # Same (expert, weight) pairs per token; slot order may differ only between equal weights.
    assert torch.equal(d_index.sort(1).values, index.sort(1).values)
    assert torch.equal(d_weights.gather(1, d_index.argsort(1)), weights.gather(1, index.argsort(1)))


def test_decode_pads_variable_support_with_the_sentinel_in_descending_weight_order():
    codec = TopKRouterCodec(num_experts=4, top_k=2)
    c = torch.tensor([[0.1, 0.0, 0.7, 0.2], [0.0, 0.5, 0.0, 0.0], [0.3, 0.3, 0.0, 0.0]]).reshape(1, 3, 1, 4)
    meta = {"logits_dtype": "float32", "weights_dtype": "float32", "index_dtype": "int64"}
    logits, weights, index = codec.decode(c, meta)
    assert index.tolist() == [[2, 3, 0], [1, 4, 4], [0, 1, 4]]  # width = largest support; ties: lower expert first
    assert torch.equal(weights, torch.tensor([[0.7, 0.2, 0.1], [0.5, 0.0, 0.0], [0.3, 0.3, 0.0]]))
    assert torch.equal(logits.softmax(-1)[1], torch.tensor([0.0, 1.0, 0.0, 0.0]))  # placeholder: log of the vector
    assert torch.equal(codec.encode((logits, weights, index), 1, 3), c)  # the sentinel round-trips to "not selected"


def test_repeat_padding_names_the_rows_top_expert_again_at_weight_0():
    codec = TopKRouterCodec(num_experts=4, top_k=2, pad="repeat")
    c = torch.tensor([[0.1, 0.0, 0.7, 0.2], [0.0, 0.5, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]]).reshape(1, 3, 1, 4)
    meta = {"logits_dtype": "float32", "weights_dtype": "float32", "index_dtype": "int64"}
    logits, weights, index = codec.decode(c, meta)
    assert index.tolist() == [[2, 3, 0], [1, 1, 1], [0, 0, 0]]  # an empty row: expert 0 at weight 0
    assert torch.equal(weights, torch.tensor([[0.7, 0.2, 0.1], [0.5, 0.0, 0.0], [0.0, 0.0, 0.0]]))
    assert torch.equal(codec.encode((logits, weights, index), 1, 3), c)  # the zero slots add nothing to the weight
    with pytest.raises(FcauditError, match="padding 'skip'"):
        TopKRouterCodec(num_experts=4, top_k=2, pad="skip")


def test_gpt_oss_experts_get_repeat_padding_and_run_variable_support_within_rounding():
    """GPT-OSS's experts one-hot the index over E classes, so the sentinel E fails there: discovery picks "repeat".
    A batch whose tokens keep 1 or 2 experts then runs; the padded slots add 0, up to the rounding of a matmul with
    more rows, and FLOPs count the padded slots that the experts compute."""
    model = tiny_moe("gpt_oss", experts=E, top_k=K)
    spread_router(model)
    ctrl = moe_controller(model)
    assert [s.codec.pad for s in routers_of(ctrl)] == ["repeat", "repeat"]
    assert "padded with a selected expert" in routers_of(ctrl)[0].codec.describe()
    ids = ids_for()
    cap = capture(model, ctrl, ids)
    assert torch.equal(replay_logits(model, ctrl, ids, cap.coefficients), cap.logits)  # Correct: no padding
    narrow = cap.like([c.clone() for c in cap.coefficients])
    for c in narrow:  # every other token keeps only its top expert
        top = c.argmax(-1, keepdim=True)
        c[:, ::2] = torch.zeros_like(c[:, ::2]).scatter(-1, top[:, ::2], c[:, ::2].gather(-1, top[:, ::2]))
    assert (replay_logits(model, ctrl, ids, narrow) - cap.logits).abs().max() > 1e-3  # dropping experts matters
    # At the experts: rows padded in one call equal the same rows run unpadded on their own, up to rounding
    experts = model.model.layers[0].mlp.experts
    h = torch.randn(4, 64, generator=torch.Generator().manual_seed(0))
    index = torch.tensor([[1, 3], [2, 2], [0, 5], [4, 4]])  # rows 1 and 3: one expert, padded by repeating it
    weights = torch.tensor([[.6, .4], [1., 0.], [.7, .3], [.9, 0.]])
    with torch.no_grad():
        joint = experts(h, index, weights)
        alone = {(0, 2): experts(h[[0, 2]], index[[0, 2]], weights[[0, 2]]),
                 (1, 3): experts(h[[1, 3]], index[[1, 3], :1], weights[[1, 3], :1])}
    for rows, out in alone.items():
        # fp32 matmuls of 2 and 4 rows differ in rounding (here up to ~1e-5 relative); a weighted slot: ~1
        torch.testing.assert_close(joint[list(rows)], out, rtol=1e-4, atol=1e-5)
    execution = expert_execution(model, ids, ctrl, narrow)
    kept = torch.tensor([1, 2] * 6).expand(4, 12)
    assert all(torch.equal(n, kept) for n in execution.experts_per_token)  # distinct experts, the padding not counted
    per_pair = execution.dense_flops[0] // (4 * 12 * E)
    assert execution.expert_flops == [4 * 12 * K * per_pair] * 2  # ... but computed: K slots per token


@pytest.mark.parametrize("family", FAMILIES)
def test_uniform_router_gives_exactly_zero_penalty_under_derangement_and_token_shuffle(family):
    model = tiny_moe(family, experts=E, top_k=K)
    zero_routers(model)  # every controller emits the same coefficient for every token
    ctrl = moe_controller(model)
    ids = ids_for()
    cap = capture(model, ctrl, ids)
    nll = token_nll(cap.logits, ids)
    g = torch.Generator().manual_seed(1)
    derangement = torch.roll(torch.arange(4), 1)
    cross = cap.like([c[derangement] for c in cap.coefficients])
    shuffle = cap.like([c[:, torch.randperm(12, generator=g)] for c in cap.coefficients])
    for coeffs in (cross, shuffle):
        assert torch.equal(token_nll(replay_logits(model, ctrl, ids, coeffs), ids), nll)


@pytest.mark.parametrize("family", FAMILIES)
def test_replaying_other_experts_changes_the_logits(family):
    model = tiny_moe(family, experts=E, top_k=K)
    ctrl = moe_controller(model)
    ids = ids_for()
    cap = capture(model, ctrl, ids)
    other = cap.like([c.roll(1, dims=-1) if kind(s) == "router" else c for s, c in zip(ctrl.sites, cap.coefficients)])
    replayed = replay_logits(model, ctrl, ids, other)
    assert (replayed - cap.logits).abs().max() > 0


def test_qwen2_shared_expert_gate_is_a_scalar_site_that_matters():
    model = tiny_moe("qwen2_moe", experts=E, top_k=K)
    ctrl = moe_controller(model)
    assert [kind(s) for s in ctrl.sites] == ["router", "shared_gate", "router", "shared_gate"]
    assert ctrl.sites[1].path == "model.layers.0.mlp.shared_expert_gate" and ctrl.sites[1].codec.top_k is None
    ids = ids_for()
    cap = capture(model, ctrl, ids)
    assert cap.coefficients[1].shape == (4, 12, 1, 1)
    changed = cap.like([c + 3.0 if kind(s) == "shared_gate" else c for s, c in zip(ctrl.sites, cap.coefficients)])
    assert not torch.equal(replay_logits(model, ctrl, ids, changed), cap.logits)


def test_controller_labels_and_switch_from_grouped_mm_to_eager():
    model = tiny_moe("mixtral", experts=4, top_k=2, experts_implementation="grouped_mm")
    assert model.config._experts_implementation == "grouped_mm"
    assert ensure_eager_experts(model) == "grouped_mm"
    assert ensure_eager_experts(model) == "eager" and model.config._experts_implementation == "eager"
    model.set_experts_implementation("grouped_mm")
    ctrl = moe_controller(model)
    assert model.config._experts_implementation == "eager"
    assert ctrl.static_name == "StaticMixMean" and ctrl.labels["StructureRemoved"] == "ExpertUniformMean"
    assert {(s.kind, s.reference) for s in ctrl.sites} == {("expert_router", "ExpertUniformMean")}
    ids = ids_for()
    cap = capture(model, ctrl, ids)
    model.set_experts_implementation("grouped_mm")  # the sentinel is unsafe there: the codec refuses
    with pytest.raises(FcauditError, match="eager"):
        replay_logits(model, ctrl, ids, cap.coefficients)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_llama4_score_router_replays_bit_exact_and_its_experts_all_run(dtype):
    """Llama 4's router returns (scores, logits): dense scores, zero off the top-k, scaling each expert's input."""
    model = tiny_moe("llama4", dtype=dtype, experts=E, top_k=K)
    ctrl = moe_controller(model)
    assert [type(s.codec).__name__ for s in ctrl.sites] == ["ScoreRouterCodec"] * 2
    ids = ids_for()
    cap = capture(model, ctrl, ids)
    for c in cap.coefficients:
        assert c.shape == (4, 12, 1, E) and ((c != 0).sum(-1) == K).all() and ((c >= 0) & (c <= 1)).all()  # sigmoid
    other = cap.like([c.roll(1, dims=-1) for c in cap.coefficients])
    assert (replay_logits(model, ctrl, ids, other) - cap.logits).abs().max() > 0
    with torch.no_grad():  # the router really does not run
        for s in routers_of(ctrl):
            s.module.weight.fill_(float("nan"))
    assert torch.equal(replay_logits(model, ctrl, ids, cap.coefficients), cap.logits)
    execution = expert_execution(model, ids, ctrl)
    assert (execution.experts_per_token == E).all() and execution.summary()["active_expert_fraction"] == 1.0


def test_llama4_audit_with_a_zero_router_gives_exactly_zero_for_assignments(tmp_path):
    import fcaudit as fca

    model = tiny_moe("llama4", experts=E, top_k=K)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("feed_forward.router.weight"):
                p.zero_()
    res = fca.audit(model, fca.controller_for(model), _windows(6), _windows(4, seed=1), randomizations=2,
                    out=tmp_path, batch_size=3, quiet=True)
    assert res.replay.bit_equal and res.replay.route_flips == 0
    pen = res.penalties().to_frame()
    for c in ("CrossInput", "TokenShuffle", "CrossShuffle", "TokenResamplePast"):
        assert pen.loc[c, "statistic"] == 0.0, c
    assert (res.records[res.records.condition == "Correct"].active == K).all() and pen.loc["StaticTopK", "active"] == K


def test_score_router_refuses_scores_with_more_than_top_k_experts():
    model = tiny_moe("llama4", experts=4, top_k=1, layers=1)
    router = model.model.layers[0].feed_forward.router
    forward = type(router).forward  # dense sigmoid scores of every expert: more than its top_k = 1
    router.forward = lambda h: (torch.sigmoid(torch.nn.functional.linear(h, router.weight)), forward(router, h)[1])
    with pytest.raises(FcauditError, match="select more than top_k=1 experts") as err:
        moe_controller(model)
    assert "\n" not in str(err.value)


def _jetmoe_sizes_as_tuple():
    """JetMoE whose routers give their expert sizes as a tuple: neither a top-k triple nor ScatterMoE's grouped form
    (which has a list), though the model runs."""
    cfg = transformers.JetMoeConfig(vocab_size=256, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                    kv_channels=16, num_local_experts=4, num_experts_per_tok=2, bos_token_id=None,
                                    eos_token_id=None, pad_token_id=None)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    for router in (model.model.layers[0].mlp.router, model.model.layers[0].self_attention.experts.router):
        forward = type(router).forward
        router.forward = lambda h, r=router, f=forward: (lambda o: (*o[:3], tuple(o[3]), o[4]))(f(r, h))
    return model


def _gpt_oss_unpaddable():
    """GPT-OSS with experts whose output depends on the index width: neither padding keeps it."""
    model = tiny_moe("gpt_oss", experts=4, top_k=2, layers=1)
    experts = model.model.layers[0].mlp.experts
    forward = experts.forward
    experts.forward = lambda h, index, weights: forward(h, index, weights) + index.shape[1]
    return model


@pytest.mark.parametrize("build, cls, why", [
    (_jetmoe_sizes_as_tuple, "JetMoeTopKGating", "not (router_logits, top_k_weights, top_k_index)"),  # a 5-tuple
    (_gpt_oss_unpaddable, "GptOssTopKRouter", "cannot be padded"),  # the right triple, but no padding holds
])
def test_unsupported_router_gets_a_one_line_error_naming_it_and_the_closest_supported(build, cls, why):
    with pytest.raises(FcauditError) as err:
        moe_controller(build())
    msg = str(err.value)
    assert "\n" not in msg and cls in msg and why in msg
    assert any(name in msg for name in SUPPORTED_EXAMPLES)
    assert "fca.Controller.from_modules(" in msg and "from_ops(" in msg  # the route that audits any model


def test_a_checkpoint_no_family_loads_is_refused_naming_the_route_that_audits_any_model(tmp_path):
    import fcaudit as fca

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mamba", "hidden_size": 16}))
    with pytest.raises(FcauditError, match="which no fcaudit family loads") as err:
        fca.load(tmp_path)
    assert "\n" not in str(err.value) and "fca.Controller.from_modules(model" in str(err.value)


def test_model_without_router_is_refused():
    with pytest.raises(FcauditError, match="has no MoE router"):
        moe_controller(torch.nn.Sequential(torch.nn.Linear(4, 4)))


@pytest.mark.parametrize("family", FAMILIES)
def test_execution_counts_k_experts_under_correct_and_every_used_expert_under_a_dense_mixture(family):
    model = tiny_moe(family, experts=E, top_k=K)
    ctrl = moe_controller(model)
    ids = ids_for()
    cap = capture(model, ctrl, ids)
    correct = expert_execution(model, ids, ctrl)
    assert correct.experts_per_token.shape == (2, 4, 12) and (correct.experts_per_token == K).all()
    assert correct.summary()["active_expert_fraction"] == pytest.approx(K / E)
    # A static dense mixture: every token gets the batch mean, with expert 0 never selected in layer 0.
    static = []
    for s, c in zip(ctrl.sites, cap.coefficients):
        m = c.mean((0, 1), keepdim=True).expand_as(c).clone()
        if kind(s) == "router":
            m = m.clamp_min(1e-3)  # every expert in use, even one no token picked here
            if s is routers_of(ctrl)[0]:
                m[..., 0] = 0
        static.append(m)
    dense = expert_execution(model, ids, ctrl, cap.like(static))
    assert (dense.experts_per_token[0] == E - 1).all() and (dense.experts_per_token[1] == E).all()
    per_pair = dense.dense_flops[1] // (4 * 12 * E)
    assert dense.expert_flops == [4 * 12 * (E - 1) * per_pair, 4 * 12 * E * per_pair]  # measured == counted
    assert correct.expert_flops == [4 * 12 * K * per_pair] * 2


def test_load_checkpoint_directory_in_bf16_and_replay_exactly(tmp_path):
    tiny_moe("olmoe", experts=4, top_k=2).save_pretrained(tmp_path)
    model = load_hf(tmp_path, dtype=torch.bfloat16)
    assert next(model.parameters()).dtype == torch.bfloat16
    assert model.config._experts_implementation == "eager"
    ctrl = moe_controller(model)
    ids = ids_for()
    cap = capture(model, ctrl, ids)
    assert torch.equal(replay_logits(model, ctrl, ids, cap.coefficients), cap.logits)


def test_load_refuses_a_directory_without_weights_and_the_tokenizer_is_the_checkpoints(tmp_path):
    from tokenizers import Tokenizer, models

    from fcaudit.tokens import load_tokenizer

    model = tiny_moe("qwen3_moe", experts=4, top_k=2)
    model.config.save_pretrained(tmp_path)
    with pytest.raises(FcauditError, match="cannot load") as err:
        load_hf(tmp_path)
    assert "\n" not in str(err.value)
    model.save_pretrained(tmp_path)
    tok = Tokenizer(models.WordLevel(vocab={"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(tmp_path)
    loaded = load_hf(tmp_path)
    assert load_tokenizer(tmp_path).encode("a").ids == [1] and loaded.config._experts_implementation == "eager"


def test_hub_id_offline_fails_fast_with_one_line(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("fcaudit.hub.hub_reachable", lambda *a, **k: False)
    start = time.monotonic()
    with pytest.raises(FcauditError) as err:
        load_hf("nobody-fcaudit/no-such-moe")
    assert time.monotonic() - start < 10 and "\n" not in str(err.value) and "no-such-moe" in str(err.value)


def test_without_transformers_the_error_names_the_extra(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "transformers", None)
    with pytest.raises(FcauditError, match=r"pip install -e '\.\[hf\]' in fcaudit's clone"):
        require_transformers()


# ---- whole audits through the engine ------------------------------------------------------------------------------

def _windows(n, T=12, seed=0):
    return torch.randint(0, 256, (n, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", FAMILIES)
def test_audit_through_controller_for_with_a_zero_router_gives_exactly_zero_for_assignments(family, tmp_path):
    import fcaudit as fca

    model = tiny_moe(family, experts=E, top_k=K)
    zero_routers(model)  # every token routed alike (and every shared gate alike)
    ctrl = fca.controller_for(model)  # the family registry recognizes the routers by structure
    assert ctrl.static_name == "StaticMixMean" and ctrl.describe()["static"] == "StaticTopK"
    res = fca.audit(model, ctrl, _windows(6), _windows(4, seed=1), randomizations=2, out=tmp_path, batch_size=3,
                    quiet=True)
    assert res.replay.bit_equal and res.replay.route_flips == 0
    pen = res.penalties().to_frame()
    for c in ("CrossInput", "TokenShuffle", "CrossShuffle", "TokenResamplePast"):
        assert pen.loc[c, "statistic"] == 0.0, c
    assert sum("the randomized conditions move nothing" in line for line in res.notices) == 1  # 0 said to be by design
    correct = res.records[res.records.condition == "Correct"]
    assert (correct.active == K).all() and pen.loc["StaticTopK", "active"] == K  # every token: the same K experts
    assert res.labels["StaticProfile"] == "StaticMixMean"
    assert res.labels["StructureRemoved"] == ("ExpertUniformMean + GlobalMean" if family == "qwen2_moe"  # its gates
                                              else "ExpertUniformMean")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_audit_of_a_routed_model_moves_nll_and_replays_exactly(dtype, tmp_path):
    import fcaudit as fca

    model = tiny_moe("qwen3_moe", experts=E, top_k=K, dtype=dtype)
    spread_router(model)
    model.to(dtype)
    res = fca.audit(model, fca.controller_for(model), _windows(6), _windows(4, seed=1), randomizations=2,
                    out=tmp_path, batch_size=3, quiet=True)
    assert res.replay.bit_equal and res.replay.max_abs_dlogit == 0.0 and res.replay.route_flips == 0
    pen = res.penalties().to_frame()
    assert abs(pen.loc["CrossInput", "statistic"]) > 1e-3 and abs(pen.loc["TokenShuffle", "statistic"]) > 1e-3  # any sign
    assert pen.loc["CrossInput", "active"] == K and pen.loc["StaticTopK", "active"] == K
    assert pen.loc["StaticProfile", "active"] > K  # a dense static mixture runs every expert with a nonzero mean
    assert not any("the randomized conditions move nothing" in line for line in res.notices)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["mixtral", "olmoe", "qwen3_moe", "deepseek_v3", "gpt_oss", "llama4"])
def test_a_briefly_trained_moe_depends_on_its_routing(family, tmp_path):
    """The issue's bar: 2 layers, hidden 64, 150 steps on bytes; CrossInput and TokenShuffle clearly above 0.01."""
    import numpy as np

    import fcaudit as fca
    from fcaudit.data import load_corpus, make_windows, random_batch

    corpus = load_corpus("embedded")
    model = tiny_moe(family, experts=8, top_k=2, output_router_logits=True).train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    rng = np.random.default_rng(0)
    for _ in range(150):
        ids = random_batch(corpus.train, 16, 64, rng)
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.config.output_router_logits = False
    model.eval()
    ev = make_windows(corpus.test, 16, 64, 0, "test")
    ca = make_windows(corpus.validation, 16, 64, 0, "validation")
    res = fca.audit(model, fca.controller_for(model), ev, ca, randomizations=2, out=tmp_path, quiet=True)
    pen = res.penalties().to_frame()["statistic"]
    assert res.replay.bit_equal and res.replay.route_flips == 0
    assert pen["CrossInput"] > 0.01 and pen["TokenShuffle"] > 0.01


def test_from_modules_with_a_codec_audits_tuple_routers(tmp_path):
    """The README's way for a router the family does not know: a path pattern and a codec, no adapter."""
    import fcaudit as fca

    model = tiny_moe("mixtral", experts=E, top_k=K)
    spread_router(model)
    with pytest.raises(FcauditError, match="give the site a codec"):  # a layout cannot read a tuple
        fca.audit(model, fca.Controller.from_modules(model, "model.layers.*.mlp.gate", layout="(batch token) expert"),
                  _windows(4), _windows(2, seed=1), randomizations=1, out=tmp_path / "layout", quiet=True)
    ctrl = fca.Controller.from_modules(model, "model.layers.*.mlp.gate", codec=TopKRouterCodec(num_experts=E, top_k=K))
    res = fca.audit(model, ctrl, _windows(6), _windows(4, seed=1), randomizations=1, out=tmp_path / "codec",
                    batch_size=3, quiet=True)
    assert res.replay.bit_equal and res.replay.route_flips == 0
    assert "StaticTopK" in set(res.records.condition)


def test_checkpoint_configs_of_moe_families_are_recognized_nested_or_with_their_own_keys():
    from fcaudit.families.hf import looks_like_hf_moe

    assert looks_like_hf_moe({"model_type": "ernie4_5_moe", "moe_num_experts": 64, "moe_k": 6})
    assert looks_like_hf_moe({"model_type": "hunyuan_v1_moe", "num_experts": 16, "moe_topk": 1})
    assert looks_like_hf_moe({"model_type": "llama4", "text_config": {"num_local_experts": 16, "num_experts_per_tok": 1}})
    assert looks_like_hf_moe({"model_type": "kimi_linear", "num_experts": 8, "num_experts_per_token": 2})
    assert looks_like_hf_moe({"model_type": "gemma4", "text_config": {"num_experts": 8, "top_k_experts": 2}})
    assert looks_like_hf_moe({"model_type": "dbrx", "ffn_config": {"moe_num_experts": 4, "moe_top_k": 1}})
    assert not looks_like_hf_moe({"model_type": "llama", "num_hidden_layers": 2})
    assert not looks_like_hf_moe({"model_type": "gemma4", "text_config": {"num_experts": None, "top_k_experts": None}})
    assert not looks_like_hf_moe({"model_type": "mixtral", "num_local_experts": 8, "num_experts_per_tok": 0})


def test_a_checkpoint_missing_a_weight_is_refused_rather_than_audited_with_a_random_one(tmp_path):
    from safetensors.torch import load_file, save_file

    tiny_moe("mixtral", experts=4, top_k=2).save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    del weights["model.layers.1.block_sparse_moe.gate.weight"]  # Mixtral's checkpoints keep their older names
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(FcauditError, match=r"lacks 1 weights of MixtralForCausalLM \(e.g. model.layers.1.mlp.gate.weight"
                                           r"\), which would be random") as err:
        load_hf(tmp_path)
    assert "\n" not in str(err.value)


def test_a_multimodal_llama4_checkpoint_loads_its_language_model_and_audits(tmp_path, caplog):
    """Llama 4's released checkpoints are multimodal: the CLI loads their language model (AutoModelForCausalLM)."""
    import fcaudit as fca
    from fcaudit.families.hf import looks_like_hf_moe

    text = tiny_moe("llama4", experts=4, top_k=1).config.to_dict()
    vision = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, image_size=28,
                  patch_size=14, vision_output_dim=32, projector_input_dim=32, projector_output_dim=64)
    torch.manual_seed(0)
    full = transformers.Llama4ForConditionalGeneration(transformers.Llama4Config(text_config=text,
                                                                                 vision_config=vision)).eval()
    full.save_pretrained(tmp_path / "ckpt")
    assert looks_like_hf_moe(json.loads((tmp_path / "ckpt" / "config.json").read_text()))
    caplog.set_level("WARNING")
    model = load_hf(tmp_path / "ckpt")
    # neither its list of unused vision weights, nor the tensor-parallel notes that silencing it by level brings
    assert not [r for r in caplog.records if "LOAD REPORT" in r.getMessage() or "not sharded" in r.getMessage()]
    ids = ids_for()
    assert torch.equal(forward_logits(model, ids), forward_logits(full.language_model, ids))  # its weights, all
    res = fca.audit(model, fca.controller_for(model), _windows(4), _windows(2, seed=1), randomizations=1,
                    out=tmp_path / "audit", batch_size=2, quiet=True)
    assert res.replay.bit_equal and res.replay.route_flips == 0


def test_on_an_accelerator_the_padding_is_probed_on_the_cpu_once_per_experts_class(monkeypatch):
    """On CUDA an index the experts refuse trips a device-side assert that ends the CUDA context, so a model off the
    CPU has its experts probed on CPU copies of their weights (placement.on_cpu), once per class. Here: the CPU
    stands in."""
    from contextlib import contextmanager

    from fcaudit import placement

    model = tiny_moe("gpt_oss", experts=E, top_k=K)
    calls, entered = [], []
    for layer in model.model.layers:
        layer.mlp.experts.register_forward_pre_hook(lambda m, a: calls.append(m))
    on_cpu = placement.on_cpu

    @contextmanager
    def recorded(module):
        with on_cpu(module):
            entered.append(module)
            yield

    monkeypatch.setattr(placement, "on_cpu", recorded)
    monkeypatch.setattr(placement, "off_cpu", lambda t: True)  # as on an accelerator
    ctrl = moe_controller(model)
    assert [s.codec.pad for s in routers_of(ctrl)] == ["repeat", "repeat"]
    # the probe's forward (2 layers), then one class's padding: plain, the sentinel (refused), the repeat
    assert len(calls) == 2 + 3
    assert entered == [model.model.layers[0].mlp.experts]  # once, for the first router's experts


def _longcat(layers=1):
    cfg = transformers.LongcatFlashConfig(vocab_size=256, hidden_size=64, num_attention_heads=4, num_key_value_heads=4,
                                          max_position_embeddings=64, n_routed_experts=6, zero_expert_num=2,
                                          moe_topk=2, num_layers=layers, kv_lora_rank=16, q_lora_rank=16,
                                          qk_rope_head_dim=32, head_dim=32, qk_nope_head_dim=8, v_head_dim=16,
                                          ffn_hidden_size=64, expert_ffn_hidden_size=32, bos_token_id=None,
                                          eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():  # route many tokens to the identity experts (6 and 7)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b[6:] = 0.3
    return model


def test_zero_computation_experts_are_experts_of_the_router_and_flops_match_the_experts_that_compute():
    """LongCat-Flash routes some tokens to identity experts, which its experts module does not hold (from
    transformers 5.25 the block maps those slots to a computing expert at weight 0 itself; before, the experts module
    skipped them): the router's combine vector has all 8 experts, the execution counts the computing experts the
    experts module receives, and the FLOPs measured inside it are that count times one expert's cost."""
    model = _longcat()
    received, routed = [], []
    block = model.model.layers[0].mlp
    block.experts.register_forward_pre_hook(lambda m, a: received.append(a[1]))
    block.router.register_forward_hook(lambda m, a, o: routed.append(o[2]))
    ctrl = moe_controller(model)
    assert ctrl.sites[0].codec.num_experts == 8
    received.clear(), routed.clear()
    execution = expert_execution(model, ids_for(), ctrl)
    assert (routed[0] >= 6).any()  # the identity experts were chosen
    index = received[0]
    n = execution.experts_per_token[0]
    distinct = [len({int(e) for e in row if e < 6}) for row in index]  # computing experts each token reached
    assert execution.num_experts == [6] and n.flatten().tolist() == distinct and (n <= K).all()
    per_pair = execution.dense_flops[0] // (4 * 12 * 6)
    assert execution.expert_flops[0] == int(n.sum()) * per_pair  # measured == counted


def test_longcat_flash_replays_exactly_and_its_checkpoint_loads_though_it_derives_its_depth(tmp_path):
    """LongCat-Flash's config derives num_hidden_layers as 2 x num_layers, the number of decoder layers its weights
    hold: the depth check reads num_layers. Capture and replay of the loaded checkpoint are bit-exact."""
    _longcat(layers=2).save_pretrained(tmp_path)
    model = load_hf(tmp_path)
    assert model.config.num_hidden_layers == 4 and len(model.model.layers) == 2
    ctrl = moe_controller(model)
    assert len(routers_of(ctrl)) == 2
    ids = ids_for()
    run = capture(model, ctrl, ids)
    assert torch.equal(replay_logits(model, ctrl, ids, run.coefficients), run.logits)
    other = run.like([c.roll(1, dims=-1) for c in run.coefficients])  # other experts (identity ones too) move them
    assert not torch.equal(replay_logits(model, ctrl, ids, other), run.logits)


# ---- models spread by a device map (accelerate) -------------------------------------------------------------------

ON_DISK = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk",
           "model.norm": "cpu", "lm_head": "cpu"}


def test_a_model_with_a_layer_offloaded_to_disk_audits_to_the_records_of_the_model_loaded_whole(tmp_path):
    """A device map changes where weights live and when they are loaded, not the function: accelerate loads layer 1
    from disk for each forward pass, and the replay replaces its router's hooked forward. Records and the checkpoint
    hash (read through the offloaded weights) equal those of the model loaded whole."""
    import fcaudit as fca
    from fcaudit import placement

    tiny_moe("mixtral", experts=E, top_k=K).save_pretrained(tmp_path / "ckpt")
    placed = load_hf(tmp_path / "ckpt", device_map=ON_DISK, offload_folder=tmp_path / "offload")
    whole = load_hf(tmp_path / "ckpt")
    assert placement.is_dispatched(placed) and not placement.is_dispatched(whole)
    layer = placed.model.layers[1]
    assert all(p.is_meta for p in layer.parameters())
    results = [fca.audit(m, fca.controller_for(m), _windows(6), _windows(4, seed=1), randomizations=2,
                         out=tmp_path / name, batch_size=4, quiet=True)
               for name, m in (("placed", placed), ("whole", whole))]
    assert results[0].replay.bit_equal and results[0].replay.route_flips == 0
    a, b = (r.records.sort_values(["condition", "randomization", "example"]).reset_index(drop=True) for r in results)
    assert len(a) == 6 * (1 + 4 * 2 + 4) and a.equals(b)
    assert results[0].config["model"]["params_sha256"] == results[1].config["model"]["params_sha256"]
    assert all(p.is_meta for p in layer.parameters())  # offloaded again
    plan = fca.plan(placed, fca.controller_for(placed), _windows(6), _windows(4, seed=1), batch_size=4)
    assert plan.devices == ["cpu", "disk"] and "over cpu, disk (its device map)" in str(plan)
    assert fca.plan(whole, fca.controller_for(whole), _windows(6), batch_size=4).devices is None


def test_on_cpu_loads_an_offloaded_modules_weights_for_the_block_only(tmp_path):
    from fcaudit import placement

    tiny_moe("mixtral", experts=E, top_k=K).save_pretrained(tmp_path / "ckpt")
    placed = load_hf(tmp_path / "ckpt", device_map=ON_DISK, offload_folder=tmp_path / "offload")
    whole = load_hf(tmp_path / "ckpt")
    experts = placed.model.layers[1].mlp.experts
    with placement.on_cpu(experts):
        assert torch.equal(experts.down_proj, whole.model.layers[1].mlp.experts.down_proj)
    assert experts.down_proj.is_meta
    kept = whole.model.layers[0].mlp.experts.down_proj
    with placement.on_cpu(whole.model.layers[0].mlp.experts):  # already on the CPU: left as it is
        assert whole.model.layers[0].mlp.experts.down_proj is kept


def test_a_device_map_under_torchrun_with_several_processes_is_refused(tmp_path):
    from fcaudit.checkpoint_audit import _load
    from fcaudit.config import AuditConfig

    tiny_moe("mixtral", experts=E, top_k=K).save_pretrained(tmp_path / "ckpt")
    config = AuditConfig(out=tmp_path / "a", n_eval=4, n_calib=4, window=16, randomizations=1, batch_size=2,
                         device_map="auto")
    with pytest.raises(FcauditError, match="torchrun started 2 processes"):
        _load(str(tmp_path / "ckpt"), "embedded", config, torch.device("cpu"), 2)


def test_the_padding_probe_of_offloaded_experts_runs_on_their_weights_loaded_to_the_cpu(tmp_path, monkeypatch):
    """As on a GPU with CPU offload: the experts' padding is probed on the CPU (placement.on_cpu) while accelerate's
    hook loads their weights for each call; they are offloaded again afterwards."""
    from fcaudit import placement

    tiny_moe("gpt_oss", experts=E, top_k=K).save_pretrained(tmp_path / "ckpt")
    both = {**ON_DISK, "model.layers.0": "disk"}  # the first experts probed are offloaded
    placed = load_hf(tmp_path / "ckpt", device_map=both, offload_folder=tmp_path / "offload")
    monkeypatch.setattr(placement, "off_cpu", lambda t: True)  # as on an accelerator
    ctrl = moe_controller(placed)
    assert [s.codec.pad for s in routers_of(ctrl)] == ["repeat", "repeat"]
    assert all(p.is_meta for p in placed.model.layers[0].mlp.experts.parameters())


def test_variation_names_each_layers_site_where_the_first_block_is_dense(tmp_path):
    """DeepSeek-V3 with first_k_dense_replace=1: the audit's layer 0 is the router of model.layers.1."""
    import fcaudit as fca

    model = tiny_moe("deepseek_v3", experts=E, top_k=K, layers=3, first_k_dense_replace=1)
    ctrl = fca.controller_for(model)
    res = fca.audit(model, ctrl, _windows(4), _windows(2, seed=1), randomizations=1, out=tmp_path, batch_size=2,
                    quiet=True)
    layers = res.variation().layers
    assert [l["site"] for l in layers] == [s.path for s in ctrl.sites] and layers[0]["site"].startswith("model.layers.1.")


def test_a_capture_keeps_its_outputs_precision_which_the_store_may_widen():
    """A bf16 router's weights are stored as float32 (codecs.canonical_dtype); the layout check's tolerance is the
    precision the model computed in, which the capture returns with the coefficients (nothing on the site)."""
    model = tiny_moe("mixtral", experts=E, top_k=K, dtype=torch.bfloat16)
    ctrl = moe_controller(model)
    coeffs = capture(model, ctrl, ids_for()).coefficients
    assert coeffs[0].dtype == torch.float32 and coeffs.decoding[0].dtype == torch.bfloat16
    assert isinstance(coeffs.decoding[0], Decoding) and "dtype" not in vars(ctrl.sites[0])


def test_execution_under_static_conditions_replays_the_audits_profiles(tmp_path):
    """`fcaudit execution`'s static conditions replay the profiles the audit computes (one computation, bit for bit),
    and only StaticTopK keeps a static routing sparse: k experts per token where StaticMixMean runs every expert."""
    import fcaudit as fca
    from safetensors.torch import load_file

    from fcaudit import families
    from fcaudit.execution.conditions import condition_execution, static_coefficients
    from fcaudit.execution.latency import Timing, random_ids

    model = tiny_moe("mixtral")
    ctrl = fca.controller_for(model)
    calib = _windows(4, seed=1)
    fca.audit(model, ctrl, _windows(6), calib, randomizations=1, out=tmp_path / "audit", batch_size=2, quiet=True)
    profiles = load_file(str(tmp_path / "audit" / "profiles.safetensors"))
    statics = static_coefficients(model, ctrl, calib, batch=3, batch_size=2)
    assert list(statics) == ["LayerPositionMean", "StaticProfile", "StaticTopK", "StructureRemoved"]
    for name, coeffs in statics.items():
        for l, c in enumerate(coeffs):
            p = profiles[f"{name}.{l}"].to(c.dtype)
            assert c.shape[0] == 3 and torch.equal(c[0], p if p.dim() == 3 else p.expand(c.shape[1], -1, -1))

    ids = random_ids(model, 2, 12, torch.device("cpu"))
    df = condition_execution(model, families.for_model(model), calib, ids,
                             Timing(min_run_time=1e-3, repetitions=2, warmup=0)).set_index("condition")
    assert list(df.index) == ["Correct", *statics]
    assert df.loc["Correct", "experts_per_token"] == df.loc["StaticTopK", "experts_per_token"] == 2
    assert df.loc["StaticProfile", "experts_per_token"] == 4 and df.loc["StaticProfile", "active_expert_fraction"] == 1
    assert df.loc["Correct", "latency_vs_correct"] == 1 and (df["latency_ms"] > 0).all()


# ---- a researcher's own MoE, and routers found by structure ---------------------------------------------------------

class OwnRouter(torch.nn.Module):
    """Softmax top-k over its experts, renormalized: returns what transformers' routers return."""

    def __init__(self, hidden, experts, k):
        super().__init__()
        self.top_k, self.num_experts = k, experts
        self.weight = torch.nn.Parameter(torch.randn(experts, hidden) * 0.5)

    def forward(self, h):
        logits = h @ self.weight.T
        w, i = logits.softmax(-1).topk(self.top_k, dim=-1)
        return logits, w / w.sum(-1, keepdim=True), i


class OwnExperts(torch.nn.Module):
    def __init__(self, hidden, experts, inner=16):
        super().__init__()
        self.num_experts = experts
        self.w_in = torch.nn.Parameter(torch.randn(experts, inner, hidden) * 0.3)
        self.w_out = torch.nn.Parameter(torch.randn(experts, hidden, inner) * 0.3)

    def forward(self, h, index, weights):
        out = torch.zeros_like(h)
        for e in range(self.num_experts):  # an index outside the experts (padding) selects nothing
            tok, slot = torch.where(index == e)
            y = torch.relu(h[tok] @ self.w_in[e].T) @ self.w_out[e].T
            out.index_add_(0, tok, y * weights[tok, slot, None])
        return out


class OwnMoE(torch.nn.Module):
    def __init__(self, hidden, experts, k):
        super().__init__()
        self.router, self.experts = OwnRouter(hidden, experts, k), OwnExperts(hidden, experts)

    def forward(self, x):
        h = x.reshape(-1, x.shape[-1])
        _, w, i = self.router(h)
        return x + self.experts(h, i, w).reshape(x.shape)


class LogitsRouter(torch.nn.Module):
    def __init__(self, hidden, experts):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(experts, hidden) * 0.5)

    def forward(self, h):
        return h @ self.weight.T


class PickingMoE(torch.nn.Module):
    """Its router returns logits only; the block's own method picks the top-k (as DBRX's)."""

    def __init__(self, hidden, experts, k):
        super().__init__()
        self.top_k = k
        self.router, self.experts = LogitsRouter(hidden, experts), OwnExperts(hidden, experts)

    def pick(self, logits):
        w, i = logits.softmax(-1).topk(self.top_k, dim=-1)
        return w, i

    def forward(self, x):
        h = x.reshape(-1, x.shape[-1])
        w, i = self.pick(self.router(h))
        return x + self.experts(h, i, w).reshape(x.shape)


def sparse_attention(x, keys):
    """Each token mixes in the `keys` earlier tokens it scores highest (torch.topk fails on fewer positions)."""
    T = x.shape[1]
    scores = x @ x.transpose(1, 2) + torch.full((T, T), -torch.inf).triu(1)
    top = scores.topk(keys, dim=-1)
    picked = torch.gather(x.unsqueeze(1).expand(-1, T, -1, -1), 2,
                          top.indices.unsqueeze(-1).expand(-1, -1, -1, x.shape[-1]))
    return x + (top.values.softmax(-1).unsqueeze(-1) * picked).sum(2)


class OwnLM(torch.nn.Module):
    def __init__(self, vocab=256, hidden=16, experts=4, k=2, layers=2, keys=None, blocks=None):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(vocab, hidden)
        self.moes = torch.nn.ModuleList(block(hidden, experts, k) for block in (blocks or [OwnMoE] * layers))
        self.head = torch.nn.Linear(hidden, vocab)
        self.keys = keys

    def forward(self, ids):
        x = self.emb(ids)
        if self.keys:
            x = sparse_attention(x, self.keys)
        else:
            x = x.cumsum(1) / torch.arange(1, ids.shape[1] + 1).view(1, -1, 1)  # each token sees the ones before it
        for moe in self.moes:
            x = moe(x)
        return self.head(x)


def test_controller_for_finds_the_routers_of_a_users_own_moe_by_structure(tmp_path):
    """Not a transformers class (as a checkpoint's own code is not): the MoE discovery still finds its routers."""
    import fcaudit as fca

    model = OwnLM().eval()
    ctrl = fca.controller_for(model)
    assert [s.path for s in ctrl.sites] == ["moes.0.router", "moes.1.router"]
    assert [s.codec.pad for s in ctrl.sites] == ["sentinel", "sentinel"]
    res = fca.audit(model, ctrl, _windows(6), _windows(4, seed=1), randomizations=1, out=tmp_path, batch_size=3,
                    quiet=True)
    assert res.replay.bit_equal and res.replay.route_flips == 0
    assert abs(res.penalties().to_frame().loc["CrossInput", "statistic"]) > 0


def test_the_probe_runs_a_longer_window_where_a_sparse_attention_needs_more_keys_than_four_tokens(tmp_path):
    import fcaudit as fca

    model = OwnLM(keys=8).eval()
    with pytest.raises(RuntimeError):  # the discovery's first, 4-token probe fails
        model(torch.zeros(1, 4, dtype=torch.long))
    ctrl = fca.controller_for(model)
    assert [s.path for s in ctrl.sites] == ["moes.0.router", "moes.1.router"]
    res = fca.audit(model, ctrl, _windows(6), _windows(4, seed=1), randomizations=1, out=tmp_path, batch_size=3,
                    quiet=True)
    assert res.replay.bit_equal and res.replay.route_flips == 0


def test_a_model_that_fails_every_probe_window_is_refused_in_one_line():
    model = OwnLM(keys=4096).eval()  # more keys than the longest probe
    with pytest.raises(FcauditError, match="fails a 4-token forward pass .* every longer probe up to 2048 tokens") as err:
        moe_controller(model)
    assert "\n" not in str(err.value)


def _tiny(cls: str, **extra):
    common = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=4, max_position_embeddings=64, bos_token_id=None, eos_token_id=None,
                  pad_token_id=None)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(getattr(transformers, cls)(**{**common, **extra})).eval()


def _gemma4():  # its router reads top_k_experts and num_experts from its config: neither is its attribute
    return _tiny("Gemma4TextConfig", num_experts=E, top_k_experts=K, enable_moe_block=True, moe_intermediate_size=32,
                 head_dim=8, global_head_dim=8, hidden_size_per_layer_input=0)


def _ergo():  # its router has top_k but no expert count: that of its weight
    return _tiny("ErgoConfig", num_experts=E, num_experts_per_tok=K)


def _dbrx():  # its router returns logits only; its block's method picks the top-k; its experts are rows of 2-D weights
    return _tiny("DbrxConfig", d_model=32, n_heads=4, n_layers=2, max_seq_len=64,
                 attn_config={"kv_n_heads": 4, "rope_theta": 10000.0, "clip_qkv": 8.0},
                 ffn_config={"moe_num_experts": E, "moe_top_k": K, "ffn_hidden_size": 16})


@pytest.mark.parametrize("build, router", [(_gemma4, "Gemma4TextRouter"), (_ergo, "ErgoTopkRouter"), (_dbrx, "DbrxFFN")])
def test_a_router_without_top_k_or_expert_count_attributes_is_found_beside_its_experts(build, router):
    model = build()
    ctrl = moe_controller(model)
    assert {type(s.module).__name__ for s in ctrl.sites} == {router}
    assert all(s.codec.num_experts == E and s.codec.top_k == K for s in ctrl.sites)
    ids = ids_for()
    run = capture(model, ctrl, ids)
    assert torch.equal(replay_logits(model, ctrl, ids, run.coefficients), run.logits)
    other = run.like([c.roll(1, dims=-1) for c in run.coefficients])
    assert not torch.equal(replay_logits(model, ctrl, ids, other), run.logits)


def test_a_block_method_that_picks_the_top_k_is_the_site_where_the_router_returns_logits_only():
    """DBRX: the router returns logits; DbrxFFN.route_tokens_to_experts returns (top_k_weights, top_k_index), which
    its experts receive. Its experts refuse the sentinel index (IndexError), so rows are padded by repetition; the
    expert FLOPs measured inside them are the experts counted times one expert's cost."""
    model = _dbrx()
    ctrl = moe_controller(model)
    assert [s.name for s in ctrl.sites] == [f"transformer.blocks.{i}.ffn.route_tokens_to_experts" for i in range(2)]
    assert [s.codec.pad for s in ctrl.sites] == ["repeat", "repeat"]
    execution = expert_execution(model, ids_for(), ctrl)
    assert (execution.experts_per_token == K).all()
    per_pair = execution.dense_flops[0] // (4 * 12 * E)
    assert execution.expert_flops == [4 * 12 * K * per_pair] * 2 and per_pair == 2 * 3 * 16 * 32


@pytest.mark.parametrize("build", [_gemma4, _dbrx], ids=["gemma4", "dbrx"])
def test_checkpoints_whose_config_spells_the_moe_keys_otherwise_load_and_their_routers_are_found(build, tmp_path):
    """Gemma-4's top_k_experts, DBRX's ffn_config.moe_num_experts/moe_top_k: `fca.load` takes the checkpoint as an MoE
    (not 'no fcaudit family loads') and controller_for finds its routers."""
    import fcaudit as fca

    build().save_pretrained(tmp_path)
    model = fca.load(tmp_path)
    assert model.fcaudit_meta["variant"] == f"moe-{model.config.model_type}"
    assert len(fca.controller_for(model).sites) == 2


def test_a_users_moe_whose_block_picks_the_top_k_beside_one_whose_router_does_audits_exactly(tmp_path):
    import fcaudit as fca

    model = OwnLM(blocks=[OwnMoE, PickingMoE]).eval()
    ctrl = fca.controller_for(model)
    assert [s.name for s in ctrl.sites] == ["moes.0.router", "moes.1.pick"]
    assert [s.codec.parts for s in ctrl.sites] == [("logits", "weights", "index"), ("weights", "index")]
    res = fca.audit(model, ctrl, _windows(6), _windows(4, seed=1), randomizations=1, out=tmp_path, batch_size=3,
                    quiet=True)
    assert res.replay.bit_equal and res.replay.route_flips == 0
