"""fca.execution on models written the way their authors write them: what the controller decided beside what the
forward pass computed, observed on the model (rows into each block's weights, FLOPs), never read from the decisions."""

import math

import pytest
import torch
from torch import nn

import fcaudit as fca
from fcaudit.errors import FcauditError


class GatedLM(nn.Module):  # the README's: residual updates scaled by input-dependent gates (`gates=False`: Dense)
    def __init__(self, vocab=256, d=32, n=2, gates=True):
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.head = nn.Embedding(vocab, d), nn.Linear(d, vocab)
        self.mlps = nn.ModuleList(nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)) for _ in range(n))
        self.gates = nn.ModuleList(nn.Sequential(nn.Linear(d, 1), nn.Sigmoid(), nn.Flatten(-2)) for _ in range(n)) \
            if gates else None

    def forward(self, ids):
        h = self.embed(ids)
        for i, mlp in enumerate(self.mlps):
            h = h + (self.gates[i](h).unsqueeze(-1) if self.gates else 1) * mlp(h)
        return self.head(h)


class Router(nn.Module):
    """Top-k tokens of the window, straight-through scores (exactly 1.0): (scores, sorted index)."""

    def __init__(self, d, k):
        super().__init__()
        self.score, self.k = nn.Linear(d, 1), k

    def forward(self, h):
        s = self.score(h).squeeze(-1)
        return s - s.detach() + 1, s.topk(self.k, dim=-1).indices.sort(-1).values


class RoutedBlock(nn.Module):
    """Mixture-of-Depths: the block runs on its router's k tokens, the others pass by the residual. `mask=True` is the
    same decision written as a mask: every token computed, the unchosen updates multiplied by 0."""

    def __init__(self, d, k, mask):
        super().__init__()
        self.router, self.mask = Router(d, k), mask
        self.mlp = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, h):
        scores, index = self.router(h)
        if self.mask:
            run = torch.zeros_like(scores).scatter(1, index, scores.gather(1, index))
            return h + run.unsqueeze(-1) * self.mlp(h)
        at = index.unsqueeze(-1).expand(-1, -1, h.shape[-1])
        return h.scatter_add(1, at, self.mlp(h.gather(1, at)) * scores.gather(1, index).unsqueeze(-1))


class RoutedLM(nn.Module):
    def __init__(self, k=4, mask=False, vocab=256, d=32, n=2):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.head = nn.Embedding(vocab, d), nn.Linear(d, vocab)
        self.blocks = nn.ModuleList(RoutedBlock(d, k, mask) for _ in range(n))

    def forward(self, ids):
        h = self.emb(ids)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


class ACT(nn.Module):
    """ACT's halting weights over S steps [B, T, S]: a token halts where the running sum passes 1 - eps."""

    def __init__(self, d, eps=0.05):
        super().__init__()
        self.unit, self.eps = nn.Linear(d, 1), eps

    def forward(self, states):
        p = torch.sigmoid(self.unit(states)).squeeze(-1)
        over = p.cumsum(-1) >= 1 - self.eps
        over[..., -1] = True
        halt = over.long().argmax(-1, keepdim=True)
        w = torch.where(torch.arange(p.shape[-1]) < halt, p, 0.0)
        return w.scatter(-1, halt, 1 - w.sum(-1, keepdim=True))


class PonderingLM(nn.Module):
    """A Universal-Transformer-like ACT as packages write it: the shared step runs every row for all S steps (until
    the whole batch has halted), then the states are mixed by the halting weights."""

    def __init__(self, vocab=64, d=16, steps=4):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.head = nn.Embedding(vocab, d), nn.Linear(d, vocab)
        self.step = nn.ModuleList([nn.Linear(d, d)])  # the one shared block
        self.halt, self.steps = ACT(d), steps
        nn.init.normal_(self.halt.unit.weight, std=1.0)
        nn.init.constant_(self.halt.unit.bias, 3.0)  # most tokens halt at the first step

    def forward(self, ids):
        h, states = self.emb(ids), []
        for _ in range(self.steps):
            h = h + torch.tanh(self.step[0](h))
            states.append(h)
        states = torch.stack(states, 2)
        return self.head((self.halt(states).unsqueeze(-1) * states).sum(2))


IDS = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(0))
FAST = dict(min_run_time=0.02, decode=False)


def test_a_soft_gate_decides_nothing_away_runs_everything_and_costs_its_controller():
    model = GatedLM().eval()
    ctrl = fca.Controller.from_modules(model, "gates.*", layout="batch token")
    r = fca.execution(model, ctrl, IDS, reference=GatedLM(gates=False).eval(), blocks="mlps.*", **FAST)
    assert (r.decided, r.executed, r.executed_by_block) == (1.0, 1.0, (1.0, 1.0))
    assert r.flops_vs_reference >= 1.0 and r.controller_flops > 1.0  # the gates' own matmuls
    assert "nothing was decided away" in r.verdict
    assert set(r) == {"live", "replayed", "reference"} and len(r.to_frame()) == 3
    assert "Execution" in r._repr_html_() and "ExecutionResult" in repr(r)


def test_a_router_that_gathers_its_tokens_executes_what_it_decided():
    model = RoutedLM(k=4).eval()
    ctrl = fca.Controller.from_modules(model, "blocks.*.router", kind="token_router")
    r = fca.execution(model, ctrl, IDS, **FAST)
    assert r.decided == pytest.approx(4 / 16) and r.executed == pytest.approx(4 / 16)  # the block's rows, observed
    assert r.blocks == ("blocks.0", "blocks.1") and "the decided saving realized" in r.verdict
    masked = RoutedLM(k=4, mask=True).eval()
    mr = fca.execution(masked, fca.Controller.from_modules(masked, "blocks.*.router", kind="token_router"), IDS, **FAST)
    assert mr.decided == pytest.approx(4 / 16) and mr.executed == 1.0
    assert "no saving realized" in mr.verdict
    assert r["live"].flops_per_token < mr["live"].flops_per_token  # FLOPs tell the same, counted independently
    # the default reference: the same model, every token chosen; the masked one computes all of it already
    assert r.flops_vs_reference < 0.75
    assert mr["replayed"].flops_per_token == mr["reference"].flops_per_token  # its k tokens cost what all T do
    assert "nothing decided away" in r["reference"].label


def test_a_halting_layer_that_runs_every_step_is_flagged():
    model = PonderingLM().eval()
    ctrl = fca.Controller.from_modules(model, "halt", layout="batch token step", kind="halting")
    ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1))
    r = fca.execution(model, ctrl, ids, blocks="step.*", **FAST)
    with torch.inference_mode(), ctrl.capture(*ids.shape) as found:
        model(ids)
    w = found[0][:, :, 0, :]  # [B, T, steps]: each token's depth is its last step of nonzero weight
    depth = 4 - (w != 0).flip(-1).long().argmax(-1)
    assert r.decided == pytest.approx(float(depth.double().mean()) / 4) and r.decided < 0.75
    assert r.executed == 1.0  # every token computed all 4 steps
    assert r.executed_by_block == (4.0,) and "no saving realized" in r.verdict


def test_decoding_is_measured_where_the_model_has_a_cache_and_said_why_not_elsewhere():
    model = GatedLM().eval()
    ctrl = fca.Controller.from_modules(model, "gates.*", layout="batch token")
    r = fca.execution(model, ctrl, IDS, blocks="mlps.*", min_run_time=0.02)
    assert "no KV-cache decoding path" in r.decoding["decode_note"]
    assert "decoding: " in repr(r)


def test_bad_settings_and_blocks_are_one_line_refusals():
    model = GatedLM().eval()
    ctrl = fca.Controller.from_modules(model, "gates.*", layout="batch token")
    with pytest.raises(FcauditError, match="batch_size=0: pass a positive integer"):
        fca.execution(model, ctrl, IDS, batch_size=0)
    routed = RoutedLM().eval()
    with pytest.raises(FcauditError, match="pass blocks= the path pattern"):
        fca.execution(routed, fca.Controller.from_modules(routed, "blocks.*.router", kind="token_router"), IDS,
                      blocks="blocks.*.mlp", **FAST)
    with pytest.raises(FcauditError, match="token ids"):
        fca.execution(model, ctrl, IDS.float(), **FAST)
    with pytest.raises(FcauditError, match="hold no weights but the controller's own"):
        fca.execution(model, ctrl, IDS, blocks="gates.*", **FAST)
    same = fca.execution(model, ctrl, IDS, blocks="mlps.*", **FAST)  # no reference given: its soft gates' own graph
    assert same["reference"].flops_per_token == same["replayed"].flops_per_token


def test_a_hugging_face_moe_decides_k_of_e_experts_and_its_experts_flops_show_k():
    pytest.importorskip("transformers")
    from fcaudit.families.hf.tiny import tiny_moe

    model = tiny_moe("mixtral", experts=4, top_k=2, layers=2)
    r = fca.execution(model, fca.controller_for(model), IDS, min_run_time=0.02)
    assert r.decided == pytest.approx(2 / 4) and r.executed == pytest.approx(2 / 4)
    assert "reference" not in r and math.isnan(r.flops_vs_reference)  # a top-k codec keeps k experts: pass one
    assert "the decided saving realized" in r.verdict
    assert r.decoding["decode_note"] == "" and r.decoding["decode_max_abs_dlogit"] < 1e-4  # through its own cache
    assert r.decoding["decode_ms_per_token"] > 0 and "ms per token" in repr(r)


class DenseMoE(nn.Module):
    """A top-k MoE written densely, as tutorials do: every expert computes every token, then the top-k weights."""

    def __init__(self, d=16, experts=4, k=1):
        super().__init__()
        self.router, self.k = nn.Linear(d, experts), k
        self.experts = nn.ModuleList(nn.Linear(d, d) for _ in range(experts))

    def forward(self, h):
        top = self.router(h).softmax(-1).topk(self.k, -1)
        w = torch.zeros(*h.shape[:-1], len(self.experts)).scatter(-1, top.indices, top.values)
        return h + sum(w[..., e:e + 1] * expert(h) for e, expert in enumerate(self.experts))


class DenseMoELM(nn.Module):
    def __init__(self, vocab=256, d=16):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.head, self.layers = nn.Embedding(vocab, d), nn.Linear(d, vocab), nn.ModuleList([DenseMoE(d)])

    def forward(self, ids):
        h = self.emb(ids)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def test_an_moe_written_densely_computes_every_expert_and_says_so():
    model = DenseMoELM().eval()
    ctrl = fca.Controller.from_ops(model, "layers.*", "scatter", "batch token source", kind="expert_router")
    with pytest.raises(FcauditError, match="pass blocks= the path pattern of its experts"):
        fca.execution(model, ctrl, IDS, **FAST)
    r = fca.execution(model, ctrl, IDS, blocks="layers.*.experts.*", **FAST)
    assert r.decided == pytest.approx(1 / 4) and r.executed == 1.0 and "no saving realized" in r.verdict


class ConvGatedLM(nn.Module):
    """Blocks mixing tokens with a causal depthwise convolution (channels first, as torch's Conv1d takes them), more
    channels than tokens, their updates scaled by a soft gate: every block computes every token."""

    def __init__(self, vocab=64, d=48, n=2):
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.head = nn.Embedding(vocab, d), nn.Linear(d, vocab)
        self.convs = nn.ModuleList(nn.Conv1d(d, d, 3, padding=2, groups=d) for _ in range(n))
        self.gates = nn.ModuleList(nn.Linear(d, 1) for _ in range(n))

    def forward(self, ids):
        h = self.embed(ids)
        for conv, gate in zip(self.convs, self.gates):
            mixed = conv(h.transpose(1, 2))[..., :h.shape[1]].transpose(1, 2)
            h = h + torch.sigmoid(gate(h)) * mixed
        return self.head(h)


def test_a_convolution_counts_its_positions_not_its_channels_as_rows():
    model = ConvGatedLM().eval()
    ctrl = fca.Controller.from_modules(model, "gates.*", layout="batch token 1", kind="scalar_gate")
    r = fca.execution(model, ctrl, IDS[:, :12] % 64, blocks="convs.*", **FAST)
    assert (r.executed, r.executed_by_block) == (1.0, (1.0, 1.0))  # 48 channels are not rows


def test_a_replay_slower_than_the_live_pass_says_the_latency_ratio_measures_the_replay():
    from fcaudit.execution.decided import ExecutionResult, Variant

    def result(replayed_ms):
        variants = {"live": Variant("live", 1e6, 3.0, 0.1), "replayed": Variant("replayed", 1e6, replayed_ms, 0.1)}
        return ExecutionResult(1.0, 1.0, ("b",), (1.0,), variants, {"decode_note": "not asked"})

    slow, level = result(4.5), result(3.1)
    assert slow.controller_latency < 1 and "measures the replay, not the controller's cost" in repr(slow)
    assert level.latency_note is None and "measures the replay" not in repr(level)


class LoopedLM(nn.Module):
    """One gated block applied three times per token (a looped layer), then a plain one."""

    def __init__(self, vocab=64, d=32):
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.head = nn.Embedding(vocab, d), nn.Linear(d, vocab)
        self.blocks = nn.ModuleList(nn.Linear(d, d) for _ in range(2))
        self.gate = nn.Linear(d, 1)

    def forward(self, ids):
        h = self.embed(ids)
        for _ in range(3):
            h = h + torch.sigmoid(self.gate(h)) * self.blocks[0](h)
        return self.head(h + self.blocks[1](h))


def test_a_looped_block_reads_over_100_percent_and_says_why():
    model = LoopedLM().eval()
    ctrl = fca.Controller.merge(*(fca.Controller.from_modules(model, "gate", layout="batch token 1",
                                                              kind="scalar_gate", call=k) for k in range(3)))
    r = fca.execution(model, ctrl, IDS % 64, **FAST)
    assert r.executed_by_block == (3.0, 1.0) and r.executed == 2.0
    assert "over 100%: a block computes a token more than once" in r.verdict
