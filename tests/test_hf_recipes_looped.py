"""Looped layers: architectures that run a layer several times in one forward pass (Dory's recurrent layers, HRM's H
and L stacks, Inkling2-Loop's loop layers) audit with zero code, each loop pass of each gate its own site
(`call=k`) and its own layer, with an exact replay; a loop whose number of passes follows the input (a halting
decision) is refused rather than numbered. The Hugging Face models are built tiny from their configs by the hf_zoo
benchmark's builder."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import fcaudit as fca
from fcaudit.auditor.results import load_records
from fcaudit.families.hf.find import per_call
from harness import api_refusal, cli, edit_config, ok, refusal

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def hf_zoo():
    spec = importlib.util.spec_from_file_location("hf_zoo", BENCHMARKS / "hf_zoo.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["hf_zoo"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def saved(tmp_path, model) -> Path:
    model.save_pretrained(tmp_path / "ckpt")
    return tmp_path / "ckpt"


def windows(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n, 16), generator=torch.Generator().manual_seed(seed))


def audited_by_cli(ckpt: Path, out: Path) -> dict:
    """`fcaudit audit DIR` (4 + 4 windows of 16, R = 2): its controller as config.json records it, the replay
    checked exact."""
    ok(cli("audit", ckpt, "--out", out, "--eval", 4, "--calib", 4, "--window", 16, "--randomizations", 2,
           "--batch-size", 4, "--quiet"))
    replay = json.loads((out / "replay.json").read_text())
    assert replay["passed"] and replay["bit_equal"]
    return json.loads((out / "config.json").read_text())["controller"]


def per_pass(path: str, calls: int) -> list[str]:
    return [f"{path}[call={k}]" for k in range(calls)]


def test_dory_gates_its_recurrent_layers_once_per_loop_pass_each_pass_a_site_from_the_cli(hf_zoo, tmp_path):
    model = hf_zoo.tiny_model("dory")  # input layer 0, recurrent layers 1 and 2 (2 loops), output layer 3
    assert model.config.n_recurrent_loops == 2
    ctrl = audited_by_cli(saved(tmp_path, model), tmp_path / "audit")
    gate = "model.layers.{}.self_attn.gate_proj"
    assert ctrl["sites"] == [gate.format(0), *per_pass(gate.format(1), 2), *per_pass(gate.format(2), 2), gate.format(3)]
    assert ctrl["kinds"] == ["vector_gate"] * 6
    assert "groups" not in ctrl  # every loop pass of every layer its own layer
    records = load_records(tmp_path / "audit")
    assert len(records[records.condition == "Correct"]) == 4 and records.nll.notna().all()


def test_hrm_h_and_l_stacks_audit_every_cycle_with_zero_code(hf_zoo, tmp_path):
    model = hf_zoo.tiny_model("hrm_text")  # one layer per stack; L runs H_cycles x L_cycles times, H H_cycles times
    cfg = model.config
    low, high = cfg.H_cycles * cfg.L_cycles, cfg.H_cycles
    # num_hidden_layers counts its cache slots (8), not the layers its weights hold: the depth check reads the stacks'
    assert (cfg.num_hidden_layers, cfg.num_layers_per_stack, low, high) == (8, 1, 6, 2)
    ctrl = audited_by_cli(saved(tmp_path, model), tmp_path / "audit")
    assert ctrl["sites"] == [*per_pass("model.L_module.layers.0.self_attn.gate_proj", low),
                             *per_pass("model.H_module.layers.0.self_attn.gate_proj", high)]


def test_an_hrm_config_asking_for_more_layers_per_stack_than_its_weights_hold_is_refused(hf_zoo, tmp_path):
    ckpt = edit_config(saved(tmp_path, hf_zoo.tiny_model("hrm_text")), num_layers_per_stack=4)
    line = refusal(cli("audit", ckpt, "--out", tmp_path / "audit"))
    assert "(num_layers_per_stack=4, the weights hold 1 layers)" in line


def test_a_looped_layers_sites_capture_one_pass_each_and_replay_exactly(hf_zoo):
    model = hf_zoo.tiny_model("hrm_text")
    ctrl = fca.controller_for(model)
    ids = windows(2, 0)
    with torch.no_grad(), ctrl.capture(*ids.shape) as found:
        live = model(ids).logits
    low = found[:6]  # the L stack's gate, once per cycle: its input changes with every cycle
    assert all(not torch.equal(a, b) for a, b in zip(low, low[1:]))
    with torch.no_grad(), ctrl.replay(found):
        assert torch.equal(model(ids).logits, live)
    moved = list(found)
    moved[3] = torch.zeros_like(moved[3])  # one cycle's gates closed: only that pass, the others replayed as captured
    with torch.no_grad(), ctrl.replay(moved, found.decoding):
        assert not torch.equal(model(ids).logits, live)


def test_inkling2_loop_layers_sites_one_per_pass_routers_and_message_gates_included(hf_zoo):
    model = hf_zoo.tiny_model("inkling2_loop_text")  # three layers, the middle one looped (hf_zoo's OVERRIDES)
    passes = model.config.loop_num_passes
    ctrl = fca.controller_for(model)
    names = [s.name for s in ctrl.sites]
    looped = "model.layers.1."
    assert names[:passes + 2] == ["model.layers.0.mlp.gate", *per_pass(looped + "mlp.gate", passes),
                                  "model.layers.2.mlp.gate"]
    for path in ("self_attn.o_proj.gate_proj", "self_attn.k_proj.sconv.weight_proj",
                 "self_attn.v_proj.sconv.weight_proj"):
        assert [n for n in names if n.startswith(looped + path)] == per_pass(looped + path, passes)
    for gate in ("q", "k", "v", "mlp"):  # the message gates run in the passes after the first
        for proj in ("forget_gate_proj", "message_gate_proj"):
            path = f"{looped}{gate}_message_gate.{proj}"
            assert [n for n in names if n.startswith(path)] == per_pass(path, passes - 1)
    assert len(names) == 2 + passes + 3 * passes + 8 * (passes - 1) + 2  # layers 0 and 2: a router, an output gate
    assert not any("MessageGate" in n or "GatedOutputProjection" in n for n in ctrl.notes)
    ids = windows(2, 0)
    with torch.no_grad(), ctrl.capture(*ids.shape) as found:
        live = model(ids).logits
    with torch.no_grad(), ctrl.replay(found):
        assert torch.equal(model(ids).logits, live)


@pytest.mark.slow
def test_inkling2_loop_audits_from_the_cli_with_every_loop_pass(hf_zoo, tmp_path):
    model = hf_zoo.tiny_model("inkling2_loop_text")
    ctrl = audited_by_cli(saved(tmp_path, model), tmp_path / "audit")
    passes = model.config.loop_num_passes
    assert ctrl["kinds"].count("expert_router") == 2 + passes
    assert len(ctrl["sites"]) == 2 + passes + 3 * passes + 8 * (passes - 1) + 2


# a looped model as a researcher writes it: one block, its gate inside, applied STEPS times

STEPS = 3


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.gate = nn.Linear(d, 1)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, h):
        return h + torch.sigmoid(self.gate(h)) * self.mlp(h)


class LoopedLM(nn.Module):
    def __init__(self, vocab: int = 32, d: int = 16, halt_token: int | None = None):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.block, self.head = nn.Embedding(vocab, d), Block(d), nn.Linear(d, vocab)
        self.halt_token = halt_token

    def forward(self, ids):
        h = self.emb(ids)
        for _ in range(STEPS):
            h = self.block(h)
            if self.halt_token is not None and (ids == self.halt_token).any():
                break  # a halting decision: how many passes run depends on the input
        return self.head(h)


def test_a_block_looped_in_plain_pytorch_audits_each_pass_with_call_k(tmp_path):
    model = LoopedLM().eval()
    passes = [fca.Controller.from_modules(model, "block.gate", "batch token ()", call=k) for k in range(STEPS)]
    ctrl = fca.Controller.merge(*passes)
    assert [s.name for s in ctrl.sites] == per_pass("block.gate", STEPS)
    # the rule the Hugging Face family applies finds the same sites, counting the calls in a probe pass
    found = per_call(model, fca.Controller.from_modules(model, "block.gate", "batch token ()"))
    assert [(s.name, s.calls, s.group) for s in found.sites] == [(s.name, STEPS, k) for k, s in enumerate(ctrl.sites)]
    res = fca.audit(model, found, torch.randint(0, 32, (4, 16)), torch.randint(0, 32, (4, 16)), randomizations=2,
                    out=tmp_path / "audit", batch_size=4, quiet=True)
    assert res.replay.bit_equal and res.replay.max_abs_dlogit == 0.0
    assert len(res.records) > 0


def test_a_loop_that_halts_on_the_input_is_refused_not_numbered():
    model = LoopedLM(halt_token=5).eval()
    ctrl = per_call(model, fca.Controller.from_modules(model, "block.gate", "batch token ()"))
    assert [s.calls for s in ctrl.sites] == [STEPS] * STEPS  # the probe's window holds no 5: every pass ran
    ids = torch.tensor([[1, 2, 5, 3]])  # a 5: the loop stops after its first pass

    def capture():
        with torch.no_grad(), ctrl.capture(*ids.shape):
            model(ids)

    line = api_refusal(capture)
    assert "'block.gate[call=0]': block.gate.forward ran 1 time(s) in a forward pass, not the 3" in line
    assert "halting" in line
    with torch.no_grad(), ctrl.capture(*ids.shape) as found:
        model(torch.tensor([[1, 2, 4, 3]]))  # no 5: three passes, captured

    def replay():  # a replay in which the loop stops early leaves two sites unreplayed: refused too
        with torch.no_grad(), ctrl.replay(found):
            model(ids)

    assert "ran 1 time(s) in a forward pass, not the 3" in api_refusal(replay)


def test_a_call_numbered_over_every_pass_of_a_looped_layer_is_refused_not_audited_for_one_pass():
    model = LoopedLM().eval()
    sigmoid = fca.Controller.from_ops(model, "block", "sigmoid", "batch token ()", call=0)  # the first pass's only
    line = api_refusal(lambda: per_call(model, sigmoid))
    assert "'block:sigmoid[call=0]': block.forward runs 3 times in a forward pass (a looped layer)" in line


def test_an_op_site_of_a_looped_block_is_one_site_per_pass_and_replays_exactly():
    model = LoopedLM().eval()
    ctrl = per_call(model, fca.Controller.from_ops(model, "block", "sigmoid", "batch token ()"))
    assert [s.name for s in ctrl.sites] == per_pass("block:sigmoid", STEPS)
    ids = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), ctrl.capture(*ids.shape) as found:
        live = model(ids)
    assert not torch.equal(found[0], found[1])  # each pass's gate, on that pass's state
    with torch.no_grad(), ctrl.replay(found):
        assert torch.equal(model(ids), live)


def test_a_model_that_fails_every_probe_window_is_refused_in_one_line():
    class Broken(LoopedLM):
        def forward(self, ids):
            raise RuntimeError("The size of tensor a (4) must match the size of tensor b (8)")

    model = Broken().eval()
    line = api_refusal(lambda: per_call(model, fca.Controller.from_modules(model, "block.gate", "batch token ()")))
    assert line.startswith("Broken fails a 4-token forward pass (RuntimeError: The size of tensor a (4)")
    assert "counts the calls of its controller sites" in line
