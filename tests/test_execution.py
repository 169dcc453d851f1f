"""Execution measurements: executed blocks, FLOPs, latency, post-training thresholding, the execution table."""

import json
import math

import pandas as pd
import pytest
import torch
from torch import nn

from fcaudit.families import controller_for
from fcaudit.errors import FcauditError
from fcaudit.execution import (ExecutionConfig, Timing, block_pattern, executed_blocks, flops, latencies, measure_execution,
                               thresholding)
from fcaudit.loss import token_nll
from fcaudit.models.checkpoint import save_checkpoint
from fcaudit.models.featuregate import VARIANTS, FeatureGateGPT, GPTConfig

TINY = dict(n_layer=3, n_head=2, d_model=16, block_size=16, gate_hidden=8)


def tiny(variant: str, seed: int = 0, **kw) -> FeatureGateGPT:
    torch.manual_seed(seed)
    model = FeatureGateGPT(GPTConfig(variant=variant, **{**TINY, **kw}))
    with torch.no_grad():  # spread the gates so thresholds fall between them
        for name, p in model.named_parameters():
            if "gate" in name:
                p.add_(torch.randn_like(p))
    return model.eval()


@pytest.fixture
def ids():
    return torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(1))


# ---- executed blocks ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("variant", VARIANTS)
def test_every_soft_gated_variant_executes_every_block_and_fixeddepth_k_executes_k(variant, ids):
    kw = {"n_layer": 2} if variant == "fixeddepth" else {}
    count = executed_blocks(tiny(variant, **kw), ids)
    assert count.pattern == "blocks.*"
    expected = 2 if variant == "fixeddepth" else 3
    assert (count.n_blocks, count.executed, count.skipped) == (expected, expected, ())


def test_mudd_executes_every_layer(ids):
    from fcaudit.models.muddpythia import BYTE_PRESETS, MUDDPythia

    torch.manual_seed(0)
    model = MUDDPythia(BYTE_PRESETS["tiny"]).eval()
    count = executed_blocks(model, ids)
    assert count.pattern == "layers.*"
    assert count.executed == count.n_blocks == BYTE_PRESETS["tiny"].n_layer
    assert flops(model, ids) > 0 and all(p.requires_grad for p in model.parameters())  # flags restored


class SkipsOddBlocks(nn.Module):
    """A model that really skips: its odd blocks are never called."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(256, 8)
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))

    def forward(self, ids):
        h = self.emb(ids)
        for i, layer in enumerate(self.layers):
            if i % 2 == 0:
                h = h + layer(h)
        return h


def test_a_block_that_is_never_called_is_counted_as_skipped(ids):
    model = SkipsOddBlocks()
    count = executed_blocks(model, ids)
    assert (count.pattern, count.n_blocks, count.executed, count.skipped) == ("layers.*", 4, 2, ("layers.1", "layers.3"))
    # the two FLOP-counted matmuls per token: 2 blocks x 2 * 8 * 8
    assert flops(model, ids) == 2 * 2 * 8 * 8


def test_block_patterns_match_one_path_segment_per_star(ids):
    model = tiny("featuregate")
    assert block_pattern(model) == "blocks.*"
    assert executed_blocks(model, ids, "blocks.*.gate").executed == 3  # the gates, not their children
    assert executed_blocks(model, ids, "blocks.1").n_blocks == 1
    with pytest.raises(FcauditError, match="matches no module"):
        executed_blocks(model, ids, "layers.*")


# ---- FLOPs --------------------------------------------------------------------------------------------------------

def dense_flops_per_token(n_layer: int, d: int, t: int, v: int) -> int:
    """qkv (3 d^2) + out proj (d^2) + MLP (8 d^2) multiply-adds per layer, attention QK^T and AV over the full
    T x T scores (2 t d per token), the tied LM head (d v); x2 FLOPs per multiply-add."""
    return n_layer * (2 * 12 * d * d + 2 * 2 * t * d) + 2 * d * v


def test_dense_flops_equal_the_analytic_count_and_scale_linearly_in_depth(ids):
    for n_layer in (1, 2, 3):
        assert flops(tiny("dense", n_layer=n_layer), ids) == dense_flops_per_token(n_layer, 16, 16, 256)
    assert flops(tiny("fixeddepth", n_layer=2), ids) == dense_flops_per_token(2, 16, 16, 256)


def test_featuregate_flops_exceed_dense_and_constant_gates_add_none(ids):
    dense = flops(tiny("dense"), ids)
    # its controller's matrix products per token: q k^T in every block and (P K') from the second on, over its one
    # causal tile (T = 16: 16 keys per row), and the gate MLP (4 -> 8 -> 1)
    L, T, d, hidden = TINY["n_layer"], TINY["block_size"], TINY["d_model"], TINY["gate_hidden"]
    assert flops(tiny("featuregate"), ids) - dense == (2 * L - 1) * 2 * T * d + L * 2 * (4 * hidden + hidden)
    assert flops(tiny("uniform"), ids) == flops(tiny("layerstatic"), ids) == dense


# ---- latency ------------------------------------------------------------------------------------------------------

def test_latency_returns_positive_finite_numbers():
    [lat] = latencies([tiny("featuregate")], batch_size=2, window=8, timing=Timing(min_run_time=0.02, warmup=1))
    assert lat.ms_per_batch > 0 and math.isfinite(lat.ms_per_batch)
    assert lat.tokens_per_s > 0 and math.isfinite(lat.tokens_per_s)
    assert lat.tokens_per_s == pytest.approx(2 * 8 / (lat.ms_per_batch / 1e3))
    assert (lat.batch_size, lat.window, lat.device) == (2, 8, "cpu") and lat.measurements >= 1
    with pytest.raises(FcauditError, match="batch size"):
        latencies([tiny("dense")], batch_size=0)


# ---- thresholding -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("variant", ["featuregate", "layerstatic"])
def test_threshold_zero_reproduces_the_plain_nll_and_one_removes_every_block(variant, ids):
    model = tiny(variant)
    with torch.no_grad():
        reference = token_nll(model(ids), ids).double().mean().item()
        _, gates = model(ids, return_gates=True)
        h = model.wte(ids) + model.wpe(torch.arange(ids.shape[1]))  # every gate 0: embeddings straight to the head
        no_blocks = token_nll(model.lm_head(model.ln_f(h)), ids).double().mean().item()
    taus = [0.0, float(gates.median()), 1.0]
    df = thresholding(model, controller_for(model), ids, taus, batch_size=len(ids)).set_index("threshold")

    assert df.loc[0.0, "nll"] == df.loc[0.0, "plain_nll"]  # exact replay of the captured gates
    assert df.loc[0.0, "plain_nll"] == pytest.approx(reference, abs=1e-12)
    assert df.loc[0.0, ["frac_below", "skippable_blocks", "delta_nll"]].tolist() == [0.0, 0.0, 0.0]

    assert df.loc[1.0, "frac_below"] == 1.0
    assert df.loc[1.0, "skippable_blocks"] == 3 and df.loc[1.0, "skippable_fraction"] == 1.0
    assert df.loc[1.0, "nll"] == pytest.approx(no_blocks, abs=1e-6)
    assert df.loc[1.0, "byte_ppl"] == pytest.approx(math.exp(no_blocks), rel=1e-6)

    mid = taus[1]
    assert df.loc[mid, "frac_below"] == pytest.approx((gates < mid).double().mean().item())
    assert df.loc[mid, "skippable_blocks"] == (gates < mid).all(dim=2).sum().item() / len(ids)
    assert (df["windows"] == 4).all() and (df["tokens"] == 4 * 15).all()

    with torch.no_grad():  # the controller is restored afterwards
        assert torch.equal(model(ids), model(ids)) and token_nll(model(ids), ids).double().mean().item() == reference


def test_thresholding_refuses_source_mixtures_and_bad_thresholds(ids):
    from fcaudit.models.muddpythia import BYTE_PRESETS, MUDDPythia

    mudd = MUDDPythia(BYTE_PRESETS["tiny"]).eval()
    with pytest.raises(FcauditError, match="scalar gates"):
        thresholding(mudd, controller_for(mudd), ids, [0.5])
    model = tiny("featuregate")
    with pytest.raises(FcauditError, match="finite thresholds"):
        thresholding(model, None, ids, [])
    with pytest.raises(FcauditError, match="integer windows"):
        thresholding(model, None, ids.float(), [0.5])


# ---- the execution table ------------------------------------------------------------------------------------------

@pytest.fixture
def checkpoints(tmp_path):
    dirs = []
    for name, variant, kw in [("dense", "dense", {}), ("fg", "featuregate", {}), ("fd2", "fixeddepth", {"n_layer": 2})]:
        d = tmp_path / name
        save_checkpoint(d, tiny(variant, **kw), {"variant": variant, "seed": 0})
        dirs.append(d)
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(b"".join(f"line {i}: the quick brown fox jumps over the lazy dog\n".encode() for i in range(600)))
    return dirs, corpus


def test_measure_execution_writes_the_table_with_ratios_to_dense(checkpoints, tmp_path):
    dirs, corpus = checkpoints
    out = tmp_path / "exec"
    threads = torch.get_num_threads()
    df = measure_execution(ExecutionConfig(dirs, out, batch_size=2, min_run_time=0.02, thresholds=[0.0, 1.0],
                                           corpus=str(corpus), threshold_windows=4, threads=1, progress=False)
                           ).set_index("model")
    assert torch.get_num_threads() == threads and (df["threads"] == 1).all()

    assert list(df.index) == ["dense", "featuregate", "fixeddepth-2"]
    assert df["executed_blocks"].tolist() == [3, 3, 2] and df["n_blocks"].tolist() == [3, 3, 2]
    assert df.loc["dense", ["latency_vs_dense", "throughput_vs_dense", "flops_vs_dense"]].tolist() == [1.0, 1.0, 1.0]
    assert df.loc["fixeddepth-2", "executed_vs_dense"] == pytest.approx(2 / 3)
    assert df.loc["fixeddepth-2", "flops_vs_dense"] < 1 < df.loc["featuregate", "flops_vs_dense"]
    assert (df["latency_ms"] > 0).all() and (df["tokens_per_s"] > 0).all() and (df["window"] == 16).all()
    assert df.loc["featuregate", "n_params"] > df.loc["dense", "n_params"] > df.loc["fixeddepth-2", "n_params"]
    assert df.loc["featuregate", ["decided", "executed"]].tolist() == [1.0, 1.0]  # a soft gate skips nothing
    assert df.loc["dense", "decided"] != df.loc["dense", "decided"]  # NaN: no controller decides anything
    assert (df["executed_row_fraction"] == 1.0).all()  # every block that ran computed every row

    saved = pd.read_csv(out / "execution.csv")
    assert saved["executed_blocks"].tolist() == [3, 3, 2]
    payload = json.loads((out / "execution.json").read_text())
    assert payload["settings"]["batch_size"] == 2 and len(payload["rows"]) == 3 and "versions" in payload
    sweep = pd.read_csv(out / "thresholding.csv")  # only the scalar-gated model is thresholded
    assert sweep["model"].unique().tolist() == ["featuregate"]
    assert sweep["frac_below"].tolist() == [0.0, 1.0] and sweep["windows"].tolist() == [4, 4]
    assert not list(out.glob(".*.tmp"))

    measure_execution(ExecutionConfig(dirs[:1], out, batch_size=2, min_run_time=0.01, progress=False))  # no sweep
    assert len(pd.read_csv(out / "execution.csv")) == 1 and not (out / "thresholding.csv").exists()
    # more test windows asked for than the split holds: execution.json records the number thresholding used
    measure_execution(ExecutionConfig(dirs[1:2], out, batch_size=8, min_run_time=0.01, thresholds=[0.5],
                                      corpus=str(corpus), threshold_windows=10**5, progress=False))
    used = pd.read_csv(out / "thresholding.csv")["windows"].item()
    assert used < 10**5 and json.loads((out / "execution.json").read_text())["settings"]["threshold_windows"] == used


def test_measure_execution_rejects_bad_input(checkpoints, tmp_path):
    dirs, _ = checkpoints
    with pytest.raises(FcauditError, match="no checkpoints"):
        ExecutionConfig([], tmp_path / "x")
    with pytest.raises(FcauditError, match="exceeds the block_size"):
        measure_execution(ExecutionConfig(dirs, tmp_path / "x", window=32, progress=False))
    with pytest.raises(FcauditError, match="no checkpoint directory"):
        measure_execution(ExecutionConfig([tmp_path / "missing"], tmp_path / "x", progress=False))
    assert not (tmp_path / "x" / "execution.csv").exists()


def test_block_size_is_read_from_a_multimodal_text_config_and_the_default_window_is_capped(tmp_path):
    from fcaudit.execution import measure

    scout, short = tmp_path / "scout", tmp_path / "short"
    scout.mkdir(), short.mkdir()
    (scout / "config.json").write_text(json.dumps({"model_type": "llama4",
                                                   "text_config": {"max_position_embeddings": 10_485_760}}))
    (short / "config.json").write_text(json.dumps({"max_position_embeddings": 4096}))
    # Llama 4 Scout's context read from its text_config: a window of 2**17 fits it, not the other's 4096
    with pytest.raises(FcauditError, match=f"window 131072 exceeds the block_size of {short}"):
        measure_execution(ExecutionConfig([scout, short], tmp_path / "x", window=2**17, progress=False))
    assert measure.default_window([10_485_760, 131_072]) == 2048
    assert measure.default_window([128, 4096]) == 128


def test_checkpoints_of_one_label_are_told_apart_and_a_model_without_gates_says_it_is_not_thresholded(
        checkpoints, tmp_path, capsys):
    dirs, corpus = checkpoints
    seed1 = tmp_path / "fg-s1"
    save_checkpoint(seed1, tiny("featuregate", seed=1), {"variant": "featuregate", "seed": 1})
    df = measure_execution(ExecutionConfig([dirs[0], dirs[1], seed1], tmp_path / "exec", batch_size=2,
                                           min_run_time=0.01, thresholds=[0.5], corpus=str(corpus),
                                           threshold_windows=2, threads=1))
    assert df["model"].tolist() == ["dense", "featuregate (fg)", "featuregate (fg-s1)"]
    assert "thresholding: dense has no scalar gates to threshold; skipped" in capsys.readouterr().err


class SkipRouterLM(nn.Module):
    """A per-token skip router written as people write one: a scorer per block picks the tokens whose MLP runs, and the
    model calls `block.mlp` on those rows only (the block's own forward never runs); `mask=True` computes every row and
    zeroes the skipped tokens' updates instead."""

    def __init__(self, keep: float, mask: bool = False, d: int = 16, n: int = 3):
        super().__init__()
        self.keep, self.mask = keep, mask
        self.emb, self.head = nn.Embedding(256, d), nn.Linear(d, 256)
        self.blocks = nn.ModuleList(nn.ModuleDict({"ln": nn.LayerNorm(d), "mlp": nn.Sequential(
            nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))}) for _ in range(n))
        self.scorers = nn.ModuleList(nn.Linear(d, 1) for _ in range(n))

    def forward(self, ids):
        h = self.emb(ids)
        k = max(1, round(self.keep * ids.shape[1]))
        for block, scorer in zip(self.blocks, self.scorers):
            top = scorer(h).squeeze(-1).topk(k, dim=1).indices  # [B, k]
            if self.mask:
                run = torch.zeros_like(h[..., 0]).scatter(1, top, 1.0)
                h = h + run[..., None] * block["mlp"](block["ln"](h))
            else:
                rows = h.gather(1, top[..., None].expand(-1, -1, h.shape[-1]))
                h = h.scatter_add(1, top[..., None].expand_as(rows), block["mlp"](block["ln"](rows)))
        return self.head(h)


def test_blocks_are_counted_by_the_rows_they_computed_not_by_their_forward_calls():
    ids = torch.randint(0, 256, (4, 12), generator=torch.Generator().manual_seed(0))
    gathered = executed_blocks(SkipRouterLM(keep=2 / 3).eval(), ids, "blocks.*")
    assert gathered.executed == gathered.n_blocks == 3 and gathered.skipped == ()  # no block's forward ever ran
    assert gathered.row_fractions == pytest.approx((2 / 3,) * 3)
    masked = executed_blocks(SkipRouterLM(keep=2 / 3, mask=True).eval(), ids, "blocks.*")
    assert masked.row_fractions == (1.0, 1.0, 1.0)  # a mask decides 2/3 and computes every row

    class Shallow(SkipRouterLM):  # a fixed depth: the last block never computes
        def forward(self, ids):
            h = self.emb(ids)
            for block in self.blocks[:2]:
                h = h + block["mlp"](block["ln"](h))
            return self.head(h)

    shallow = executed_blocks(Shallow(keep=1.0).eval(), ids, "blocks.*")
    assert (shallow.executed, shallow.skipped, shallow.row_fractions) == (2, ("blocks.2",), (1.0, 1.0, 0.0))
    assert shallow.row_fraction() == pytest.approx(2 / 3)
