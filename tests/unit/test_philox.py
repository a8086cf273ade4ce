"""hvdcomp.philox: Philox4x32-10 and the (seed, rank | block, tensor_id, step) stream layout.

Golden values are the Random123 known-answer vectors (kat_vectors, philox4x32 with 10
rounds).  The stream layout is checked against a small pure-Python Philox written here from
Salmon et al. (SC 2011) / Random123's philox.h, itself pinned by the same vectors.
"""
import math

import pytest
import torch

from hvdcomp.philox import philox4x32, random_words, uniform

M32 = 0xFFFFFFFF

# Random123 kat_vectors: philox4x32 10 rounds, (counter words, key words) -> output words.
KAT = [
    ((0x00000000, 0x00000000, 0x00000000, 0x00000000), (0x00000000, 0x00000000),
     (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF), (0xFFFFFFFF, 0xFFFFFFFF),
     (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


def philox_ref(ctr, key, rounds=10):
    """Pure-Python Philox4x32 (Python ints, no wrap-around tricks)."""
    c0, c1, c2, c3 = ctr
    k0, k1 = key[0] & M32, key[1] & M32
    for r in range(rounds):
        if r:
            k0 = (k0 + 0x9E3779B9) & M32
            k1 = (k1 + 0xBB67AE85) & M32
        p0 = 0xD2511F53 * c0
        p1 = 0xCD9E8D57 * c2
        c0, c1, c2, c3 = (p1 >> 32) ^ c1 ^ k0, p1 & M32, (p0 >> 32) ^ c3 ^ k1, p0 & M32
    return c0, c1, c2, c3


def ref_words(indices, *, seed, step, rank, tensor_id):
    """Word ``index`` = output word index % 4 of Philox(counter=(block lo, block hi,
    tensor_id, step), key=(seed, rank)) with block = index // 4 (module docstring)."""
    out = []
    for i in indices:
        b = i // 4
        ctr = (b & M32, b >> 32, tensor_id & M32, step & M32)
        out.append(philox_ref(ctr, (seed, rank))[i % 4])
    return out


def _t(v):
    return torch.tensor([v], dtype=torch.int64)


@pytest.mark.parametrize("ctr,key,expected", KAT)
def test_reference_matches_random123_kat(ctr, key, expected):
    assert philox_ref(ctr, key) == expected


@pytest.mark.parametrize("ctr,key,expected", KAT)
def test_philox4x32_random123_kat(ctr, key, expected):
    out = philox4x32(*(_t(c) for c in ctr), key[0], key[1])
    assert [int(o) for o in out] == list(expected)
    for o in out:
        assert o.dtype == torch.int64


def test_philox4x32_batched_counters_match_kat_elementwise():
    # All three KAT counters in one call is impossible (one key per call), but a batch of
    # counters under the zero key must give, for the zero counter, KAT 0, and every element
    # must match the pure-Python reference.
    ctrs = [(0, 0, 0, 0), (1, 0, 0, 0), (M32, M32, M32, M32), (0x243F6A88, 0x85A308D3,
                                                               0x13198A2E, 0x03707344)]
    cols = [torch.tensor([c[j] for c in ctrs], dtype=torch.int64) for j in range(4)]
    out = philox4x32(*cols, 0, 0)
    got = [tuple(int(out[j][i]) for j in range(4)) for i in range(len(ctrs))]
    assert got[0] == KAT[0][2]
    assert got == [philox_ref(c, (0, 0)) for c in ctrs]


def test_philox4x32_fewer_rounds_differs_from_ten():
    out7 = philox4x32(*(_t(0) for _ in range(4)), 0, 0, rounds=7)
    assert tuple(int(o) for o in out7) == philox_ref((0, 0, 0, 0), (0, 0), rounds=7)
    assert tuple(int(o) for o in out7) != KAT[0][2]


# --- random_words: stream layout ----------------------------------------------------

STREAM = dict(seed=0x1234ABCD, step=5, rank=3, tensor_id=17)


def test_random_words_first_block_is_philox_of_counter_zero_block():
    # Indices 0..3 are the four outputs of block 0: counter (0, 0, tensor_id, step).
    w = random_words(4, **STREAM)
    expected = philox_ref((0, 0, STREAM["tensor_id"], STREAM["step"]),
                          (STREAM["seed"], STREAM["rank"]))
    assert w.tolist() == list(expected)


def test_random_words_zero_key_zero_counter_is_kat0():
    # seed=0, rank=0, tensor_id=0, step=0: block 0 is exactly the first KAT vector.
    w = random_words(4, seed=0, step=0, rank=0, tensor_id=0)
    assert w.tolist() == list(KAT[0][2])


def test_random_words_matches_reference_layout():
    w = random_words(37, offset=5, **STREAM)
    assert w.dtype == torch.int64 and w.shape == (37,)
    assert w.tolist() == ref_words(range(5, 42), **STREAM)


BIG = dict(seed=0xFEDCBA98, step=0x9ABCDEF0, rank=0x87654321, tensor_id=0xCAFEBABE)


def test_random_words_full_width_fields():
    # every field uses all 32 bits (a field cut to 16 bits would change the stream)
    w = random_words(11, offset=2, **BIG)
    assert w.tolist() == ref_words(range(2, 13), **BIG)
    # 64-bit step and seed/tensor_id beyond 32 bits: only the low 32 bits count
    wide = dict(BIG, step=BIG["step"] + 5 * 2**32, tensor_id=BIG["tensor_id"] + 2**40,
                seed=BIG["seed"] + 2**35)
    assert torch.equal(random_words(11, offset=2, **wide), w)


@pytest.mark.parametrize("offset", [1, 3, 5, 7, 11, 13, 29, 61])
@pytest.mark.parametrize("n", [0, 1, 2, 3, 4, 5, 9])
def test_random_words_offset_is_slice_of_longer_draw(offset, n):
    long = random_words(80, **STREAM)
    part = random_words(n, offset=offset, **STREAM)
    assert part.shape == (n,)
    assert torch.equal(part, long[offset:offset + n])


def test_random_words_n_zero_and_negative():
    assert random_words(0, **STREAM).shape == (0,)
    assert random_words(0, offset=3, **STREAM).shape == (0,)
    with pytest.raises(ValueError):
        random_words(-1, **STREAM)


def test_random_words_deterministic():
    a = random_words(100, **STREAM)
    b = random_words(100, **STREAM)
    assert torch.equal(a, b)
    assert int(a.min()) >= 0 and int(a.max()) <= M32


@pytest.mark.parametrize("field,other", [("rank", 4), ("step", 6), ("tensor_id", 18),
                                         ("seed", 0x1234ABCC)])
def test_random_words_streams_differ(field, other):
    base = random_words(64, **STREAM)
    params = dict(STREAM, **{field: other})
    changed = random_words(64, **params)
    assert changed.tolist() == ref_words(range(64), **params)
    # 64 independent uniform 32-bit words: a chance coincidence in more than 2 places is
    # impossible in practice (expected number of equal positions is 64 / 2**32).
    assert int((base == changed).sum()) <= 2


def test_step_is_taken_modulo_2_pow_32():
    a = random_words(16, seed=1, step=9, rank=0, tensor_id=2)
    b = random_words(16, seed=1, step=9 + 2**32, rank=0, tensor_id=2)
    assert torch.equal(a, b)


def test_large_offset_2_pow_33():
    # index 2**33 -> block 2**31 (block_lo = 0x80000000, block_hi = 0).
    off = 2**33
    w = random_words(9, offset=off, **STREAM)
    assert w.tolist() == ref_words(range(off, off + 9), **STREAM)
    assert not torch.equal(w, random_words(9, **STREAM))


def test_offset_beyond_2_pow_34_uses_block_hi():
    # indices 2**34 - 3 .. 2**34 + 4 straddle block 2**32 - 1 (lo = 0xffffffff, hi = 0)
    # and block 2**32 (lo = 0, hi = 1): the high counter word must come into play.
    off = 2**34 - 3
    w = random_words(8, offset=off, **STREAM)
    assert w.tolist() == ref_words(range(off, off + 8), **STREAM)
    # block 2**32 must differ from block 0 (it would equal it if block_hi were dropped).
    hi = random_words(4, offset=2**34, **STREAM)
    assert hi.tolist() == list(philox_ref((0, 1, STREAM["tensor_id"], STREAM["step"]),
                                          (STREAM["seed"], STREAM["rank"])))
    assert not torch.equal(hi, random_words(4, **STREAM))


# --- uniform ------------------------------------------------------------------------

def test_uniform_is_top_24_bits_scaled():
    w = ref_words(range(3, 3 + 50), **STREAM)
    u = uniform(50, offset=3, **STREAM)
    assert u.dtype == torch.float32
    assert u.tolist() == [(x >> 8) / 2.0**24 for x in w]


def test_uniform_statistics_over_1e6_draws():
    n = 1_000_000
    u = uniform(n, seed=7, step=1, rank=0, tensor_id=0)
    assert u.shape == (n,)
    assert float(u.min()) >= 0.0
    assert float(u.max()) < 1.0
    # multiples of 2**-24: scaling back gives integers in [0, 2**24)
    k = u.double() * 2.0**24
    assert torch.equal(k, torch.floor(k))
    assert float(k.max()) <= 2**24 - 1
    # U ~ uniform on {0, 1, ..., 2**24-1} / 2**24: mean (1 - 2**-24)/2 ~ 1/2,
    # variance ~ 1/12.  Standard error of the mean: sqrt(1/12 / n) = 2.9e-4; of the
    # variance estimate: sqrt((1/80 - 1/144) / n) = 7.5e-5.  Allow 5 standard errors.
    ud = u.double()
    mean = float(ud.mean())
    var = float(ud.var(unbiased=False))
    assert abs(mean - 0.5) < 5 * math.sqrt(1 / 12 / n)
    assert abs(var - 1 / 12) < 5 * math.sqrt((1 / 80 - 1 / 144) / n)
    # and the 16 equal-width bins hold n/16 each within 5 binomial standard deviations
    counts = torch.bincount((u * 16).long(), minlength=16).double()
    sd = math.sqrt(n * (1 / 16) * (15 / 16))
    assert float((counts - n / 16).abs().max()) < 5 * sd


def test_uniform_offset_2_pow_33_works_and_differs():
    off = 2**33
    u = uniform(8, offset=off, **STREAM)
    w = ref_words(range(off, off + 8), **STREAM)
    assert u.tolist() == [(x >> 8) / 2.0**24 for x in w]
    assert not torch.equal(u, uniform(8, **STREAM))
