"""The reduce-scatter's finer second stage of the bucketed quantizers (#11 item 5):
hvdcomp.levels.refine (hand-worked tables, the superset and float32 properties, bad input)
and hvdcomp.compressors.quantizers.Finer (follows its base's table and version, bits and
bytes on the wire, no state of its own, variance never above the base's)."""
import math

import numpy as np
import pytest
import torch

import hvdcomp
from hvdcomp import WireFormatError
from hvdcomp import levels as L
from hvdcomp.compressors.quantizers import FINER_BITS, Finer
from hvdcomp.exchange.shards import second_stage


def test_refine_hand_worked():
    # NUQSGD's 3-bit table {0, 1/4, 1/2, 1}: 15 parts for 3 intervals, 5 each
    got = L.refine([0.0, 0.25, 0.5, 1.0], 5)
    want = [0, .05, .1, .15, .2, .25, .3, .35, .4, .45, .5, .6, .7, .8, .9, 1]
    assert got.dtype == np.float32 and got.tolist() == np.float32(want).tolist()
    # uniform tables become uniform where the parts divide evenly (2**(b2-1) - 1 parts)
    for b, b2 in ((2, 4), (3, 5), (2, 8)):
        np.testing.assert_allclose(L.refine(L.uniform_levels(b), b2), L.uniform_levels(b2),
                                   rtol=0, atol=1e-7)
    # 4 bits -> 6: 31 parts for 7 intervals: 5, 5, 5 in the three lowest, then 4, 4, 4, 4
    base = L.exponential_levels(4)
    got = L.refine(base, 6)
    assert got.size == 32
    inside = [int(np.sum((got > a) & (got < b))) for a, b in zip(base[:-1], base[1:])]
    assert inside == [4, 4, 4, 3, 3, 3, 3]
    # 7 bits -> 8: 127 parts for 63 intervals: 3 in the lowest, 2 in the others
    base = np.float32(L.exponential_levels(7, 0.9))
    got = L.refine(base, 8)
    inside = [int(np.sum((got > a) & (got < b))) for a, b in zip(base[:-1], base[1:])]
    assert got.size == 128 and inside == [2] + [1] * 62


@pytest.mark.parametrize("bits,bits2", [(2, 4), (3, 5), (4, 6), (6, 8)])
def test_refine_holds_every_level_and_lowers_every_variance(bits, bits2):
    rng = np.random.default_rng(bits)
    base = np.float32(np.sort(np.concatenate([[0.0, 1.0],
                                              rng.uniform(0, 1, L.num_levels(bits) - 2)])))
    fine = L.refine(base, bits2)
    assert fine.size == L.num_levels(bits2) and np.all(np.diff(fine) > 0)
    assert set(base.tolist()) <= set(fine.tolist())
    r = rng.uniform(0, 1, 20000) ** 3
    w = np.ones_like(r)
    per = [L.empirical_variance(r[i:i + 1], w[i:i + 1], fine)
           <= L.empirical_variance(r[i:i + 1], w[i:i + 1], base) + 1e-15 for i in range(200)]
    assert all(per)
    # an interval of width d cut in k parts: variance at most d^2 / (4 k^2) there
    k = (L.num_levels(bits2) - 1) // (base.size - 1)
    assert L.empirical_variance(r, w, fine) <= np.sum(
        np.diff(base.astype(np.float64)).max() ** 2 / (4 * k * k) * w)


def test_refine_keeps_a_crowded_table_distinct_in_float32():
    x = np.float32(0.3)
    crowded = np.array([0.0, x, np.nextafter(x, np.float32(1)), 1.0], dtype=np.float32)
    fine = L.refine(crowded, 5)
    assert fine.size == 16 and fine[0] == 0.0 and fine[-1] == 1.0
    assert np.all(np.diff(fine) > 0)
    top = np.array([0.0, 0.5, np.nextafter(np.float32(1), np.float32(0)), 1.0], np.float32)
    fine = L.refine(top, 5)
    assert fine[-1] == 1.0 and np.all(np.diff(fine) > 0)


@pytest.mark.parametrize("table,bits", [([0.0, 0.5, 0.4, 1.0], 5), ([0.1, 0.5, 1.0], 5),
                                        ([0.0, 0.5], 5), (L.uniform_levels(5), 4)])
def test_refine_refuses_bad_tables(table, bits):
    with pytest.raises(ValueError, match="refine"):
        L.refine(table, bits)


def test_second_stage_is_finer_for_the_bucketed_quantizers_only():
    for spec in ("qsgd:bits=3", "qsgdinf:bits=4", "nuqsgd:bits=2", "alq:bits=3",
                 "amq:bits=3,entropy=1", "qsgd:bits=7"):
        c = hvdcomp.get(spec)
        f = second_stage(c)
        assert isinstance(f, Finer) and f.base is c and f.bits == min(c.bits + FINER_BITS, 8)
        assert (f.name, f.codec, f.bucket_size, f.entropy) == (c.name, c.codec,
                                                               c.bucket_size, c.entropy)
        assert f.inner.norm == c.norm and type(f.inner) is type(c)
    for spec in ("qsgd:bits=8", "terngrad", "signef", "psq:bits=4", "dqsg:bits=4", "topk"):
        c = hvdcomp.get(spec)
        assert second_stage(c) is c
    with pytest.raises(TypeError, match="Finer refines"):
        Finer(hvdcomp.get("terngrad"), 4)
    with pytest.raises(ValueError, match="bits"):
        Finer(hvdcomp.get("qsgd:bits=3"), 3)


def _key(step=0, name="w/avg"):
    return hvdcomp.TensorKey(name, 7, step, 2, 1, seed=5)


def test_finer_follows_its_base_table_and_version():
    alq = hvdcomp.get("alq:bits=3,bucket_size=512")
    f = second_stage(alq)
    # the initial table {0, 1/4, 1/2, 1}: NUQSGD's 5-bit table, which holds it
    assert f.level_version == 0
    np.testing.assert_array_equal(f.levels.numpy(), np.float32(L.exponential_levels(5)))
    assert set(alq.levels.tolist()) <= set(f.levels.tolist())
    # a refit (adopt) and a checkpoint load: the fitted table refined, with the version
    alq.adopt(np.float32([0.0, 0.01, 0.03, 1.0]))
    assert f.level_version == 1
    np.testing.assert_array_equal(f.levels.numpy(), L.refine(np.float32([0, .01, .03, 1]), 5))
    alq.load_state_dict({"levels": [0.0, 0.02, 0.2, 1.0], "level_version": 4})
    assert f.level_version == 4
    np.testing.assert_array_equal(f.levels.numpy(), L.refine(np.float32([0, .02, .2, 1]), 5))
    alq.load_state_dict({"levels": [0.0, 0.25, 0.5, 1.0], "level_version": 5})
    np.testing.assert_array_equal(f.levels.numpy(), np.float32(L.exponential_levels(5)))
    alq.load_state_dict({"levels": [0.0, 0.02, 0.2, 1.0], "level_version": 4})
    assert f.state_dict() == {} and not f.keeps_state
    f.load_state_dict({})
    # the message: base's codec, 5 bits, the base's version; 4 * nb + ceil(5 n / 8) bytes
    x = torch.randn(1300, generator=torch.Generator().manual_seed(3))
    msg = hvdcomp.Message.from_bytes(f.encode(x, _key()).to_bytes())
    assert (msg.codec, msg.bits, msg.level_version, msg.bucket_size) == (alq.codec, 5, 4, 512)
    assert f.message_bytes(1300) == 4 * 3 + math.ceil(5 * 1300 / 8)
    assert sum(len(bytes(s)) for s in msg.sections) == f.message_bytes(1300)
    # decoded: sign * norm * fine level of each code (the inner quantizer's own decode)
    out = torch.zeros(1300)
    assert f.decode(msg, _key(), out)
    inner = hvdcomp.get("alq:bits=5,bucket_size=512")
    inner.levels, inner.level_version = torch.from_numpy(f.levels.numpy().copy()), 4
    want = torch.zeros(1300)
    inner.decode(msg, _key(), want)
    assert torch.equal(out, want)
    # a receiver whose base holds another version refuses it
    other = second_stage(hvdcomp.get("alq:bits=3,bucket_size=512"))
    with pytest.raises(WireFormatError, match="level-table version mismatch: message has 4"):
        other.decode(msg, _key(), torch.zeros(1300))


@pytest.mark.parametrize("spec", ["qsgd:bits=3,bucket_size=512", "nuqsgd:bits=3,bucket_size=512",
                                  "alq:bits=3,bucket_size=8192", "qsgdinf:bits=2,bucket_size=64"])
def test_finer_variance_is_at_most_the_base_variance_and_unbiased(spec):
    c = hvdcomp.get(spec)
    f = second_stage(c)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3000, generator=g) * torch.rand(3000, generator=g) ** 4
    v, vf = c.variance(x), f.variance(x)
    assert 0 < vf < v
    # the family's own table at 5 (4) bits, which holds the base's
    assert set(c.levels.tolist()) <= set(f.levels.tolist())
    # Monte-Carlo over 400 Philox streams: the error's mean is the variance, and the
    # mean of the 400 results is off x by sum_i Var_i / 400 in squared norm (unbiased: no
    # bias term), within 5 standard errors
    k = 400
    ys = torch.stack([_round_trip(f, x, step) for step in range(k)]).double()
    err = ((ys - x.double()) ** 2).sum(1)
    assert abs(float(err.mean()) - vf) < 5 * float(err.std()) / math.sqrt(k)
    halves = [float((ys[i::2].mean(0) - x.double()).pow(2).sum()) for i in (0, 1)]
    for h in halves:        # each half: E = vf / (k/2); a bias b would add ||b||^2
        assert abs(h - vf / (k / 2)) < 0.35 * vf / (k / 2), (h, vf / (k / 2))


def _round_trip(comp, x, step):
    out = torch.zeros(x.numel())
    comp.decode(comp.encode(x, _key(step)), _key(step), out)
    return out
