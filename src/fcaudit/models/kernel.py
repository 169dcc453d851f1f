"""FeatureGate's attention pass in C++ (attend.cpp), built with the machine's C++ compiler on first use.

In inference on the CPU a FeatureGate block needs the attention output and its gate's statistics (lse, entropy and
the cross score against the previous block) from one pass over the scores. In torch ops that pass is about 20 small
operations per tile of scores (`featuregate._tile_pass`); the kernel does it in one loop per (batch, head) map with
each vector holding one value for each of 16 query rows (8 without AVX-512), so every row of k, v and the other
block's k' is read once per 16 rows; q, k, v are read strided from the qkv projection (no copies in torch).

Built once per machine and source into the cache directory ($FCAUDIT_CACHE, else $XDG_CACHE_HOME/fcaudit, else
~/.cache/fcaudit), under a name that hashes the source, the flags, the compiler and the CPU's features (-march=native
code must not run on another CPU), and renamed into place, so concurrent processes (torchrun ranks) may build it
together. Without a compiler, or where the build fails, `library()` is None with one warning and FeatureGate runs on
torch ops: the same function within float32 rounding. FCAUDIT_KERNEL=off turns it off.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("attend.cpp")
# no -ffast-math: it would link code that sets flush-to-zero for the whole process, and reorder the sums
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC")
# OpenMP: the kernel then runs its maps on the libgomp.so.1 that torch has loaded (one pool, no threads of its own
# competing with torch's spinning workers); a compiler without OpenMP builds it single-threaded
OPENMP = "-fopenmp"


def cache_dir() -> Path:
    if os.environ.get("FCAUDIT_CACHE"):
        return Path(os.environ["FCAUDIT_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "fcaudit"


def _cpu_features() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return platform.processor()


def _build(cxx: str) -> Path:
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60).stdout
    key = hashlib.sha256("\0".join([SOURCE.read_text(), *FLAGS, OPENMP, version, platform.machine(), _cpu_features()])
                         .encode()).hexdigest()[:16]
    user = os.getuid() if hasattr(os, "getuid") else os.getlogin()
    for folder in (cache_dir(), Path(tempfile.gettempdir()) / f"fcaudit-{user}"):
        target = folder / f"attend-{key}.so"
        if target.exists():
            return target
        try:
            folder.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=folder)
        except OSError:
            continue  # not writable: the next folder
        os.close(fd)
        try:
            for flags in ((*FLAGS, OPENMP), FLAGS):
                done = subprocess.run([cxx, *flags, "-o", tmp, str(SOURCE)], capture_output=True, text=True,
                                      timeout=300)
                if not done.returncode:
                    break
            else:
                raise RuntimeError((done.stderr.strip().splitlines() or ["no output"])[0])
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return target
    raise RuntimeError(f"no writable cache folder (tried {cache_dir()})")


def compiler() -> str | None:
    """The C++ compiler the kernel is built with: $CXX, else c++, g++ or clang++ on PATH."""
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")


@functools.cache
def library() -> ctypes.CDLL | None:
    """The built kernel, or None (FCAUDIT_KERNEL=off, no compiler, or a failed build: warned once)."""
    if os.environ.get("FCAUDIT_KERNEL", "").lower() in ("off", "0", "no"):
        return None
    cxx = compiler()
    try:
        if cxx is None:
            raise RuntimeError("no C++ compiler on PATH")
        lib = ctypes.CDLL(str(_build(cxx)))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        warnings.warn(f"fcaudit: FeatureGate's attention kernel is not available ({e}); FeatureGate inference runs on "
                      "torch ops (slower). Install a C++ compiler (g++), or set FCAUDIT_KERNEL=off to silence this.",
                      RuntimeWarning, stacklevel=2)
        return None
    p, s = ctypes.c_void_p, ctypes.POINTER(ctypes.c_int64)
    lib.fg_attend.argtypes = [ctypes.c_int] * 4 + [ctypes.c_float] + [p, s] * 6 + [p, p, p, ctypes.c_int]
    lib.fg_attend.restype = ctypes.c_int
    return lib


def applies(*tensors: torch.Tensor) -> bool:
    """Whether the kernel takes these [B, H, T, D] tensors: plain tensors (not subclasses such as the fake tensors of
    torch.compile's tracing, which have no data), float32 on the CPU, unit stride in D, D a multiple of 8 (the kernel
    accumulates 8 columns or more at a time); the kernel built (on the first call)."""
    return (all(type(t) is torch.Tensor and t.dtype == torch.float32 and t.device.type == "cpu" and t.dim() == 4
                and t.stride(-1) == 1 for t in tensors) and tensors[0].size(-1) % 8 == 0 and library() is not None)


def _strides(t: torch.Tensor | None):
    return None if t is None else (ctypes.c_int64 * 3)(*t.stride()[:3])


def _ptr(t: torch.Tensor | None):
    return None if t is None else t.data_ptr()


# multiply-adds per thread at least (a share of about 0.2 ms): waking and joining a thread of the pool costs
# microseconds, so a small block on a many-core machine runs on fewer threads than torch's count
WORK_PER_THREAD = 1 << 21


def threads_for(B: int, H: int, T: int, D: int) -> int:
    """Threads for one call: torch's intra-op count, at most one per map and per WORK_PER_THREAD of work."""
    work = B * H * T * T * D // 2 * 3  # scores, P V and P K' over the causal half
    return max(1, min(torch.get_num_threads(), B * H, -(-work // WORK_PER_THREAD)))


def attend(q, k, v, stats: bool = False, cross_q=None, cross_k=None, threads: int | None = None):
    """(y [B, H, T, D] (a view of a [B, T, H, D] tensor, so its "b t (h d)" form needs no copy), lse [B, H, T],
    entropy, cross score) of causal attention over strided [B, H, T, D] float32 q, k, v. The entropy with `stats`,
    the cross score with `stats` and the other block's (cross_q, cross_k); else None. The caller checks `applies`.
    Each map is one thread's, so the bits do not depend on `threads` (default: threads_for)."""
    B, H, T, D = q.shape
    y = q.new_empty(B, T, H, D).transpose(1, 2)
    lse = q.new_empty(B, H, T)
    entropy = q.new_empty(B, H, T) if stats else None
    cross = q.new_empty(B, H, T) if stats and cross_q is not None else None
    cross_q, cross_k = (cross_q, cross_k) if cross is not None else (None, None)
    rc = library().fg_attend(B, H, T, D, D ** -0.5, _ptr(q), _strides(q), _ptr(k), _strides(k), _ptr(v), _strides(v),
                             _ptr(cross_q), _strides(cross_q), _ptr(cross_k), _strides(cross_k), _ptr(y), _strides(y),
                             _ptr(lse), _ptr(entropy), _ptr(cross), threads or threads_for(B, H, T, D))
    if rc:
        raise MemoryError("FeatureGate's attention kernel could not allocate its buffers") if rc == 1 else \
            RuntimeError(f"FeatureGate's attention kernel refused head size {D}: it takes multiples of 8")
    return y, lse, entropy, cross
