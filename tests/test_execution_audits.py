"""`fcaudit execution AUDIT_DIR`: the checkpoint an audit read, measured with the controller it audited; refused in one
line where the audit's model is not a checkpoint, where the checkpoint changed since, and where a checkpoint loads
but fcaudit finds no controller in it."""

import json

import pandas as pd
import pytest
import torch

from harness import an_audit, cli, fg_ckpt, ok, refusal

FAST = ("--window", 16, "--batch-size", 2, "--min-run-time", 0.01, "--threads", 1)


def audited_checkpoint(t):
    """A tiny FeatureGate checkpoint and its audit by `fcaudit audit`."""
    ckpt = fg_ckpt(t)
    ok(cli("audit", ckpt, "--out", t / "audit", "--eval", 4, "--calib", 2, "--randomizations", 1, "--batch-size", 4,
           "--window", 16, "--quiet", "--threads", 1))
    return ckpt, t / "audit"


def test_an_audit_directory_measures_the_checkpoint_it_audited_next_to_a_dense_reference(tmp_path):
    ckpt, audit = audited_checkpoint(tmp_path)
    from fcaudit.models.checkpoint import save_checkpoint
    from fcaudit.models.featuregate import FeatureGateGPT, config_for

    torch.manual_seed(1)
    dense = save_checkpoint(tmp_path / "dense", FeatureGateGPT(config_for("tiny", "dense")), {"variant": "dense"})
    ok(cli("execution", audit, dense, "--out", tmp_path / "e", *FAST))
    rows = pd.read_csv(tmp_path / "e" / "execution.csv").set_index("model")
    assert rows.loc["featuregate", "audit"] == str(audit) and rows.loc["featuregate", "checkpoint"] == str(ckpt)
    assert rows.loc["dense", "audit"] != rows.loc["dense", "audit"]  # NaN: given as a checkpoint
    # the audit's soft gates decide nothing away; Dense is the reference of the ratios
    assert rows.loc["featuregate", ["decided", "executed"]].tolist() == [1.0, 1.0]
    assert rows.loc["dense", "flops_vs_dense"] == 1.0 < rows.loc["featuregate", "flops_vs_dense"]

    # the same model as the checkpoint itself: the same FLOPs and blocks (the audit's dtype is the checkpoint's)
    ok(cli("execution", ckpt, "--out", tmp_path / "e2", *FAST))
    plain = pd.read_csv(tmp_path / "e2" / "execution.csv").iloc[0]
    assert "audit" not in plain.index
    assert plain[["flops_per_token", "n_blocks", "executed_blocks"]].tolist() == \
        rows.loc["featuregate", ["flops_per_token", "n_blocks", "executed_blocks"]].tolist()
    line = refusal(cli("execution", audit, ckpt, "--out", tmp_path / "e3", *FAST))
    assert "the same checkpoint was given twice (itself, or as an audit's)" in line


def test_an_audit_of_a_checkpoint_that_changed_since_is_refused_naming_what_differs(tmp_path):
    ckpt, audit = audited_checkpoint(tmp_path)
    from fcaudit.models.checkpoint import save_checkpoint
    from fcaudit.models.featuregate import FeatureGateGPT, config_for

    torch.manual_seed(7)  # retrained in place: other weights, the same gates
    save_checkpoint(ckpt, FeatureGateGPT(config_for("tiny", "featuregate")), {"variant": "featuregate"})
    line = refusal(cli("execution", audit, "--out", tmp_path / "e", *FAST))
    assert f"{ckpt} is not the model {audit} audited: its weights (params_sha256) differ" in line
    assert "controller" not in line.split("differ")[0]

    torch.manual_seed(0)  # the audit's weights, but the gates gone: no controller to build any more
    save_checkpoint(ckpt, FeatureGateGPT(config_for("tiny", "dense")), {"variant": "dense"})
    line = refusal(cli("execution", audit, "--out", tmp_path / "e", *FAST))
    assert "its weights (params_sha256), controller codecs, controller description" in line
    assert "the checkpoint changed since the audit?" in line and not (tmp_path / "e").exists()


def test_an_audit_of_a_model_given_in_python_names_the_python_route(tmp_path):
    audit = an_audit(tmp_path)
    line = refusal(cli("execution", audit, "--out", tmp_path / "e", *FAST))
    assert line == (f"error: {audit} is an audit of a model given in Python (its config.json names no checkpoint): "
                    "measure that model in Python with fca.execution(model, controller, windows)")


def test_a_checkpoint_that_loads_but_has_no_controller_fcaudit_finds_is_refused_not_measured_as_dense(tmp_path):
    pytest.importorskip("transformers")
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)  # a dense Llama whose config.json carries MoE keys: it loads, but nothing routes
    LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                 num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
                     ).save_pretrained(tmp_path / "llama")
    config = json.loads((tmp_path / "llama" / "config.json").read_text())
    (tmp_path / "llama" / "config.json").write_text(json.dumps({**config, "num_experts": 4, "num_experts_per_tok": 2}))
    line = refusal(cli("execution", tmp_path / "llama", "--out", tmp_path / "e", *FAST))
    assert line == (f"error: {tmp_path / 'llama'} loads, but fcaudit finds no controller in it (LlamaForCausalLM has "
                    "no controller fcaudit finds (no MoE router beside its experts, no module of a class in "
                    "fcaudit/families/hf/recipes.py)): describe it with fca.Controller.from_modules(model, 'path.*', "
                    "...) and measure it in Python with fca.execution(model, controller, windows)")
    assert not (tmp_path / "e").exists()



def test_a_checkpoint_an_audit_recorded_relative_to_where_it_ran_is_found_there_and_refused_elsewhere(
        tmp_path, monkeypatch):
    fg_ckpt(tmp_path)
    monkeypatch.chdir(tmp_path)
    ok(cli("audit", "fg", "--out", "audit", "--eval", 4, "--calib", 2, "--randomizations", 1, "--batch-size", 4,
           "--window", 16, "--quiet", "--threads", 1))
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    line = refusal(cli("execution", "../audit", "--out", "e", *FAST))
    assert line.startswith("error: ../audit audited the checkpoint fg, which is not found from here (no checkpoint "
                           "directory fg")
    assert line.endswith("run from the directory the audit ran in, or pass the checkpoint where it is now")
