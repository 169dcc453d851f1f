"""The pre-write checks' "looks like a hidden state" notice (controllers/flow.py, flow_checks.py) on models written
the way researchers write them: a block's output that the next block transforms is a hidden state; an output gate of
the model's width handed to a gated norm as its gate (Qwen3.5's and Kimi's linear attention) is a coefficient and gets
no notice; a state handed to a module as a later argument is still followed, into the ops that contract it."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fcaudit as fca
from conftest import V, run

WIDTH = 16


def running_mean(v):
    return v.cumsum(1) / torch.arange(1, v.shape[1] + 1)[:, None]


class PreNormMLP(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.ln(running_mean(x)))))


class GatedRMSNorm(nn.Module):
    """RMSNorm times act(gate), as linear-attention layers gate their output (`norm(core_out, z)`)."""

    def __init__(self, d, act=None):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(d))
        self.act = act

    def forward(self, hidden, gate):
        hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + 1e-6) * self.scale
        return hidden * (self.act(gate) if self.act is not None else F.silu(gate))


class OutputGated(nn.Module):
    def __init__(self, d, act=None, by_keyword=False):
        super().__init__()
        self.v = nn.Linear(d, d)
        self.z = nn.Linear(d, d)  # the output gate's logits: as wide as the hidden state
        self.norm = GatedRMSNorm(d, act)
        self.o = nn.Linear(d, d)
        self.by_keyword = by_keyword

    def forward(self, x):
        core = running_mean(self.v(x))
        z = self.z(x)
        out = self.norm(core, gate=z) if self.by_keyword else self.norm(core, z)
        return x + self.o(out)


class ReadsState(nn.Module):
    """Takes a state of the hidden width as its second argument and contracts it: `x + s @ W`."""

    def __init__(self, d):
        super().__init__()
        self.w = nn.Parameter(torch.randn(d, d) / d ** 0.5)

    def forward(self, x, s):
        return x + s @ self.w


class StateBlock(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.state = nn.Linear(d, d)
        self.read = ReadsState(d)

    def forward(self, x):
        return self.read(x, self.state(running_mean(x)))


class TinyLM(nn.Module):
    def __init__(self, make_layer, n_layers=2, vocab=V, d=WIDTH):
        super().__init__()
        torch.manual_seed(3)
        self.embed = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList([make_layer(d) for _ in range(n_layers)])
        self.out = nn.Linear(d, vocab)

    def forward(self, input_ids):
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x)
        return self.out(x)


def audited(model, ctrl, tmp_path):
    res = run(model.eval(), ctrl, tmp_path / "audit", n_eval=4, n_calib=2, R=2, batch_size=2)
    assert res.replay.passed and res.replay.bit_equal and res.replay.max_abs_dlogit == 0
    return [n for n in res.notices if n.startswith("note: site")]


def test_a_block_output_the_next_block_transforms_is_noticed_as_a_hidden_state(tmp_path):
    model = TinyLM(PreNormMLP)
    notes = audited(model, fca.Controller.from_modules(model, "layers.*", "batch token hidden"), tmp_path)
    assert len(notes) == 1 and notes[0].startswith(f"note: site 'layers.0' (and 1 more) looks like a hidden state, "
                                                   f"not a coefficient: its source axis has the model's hidden "
                                                   f"width {WIDTH}")


@pytest.mark.parametrize("act,by_keyword", [(None, False), (None, True), (nn.SiLU(), False)],
                         ids=["F.silu", "gate=z", "an activation module"])
def test_an_output_gate_handed_to_a_gated_norm_is_no_hidden_state(act, by_keyword, tmp_path):
    model = TinyLM(lambda d: OutputGated(d, act, by_keyword))
    assert audited(model, fca.Controller.from_modules(model, "layers.*.z", "batch token channel"), tmp_path) == []


def test_a_state_a_module_takes_as_a_later_argument_is_still_noticed(tmp_path):
    model = TinyLM(StateBlock)
    notes = audited(model, fca.Controller.from_modules(model, "layers.*.state", "batch token hidden"), tmp_path)
    assert len(notes) == 1 and re.match(r"note: site 'layers.0.state' \(and 1 more\) looks like (a hidden state|"
                                        r"hidden-width features)", notes[0]), notes


def test_qwen3_5s_output_gate_z_is_audited_with_no_hidden_state_notice(tmp_path):
    """Qwen3.5's gated delta net gates its output with `norm(core_attn_out, z)`: z (in_proj_z) has the hidden width
    here, and is a coefficient."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.AutoConfig.for_model(
        "qwen3_5_text", vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=2,
        linear_key_head_dim=16, linear_value_head_dim=16, layer_types=["linear_attention", "full_attention"],
        pad_token_id=None, bos_token_id=None, eos_token_id=None)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    ctrl = fca.controller_for(model)
    assert "model.layers.0.linear_attn.in_proj_z" in [s.name for s in ctrl.sites]
    assert model.model.layers[0].linear_attn.in_proj_z.out_features == cfg.hidden_size  # the check follows it
    ids = torch.randint(0, 256, (8, 16), generator=torch.Generator().manual_seed(0))
    res = fca.audit(model, ctrl, ids[:4], ids[4:], randomizations=2, seed=0, out=tmp_path / "audit", batch_size=4,
                    quiet=True)
    assert res.replay.passed and res.replay.bit_equal
    assert not [n for n in res.notices if n.startswith("note: site")], res.notices
