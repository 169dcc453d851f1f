"""FeatureGate's C++ attention pass (fcaudit.models.kernel): against float64 truth and the torch-op pass, on strided
inputs as the model gives them, independent of the thread count; and how it is built, cached and refused."""

import math
import warnings

import pytest
import torch

import fcaudit.models.featuregate as fg
from fcaudit.models import kernel
from test_featuregate import require_kernel


@pytest.fixture(autouse=True)
def built():
    require_kernel()


def qkv(B, H, T, D, seed, scale=1.0):
    """q, k, v [B, H, T, D] as strided views of one projection output [B, T, 3 H D], as the model makes them."""
    x = torch.randn(B, T, 3 * H * D, generator=torch.Generator().manual_seed(seed)) * scale
    return x.view(B, T, 3, H, D).permute(2, 0, 3, 1, 4).unbind(0)


def truth(q, k, v, pq, pk):
    """y, lse, entropy and sum_s P S' in float64 from the definitions."""
    T, D = q.shape[-2:]
    future = ~torch.ones(T, T, dtype=torch.bool).tril()
    s = (q.double() @ k.double().transpose(-1, -2) / math.sqrt(D)).masked_fill(future, float("-inf"))
    sp = (pq.double() @ pk.double().transpose(-1, -2) / math.sqrt(D)).masked_fill(future, 0.0)
    log_p = s.log_softmax(-1)
    p = log_p.exp()
    return p @ v.double(), s.logsumexp(-1), -(p * log_p.masked_fill(future, 0)).sum(-1), (p * sp).sum(-1)


@pytest.mark.parametrize("shape", [(1, 1, 1, 8), (2, 3, 5, 16), (2, 2, 37, 24), (1, 4, 130, 40), (1, 2, 64, 64),
                                   (1, 1, 9, 136)])
def test_kernel_matches_float64_truth_and_the_torch_pass(shape):
    """T = 1, 5, 37, 130: no multiple of the kernel's 16 (or 8) rows per block; D = 40, 64 and 136: head columns
    accumulated in chunks of 24, 16 and 8."""
    B, H, T, D = shape
    q, k, v = qkv(B, H, T, D, seed=T, scale=2.0)
    pq, pk, _ = qkv(B, H, T, D, seed=T + 1, scale=2.0)
    assert kernel.applies(q, k, v) and (T == 1 or not q.is_contiguous())
    y, lse, entropy, cross = kernel.attend(q, k, v, True, pq, pk)
    ty, tlse, tent, tcross = truth(q, k, v, pq, pk)
    for got, want in [(y, ty), (lse, tlse), (entropy, tent), (cross, tcross)]:
        torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=2e-5)
    # against the torch-op pass (the same formulas in other operations): within float32 rounding
    att, prev = fg.Attention(q, k), fg.Attention(pq, pk)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(kernel, "applies", lambda *t: False)
        ry = fg.attend(att, v, prev, True)
    # float32 rounding: of sums of T terms for y (as in test_featuregate), of terms the size of the lse for the rest
    eps = torch.finfo(torch.float32).eps
    y_tol, term_tol = 2 * math.sqrt(T) * eps * float(v.abs().max()), 4 * eps * float(lse.abs().max())
    for got, want, atol in [(y, ry, y_tol), (lse, att.lse, term_tol), (entropy, att.stats[1].entropy, term_tol),
                            (cross, att.stats[1].cross_score, term_tol)]:
        torch.testing.assert_close(got, want, atol=max(atol, 2e-6), rtol=2e-6)


def test_kernel_output_is_the_same_bits_with_or_without_statistics_and_any_thread_count():
    q, k, v = qkv(3, 4, 50, 24, seed=0)
    pq, pk, _ = qkv(3, 4, 50, 24, seed=1)
    one = kernel.attend(q, k, v, True, pq, pk, threads=1)
    five = kernel.attend(q, k, v, True, pq, pk, threads=5)  # more threads than cores: uneven shares of the 12 maps
    assert all(torch.equal(a, b) for a, b in zip(one, five))
    threads = torch.get_num_threads()
    try:  # by default torch's thread count, but not more than the work is worth
        torch.set_num_threads(4)
        assert kernel.threads_for(3, 4, 50, 24) == 1 and kernel.threads_for(8, 4, 512, 64) == 4
        assert kernel.threads_for(1, 2, 2048, 128) == 2  # one thread per map at most
    finally:
        torch.set_num_threads(threads)
    for stats, cross in [(False, ()), (True, ())]:
        y, lse, entropy, cross_score = kernel.attend(q, k, v, stats, *cross)
        assert torch.equal(y, one[0]) and torch.equal(lse, one[1]) and cross_score is None
        assert (entropy is None) != stats and (not stats or torch.equal(entropy, one[2]))
    # y is a [B, H, T, D] view of a [B, T, H, D] tensor: the block's "b t (h d)" needs no copy
    assert one[0].transpose(1, 2).is_contiguous()


def test_masked_keys_add_nothing_even_where_a_row_is_one_hot():
    """A row with one dominant score (P one-hot): entropy 0 and lse the score, exactly as far as float32 goes; rows of
    equal scores: P uniform, entropy log(t + 1)."""
    B, H, T, D = 1, 1, 20, 8
    q = torch.zeros(B, H, T, D)
    k = torch.zeros(B, H, T, D)
    q[..., 0], k[..., 0, 0] = 400.0, 1.0  # key 0 scores 400 / sqrt(8) for every row, the others 0
    y, lse, entropy, _ = kernel.attend(q, k, torch.randn(B, H, T, D), True)
    assert (entropy[0, 0, 1:] < 1e-6).all() and torch.allclose(lse[0, 0], torch.full((T,), 400 / math.sqrt(8)))
    _, lse, entropy, _ = kernel.attend(torch.zeros(B, H, T, D), k * 0, torch.randn(B, H, T, D), True)
    visible = torch.arange(1, T + 1).double().log()
    torch.testing.assert_close(entropy[0, 0].double(), visible, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(lse[0, 0].double(), visible, atol=1e-6, rtol=1e-6)


def test_other_dtypes_devices_and_head_sizes_stay_on_torch_ops():
    q, k, v = qkv(1, 2, 6, 8, seed=0)
    assert kernel.applies(q, k, v)
    assert not kernel.applies(q.double(), k.double(), v.double())
    assert not kernel.applies(q.bfloat16(), k.bfloat16(), v.bfloat16())
    for D in (4, 12, 20):  # not multiples of 8
        q, k, v = qkv(1, 2, 6, D, seed=0)
        assert not kernel.applies(q, k, v)
    assert not kernel.applies(*(t.transpose(-1, -2) for t in qkv(1, 2, 8, 8, seed=0)))  # D not of unit stride
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:  # torch.compile traces with these: no data to hand to the kernel
        fake = [mode.from_tensor(t) for t in qkv(1, 2, 6, 8, seed=0)]
        assert not kernel.applies(*fake)
        model = fg.FeatureGateGPT(fg.GPTConfig(n_layer=2, n_head=2, d_model=16, block_size=8)).eval()
        with torch.no_grad():
            assert model(torch.zeros(1, 8, dtype=torch.long)).shape == (1, 8, 256)  # the torch-op pass


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """The loader's caches cleared, the build going to tmp_path; restored afterwards."""
    monkeypatch.setenv("FCAUDIT_CACHE", str(tmp_path / "cache"))
    kernel.library.cache_clear()
    yield tmp_path / "cache"
    kernel.library.cache_clear()


def test_the_kernel_is_built_once_into_the_cache_and_reused(fresh, monkeypatch):
    lib = kernel.library()
    built = list(fresh.iterdir())
    assert lib is not None and [p.name for p in built] == [f"attend-{built[0].name[7:]}"] and built[0].suffix == ".so"
    kernel.library.cache_clear()
    run = kernel.subprocess.run
    monkeypatch.setattr(kernel.subprocess, "run", lambda cmd, **kw: pytest.fail("rebuilt") if "-o" in cmd else
                        run(cmd, **kw))
    again = kernel.library()
    assert again is not None and again._name == lib._name == str(built[0])


@pytest.mark.parametrize("how", ["off", "no compiler", "failing compiler"])
def test_without_the_kernel_featuregate_runs_on_torch_ops_with_one_warning(how, fresh, monkeypatch, tmp_path):
    if how == "off":
        monkeypatch.setenv("FCAUDIT_KERNEL", "off")
    elif how == "no compiler":
        monkeypatch.setenv("CXX", str(tmp_path / "missing-c++"))
    else:
        failing = tmp_path / "c++"
        failing.write_text("#!/bin/sh\necho 'fake: error: no' >&2\nexit 1\n")
        failing.chmod(0o755)
        monkeypatch.setenv("CXX", str(failing))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert kernel.library() is None and kernel.library() is None
        q, k, v = qkv(1, 2, 6, 8, seed=0)
        assert not kernel.applies(q, k, v)
        model = fg.FeatureGateGPT(fg.GPTConfig(n_layer=2, n_head=2, d_model=16, block_size=8)).eval()
        with torch.no_grad():
            assert torch.isfinite(model(torch.zeros(1, 8, dtype=torch.long))).all()
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    if how == "off":
        assert messages == []
    else:
        assert len(messages) == 1 and "torch ops" in messages[0] and "FCAUDIT_KERNEL=off" in messages[0]
        assert ("fake: error: no" if how == "failing compiler" else "missing-c++") in messages[0]
    assert not list(fresh.glob("*")) if fresh.exists() else True  # nothing half written


def test_the_eight_lane_build_of_cpus_without_avx512_gives_the_same_values(tmp_path, monkeypatch):
    """Where the CPU has no 512-bit registers the kernel works on blocks of 8 query rows and 8 head columns (KW = 8);
    built that way here, it must agree with the 16-lane build within float32 rounding, and ask no other ABI."""
    import ctypes
    import subprocess

    cxx = kernel.compiler()
    out = tmp_path / "attend8.so"
    subprocess.run([cxx, *kernel.FLAGS, "-DKW=8", "-o", str(out), str(kernel.SOURCE)], check=True)
    eight = ctypes.CDLL(str(out))
    eight.fg_attend.argtypes, eight.fg_attend.restype = kernel.library().fg_attend.argtypes, ctypes.c_int
    for shape in [(2, 3, 37, 24), (1, 2, 20, 64), (1, 1, 5, 8)]:
        q, k, v = qkv(*shape, seed=1)
        pq, pk, _ = qkv(*shape, seed=2)
        wide = kernel.attend(q, k, v, True, pq, pk)
        monkeypatch.setattr(kernel, "library", lambda: eight)
        narrow = kernel.attend(q, k, v, True, pq, pk)
        monkeypatch.undo()
        for a, b in zip(wide, narrow):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_the_kernel_shares_torchs_openmp_runtime():
    """Built with OpenMP, the kernel runs its maps on the libgomp that torch loaded: one runtime in the process, so
    no second pool of threads competes with torch's for the cores."""
    import sys

    if not sys.platform.startswith("linux"):
        pytest.skip("reads /proc/self/maps")
    with open("/proc/self/maps") as f:
        gomp = {line.split()[-1] for line in f if "libgomp" in line}
    assert len(gomp) <= 1, gomp


def test_a_compiler_without_openmp_builds_it_single_threaded(fresh, tmp_path, monkeypatch):
    real = kernel.compiler()
    cxx = tmp_path / "c++"
    cxx.write_text(f'#!/bin/sh\nfor a in "$@"; do [ "$a" = -fopenmp ] && {{ echo "no openmp" >&2; exit 1; }}; done\n'
                   f'exec {real} "$@"\n')
    cxx.chmod(0o755)
    monkeypatch.setenv("CXX", str(cxx))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning: the kernel is built, without OpenMP
        assert kernel.library() is not None
    q, k, v = qkv(2, 3, 20, 16, seed=3)
    single = kernel.attend(q, k, v, True, threads=3)
    monkeypatch.undo()
    kernel.library.cache_clear()
    assert all(torch.equal(a, b) for a, b in zip(single, kernel.attend(q, k, v, True, threads=3)) if a is not None)
