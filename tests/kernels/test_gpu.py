"""The CuPy backend (hvdcomp.backends.cuda) on a GPU, against the PyTorch specification run on
the same GPU and against the host build of the same sources.

Skipped with the reason where there is no CUDA device or no CuPy (conftest.py); with
HVDCOMP_REQUIRE_GPU=1 (launch/gpu-check) a missing GPU fails instead.

Claims checked: packed codes byte-identical to pack_bits(quantize_reference codes) given the
same norms; decode-accumulate bit-identical to out + dequantize_reference; Philox identical;
L-inf norms identical to torch; L2 norms bit-identical to the HOST BUILD's (same fixed
float64 order) and within 1 float32 ulp of torch.sum's; launches ordered on PyTorch's
current stream; 64-bit indexing past 2**31 elements.
"""
import pytest
import torch

from hvdcomp.ops.bitpack import unpack_bits
from hvdcomp.ops import quantize as Q
from hvdcomp.ops import philox_draws as R
from hvdcomp.philox import random_words, uniform

from kernel_cases import (BITS, BUCKETS, KEY, NORMS, SIZES, gradient, on_levels, ref_decode_add,
                          ref_norms, reference, same_bits, tables, ulp_distance)

pytestmark = pytest.mark.requires_cuda
DEV = "cuda"


def test_philox_on_gpu(cuda_backend):
    for offset in (0, 3, 4 * 2**32 - 5, 2**45 + 7):
        kw = dict(seed=0x1_2345_6789, step=2**32 + 5, rank=-1, tensor_id=77, offset=offset)
        for n in (1, 5, 100_003):
            got = R.random_words.kernels(cuda_backend.backend, n, device=DEV, **kw)
            assert got.is_cuda
            assert torch.equal(got.cpu(), random_words(n, **kw))
            assert torch.equal(R.uniform.kernels(cuda_backend.backend, n, device=DEV, **kw).cpu(),
                               uniform(n, **kw))


@pytest.mark.parametrize("norm", NORMS)
def test_norms_on_gpu(cuda_backend, maybe_host, norm):
    for n in SIZES + (25_000, 1_000_003):
        for bs in BUCKETS + (8192 * 3,):
            x = gradient(n, bs, seed=n * 31 + bs)
            got = Q.bucket_norms.kernels(cuda_backend.backend, x.to(DEV), bs, norm).cpu()
            if maybe_host is not None:                                      # one order
                want = Q.bucket_norms.kernels(maybe_host.backend, x, bs, norm)
                assert same_bits(got, want), (n, bs)
            want = ref_norms(x.to(DEV), bs, norm).cpu()
            if norm == "linf":
                assert same_bits(got, want), (n, bs)
            else:
                assert int(ulp_distance(got, want).max()) <= 1, (n, bs)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("norm", NORMS)
def test_quantize_and_decode_on_gpu(cuda_backend, maybe_host, bits, norm):
    for tname, lv_cpu in tables(bits).items():
        lv = lv_cpu.to(DEV)
        for n in SIZES + (100_003,):
            for bs in BUCKETS:
                x = gradient(n, bs, seed=bits * 1000 + n + bs).to(DEV)
                norms, codes, packed = reference(x, lv, bits, bs, norm)   # torch on the GPU
                got = Q.quantize_pack.kernels(cuda_backend.backend, x, norms, lv, bits, bs, **KEY)
                assert got.is_cuda and torch.equal(got, packed), (tname, n, bs)
                if maybe_host is not None:   # the host build: same bytes from the same norms
                    assert torch.equal(got.cpu(), Q.quantize_pack.kernels(
                        maybe_host.backend, x.cpu(), norms.cpu(), lv_cpu, bits, bs, **KEY))
                out = torch.randn(n, device=DEV)
                want = ref_decode_add(out, norms, codes, lv, bits, bs)
                Q.dequantize_add.kernels(cuda_backend.backend, got, n, norms, lv, bits, bs, out)
                assert same_bits(out.cpu(), want.cpu()), (tname, n, bs)


@pytest.mark.parametrize("bits", (2, 3, 8))
def test_values_on_levels_on_gpu(cuda_backend, bits):
    for tname, lv_cpu in tables(bits).items():
        lv = lv_cpu.to(DEV)
        x = on_levels(lv_cpu, 4099, seed=bits).to(DEV)
        norms, codes, packed = reference(x, lv, bits, 100, "linf")
        got = Q.quantize_pack.kernels(cuda_backend.backend, x, norms, lv, bits, 100, **KEY)
        assert torch.equal(got, packed), tname


def test_end_to_end_gpu_equals_host(cuda_backend, maybe_host):
    host = maybe_host
    if host is None:
        pytest.skip("no host build here (no C++ compiler)")
    lv_cpu = tables(3)["fitted"]
    x = gradient(3_000_017, 8192, seed=12)
    for norm in NORMS:
        gn, gp = Q.quantize.kernels(cuda_backend.backend, x.to(DEV), lv_cpu.to(DEV), 3, 8192,
                                    norm, **KEY)
        hn, hp = Q.quantize.kernels(host.backend, x, lv_cpu, 3, 8192, norm, **KEY)
        assert torch.equal(gn.cpu(), hn) and torch.equal(gp.cpu(), hp), norm
        acc_g = torch.zeros(x.numel(), device=DEV)
        acc_h = torch.zeros(x.numel())
        for r in range(3):
            Q.dequantize_add.kernels(cuda_backend.backend, gp, x.numel(), gn, lv_cpu.to(DEV), 3,
                                     8192, acc_g)
            Q.dequantize_add.kernels(host.backend, hp, x.numel(), hn, lv_cpu, 3, 8192, acc_h)
        assert same_bits(acc_g.cpu(), acc_h)


def test_launches_are_ordered_on_torchs_current_stream(cuda_backend):
    # y is written on a side stream behind a long sleep; kernels launched on any other stream
    # would read it before it is written
    lv_cpu = tables(3)["uniform"]
    lv = lv_cpu.to(DEV)
    x = torch.randn(1 << 22, device=DEV)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        torch.cuda._sleep(200_000_000)
        y = x * 2.0
        norms, packed = Q.quantize.kernels(cuda_backend.backend, y, lv, 3, 8192, "l2", **KEY)
        acc = torch.zeros_like(y)
        Q.dequantize_add.kernels(cuda_backend.backend, packed, y.numel(), norms, lv, 3, 8192, acc)
        total = acc.sum()
    s.synchronize()
    # the same calls after everything is done, on the default stream
    n2, p2 = Q.quantize.kernels(cuda_backend.backend, y, lv, 3, 8192, "l2", **KEY)
    assert torch.equal(norms, n2) and torch.equal(packed, p2)
    acc2 = torch.zeros_like(y)
    Q.dequantize_add.kernels(cuda_backend.backend, p2, y.numel(), n2, lv, 3, 8192, acc2)
    assert same_bits(acc, acc2) and torch.equal(total, acc2.sum())


def test_grad_and_strided_inputs_on_gpu(cuda_backend):
    lv = tables(3)["uniform"].to(DEV)
    base = torch.randn(2 * 10_001, device=DEV)
    ref = Q.quantize.kernels(cuda_backend.backend, base[::2].contiguous(), lv, 3, 100, "l2", **KEY)
    for inp in (base[::2], base[::2].clone().requires_grad_(True)):
        got = Q.quantize.kernels(cuda_backend.backend, inp, lv, 3, 100, "l2", **KEY)
        assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    with pytest.raises(ValueError, match="cuda"):
        Q.bucket_norms.kernels(cuda_backend.backend, torch.randn(10), 4, "l2")


def test_past_2_31_elements(cuda_backend):
    # 64-bit indices: the tail of a 2**31 + 9 element gradient against the reference on the
    # same tail (bucket- and byte-aligned start, Philox uniforms at the right offset)
    free, _ = torch.cuda.mem_get_info()
    if free < 48 * 2**30:
        pytest.skip(f"needs 48 GiB of free GPU memory, {free / 2**30:.0f} GiB free")
    n, bits, bs = 2**31 + 9, 3, 8192
    lv = tables(bits)["fitted"].to(DEV)
    x = torch.randn(n, device=DEV)
    norms, packed = Q.quantize.kernels(cuda_backend.backend, x, lv, bits, bs, "l2", **KEY)
    out = torch.zeros(n, device=DEV)
    Q.dequantize_add.kernels(cuda_backend.backend, packed, n, norms, lv, bits, bs, out)
    start = (n - 100_000) // bs * bs
    tail = x[start:].clone()
    u = uniform(tail.numel(), seed=KEY["seed"], step=KEY["step"], rank=KEY["rank"],
                tensor_id=KEY["tensor_id"], offset=start, device=DEV)
    rn, codes = Q.quantize_reference(tail, lv, bs, "l2", u)
    tn = norms[start // bs:]
    assert int(ulp_distance(rn.cpu(), tn.cpu()).max()) <= 1
    codes_k = unpack_bits(packed[start * bits // 8:], tail.numel(), bits)
    if torch.equal(rn, tn):
        assert torch.equal(codes_k, codes)
    want = Q.dequantize_reference(tn, codes_k, lv, bs, bits - 1)
    assert same_bits(out[start:].cpu(), (torch.zeros_like(want) + want).cpu())
    del x, out


def test_decode_many_matches_reference_on_gpu():
    from hvdcomp.backends import cuda
    from kernel_cases import gradient, ref_decode_add, same_bits, tables, KEY
    from hvdcomp.ops.bitpack import unpack_bits
    bits, bs, n = 3, 512, 100_003
    lv = tables(bits)["fitted"]
    acc = torch.zeros(n)
    packed, norms = [], []
    for rank in range(4):
        x = gradient(n, bs, seed=rank)
        nm, pk = Q.quantize.kernels(cuda.backend, x.cuda(), lv.cuda(), bits, bs, "linf",
                                    **dict(KEY, rank=rank))
        packed.append(pk)
        norms.append(nm)
        acc = ref_decode_add(acc, nm.cpu(), unpack_bits(pk.cpu(), n, bits), lv, bits, bs)
    got = Q.dequantize_add_many.kernels(cuda.backend, packed, n, norms, lv.cuda(), bits, bs,
                                        torch.zeros(n).cuda())
    assert same_bits(got.cpu(), acc)
