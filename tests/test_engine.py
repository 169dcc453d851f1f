"""The FCA engine: sites, store, exact replay, interventions, runner, results (issue 3), on tiny models."""

import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from torch import nn

from fcaudit import protocol
from fcaudit.auditor import CoefficientStore, audit, plan
from fcaudit.auditor import files
from fcaudit.auditor.directory import AuditDir
from fcaudit.controllers import Controller, Layout
from fcaudit.controllers.checks import SITE_CHECK_PASSES
from fcaudit.families import Family, controller_for, register
from fcaudit.errors import FcauditError
from fcaudit.kinds import Description
from fcaudit.models.featuregate import FeatureGateGPT, config_for
from fcaudit.protocol import derangement, resample_past, shuffle_tokens
from conftest import Block, Gate, Leaky, T, ToyGated, V, gated, run, windows


# ---- tiny models built for the tests ----------------------------------------------------------------------------


class ParityGate(nn.Module):
    def __init__(self, constant):
        super().__init__()
        self.table = nn.Parameter(torch.tensor([6.0 if i % 2 else -6.0 for i in range(V)]))
        self.constant = constant

    def forward(self, ids):
        return torch.full(ids.shape, 0.5) if self.constant else torch.sigmoid(self.table[ids])


NEXT_ODD = np.random.default_rng(1).integers(0, V, V)
NEXT_EVEN = np.random.default_rng(2).integers(0, V, V)


class Planted(nn.Module):
    """Predictions depend by construction on per-token coefficient alignment: the gate of token t picks which of
    two lookup tables predicts t+1 (odd ids use one rule, even ids the other)."""

    def __init__(self, constant=False):
        super().__init__()
        self.gate = ParityGate(constant)
        self.odd = nn.Parameter(8.0 * torch.eye(V)[NEXT_ODD])
        self.even = nn.Parameter(8.0 * torch.eye(V)[NEXT_EVEN])

    def forward(self, ids):
        g = self.gate(ids)[..., None]
        return g * self.odd[ids] + (1 - g) * self.even[ids]


def planted_windows(n, seed):
    rng = np.random.default_rng(seed)
    out = np.zeros((n, T), dtype=np.int64)
    out[:, 0] = rng.integers(0, V, n)
    for t in range(1, T):
        prev = out[:, t - 1]
        out[:, t] = np.where(prev % 2 == 1, NEXT_ODD[prev], NEXT_EVEN[prev])
        jump = rng.random(n) < 0.2  # restarts keep the sequences from collapsing into one short cycle
        out[jump, t] = rng.integers(0, V, jump.sum())
    return torch.from_numpy(out)


class MoELayer(nn.Module):
    def __init__(self, d, n_expert):
        super().__init__()
        self.router = nn.Linear(d, n_expert)
        self.experts = nn.ModuleList(nn.Linear(d, d) for _ in range(n_expert))

    def forward(self, h):
        b, t, d = h.shape
        x = h.reshape(b * t, d)  # the router sees flattened tokens: layout "(batch token) expert"
        w = torch.softmax(self.router(x), -1)
        y = sum(w[:, e:e + 1] * expert(x) for e, expert in enumerate(self.experts))
        return h + y.view(b, t, d)


class ToyMoE(nn.Module):
    def __init__(self, d=16, n_expert=4, n_layer=2):
        super().__init__()
        torch.manual_seed(1)
        self.emb = nn.Embedding(V, d)
        self.layers = nn.ModuleList(MoELayer(d, n_expert) for _ in range(n_layer))
        self.head = nn.Linear(d, V)

    def forward(self, ids):
        h = self.emb(ids)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


class DenseMix(nn.Module):
    """MUDD-like controller of layer i: [stream, batch, token, source] mixing weights over i+2 earlier states."""

    def __init__(self, d, streams, sources):
        super().__init__()
        self.proj = nn.Linear(d, streams * sources)
        self.streams, self.sources = streams, sources

    def forward(self, h):
        w = self.proj(h).view(*h.shape[:2], self.streams, self.sources)
        return w.permute(2, 0, 1, 3) + 1.0 / self.sources


class ToyMudd(nn.Module):
    """Ragged sites: layer i mixes i+2 stored hidden states, 2 streams except 1 at the last layer."""

    def __init__(self, d=16, n_layer=3):
        super().__init__()
        torch.manual_seed(2)
        self.emb = nn.Embedding(V, d)
        self.mlps = nn.ModuleList(nn.Linear(d, d) for _ in range(n_layer))
        self.dynamic_dense = nn.ModuleList(DenseMix(d, 2 if i < n_layer - 1 else 1, i + 2) for i in range(n_layer))
        self.head = nn.Linear(d, V)

    def forward(self, ids):
        states = [self.emb(ids)]
        h = states[0]
        for mlp, mix in zip(self.mlps, self.dynamic_dense):
            h = h + torch.tanh(mlp(h))
            states.append(h)
            dw = mix(h)  # [C, B, T, i+2]
            stack = torch.stack(states, -1)  # [B, T, D, i+2]
            h = sum(torch.einsum("btdk,btk->btd", stack, dw[c]) for c in range(dw.shape[0]))
        return self.head(h)


def randomized_means(result):
    d = result.penalties().to_frame()["statistic"]
    return d


# ---- sites and layouts ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("pattern,shape", [("batch token", (2, 5)), ("stream batch token source", (3, 2, 5, 4)),
                                           ("(batch token) expert", (10, 6)), ("batch token stream", (2, 5, 3))])
def test_layout_round_trip(pattern, shape):
    x = torch.randn(shape)
    lay = Layout.parse(pattern)
    c = lay.encode(x, batch=2, token=5)
    assert c.dim() == 4 and c.shape[:2] == (2, 5)
    assert torch.equal(lay.decode(c, lay.meta(x)), x)
    if pattern.startswith("stream"):
        assert torch.equal(c[1, 3, 2], x[2, 1, 3])  # [batch, token, stream, source]
        permuted = torch.randn(2, 5, 3, 4).permute(2, 0, 1, 3)  # a non-contiguous site output
        back = lay.decode(lay.encode(permuted, 2, 5), lay.meta(permuted))
        assert torch.equal(back, permuted) and back.stride() == permuted.stride()


def test_layout_errors():
    with pytest.raises(FcauditError, match="does not fit layout"):
        Layout.parse("batch token").encode(torch.randn(2, 5, 3), 2, 5)
    with pytest.raises(FcauditError, match="does not fit layout"):
        Layout.parse("(batch token) expert").encode(torch.randn(9, 3), 2, 5)
    with pytest.raises(FcauditError, match="'batch' and a 'token'"):
        Layout.parse("token expert")
    with pytest.raises(FcauditError, match="matches no module"):
        Controller.from_modules(ToyGated(), "blocks.*.router", "batch token")


def test_replay_disables_controller_and_restores_model():
    model = ToyGated().eval()
    ctrl = gated(model)
    ids = windows(2, 0)
    with torch.no_grad(), ctrl.capture(2, T) as found:
        ref = model(ids)
    calls = [b.gate.calls for b in model.blocks]
    with torch.no_grad(), ctrl.replay(found):
        out = model(ids)
    assert torch.equal(out, ref)
    assert [b.gate.calls for b in model.blocks] == calls  # the controller did not run
    assert all("forward" not in b.gate.__dict__ for b in model.blocks)
    with pytest.raises(RuntimeError, match="boom"), ctrl.replay([torch.zeros_like(c) for c in found], found.decoding):
        raise RuntimeError("boom")
    assert all("forward" not in b.gate.__dict__ for b in model.blocks)
    with torch.no_grad():
        assert torch.equal(model(ids), ref)
        model.blocks[0].gate.calls = 0
        model(ids)
        assert model.blocks[0].gate.calls == 1


def test_controller_for_registry_and_featuregate():
    with pytest.raises(FcauditError, match="Controller.from_modules"):
        controller_for(ToyMoE())
    sites = lambda m: Controller.from_modules(m, "layers.*.router", "(batch token) expert")  # noqa: E731
    unregister = register(Family("toy-moe", matches=lambda m: isinstance(m, ToyMoE), controller=sites))
    try:
        assert [s.path for s in controller_for(ToyMoE()).sites] == ["layers.0.router", "layers.1.router"]
    finally:
        unregister()
    with pytest.raises(FcauditError, match="Controller.from_modules"):  # the registration did not leak
        controller_for(ToyMoE())
    model = FeatureGateGPT(config_for("tiny", "featuregate"))
    ctrl = controller_for(model)
    assert [s.path for s in ctrl.sites] == ["blocks.0.gate", "blocks.1.gate"]
    assert ctrl.labels == {"StaticProfile": "LayerMean", "StructureRemoved": "GlobalMean"}
    with pytest.raises(FcauditError, match="no gate modules"):
        controller_for(FeatureGateGPT(config_for("tiny", "dense")))


# ---- store ------------------------------------------------------------------------------------------------------

def test_store_round_trip_take_and_reopen(tmp_path):
    store = CoefficientStore(tmp_path)
    data = [torch.randn(10, T, 1, 1).to(torch.bfloat16), torch.randn(10, T, 3, 5)]
    for b0 in (0, 4, 8):
        store.write(b0, [d[b0:b0 + 4] for d in data])
    again = CoefficientStore(tmp_path)
    # rows one by one, runs within a chunk, runs across chunks, repeats, one batch, all windows
    for idx in ([9, 0, 1, 2, 5, 5, 7, 3], [2, 3, 4, 5, 6], list(range(10)), [4, 5, 6, 7], [6, 7, 8, 9, 0, 1], [3]):
        idx = np.array(idx)
        got = again.take(idx, np.array([0, 4, 8]))
        assert got[0].dtype == torch.bfloat16
        assert all(torch.equal(g, d[torch.from_numpy(idx)]) for g, d in zip(got, data))
    assert all(torch.equal(g, d[4:8]) for g, d in zip(again.read_chunk(4), data))
    with pytest.raises(FcauditError, match="non-finite"):
        store.write(12, [torch.full((1, T, 1, 1), float("nan")), torch.zeros(1, T, 3, 5)])
    assert not store.chunk_path(12).exists() and not list(tmp_path.glob(".*"))
    # equal content, equal bytes (the metadata is written in a fixed order)
    twin = CoefficientStore(tmp_path / "twin")
    twin.write(4, [d[4:8] for d in data])
    assert (tmp_path / "twin" / "chunk_0000004.safetensors").read_bytes() == store.chunk_path(4).read_bytes()


def test_store_reads_keep_no_memory(tmp_path, monkeypatch):
    """Reading the store many times holds no Python memory afterwards (an audit reads it a few hundred thousand
    times)."""
    import tracemalloc

    store = CoefficientStore(tmp_path)
    data = [torch.randn(64, T, 1, 1).to(torch.bfloat16), torch.randn(64, T, 2, 3)]
    for b0 in range(0, 64, 2):
        store.write(b0, [d[b0:b0 + 2] for d in data])
    starts, rng = np.arange(0, 64, 2), np.random.default_rng(0)
    reads = [rng.permutation(64)[:8] for _ in range(50)] + [np.arange(b, b + 2) for b in range(0, 64, 2)]
    for idx in reads:  # warm: imports, caches, every chunk loaded
        store.take(idx, starts)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for _ in range(20):
        for idx in reads:
            got = store.take(idx, starts)
    grown = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert all(torch.equal(g, d[torch.from_numpy(idx)]) for g, d in zip(got, data))
    assert grown < 100_000, f"{grown} bytes kept after {20 * len(reads)} reads"


def test_store_reads_hold_only_the_rows_asked_for(tmp_path):
    """Scattered reads (a derangement's donors) give the right rows, each read its own tensors: nothing of a chunk
    stays loaded between reads, so memory does not grow with the windows."""
    data = [torch.randn(64, T, 1, 1).to(torch.bfloat16), torch.randn(64, T, 2, 3)]
    writer = CoefficientStore(tmp_path)
    for b0 in range(0, 64, 2):
        writer.write(b0, [d[b0:b0 + 2] for d in data])
    store, rng = CoefficientStore(tmp_path), np.random.default_rng(0)
    starts = np.arange(0, 64, 2)
    for idx in [rng.permutation(64)[:8] for _ in range(40)] + [np.arange(6, 8), np.array([63])]:
        got = store.take(idx, starts)
        assert all(torch.equal(g, d[torch.from_numpy(idx)]) for g, d in zip(got, data))
        assert [g.untyped_storage().nbytes() for g in got] == [d[:len(idx)].nbytes for d in data]
    assert vars(store).keys() == vars(CoefficientStore(tmp_path)).keys() and store.device is None


def test_a_store_read_past_a_chunk_or_its_bytes_is_damaged(tmp_path):
    store = CoefficientStore(tmp_path)
    store.write(0, [torch.randn(4, T, 1, 1)])
    starts = np.array([0])
    with pytest.raises(files.Damaged, match="holds 4 windows"):
        store.take(np.array([5]), starts)
    path = store.chunk_path(0)
    path.write_bytes(path.read_bytes()[:-8])
    with pytest.raises(files.Damaged, match="truncated"):
        store.take(np.array([3]), starts)


def test_store_held_on_a_device_takes_the_same_rows(tmp_path):
    data = [torch.randn(10, T, 1, 1).to(torch.bfloat16), torch.randn(10, T, 3, 5)]
    store = CoefficientStore(tmp_path)
    for b0 in (0, 4, 8):
        store.write(b0, [d[b0:b0 + 4] for d in data])
    starts = np.array([0, 4, 8])
    store.load(starts, 10, torch.device("cpu"))  # the engine loads onto a GPU; any device holds the same rows
    assert store.device == torch.device("cpu")
    for idx in (np.array([9, 0, 1, 2, 5, 5, 7, 3]), np.arange(2, 9), np.array([6])):
        got = store.take(idx, starts)
        assert [g.dtype for g in got] == [torch.bfloat16, torch.float32]
        assert all(torch.equal(g, d[torch.from_numpy(idx)]) for g, d in zip(got, data))
    store.unload()
    assert store.device is None and torch.equal(store.take(np.arange(4, 8), starts)[1], data[1][4:8])


def test_store_held_on_the_device_gives_the_same_records(tmp_path, monkeypatch):
    """Stage 2 with the whole store on the device (as on a GPU with room for it) replays the same coefficients:
    records equal bit for bit, and no replay reads a chunk file."""
    from fcaudit.auditor import engine as engine_module

    model = ToyMudd()
    ctrl = Controller.from_modules(model, "dynamic_dense.*", "stream batch token source", reference="SourceUniformMean")
    files_read, load = [], CoefficientStore.load
    base = run(model, ctrl, tmp_path / "files", R=2)
    monkeypatch.setattr(engine_module, "keeps_store_on", lambda device, nbytes: True)
    monkeypatch.setattr(CoefficientStore, "load", lambda self, *a: files_read.append("load") or load(self, *a))
    read_rows = CoefficientStore._read
    monkeypatch.setattr(CoefficientStore, "_read",
                        lambda self, *a: files_read.append(self.device) or read_rows(self, *a))
    held = run(model, ctrl, tmp_path / "held", R=2)
    assert "load" in files_read and not any(isinstance(x, torch.device) for x in files_read)
    pd.testing.assert_frame_equal(held.records, base.records, check_exact=True)
    assert randomized_means(held)["CrossInput"] != 0 and randomized_means(held)["TokenShuffle"] != 0  # they move NLLs


class SparseGate(Gate):
    """Exact zeros for some tokens: the active count differs between windows."""

    def forward(self, h):
        return torch.relu(self.proj(h)).squeeze(-1)


def test_replays_free_each_batchs_logits_before_the_next_forward(tmp_path, monkeypatch):
    """Stage 2 keeps no replay's logits alive into the next forward pass (at a 50k vocabulary and 8 x 2048 tokens
    they are 3.3 GB in float32, and the peak would hold two batches of them)."""
    import weakref

    from fcaudit.auditor import engine as engine_module

    model = ToyGated()
    previous, alive, replaying = [None], [], [False]
    forward = model.forward

    def watched(ids):
        if replaying[0]:
            alive.append(previous[0] is not None and previous[0]() is not None)
        out = forward(ids)
        previous[0] = weakref.ref(out)
        return out

    monkeypatch.setattr(model, "forward", watched)
    stage2 = engine_module.Engine._stage2

    def replays(self, *args):
        replaying[0] = True
        try:
            return stage2(self, *args)
        finally:
            replaying[0] = False

    monkeypatch.setattr(engine_module.Engine, "_stage2", replays)
    run(model, gated(model), tmp_path / "a", n_eval=8, R=2)
    assert len(alive) > 10 and not any(alive[1:])  # the first replay follows stage 1's last capture


def test_stage2_writes_each_run_once_complete_and_a_resumed_run_as_a_part(tmp_path, monkeypatch):
    """One process replays unit by unit: each (condition, r) is written once, as its whole records file. A run that
    resumes after some of its units were done writes the rest as a part file, and the records equal the
    uninterrupted audit's bit for bit (NLLs and active counts)."""
    from fcaudit.auditor import engine as engine_module
    from fcaudit.auditor import files

    model = ToyGated()
    for b in model.blocks:
        b.gate = SparseGate(16)
    written, write_run = [], engine_module.Engine._write_run
    monkeypatch.setattr(engine_module.Engine, "_write_run",
                        lambda self, key, ranges, nll, act: written.append((key, sum(r.stop - r.start for r in ranges)))
                        or write_run(self, key, ranges, nll, act))
    base = run(model, gated(model), tmp_path / "a", n_eval=10, R=2)
    varies = base.records.groupby(["condition", "randomization"]).active.nunique() > 1
    assert varies.sum() >= 1 + 4 * 2  # Correct and every randomized run: the active count differs between windows
    keys = [k for k, _ in written]
    assert len(keys) == len(set(keys)) == len(base.records.groupby(["condition", "randomization"])) - 1  # not Correct
    assert {n for _, n in written} == {10}
    records = tmp_path / "a" / "records" / "TokenShuffle" / "r0001.parquet"
    frame = files.read_frame(records)
    parts = tmp_path / "a" / "parts" / "TokenShuffle" / "r0001"
    files.write_tensors(parts / "b0000004.safetensors", {c: torch.from_numpy(frame[c].to_numpy()[4:8].copy())
                                                          for c in ("example", "nll", "active")},
                        AuditDir(tmp_path / "a").binding("TokenShuffle", 1))  # as the engine binds it
    records.unlink()
    written.clear()
    again = run(model, gated(model), tmp_path / "a", n_eval=10, R=2)
    assert written == [(("TokenShuffle", 1), 6)]  # windows 0-3 and 8-9: one part beside the one kept
    pd.testing.assert_frame_equal(again.records, base.records, check_exact=True)


# ---- interventions ----------------------------------------------------------------------------------------------

def test_derangement_properties():
    for n in (2, 3, 7, 100):
        for r in range(10):
            p = derangement(n, seed=5, r=r)
            assert not np.any(p == np.arange(n)) and np.array_equal(np.sort(p), np.arange(n))
            assert np.array_equal(p, derangement(n, seed=5, r=r))
    assert not np.array_equal(derangement(100, 5, 0), derangement(100, 5, 1))
    # n = 3 has two derangements; uniform sampling gives each about half the draws
    share = np.mean([derangement(3, 0, r)[0] == 1 for r in range(400)])
    assert 0.4 < share < 0.6
    with pytest.raises(FcauditError, match="at least 2"):
        derangement(1, 0, 0)


@pytest.mark.parametrize("seed", [0, 12345, 2**32 - 1, 2**32, 2**40 + 7])
def test_keyed_draws_are_numpys_generator_of_the_key_list(seed):
    """The per-window draws are default_rng([tag, seed, r, example]) as written in the protocol, also for values of
    2**32 and more (several words each)."""
    for r, e in [(0, 0), (3, 63), (19, 2**31), (2, 2**32 + 5)]:
        for T, rows in [(16, 3), (128, 4)]:
            perm = np.random.default_rng([protocol.SHUFFLE, seed, r, e]).permuted(
                np.broadcast_to(np.arange(T), (rows, T)), axis=1)
            past = np.random.default_rng([protocol.RESAMPLE, seed, r, e]).integers(0, np.arange(1, T + 1), size=(rows, T))
            for got, want in [(protocol.token_permutations(np.array([e]), seed, r, T, rows), perm),
                              (protocol.past_positions(np.array([e]), seed, r, T, rows), past)]:
                assert got.dtype == want.dtype and np.array_equal(got[0], want)
    rng = np.random.default_rng([protocol.DERANGE, seed, 4])
    while np.any((want := rng.permutation(50)) == np.arange(50)):
        pass
    assert np.array_equal(derangement(50, seed, 4), want)
    with pytest.raises(ValueError):  # a negative key is refused as numpy refuses it, never wrapped into uint32
        protocol.token_permutations(np.array([0]), -1, 0, 16, 3)
    with pytest.raises(ValueError):
        protocol.past_positions(np.array([-1]), 0, 0, 16, 3)


def labelled(b, t, s, k, offset=0):
    """Coefficients whose value encodes (example, token, stream, source) so moves can be traced."""
    e = torch.arange(b)[:, None, None, None] + offset
    return (e * 1000 + torch.arange(t)[None, :, None, None] * 10 + torch.arange(s)[None, None, :, None] * 0.1
            + torch.arange(k)[None, None, None, :] * 0.001).double()


def test_token_shuffle_preserves_multisets_and_moves_source_vectors():
    coeffs = [labelled(3, T, 1, 1), labelled(3, T, 4, 3)]
    out = shuffle_tokens(coeffs, np.array([10, 11, 12]), seed=0, r=0)
    for c, o in zip(coeffs, out):
        for b in range(3):
            for s in range(c.shape[2]):
                assert torch.equal(o[b, :, s].sort(0).values, c[b, :, s].sort(0).values)  # same multiset
                src = torch.round((o[b, :, s, 0] - b * 1000) / 10).long()  # token each row came from
                assert torch.equal(o[b, :, s], c[b, src, s])  # the whole source vector moved as one
    assert not torch.equal(out[1][0, :, 0], out[1][0, :, 1])  # streams permuted independently
    assert not torch.equal(out[0], coeffs[0])
    # keyed by example id, not by batch position
    one = shuffle_tokens([c[1:2] for c in coeffs], np.array([11]), seed=0, r=0)
    assert all(torch.equal(a[0], b[1]) for a, b in zip(one, out))


class Context:
    """A protocol.ReplayContext over coefficients held in memory."""

    def __init__(self, data, seed, statics=None):
        self.data, self.seed, self.statics = data, seed, statics or {}
        self.info = Description(("vector_gate",) * len(data))  # no token routers

    def take(self, examples):
        return [d[torch.from_numpy(np.asarray(examples))] for d in self.data]

    def derangement(self, r):
        return derangement(self.data[0].shape[0], self.seed, r)

    def static(self, condition, batch):
        return [p.expand(batch, *p.shape[1:]) for p in self.statics[condition]]


def make(condition, ctx, r, examples):
    return protocol.REGISTRY[condition].make(ctx, r, examples)


def test_cross_shuffle_pairs_cross_input_and_token_shuffle():
    data = [labelled(6, T, 1, 1), labelled(6, T, 2, 3)]
    ctx = Context(data, seed=3)
    perm = derangement(6, seed=3, r=2)
    ex = np.array([1, 4, 5])
    cross, shuf, both = (make(c, ctx, 2, ex) for c in ("CrossInput", "TokenShuffle", "CrossShuffle"))
    assert all(torch.equal(c, d[torch.from_numpy(perm[ex])]) for c, d in zip(cross, data))
    assert all(torch.equal(b, x) for b, x in zip(both, shuffle_tokens(cross, ex, 3, 2)))
    # the CrossShuffle token order equals the TokenShuffle token order of the same example
    src_shuf = torch.round((shuf[1][:, :, 0, 0] - torch.from_numpy(ex)[:, None] * 1000) / 10)
    src_both = torch.round((both[1][:, :, 0, 0] - torch.from_numpy(perm[ex])[:, None] * 1000) / 10)
    assert torch.equal(src_shuf, src_both)


def test_token_resample_past_takes_only_earlier_or_same_positions():
    data = [labelled(4, T, 1, 1), labelled(4, T, 3, 2)]
    ex = np.array([0, 1, 2, 3])
    out = make("TokenResamplePast", Context(data, seed=0), 0, ex)
    drawn = []
    for c, o in zip(data, out):
        src = torch.round((o[..., 0] - torch.arange(4)[:, None, None].double() * 1000) / 10).long()  # [b, t, s]
        assert (src <= torch.arange(T)[None, :, None]).all() and (src[:, 0] == 0).all()  # never from the future
        for b in range(4):
            for s in range(c.shape[2]):
                assert torch.equal(o[b, :, s], c[b, src[b, :, s], s])  # the source vector moves as one
        drawn.append(src)
    assert (drawn[1][:, 1:] < torch.arange(1, T)[None, :, None]).any()  # some positions do look back
    assert not torch.equal(drawn[1][:, :, 0], drawn[1][:, :, 1])  # streams draw independently
    # keyed by example, not batch position; a different randomization draws differently
    one = resample_past([d[2:3] for d in data], np.array([2]), seed=0, r=0)
    assert all(torch.equal(a[0], b[2]) for a, b in zip(one, out))
    assert not torch.equal(resample_past(data, ex, 0, 1)[1], out[1])


def test_profiles_global_and_source_uniform_mean():
    a, b = torch.rand(5, T, 1, 1), torch.rand(5, T, 2, 3) - 0.5
    cal = protocol.Calibration([a.double().sum(0), b.double().sum(0)], 5, (None, None))
    assert torch.allclose(cal.layer_mean()[1], b.double().mean((0, 1)))
    assert torch.allclose(cal.layer_position_mean()[1], b.double().mean(0))
    total = (a.double().sum() + b.double().sum()) / (a.numel() + b.numel())
    assert all(torch.allclose(p, total.expand_as(p)) for p in protocol.global_mean(cal))
    su = protocol.source_uniform_mean(cal)[1]
    assert torch.allclose(su.sum(1), cal.layer_mean()[1].sum(1))  # signed sum per stream kept
    assert torch.allclose(su, su[:, :1].expand_as(su))


def test_static_top_k_keeps_the_k_largest_mean_weights_with_the_mean_mass():
    mean = torch.tensor([[0.1, 0.4, 0.0, 0.3, 0.2]], dtype=torch.float64)  # one stream, five experts
    cal = protocol.Calibration([mean * 7], 7, (2,))
    top = protocol.static_top_k(cal)[0]
    assert torch.allclose(top, torch.tensor([[0.0, 4 / 7, 0.0, 3 / 7, 0.0]], dtype=torch.float64))
    assert protocol.for_controller(Description(("expert_router",), top_k=(2,))).count("StaticTopK") == 1
    assert "StaticTopK" not in protocol.for_controller(Description(("source_mixture",)))


# ---- audits -----------------------------------------------------------------------------------------------------

def test_static_controller_gives_exact_zero(tmp_path):
    model = ToyGated(static=True)
    res = run(model, gated(model), tmp_path / "a")
    warnings.simplefilter("ignore", RuntimeWarning)  # some windows gain from GlobalMean: undefined retention CI
    assert res.replay.passed and res.replay.bit_equal and res.replay.max_abs_dlogit == 0.0
    m = randomized_means(res)
    assert m["CrossInput"] == 0.0 and m["TokenShuffle"] == 0.0 and m["CrossShuffle"] == 0.0
    assert m["TokenResamplePast"] == 0.0
    assert m["StaticProfile"] == 0.0 and m["StructureRemoved"] > 0  # LayerStatic needs its depth profile
    assert set(res.records.columns) == {"example", "condition", "randomization", "nll", "tokens", "active"}
    assert len(res.records) == 8 * (1 + 4 * 3 + 3) and (res.records["tokens"] == T - 1).all()
    assert (res.records["active"] == 1.0).all()  # one nonzero gate per (layer, token)
    ret = res.retention("LayerMean")  # GlobalMean helps some windows of this random model: no clear gap
    assert np.isnan(ret.statistic) and "not above the practically-small bound" in ret.reason and ret.delta_reference > 0
    assert (res.factor_effects().to_frame()["statistic"] == 0.0).all()
    var = res.variation
    assert len(var["layers"]) == 3 and var["layers"][0]["sd"] == 0.0


def test_real_featuregate_layerstatic_and_uniform_exact_zero(tmp_path):
    for variant in ("layerstatic", "uniform"):
        model = FeatureGateGPT(config_for("tiny", variant))
        ev = torch.randint(0, 256, (6, T), generator=torch.Generator().manual_seed(0))
        ca = torch.randint(0, 256, (3, T), generator=torch.Generator().manual_seed(1))
        res = audit(model, controller_for(model), ev, ca, randomizations=2, out=tmp_path / variant, batch_size=3, quiet=True)
        m = randomized_means(res)
        assert res.replay.bit_equal
        assert m["CrossInput"] == 0.0 and m["TokenShuffle"] == 0.0 and m["CrossShuffle"] == 0.0
        assert res.config["labels"]["StaticProfile"] == "LayerMean"


def test_planted_dependence_detected_and_constant_twin_zero(tmp_path):
    ev, ca = planted_windows(16, 0), planted_windows(8, 1)
    model = Planted()
    ctrl = Controller.from_modules(model, "gate", "batch token")
    res = audit(model, ctrl, ev, ca, randomizations=3, out=tmp_path / "p", batch_size=8, quiet=True)
    m = randomized_means(res)
    assert res.replay.bit_equal
    assert m["CrossInput"] > 1.0 and m["TokenShuffle"] > 1.0 and m["CrossShuffle"] > 1.0 and m["StaticProfile"] > 0.1
    assert m["TokenResamplePast"] > 1.0
    twin = Planted(constant=True)
    res = audit(twin, Controller.from_modules(twin, "gate", "batch token"), ev, ca, randomizations=3,
                out=tmp_path / "c", batch_size=8, quiet=True)
    assert (randomized_means(res) == 0.0).all()


def test_moe_through_from_modules_alone(tmp_path):
    model = ToyMoE()
    ctrl = Controller.from_modules(model, "layers.*.router", "(batch token) expert", reference="SourceUniformMean")
    res = run(model, ctrl, tmp_path / "moe", R=2)
    assert res.replay.passed and res.replay.bit_equal and res.replay.max_abs_dlogit == 0.0
    m = randomized_means(res)
    assert m["CrossInput"] != 0.0 and m["StructureRemoved"] != 0.0
    assert res.config["labels"]["StructureRemoved"] == "SourceUniformMean"
    assert res.variation["layers"][0]["shape"] == [1, 4]
    assert "factor_effects" not in res.config and set(res.factor_effects().to_frame().index) == {"input", "token", "interaction"}


def test_ragged_multi_stream_sites(tmp_path):
    model = ToyMudd()
    ctrl = Controller.from_modules(model, "dynamic_dense.*", "stream batch token source",
                                   static_name="StaticMixMean", reference="SourceUniformMean")
    res = run(model, ctrl, tmp_path / "mudd", R=2)
    warnings.simplefilter("ignore", RuntimeWarning)  # untrained: SourceUniformMean may not hurt, retention undefined
    assert res.replay.bit_equal
    assert [l["shape"] for l in res.variation["layers"]] == [[2, 2], [2, 3], [1, 4]]
    assert abs(sum(res.variation["decomposition"].values()) - 1) < 1e-9 and "slice" in res.variation["decomposed"]
    m = randomized_means(res)
    assert m["CrossInput"] != 0 and m["TokenShuffle"] != 0 and m["StructureRemoved"] != 0
    assert res.retention("StaticMixMean").reference_label == "SourceUniformMean"
    from safetensors.torch import load_file
    prof = load_file(str(tmp_path / "mudd" / "profiles.safetensors"))
    assert prof["StaticProfile.2"].dtype == torch.float64 and prof["LayerPositionMean.1"].shape == (T, 2, 3)


def test_summary_printed_unless_quiet(tmp_path, capsys):
    model = ToyGated()
    audit(model, gated(model), windows(4, 0), windows(2, 1), randomizations=2, out=tmp_path / "s", quiet=False)
    text = capsys.readouterr().out
    assert "exact replay: passed=True" in text and "Cross+shuffle" in text and "LayerMean" in text
    assert "Token-resample-past" in text and "retention LayerMean vs GlobalMean" in text


def test_hf_style_output_and_custom_loss(tmp_path):
    model = ToyGated(hf=True)
    res = run(model, gated(model), tmp_path / "hf", R=1)
    plain = ToyGated()
    ref = run(plain, gated(plain), tmp_path / "plain", R=1)
    pd.testing.assert_frame_equal(res.records, ref.records)
    calls = []

    def loss_fn(out, ids):
        calls.append(1)
        return (out.logits[:, :-1].float() ** 2).mean((1, 2))

    res = run(model, gated(model), tmp_path / "custom", R=1, loss_fn=loss_fn)
    assert calls and not np.allclose(res.records["nll"], ref.records["nll"])


def test_an_audit_runs_its_schedules_forward_passes_and_no_more(tmp_path):
    """The probe's capture of the first batch is that batch's stage 1 capture: the first batch is not run twice."""
    from fcaudit.auditor.units import Schedule

    model = ToyGated()
    calls = []
    model.register_forward_hook(lambda *a: calls.append(1))
    result = run(model, gated(model), tmp_path / "a", n_eval=10, n_calib=5)
    sched = Schedule(10, 5, 4, 3, tuple(result.config["conditions"]))
    assert len(calls) == SITE_CHECK_PASSES + sum(u.passes for u in (*sched.iter_stage1(), *sched.iter_stage2()))
    # a capture pass per evaluation and calibration batch, the site check's capture of window 0 alone and the
    # pre-write checks' pass of the first batch
    assert [b.gate.calls for b in model.blocks] == [3 + 2 + 1 + 1] * 3


def test_resume_skips_finished_units_and_rejects_other_config(tmp_path):
    model = ToyGated()
    first = run(model, gated(model), tmp_path / "a")
    calls = []
    model.register_forward_hook(lambda *a: calls.append(1))
    again = run(model, gated(model), tmp_path / "a")
    assert len(calls) == 1 + SITE_CHECK_PASSES  # only the probe and its checks: every unit was already on disk
    pd.testing.assert_frame_equal(first.records, again.records)
    with pytest.raises(FcauditError, match=r"different configuration \(differs in \['randomizations'\]\)"):
        run(model, gated(model), tmp_path / "a", R=4)
    with pytest.raises(FcauditError, match="different configuration"):
        audit(model, gated(model), windows(8, 0), windows(4, 1), randomizations=3, seed=1, out=tmp_path / "a",
              batch_size=4, quiet=True)


def test_part_files_merge_into_the_records_and_a_window_twice_is_recomputed(tmp_path, capsys):
    from fcaudit.auditor import files

    model = ToyGated()
    expected = run(model, gated(model), tmp_path / "a").records.copy()  # 8 windows, batches of 4 (read now: lazy)
    records = tmp_path / "a" / "records" / "Correct" / "r0000.parquet"
    frame = files.read_frame(records)
    parts = tmp_path / "a" / "parts" / "Correct" / "r0000"
    parts.mkdir(parents=True)

    def part(name, rows):  # a part file as a process writes it: its windows in any order, bound to its audit
        files.write_tensors(parts / name, {c: torch.from_numpy(frame[c].to_numpy()[rows])
                                           for c in ("example", "nll", "active")},
                            AuditDir(tmp_path / "a").binding("Correct", 0))

    part("b0000004.safetensors", [6, 4, 7, 5])
    part("b0000000.safetensors", [0, 1, 2, 3])
    records.unlink()
    again = run(model, gated(model), tmp_path / "a")
    pd.testing.assert_frame_equal(expected, again.records)  # put in window order, every column as it was
    assert not (tmp_path / "a" / "parts").exists()

    part("b0000000.safetensors", [0, 1, 2, 3])
    part("b0000004.safetensors", [4, 5, 6, 7])
    part("b0000002.safetensors", [2, 3, 4, 5])  # windows 2..5 twice: no window may count twice
    records.unlink()
    capsys.readouterr()
    again = run(model, gated(model), tmp_path / "a")  # the part that is not whole batches of its own is recomputed
    assert "recomputed 1 damaged file(s): parts/Correct/r0000/b0000002.safetensors" in capsys.readouterr().err
    pd.testing.assert_frame_equal(expected, again.records)


def test_records_independent_of_batch_size(tmp_path):
    # dynamic gates: a derangement or permutation keyed by batch position instead of example would change the NLLs
    model = ToyGated()
    a = run(model, gated(model), tmp_path / "a", batch_size=4)
    b = run(model, gated(model), tmp_path / "b", batch_size=3)
    assert (a.penalties().to_frame()["statistic"].abs() > 1e-4).sum() >= 5  # the conditions do move NLL
    # equal up to the rounding of batched kernels and of the calibration sums' order
    pd.testing.assert_frame_equal(a.records, b.records, check_exact=False, rtol=1e-5, atol=1e-7)


def test_bad_inputs_leave_nothing(tmp_path):
    model = ToyGated()
    ctrl = gated(model)
    out = tmp_path / "x"
    cases = [
        (dict(eval_windows=windows(1, 0)), "at least 2"),
        (dict(eval_windows=[torch.zeros(T, dtype=torch.long), torch.zeros(T + 1, dtype=torch.long)]), "unequal lengths"),
        (dict(calib_windows=torch.cat([windows(3, 1), windows(8, 0)[2:3]])), "equal evaluation windows"),
        (dict(calib_windows=windows(4, 1)[:, :8]), "length"),
    ]
    for kw, msg in cases:
        args = dict(eval_windows=windows(8, 0), calib_windows=windows(4, 1)) | kw
        with pytest.raises(FcauditError, match=msg):
            audit(model, ctrl, args["eval_windows"], args["calib_windows"], out=out, quiet=True)
        assert not out.exists()
    from fcaudit.data import WindowSet
    ev = WindowSet(windows(8, 0), np.arange(8) * 100, "test")
    ca = WindowSet(windows(4, 1), np.array([1000, 1100, 705, 1300]), "test")
    with pytest.raises(FcauditError, match="overlap"):
        audit(model, ctrl, ev, ca, out=out, quiet=True)
    ok = WindowSet(windows(4, 1), np.array([705, 1100, 1200, 1300]), "validation")
    assert audit(model, ctrl, ev, ok, randomizations=1, out=tmp_path / "ok", quiet=True).replay.passed
    moe = ToyMoE()
    with pytest.raises(FcauditError, match="does not fit layout"):
        audit(moe, Controller.from_modules(moe, "layers.*.router", "batch token"), windows(4, 0), windows(2, 1),
              out=out, quiet=True)
    assert not out.exists()


def test_non_finite_coefficients(tmp_path):
    model = ToyGated()
    model.blocks[1].gate.proj.bias.data.fill_(float("nan"))
    with pytest.raises(FcauditError, match="non-finite"):
        run(model, gated(model), tmp_path / "nan")
    assert not (tmp_path / "nan").exists()
    # non-finite only in a later batch: whole chunks before it, nothing partial
    model = ToyGated()
    orig = model.blocks[0].gate.forward
    model.blocks[0].gate.forward = lambda h: orig(h).masked_fill(h[..., 0] > 1e3, float("nan"))
    ev = windows(8, 0)
    ev[ev == V - 1] = 0
    ev[5, 3] = V - 1
    model.emb.weight.data[V - 1] = 1e4  # a token only in a later window drives the gate to nan
    with pytest.raises(FcauditError, match="non-finite"):
        audit(model, gated(model), ev, windows(4, 1), randomizations=1, out=tmp_path / "late", batch_size=4, quiet=True)
    assert not list((tmp_path / "late").rglob("*.tmp")) and not list((tmp_path / "late").rglob("*CrossInput*"))


def test_failed_exact_replay_stops_audit(tmp_path):
    model = Leaky()
    with pytest.raises(FcauditError, match=r"exact replay failed.*max \|Δlogit\|"):
        run(model, gated(model), tmp_path / "leak")
    import json
    report = json.loads((tmp_path / "leak" / "replay.json").read_text())
    assert report["passed"] is False and report["max_abs_dlogit"] > 0
    assert not list((tmp_path / "leak").rglob("*.parquet")) and not list((tmp_path / "leak").rglob("*.safetensors"))
    res = run(model, gated(model), tmp_path / "leak", tolerance=1e-2)  # same directory: nothing there to mix
    assert res.replay.tolerance == 1e-2 and res.replay.passed and not res.replay.bit_equal
    assert "replay passed=True" in repr(res)


def test_plan_reports_sizes():
    model = ToyMoE()
    ctrl = Controller.from_modules(model, "layers.*.router", "(batch token) expert")
    p = plan(model, ctrl, windows(32, 0), windows(8, 1), batch_size=8, randomizations=20)
    assert p.layer_shapes == [[T, 1, 4], [T, 1, 4]]
    assert p.store_bytes == 32 * 2 * T * 4 * 4
    assert p.forward_passes == 1 + 4 * (2 + 80 + 3)
    assert p.conditions == ["Correct", "CrossInput", "TokenShuffle", "CrossShuffle", "TokenResamplePast",
                            "LayerPositionMean", "StaticProfile", "StructureRemoved"]  # a source mixture's
    assert p.activation_bytes > 0
    assert p.peak_memory_bytes > sum(x.numel() * 4 for x in model.parameters())
    assert p.store_device is None and "hold the store" not in str(p)  # the CPU reads the store from its files


def test_plan_names_the_device_that_holds_the_store(monkeypatch):
    from fcaudit.auditor import planner

    asked = []
    monkeypatch.setattr(planner, "keeps_store_on", lambda device, nbytes: asked.append(nbytes) or True)
    model = ToyMoE()
    p = plan(model, Controller.from_modules(model, "layers.*.router", "(batch token) expert"), windows(32, 0))
    assert asked == [p.store_bytes] and p.store_device == "cpu"
    assert str(p).endswith("per window); the replays also hold the store on cpu")


KILL_SCRIPT = """
import sys, torch
sys.path.insert(0, {tests!r})
torch.set_num_threads({threads})
import conftest as t
from fcaudit.auditor import engine
model = t.ToyGated(sleep=float(sys.argv[2]))
t.run(model, t.gated(model), sys.argv[1], n_eval=12, R=4)
"""


def captured(out: Path, start: int) -> bool:
    """Whether a killed audit left the capture of the batch at `start` done: its chunk and its Correct records (a
    part file, or the records file the end merges them into)."""
    return (out / "coeffs" / f"chunk_{start:07d}.safetensors").exists() and (
        (out / "records" / "Correct" / "r0000.parquet").exists()
        or (out / "parts" / "Correct" / "r0000" / f"b{start:07d}.safetensors").exists())


def finished_passes(out: Path, n_eval: int, batch_size: int) -> int:
    """Forward passes whose results a killed audit left on disk, counted from its files."""
    capture = sum(captured(out, b) for b in range(0, n_eval, batch_size))
    calib = 1 if (out / "profiles.safetensors").exists() else len(list((out / "calib").glob("sum_*.safetensors")))
    from safetensors.torch import load_file

    covered = sum(len(load_file(str(p))["example"]) for p in (out / "parts").rglob("b*.safetensors")
                  if p.parts[-3] != "Correct")  # a part file holds whole batches of one (condition, r)
    # one process writes a whole (condition, r) straight to its records file
    covered += n_eval * len([p for p in (out / "records").rglob("r*.parquet") if p.parts[-2] != "Correct"])
    return 2 * capture + calib + covered // batch_size


def test_sigkill_midway_then_rerun_equals_uninterrupted(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(KILL_SCRIPT.format(tests=str(Path(__file__).parent), threads=torch.get_num_threads()))
    out = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, str(script), str(out), "0.02"])
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if len(list((out / "records").glob("*/r*.parquet"))) >= 4:  # stage 2 well under way
            break
        time.sleep(0.005)
    assert proc.poll() is None, "the audit finished (or failed) before it could be killed"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (out / "replay.json").exists()
    finished = finished_passes(out, 12, 4)
    total = 1 + 3 * (2 + 4 * 4 + 3)  # calibration, then per batch: capture + check, 4 x R=4 randomized, 3 static
    assert 0 < finished < total
    model = ToyGated()
    calls = []
    model.register_forward_hook(lambda *a: calls.append(1))
    resumed = run(model, gated(model), out, n_eval=12, R=4)  # same process settings: one thread
    # the probe (stage 1 uses it when the first batch is undone), then only the units the kill left undone
    assert len(calls) == SITE_CHECK_PASSES + total - finished + captured(out, 0)
    assert not list(out.rglob("*.tmp")) and not (out / "parts").exists()
    whole = run(model, gated(model), tmp_path / "whole", n_eval=12, R=4)
    assert len(whole.records) == 12 * (1 + 4 * 4 + 3)
    pd.testing.assert_frame_equal(resumed.records, whole.records, check_exact=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_all_finite_finds_nan_and_inf_and_no_overflow_of_large_values(dtype):
    from fcaudit.auditor.store import all_finite

    big = torch.finfo(dtype).max
    x = torch.full((4, 1000), big, dtype=dtype)  # a float32 sum of these would overflow
    assert all_finite(x) and all_finite(-x) and all_finite(torch.zeros(0, dtype=dtype))
    for bad in (float("nan"), float("inf"), float("-inf")):
        y = x.clone()
        y[2, 17] = bad
        assert not all_finite(y)
    y = torch.zeros(3, 5, dtype=dtype)
    y[0, 0], y[1, 1] = float("inf"), float("-inf")  # they would cancel in no sum: inf + -inf is nan
    assert not all_finite(y)
    assert all_finite(torch.arange(10)) and all_finite(torch.ones(2, dtype=torch.bool))


def test_active_counts_nonzero_sources_as_count_nonzero_does():
    """Per window, the mean over sites of the nonzero sources per (token, stream): nan counts, -0.0 does not; the
    same bits for float32, bf16, strided and expanded (static-profile) coefficients, and over the routers only."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(5, 7, 3, 4, generator=g)
    a[a.abs() < 0.7] = 0.0
    a[0, 0, 0, 0], a[1, 2, 1, 3], a[2, 3, 2, 1], a[3, 0, 0, 2] = -0.0, float("nan"), float("inf"), -0.0
    b = torch.randn(5, 7, 1, 6, generator=g).relu().to(torch.bfloat16)
    c = torch.tensor([0.0, 1.0, 0.0, 2.0]).expand(5, 7, 2, 4)  # a static profile, expanded to a batch
    d = torch.randn(5, 4, 7, 3, generator=g).relu().permute(0, 2, 3, 1)  # strided
    want = lambda t: np.count_nonzero(t.float().numpy().reshape(t.shape[0], -1), 1) / (t.shape[1] * t.shape[2])
    coeffs = [a, b, c, d]
    gates = Description(("vector_gate",) * 4)
    assert torch.equal(gates.active(coeffs), torch.from_numpy(np.mean([want(t) for t in coeffs], 0)))
    routers = Description(("vector_gate", "expert_router", "vector_gate", "expert_router"))  # routers are counted
    assert torch.equal(routers.active(coeffs), torch.from_numpy((want(b) + want(d)) / 2))
    signed = torch.full((1, 2, 1, 3), -0.0)
    signed[0, 1, 0, 2] = float("nan")
    assert Description(("vector_gate",)).active([signed]).tolist() == [0.5]


# ---- controllers the audit would misread: caught before anything is written ------------------------------------

class KeptGate(Gate):
    """A gate whose block reads the value it kept, not the one it returns: a replay changes nothing."""

    def forward(self, h):
        self.kept = super().forward(h)
        return self.kept


class KeptBlock(Block):
    def forward(self, h):
        mix = h.cumsum(1) / torch.arange(1, h.shape[1] + 1, device=h.device)[:, None]
        self.gate(h)
        return h + self.gate.kept[..., None] * self.mlp(torch.cat([self.ln(h), mix], -1))


class FlatRouter(nn.Module):
    """Softmax weights over 4 sources, returned flattened as [(batch token), source]."""

    def __init__(self, d):
        super().__init__()
        self.proj = nn.Linear(d, 4)

    def forward(self, h):
        return torch.softmax(self.proj(h), -1).reshape(-1, 4)


class FlatBlock(Block):
    def __init__(self, d):
        super().__init__(d, FlatRouter(d))
        self.experts = nn.Linear(d, 4 * d)

    def forward(self, h):
        w = self.gate(h).reshape(*h.shape[:2], 4, 1)
        out = self.experts(self.ln(h)).reshape(*h.shape[:2], 4, -1)
        return h + (w * out).sum(2)


def test_a_model_that_does_not_read_what_its_sites_return_gets_a_notice_and_fails_the_exact_replay(tmp_path, capsys):
    """The logits of a zero replay cannot tell such a model from one whose coefficients have no effect (gated
    branches that output zero), a legitimate audit: a notice, printed even when quiet. The exact replay check then
    stops it: the window the site check captured alone left its own values in the gates' attribute."""
    model = ToyGated()
    for b in model.blocks:
        b.__class__, b.gate.__class__ = KeptBlock, KeptGate
    with pytest.raises(FcauditError, match="exact replay failed on windows 0..3"):
        run(model, gated(model), tmp_path / "a")  # quiet
    assert "replaying zeros for every coefficient leaves the logits unchanged" in capsys.readouterr().err
    plain = ToyGated()
    run(plain, gated(plain), tmp_path / "b")
    assert "replaying zeros" not in capsys.readouterr().err


def test_a_layout_naming_a_flattened_outputs_axes_in_the_wrong_order_is_refused(tmp_path):
    model = ToyGated()
    model.blocks = nn.ModuleList(FlatBlock(16) for _ in range(2))
    wrong = Controller.from_modules(model, "blocks.*.gate", layout="(token batch) source")
    with pytest.raises(FcauditError, match=r"'\(token batch\) source' names the output's axes"):
        run(model, wrong, tmp_path / "a")
    right = run(model, Controller.from_modules(model, "blocks.*.gate", layout="(batch token) source"), tmp_path / "b")
    assert right.replay.bit_equal


@pytest.mark.parametrize("wrap", [lambda x: {"logits": x}, lambda x: (x, None)], ids=["dict", "tuple"])
def test_a_model_returning_a_dict_or_a_tuple_is_read_for_its_logits(tmp_path, wrap):
    class Wrapped(ToyGated):
        def forward(self, ids):
            return wrap(super().forward(ids))

    plain, wrapped = ToyGated(), Wrapped()
    a, b = run(plain, gated(plain), tmp_path / "a"), run(wrapped, gated(wrapped), tmp_path / "b")
    pd.testing.assert_frame_equal(a.records, b.records, check_exact=True)


def test_model_mistakes_get_one_line_each(tmp_path):
    class Opaque(ToyGated):
        def forward(self, ids):
            return {"scores": super().forward(ids)}

    opaque = Opaque()
    with pytest.raises(FcauditError, match="returned dict, in which fcaudit finds no logits"):
        run(opaque, gated(opaque), tmp_path / "a")
    model, other = ToyGated(), ToyGated()
    with pytest.raises(FcauditError, match="module of another model instance"):
        run(model, gated(other), tmp_path / "b")
    shared = ToyGated()
    for b in shared.blocks:
        b.gate = shared.blocks[0].gate
    with pytest.raises(FcauditError, match="also at another path"):
        gated(shared)

    class Positions(ToyGated):  # a position table of 8 rows that the model does not declare
        def __init__(self):
            super().__init__()
            self.pos = nn.Embedding(8, 16)

        def forward(self, ids):
            self.pos(torch.arange(ids.shape[1]))
            return super().forward(ids)

    short = Positions()
    with pytest.raises(FcauditError, match=r"first evaluation batch \(4 windows of 16 tokens\) failed \(IndexError"):
        run(short, gated(short), tmp_path / "c")


def test_a_model_whose_gated_branches_output_zero_audits_with_the_notice(tmp_path, capsys):
    model = ToyGated()
    with torch.no_grad():
        for b in model.blocks:  # zero-initialized output projections: the gates scale nothing
            b.mlp[-1].weight.zero_(), b.mlp[-1].bias.zero_()
    result = run(model, gated(model), tmp_path / "a")
    assert "leaves the logits unchanged" in capsys.readouterr().err
    assert result.replay.bit_equal and (result.penalties().to_frame()["statistic"] == 0).all()
