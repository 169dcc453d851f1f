"""The benchmark scripts that are meant for other machines still run here: gpu_audit.py in its CPU smoke mode."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from fcaudit.auditor.state import STATE_CHECK_PASSES
from fcaudit.controllers.checks import BATCH_CHECK_PASSES, FLOW_CHECK_PASSES, SITE_CHECK_PASSES, routing_check_passes

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # a dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


def test_gpu_audit_smoke_mode_runs_on_the_cpu(tmp_path, capsys):
    gpu_audit = load_script("gpu_audit")
    rows = gpu_audit.main(["--smoke", "--out", str(tmp_path)])
    assert [r["model"] for r in rows] == ["muddpythia-tiny", "featuregate-tiny", "olmoe-tiny"]
    for r, static, routed in zip(rows, (3, 3, 4), (0, 0, 1)):  # the MoE has StaticTopK and the causality check
        assert r["replay_passed"] and r["forward_ms"] > 0 and r["flops_per_forward"] > 0
        # counted in the audit: 4 + 4 windows at batch 2 with R = 2 (calibration, capture (the first batch's by the
        # probe) and replay check, R per randomized condition (4 of them), the static ones)
        # the checks: the Flow pass follows the gates and mixtures (not the routers), the causality check the routers;
        # the batch-composition check's two passes and the state check's repeated Correct pass
        checks = SITE_CHECK_PASSES + (1 - routed) * FLOW_CHECK_PASSES + routed * routing_check_passes(4, 2)
        checks += BATCH_CHECK_PASSES + STATE_CHECK_PASSES
        assert r["forward_passes"] == checks + 2 + 2 * (2 + 4 * 2 + static)
        assert r["paper_forward_passes"] == 64 + 64 * (2 + 4 * 20 + static)
        assert r["audit_over_bare"] > 0 and r["paper_audit_h_extrapolated"] > 0 and r["mfu"] is None
    assert "forward_ms_fast_mix" in rows[0] and rows[0]["fast_mix"] is False
    assert json.loads((tmp_path / "gpu_audit.json").read_text()) == rows
    assert (tmp_path / "audit-muddpythia-tiny").is_dir()
    assert "paper audit" in capsys.readouterr().out


def test_gpu_audit_without_a_gpu_names_the_smoke_mode(monkeypatch):
    gpu_audit = load_script("gpu_audit")
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.raises(gpu_audit.FcauditError, match="--smoke"):
        gpu_audit.main([])


def test_audit_floors_bare_loop_runs_the_audits_replays():
    import torch

    audit_floor = load_script("audit_floor")
    model, ctrl, _ = audit_floor.build("featuregate")
    ev, ca = torch.randint(0, 256, (4, 16)), torch.randint(0, 256, (2, 16))
    passes = []
    model.register_forward_pre_hook(lambda *a: passes.append(1))
    theirs, mine = [], []
    audit_floor.bare_loop(model, ctrl, ev, ca, 2, 1, theirs)
    assert len(passes) > 10
    audit_floor.audit_split(model, ctrl, ev, ca, 2, 1, mine)
    assert len(mine) == len(theirs) > 0  # the same replays, each timed, in both


def test_audit_floors_parts_name_every_step_and_leave_the_engine_as_it_was():
    import torch

    from fcaudit import protocol
    from fcaudit.auditor import engine

    audit_floor = load_script("audit_floor")
    model, ctrl, _ = audit_floor.build("own")
    before = engine.forward_nll, engine.Engine.take, protocol.REGISTRY["CrossInput"].make
    line = audit_floor.parts_line(model, ctrl, torch.randint(0, 256, (4, 16)), torch.randint(0, 256, (2, 16)), 2, 1)
    assert all(f"{part} " in line for part in audit_floor.PARTS) and "the rest / bare" in line
    assert (engine.forward_nll, engine.Engine.take, protocol.REGISTRY["CrossInput"].make) == before


def test_hf_zoo_audits_an_moe_and_an_ssm_with_zero_code_and_refuses_a_dense_lm_in_one_line():
    """The zoo's own path (tiny config from the class defaults, save_pretrained, `fcaudit audit DIR`) on three kinds
    of architecture, so that the benchmark cannot rot unseen; its decision of which have a controller too."""
    hf_zoo = load_script("hf_zoo")
    # LongCat-Flash: its router's weight has rows for zero-computation experts that its experts module lacks
    moe = hf_zoo.audit_one("longcat_flash", hf_zoo.controlled("longcat_flash"))
    assert moe.controlled and moe.status == "audited" and moe.kinds["expert_router"] == 2, moe
    assert "exact replay True" in moe.line
    ssm = hf_zoo.audit_one("mamba", hf_zoo.controlled("mamba"))  # x_proj: selective-SSM Δ, B and C, by recipe
    assert ssm.controlled and ssm.status == "audited" and ssm.kinds["vector_gate"] == 2, ssm
    assert "exact replay True" in ssm.line
    dense = hf_zoo.audit_one("llama", hf_zoo.controlled("llama"))
    assert not dense.controlled and dense.status == "refused" and "\n" not in dense.line, dense
    assert "LlamaForCausalLM" in dense.line and "from_modules" in dense.line
    # decided from the modeling source, not by fcaudit: the router's sigmoid of its logits is no gate
    assert (moe.controlled, ssm.controlled) == ("MoE router", hf_zoo.GATES)
    lines = hf_zoo.summary([moe, ssm, dense])
    assert lines[0].startswith("2 architectures with an input-dependent controller (2 causal LM classes): 2 audited "
                               "with zero code")
    assert lines[-3:-1] == ["with a controller in which fcaudit found none (0): -", "audited, but with a gate in "
                            "their source that fcaudit neither audited nor named (0): -"]


@pytest.mark.slow
def test_hf_zoo_every_architecture_with_a_controller_replays_exactly_or_is_refused_in_one_line(capsys):
    """The whole zoo of architectures with a controller (about a minute): no traceback, each audit bit-exact, each
    refusal one line."""
    rows = load_script("hf_zoo").main(["--controlled"])
    assert len(rows) >= 80 and not [r for r in rows if r.status == "bug"]
    assert all("exact replay True" in r.line for r in rows if r.status == "audited")
    assert all("\n" not in r.line for r in rows)
    assert sum(r.status == "audited" for r in rows) >= 60, capsys.readouterr().out


def test_torch_modules_smoke_audits_on_the_fast_path_and_times_the_planned_passes(capsys):
    torch_modules = load_script("torch_modules")
    rows = torch_modules.main(["--smoke"])
    assert [r["model"] for r in rows] == ["mha", "encoder"]
    for r in rows:
        assert r["replay_exact"] and r["forward_passes"] == r["planned_passes"]
        # every pass runs the fused kernel but the Flow check's, under its TorchFunctionMode (no site is ranked)
        assert r["fused_passes"] == r["forward_passes"] - FLOW_CHECK_PASSES
        assert len(r["ratios"]) == 1 and min(r["ratios"][0]) > 0
    assert "replay bit-exact True" in capsys.readouterr().out


def test_peers_audits_with_plain_hooks_give_fcaudits_records_bit_for_bit():
    peers = load_script("peers")
    rows = peers.main(["--models", "tiny", "--n-eval", "8", "--n-calib", "8", "--window", "16", "--randomizations",
                       "1", "--reps", "0"])
    assert rows[0]["identical"]["hooks"] and all(rows[0]["identical"].values())
    passes = rows[0]["passes"]  # the peers run the same passes; fcaudit more: its checks
    assert passes["fcaudit"] > passes["hooks"] == passes.get("nnsight", passes["hooks"]) > 0


def test_hf_decode_decodes_each_block_once_per_token_or_says_why_not():
    pytest.importorskip("transformers")
    hf_decode = load_script("hf_decode")
    assert hf_decode.decode_one("mixtral")[0] == "each once"
    outcome, line = hf_decode.decode_one("recurrent_gemma")  # its state kept outside the cache fcaudit is handed
    assert outcome == "not measured" and "beyond torch.float32 rounding" in line
