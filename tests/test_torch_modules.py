"""Models built from torch's own attention modules, as researchers build them: nn.MultiheadAttention,
nn.TransformerEncoderLayer and nn.TransformerDecoderLayer in eval mode with batch_first=True take a fused fast path,
which a TorchFunctionMode (the pre-write checks' Flow pass, an op site's capture and replay) turns off and which
rounds differently. The audits below replay bit-exactly with the fast path on: no check compares a pass under a mode
with a pass without one."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

import fcaudit as fca

VOCAB, CTX, WIDTH, HEADS = 48, 12, 16, 2


def causal(t: int) -> torch.Tensor:
    return torch.ones(t, t, dtype=torch.bool).triu(1)  # True: may not attend (a bool mask keeps the fast path)


class AttnBlock(nn.Module):
    """Pre-norm attention whose update a per-token gate scales."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.attn = nn.MultiheadAttention(WIDTH, HEADS, batch_first=True)
        self.gate = nn.Sequential(nn.Linear(WIDTH, 1), nn.Sigmoid())
        self.ff = nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH))

    def forward(self, x):
        h = self.norm(x)
        a, _ = self.attn(h, h, h, attn_mask=causal(x.shape[1]), need_weights=False)
        x = x + self.gate(h) * a
        return x + self.ff(x)


class EncoderBlock(nn.Module):
    """A whole encoder layer as the branch; the gate mixes its output with the block's input."""

    def __init__(self):
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(WIDTH, HEADS, dim_feedforward=2 * WIDTH, batch_first=True)
        self.gate = nn.Linear(WIDTH, 1)

    def forward(self, x):
        y = self.layer(x, src_mask=causal(x.shape[1]), is_causal=True)
        g = torch.sigmoid(self.gate(x))
        return x + g * (y - x)


class DecoderBlock(nn.Module):
    """A decoder layer attending to a learned memory (a few prefix slots), its update gated per token."""

    def __init__(self):
        super().__init__()
        self.layer = nn.TransformerDecoderLayer(WIDTH, HEADS, dim_feedforward=2 * WIDTH, batch_first=True)
        self.memory = nn.Parameter(torch.randn(4, WIDTH) * 0.5)
        self.gate = nn.Sequential(nn.Linear(WIDTH, 1), nn.Sigmoid())

    def forward(self, x):
        mem = self.memory.expand(x.shape[0], -1, -1)
        y = self.layer(x, mem, tgt_mask=causal(x.shape[1]), tgt_is_causal=True)
        return x + self.gate(x) * (y - x)


class TinyLM(nn.Module):
    def __init__(self, block: type[nn.Module], n_layer: int = 2):
        super().__init__()
        torch.manual_seed(0)
        self.tok = nn.Embedding(VOCAB, WIDTH)
        self.pos = nn.Embedding(CTX, WIDTH)
        self.blocks = nn.ModuleList(block() for _ in range(n_layer))
        self.out = nn.Linear(WIDTH, VOCAB)

    def forward(self, ids):
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        for b in self.blocks:
            x = b(x)
        return self.out(x)


# the fused kernel each model's blocks call on their fast path
FUSED = {AttnBlock: "_native_multi_head_attention", EncoderBlock: "_transformer_encoder_layer_fwd",
         DecoderBlock: "_native_multi_head_attention"}
GATES = {AttnBlock: "blocks.*.gate", EncoderBlock: "blocks.*.gate", DecoderBlock: "blocks.*.gate"}


def ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n, CTX), generator=torch.Generator().manual_seed(seed))


def fused_calls(monkeypatch, name: str) -> list[int]:
    """Counts the calls of torch's fused kernel `name` (the module looks it up on torch at each call)."""
    calls, fused = [], getattr(torch, name)
    monkeypatch.setattr(torch, name, lambda *a, **k: calls.append(1) or fused(*a, **k))
    return calls


class Nothing(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("block", [AttnBlock, EncoderBlock, DecoderBlock], ids=lambda b: b.__name__)
def test_torch_attention_modules_audit_with_an_exact_replay_on_their_fast_path(block, monkeypatch, tmp_path):
    model = TinyLM(block).eval()
    x = ids(4, 0)
    calls = fused_calls(monkeypatch, FUSED[block])
    with torch.inference_mode():
        plain = model(x)
        assert len(calls) == 2 and torch.equal(model(x), plain)  # the fast path, deterministic
        with Nothing():  # any TorchFunctionMode turns it off, and the other path rounds differently
            moded = model(x)
    assert len(calls) == 4 and not torch.equal(moded, plain)
    ctrl = fca.Controller.from_modules(model, GATES[block], layout="batch token 1")
    planned = fca.plan(model, ctrl, x, ids(2, 1), randomizations=1, batch_size=2)
    passes, before = [], len(calls)
    model.register_forward_pre_hook(lambda *a: passes.append(1))
    result = fca.audit(model, ctrl, x, ids(2, 1), randomizations=1, batch_size=2, seed=0, out=tmp_path / "a",
                       quiet=True)
    r = result.replay
    assert r.passed and r.bit_equal and r.max_abs_dlogit == 0 and r.delta_nll == 0
    assert not [f for f in r.findings if f.refusal]
    assert len(calls) > before  # the audit's captures and replays ran on the fast path
    assert len(passes) == planned.forward_passes  # the plan counts the checks' passes, the Flow pass among them
    assert result.penalties()["StructureRemoved"].statistic != 0  # the gates matter: the replays moved something


class OpGatedBlock(nn.Module):
    """The gate computed inline (no module of its own): reached as the sigmoid op of the block's forward."""

    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(WIDTH, HEADS, batch_first=True)
        self.score = nn.Linear(WIDTH, 1)

    def forward(self, x):
        a, _ = self.attn(x, x, x, attn_mask=causal(x.shape[1]), need_weights=False)
        return x + torch.sigmoid(self.score(x)) * a


def test_an_op_site_around_torch_attention_captures_and_replays_under_the_same_mode(monkeypatch, tmp_path):
    """An op site's TorchFunctionMode is active while its method runs, in the capture and in the replay alike, so the
    attention inside takes the same (unfused) path in both and the replay is exact."""
    model = TinyLM(OpGatedBlock).eval()
    x = ids(4, 0)
    calls = fused_calls(monkeypatch, "_native_multi_head_attention")
    with torch.inference_mode():
        model(x)
    assert len(calls) == 2  # a plain pass takes the fast path
    ctrl = fca.Controller.from_ops(model, "blocks.*", "sigmoid", method="forward", layout="batch token 1")
    result = fca.audit(model, ctrl, x, ids(2, 1), randomizations=1, batch_size=2, seed=0, out=tmp_path / "a",
                       quiet=True)
    r = result.replay
    assert r.passed and r.bit_equal and r.max_abs_dlogit == 0 and r.delta_nll == 0
    assert len(calls) == 2  # every audit pass ran the block under the op site's mode: no fast path, on either side


class Noisy(AttnBlock):
    """The determinism check still refuses what is not deterministic, on a model with the fast path on."""

    def forward(self, x):
        return super().forward(x) + 1e-3 * torch.randn_like(x)


def test_a_nondeterministic_torch_attention_model_is_still_refused(tmp_path):
    model = TinyLM(Noisy).eval()
    ctrl = fca.Controller.from_modules(model, "blocks.*.gate", layout="batch token 1")
    with pytest.raises(fca.FcauditError, match=r"^two Correct passes of the first evaluation batch differ in the "
                                                 r"logits .*not deterministic in eval mode"):
        fca.audit(model, ctrl, ids(4, 0), ids(2, 1), randomizations=1, batch_size=2, out=tmp_path / "a", quiet=True)
