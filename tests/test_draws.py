"""The randomized conditions' draws: derangements, token shuffles and past resamples, keyed by example as the
protocol says."""

import numpy as np
import pytest
import torch

from fcaudit import protocol
from fcaudit.errors import FcauditError
from fcaudit.kinds import Description
from fcaudit.protocol import derangement, resample_past, shuffle_tokens
from conftest import T


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
        for n, rows in [(16, 3), (128, 4)]:
            perm = np.random.default_rng([protocol.SHUFFLE, seed, r, e]).permuted(
                np.broadcast_to(np.arange(n), (rows, n)), axis=1)
            past = np.random.default_rng([protocol.RESAMPLE, seed, r, e]).integers(0, np.arange(1, n + 1), size=(rows, n))
            for got, want in [(protocol.token_permutations(np.array([e]), seed, r, n, rows), perm),
                              (protocol.past_positions(np.array([e]), seed, r, n, rows), past)]:
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
