"""fcaudit.keyed against numpy itself: the same generators and draws as `default_rng([*prefix, key])`, bit for bit."""

import numpy as np
import pytest
from numpy.random import SeedSequence

from fcaudit import keyed

EDGES = [0, 1, 2**31, 2**32 - 1]


def random_keys(n: int, words: int, seed: int = 0) -> np.ndarray:
    keys = np.random.default_rng(seed).integers(0, 2**32, size=(n, words), dtype=np.uint64)
    keys[: len(EDGES)] = np.array(EDGES, dtype=np.uint64)[:, None]  # every word at each edge value
    return keys.astype(np.uint32)


@pytest.mark.parametrize("words", [1, 2, 3, 4])
def test_seed_states_are_numpys(words):
    keys = random_keys(2000, words)
    got = keyed.pcg64_states(keys)
    for k, g in zip(keys, got):
        assert np.array_equal(g, SeedSequence(k).generate_state(4, np.uint64))


def test_generators_are_default_rng():
    positions = np.broadcast_to(np.arange(40), (5, 40))
    keys = np.concatenate([random_keys(200, 1, seed=1)[:, 0].astype(np.int64), [2**32 + 5]])  # the last: numpy's path
    for prefix in [(2, 7, 3), (1, 2**32 - 1), (4, 2**40)]:  # the last: a prefix numpy splits into two words
        for k, g in zip(keys, keyed.generators(prefix, keys)):
            want = np.random.default_rng([*prefix, int(k)])
            assert np.array_equal(g.permuted(positions, axis=1), want.permuted(positions, axis=1))
            assert np.array_equal(g.random(3), want.random(3))


@pytest.mark.parametrize("high", [np.arange(1, 2), np.arange(1, 3), np.arange(1, 66), np.array([1, 1, 1]),
                                  np.array([1, 5, 1, 1, 2**31 + 3, 7]), np.array([2**32 - 1, 3])])
@pytest.mark.parametrize("rows", [1, 9])
def test_integers_below_are_numpys(high, rows, monkeypatch):
    keys = np.arange(300) * 7919
    got = keyed.integers_below((3, 11, 4), keys, high, rows)
    monkeypatch.setattr(keyed, "BLOCK_DRAWS", 7 * rows * len(high))  # blocks of 7 keys and a short last one
    assert np.array_equal(keyed.integers_below((3, 11, 4), keys, high, rows), got)
    assert got.shape == (300, rows, len(high)) and got.dtype == np.int64
    for k, g in zip(keys, got):
        assert np.array_equal(g, np.random.default_rng([3, 11, 4, int(k)]).integers(0, high, size=(rows, len(high))))


def test_a_draw_numpy_rejects_is_flagged_and_redrawn_by_numpy(monkeypatch):
    """numpy rejects a 32-bit draw u for the bound b when (u * b) mod 2**32 < 2**32 mod b (for b = 3: u = 0); such a
    key's row comes from numpy's own draws, which went on past the rejected one."""
    values, rejected = keyed._lemire(np.array([0, 1, 0, 2**32 - 1], dtype=np.uint32),
                                     np.array([3, 3, 4, 3], dtype=np.uint64))
    assert rejected.tolist() == [True, False, False, False]  # a power of two never rejects
    assert values.tolist() == [0, 0, 0, 2]
    monkeypatch.setattr(keyed, "BLOCK_DRAWS", 1)  # a key per block: its row is put back where it belongs
    real = keyed._lemire
    monkeypatch.setattr(keyed, "_lemire", lambda u, excl: (real(u, excl)[0] + np.uint64(7), np.ones(u.shape, bool)))
    high = np.arange(1, 20)
    got = keyed.integers_below((3, 0, 0), np.arange(5), high, 2)
    for k, g in zip(range(5), got):
        assert np.array_equal(g, np.random.default_rng([3, 0, 0, k]).integers(0, high, size=(2, 19)))
