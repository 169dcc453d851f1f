"""numpy's keyed generators, many at once: `default_rng([*prefix, key])` for every key of an array, bit for bit.

The audit draws its token permutations and past positions from one generator per (condition, randomization,
window), and building a generator costs about as much as its draws: `default_rng` hashes the key through a
`SeedSequence` (pure-Python-speed bookkeeping, ~20 us). Here the SeedSequence hash (numpy's documented algorithm,
NEP 19) runs vectorized over all keys of a call, and each PCG64 starts from its precomputed state (~5 us per key,
all told). Draws of `integers(0, high)` with per-column bounds are made from the generators' raw 64-bit outputs by
the same Lemire step numpy uses; a draw numpy would reject (probability below bound / 2**32 per draw) sends that
key to numpy itself. Tests compare both with numpy on random keys; keys that do not fit one 32-bit word each go to
numpy.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
from numpy.random import PCG64, Generator
from numpy.random.bit_generator import ISeedSequence

# numpy/random/bit_generator.pyx: SeedSequence's hash constants (pool of 4 words)
_INIT_A, _MULT_A, _INIT_B, _MULT_B = 0x43B0D7E5, 0x931E8875, 0x8B51F9DD, 0x58F38DED
_MIX_L, _MIX_R, _POOL = 0xCA01F9DD, 0x4973F715, 4
_M32 = 0xFFFFFFFF
BLOCK_DRAWS = 2**16  # integers_below works on blocks of keys of about this many draws


def _hash_constants(init: int, mult: int, n: int) -> list[tuple[int, int]]:
    """(xor, multiplier) of each of n consecutive hashmix calls: the hash constant before and after its update."""
    out, h = [], init
    for _ in range(n):
        nxt = (h * mult) & _M32
        out.append((h, nxt))
        h = nxt
    return out


_HASH_A = _hash_constants(_INIT_A, _MULT_A, _POOL + _POOL * (_POOL - 1))  # the pool's fill, then its mixing
_HASH_B = _hash_constants(_INIT_B, _MULT_B, 2 * _POOL)  # generate_state(4, uint64): 8 words


def _hashmix(v: np.ndarray, const: tuple[int, int]) -> np.ndarray:
    v = (v ^ np.uint32(const[0])) * np.uint32(const[1])  # uint32 arithmetic wraps, as numpy's C code does
    return v ^ (v >> np.uint32(16))


def _mix(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    r = x * np.uint32(_MIX_L) - y * np.uint32(_MIX_R)
    return r ^ (r >> np.uint32(16))


def pcg64_states(entropy: np.ndarray) -> np.ndarray:
    """`SeedSequence(entropy[i]).generate_state(4, np.uint64)` for every row of a uint32 array [N, words <= 4]:
    the words PCG64 seeds itself with. [N, 4] uint64."""
    n, words = entropy.shape
    if words > _POOL:
        raise ValueError(f"at most {_POOL} entropy words, got {words}")
    consts = iter(_HASH_A)
    zero = np.zeros(n, np.uint32)
    with np.errstate(over="ignore"):
        pool = [_hashmix(entropy[:, i] if i < words else zero, next(consts)) for i in range(_POOL)]
        for src in range(_POOL):
            for dst in range(_POOL):
                if src != dst:
                    pool[dst] = _mix(pool[dst], _hashmix(pool[src], next(consts)))
        out = np.stack([_hashmix(pool[i % _POOL], c) for i, c in enumerate(_HASH_B)], 1)
    return np.ascontiguousarray(out).astype("<u4").view("<u8").astype(np.uint64)


class _Seeded(ISeedSequence):
    """A seed sequence whose state is already computed (PCG64 asks for 4 uint64 words once)."""

    __slots__ = ("words",)

    def __init__(self, words: np.ndarray):
        self.words = words

    def generate_state(self, n_words, dtype=np.uint32):
        if n_words != 4 or np.dtype(dtype) != np.uint64:  # only PCG64's request was precomputed
            raise ValueError(f"precomputed state has 4 uint64 words, asked for {n_words} {np.dtype(dtype)}")
        return self.words


def _entropy(prefix: Sequence[int], keys: np.ndarray) -> np.ndarray | None:
    """[N, words] uint32 entropy of the keys [*prefix, key], or None when some value does not fit one word."""
    keys = np.asarray(keys, dtype=np.int64)
    if any(not 0 <= p <= _M32 for p in prefix) or (len(keys) and (keys.min() < 0 or keys.max() > _M32)):
        return None
    out = np.empty((len(keys), len(prefix) + 1), np.uint32)
    out[:, :len(prefix)] = np.asarray(prefix, dtype=np.uint32)
    out[:, -1] = keys
    return out


def bit_generators(prefix: Sequence[int], keys: np.ndarray) -> list[PCG64] | None:
    """The PCG64 of `default_rng([*prefix, k])` for each k, or None when the keys take numpy's own path."""
    entropy = _entropy(prefix, keys)
    if entropy is None or entropy.shape[1] > _POOL:
        return None
    return [PCG64(_Seeded(w)) for w in pcg64_states(entropy)]


def generators(prefix: Sequence[int], keys: np.ndarray) -> list[Generator]:
    """`np.random.default_rng([*prefix, k])` for each k in `keys`, equal bit for bit."""
    fast = bit_generators(prefix, keys)
    if fast is None:
        return [np.random.default_rng([*prefix, int(k)]) for k in keys]
    return [Generator(b) for b in fast]


def _lemire(u: np.ndarray, excl: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """numpy's bounded draw (distributions.c, buffered_bounded_lemire_uint32) of values in [0, excl) from 32-bit
    draws `u` [..., n] (uint32) and bounds `excl` [n] (uint64, 2 <= excl < 2**32): (values as uint64, where numpy
    would have rejected the draw and drawn again)."""
    m = u.astype(np.uint64)
    m *= excl
    rejected = (m & np.uint64(_M32)) < (np.uint64(_M32) - (excl - np.uint64(1))) % excl
    m >>= np.uint64(32)
    return m, rejected


def integers_below(prefix: Sequence[int], keys: np.ndarray, high: np.ndarray, rows: int) -> np.ndarray:
    """`np.random.default_rng([*prefix, k]).integers(0, high, size=(rows, len(high)))` for each k in `keys`, stacked
    [N, rows, len(high)] int64, equal bit for bit. `high`: int bounds >= 1 per column."""
    high = np.asarray(high, dtype=np.int64)
    keys = np.asarray(keys, dtype=np.int64)
    exact = lambda k: np.random.default_rng([*prefix, int(k)]).integers(0, high, size=(rows, len(high)))  # noqa: E731
    bits = bit_generators(prefix, keys) if len(high) and high.min() >= 1 and high.max() <= _M32 else None
    if bits is None:
        return np.stack([exact(k) for k in keys]) if len(keys) else np.zeros((0, rows, len(high)), np.int64)
    drawn = high > 1  # a bound of 1 gives 0 without a draw
    per_row = int(drawn.sum())
    n = rows * per_row
    out = np.zeros((len(keys), rows, len(high)), np.int64)
    if not n:
        return out
    excl = high[drawn].astype(np.uint64)
    step = max(1, BLOCK_DRAWS // n)  # keys per block: the temporaries stay in cache, not [N, rows, T] uint64 twice
    for lo in range(0, len(keys), step):
        block = bits[lo:lo + step]
        # PCG64's 32-bit draws: each 64-bit output split, its low half first
        raw = np.stack([b.random_raw((n + 1) // 2) for b in block]).astype("<u8", copy=False).view("<u4")[:, :n]
        values, rejected = _lemire(raw.reshape(len(block), rows, per_row), excl)
        out[lo:lo + len(block), :, drawn] = values
        for i in np.flatnonzero(rejected.any((1, 2))):  # numpy drew again there: its own draws from that key
            out[lo + i] = exact(keys[lo + i])
    return out
