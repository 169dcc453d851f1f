"""The coefficient store: chunks written, read back row by row, damaged, held on a device; its finiteness check."""

import numpy as np
import pandas as pd
import pytest
import torch

from fcaudit.auditor import CoefficientStore, files
from fcaudit.controllers import Controller
from fcaudit.errors import FcauditError
from conftest import T, ToyMudd, randomized_means, run


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
    records equal bit for bit, and no replay reads a chunk file (their bytes are gone while the store is held)."""
    from fcaudit.auditor import engine as engine_module

    model = ToyMudd()
    ctrl = Controller.from_modules(model, "dynamic_dense.*", "stream batch token source", reference="SourceUniformMean")
    loads, load, unload = [], CoefficientStore.load, CoefficientStore.unload
    base = run(model, ctrl, tmp_path / "files", R=2)
    chunks = tmp_path / "held" / "coeffs"
    kept: dict = {}

    def held(self, *args):  # held on the device, then its files emptied: a read of one would be refused as damaged
        load(self, *args)
        loads.append(self.device)
        for chunk in sorted(chunks.glob("chunk_*.safetensors")):
            kept[chunk] = chunk.read_bytes()
            chunk.write_bytes(b"")

    def let_go(self):
        unload(self)
        for chunk, data in kept.items():
            chunk.write_bytes(data)

    monkeypatch.setattr(engine_module, "keeps_store_on", lambda device, nbytes: True)  # a GPU's answer, on the CPU
    monkeypatch.setattr(CoefficientStore, "load", held)
    monkeypatch.setattr(CoefficientStore, "unload", let_go)
    held_records = run(model, ctrl, tmp_path / "held", R=2)
    assert loads == [torch.device("cpu")] and len(kept) == 2  # the 8 windows' two chunks, emptied while held
    pd.testing.assert_frame_equal(held_records.records, base.records, check_exact=True)
    means = randomized_means(held_records)
    assert means["CrossInput"] != 0 and means["TokenShuffle"] != 0  # they move NLLs


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
