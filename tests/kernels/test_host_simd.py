"""The host build's bulk paths against the PyTorch references, bit for bit, at every SIMD level
this CPU has and with several OpenMP threads.

On the host, the element-wise kernels (kernels/quantize.cu, dithered.cu, psq.cu, ternary.cu,
random.cu) do a whole block's groups in one loop, with Philox4x32-10 in SSE2, AVX2 or AVX-512
registers (kernels/hvdcomp.cuh, sections 1b and 5).  Level 0 runs the device code thread by
thread instead (what the GPU runs), 1 the baseline (SSE2 on x86-64), 2 AVX2, 3 AVX-512
(hvdcomp.backends.host.set_simd).  Every level must give the references' bits.  With several
threads the blocks are written concurrently, so a store that spilled into a neighbouring
block's bytes (a 1-bit or 2-bit packed stream, or a chunk's last groups) would show as wrong
bytes here; sizes span up to 30 blocks of 2048 coordinates, with odd ends and buckets smaller
than a group, equal to it, and not dividing it.
"""
import numpy as np
import pytest
import torch

from hvdcomp.ops.bitpack import pack_bits
from hvdcomp.compressors.base import TensorKey
from hvdcomp.ops import dithered as Dith
from hvdcomp.ops import psq as P
from hvdcomp.ops import quantize as Q
from hvdcomp.ops import philox_draws as R
from hvdcomp.ops import ternary as T
from hvdcomp.philox import random_words, uniform

from kernel_cases import KEY, gradient, ref_decode_add, same_bits, tables

SIZES = (1, 9, 1000, 10_253, 60_000)
BUCKETS = (1, 3, 8, 100, 512)
UKEY = {k: KEY[k] for k in ("seed", "step", "rank", "tensor_id")}


@pytest.fixture(params=[0, 1, 2, 3], ids=lambda v: f"simd{v}")
def level(request, host):
    if request.param > host.max_simd():
        pytest.skip(f"this CPU's best SIMD level is {host.max_simd()}")
    assert host.set_simd(request.param) == request.param
    assert host.simd_level() == request.param
    yield request.param
    host.set_simd(None)
    assert host.simd_level() == host.max_simd()


@pytest.fixture(params=[1, 3], ids=lambda v: f"threads{v}")
def threads(request, host):
    host.set_num_threads(request.param)
    yield request.param
    host.set_num_threads(None)


def test_set_simd_checks_its_argument(host):
    for bad in (-1, 4, 1.0, True, "2"):
        with pytest.raises(ValueError):
            host.set_simd(bad)
    assert host.simd_level() == host.max_simd()
    assert host.set_simd(None) == host.max_simd()


@pytest.mark.parametrize("offset", [0, 1, 3, 5, 2**32 * 4 - 7])
def test_philox_words_and_uniforms(host, level, threads, offset):
    kw = dict(seed=0x89ABCDEF, step=5, rank=3, tensor_id=2**32 - 1, offset=offset)
    for n in (1, 2, 5, 255, 257, 10_001):
        assert torch.equal(R.random_words.kernels(host.backend, n, **kw), random_words(n, **kw))
        assert torch.equal(R.uniform.kernels(host.backend, n, **kw), uniform(n, **kw))


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_quantize_pack_and_dequantize_add(host, level, threads, bits):
    be = host.backend
    lv = tables(bits)["fitted"]
    for n in SIZES:
        for bs in BUCKETS:
            x = gradient(n, bs, seed=n + 7 * bs + bits)
            u = uniform(n, **UKEY)
            norms, codes = Q.quantize_reference(x, lv, bs, "l2", u)
            packed = pack_bits(codes, bits)
            got = Q.quantize_pack.kernels(be, x, norms, lv, bits, bs, **KEY)
            assert torch.equal(got, packed), (n, bs)
            assert same_bits(Q.bucket_norms.kernels(be, x, bs, "linf"),
                             Q.bucket_norms.reference(
                                 torch.cat([x, x.new_zeros(-n % bs)]), bs, "linf")), (n, bs)
            out = torch.randn(n)
            want = ref_decode_add(out, norms, codes, lv, bits, bs)
            assert same_bits(Q.dequantize_add.kernels(be, packed, n, norms, lv, bits, bs,
                                                      out.clone()), want), (n, bs)
            # three messages added in order, as three single adds
            msgs = [Q.quantize_pack.kernels(be, x * (r + 1), norms * (r + 1), lv, bits, bs,
                                            seed=KEY["seed"], rank=r, tensor_id=3, step=7)
                    for r in range(3)]
            want = out.clone()
            for r, m in enumerate(msgs):
                Q.dequantize_add.reference(m, n, norms * (r + 1), lv, bits, bs, want)
            got = Q.dequantize_add_many.kernels(be, msgs, n, [norms * (r + 1) for r in range(3)],
                                                lv, bits, bs, out.clone())
            assert same_bits(got, want), (n, bs)


def test_l2_norms_equal_the_device_code(host, threads):
    # the L2 norms' order is the kernel's own (test_host.py bounds it against torch.sum):
    # every level gives the device code's bits
    be = host.backend
    for n in SIZES:
        for bs in BUCKETS + (8192, 3000):
            x = gradient(n, bs, seed=n * 3 + bs)
            host.set_simd(0)
            want = Q.bucket_norms.kernels(be, x, bs, "l2")
            for lvl in range(1, host.max_simd() + 1):
                host.set_simd(lvl)
                assert same_bits(Q.bucket_norms.kernels(be, x, bs, "l2"), want), (n, bs, lvl)
            host.set_simd(None)


def test_terngrad(host, level, threads):
    be = host.backend
    for n in SIZES:
        for bs in BUCKETS:
            x = gradient(n, bs, seed=n + bs)
            scales, t = T.terngrad_scales.reference(x, 2.5, bs)
            want = T.terngrad_pack.reference(x, scales, bs, t, **KEY)
            assert torch.equal(T.terngrad_pack.kernels(be, x, scales, bs, t, **KEY), want), \
                (n, bs)
            out = torch.randn(n)
            assert same_bits(T.terngrad_decode_add.kernels(be, want, n, scales, bs, out.clone()),
                             T.terngrad_decode_add.reference(want, n, scales, bs, out.clone())), \
                (n, bs)


@pytest.mark.parametrize("with_residual", [False, True])
def test_signef(host, level, threads, with_residual):
    # 1-bit stream: a group is one byte, a 4-byte store covers four groups
    be = host.backend
    for n in SIZES:
        for bs in BUCKETS:
            g = gradient(n, bs, seed=n * 5 + bs)
            e = gradient(n, bs, seed=n * 7 + bs) * 0.25 if with_residual else None
            s = T.signef_scales.reference(g, e, bs)
            bits_r, e_r = T.signef_pack.reference(g, None if e is None else e.clone(), s, bs)
            e_in = None if e is None else e.clone()
            bits, e_new = T.signef_pack.kernels(be, g, e_in, s, bs, e_out=e_in)
            assert torch.equal(bits, bits_r), (n, bs)
            assert same_bits(e_new, e_r), (n, bs)
            out = torch.randn(n)
            assert same_bits(T.signef_decode_add.kernels(be, bits_r, n, s, bs, out.clone()),
                             T.signef_decode_add.reference(bits_r, n, s, bs, out.clone())), \
                (n, bs)


@pytest.mark.parametrize("bits", [2, 4])
def test_dithered(host, level, threads, bits):
    # nested residues of 1 .. bits-1 bits: 1-bit and 3-bit streams too
    be = host.backend
    tk = TensorKey("w", 3, 7, 2, 4, 11)
    for n in SIZES:
        for bs in BUCKETS:
            x = gradient(n, bs, seed=n + 3 * bs)
            delta = Dith.bucket_steps.reference(x, bits, bs)
            q = Dith.dqsg_quantize(x, delta, bits, bs, Dith.dither(n, tk))
            M = (1 << (bits - 1)) - 1
            packed = pack_bits(q + M, bits)
            assert torch.equal(Dith.dqsg_encode.kernels(be, x, delta, bits, bs, tk), packed), \
                (n, bs)
            for nb in range(1, bits):
                got = Dith.nested_encode.kernels(be, x, delta, bits, nb, bs, tk)[0]
                assert torch.equal(got, pack_bits(q & ((1 << nb) - 1), nb)), (n, bs, nb)
            out = torch.randn(n)
            want = out + Dith.dqsg_reconstruct(delta, q, Dith.dither(n, tk), bs)
            got = Dith.dqsg_decode_add.kernels(be, packed, n, delta, bits, bs, out.clone(), tk)
            assert same_bits(got, want), (n, bs)


@pytest.mark.parametrize("bits", [2, 3, 6, 8])
def test_uniform_rounding(host, level, threads, bits):
    # uniformef's nearest rounding (no dither): codes and residuals, and the decode
    be = host.backend
    for n in SIZES:
        for bs in BUCKETS:
            x = gradient(n, bs, seed=n + 5 * bs + bits)
            delta = Dith.variance_steps(x, bits, bs, 0.04)
            packed, residual = Dith.uniform_encode.reference(x, delta, bits, bs)
            got_p, got_r = Dith.uniform_encode.kernels(be, x, delta, bits, bs)
            assert torch.equal(got_p, packed), (n, bs)
            assert same_bits(got_r, residual), (n, bs)
            out = torch.randn(n)
            want = Dith.uniform_decode_add.reference(packed, n, delta, bits, bs, out.clone())
            got = Dith.uniform_decode_add.kernels(be, packed, n, delta, bits, bs, out.clone())
            assert same_bits(got, want), (n, bs)


@pytest.mark.parametrize("width", [1, 2, 3, 6, 8])
def test_validate_codes(host, level, threads, width):
    # the received codes' checks (DQSG, NDQSG's residues, uniformef): per code > max_code,
    # and a code other than zero_code in a bucket of step 0
    be = host.backend
    g = torch.Generator().manual_seed(width)
    top = (1 << width) - 1
    for n in SIZES:
        for bs in BUCKETS:
            nb = (n + bs - 1) // bs
            delta = torch.rand(nb, generator=g) + 0.1
            delta[::3] = 0.0
            zero_code, max_code = top // 2, top - 1
            codes = torch.randint(0, top, (n,), generator=g)
            zero = Dith.per_coordinate(delta == 0, bs, n)
            codes[zero] = zero_code
            cases = [codes]
            for at in (0, n // 2, n - 1):
                bad = codes.clone()
                bad[at] = top                                 # above max_code
                cases.append(bad)
                if zero[at]:
                    off = codes.clone()
                    off[at] = (zero_code + 1) % (max_code + 1)    # valid, but in a zero bucket
                    cases.append(off)
            for c in cases:
                packed = pack_bits(c, width)
                want = Dith.validate_codes.reference(packed, n, delta, bs, width, zero_code,
                                                     max_code)
                got = Dith.validate_codes.kernels(be, packed, n, delta, bs, width, zero_code,
                                                  max_code)
                assert got == want, (n, bs)
            assert Dith.validate_codes.kernels(be, pack_bits(cases[1], width), n, delta, bs,
                                               width, zero_code, max_code)[0]


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 8])
def test_psq(host, level, threads, bits):
    be = host.backend
    for R_, D in ((1, 1), (3, 5), (7, 8), (13, 100), (40, 1500), (3, 20_001)):
        g = torch.Generator().manual_seed(R_ * 31 + D + bits)
        x = (torch.randn(R_, D, generator=g) * torch.exp(torch.randn(R_, 1, generator=g)))
        x[0, ::3] = 0.0
        lohi_r, codes = P.round_rows(x, bits, uniform(R_ * D, **UKEY))
        lohi, packed = P.quantize_rows.kernels(be, x, bits, **KEY)
        assert torch.equal(packed, pack_bits(codes, bits)), (R_, D)
        out = torch.randn(R_ * D)
        want = out + P.dequantize_rows(lohi_r, codes, bits).to(torch.float32).reshape(-1)
        assert same_bits(P.dequantize_add.kernels(be, packed, R_, D, lohi, bits, out.clone()),
                         want), (R_, D)


def test_levels_give_the_same_bytes_on_a_large_input(host, threads):
    # one 3-bit ALQ-like encode of 300,001 coordinates (147 blocks) at every level
    be = host.backend
    n, bs = 300_001, 8192
    x = gradient(n, bs, seed=99)
    lv = tables(3)["fitted"]
    norms = Q.bucket_norms.kernels(be, x, bs, "l2")
    codes = Q._codes(x, norms, lv, bs, uniform(n, **UKEY))      # against the kernel's norms
    want = pack_bits(codes, 3)
    assert np.unique(want.numpy()).size > 100                     # not a degenerate stream
    for lvl in range(host.max_simd() + 1):
        host.set_simd(lvl)
        assert torch.equal(Q.quantize_pack.kernels(be, x, norms, lv, 3, bs, **KEY), want), lvl
    host.set_simd(None)
