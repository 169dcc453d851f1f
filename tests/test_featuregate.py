"""The FeatureGate family: shapes, the dense reference, gate ranges, each controller feature, checkpoints."""

import hashlib
import json
import math

import pytest
import torch
import torch.nn.functional as F

from fcaudit.errors import FcauditError
from fcaudit.families import load_model
from fcaudit.models.checkpoint import load_weights, save_checkpoint, save_weights
import fcaudit.models.featuregate as fg
from fcaudit.models.featuregate import PRESETS, VARIANTS, Attention, FeatureGateGPT, GPTConfig, config_for, gate_features

TINY = dict(n_layer=3, n_head=2, d_model=16, block_size=16, gate_hidden=8)


def tiny(variant: str, seed: int = 0, **kw) -> FeatureGateGPT:
    torch.manual_seed(seed)
    model = FeatureGateGPT(GPTConfig(variant=variant, **{**TINY, **kw}))
    with torch.no_grad():  # move learned gates off their common init so layers differ
        for name, p in model.named_parameters():
            if "gate" in name:
                p.add_(torch.randn_like(p) * 0.5)
    return model.eval()


@pytest.fixture
def ids():
    return torch.randint(0, 256, (3, 12), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_variant_has_the_right_shapes_and_gates_in_unit_interval(variant, ids):
    model = tiny(variant)
    logits, gates = model(ids, return_gates=True)
    assert logits.shape == (3, 12, 256)
    assert torch.isfinite(logits).all()
    if variant in ("dense", "fixeddepth"):
        assert gates is None and all(b.gate is None for b in model.blocks)
    else:
        assert gates.shape == (3, 3, 12)
        for l, block in enumerate(model.blocks):  # the gate module itself returns [B, T]
            assert block.gate is not None
        assert ((gates > 0) & (gates < 1)).all()


def test_gate_kinds_per_variant(ids):
    uniform = tiny("uniform")
    assert len({id(b.gate.logit) for b in uniform.blocks}) == 1  # one shared coefficient
    _, g = uniform(ids, return_gates=True)
    assert torch.all(g == g.flatten()[0])
    _, g = tiny("layerstatic")(ids, return_gates=True)
    per_layer = g.flatten(1)
    assert torch.all(per_layer == per_layer[:, :1]) and len(set(per_layer[:, 0].tolist())) == 3
    _, g = tiny("uniform-fixed")(ids, return_gates=True)
    assert torch.all(g == 0.6)
    _, g = tiny("uniform-matched", gate_value=0.5973)(ids, return_gates=True)
    assert torch.allclose(g, torch.tensor(0.5973))
    _, g = tiny("featuregate")(ids, return_gates=True)
    assert g.std(dim=(1, 2)).min() > 0  # per-token gates differ across tokens
    assert config_for("demo", "fixeddepth", fixed_depth=2).n_layer == 2
    with pytest.raises(FcauditError, match="unknown model variant"):
        GPTConfig(variant="moe")
    with pytest.raises(FcauditError, match="fixed_depth"):
        config_for("demo", "fixeddepth")


def reference_preln(model: FeatureGateGPT, ids: torch.Tensor) -> torch.Tensor:
    """An ungated pre-LN Transformer written out directly from the model's weights."""
    T = ids.size(1)
    H = model.config.n_head
    x = model.wte.weight[ids] + model.wpe.weight[:T]
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    for b in model.blocks:
        y = F.layer_norm(x, x.shape[-1:], b.ln1.weight, b.ln1.bias, model.config.norm_eps)
        q, k, v = (y @ b.attn.qkv.weight.T).split(x.size(-1), dim=-1)
        q, k, v = (t.view(*t.shape[:2], H, -1).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-1, -2) / math.sqrt(q.size(-1))).masked_fill(~mask, float("-inf")).softmax(-1)
        a = (att @ v).transpose(1, 2).reshape(x.shape) @ b.attn.proj.weight.T
        x = x + a
        y = F.layer_norm(x, x.shape[-1:], b.ln2.weight, b.ln2.bias, model.config.norm_eps)
        x = x + F.gelu(y @ b.mlp.fc.weight.T) @ b.mlp.proj.weight.T
    x = F.layer_norm(x, x.shape[-1:], model.ln_f.weight, model.ln_f.bias, model.config.norm_eps)
    return x @ model.wte.weight.T


def test_dense_equals_an_ungated_preln_transformer(ids):
    model = tiny("dense")
    with torch.no_grad():
        assert torch.allclose(model(ids), reference_preln(model, ids), atol=1e-5, rtol=1e-5)


def test_gate_one_reproduces_dense_and_gate_scales_the_whole_block_update(ids):
    dense, fixed = tiny("dense"), tiny("uniform-fixed", gate_value=0.5)
    fixed.load_state_dict(dense.state_dict())
    for block in fixed.blocks:  # a constant gate of 1 must give the dense model
        block.gate.value = 1.0
    with torch.no_grad():
        assert torch.allclose(fixed(ids), dense(ids), atol=1e-6)
        # with g = 0 every block is skipped: the logits only see the embeddings
        for block in fixed.blocks:
            block.gate.value = 0.0
        x = dense.wte(ids) + dense.wpe(torch.arange(ids.size(1)))
        assert torch.allclose(fixed(ids), dense.lm_head(dense.ln_f(x)), atol=1e-6)


def test_replacing_the_gate_forward_gives_bit_identical_logits_and_skips_the_controller(ids, monkeypatch):
    model = tiny("featuregate")
    with torch.no_grad():
        logits, gates = model(ids, return_gates=True)
        calls = []
        monkeypatch.setattr("fcaudit.models.featuregate.gate_features", lambda *a: calls.append(1))
        for l, block in enumerate(model.blocks):
            block.gate.forward = lambda *args, _g=gates[l]: _g
        replayed = model(ids)
    assert not calls  # the features were not computed
    assert torch.equal(replayed, logits)


@pytest.mark.parametrize("variant", ["uniform", "layerstatic", "featuregate"])
def test_with_gates_of_one_every_variant_computes_denses_logits_bit_for_bit(variant, ids):
    """With Dense's weights and every gate replaced by 1, a gated variant computes Dense's logits bit for bit, with and
    without gradients: every variant's attention output comes from the same operation, in every mode."""
    dense, gated = tiny("dense"), tiny(variant)
    gated.load_state_dict(dense.state_dict(), strict=False)
    for block in gated.blocks:
        block.gate.forward = lambda h, *args: torch.ones(h.shape[:2])
    for grad in (False, True):
        with torch.set_grad_enabled(grad):
            assert torch.equal(gated(ids), dense(ids))


# ---- features against direct computations -----------------------------------------------------------------------

def direct_attention(q, k):
    """P[b, n, t, s] for s <= t, written with explicit loops over positions."""
    B, H, T, D = q.shape
    P = torch.zeros(B, H, T, T, dtype=torch.float64)
    Z = torch.zeros(B, H, T, dtype=torch.float64)
    for t in range(T):
        s = (q[:, :, t:t + 1].double() @ k[:, :, : t + 1].double().transpose(-1, -2)).squeeze(-2) / math.sqrt(D)
        P[:, :, t, : t + 1] = torch.exp(s - s.max(-1, keepdim=True).values) / torch.exp(s - s.max(-1, keepdim=True).values).sum(-1, keepdim=True)
        Z[:, :, t] = torch.log(torch.exp(s.double()).sum(-1)) - math.log(t + 1)
    return P, Z


def features_of(h, upd, q, k, pq=None, pk=None, features=gate_features) -> torch.Tensor:
    return features(h, upd, Attention(q, k), None if pq is None else Attention(pq, pk))


@pytest.mark.parametrize("features", ["tiled", "map"])
def test_each_feature_equals_a_direct_computation(features):
    g = torch.Generator().manual_seed(0)
    B, H, T, D, d = 2, 3, 5, 4, 6
    q, k, pq, pk = (torch.randn(B, H, T, D, generator=g) for _ in range(4))
    h, upd = torch.randn(B, T, d, generator=g), torch.randn(B, T, d, generator=g)
    features = gate_features if features == "tiled" else reference_gate_features
    feats = features_of(h, upd, q, k, pq, pk, features=features).double()
    P, Z = direct_attention(q, k)
    Pp, _ = direct_attention(pq, pk)
    for b in range(B):
        for t in range(T):
            ent = [-sum(P[b, n, t, s] * math.log(P[b, n, t, s]) for s in range(t + 1)) for n in range(H)]
            exp_ent = 0.0 if t == 0 else sum(ent) / H / math.log(t + 1)
            kl = sum(sum(P[b, n, t, s] * math.log(P[b, n, t, s] / Pp[b, n, t, s]) for s in range(t + 1)) for n in range(H)) / H
            rel = h[b, t].double().norm().item()
            assert feats[b, t, 0].item() == pytest.approx(float(exp_ent), abs=1e-5)
            assert feats[b, t, 1].item() == pytest.approx(float(kl), abs=1e-5)
            assert feats[b, t, 2].item() == pytest.approx(Z[b, :, t].mean().item(), abs=1e-5)
            assert feats[b, t, 3].item() == pytest.approx(upd[b, t].double().norm().item() / (rel + 1e-6), rel=1e-5)
    first = features_of(h, upd, q, k, features=features)
    assert torch.all(first[..., 1] == 0)  # first layer: no previous attention, KL 0
    assert torch.allclose(first[..., [0, 2, 3]], feats[..., [0, 2, 3]].float())
    assert torch.all(feats[:, 0, 0] == 0) and (feats[..., 0] >= 0).all() and (feats[..., 0] <= 1 + 1e-6).all()


def test_features_are_detached_and_the_gate_sees_the_previous_blocks_attention(ids):
    model = tiny("featuregate")
    seen = []
    for block in model.blocks:
        block.gate.register_forward_hook(lambda m, args, out: seen.append(args))
    logits = model(ids)
    assert seen[0][3] is None
    for l in range(1, 3):  # block l's gate receives block l-1's attention, the one block l-1's gate read
        assert seen[l][3] is seen[l - 1][2]
    att, prev = seen[1][2:]
    feats = gate_features(seen[1][0], seen[1][1], Attention(att.q.detach().requires_grad_(), att.k), prev)
    assert not feats.requires_grad  # the controller reads the block, gradients do not flow into it through features
    logits.sum().backward()
    assert model.blocks[0].gate.fc.weight.grad is not None


def test_gates_do_not_depend_on_which_gates_ran(ids):
    """The engine's replay replaces some gates' forwards: the others, and a gate called on its own with fresh
    attention objects, get the same bits (each gate computes the previous block's lse where its gate did not)."""
    model = tiny("featuregate", n_layer=4)
    seen = []
    for block in model.blocks:
        block.gate.register_forward_hook(lambda m, args, out: seen.append(args))
    for grad in (False, True):
        with torch.set_grad_enabled(grad):
            seen.clear()
            logits, gates = model(ids, return_gates=True)
            args = [(h, upd, att.q, att.k, prev) for h, upd, att, prev in seen]
            for replaced in ([0], [1], [0, 2], [1, 2]):
                for l in replaced:
                    model.blocks[l].gate.forward = lambda *a, _g=gates[l]: _g
                out, g = model(ids, return_gates=True)
                for l in replaced:
                    del model.blocks[l].gate.forward
                assert torch.equal(out, logits) and torch.equal(g, gates)
        with torch.no_grad():
            for l, (h, upd, q, k, prev) in enumerate(args):
                fresh = None if prev is None else Attention(prev.q, prev.k)
                assert torch.equal(model.blocks[l].gate(h, upd, Attention(q, k), fresh), gates[l])


@pytest.fixture
def small_tiles(monkeypatch):
    """Tiles of 8 query rows and few maps, so small shapes exercise several tiles, partial tiles and map chunks."""
    monkeypatch.setattr(fg, "TILE_ROWS_CPU", (8, 8))
    monkeypatch.setattr(fg, "TILE_ELEMENTS", {"cpu": 8 * 8 * 37})


def reference_gate_features(h, update, att: Attention, prev: Attention | None) -> torch.Tensor:
    """The oracle: gate_features from the materialized float32 [B, H, T, T] maps. With X = S - max_s S and
    log P = X - log_z: H = log_z - sum_s P X and KL = sum_s P (X - X') - log_z + log_z'."""

    def causal(q, k):
        T, Dh = q.shape[-2:]
        s = (q.float() * Dh ** -0.5) @ k.float().transpose(-1, -2) + torch.full((T, T), fg.MASKED_SCORE).triu(1)
        x = s - s.amax(-1, keepdim=True)
        p = x.softmax(-1)
        log_z = -p.amax(-1).log()
        return x, p, log_z, s.amax(-1) + log_z

    with torch.no_grad():
        x, p, log_z, lse = causal(att.q, att.k)
        entropy_h = log_z - (p * x).sum(-1)
        kl_h = None
        if prev is not None:
            px, _, plog_z, _ = causal(prev.q, prev.k)
            kl_h = -entropy_h - ((p * px).sum(-1) - plog_z)
        # the four features of gate_features' docstring, from these per-head values
        log_visible = torch.arange(1, lse.shape[-1] + 1, dtype=torch.float32).log()
        entropy = entropy_h.mean(1).clamp_min(0.0) / log_visible
        entropy[:, 0] = 0.0  # one visible key
        kl = torch.zeros_like(entropy) if kl_h is None else kl_h.mean(1).clamp_min(0.0)
        log_partition = (lse - log_visible).mean(1)
        update_norm = update.float().norm(dim=-1) / (h.float().norm(dim=-1) + 1e-6)
        return torch.stack([entropy, kl, log_partition, update_norm], dim=-1)


def random_block(B, H, T, D, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    q, k, pq, pk = (torch.randn(B, H, T, D, generator=g) * scale for _ in range(4))
    h, upd = torch.randn(B, T, H * D, generator=g), torch.randn(B, T, H * D, generator=g)
    return h, upd, q, k, pq, pk


@pytest.mark.parametrize("shape", [(1, 1, 1, 4), (2, 3, 5, 4), (2, 2, 8, 8), (3, 4, 37, 16), (2, 3, 50, 32)])
@pytest.mark.parametrize("tiles", ["default", "small"])
def test_features_without_a_map_match_the_reference(shape, tiles, request):
    """T = 37 and 50 are no multiple of the small tile (8 rows), whose budget of 8*8*37 scores also splits the maps
    unevenly: 8 per tile at T = 37 (B*H = 12: 8 + 4), 5 at T = 50 (B*H = 6: 5 + 1)."""
    if tiles != "default":
        request.getfixturevalue("small_tiles")
    h, upd, q, k, pq, pk = random_block(*shape)
    for prev in [(pq, pk), ()]:  # a middle block and the first block (no previous attention)
        new = features_of(h, upd, q, k, *prev)
        ref = features_of(h, upd, q, k, *prev, features=reference_gate_features)
        # KL of unrelated random maps is about 2; float32 gets it to about 1e-6 relative (both versions)
        torch.testing.assert_close(new, ref, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(new[..., [0, 2, 3]], ref[..., [0, 2, 3]], atol=1e-6, rtol=0)


def float64_features(h, upd, q, k, pq, pk) -> torch.Tensor:
    """The four features straight from their definitions, in float64."""
    T, D = q.shape[-2:]
    future = ~torch.ones(T, T, dtype=torch.bool).tril()

    def log_p(q, k):
        s = (q.double() @ k.double().transpose(-1, -2) / math.sqrt(D)).masked_fill(future, float("-inf"))
        return s.log_softmax(-1), s.logsumexp(-1)

    (lp, lse), (lpp, _) = log_p(q, k), log_p(pq, pk)
    p, visible = lp.exp(), torch.arange(1, T + 1, dtype=torch.float64)
    entropy = -(p * lp.masked_fill(future, 0)).sum(-1).mean(1) / visible.log().clamp_min(1e-300)
    kl = (p * (lp - lpp).masked_fill(future, 0)).sum(-1).mean(1)
    norm = upd.double().norm(dim=-1) / (h.double().norm(dim=-1) + 1e-6)
    return torch.stack([entropy.masked_fill(visible == 1, 0), kl, (lse - visible.log()).mean(1), norm], -1)


def test_features_of_bfloat16_queries_and_keys_match_the_reference():
    h, upd, *qk = random_block(2, 3, 20, 24)  # Dh = 24: the 1/sqrt(Dh) scale is not exact in bfloat16
    qk = [t.bfloat16() for t in qk]
    torch.testing.assert_close(features_of(h, upd, *qk), features_of(h, upd, *qk, features=reference_gate_features),
                               atol=1e-6, rtol=1e-6)


def test_features_without_a_map_are_as_accurate_as_the_reference():
    """Against float64, with scores of std 1 and 9: the new features are no further from the truth."""
    for scale in (1.0, 3.0):
        block = random_block(2, 4, 40, 16, seed=3, scale=scale)
        truth = float64_features(*block)
        new = (features_of(*block).double() - truth).abs().amax((0, 1))
        ref = (features_of(*block, features=reference_gate_features).double() - truth).abs().amax((0, 1))
        assert (new <= ref * 1.5 + 2e-7).all(), (scale, new, ref)


def test_no_tile_of_scores_is_larger_than_the_budget(small_tiles):
    from torch.utils._python_dispatch import TorchDispatchMode

    class Largest(TorchDispatchMode):
        numel = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor):
                    Largest.numel = max(Largest.numel, t.numel())
            return out

    h, upd, q, k, pq, pk = random_block(2, 3, 48, 8)
    with Largest():
        features_of(h, upd, q, k, pq, pk)
    assert Largest.numel <= fg.TILE_ELEMENTS["cpu"] < 2 * 3 * 48 * 48  # the [B, H, T, T] maps would hold 13824


def test_gates_and_logits_of_a_trained_looking_model_match_the_reference(ids, monkeypatch):
    model = tiny("featuregate", n_layer=4, n_head=4, d_model=32)
    with torch.no_grad():  # sharper attention than at init, as after training
        for block in model.blocks:
            block.attn.qkv.weight.mul_(8.0)
        logits, gates = model(ids, return_gates=True)
        monkeypatch.setattr(fg, "gate_features", reference_gate_features)
        ref_logits, ref_gates = model(ids, return_gates=True)
    assert (gates - ref_gates).abs().max() <= 1e-6
    assert (logits - ref_logits).abs().max() <= 1e-6


def test_features_are_float32_under_autocast():
    g = torch.Generator().manual_seed(2)
    q, k, pq, pk = (torch.randn(1, 2, 6, 4, generator=g) for _ in range(4))
    h = torch.randn(1, 6, 8, generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        feats = features_of(h, h, q, k, pq, pk)
    assert feats.dtype == torch.float32 and torch.isfinite(feats).all()
    assert torch.allclose(feats, features_of(h, h, q, k, pq, pk), atol=1e-6)


# ---- checkpoints -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("variant", ["featuregate", "uniform", "layerstatic", "uniform-matched"])
def test_checkpoint_round_trip_is_bit_exact(tmp_path, ids, variant):
    model = tiny(variant, gate_value=0.6123)
    save_checkpoint(tmp_path / "ck", model, {"seed": 3})
    loaded, meta = load_model(tmp_path / "ck")
    assert meta == {"seed": 3} and loaded.config == model.config
    a, b = model.state_dict(), loaded.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert loaded.lm_head.weight is loaded.wte.weight  # tying survives the round trip
    with torch.no_grad():
        assert torch.equal(loaded(ids), model(ids))
    assert not list((tmp_path / "ck").glob(".*"))  # no temp files left behind


def test_checkpoint_bytes_are_the_same_on_every_save(tmp_path):
    """Uniform ties one logit across blocks: several ties, which safetensors' save_model wrote in a random order."""
    model = tiny("uniform")
    digests = {hashlib.sha256(save_weights(tmp_path / f"{i}.safetensors", model).read_bytes()).digest()
               for i in range(8)}
    assert len(digests) == 1
    loaded = tiny("uniform", seed=1)  # other weights: equal below only if loaded
    load_weights(tmp_path / "0.safetensors", loaded)
    assert len({id(b.gate.logit) for b in loaded.blocks}) == 1 and loaded.lm_head.weight is loaded.wte.weight
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in loaded.state_dict().items())


def test_checkpoint_errors_are_one_line_and_name_the_fix(tmp_path):
    ck = tmp_path / "ck"
    save_checkpoint(ck, tiny("featuregate"), {})
    weights = (ck / "model.safetensors").read_bytes()
    config = json.loads((ck / "config.json").read_text())

    def fails(match):
        with pytest.raises(FcauditError, match=match) as e:
            load_model(ck)
        assert "\n" not in str(e.value)

    (ck / "config.json").write_text(json.dumps({**config, "d_model": 32}))
    fails("do not match its config.json")
    (ck / "config.json").write_text(json.dumps({**config, "n_layer": 4}))
    fails("do not match its config.json")
    (ck / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))
    fails("model_type 'llama'")
    (ck / "config.json").write_text("{not json")
    fails("not valid JSON")
    (ck / "config.json").write_text(json.dumps(config))
    (ck / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    fails("corrupt or truncated")
    (ck / "model.safetensors").unlink()
    fails("no weights file")
    (ck / "config.json").unlink()
    fails("has no config.json")
    with pytest.raises(FcauditError, match="no checkpoint directory"):
        load_model(tmp_path / "missing")


def test_hub_id_offline_gives_one_line_error(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("fcaudit.hub.hub_reachable", lambda *a, **k: False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FcauditError, match="pass the local directory"):
        load_model("nobody-xyz/no-such-model")


def test_paper_presets_have_the_papers_sizes():
    """Count = 1-block model + (L-1) blocks, from two shallow models of the preset's width (no full-size init)."""
    from dataclasses import replace

    def count(preset):
        cfg = PRESETS[preset]
        one, two = (FeatureGateGPT(replace(cfg, n_layer=n)).n_params() for n in (1, 2))
        return one + (cfg.n_layer - 1) * (two - one)

    assert (PRESETS["paper-76m"].n_layer, PRESETS["paper-76m"].d_model, PRESETS["paper-76m"].n_head) == (24, 512, 8)
    assert round(count("paper-76m") / 1e6, 1) == 75.9
    assert (PRESETS["paper-504m"].n_layer, PRESETS["paper-504m"].d_model, PRESETS["paper-504m"].n_head) == (40, 1024, 16)
    assert round(count("paper-504m") / 1e6) == 504


def test_a_model_loaded_in_bfloat16_audits_with_exact_replay(tmp_path):
    """`--dtype bfloat16`: the features stay float32 (by definition), the gate's MLP computes in the weights' dtype."""
    import fcaudit as fca

    torch.manual_seed(0)
    model = FeatureGateGPT(config_for("tiny", "featuregate"))
    with torch.no_grad():  # gates that vary over tokens and inputs, as after training
        for block in model.blocks:
            for p in block.gate.parameters():
                p.add_(torch.randn_like(p) * 0.5)
    model = model.to(torch.bfloat16).eval()
    windows = torch.randint(0, 256, (10, 32), generator=torch.Generator().manual_seed(1))
    res = fca.audit(model, fca.controller_for(model), windows[:6], windows[6:], randomizations=2,
                    out=tmp_path / "audit", batch_size=3, quiet=True)
    assert res.replay.bit_equal and res.config["model"]["dtype"] == "bfloat16"
    assert res.penalties()["CrossInput"].statistic != 0
