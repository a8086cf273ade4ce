"""The host build of kernels/*.cu (g++, hvdcomp.backends.host) against the PyTorch specification.

What is bit-exact, and what is not:
* Philox words and uniforms: bit-identical to hvdcomp.philox.
* Packed codes: byte-identical to pack_bits(quantize_reference(...) codes) GIVEN THE SAME
  NORMS (the kernel is run with the reference's norms).
* Decode: out + dequantize_reference(...), bit for bit, accumulated in place
  (hvdcomp.ops.quantize: the references of the ops whose kernels are tested here).
* L-inf norms: bit-identical (max is exact).
* L2 norms: the kernel sums the float64 squares in its own fixed order (set by bucket_size
  alone, identical on CPU and GPU); torch.sum uses another, which depends on PyTorch's
  vectorization.  Squares of float32 are exact in float64 and the partial sums of n
  non-negative terms carry a relative error below n * 2^-53 (~1e-12 for 8192), far below
  float32's 2^-24, so both round to the same float32 unless a rounding boundary falls
  between the two float64 sums: then they differ by exactly 1 ulp.  Asserted: at most 1 ulp
  everywhere; and since a difference is a ~1e-7-per-bucket event, no more than a handful
  (none occurs on the inputs of this file, on this machine).  End-to-end byte equality with
  the kernel's own norms therefore holds bucket by bucket wherever the norms agree.
"""
import numpy as np
import pytest
import torch

from hvdcomp import levels as L
from hvdcomp.ops.bitpack import pack_bits, unpack_bits
from hvdcomp.ops import quantize as Q
from hvdcomp.ops import philox_draws as R
from hvdcomp.ops.level_stats import bucket_stats
from hvdcomp.philox import random_words, uniform

from kernel_cases import (BITS, BUCKETS, KEY, NORMS, SIZES, gradient, on_levels, ref_decode_add,
                          ref_norms, reference, same_bits, tables, ulp_distance)


# ---- Philox ----------------------------------------------------------------------------------

@pytest.mark.parametrize("offset", [0, 1, 3, 4, 2**32 - 2, 4 * 2**32 - 5, 2**45 + 7])
def test_philox_words_and_uniforms_match_reference(host, offset):
    # offsets past 4 * 2**32 exercise the high counter word
    kw = dict(seed=0x1234_5678_9, step=2**32 + 5, rank=-1, tensor_id=77, offset=offset)
    for n in (1, 5, 1003):
        assert torch.equal(R.random_words.kernels(host.backend, n, **kw), random_words(n, **kw))
        assert torch.equal(R.uniform.kernels(host.backend, n, **kw), uniform(n, **kw))


# ---- norms -----------------------------------------------------------------------------------

@pytest.mark.parametrize("norm", NORMS)
def test_bucket_norms(host, norm):
    buckets = differ = 0
    for n in SIZES + (25_000,):
        for bs in BUCKETS:
            x = gradient(n, bs, seed=n * 31 + bs)
            got = Q.bucket_norms.kernels(host.backend, x, bs, norm)
            want = ref_norms(x, bs, norm)
            if norm == "linf":
                assert same_bits(got, want), (n, bs)
            else:
                d = ulp_distance(got, want)
                assert int(d.max()) <= 1, (n, bs, int(d.max()))
                buckets += d.numel()
                differ += int((d > 0).sum())
    # 1 ulp is the guarantee; a difference at all is a ~1e-7-per-bucket event (none was seen
    # on these inputs), so more than a handful means a wrong summation, not bad luck
    assert differ <= max(1, buckets // 10_000), (differ, buckets)


def test_norms_special_values(host):
    big = torch.full((10,), 3e38)                       # L2 overflows float32: +inf
    assert torch.equal(Q.bucket_norms.kernels(host.backend, big, 4, "l2"), ref_norms(big, 4, "l2"))
    tiny = torch.full((10,), 1e-45)                     # denormal squares are fine in float64
    assert torch.equal(Q.bucket_norms.kernels(host.backend, tiny, 4, "l2"),
                       ref_norms(tiny, 4, "l2"))
    z = torch.zeros(9)
    assert torch.equal(Q.bucket_norms.kernels(host.backend, z, 4, "l2"), torch.zeros(3))
    for norm in NORMS:                                  # NaN propagates as in torch
        x = torch.randn(20)
        x[13] = float("nan")
        x[2] = float("inf")
        assert same_bits(Q.bucket_norms.kernels(host.backend, x, 8, norm),
                         ref_norms(x, 8, norm)), norm


def test_norm_order_is_fixed_by_bucket_size_alone(host):
    # the reduction geometry comes from bucket_size only: thread count must not matter
    x = gradient(100_003, 8192, seed=5)
    host.set_num_threads(1)
    try:
        a = Q.bucket_norms.kernels(host.backend, x, 8192, "l2")
        host.set_num_threads(2)
        b = Q.bucket_norms.kernels(host.backend, x, 8192, "l2")
    finally:
        host.set_num_threads(None)
    assert torch.equal(a, b)


# ---- quantize + pack -------------------------------------------------------------------------

@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("norm", NORMS)
def test_quantize_pack_matches_reference_given_norms(host, bits, norm):
    for tname, lv in tables(bits).items():
        for n in SIZES:
            for bs in BUCKETS:
                x = gradient(n, bs, seed=bits * 1000 + n + bs)
                norms, codes, packed = reference(x, lv, bits, bs, norm)
                got = Q.quantize_pack.kernels(host.backend, x, norms, lv, bits, bs, **KEY)
                assert got.dtype == torch.uint8 and got.numel() == (n * bits + 7) // 8
                assert torch.equal(got, packed), (tname, n, bs)


@pytest.mark.parametrize("bits", BITS)
def test_values_exactly_on_levels(host, bits):
    # r == l_j exactly: p == 0 (never rounds up) or r == 1 (top level); Linf norm == 1
    for tname, lv in tables(bits).items():
        for bs in (8, 100, 4096):
            x = on_levels(lv, 4099, seed=bits)
            norms, codes, packed = reference(x, lv, bits, bs, "linf")
            got = Q.quantize_pack.kernels(host.backend, x, norms, lv, bits, bs, **KEY)
            assert torch.equal(got, packed), (tname, bs)


def test_key_words_are_taken_modulo_2_32(host):
    lv = tables(3)["uniform"]
    x = gradient(1000, 100, seed=1)
    key = dict(seed=-5, rank=2**32 + 1, tensor_id=-(2**40), step=2**33 + 9)
    u = uniform(1000, **key)
    norms, codes = Q.quantize_reference(x, lv, 100, "l2", u)
    assert torch.equal(Q.quantize_pack.kernels(host.backend, x, norms, lv, 3, 100, **key),
                       pack_bits(codes, 3))


def test_nonfinite_inputs_follow_torch(host):
    # The compressors never encode non-finite gradients (NaN policy); the kernel still
    # computes what the reference computes from the same norms.
    lv = tables(4)["exp0.5"]
    x = gradient(1000, 100, seed=2)
    x[10] = float("nan")
    x[20] = float("inf")
    x[333] = -float("inf")
    for norm in NORMS:
        norms, codes, packed = reference(x, lv, 4, 100, norm)
        got = Q.quantize_pack.kernels(host.backend, x, norms, lv, 4, 100, **KEY)
        assert torch.equal(got, packed), norm


def assert_same_codes_where_norms_agree(norms, packed, rn, codes, bits, bs):
    """The end-to-end claim with the kernel's own norms: norms within 1 ulp of torch's, and
    codes identical in every bucket whose norm is identical (in practice: all of them)."""
    n = codes.numel()
    assert int(ulp_distance(norms, rn).max()) <= 1
    same = (norms.view(torch.int32) == rn.view(torch.int32)).repeat_interleave(bs)[:n]
    assert float(same.float().mean()) > 0.99
    got = unpack_bits(packed, n, bits)
    assert torch.equal(got[same], codes[same])


def test_end_to_end_with_own_norms(host):
    # the quantize kernel computes its own norms (the kernel's fixed float64 order)
    for bits in (2, 3, 8):
        lv = tables(bits)["exp0.5"]
        for norm in NORMS:
            for n, bs in ((8193, 512), (100_001, 8192)):
                x = gradient(n, bs, seed=n + bits)
                norms, packed = Q.quantize.kernels(host.backend, x, lv, bits, bs, norm, **KEY)
                rn, codes, rp = reference(x, lv, bits, bs, norm)
                assert_same_codes_where_norms_agree(norms, packed, rn, codes, bits, bs)
                if torch.equal(norms, rn):          # (true for all of these inputs)
                    assert torch.equal(packed, rp)


def test_thread_count_does_not_change_bytes(host):
    lv = tables(3)["fitted"]
    x = gradient(300_001, 8192, seed=3)
    outs = []
    try:
        for t in (1, 2, 3):
            host.set_num_threads(t)
            outs.append(Q.quantize.kernels(host.backend, x, lv, 3, 8192, "l2", **KEY))
    finally:
        host.set_num_threads(None)
    for norms, packed in outs[1:]:
        assert torch.equal(norms, outs[0][0]) and torch.equal(packed, outs[0][1])


# ---- unpack + dequantize + accumulate ---------------------------------------------------------

@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("norm", NORMS)
def test_dequantize_add_matches_reference(host, bits, norm):
    for tname, lv in tables(bits).items():
        for n in SIZES:
            for bs in BUCKETS:
                x = gradient(n, bs, seed=bits * 7 + n + bs)
                norms, codes, packed = reference(x, lv, bits, bs, norm)
                out = torch.randn(n)
                want = ref_decode_add(out, norms, codes, lv, bits, bs)
                got = Q.dequantize_add.kernels(host.backend, packed, n, norms, lv, bits, bs, out)
                assert got is out
                assert same_bits(out, want), (tname, n, bs)


def test_decode_all_ranks_accumulates_in_rank_order(host):
    # decoding 4 ranks into one accumulator == ((0 + v0) + v1) + v2) + v3 of the reference
    bits, bs, n = 3, 512, 10_007
    lv = tables(bits)["fitted"]
    acc = torch.zeros(n)
    want = torch.zeros(n)
    for rank in range(4):
        key = dict(KEY, rank=rank)
        x = gradient(n, bs, seed=rank)
        norms, packed = Q.quantize.kernels(host.backend, x, lv, bits, bs, "l2", **key)
        Q.dequantize_add.kernels(host.backend, packed, n, norms, lv, bits, bs, acc)
        codes = unpack_bits(packed, n, bits)
        want = ref_decode_add(want, norms, codes, lv, bits, bs)
    assert same_bits(acc, want)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("n,bs", [(1, 1), (7, 3), (10_007, 512), (4097, 4096), (65_536, 8192)])
def test_decode_many_equals_one_by_one(host, bits, n, bs):
    # one pass over the accumulator for all ranks' messages == the reference's rank-order sum
    lv = tables(bits)["fitted"]
    acc = gradient(n, bs, seed=99)          # a non-zero accumulator: the order matters
    want = acc.clone()
    packed, norms = [], []
    for rank in range(5):
        x = gradient(n, bs, seed=rank + 10 * bits)
        nm, pk = Q.quantize.kernels(host.backend, x, lv, bits, bs, "l2", **dict(KEY, rank=rank))
        packed.append(pk)
        norms.append(nm)
        want = ref_decode_add(want, nm, unpack_bits(pk, n, bits), lv, bits, bs)
    Q.dequantize_add_many.kernels(host.backend, packed, n, norms, lv, bits, bs, acc)
    assert same_bits(acc, want)
    # no messages: nothing changes; mismatched lists are refused
    before = acc.clone()
    Q.dequantize_add_many.kernels(host.backend, [], n, [], lv, bits, bs, acc)
    assert same_bits(acc, before)
    with pytest.raises(ValueError):
        Q.dequantize_add_many.kernels(host.backend, packed, n, norms[:-1], lv, bits, bs, acc)


def test_matches_the_compressors_messages(host):
    # the drop-in equivalence quantizers.py relies on: same sections, same decoded sum
    import hvdcomp
    key = hvdcomp.TensorKey(name="w", tensor_id=5, step=3, rank=1, world_size=2, seed=9)
    grad = gradient(3 * 4099, 1000, seed=9).reshape(3, 4099)
    for spec in ("qsgd:bits=3,bucket_size=1000", "qsgdinf:bits=2,bucket_size=512",
                 "nuqsgd:bits=4,bucket_size=8192", "alq:bits=3,bucket_size=1000",
                 "amq:bits=5,bucket_size=777", "alq:bits=3,bucket_size=1000,norm=linf"):
        c = hvdcomp.get(spec)
        msg = c.encode(grad, key)
        norms, packed = Q.quantize.kernels(host.backend, grad.reshape(-1), c.levels, c.bits,
                                           c.bucket_size, c.norm, seed=key.seed, rank=key.rank,
                                           tensor_id=key.tensor_id, step=key.step)
        mnorms = torch.from_numpy(np.array(msg.sections[0]).view(np.float32))
        mpacked = torch.from_numpy(np.array(msg.sections[1]))
        if torch.equal(norms, mnorms):              # (true here; 1 ulp apart at worst)
            assert bytes(msg.sections[1]) == packed.numpy().tobytes(), spec
        else:
            assert_same_codes_where_norms_agree(
                norms, packed, mnorms, unpack_bits(mpacked, grad.numel(), c.bits), c.bits,
                c.bucket_size)
        # decoding the compressor's own message: bit for bit what decode adds
        out = torch.zeros(grad.numel())
        c.decode(msg, key, out)
        acc = Q.dequantize_add.kernels(host.backend, mpacked, grad.numel(), mnorms, c.levels,
                                       c.bits, c.bucket_size, torch.zeros(grad.numel()))
        assert same_bits(acc, out), spec


# ---- launchers: checks and edge cases ----------------------------------------------------------

def test_empty_tensor(host):
    lv = tables(3)["uniform"]
    x = torch.zeros(0)
    norms, packed = Q.quantize.kernels(host.backend, x, lv, 3, 8, "l2", **KEY)
    assert norms.numel() == 0 and packed.numel() == 0
    out = torch.zeros(0)
    assert Q.dequantize_add.kernels(host.backend, packed, 0, norms, lv, 3, 8, out).numel() == 0


def test_noncontiguous_and_grad_inputs_are_read_in_logical_order(host):
    lv = tables(3)["uniform"]
    base = gradient(2 * 1001, 100, seed=4)
    x = base[::2]                                      # a strided view
    xr = x.clone().requires_grad_(True)
    ref = Q.quantize.kernels(host.backend, x.contiguous(), lv, 3, 100, "l2", **KEY)
    for inp in (x, xr):
        got = Q.quantize.kernels(host.backend, inp, lv, 3, 100, "l2", **KEY)
        assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])


def test_argument_checks(host):
    lv = tables(3)["uniform"]
    x = torch.randn(100)
    norms = Q.bucket_norms.kernels(host.backend, x, 10, "l2")
    packed = Q.quantize_pack.kernels(host.backend, x, norms, lv, 3, 10, **KEY)
    with pytest.raises(TypeError, match="float32"):
        Q.bucket_norms.kernels(host.backend, x.double(), 10, "l2")
    with pytest.raises(ValueError, match="1-D"):
        Q.bucket_norms.kernels(host.backend, x.reshape(10, 10), 10, "l2")
    with pytest.raises(ValueError, match="norm"):
        Q.bucket_norms.kernels(host.backend, x, 10, "l1")
    with pytest.raises(ValueError, match="bucket_size"):
        Q.bucket_norms.kernels(host.backend, x, 0, "l2")
    with pytest.raises(TypeError, match="integer"):
        Q.bucket_norms.kernels(host.backend, x, 10.0, "l2")
    with pytest.raises(ValueError, match="bits"):
        Q.quantize_pack.kernels(host.backend, x, norms, lv, 9, 10, **KEY)
    with pytest.raises(TypeError, match="bool"):
        Q.quantize_pack.kernels(host.backend, x, norms, lv, True, 10, **KEY)
    with pytest.raises(ValueError, match="levels must have 8 elements"):
        Q.quantize_pack.kernels(host.backend, x, norms, lv, 4, 10, **KEY)
    with pytest.raises(ValueError, match="norms must have 10"):
        Q.quantize_pack.kernels(host.backend, x, norms[:-1], lv, 3, 10, **KEY)
    with pytest.raises(ValueError, match="packed must have"):
        Q.dequantize_add.kernels(host.backend, packed[:-1], 100, norms, lv, 3, 10,
                                 torch.zeros(100))
    with pytest.raises(ValueError, match="grad"):
        Q.dequantize_add.kernels(host.backend, packed, 100, norms, lv, 3, 10,
                                 torch.zeros(100, requires_grad=True))
    with pytest.raises(TypeError, match="uint8"):
        Q.dequantize_add.kernels(host.backend, packed.to(torch.int8), 100, norms, lv, 3, 10,
                                 torch.zeros(100))
    # an accumulator the kernel cannot write in place (strided, float64): the reference's
    for out in (torch.zeros(200)[::2], torch.zeros(100, dtype=torch.float64)):
        assert Q.dequantize_add.kernels(host.backend, packed, 100, norms, lv, 3, 10,
                                        out) is NotImplemented
        assert Q.dequantize_add_many.kernels(host.backend, [packed], 100, [norms], lv, 3, 10,
                                             out) is NotImplemented
        want = Q.dequantize_add.reference(packed, 100, norms, lv, 3, 10, out.clone())
        assert torch.equal(Q.dequantize_add(packed, 100, norms, lv, 3, 10, out), want)
    with pytest.raises(ValueError, match="offset"):
        R.uniform.kernels(host.backend, 4, seed=0, step=0, rank=0, tensor_id=0, offset=-1)


def test_bad_geometry_is_reported_not_silent(host):
    # a launcher bug (a non-power-of-two reduction block) must raise, never reorder the sum
    from hvdcomp.backends import host as h
    x = torch.randn(100)
    out = torch.empty(10)
    with pytest.raises(RuntimeError, match="blockDim"):
        h._HostBackend().launch("hvd_bucket_norms_l2", 10, 3, (x, 100, 10, out))
    with pytest.raises(RuntimeError, match="bits must be in 2..8"):
        h._HostBackend().launch("hvd_dequantize_add", 1, 32,
                                (torch.zeros(4, dtype=torch.uint8), 10, out, 10,
                                 torch.zeros(2), 1, torch.zeros(10)))


def test_cuda_tensors_are_refused(host):
    x = torch.randn(10, device="meta")
    with pytest.raises(ValueError, match="cpu"):
        Q.bucket_norms.kernels(host.backend, x, 4, "l2")


def test_levels_from_fitting_are_accepted(host):
    # ALQ's fitted tables come from float64 NumPy: the float32 cast the compressor keeps
    stats = bucket_stats.reference(gradient(20_000, 1000, seed=8), 1000, "l2").numpy()
    lv = torch.from_numpy(L.fit_alq(stats, 3).astype(np.float32))
    x = gradient(5000, 1000, seed=10)
    norms, codes, packed = reference(x, lv, 3, 1000, "l2")
    assert torch.equal(Q.quantize_pack.kernels(host.backend, x, norms, lv, 3, 1000, **KEY), packed)


# ---- backend selection (what the compressors call) -------------------------------------------

def test_kernel_backend_selection(host, monkeypatch):
    from hvdcomp import backends
    monkeypatch.setattr(backends, "_choice", {})
    monkeypatch.setenv("HVDCOMP_BACKEND", "reference")
    assert backends.kernel_backend("cpu") is None
    monkeypatch.setenv("HVDCOMP_BACKEND", "auto")
    assert backends.kernel_backend("cpu") is host
    monkeypatch.setenv("HVDCOMP_BACKEND", "kernels")
    assert backends.kernel_backend(torch.device("cpu")) is host
    monkeypatch.setenv("HVDCOMP_BACKEND", "fast")
    with pytest.raises(ValueError, match="HVDCOMP_BACKEND"):
        backends.kernel_backend("cpu")
    with pytest.raises(ValueError, match="no kernel backend"):
        backends.for_device("meta")


def test_kernel_backend_falls_back_loudly_or_raises(monkeypatch, caplog):
    from hvdcomp import backends
    monkeypatch.setattr(backends, "_choice", {})
    monkeypatch.setitem(__import__("sys").modules, "cupy", None)
    import hvdcomp.backends.cuda  # noqa: F401  (loaded, CuPy missing)
    monkeypatch.setenv("HVDCOMP_BACKEND", "auto")
    with caplog.at_level("WARNING", logger="hvdcomp"):
        assert backends.kernel_backend("cuda") is None
        assert backends.kernel_backend("cuda") is None        # decided once, no new warning
    warned = [r for r in caplog.records if r.name == "hvdcomp" and r.levelname == "WARNING"]
    assert len(warned) == 1 and "reference" in warned[0].getMessage(), caplog.records
    monkeypatch.setenv("HVDCOMP_BACKEND", "kernels")
    with pytest.raises(RuntimeError, match="HVDCOMP_BACKEND=kernels"):
        backends.kernel_backend("cuda")


def test_concurrent_launches_from_threads(host):
    # the exchange encodes and decodes on two threads at once: launches do not serialize and
    # each gets its own result (and its own error slot)
    import threading
    lv = tables(3)["fitted"]
    xs = [gradient(300_001 + k, 512, seed=k) for k in range(4)]
    want = [Q.quantize.kernels(host.backend, x, lv, 3, 512, "l2", **KEY) for x in xs]
    got, errors = [None] * 4, []

    def work(k):
        try:
            for _ in range(3):
                got[k] = Q.quantize.kernels(host.backend, xs[k], lv, 3, 512, "l2", **KEY)
            if k == 0:   # a failing launch on one thread does not fail the others
                with pytest.raises(RuntimeError, match="blockDim"):
                    host.backend.launch("hvd_bucket_norms_l2", 1, 100,
                                        (xs[0], xs[0].numel(), 512, torch.empty(1)))
        except BaseException as e:     # noqa: BLE001
            errors.append(e)
    ts = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors, errors
    for (n1, p1), (n2, p2) in zip(got, want):
        assert torch.equal(n1, n2) and torch.equal(p1, p2)
