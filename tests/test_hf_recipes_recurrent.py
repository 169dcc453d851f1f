"""The recipes of transformers' state-space and recurrent mixers (families/hf/recipes.py, RECURRENT): one tiny model
per controller class, built from its transformers config, saved with save_pretrained and audited with zero code. Each
must name its sites with the right kind and layout, replay bit-exactly, and read coefficients that follow the input."""

import json
import logging

import pytest
import torch
from torch import nn

import transformers  # noqa: E402  (a test dependency: the test extra includes the hf extra)

import fcaudit as fca  # noqa: E402
from fcaudit.families.hf import recipes, require_transformers  # noqa: E402
from harness import api_refusal, cli, ok, refusal  # noqa: E402

SMALL = dict(vocab_size=256, hidden_size=32, num_hidden_layers=2, pad_token_id=None, bos_token_id=None,
             eos_token_id=None)
ATTENTION = dict(num_attention_heads=2, num_key_value_heads=2, intermediate_size=64)
# Mamba-2 sizes whose B and C (4 heads x 16 states) are not the hidden width: a coincidence the checks would flag
MAMBA2_HEADS = dict(mamba_n_heads=4, mamba_d_head=16, mamba_d_state=16, mamba_chunk_size=8)


def saved(tmp_path, model_type: str, noise: float = 0.0, **config):
    """A seeded tiny model of `model_type` saved as a checkpoint directory. `noise` moves every weight by seeded
    Gaussian noise, as a little training would: some controllers start at zero (xLSTM's gates)."""
    cfg = transformers.AutoConfig.for_model(model_type, **{**SMALL, **config})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        g = torch.Generator().manual_seed(1)
        for p in model.parameters():
            p.add_(noise * torch.randn(p.shape, generator=g))
    model.save_pretrained(tmp_path / model_type)
    return tmp_path / model_type


def windows(n: int, seed: int):
    return torch.randint(0, 256, (n, 16), generator=torch.Generator().manual_seed(seed))


def audited(ckpt, out):
    """`fca.load` + `fca.controller_for` + `fca.audit`: 4 + 4 windows of 16 tokens, R = 2."""
    model = fca.load(ckpt, device="cpu")
    ctrl = fca.controller_for(model)
    return model, ctrl, fca.audit(model, ctrl, windows(4, 0), windows(4, 1), randomizations=2, seed=0, out=out,
                                  batch_size=4, quiet=True)


def follow_the_input(model, ctrl) -> list[bool]:
    """Per site: whether its coefficients differ between two batches of other tokens."""
    runs = []
    for seed in (5, 6):
        ids = windows(2, seed)
        with ctrl.capture(*ids.shape) as found, torch.no_grad():
            model(input_ids=ids)
        runs.append(list(found))
    return [not torch.equal(a, b) for a, b in zip(*runs)]


def recipe_sites(ctrl) -> list[tuple[str, str | None, str]]:
    """(kind, op, layout as written) of each site a recipe names (not a router's)."""
    return [(s.kind, s.op, s.codec.given or s.codec.pattern) for s in ctrl.sites if s.kind == "vector_gate"]


def test_mamba_checkpoint_audits_its_x_proj_through_the_cli_without_transformers_fallback_notes(tmp_path, capfd):
    ckpt = saved(tmp_path, "mamba", state_size=8, time_step_rank=4)
    ok(cli("audit", ckpt, "--out", tmp_path / "audit", "--eval", 4, "--calib", 4, "--window", 16,
           "--randomizations", 2, "--batch-size", 4, "--quiet"))
    assert "falling back to its reference PyTorch implementation" not in capfd.readouterr().err
    replay = json.loads((tmp_path / "audit" / "replay.json").read_text())
    assert replay["passed"] and replay["bit_equal"]
    ctrl = json.loads((tmp_path / "audit" / "config.json").read_text())["controller"]
    assert ctrl["sites"] == ["backbone.layers.0.mixer.x_proj", "backbone.layers.1.mixer.x_proj"]
    assert ctrl["kinds"] == ["vector_gate"] * 2 and ctrl["codecs"] == ["batch token channel"] * 2
    model = fca.load(ckpt, device="cpu")
    assert all(follow_the_input(model, fca.controller_for(model)))


def test_transformers_note_that_a_mixer_runs_its_reference_pytorch_code_is_dropped_and_nothing_else():
    require_transformers()
    logger = logging.getLogger("transformers.integrations.hub_kernels")

    def record(msg):
        return logger.makeRecord(logger.name, logging.WARNING, __file__, 0, msg, (), None)

    assert not logger.filter(record("`causal_conv1d_fn` is falling back to its reference PyTorch implementation "
                                    "because `causal_conv1d` is either not installed ..."))
    assert logger.filter(record("kernels-community/causal-conv1d could not be loaded"))


def test_mamba2_delta_b_and_c_are_audited_per_layer_with_an_exact_replay(tmp_path):
    ckpt = saved(tmp_path, "mamba2", num_heads=4, head_dim=16, state_size=16, n_groups=1, chunk_size=8)
    model, ctrl, res = audited(ckpt, tmp_path / "audit")
    assert recipe_sites(ctrl) == [("vector_gate", "softplus", "batch token head"),
                                  ("vector_gate", "repeat_interleave", "batch token (head state)"),
                                  ("vector_gate", "repeat_interleave", "batch token (head state)")] * 2
    assert [s.group for s in ctrl.sites] == [0, 0, 0, 1, 1, 1]  # Δ, B and C of one layer move together
    assert res.replay.passed and res.replay.bit_equal
    assert all(follow_the_input(model, ctrl))
    assert not any(n.startswith("note: site") for n in res.notices)  # no hidden state, no ranked scores


@pytest.mark.parametrize("model_type, sizes", [
    ("mamba2", dict(num_heads=4, head_dim=16, state_size=16, n_groups=1, chunk_size=65536)),
    ("bamba", dict(ATTENTION, **MAMBA2_HEADS, attn_layer_indices=[1]) | dict(mamba_chunk_size=16384))])
def test_a_scan_chunk_too_large_for_memory_is_refused_at_load_naming_the_chunk_that_fits(tmp_path, model_type, sizes):
    """The torch scan pads a 16-token window to the chunk and holds [head, chunk, chunk] tensors: 4 heads at 65536
    would be ~192 GiB per layer. Refused from config.json alone, before the controller's probe runs a pass; a model
    loaded by the user is refused by fca.controller_for, before its probe, naming the argument to load it with."""
    ckpt = saved(tmp_path, model_type, **sizes)
    key = "chunk_size" if model_type == "mamba2" else "mamba_chunk_size"
    own = transformers.AutoModelForCausalLM.from_pretrained(ckpt)
    assert api_refusal(lambda: fca.controller_for(own)).endswith(
        f"load the model again with from_pretrained(..., {key}=2048) (the chunk changes the scan's result only in "
        "rounding)")
    own = transformers.AutoModelForCausalLM.from_pretrained(ckpt, **{key: 2048})
    assert fca.controller_for(own).sites  # the argument it names loads a model whose controller is found
    line = api_refusal(lambda: fca.load(ckpt, device="cpu"))
    assert f"has {key}={sizes[key]}: transformers' torch scan pads" in line
    assert line.endswith(f"set {key} to at most 2048 in config.json (the chunk changes the scan's result only in "
                         "rounding)")
    assert refusal(cli("audit", ckpt, "--out", tmp_path / "audit", "--window", 16)) == f"error: {line}"
    assert not (tmp_path / "audit").exists()
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**config, key: 2048}))  # the chunk it names: 0.19 GiB, loaded
    assert getattr(fca.load(ckpt, device="cpu").config, key) == 2048


def test_a_hybrid_moe_and_mamba2_model_is_audited_whole_routers_and_ssm(tmp_path):
    ckpt = saved(tmp_path, "granitemoehybrid", **ATTENTION, **MAMBA2_HEADS, num_local_experts=4,
                 num_experts_per_tok=2, shared_intermediate_size=32, layer_types=["mamba", "attention"])
    model, ctrl, res = audited(ckpt, tmp_path / "audit")
    assert sorted(s.kind for s in ctrl.sites) == ["expert_router"] * 2 + ["vector_gate"] * 3
    assert {s.path for s in ctrl.sites if s.kind == "vector_gate"} == {"model.layers.0.mamba"}
    mamba_group = {s.group for s in ctrl.sites if s.kind == "vector_gate"}
    router_0 = next(s.group for s in ctrl.sites if s.kind == "expert_router" and ".layers.0." in s.path)
    assert len(mamba_group) == 1 and router_0 not in mamba_group  # two mechanisms of layer 0, two groups
    assert res.replay.passed and res.replay.bit_equal and res.replay.route_flips == 0
    assert all(follow_the_input(model, ctrl))


def test_recurrent_gemma_rg_lru_input_and_recurrence_gates(tmp_path):
    ckpt = saved(tmp_path, "recurrent_gemma", num_attention_heads=2, num_key_value_heads=1, intermediate_size=64,
                 lru_width=32, attention_window_size=16, block_types=["recurrent", "attention"])
    model, ctrl, res = audited(ckpt, tmp_path / "audit")
    assert [s.name for s in ctrl.sites] == ["model.layers.0.temporal_block.rg_lru:sigmoid[call=0]",
                                            "model.layers.0.temporal_block.rg_lru:sigmoid[call=1]"]
    assert recipe_sites(ctrl) == [("vector_gate", "sigmoid", "batch token channel")] * 2
    assert res.replay.passed and res.replay.bit_equal
    assert all(follow_the_input(model, ctrl))


def test_rwkv_receptance_gates_of_time_mix_and_channel_mix(tmp_path):
    ckpt = saved(tmp_path, "rwkv", attention_hidden_size=32, intermediate_size=64, context_length=64)
    model, ctrl, res = audited(ckpt, tmp_path / "audit")
    assert [s.name for s in ctrl.sites] == [f"rwkv.blocks.{i}.{m}:sigmoid" for i in (0, 1)
                                            for m in ("attention", "feed_forward")]
    assert res.replay.passed and res.replay.bit_equal
    assert all(follow_the_input(model, ctrl))
    assert res.penalties().to_frame().loc["CrossInput", "statistic"] != 0


def test_xlstm_input_forget_and_output_gates(tmp_path):
    # transformers' own cached forward fails at this size (its state shapes), so the config turns the cache off
    ckpt = saved(tmp_path, "xlstm", noise=0.05, use_cache=False, num_heads=2, chunk_size=8, embedding_dim=32,
                 num_blocks=2)
    model, ctrl, res = audited(ckpt, tmp_path / "audit")
    assert [s.path.rsplit(".", 1)[-1] for s in ctrl.sites] == ["igate_preact", "fgate_preact", "ogate_act_fn"] * 2
    gates = [("vector_gate", None, "batch token head")] * 2 + [("vector_gate", None, "batch token channel")]
    assert recipe_sites(ctrl) == gates * 2
    assert res.replay.passed and res.replay.bit_equal
    assert all(follow_the_input(model, ctrl))


def test_lfm2_short_conv_gates_b_and_c_are_replayed_and_its_value_x_stays_live(tmp_path):
    """B, C and x are one chunked projection: the site holds B and C only, so a replay of another batch's B and C
    computes y = C' * conv(B' * x) with this batch's own x, as a hook overwriting B and C in in_proj's output does."""
    ckpt = saved(tmp_path, "lfm2", **ATTENTION, layer_types=["conv", "full_attention"], block_multiple_of=16)
    model, ctrl, res = audited(ckpt, tmp_path / "audit")
    assert [s.name for s in ctrl.sites] == ["model.layers.0.conv:chunk"] and ctrl.sites[0].kind == "vector_gate"
    assert res.replay.passed and res.replay.bit_equal
    assert all(follow_the_input(model, ctrl))

    first, second = windows(2, 7), windows(2, 8)
    with ctrl.capture(*first.shape) as coeffs, torch.no_grad():
        model(input_ids=first)
    in_proj, kept = model.model.layers[0].conv.in_proj, {}
    with torch.no_grad():
        handle = in_proj.register_forward_hook(lambda m, i, out: kept.update(bc=out[..., :64].clone()))
        model(input_ids=first)
        handle.remove()
        with ctrl.replay(coeffs, coeffs.decoding):
            replayed = model(input_ids=second).logits
        handle = in_proj.register_forward_hook(lambda m, i, out: torch.cat([kept["bc"], out[..., 64:]], dim=-1))
        by_hand = model(input_ids=second).logits
        handle.remove()
        own = model(input_ids=second).logits
    assert torch.equal(replayed, by_hand) and not torch.equal(replayed, own)


class TinyMixer(nn.Module):
    """A mixer whose class name has a recipe that reads a submodule it does not have."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, h):
        return torch.sigmoid(self.proj(h)) * h


def test_a_recipe_whose_submodule_is_missing_is_refused_in_one_line(monkeypatch):
    monkeypatch.setitem(recipes.RECIPES, "TinyMixer", (recipes.Recipe("tiny gate", "gate_proj"),))
    model = nn.Sequential(nn.Embedding(16, 8), TinyMixer(), nn.Linear(8, 16))
    line = api_refusal(lambda: fca.controller_for(model))
    assert "TinyMixer at 1 has no submodule 'gate_proj'" in line and "fcaudit.Controller.from_modules" in line


class GatedSplit(nn.Module):
    """One projection split into a gate and a value, as LFM2's is (here in two parts, not three)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 16)

    def forward(self, h):
        gate, value = self.proj(h).chunk(2, dim=-1)
        return gate * value


def test_parts_of_a_chunk_that_it_does_not_return_are_refused_in_one_line():
    from fcaudit.controllers.codecs import Parts

    model = nn.Sequential(GatedSplit())
    codec = Parts(fca.Layout.parse("batch token channel"), (2,), "chunk")  # a third part: the chunk has two
    ctrl = fca.Controller.from_ops(model, "0", "chunk", codec=codec)
    h = torch.randn(2, 3, 8)

    def capture():
        with ctrl.capture(2, 3), torch.no_grad():
            model(h)

    line = api_refusal(capture)
    assert "'chunk' returned 2 parts, which has no parts [2]" in line
