"""The pieces kernels (kernels/quantize.cu: hvd_quantize_pack_pieces, hvd_dequantize_add_pieces;
the piece table of kernels/hvdcomp.cuh, section 4b) against two independent specifications,
bit for bit: the ops' PyTorch references, and the pieces done one call each (quantize_pack /
dequantize_add references, each piece with its own tensor id, from its own offset) — what
the reduce-scatter sent before the one-call path.  On the host at every SIMD level and with
1 and 3 threads (a piece whose stream a neighbour's block overwrote would show), and on a
GPU where there is one.
"""
import pytest
import torch

from hvdcomp.ops import quantize as Q
from hvdcomp.ops.bitpack import pack_bits
from hvdcomp.philox import uniform

from kernel_cases import KEY, gradient, tables

PKEY = {k: KEY[k] for k in ("seed", "rank", "step")}


def cuts(n, bs, count, seed):
    """``count`` spans of [0, n) cut at multiples of ``bs`` (some empty), as the
    reduce-scatter cuts a tensor among ``count`` ranks."""
    g = torch.Generator().manual_seed(seed)
    inner = sorted(bs * int(v) for v in torch.randint(0, n // bs + 1, (count - 1,), generator=g))
    c = [0] + inner + [n]
    return list(zip(c[:-1], c[1:]))


def one_by_one_pack(x, lv, bits, bs, spans, ids):
    """Each piece quantized on its own (its own bucket norms, uniforms of its tensor id from
    index 0), packed from its first byte: the per-piece path."""
    parts = []
    for (lo, hi), t in zip(spans, ids):
        xs = x[lo:hi]
        u = uniform(hi - lo, seed=PKEY["seed"], step=PKEY["step"], rank=PKEY["rank"],
                    tensor_id=t)
        norms, codes = Q.quantize_reference(xs, lv, bs, "l2", u)
        parts.append(pack_bits(codes, bits))
    return torch.cat(parts)


CASES = [(1, 1, 5), (10_253, 3, 4), (60_000, 100, 8), (20_000, 512, 64), (8192 * 3, 8192, 5),
         (4096, 8, 1)]


@pytest.fixture(params=[0, 1, 2, 3], ids=lambda v: f"simd{v}")
def level(request, host):
    if request.param > host.max_simd():
        pytest.skip(f"this CPU's best SIMD level is {host.max_simd()}")
    host.set_simd(request.param)
    yield request.param
    host.set_simd(None)


@pytest.fixture(params=[1, 3], ids=lambda v: f"threads{v}")
def threads(request, host):
    host.set_num_threads(request.param)
    yield request.param
    host.set_num_threads(None)


@pytest.mark.parametrize("bits", [2, 3, 5, 8])
def test_pieces_equal_the_pieces_one_by_one(host, level, threads, bits):
    be = host.backend
    lv = tables(bits)["fitted"]
    for n, bs, count in CASES:
        x = gradient(n, bs, seed=n + bits)
        spans = cuts(n, bs, count, seed=n + bs)
        ids = [1000 + 2 * k for k in range(len(spans))]
        norms = Q.bucket_norms.reference(x, bs, "l2")
        want = one_by_one_pack(x, lv, bits, bs, spans, ids)
        ref = Q.quantize_pack_pieces.reference(x, norms, lv, bits, bs, spans, ids, **PKEY)
        got = Q.quantize_pack_pieces.kernels(be, x, norms, lv, bits, bs, spans, ids, **PKEY)
        assert torch.equal(ref, want), (n, bs)
        assert torch.equal(got, want), (n, bs)
        # decode: every piece into its own part of a larger accumulator, with gaps
        nbytes, nbuckets = Q.piece_offsets(spans, bits, bs)
        pn = torch.cat([norms[lo // bs:lo // bs + (hi - lo + bs - 1) // bs]
                        for lo, hi in spans])
        assert pn.numel() == nbuckets[-1] and got.numel() == nbytes[-1]
        moved = [(lo + 5 * k, hi + 5 * k) for k, (lo, hi) in enumerate(spans)]
        base = torch.randn(n + 5 * len(spans), generator=torch.Generator().manual_seed(n))
        want_out = base.clone()
        for k, (lo, hi) in enumerate(moved):
            Q.dequantize_add.reference(got[nbytes[k]:nbytes[k + 1]], hi - lo,
                                       pn[nbuckets[k]:nbuckets[k + 1]], lv, bits, bs,
                                       want_out[lo:hi])
        ref_out = Q.dequantize_add_pieces.reference(got, pn, lv, bits, bs, moved, base.clone())
        got_out = Q.dequantize_add_pieces.kernels(be, got, pn, lv, bits, bs, moved,
                                                  base.clone())
        assert torch.equal(ref_out, want_out), (n, bs)
        assert torch.equal(got_out, want_out), (n, bs)


def test_no_pieces_and_empty_pieces(host):
    be = host.backend
    lv = tables(3)["uniform"]
    x = gradient(100, 10, seed=1)
    norms = Q.bucket_norms.reference(x, 10, "l2")
    for spans in ([], [(0, 0)], [(0, 0), (0, 100), (100, 100)]):
        ids = list(range(len(spans)))
        got = Q.quantize_pack_pieces.kernels(be, x, norms, lv, 3, 10, spans, ids, **PKEY)
        assert torch.equal(got, Q.quantize_pack_pieces.reference(x, norms, lv, 3, 10, spans,
                                                                 ids, **PKEY))
    out = torch.zeros(10)
    assert torch.equal(Q.dequantize_add_pieces.kernels(
        be, torch.empty(0, dtype=torch.uint8), torch.empty(0), lv, 3, 10, [], out), out)


def test_argument_checks(host):
    be = host.backend
    lv = tables(3)["uniform"]
    x = gradient(100, 10, seed=2)
    norms = Q.bucket_norms.reference(x, 10, "l2")
    for fn in (Q.quantize_pack_pieces.reference,
               lambda *a, **k: Q.quantize_pack_pieces.kernels(be, *a, **k)):
        with pytest.raises(ValueError, match="multiple of the bucket size"):
            fn(x, norms, lv, 3, 10, [(0, 15), (15, 100)], [1, 2], **PKEY)
        with pytest.raises(ValueError, match="lo must be in"):
            fn(x, norms, lv, 3, 10, [(0, 50), (40, 100)], [1, 2], **PKEY)   # overlap
        with pytest.raises(ValueError, match="hi must be in"):
            fn(x, norms, lv, 3, 10, [(0, 110)], [1], **PKEY)              # past x
        with pytest.raises(ValueError, match="tensor ids"):
            fn(x, norms, lv, 3, 10, [(0, 50), (50, 100)], [1], **PKEY)
        with pytest.raises(TypeError, match="pair"):
            fn(x, norms, lv, 3, 10, [5], [1], **PKEY)
    packed = Q.quantize_pack_pieces.kernels(be, x, norms, lv, 3, 10, [(0, 50), (50, 100)],
                                            [1, 2], **PKEY)
    for fn in (Q.dequantize_add_pieces.reference,
               lambda *a: Q.dequantize_add_pieces.kernels(be, *a)):
        with pytest.raises(ValueError):
            fn(packed[:-1], norms, lv, 3, 10, [(0, 50), (50, 100)], torch.zeros(100))
        with pytest.raises(ValueError):
            fn(packed, norms[:-1], lv, 3, 10, [(0, 50), (50, 100)], torch.zeros(100))
        with pytest.raises(ValueError):
            fn(packed, norms, lv, 3, 10, [(0, 50), (49, 99)], torch.zeros(100))  # overlap
        with pytest.raises(ValueError):
            fn(packed, norms, lv, 3, 10, [(0, 50), (60, 110)], torch.zeros(100))  # past out


@pytest.mark.requires_cuda
@pytest.mark.parametrize("bits", [3, 5])
def test_pieces_on_gpu(cuda_backend, bits):
    be = cuda_backend.backend
    lv = tables(bits)["fitted"]
    for n, bs, count in CASES:
        x = gradient(n, bs, seed=n + bits)
        spans = cuts(n, bs, count, seed=n + bs)
        ids = [1000 + 2 * k for k in range(len(spans))]
        norms = Q.bucket_norms.reference(x, bs, "l2")
        want = one_by_one_pack(x, lv, bits, bs, spans, ids)
        got = Q.quantize_pack_pieces.kernels(be, x.cuda(), norms.cuda(), lv.cuda(), bits, bs,
                                             spans, ids, **PKEY)
        assert torch.equal(got.cpu(), want), (n, bs)
        nbytes, nbuckets = Q.piece_offsets(spans, bits, bs)
        pn = torch.cat([norms[lo // bs:lo // bs + (hi - lo + bs - 1) // bs]
                        for lo, hi in spans])
        base = torch.randn(n, generator=torch.Generator().manual_seed(n))
        want_out = Q.dequantize_add_pieces.reference(want, pn, lv, bits, bs, spans, base.clone())
        got_out = Q.dequantize_add_pieces.kernels(be, got, pn.cuda(), lv.cuda(), bits, bs,
                                                  spans, base.cuda())
        assert torch.equal(got_out.cpu(), want_out), (n, bs)
