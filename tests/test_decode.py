"""Token-by-token decoding with a KV cache: the logits of every family that decodes equal the window's forward, and
`fcaudit execution` measures decoding beside scoring against Dense."""

import math

import pandas as pd
import pytest
import torch
from conftest import tiny_early_exit
from rich.console import Console

from fcaudit.errors import FcauditError
from fcaudit.execution import ExecutionConfig, flops, measure_execution
from fcaudit.execution.decode import decode, not_decodable
from fcaudit.execution.display import decoding_table
from fcaudit.models.featuregate import FeatureGateGPT, GPTConfig
from fcaudit.models.mod import MoDGPT
from fcaudit.models.mod import config_for as mod_config

# Decoding computes one query row against the cache where the window's forward computes all rows at once: other
# kernel shapes, so float32 sums in another order (differences of about 1e-7 on these models), never other decisions.
TOLERANCE = dict(atol=1e-5, rtol=1e-5)


def tiny_gpt(variant: str, **kw) -> FeatureGateGPT:
    torch.manual_seed(0)
    shape = dict(n_layer=3, n_head=2, d_model=32, block_size=64, gate_hidden=8)
    return FeatureGateGPT(GPTConfig(variant=variant, **{**shape, **kw})).eval()


def tiny_mod(routing: str = "predictor") -> MoDGPT:
    torch.manual_seed(0)
    model = MoDGPT(mod_config("tiny", "mod")).eval()
    model.config.routing = routing
    for block in model.blocks:  # an untrained predictor chooses no token: make it choose some, unequally per row
        if block.router is not None:
            for layer in (block.router.predictor[0], block.router.predictor[2]):
                torch.nn.init.normal_(layer.weight, std=3.0)
                torch.nn.init.zeros_(layer.bias)
    return model


MODELS = {"dense": lambda: tiny_gpt("dense"), "featuregate": lambda: tiny_gpt("featuregate"),
          "uniform": lambda: tiny_gpt("uniform"), "fixeddepth": lambda: tiny_gpt("fixeddepth", n_layer=2),
          "mod-causal": tiny_mod, "early-exit": tiny_early_exit}


@pytest.fixture
def ids():
    return torch.randint(0, 256, (3, 40), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("name", MODELS)
def test_decoding_with_the_kv_cache_gives_the_windows_logits(name, ids):
    model = MODELS[name]()
    logits, state = decode(model, ids)
    with torch.inference_mode():
        torch.testing.assert_close(logits, model(ids), **TOLERANCE)
    executed = state.executed()
    if name == "mod-causal":  # a routed block ran for the tokens its predictor chose, unequally per row
        assert executed[0] == ids.numel() > executed[1] > 0
    elif name == "early-exit":  # the same exits as the window's forward
        with torch.inference_mode():
            _, ran = model(ids, return_executed=True)
        assert executed == ran.sum((1, 2)).tolist() and executed[2] < executed[0] == ids.numel()
    else:
        assert executed == [ids.numel()] * len(model.blocks)


def test_featuregate_decodes_its_gates_as_the_window_computes_them(ids):
    model = tiny_gpt("featuregate")
    state = model.start_decoding(*ids.shape)
    with torch.inference_mode():
        steps = torch.cat([model(ids[:, t:t + 1], cache=state, return_gates=True)[1] for t in range(ids.shape[1])], 2)
        torch.testing.assert_close(steps, model(ids, return_gates=True)[1], **TOLERANCE)


def test_what_cannot_decode_says_why():
    assert "causal predictor" in not_decodable(tiny_mod("topk"))  # top-k over the window is not causal
    assert "no KV-cache decoding path" in not_decodable(torch.nn.Linear(2, 2))
    assert not_decodable(tiny_gpt("dense")) is None
    model = tiny_gpt("dense")
    state = model.start_decoding(1, 2)
    with pytest.raises(FcauditError, match="one token per sequence"):
        model(torch.zeros(1, 2, dtype=torch.long), cache=state)
    for _ in range(2):
        model(torch.zeros(1, 1, dtype=torch.long), cache=state)
    with pytest.raises(FcauditError, match="start_decoding again"):
        model(torch.zeros(1, 1, dtype=torch.long), cache=state)


def test_execution_measures_decoding_against_dense(tmp_path):
    from fcaudit.families.early_exit import MODEL_TYPE
    from fcaudit.families.mod import save as save_mod
    from fcaudit.models.checkpoint import save_checkpoint, write_checkpoint

    save_checkpoint(tmp_path / "dense", tiny_gpt("dense"), {})
    write_checkpoint(tmp_path / "ee", tiny_early_exit(), MODEL_TYPE, {})
    save_mod(tiny_mod("topk"), tmp_path / "mod", {})
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(b"".join(f"line {i}: the quick brown fox jumps over the lazy dog\n".encode() for i in range(300)))
    df = measure_execution(ExecutionConfig([tmp_path / n for n in ("dense", "ee", "mod")], tmp_path / "x",
                                           batch_size=2, window=32, min_run_time=0.01, corpus=str(corpus),
                                           progress=False)).set_index("model")
    dense, ee, mod = df.loc["dense"], df.loc["early-exit"], df.loc["mod"]
    assert dense["executed_layer_fraction"] == 1.0 and dense["decode_flops_vs_dense"] == 1.0
    assert 0 < ee["executed_layer_fraction"] < 1 and ee["decode_flops_vs_dense"] < 1 <= ee["flops_vs_dense"]
    assert ee["executed_blocks"] == ee["n_blocks"]  # scoring a window runs every block
    assert ee["decided"] < ee["executed"] == 1.0 and "no saving realized" in ee["execution_verdict"]  # in scoring
    assert mod["decided"] == mod["executed"] < 1  # MoD's blocks gather the tokens they run on
    assert ee["decode_ms_per_token"] > 0 and math.isfinite(ee["decode_latency_vs_dense"])
    assert dense["decode_max_abs_dlogit"] < 1e-5 and ee["decode_max_abs_dlogit"] < 1e-5
    assert "causal predictor" in mod["decode_note"] and math.isnan(mod["executed_layer_fraction"])
    assert pd.read_csv(tmp_path / "x" / "execution.csv")["decode_latency_vs_dense"].notna().sum() == 2

    console = Console(width=100, record=True)
    console.print(decoding_table(df.reset_index()))
    text = console.export_text()
    assert "no layer skipped" in text and "not decodable" in text and "causal predictor" in text


def test_a_hugging_face_model_decodes_through_its_own_cache_and_its_blocks_are_observed(ids):
    pytest.importorskip("transformers")
    from fcaudit.execution.decode import decoding_columns
    from fcaudit.families.hf.tiny import tiny_moe

    model = tiny_moe("mixtral", experts=4, top_k=2, layers=2)
    assert not_decodable(model) is None
    text = ids[:1, :12]
    cols = decoding_columns(model, text)
    assert cols["decode_note"] == "" and cols["executed_layer_fraction"] == 1.0  # every block ran every token
    assert cols["decode_max_abs_dlogit"] < 1e-4  # teacher-forced decoding gives the window's logits
    assert 0 < cols["decode_flops_per_token"] < flops(model, text) * 1.5


def test_a_cache_path_that_computes_another_function_is_not_measured(ids):
    """A transformers model keeping its recurrent state outside the cache fcaudit hands it (RecurrentGemma sets it up
    only when given no cache): its token-by-token logits are not the window's, so its decoding is not reported."""
    transformers = pytest.importorskip("transformers")
    from fcaudit.execution.decode import decoding_columns

    config = transformers.RecurrentGemmaConfig(vocab_size=256, hidden_size=32, intermediate_size=64,
                                               num_hidden_layers=2, num_attention_heads=2, lru_width=32,
                                               attention_window_size=16, block_types=["recurrent", "attention"])
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    cols = decoding_columns(model, ids[:1, :12])
    assert cols["decode_max_abs_dlogit"] > 1e-2 and math.isnan(cols["executed_layer_fraction"])
    assert "not measured: decoding token by token gives logits up to" in cols["decode_note"]


@pytest.mark.parametrize("make", [
    # every expert computes every token (its experts take E rows per token): each block still computed each token once
    lambda t: t.Llama4TextConfig(vocab_size=256, hidden_size=32, intermediate_size=32, intermediate_size_mlp=32,
                                 num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, head_dim=16,
                                 num_local_experts=4, num_experts_per_tok=1, moe_layers=[0, 1],
                                 layer_types=["full_attention"] * 2, no_rope_layers=[1, 1]),
    # a recurrent model with a cache of its own kind (xLSTMCache), which it makes on the first step
    lambda t: t.xLSTMConfig(vocab_size=256, hidden_size=64, embedding_dim=64, num_hidden_layers=2, num_blocks=2,
                            num_heads=4, qk_dim_factor=1.0, chunk_size=64, mode="inference", return_last_states=True),
], ids=["llama4-dense-experts", "xlstm-own-cache"])
def test_a_hugging_face_model_decodes_each_block_once_per_token_through_the_cache_it_makes(make, ids):
    transformers = pytest.importorskip("transformers")
    from fcaudit.execution.decode import decoding_columns

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(make(transformers)).eval()
    cols = decoding_columns(model, ids[:1, :12])
    assert cols["decode_note"] == "" and cols["decode_max_abs_dlogit"] < 1e-4
    assert cols["executed_layer_fraction"] == 1.0  # dense experts take 4 rows a token
