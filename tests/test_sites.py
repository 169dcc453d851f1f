"""Controllers as other people write them: tiny models with exactly the shapes of third-party dynamic mechanisms (a
module called twice with two meanings, a local `normed @ self.w` in a method the parent calls directly, a Python
GRU cell's gates, a router whose namedtuple output gathers from its input, two sites of one layer merged), each
audited with the public API, an exact replay and no change to the model's code."""

from __future__ import annotations

import json
import re
from collections import namedtuple
from typing import Callable

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fcaudit as fca
from fcaudit import protocol
from fcaudit.controllers import Layout
from fcaudit.controllers.sites import op_name
from fcaudit.errors import FcauditError
from fcaudit.kinds import Description

V, D, T, S = 32, 16, 8, 2


def causal_mean(x: torch.Tensor) -> torch.Tensor:
    """Token mixing that looks only backwards: position t sees the mean of positions <= t."""
    return x.cumsum(1) / torch.arange(1, x.shape[1] + 1, dtype=x.dtype)[:, None]


def windows(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, V, (n, T), generator=torch.Generator().manual_seed(seed))


def audit(model, ctrl, tmp_path, name="audit", **kw):
    return fca.audit(model, ctrl, windows(4, 0), windows(2, 1), randomizations=2, seed=0, out=tmp_path / name,
                     batch_size=2, quiet=True, **kw)


def assert_exact(result):
    assert result.replay.bit_equal and result.replay.max_abs_dlogit == 0 and result.replay.passed


class LM(nn.Module):
    """Embedding, blocks, norm and head around any block (the blocks take and return [batch, token, hidden])."""

    def __init__(self, blocks: list[nn.Module], seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Embedding(V, D)
        self.blocks = nn.ModuleList(blocks)
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, V)

    def forward(self, ids):
        h = self.emb(ids)
        for b in self.blocks:
            h = b(h)
        return self.head(self.norm(h))


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))


# ---- 1 + 5. one activation module applied twice with different meanings; alpha and beta of one layer merged ------

class HyperConnection(nn.Module):
    """S residual streams mixed per token by alpha [b, t, 1, S, S+1] (column 0: the branch input, the rest: the
    stream mix) and beta [b, t, 1, S] (the branch output per stream); one activation module makes both."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.alpha_fn = nn.Linear(D, S * (S + 1))
        self.beta_fn = nn.Linear(D, S)
        self.act = nn.Tanh()

    def forward(self, streams: torch.Tensor, branch: nn.Module) -> torch.Tensor:
        b, t, s, _ = streams.shape
        normed = self.norm(streams.mean(2))
        alpha = self.act(self.alpha_fn(normed).view(b, t, 1, s, s + 1))
        beta = self.act(self.beta_fn(normed).view(b, t, 1, s))
        out = branch(causal_mean(torch.einsum("btsd,bts->btd", streams, alpha[:, :, 0, :, 0])))
        mixed = torch.einsum("btsd,btsr->btrd", streams, alpha[:, :, 0, :, 1:])
        return mixed + beta[:, :, 0, :, None] * out[:, :, None]


class HCBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.hc_attn = HyperConnection()
        self.mlp = mlp()

    def forward(self, streams):
        return self.hc_attn(streams, self.mlp)


class HCModel(LM):
    def forward(self, ids):
        h = self.emb(ids)[:, :, None].expand(-1, -1, S, -1)
        for b in self.blocks:
            h = b(h)
        return self.head(self.norm(h.sum(2)))


def hc_model() -> HCModel:
    return HCModel([HCBlock(), HCBlock()]).eval()


def hc_controller(model: nn.Module) -> fca.Controller:
    alpha = fca.Controller.from_modules(model, "blocks.*.hc_attn.act", "batch token () stream source", call=0)
    beta = fca.Controller.from_modules(model, "blocks.*.hc_attn.act", "batch token () stream", call=1)
    return fca.Controller.merge(alpha, beta)


def test_a_module_called_twice_is_refused_naming_call_and_each_call_audits_exactly(tmp_path):
    model = hc_model()
    with pytest.raises(FcauditError, match=r"ran twice in one forward pass.*call=0 or call=1"):
        audit(model, fca.Controller.from_modules(model, "blocks.*.hc_attn.act", "batch token () stream source"),
              tmp_path, "twice")
    assert not (tmp_path / "twice").exists()
    with pytest.raises(FcauditError, match=r"ran 2 time\(s\).*call=2 does not exist; pass call=0..1"):
        audit(model, fca.Controller.from_modules(model, "blocks.*.hc_attn.act", "batch token () stream", call=2),
              tmp_path, "third")
    ctrl = hc_controller(model)
    assert [s.name for s in ctrl.sites][:2] == ["blocks.0.hc_attn.act[call=0]", "blocks.1.hc_attn.act[call=0]"]
    assert ctrl.groups == (0, 1, 0, 1)  # alpha and beta of one layer: one group
    result = audit(model, ctrl, tmp_path)
    assert_exact(result)
    assert "forward" not in model.blocks[0].hc_attn.act.__dict__  # restored: the model's code is untouched
    d = result.penalties().to_frame()["statistic"]
    assert d["CrossInput"] != 0 and d["TokenShuffle"] != 0


def test_replaying_one_call_leaves_the_modules_other_call_computed():
    model = hc_model()
    ids = windows(2, 0)
    beta = fca.Controller.from_modules(model, "blocks.*.hc_attn.act", "batch token () stream", call=1)
    with torch.inference_mode():
        with beta.capture(2, T) as found:
            ref = model(ids)
        with beta.replay([torch.zeros_like(c) for c in found], found.decoding):
            zeroed = model(ids)
        with beta.replay(found):
            same = model(ids)
    assert torch.equal(same, ref) and not torch.equal(zeroed, ref)


# ---- 2. a method the parent calls directly, holding local `normed @ self.w` coefficients --------------------------

class Residual(nn.Module):
    """Hyper-connection residual in the style of third-party code: the parent calls `prepare` and `gate`, never
    `forward`; the coefficients are local tensors of `prepare`."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.dynamic_alpha_fn = nn.Parameter(torch.randn(D, S) * 0.5)
        self.dynamic_beta_fn = nn.Parameter(torch.randn(D, 1) * 0.5)
        self.gate_fn = nn.Linear(D, 1)

    def prepare(self, x):
        normed = self.norm(x)
        wc_weight = normed @ self.dynamic_alpha_fn
        dc_weight = normed @ self.dynamic_beta_fn
        return wc_weight.softmax(-1), dc_weight

    def gate(self, x):
        return torch.sigmoid(self.gate_fn(x)).squeeze(-1)

    def forward(self, x):
        raise AssertionError("the parent never calls forward")


class ResidualBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.residual_fn = Residual()
        self.mlp = nn.ModuleList([mlp() for _ in range(S)])

    def forward(self, x):
        wc, dc = self.residual_fn.prepare(x)
        g = self.residual_fn.gate(x)
        out = sum(wc[..., i, None] * m(causal_mean(x)) for i, m in enumerate(self.mlp))
        return x * (1 + dc) + g[..., None] * out


def residual_model() -> LM:
    return LM([ResidualBlock(), ResidualBlock()], seed=1).eval()


def test_local_matmul_results_in_a_method_are_sites_and_replay_does_not_compute_them(tmp_path, monkeypatch):
    model = residual_model()
    wc = fca.Controller.from_ops(model, "blocks.*.residual_fn", "@", "batch token source", method="prepare", call=0)
    dc = fca.Controller.from_ops(model, "blocks.*.residual_fn", "matmul", "batch token ()", method="prepare", call=1)
    ctrl = fca.Controller.merge(wc, dc)
    assert ctrl.groups == (0, 1, 0, 1)
    result = audit(model, ctrl, tmp_path)
    assert_exact(result)
    assert "prepare" not in model.blocks[0].residual_fn.__dict__
    # replay substitutes the op's result: no matmul runs inside prepare
    seen = []

    class Count(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(op_name(func))
            return func(*args, **(kwargs or {}))

    ids = windows(2, 0)
    with torch.inference_mode(), ctrl.capture(2, T) as found:
        ref = model(ids)
    with torch.inference_mode(), ctrl.replay(found), Count():
        assert torch.equal(model(ids), ref)
    assert "matmul" not in seen


def test_a_method_the_parent_calls_directly_is_a_site(tmp_path):
    model = residual_model()
    ctrl = fca.Controller.from_modules(model, "blocks.*.residual_fn", "batch token", method="gate")
    assert_exact(audit(model, ctrl, tmp_path))
    with pytest.raises(FcauditError, match=r"has no method 'gates'; its own methods are \['forward', 'gate', 'prepare'\]"):
        fca.Controller.from_modules(model, "blocks.*.residual_fn", "batch token", method="gates")
    unused = fca.Controller.from_modules(model, "blocks.*.residual_fn", "batch token", method="extra_repr")
    with pytest.raises(FcauditError, match=r"residual_fn.extra_repr did not run in a forward pass; pick a method"):
        audit(model, unused, tmp_path, "unused")
    with pytest.raises(FcauditError, match="has no method 'gate_fn'"):  # a submodule: its path goes in the pattern
        fca.Controller.from_modules(model, "blocks.*.residual_fn", "batch token", method="gate_fn")


@pytest.mark.parametrize("op,call,match", [
    ("matmul", None, r"ran twice in one forward pass \(#0 matmul\(\[2, 8, 16\], \[16, 2\]\) -> \[2, 8, 2\]; "
                     r"#1 matmul\(\[2, 8, 16\], \[16, 1\]\) -> \[2, 8, 1\]\).*call=0 or call=1"),
    ("matmul", 2, r"made 2 call\(s\) of 'matmul' \(#0 matmul\(\[2, 8, 16\], \[16, 2\]\) -> \[2, 8, 2\]; #1 "
                  r"matmul\(\[2, 8, 16\], \[16, 1\]\) -> \[2, 8, 1\]\), so call=2 does not exist; pass call=0..1"),
    ("tanh", 0, r"made no call of 'tanh'"),
])
def test_an_op_that_matches_nothing_or_twice_gets_one_line_naming_the_calls_it_saw(op, call, match, tmp_path):
    model = residual_model()
    ctrl = fca.Controller.from_ops(model, "blocks.*.residual_fn", op, "batch token source", method="prepare",
                                   call=call)
    with pytest.raises(FcauditError, match=match):
        audit(model, ctrl, tmp_path)
    assert not (tmp_path / "audit").exists()


# ---- 3. gates inside a fused op: the documented Python cell, equal to nn.GRUCell ----------------------------------

class GRUCell(nn.Module):
    """nn.GRUCell written out, so its reset and update gates are sigmoid calls a site can reach."""

    def __init__(self, size: int):
        super().__init__()
        fused = nn.GRUCell(size, size)
        self.weight_ih, self.weight_hh = fused.weight_ih, fused.weight_hh
        self.bias_ih, self.bias_hh = fused.bias_ih, fused.bias_hh

    def forward(self, x, h):
        i_r, i_z, i_n = F.linear(x, self.weight_ih, self.bias_ih).chunk(3, -1)
        h_r, h_z, h_n = F.linear(h, self.weight_hh, self.bias_hh).chunk(3, -1)
        r = torch.sigmoid(i_r + h_r)
        z = torch.sigmoid(i_z + h_z)
        n = torch.tanh(i_n + r * h_n)
        return (1 - z) * n + z * h


class GRUBlock(nn.Module):
    """A GRU-gated residual (GTrXL style): the cell merges the branch output into the residual stream per token."""

    def __init__(self):
        super().__init__()
        self.mlp = mlp()
        self.cell = GRUCell(D)

    def forward(self, h):
        b, t, d = h.shape
        return self.cell(self.mlp(causal_mean(h)).reshape(-1, d), h.reshape(-1, d)).reshape(b, t, d)


def gru_model() -> LM:
    return LM([GRUBlock(), GRUBlock()], seed=2).eval()


def gru_gates(model: nn.Module) -> fca.Controller:
    r = fca.Controller.from_ops(model, "blocks.*.cell", "sigmoid", "(batch token) gate", call=0)
    z = fca.Controller.from_ops(model, "blocks.*.cell", "sigmoid", "(batch token) gate", call=1)
    return fca.Controller.merge(r, z)


def test_the_python_cell_equals_the_fused_one_and_its_gates_audit_exactly(tmp_path):
    cell = GRUCell(D)
    fused = nn.GRUCell(D, D)
    fused.load_state_dict({"weight_ih": cell.weight_ih, "weight_hh": cell.weight_hh, "bias_ih": cell.bias_ih,
                           "bias_hh": cell.bias_hh})
    x, h = torch.randn(5, D), torch.randn(5, D)
    torch.testing.assert_close(cell(x, h), fused(x, h))
    model = gru_model()
    result = audit(model, gru_gates(model), tmp_path)
    assert_exact(result)
    assert result.penalties().to_frame()["statistic"]["TokenShuffle"] != 0


# ---- 4. a router returning a namedtuple whose routed tokens are gathered from its input ---------------------------

Routed = namedtuple("Routed", "indices scores routed_tokens mask")
K = 3


class TokenRouter(nn.Module):
    """A fixed-budget token router: the K best-scoring tokens of each window go through the block."""

    def __init__(self):
        super().__init__()
        self.score = nn.Linear(D, 1)

    def forward(self, x):
        scores = self.score(x).squeeze(-1)
        indices = scores.topk(K, dim=1).indices.sort(1).values
        routed = x.gather(1, indices[..., None].expand(-1, -1, x.shape[-1]))
        mask = torch.zeros_like(scores, dtype=torch.bool).scatter(1, indices, True)
        return Routed(indices, scores, routed, mask)


class RoutedBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.router = TokenRouter()
        self.mlp = mlp()

    def forward(self, h):
        h = h + causal_mean(h)
        r = self.router(h)
        out = self.mlp(r.routed_tokens) * torch.sigmoid(r.scores.gather(1, r.indices))[..., None]
        return h + torch.zeros_like(h).scatter(1, r.indices[..., None].expand_as(out), out)


class RoutedCodec(fca.Codec):
    """The router's scores are the coefficient; decode selects as the router does and gathers the routed tokens
    from the router's live input."""

    def encode(self, output, batch, token):
        return output.scores.detach().reshape(batch, token, 1, 1).clone()

    def decode(self, canonical, meta, inputs):
        x = inputs.args[0]
        scores = canonical.reshape(canonical.shape[0], -1)
        indices = scores.topk(K, dim=1).indices.sort(1).values
        routed = x.gather(1, indices[..., None].expand(-1, -1, x.shape[-1]))
        mask = torch.zeros_like(scores, dtype=torch.bool).scatter(1, indices, True)
        return Routed(indices, scores, routed, mask)


def routed_model() -> LM:
    return LM([RoutedBlock(), RoutedBlock()], seed=3).eval()


def test_a_codec_reads_the_sites_live_inputs_to_rebuild_a_namedtuple(tmp_path):
    model = routed_model()
    ctrl = fca.Controller.from_modules(model, "blocks.*.router", codec=RoutedCodec())
    result = audit(model, ctrl, tmp_path)
    assert_exact(result)
    assert result.penalties().to_frame()["statistic"]["TokenShuffle"] != 0


def test_two_argument_codecs_keep_working_and_get_no_inputs():
    class Plain(fca.Codec):
        def encode(self, output, batch, token):
            return output.detach().reshape(batch, token, 1, 1).clone()

        def decode(self, canonical, meta):
            return canonical.reshape(canonical.shape[0], -1)

    model = residual_model()
    ctrl = fca.Controller.from_modules(model, "blocks.*.residual_fn", codec=Plain(), method="gate")
    assert not ctrl.sites[0].reads_inputs and fca.Controller.from_modules(
        routed_model(), "blocks.*.router", codec=RoutedCodec()).sites[0].reads_inputs
    ids = windows(2, 0)
    with torch.inference_mode():
        with ctrl.capture(2, T) as found:
            ref = model(ids)
        with ctrl.replay(found):
            assert torch.equal(model(ids), ref)


# ---- groups: the randomized conditions move a group's coefficients together --------------------------------------

def test_merge_groups_by_module_or_an_explicit_key_and_refuses_a_site_twice():
    model = hc_model()
    alpha = fca.Controller.from_modules(model, "blocks.*.hc_attn.act", "batch token () stream source", call=0)
    beta = fca.Controller.from_modules(model, "blocks.*.hc_attn.act", "batch token () stream", call=1)
    assert fca.Controller.merge(alpha, beta).info.groups == (0, 1, 0, 1)
    assert fca.Controller.merge(alpha, beta, group=lambda s: s.path).info.groups == (0, 1, 0, 1)
    assert fca.Controller.merge(alpha, beta, group=lambda s: s.name).groups == ()  # every site its own group
    with pytest.raises(FcauditError, match="is in two of the merged controllers"):
        fca.Controller.merge(alpha, alpha)
    every = fca.Controller.from_modules(model, "blocks.*.hc_attn.act", "batch token () stream")
    for pair in ((alpha, every), (every, alpha)):  # in either order
        with pytest.raises(FcauditError, match="takes every call and another merged site one of them; pass call=N"):
            fca.Controller.merge(*pair)
    assert "groups" in fca.Controller.merge(alpha, beta).describe() and "groups" not in alpha.describe()


def test_a_merged_mixture_and_gate_keep_their_own_references(tmp_path):
    """Merged, alpha (a mixture over the branch input and the streams) keeps SourceUniformMean and beta (a gate per
    stream) its GlobalMean, the mean over the gate sites' coefficients: the gate's StructureRemoved is no copy of its
    StaticProfile, as it was with one SourceUniformMean for every site."""
    from safetensors.torch import load_file

    model = hc_model()
    alpha = fca.Controller.from_modules(model, "blocks.*.hc_attn.act", "batch token () stream source", call=0,
                                        kind="source_mixture")
    beta = fca.Controller.from_modules(model, "blocks.*.hc_attn.act", "batch token () stream", call=1)
    ctrl = fca.Controller.merge(alpha, beta)
    assert [(s.kind, s.reference) for s in ctrl.sites] == [("source_mixture", "SourceUniformMean")] * 2 + \
        [("vector_gate", "GlobalMean")] * 2
    assert ctrl.labels["StructureRemoved"] == "SourceUniformMean + GlobalMean" and ctrl.describe()["static"] == \
        "StaticProfile"
    result = audit(model, ctrl, tmp_path)
    assert_exact(result)
    profiles = load_file(str(tmp_path / "audit" / "profiles.safetensors"))
    with torch.inference_mode(), ctrl.capture(2, T) as calib:
        model(windows(2, 1))  # the audit's calibration windows
    gates = torch.cat([c.double().flatten() for c in calib[2:]])
    for l in (2, 3):
        removed, static = profiles[f"StructureRemoved.{l}"], profiles[f"StaticProfile.{l}"]
        torch.testing.assert_close(removed, torch.full_like(removed, float(gates.mean())))
        assert not torch.allclose(removed, static)
    for l in (0, 1):
        want = calib[l].double().mean((0, 1)).mean(-1, keepdim=True).expand(S, S + 1)
        torch.testing.assert_close(profiles[f"StructureRemoved.{l}"], want)
    pen = result.penalties()
    assert pen["StructureRemoved"].statistic != pen["StaticProfile"].statistic


# ---- layouts: merged axes and unit axes ---------------------------------------------------------------------------

@pytest.mark.parametrize("pattern,shape,canonical", [
    ("batch token (view layer)", (2, 5, 12), (2, 5, 1, 12)),
    ("batch token (view layer)", (2, 5, 3, 4), (2, 5, 1, 12)),  # the group's axes side by side
    ("stream batch token (a b)", (3, 2, 5, 2, 2), (2, 5, 3, 4)),
    ("batch token () stream source", (2, 5, 1, 3, 4), (2, 5, 3, 4)),
    ("batch token 1 stream", (2, 5, 1, 3), (2, 5, 3, 1)),
    ("(batch token) 1", (10, 1), (2, 5, 1, 1)),
    ("(batch token head) channel", (30, 4), (2, 5, 1, 12)),  # a norm's view: the source (head channel)
])
def test_layouts_with_merged_and_unit_axes_round_trip(pattern, shape, canonical):
    lay = Layout.parse(pattern)
    x = torch.randn(shape)
    c = lay.encode(x, 2, 5)
    assert tuple(c.shape) == canonical and torch.equal(lay.decode(c, lay.meta(x)), x)
    assert lay.describe() == pattern


def test_a_layout_with_two_unmerged_source_axes_is_refused_with_the_advice_that_works():
    """The refusal's advice reads the output it was given: a merged group takes its axes side by side, as well as
    one axis holding both."""
    with pytest.raises(FcauditError, match=r"more than one source-like axis \['view', 'layer'\]; merge them with "
                                           r"parentheses, e.g. 'batch token \(view layer\)'"):
        Layout.parse("batch token view layer")
    lay = Layout.parse("batch token (view layer)")  # the advice, taken
    apart = torch.randn(2, 3, 5, 4).permute(0, 2, 1, 3)  # [batch, token, view, layer], not contiguous
    c = lay.encode(apart, 2, 5)
    assert c.shape == (2, 5, 1, 12) and torch.equal(c[:, :, 0], apart.reshape(2, 5, 12))
    back = lay.decode(c, lay.meta(apart))
    assert torch.equal(back, apart) and back.stride() == apart.stride()
    joined = apart.reshape(2, 5, 12)
    assert torch.equal(lay.decode(lay.encode(joined, 2, 5), lay.meta(joined)), joined)
    with pytest.raises(FcauditError, match="does not fit layout 'batch token \\(view layer\\)'"):
        lay.encode(torch.randn(2, 5, 2, 3, 2), 2, 5)


def test_op_names_cover_operator_forms():
    x = torch.randn(2, 2)
    names = []

    class Seen(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            names.append(op_name(func))
            return func(*args, **(kwargs or {}))

    with Seen():
        x @ x, torch.matmul(x, x), x.matmul(x), torch.sigmoid(x), x.softmax(-1), F.softmax(x, -1), torch.tanh(x)
        torch.einsum("ij,jk->ik", x, x)
    assert names == ["matmul"] * 3 + ["sigmoid", "softmax", "softmax", "tanh", "einsum"]


class Held:
    """A protocol.ReplayContext over coefficients held in memory, with site groups."""

    def __init__(self, data, groups):
        self.data, self.seed, self.info = data, 0, Description(("vector_gate",) * len(data), groups=groups)

    def take(self, examples):
        return [d[torch.from_numpy(np.asarray(examples))] for d in self.data]

    def derangement(self, r):
        return protocol.derangement(self.data[0].shape[0], self.seed, r)


@pytest.mark.parametrize("condition", ["TokenShuffle", "CrossShuffle", "TokenResamplePast"])
def test_randomized_conditions_draw_once_per_group_so_its_sites_move_together(condition):
    # three sites: two of one layer (streams 2 and 1), one of another; each value names its (example, token)
    n = 6
    tag = (torch.arange(n)[:, None] * 100 + torch.arange(T)[None]).double()
    data = [tag[:, :, None, None].expand(-1, -1, 2, 3).clone(), tag[:, :, None, None].clone(),
            tag[:, :, None, None].expand(-1, -1, 2, 1).clone()]
    ex = np.arange(n)
    grouped = protocol.REGISTRY[condition].make(Held(data, (0, 0, 1)), 1, ex)
    # the group's sites took the same positions, stream by stream
    assert torch.equal(grouped[0][:, :, 0, 0], grouped[1][:, :, 0, 0])
    assert not torch.equal(grouped[0][:, :, 1, 0], grouped[0][:, :, 0, 0])  # streams still draw their own
    assert not torch.equal(grouped[2][:, :, 0, 0], grouped[0][:, :, 0, 0])  # the other layer draws its own
    apart = protocol.REGISTRY[condition].make(Held(data, ()), 1, ex)
    assert not torch.equal(apart[0][:, :, 0, 0], apart[1][:, :, 0, 0])
    # one group per site, written out, is today's draw
    same = protocol.REGISTRY[condition].make(Held(data, (0, 1, 2)), 1, ex)
    assert all(torch.equal(a, b) for a, b in zip(apart, same))


def test_variation_counts_a_merged_layer_once(tmp_path):
    model = hc_model()
    result = audit(model, hc_controller(model), tmp_path)
    layers = result.variation().layers
    assert [l["site"] for l in layers] == ["blocks.0.hc_attn.act", "blocks.1.hc_attn.act"]
    assert [l["shape"] for l in layers] == [[S, S + 2], [S, S + 2]]  # alpha's S+1 sources and beta's one


# ---- the silent cases: each a refusal or a notice before anything is written --------------------------------------

class SamplingRouter(TokenRouter):
    """Samples in eval mode too: two forwards of one batch route differently."""

    def forward(self, x):
        out = super().forward(x + 0.5 * torch.randn_like(x))
        return out._replace(routed_tokens=x.gather(1, out.indices[..., None].expand(-1, -1, x.shape[-1])))


class SeededTopOne(nn.Module):
    """A top-1 router over 4 experts that samples from a generator shared by the layers, which each block seeds
    before calling its router: each pass is deterministic (the same noise for every window of a batch), but the
    routers called one after another on their own draw other noise: route flips with bit-equal logits."""

    def __init__(self, gen: torch.Generator):
        super().__init__()
        self.proj, self.gen, self.noise = nn.Linear(D, 4), gen, 4.0

    def forward(self, x):
        w = (self.proj(x) + self.noise * torch.rand(x.shape[1], 4, generator=self.gen)).softmax(-1)
        top = w.topk(1, -1)
        return torch.zeros_like(w).scatter(-1, top.indices, top.values)


class MoEBlock(nn.Module):
    def __init__(self, gen):
        super().__init__()
        self.router = SeededTopOne(gen)
        self.experts = nn.ModuleList([mlp() for _ in range(4)])

    def forward(self, h):
        h = h + causal_mean(h)
        self.router.gen.manual_seed(0)
        w = self.router(h)
        return h + sum(w[..., e, None] * f(h) for e, f in enumerate(self.experts))


class SeededMoE(LM):
    def __init__(self):
        gen = torch.Generator()
        super().__init__([MoEBlock(gen), MoEBlock(gen)], seed=4)


class TopOne(fca.Codec):
    top_k = 1

    def encode(self, output, batch, token):
        return output.detach().reshape(batch, token, 1, -1).clone()

    def decode(self, canonical, meta):
        return canonical.reshape(*canonical.shape[:2], -1).clone()


class UnsortedCodec(RoutedCodec):
    """Selects the routed tokens in score order, where the router sorts them by position."""

    def decode(self, canonical, meta, inputs):
        out = super().decode(canonical, meta, inputs)
        indices = canonical.reshape(canonical.shape[0], -1).topk(K, dim=1).indices
        return out._replace(indices=indices)


class Carried(nn.Module):
    """A block whose mix's output (of hidden width) reaches the next block through other ops: `carry(block, x, h)`."""

    def __init__(self, carry):
        super().__init__()
        self.mix, self.scale, self.carry = nn.Linear(D, D), nn.Parameter(torch.full((D,), 0.5)), carry
        self.fold, self.proj = nn.Linear(2 * D, D), nn.Linear(D, D)

    def forward(self, x):
        return self.carry(self, x, self.mix(causal_mean(x)))


CARRIES = {  # a hidden state however it is carried on: each one a notice
    "tanh(h) * 2": lambda block, x, h: torch.tanh(h) * 2,
    "x + (h + 0)": lambda block, x, h: x + (h + 0),
    "x + h reshaped": lambda block, x, h: x + h.reshape(-1, D).reshape(x.shape),
    "x + h * scale": lambda block, x, h: x + h * block.scale,
    # GRU-style code views its cell's output back; gated and joined states; a module taking it by keyword
    "x + h.reshape_as(x)": lambda block, x, h: x + h.reshape(-1, D).reshape_as(x),
    "x + h.view_as(x)": lambda block, x, h: x + h.view(-1, D).view_as(x),
    "x + h.expand_as(x)": lambda block, x, h: x + h.expand_as(x),
    "x + where(x > 0, h, 0)": lambda block, x, h: x + torch.where(x > 0, h, 0.0),
    "fold(cat([x, h]))": lambda block, x, h: x + block.fold(torch.cat([x, h], -1)),
    "fold(stack([x, h]))": lambda block, x, h: x + block.fold(torch.stack([x, h], -1).flatten(-2)),
    "proj(input=h)": lambda block, x, h: x + block.proj(input=h),
}


class FeatureGate(nn.Module):
    """A gate computed from hidden-width features that only an op consumes: sigmoid(norm(x) @ w)."""

    def __init__(self):
        super().__init__()
        self.norm, self.w, self.mlp = nn.LayerNorm(D), nn.Parameter(torch.randn(D, 1) * 0.5), mlp()

    def forward(self, x):
        return x + torch.sigmoid(self.norm(x) @ self.w) * self.mlp(causal_mean(x))


RANKINGS = {  # what the parent makes of its router's scores [batch, token]: each one a choice of tokens
    "topk": lambda s: s.topk(3, dim=-1).indices,
    "sort": lambda s: s.sort(-1, descending=True).indices[:, :3],
    "argmax": lambda s: s.argmax(-1, keepdim=True),
    "comparison": lambda s: torch.where(s > 0, torch.arange(s.shape[1]), 0),  # a threshold (index 0 otherwise)
}


class RankingBlock(nn.Module):
    """A Mixture-of-Depths block: a linear router scores each token and the parent runs the tokens its ranking
    picks; read with a plain layout, the scores pass for a gate."""

    def __init__(self, rank):
        super().__init__()
        self.router, self.mlp, self.rank = nn.Linear(D, 1), mlp(), rank

    def forward(self, h):
        h = h + causal_mean(h)
        scores = self.router(h).squeeze(-1)
        at = self.rank(scores)[..., None].expand(-1, -1, D)
        weight = torch.sigmoid(scores.gather(1, at[..., 0]))[..., None]
        return h.scatter_add(1, at, self.mlp(h.gather(1, at)) * weight)


def ranking_model(rank) -> Callable[[], LM]:
    return lambda: LM([RankingBlock(rank), RankingBlock(rank)], seed=7).eval()


def carried_model(carry) -> Callable[[], LM]:
    return lambda: LM([Carried(carry), Carried(carry)], seed=5).eval()


class ChannelGate(nn.Module):
    """Coefficients of hidden width: a per-channel gate mixing two branches, `x + g * a + (1 - g) * b`."""

    def __init__(self):
        super().__init__()
        self.gate, self.a, self.b = nn.Linear(D, D), mlp(), mlp()

    def forward(self, x):
        g = torch.sigmoid(self.gate(x))
        return x + g * self.a(causal_mean(x)) + (1 - g) * self.b(x)


def seeded_moe(noise: float = 4.0) -> SeededMoE:
    model = SeededMoE().eval()
    for b in model.blocks:
        b.router.noise = noise
    return model


def sampling_model() -> LM:
    model = routed_model()
    for b in model.blocks:
        b.router.__class__ = SamplingRouter
    return model


SILENT = [  # (what, model, controller, expected refusal or notice; None: nothing to say)
    ("a router that samples in eval mode", sampling_model,
     lambda m: fca.Controller.from_modules(m, "blocks.*.router", codec=RoutedCodec()),
     ("refusal", "two Correct passes of the first evaluation batch differ in the logits .*not deterministic in eval")),
    ("route flips with bit-equal logits", seeded_moe,
     lambda m: fca.Controller.from_modules(m, "blocks.*.router", codec=TopOne()),
     ("refusal", r"route flips = [1-9]\d* .*recomputed .*it samples, or its noise is reseeded")),
    ("a codec whose decode(encode(x)) is not x", routed_model,
     lambda m: fca.Controller.from_modules(m, "blocks.*.router", codec=UnsortedCodec()),
     ("refusal", r"site 'blocks.0.router': decode\(encode\(output\)\) of codec 'UnsortedCodec' differs from the "
                 r"captured output at leaf .indices: other values")),
    ("the residual stream as a site", residual_model,
     lambda m: fca.Controller.from_modules(m, "blocks.*", "batch token hidden"),
     ("notice", r"site 'blocks.0' \(and 1 more\) looks like a hidden state, not a coefficient: .*hidden width 16")),
    ("a GRU cell's output as a site", gru_model,
     lambda m: fca.Controller.from_modules(m, "blocks.*.cell", "(batch token) hidden"),
     ("notice", "site 'blocks.0.cell' .*looks like a hidden state")),
    *((f"a hidden state carried on as {how}", carried_model(carry),
       lambda m: fca.Controller.from_modules(m, "blocks.*.mix", "batch token hidden"),
       ("notice", r"site 'blocks.0.mix' \(and 1 more\) looks like a hidden state, not a coefficient: .*hidden width 16"))
      for how, carry in CARRIES.items()),
    ("hidden-width features only an op consumes", lambda: LM([FeatureGate(), FeatureGate()], seed=6).eval(),
     lambda m: fca.Controller.from_modules(m, "blocks.*.norm", "batch token hidden"),
     ("notice", r"site 'blocks.0.norm' \(and 1 more\) looks like hidden-width features, not coefficients: .*an op")),
    *((f"router scores the model ranks by {how}, read as a gate", ranking_model(rank),
       lambda m: fca.Controller.from_modules(m, "blocks.*.router", "batch token 1"),
       ("notice", r"the model ranks or thresholds the values of site 'blocks.0.router' \(and 1 more\) \((topk|sort|"
                  r"argmax|gt)\): .*declare the routing: kind='token_router'"))
      for how, rank in RANKINGS.items()),
    ("a GRU cell's gates (coefficients of hidden width)", gru_model, gru_gates, None),
    ("a per-channel gate (coefficients of hidden width)", lambda: LM([ChannelGate(), ChannelGate()], seed=6).eval(),
     lambda m: fca.Controller.from_ops(m, "blocks.*", "sigmoid", "batch token channel"), None),
    ("a module called twice, merged", hc_model, hc_controller, None),
    ("a namedtuple router whose decode reads its input", routed_model,
     lambda m: fca.Controller.from_modules(m, "blocks.*.router", codec=RoutedCodec()), None),
    ("a deterministic top-1 router", lambda: seeded_moe(0.0),
     lambda m: fca.Controller.from_modules(m, "blocks.*.router", codec=TopOne()), None),
]


PRE_WRITE = [s for s in SILENT if not s[0].startswith("route flips")]  # those the engine's replay check finds


@pytest.mark.parametrize("what,build,controller,expected", PRE_WRITE, ids=[s[0] for s in PRE_WRITE])
def test_the_silent_cases_get_a_refusal_or_a_notice(what, build, controller, expected, tmp_path):
    from fcaudit.auditor.engine import capture_batch
    from fcaudit.controllers.checks import pre_write_checks

    model = build()
    ctrl = controller(model)
    first = windows(2, 0)
    with torch.inference_mode():
        found = pre_write_checks(model, ctrl, first, capture_batch(model, ctrl, first, None, decoding=True), V)
    if expected is None:  # a router's causality check (with nothing to say) is all it finds
        assert [(f.check, f.line, f.data["later_token_flips"]) for f in found] == \
            ([("causality", "", 0)] if ctrl.info.routers else [])
        return
    kind, line = expected
    assert len(found) >= 1 and found[0].refusal == (kind == "refusal")
    assert re.search(line, found[0].line), found[0].line
    assert "\n" not in found[0].line
    assert not any(tmp_path.iterdir())  # the checks write nothing


@pytest.mark.parametrize("what,build,controller,expected", SILENT, ids=[s[0] for s in SILENT])
def test_an_audit_refuses_the_silent_cases_with_nothing_written_or_prints_their_notice(what, build, controller,
                                                                                       expected, tmp_path, capsys):
    model = build()
    kind, line = expected or (None, None)
    if kind is None:  # a controller: an exact replay (no route flips) and nothing to say
        result = audit(model, controller(model), tmp_path)
        assert_exact(result)
        assert result.notices == () and not result.replay.route_flips
        assert [f.check for f in result.replay.findings] == (["causality"] if result.replay.route_flips is not None
                                                             else [])
    elif kind == "refusal":
        with pytest.raises(FcauditError, match=line) as refused:
            audit(model, controller(model), tmp_path)
        assert type(refused.value) is FcauditError  # one process: the error itself, never a RankError
        if what.startswith("route flips"):  # the exact replay check of a batch fails closed: its report, no records
            assert "tolerance" not in str(refused.value)  # a tolerance cannot help a router that routes otherwise
            report = json.loads((tmp_path / "audit" / "replay.json").read_text())
            assert not report["passed"] and report["route_flips"] > 0 and report["max_abs_dlogit"] == 0
            assert not list((tmp_path / "audit").rglob("*.parquet"))
        else:
            assert not (tmp_path / "audit").exists()
    else:
        assert_exact(audit(model, controller(model), tmp_path))
        assert re.search(line, capsys.readouterr().err.replace("\n", " "))


@pytest.mark.parametrize("how,later", [("topk", True), ("sort", True), ("argmax", True), ("comparison", False)])
def test_the_causality_check_follows_the_choices_the_model_makes_from_a_site(how, later, tmp_path):
    """A ranking over the window (top-k, sort, argmax) decides from later tokens though each score is causal; a
    threshold on a causal score does not: the check compares what the ranking chose, not the scores."""
    model = ranking_model(RANKINGS[how])()
    result = audit(model, fca.Controller.from_modules(model, "blocks.*.router", "batch token 1"), tmp_path)
    found = result.replay.finding("causality")
    assert (found.data["later_token_flips"] > 0) == later
    assert found.line in result.notices if later else found.line == ""


def test_phimoe_router_output_is_rebuilt_in_its_own_slot_order():
    """PhiMoE's sparsemixer puts the argmax expert first, with both weights often 1.0: decode takes the slot order
    from the router's logits on its live input, so decode(encode(x)) is x, index order included."""
    transformers = pytest.importorskip("transformers")
    from fcaudit.controllers import Decoding
    from fcaudit.controllers.coefficient_checks import round_trip_difference

    torch.manual_seed(0)
    cfg = transformers.PhimoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
                                    num_local_experts=8, num_experts_per_tok=2, bos_token_id=None, eos_token_id=None,
                                    pad_token_id=None)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    ctrl = fca.controller_for(model)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        with ctrl.outputs(2, 16) as raws:
            model(ids)
        for site, (out, call) in zip(ctrl.sites, raws):
            decoding = Decoding.of(site.codec, out)
            assert decoding.meta["slot_order"] == "logits"
            # in weight order (without the live call): the same experts and weights, other slots
            assert round_trip_difference(site, out, None, decoding, 2, 16).startswith("slot order (")
            assert round_trip_difference(site, out, call, decoding, 2, 16) is None


class SortedPairs(fca.Codec):
    """A top-2 router's (weights [N, 2], index [N, 2]) <-> its combine vector over 4 experts; decode lists tied
    experts lowest first, where the router may list them in another order."""

    top_k = 2

    def encode(self, output, batch, token):
        weights, index = output
        return torch.zeros(batch * token, 4).scatter_add(1, index, weights).reshape(batch, token, 1, 4)

    def decode(self, canonical, meta):
        top = canonical.reshape(-1, 4).sort(dim=1, descending=True, stable=True)
        return top.values[:, :2].contiguous(), top.indices[:, :2].contiguous()


@pytest.mark.parametrize("unordered", [True, False])
def test_a_codec_says_which_leaves_are_sets_and_ties_in_another_order_pass_with_a_notice(unordered):
    from fcaudit.controllers import Decoding, Site
    from fcaudit.controllers.coefficient_checks import round_trip_difference

    codec = SortedPairs()
    if unordered:
        codec.unordered = ("[0]", "[1]")  # the (weights, index) leaves: compared as sets of pairs
    site = Site("router", nn.Linear(2, 2), codec)
    tied = (torch.full((6, 2), 0.5), torch.tensor([[3, 1], [2, 0], [1, 0], [3, 2], [0, 1], [2, 3]]))
    how = round_trip_difference(site, tied, None, Decoding.of(codec, tied), 2, 3)
    assert how == "slot order (4 of 6 rows hold their experts and weights in another order)" if unordered else \
        how == "leaf [1]: other values (8 of 12 elements)"


# ---- the pre-write notices kept with the results; `active` of merged layers --------------------------------------

def test_a_notice_is_kept_in_the_audit_and_printed_by_the_summary_and_the_report(tmp_path, capsys):
    from fcaudit.report.render import build_report

    model = residual_model()
    result = audit(model, fca.Controller.from_modules(model, "blocks.*", "batch token hidden"), tmp_path)
    assert_exact(result)
    assert len(result.notices) == 1 and "hidden state" in result.notices[0]
    assert fca.AuditResult.load(tmp_path / "audit").notices == result.notices
    lines = str(result).splitlines()[4:]  # what `fcaudit audit` prints, after the three questions
    assert lines[0].startswith("exact replay:") and "hidden state" in lines[1]
    build_report([tmp_path / "audit"], tmp_path / "report")
    md = (tmp_path / "report" / "report.md").read_text().split("\n\n")
    replay = next(i for i, p in enumerate(md) if p.startswith("Exact replay"))
    assert md[replay + 1] == result.notices[0]
    # a rerun resumes the audit (a notice is no part of its configuration) and keeps the notice
    again = audit(model, fca.Controller.from_modules(model, "blocks.*", "batch token hidden"), tmp_path)
    assert again.notices == result.notices
    assert again.records.equals(result.records)


def test_an_audit_without_notices_has_none_and_counts_a_merged_layer_once(tmp_path):
    model = hc_model()
    result = audit(model, hc_controller(model), tmp_path)
    assert result.notices == () and result.replay.findings == ()
    # alpha's S+1 sources and beta's one, all nonzero (tanh): S+2 per (token, stream) of one layer, where a mean over
    # the four sites would say (S+1+1)/2
    correct = result.records[result.records.condition == "Correct"]
    assert (correct.active == S + 2).all()


def test_active_counts_a_merged_layer_once_as_its_sources_side_by_side():
    from fcaudit.stats.variance import by_layer

    def active(coeffs, routers=(), groups=()):
        return Description(tuple("expert_router" if i in routers else "vector_gate" for i in range(len(coeffs))),
                           groups=groups).active(coeffs)

    a = torch.ones(2, T, 2, 3)
    a[0, :, :, 0] = 0  # window 0: 2 of 3 sources per (token, stream), window 1: 3
    b = torch.ones(2, T, 2, 1)
    b[1] = 0  # window 0: 1, window 1: 0
    c = torch.ones(2, T, 1, 4)
    c[0, :, :, :2] = 0  # another layer: window 0: 2, window 1: 4
    assert active([a, b, c]).tolist() == pytest.approx([(2 + 1 + 2) / 3, (3 + 0 + 4) / 3])  # no groups: per site
    assert torch.equal(active([a, b, c]), active([a, b, c], groups=()))
    grouped = active([a, b, c], groups=(0, 0, 1))
    assert grouped.tolist() == [(3 + 2) / 2, (3 + 4) / 2]
    layers = by_layer([a, b, c], Description(("vector_gate",) * 3, groups=(0, 0, 1)).layers)  # variation.json's
    assert torch.equal(grouped, torch.stack([l.bool().reshape(2, -1).sum(1).double() / (l.shape[1] * l.shape[2])
                                             for l in layers]).mean(0))
    # a site with fewer streams: the layer's other streams hold none of its sources
    one = torch.ones(2, T, 1, 1)
    assert active([a, one], groups=(0, 0)).tolist() == [(2 * 2 + 1) / 2, (3 * 2 + 1) / 2]
    assert active([a, b, c], [1, 2], groups=(0, 0, 1)).tolist() == [(1 + 2) / 2, (0 + 4) / 2]  # routers only
