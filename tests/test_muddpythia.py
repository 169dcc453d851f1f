"""MUDDPythia: checkpoint format, forward pass against independent computations, controller site, adapter."""

import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from fcaudit.errors import FcauditError
from fcaudit.models.muddpythia import (BYTE_PRESETS, MUDDConfig, MUDDPythia, apply_rotary, from_pretrained,
                                       rotary_table)

# 3 layers, intermediate 128: FFN widths round(128*(i/2+0.5)/128)*128 = 0 (round(0.5) ties to even), 128, 256
TINY = dict(block_size=64, vocab_size=300, n_layer=3, n_head=4, dim=64, intermediate_size=128, use_qk_norm=True,
            expand_last=True, round64=True)
PUBLISHED = dict(block_size=2048, vocab_size=50432, n_layer=24, n_head=16, n_local_heads=16, dim=2048,
                 intermediate_size=8192, rope_base=10000, rotary_pct=0.25, norm_eps=1e-5, use_qk_norm=True,
                 use_parallel_residual=True, use_linear_bias=True, dense=True, dynamic_dense=True, dense_type="qkvr",
                 sepln=True, stack_hidden=False, expand_last=True, round64=True, tie_word_embeddings=False)


def tiny_model(dtype=torch.float32, seed=0) -> MUDDPythia:
    torch.manual_seed(seed)
    model = MUDDPythia(MUDDConfig(**TINY))
    with torch.no_grad():  # a trained-looking model: active controller, non-trivial static mix and norms
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model.to(dtype).eval()


def ids(batch=2, T=24, seed=1, vocab=300):
    return torch.randint(0, vocab, (batch, T), generator=torch.Generator().manual_seed(seed))


def expected_keys(cfg: MUDDConfig) -> dict[str, tuple]:
    """The published state-dict keys and shapes, written out from the spec."""
    d, hd = cfg.dim, cfg.head_dim
    keys = {"tok_embeddings.weight": (cfg.vocab_size, d), "norm.weight": (d,), "norm.bias": (d,),
            "output.weight": (cfg.vocab_size, d)}
    for i in range(cfg.n_layer):
        p = f"layers.{i}."
        for w in ("wq", "wk", "wv", "wo"):
            keys[p + f"attention.{w}.weight"] = (d, d)
            keys[p + f"attention.{w}.bias"] = (d,)
        keys[p + "attention.q_norm.weight"] = keys[p + "attention.k_norm.weight"] = (hd,)
        norms = ["attention_norm"] if i == 0 else [f"attention_norms.{n}" for n in range(3)]
        for n in norms + ["ffn_norm"]:
            keys[p + n + ".weight"] = keys[p + n + ".bias"] = (d,)
        ffn = round(cfg.intermediate_size * (i / (cfg.n_layer - 1) + 0.5) / 128) * 128
        keys[p + "feed_forward.w1.weight"], keys[p + "feed_forward.w1.bias"] = (ffn, d), (ffn,)
        keys[p + "feed_forward.w2.weight"], keys[p + "feed_forward.w2.bias"] = (d, ffn), (d,)
        C, l = (1 if i == cfg.n_layer - 1 else 4), i + 2
        hidden = l * C * (4 if i == cfg.n_layer - 1 else 1)
        hidden = (hidden // 64 + 1) * 64
        keys[f"dynamic_dense.{i}.w1.weight"] = (hidden, d)
        keys[f"dynamic_dense.{i}.w2.weight"] = (C * l, hidden)
        keys[f"dense_bs.{i}"] = (C, l)
    return keys


# ------------------------------------------------------------------------------------------ shapes and config

def test_state_dict_keys_and_shapes_match_the_published_layout():
    model = tiny_model()
    got = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert got == expected_keys(model.config)
    assert got["layers.0.feed_forward.w1.weight"] == (0, 64)  # zero-width FFN at layer 0
    assert model(ids()).shape == (2, 24, 300)


def test_published_config_widths_and_parameter_count():
    cfg = MUDDConfig.from_dict({"model_type": "muddpythia", "torch_dtype": "bfloat16", "auto_map": {}, **PUBLISHED})
    assert cfg.head_dim == 128 and cfg.rotary_ndims == 32
    assert [cfg.ffn_width(i) for i in (0, 1, 12, 23)] == [4096, 4480, 8320, 12288]
    # l*C = 8 -> 64 (round64 always adds a step); layer 22: 96 -> 128; last: 25*1*4 = 100 -> 128
    assert [cfg.controller_hidden(i) for i in (0, 14, 22, 23)] == [64, 128, 128, 128]
    assert cfg.controller_hidden(14) == 64 + 64  # 16*4 = 64 is already a multiple and still gets a step
    expected = sum(math.prod(s) for s in expected_keys(cfg).values())
    with torch.device("meta"):
        model = MUDDPythia(cfg)
    assert sum(p.numel() for p in model.parameters()) == expected
    assert round(expected / 1e9, 3) == 1.420


def test_config_round_trip_and_defaults():
    cfg = MUDDConfig.from_dict({"n_layer": 2, "n_head": 4, "dim": 32, "vocab_size": 50})
    assert (cfg.n_local_heads, cfg.intermediate_size, cfg.expand_last, cfg.round64, cfg.use_qk_norm) == (4, 128, False, False, False)
    d = MUDDConfig(**TINY).to_dict()
    assert d["model_type"] == "muddpythia" and "torch_dtype" in d
    assert MUDDConfig.from_dict(d) == MUDDConfig(**TINY)
    with pytest.raises(FcauditError, match="stack_hidden"):
        MUDDConfig(**TINY, stack_hidden=True)


# ------------------------------------------------------------------------------------------ checkpoints

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_save_and_load_strict_identical_logits(tmp_path, dtype):
    model = tiny_model(dtype)
    model.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["model_type"] == "muddpythia" and cfg["torch_dtype"] == str(dtype).removeprefix("torch.")
    assert {v.dtype for v in load_file(tmp_path / "model.safetensors").values()} == {dtype}
    loaded = from_pretrained(tmp_path)
    assert loaded.dtype == dtype
    x = ids()
    with torch.no_grad():
        assert torch.equal(loaded(x), model(x))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]  # no temp files
    as32 = from_pretrained(tmp_path, dtype="float32")
    assert as32.dtype == torch.float32


def test_sharded_safetensors_and_pytorch_bin_load(tmp_path):
    model = tiny_model()
    model.save_pretrained(tmp_path / "ref")
    state = model.state_dict()
    x = ids()
    with torch.no_grad():
        want = model(x)

    sharded = tmp_path / "sharded"
    sharded.mkdir()
    (sharded / "config.json").write_text((tmp_path / "ref" / "config.json").read_text())
    keys = sorted(state)
    parts = [keys[: len(keys) // 2], keys[len(keys) // 2:]]
    weight_map = {}
    for n, part in enumerate(parts, 1):
        name = f"model-{n:05d}-of-00002.safetensors"
        save_file({k: state[k].contiguous() for k in part}, sharded / name)
        weight_map.update({k: name for k in part})
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    with torch.no_grad():
        assert torch.equal(from_pretrained(sharded)(x), want)

    binary = tmp_path / "bin"
    binary.mkdir()
    (binary / "config.json").write_text((tmp_path / "ref" / "config.json").read_text())
    torch.save(state, binary / "pytorch_model.bin")
    with torch.no_grad():
        assert torch.equal(from_pretrained(binary)(x), want)


def _broken_checkpoint(tmp_path, edit):
    model = tiny_model()
    model.save_pretrained(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    edit(state)
    save_file(state, tmp_path / "model.safetensors")
    return tmp_path


def test_missing_extra_and_misshaped_keys_are_named(tmp_path):
    def missing(s):
        del s["dense_bs.1"]

    def extra(s):
        s["layers.0.attention_norms.0.weight"] = torch.ones(64)

    def misshaped(s):
        s["dynamic_dense.2.w2.weight"] = torch.zeros(5, 128)

    for name, edit, key in [("m", missing, "dense_bs.1"), ("e", extra, "layers.0.attention_norms.0.weight"),
                            ("s", misshaped, "dynamic_dense.2.w2.weight")]:
        path = _broken_checkpoint(tmp_path / name, edit)
        with pytest.raises(FcauditError) as err:
            from_pretrained(path)
        assert key in str(err.value) and "\n" not in str(err.value)


def test_bad_paths_and_offline_hub_give_one_line_errors(tmp_path, monkeypatch):
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    with pytest.raises(FcauditError, match="no checkpoint directory"):
        from_pretrained(tmp_path / "nope")
    with pytest.raises(FcauditError, match="no config.json"):
        from_pretrained(tmp_path)

    def offline(*args, **kwargs):
        raise LocalEntryNotFoundError("offline mode is enabled")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    monkeypatch.setattr("fcaudit.hub.hub_reachable", lambda: False)
    with pytest.raises(FcauditError) as err:
        from_pretrained("Caiyun-AI/MUDDPythia-1.4B", revision="3c241c8")
    msg = str(err.value)
    assert "local" in msg and "Caiyun-AI/MUDDPythia-1.4B" in msg and "3c241c8" in msg and "\n" not in msg


def test_window_longer_than_block_size_is_refused():
    with pytest.raises(FcauditError, match="block_size"):
        tiny_model()(ids(1, 65))


# ------------------------------------------------------------------------------------------ forward pass

def _trace(model, x):
    """Capture dw (controller outputs), hiddens (embedding + block outputs), block inputs and final-norm input."""
    rec = {"dw": {}, "h": {}, "inp": {}}
    hooks = [model.tok_embeddings.register_forward_hook(lambda m, a, o: rec["h"].__setitem__(0, o))]
    for i in range(model.config.n_layer):
        hooks.append(model.dynamic_dense[i].register_forward_hook(lambda m, a, o, i=i: rec["dw"].__setitem__(i, o)))
        hooks.append(model.layers[i].register_forward_hook(lambda m, a, o, i=i: rec["h"].__setitem__(i + 1, o)))
        hooks.append(model.layers[i].register_forward_pre_hook(lambda m, a, i=i: rec["inp"].__setitem__(i, a[0])))
    hooks.append(model.norm.register_forward_pre_hook(lambda m, a: rec["inp"].__setitem__("final", a[0])))
    with torch.no_grad():
        logits = model(x)
    for h in hooks:
        h.remove()
    return rec, logits


def test_mixing_matches_direct_computation_including_the_single_stream_last_layer():
    model = tiny_model()
    rec, _ = _trace(model, ids())
    L = model.config.n_layer
    for i in range(L):
        dw = rec["dw"][i]
        C = 1 if i == L - 1 else 4
        assert dw.shape == (C, 2, 24, i + 2)
        # dw = controller MLP + dense_bs[i]
        h = rec["h"][i + 1]
        normed = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)
        mlp = model.dynamic_dense[i].w2(F.gelu(model.dynamic_dense[i].w1(normed))).detach()
        want_dw = mlp.view(2, 24, C, i + 2).permute(2, 0, 1, 3) + model.dense_bs[i].detach()[:, None, None, :]
        torch.testing.assert_close(dw, want_dw)
        streams = [sum(dw[c, :, :, j, None].double() * rec["h"][j].double() for j in range(i + 2)) for c in range(C)]
        got = rec["inp"]["final"] if i == L - 1 else rec["inp"][i + 1]
        got = [got] if i == L - 1 else list(got)
        assert len(got) == C
        for c in range(C):
            torch.testing.assert_close(got[c].double(), streams[c], rtol=1e-6, atol=1e-6)


def _reference_attention(attn, xq, xk, xv, cfg):
    """Straightforward attention: float64, NeoX rotate-half (non-interleaved) on the float16-rounded table."""
    B, T, _ = xq.shape
    H, D, n = cfg.n_head, cfg.head_dim, cfg.rotary_ndims

    def proj(lin, x):
        return (x.double() @ lin.weight.double().T + lin.bias.double()).view(B, T, H, D)

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.norm_eps) * w.double()

    inv = 1.0 / (cfg.rope_base ** (torch.arange(0, n, 2, dtype=torch.float64) / n))
    ang = torch.arange(T, dtype=torch.float64)[:, None] * inv[None]
    cos = torch.cos(ang).to(torch.float16).double().repeat(1, 2)[None, :, None]  # the spec's float16 table
    sin = torch.sin(ang).to(torch.float16).double().repeat(1, 2)[None, :, None]

    def rope(x):
        r, rest = x[..., :n], x[..., n:]
        half = torch.cat([-r[..., n // 2:], r[..., : n // 2]], -1)
        return torch.cat([r * cos + half * sin, rest], -1)

    q = rope(rms(proj(attn.wq, xq), attn.q_norm.weight)).transpose(1, 2)
    k = rope(rms(proj(attn.wk, xk), attn.k_norm.weight)).transpose(1, 2)
    v = proj(attn.wv, xv).transpose(1, 2)
    scores = q @ k.transpose(-1, -2) / math.sqrt(D)
    scores = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    y = (scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, H * D)
    return y @ attn.wo.weight.double().T + attn.wo.bias.double()


def test_attention_and_rotary_match_an_independent_implementation():
    model = tiny_model()
    cfg, attn = model.config, model.layers[1].attention
    g = torch.Generator().manual_seed(3)
    xq, xk, xv = (torch.randn(2, 20, 64, generator=g) for _ in range(3))
    with torch.no_grad():
        got = attn(xq, xk, xv, model.rope(torch.device("cpu")))
    torch.testing.assert_close(got.double(), _reference_attention(attn, xq, xk, xv, cfg), rtol=1e-5, atol=1e-5)


def test_interleaved_rotary_is_a_permutation_of_half_rotation_with_equal_scores():
    n, T = 8, 10
    table = rotary_table(64, n, 10000.0)
    assert table.dtype == torch.float16 and table.shape == (64, n // 2, 2)
    g = torch.Generator().manual_seed(5)
    q, k = torch.randn(1, T, 2, 12, generator=g), torch.randn(1, T, 2, 12, generator=g)
    cos, sin = table[:T, :, 0].float().repeat(1, 2)[None, :, None], table[:T, :, 1].float().repeat(1, 2)[None, :, None]

    def half(x):
        r = x[..., :n]
        return torch.cat([r * cos + torch.cat([-r[..., n // 2:], r[..., : n // 2]], -1) * sin, x[..., n:]], -1)

    perm = torch.tensor([j // 2 + (n // 2) * (j % 2) for j in range(n)] + list(range(n, 12)))  # 2j <- j, 2j+1 <- j+n/2
    assert torch.equal(apply_rotary(q, table), half(q)[..., perm])
    scores = lambda a, b: torch.einsum("bthd,bshd->bhts", a, b)
    torch.testing.assert_close(scores(apply_rotary(q, table), apply_rotary(k, table)), scores(half(q), half(k)))


# ------------------------------------------------------------------------------------------ controller site

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_replacing_the_controller_forward_is_bit_exact(dtype):
    model = tiny_model(dtype)
    x = ids()
    rec, want = _trace(model, x)
    calls = []
    for i, dd in enumerate(model.dynamic_dense):
        dd.forward = (lambda t: lambda *a, **k: calls.append(1) or t)(rec["dw"][i].clone())
    try:
        with torch.no_grad():
            got = model(x)
    finally:
        for dd in model.dynamic_dense:
            del dd.forward
    assert len(calls) == model.config.n_layer and got.dtype == dtype
    assert torch.equal(got, want)
    with torch.no_grad():  # changing the replayed coefficients changes the output: the replay is really used
        for i, dd in enumerate(model.dynamic_dense):
            dd.forward = (lambda t: lambda *a, **k: t)(rec["dw"][i].flip(2))
        assert not torch.equal(model(x), want)
        for dd in model.dynamic_dense:
            del dd.forward


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_adapter_capture_and_replay_through_the_engine(dtype):
    from fcaudit.families import controller_for

    model = tiny_model(dtype)
    ctrl = controller_for(model)
    assert [s.path for s in ctrl.sites] == ["dynamic_dense.0", "dynamic_dense.1", "dynamic_dense.2"]
    assert ctrl.labels == {"StaticProfile": "StaticMixMean", "StructureRemoved": "SourceUniformMean"}
    assert [(s.kind, s.reference) for s in ctrl.sites] == [("source_mixture", "SourceUniformMean")] * 3
    x = ids()
    with torch.no_grad(), ctrl.capture(2, 24) as found:
        want = model(x)
    assert [tuple(c.shape) for c in found] == [(2, 24, 4, 2), (2, 24, 4, 3), (2, 24, 1, 4)]
    rec, _ = _trace(model, x)
    assert torch.equal(found[2][:, :, 0, :], rec["dw"][2][0])  # canonical [batch, token, stream, source]
    with torch.no_grad(), ctrl.replay(found):
        got = model(x)
    assert torch.equal(got, want)


def test_mudd_profiles_and_token_shuffle_on_ragged_coefficients():
    from fcaudit import protocol
    from fcaudit.families import controller_for
    from fcaudit.protocol import shuffle_tokens

    model = tiny_model()
    ctrl = controller_for(model)
    sums = None
    for seed in (1, 2):
        with torch.no_grad(), ctrl.capture(2, 24) as found:
            model(ids(seed=seed))
        batch = [c.double().sum(0) for c in found]
        sums = batch if sums is None else [a + b for a, b in zip(sums, batch)]
    cal = protocol.Calibration(sums, 4, ctrl.info.top_k)
    static, lpm = cal.layer_mean(), cal.layer_position_mean()
    assert [tuple(p.shape) for p in static] == [(4, 2), (4, 3), (1, 4)]
    assert [tuple(p.shape) for p in lpm] == [(24, 4, 2), (24, 4, 3), (24, 1, 4)]
    for static, removed in zip(static, protocol.reference_profiles(cal, ctrl.info)):
        torch.testing.assert_close(removed.sum(-1), static.sum(-1))  # signed sum per (layer, stream) kept
        assert torch.allclose(removed, removed[:, :1].expand_as(removed))  # uniform over sources
    coeffs = [c.clone() for c in found]
    shuffled = shuffle_tokens(coeffs, np.array([0, 1]), seed=0, r=0)
    for c, s in zip(coeffs, shuffled):
        for b in range(2):
            for st in range(c.shape[2]):
                src = {tuple(v.tolist()) for v in c[b, :, st]}
                assert {tuple(v.tolist()) for v in s[b, :, st]} == src  # whole source vectors move
        assert not torch.equal(c, s)


# ------------------------------------------------------------------------------------------ byte presets

def test_byte_presets_train_from_random_init():
    assert {"tiny", "demo"} <= set(BYTE_PRESETS) and all(c.vocab_size == 256 for c in BYTE_PRESETS.values())
    torch.manual_seed(0)
    model = MUDDPythia(BYTE_PRESETS["tiny"])
    for i, bs in enumerate(model.dense_bs):  # starts as a plain residual stream: take the latest hidden state
        assert torch.equal(bs, F.one_hot(torch.tensor(i + 1), i + 2).float().expand_as(bs))
    text = np.frombuffer(b"def f(x):\n    return x + 1\n" * 200, dtype=np.uint8).astype(np.int64)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rng = np.random.default_rng(0)
    losses = []
    for _ in range(15):
        starts = rng.integers(0, len(text) - 33, 4)
        x = torch.from_numpy(np.stack([text[s: s + 32] for s in starts]))
        loss = F.cross_entropy(model(x)[:, :-1].reshape(-1, 256), x[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[0] > 5.0 and np.mean(losses[-3:]) < 3.0
    assert model.dynamic_dense[0].w2.weight.abs().sum() > 0  # the controller learns too


def test_training_after_an_inference_mode_forward():
    model = MUDDPythia(BYTE_PRESETS["tiny"])
    x = ids(2, 16, vocab=256)
    with torch.inference_mode():  # e.g. an evaluation before the first training step builds the rotary table
        model(x)
    model(x).sum().backward()
    assert model.layers[0].attention.wq.weight.grad is not None


# ------------------------------------------------------------------------------------------ tokenizer

def test_tokenizer_from_checkpoint_dir_and_offline_hub(tmp_path, monkeypatch):
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError
    from tokenizers import Tokenizer, models, pre_tokenizers

    from fcaudit.tokens import encode, load_tokenizer

    vocab = {"[UNK]": 0, "the": 1, "cat": 2, "sat": 3, "on": 4, "mat": 5}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    loaded = load_tokenizer(tmp_path)
    ids_ = encode(loaded, ["the cat sat", "on the mat", "dog"])
    assert ids_.dtype == np.int64 and ids_.tolist() == [1, 2, 3, 4, 1, 5, 0]
    assert encode(load_tokenizer(tmp_path / "tokenizer.json"), "the mat").tolist() == [1, 5]
    (tmp_path / "empty").mkdir()
    with pytest.raises(FcauditError, match="no tokenizer.json"):
        load_tokenizer(tmp_path / "empty")

    def offline(*args, **kwargs):
        raise LocalEntryNotFoundError("offline mode is enabled")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", offline)
    monkeypatch.setattr("fcaudit.hub.hub_reachable", lambda: False)
    with pytest.raises(FcauditError) as err:
        load_tokenizer("Caiyun-AI/MUDDPythia-1.4B", revision="3c241c8")
    assert "local" in str(err.value) and "\n" not in str(err.value)


# ------------------------------------------------------------------------------------------ the whole audit

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_audit_of_a_tiny_mudd_replays_exactly(tmp_path, dtype):
    from safetensors.torch import load_file

    from fcaudit.auditor import AuditResult, audit
    from fcaudit.families import controller_for

    model = tiny_model(dtype)
    ev, ca = ids(4, 16, seed=10), ids(4, 16, seed=11)
    result = audit(model, controller_for(model), ev, ca, randomizations=2, seed=0, out=tmp_path, batch_size=2,
                   quiet=True)
    assert result.replay.passed and result.replay.max_abs_dlogit == 0.0
    assert AuditResult.load(tmp_path).labels["StructureRemoved"] == "SourceUniformMean"
    recs = result.records
    assert set(recs.condition) == {"Correct", "CrossInput", "TokenShuffle", "CrossShuffle", "TokenResamplePast",
                                   "LayerPositionMean", "StaticProfile", "StructureRemoved"}
    with torch.no_grad():  # Correct is the unmodified model's NLL
        from fcaudit.loss import token_nll
        correct = token_nll(model(ev), ev).mean(1).double().numpy()
    got = recs[recs.condition == "Correct"].sort_values("example").nll.to_numpy()
    np.testing.assert_allclose(got, correct, rtol=1e-6)
    prof = load_file(str(tmp_path / "profiles.safetensors"))
    assert [tuple(prof[f"StaticProfile.{l}"].shape) for l in range(3)] == [(4, 2), (4, 3), (1, 4)]
    assert (recs[recs.condition != "Correct"].nll.to_numpy() != got.mean()).any()


# ------------------------------------------------------------------------------------------ fast mix

# Measured agreement of mix_stacked with the published-order mix (tests below; seeds fixed), max |delta|:
# float32: streams of the 1.4B width (D = 2048, J = 2..25 sources, values up to ~11) 2.9e-6, tiny-model logits 8e-7;
# bfloat16: streams 0.19 (against float64 the published order is off by up to 0.17, the matrix product by 0.03: it
# rounds once instead of after every source), tiny-model logits 0.018. A random MUDDPythia-1.4B in bfloat16 (1 x 64
# tokens, benchmarks/mix_speed.py --full-1p4b): logits up to 4.6 differ by up to 0.82 between the two paths; against
# float32 arithmetic on the same weights the published order is off by up to 1.93, the fast path by 1.49.
FAST_MIX_TOLERANCE = {torch.float32: dict(stream=5e-6, logit=2e-6), torch.bfloat16: dict(stream=0.25, logit=0.04)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fast_mix_agrees_with_the_published_order_on_1p4b_shaped_layers(dtype):
    from fcaudit.models.muddpythia import mix, mix_stacked

    g = torch.Generator().manual_seed(0)
    cfg = MUDDConfig(**PUBLISHED)
    worst, worst_exact = 0.0, {"published": 0.0, "fast": 0.0}
    for i in (0, 11, 22, 23):  # 2, 13, 24 sources with 4 streams; 25 sources with the last layer's single stream
        J, C = i + 2, cfg.n_streams(i)
        hs = [torch.randn(1, 8, cfg.dim, generator=g).to(dtype) for _ in range(J)]
        dw = (torch.randn(C, 1, 8, J, generator=g) * 0.5).to(dtype)
        published, fast = mix(dw, hs), mix_stacked(dw, torch.stack(hs, 2))
        assert len(fast) == C and all(f.shape == (1, 8, cfg.dim) and f.dtype == dtype for f in fast)
        exact = [sum(dw[c, :, :, j, None].double() * hs[j].double() for j in range(J)) for c in range(C)]
        for c in range(C):
            worst = max(worst, (published[c].double() - fast[c].double()).abs().max().item())
            for name, got in (("published", published[c]), ("fast", fast[c])):
                worst_exact[name] = max(worst_exact[name], (got.double() - exact[c]).abs().max().item())
    assert worst <= FAST_MIX_TOLERANCE[dtype]["stream"]
    assert worst_exact["fast"] <= worst_exact["published"] * 1.01  # no less accurate than the published order


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fast_mix_logits_agree_and_its_audit_replays_exactly(tmp_path, dtype):
    from fcaudit.auditor import audit
    from fcaudit.families import controller_for

    model = tiny_model(dtype)
    x = ids()
    with torch.no_grad():
        published = model(x)
        model.fast_mix = True
        fast = model(x)
    assert not torch.equal(fast, published)  # really the other path
    assert (fast.float() - published.float()).abs().max() <= FAST_MIX_TOLERANCE[dtype]["logit"]
    if dtype == torch.bfloat16:  # about as far from float32 arithmetic (same weights) as the published order
        with torch.no_grad():
            exact = tiny_model(torch.bfloat16).float()(x)
        assert (fast.float() - exact).abs().max() <= (published.float() - exact).abs().max() * 1.25
    rec, want = _trace(model, x)  # the controller site is unchanged: replaying its output is bit-exact
    assert torch.equal(want, fast)
    for i, dd in enumerate(model.dynamic_dense):
        dd.forward = (lambda t: lambda *a, **k: t)(rec["dw"][i])
    with torch.no_grad():
        assert torch.equal(model(x), fast)
    for dd in model.dynamic_dense:
        del dd.forward
    result = audit(model, controller_for(model), ids(4, 16, seed=10), ids(4, 16, seed=11), randomizations=1,
                   seed=0, out=tmp_path, batch_size=2, quiet=True)
    assert result.replay.passed and result.replay.max_abs_dlogit == 0.0


def test_fast_mix_is_off_by_default_and_refuses_gradients():
    model = tiny_model()
    assert model.fast_mix is False and MUDDPythia(MUDDConfig(**TINY), fast_mix=True).fast_mix
    model.fast_mix = True
    with pytest.raises(FcauditError, match="fast_mix = False to train"):
        model(ids())
