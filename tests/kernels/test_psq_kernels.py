"""PSQ and BHQ kernels (kernels/psq.cu, the kernel side of the ops in hvdcomp/ops/psq.py)
against their PyTorch references (the specification), bit for bit: the host build here, the
CUDA backend on a GPU (tests marked requires_cuda), and end to end through the compressors
(kernel path vs HVDCOMP_BACKEND=reference: identical message bytes and decoded sums).
"""
import numpy as np
import pytest
import torch

import hvdcomp
import hvdcomp.backends as B
from hvdcomp.ops.bitpack import pack_bits, unpack_bits
from hvdcomp.compressors.base import TensorKey
from hvdcomp.ops import psq
from hvdcomp.ops.psq import bhq_plan, dequantize_rows, householder_blocks, lohi_of, round_rows
from hvdcomp.philox import uniform
from hvdcomp.wire import Message

from kernel_cases import KEY, same_bits

SHAPES = ((1, 1), (1, 7), (3, 1), (2, 9), (7, 3), (13, 64), (5, 1001), (129, 17))


def matrix(R, D, seed, kind="mixed"):
    """float32 (R, D): heavy tails, ±0, denormals, a constant row, an all-zero row, huge."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(R, D, generator=g) * torch.exp(2.0 * torch.randn(R, D, generator=g))
    if kind == "mixed":
        f = x.view(-1)
        f[::7] = 0.0
        f[3::11] = -0.0
        f[5::13] *= 1e-39
        if R > 2:
            x[1] = 0.0                      # span 0, all zero
            x[2] = -2.5                     # span 0, constant
        if R > 4:
            x[3] *= 1e30                    # large range
            x[4, ::2] = -0.0
    return x.contiguous()


def plan(mode, x, bits, block_size):
    """bhq_plan (a composition of ops) with HVDCOMP_BACKEND = ``mode``."""
    with B.use(mode):
        return bhq_plan(x, bits, block_size)


def _u(n, key=KEY):
    return uniform(n, seed=key["seed"], step=key["step"], rank=key["rank"],
                   tensor_id=key["tensor_id"])


# ---- kernels vs the reference functions (host) ------------------------------------------------

@pytest.mark.parametrize("bits", range(1, 9))
def test_quantize_and_dequantize_rows(host, bits):
    be = host.backend
    for R, D in SHAPES:
        x = matrix(R, D, seed=bits * 100 + R * 7 + D)
        lohi_r, codes = round_rows(x, bits, _u(R * D))
        lohi, packed = psq.quantize_rows.kernels(be, x, bits, **KEY)
        assert same_bits(lohi, lohi_r), (R, D)
        assert torch.equal(packed, pack_bits(codes, bits)), (R, D)
        out = torch.randn(R * D)
        want = out + dequantize_rows(lohi_r, codes, bits).to(torch.float32).reshape(-1)
        psq.dequantize_add.kernels(be, packed, R, D, lohi, bits, out)
        assert same_bits(out, want), (R, D)


def test_rows_at_the_grid_and_range_ends(host):
    # coordinates exactly on grid points (r - floor(r) == 0) and at min / max of each row
    be = host.backend
    for bits in (1, 2, 4, 8):
        L = (1 << bits) - 1
        g = torch.Generator().manual_seed(bits)
        idx = torch.randint(0, L + 1, (9, 40), generator=g).to(torch.float32)
        idx[:, 0], idx[:, 1] = 0.0, float(L)
        x = (idx / L * 3.0 - 1.0).contiguous()
        lohi_r, codes = round_rows(x, bits, _u(x.numel()))
        assert torch.equal(psq.quantize_rows.kernels(be, x, bits, **KEY)[1], pack_bits(codes, bits))


def test_row_variance_terms(host):
    be = host.backend
    for bits in (1, 3, 8):
        for R, D in SHAPES:
            x = matrix(R, D, seed=bits + R + D)
            rows = torch.randperm(R, generator=torch.Generator().manual_seed(R))
            xb = x[rows]
            got = psq.row_variance.kernels(be, x, bits, rows, lohi_of(xb))
            assert torch.equal(got, psq.row_variance.reference(xb, bits)), (R, D)


@pytest.mark.parametrize("block_size", (1, 2, 3, 8, 64))
def test_householder_forward_and_plan(host, block_size):
    be = host.backend
    for bits in (1, 2, 4, 8):
        for R, D in SHAPES + ((200, 9), (33, 1)):
            x = matrix(R, D, seed=block_size * 1000 + R + D + bits, kind="plain")
            x[::3] *= 1e-3                                  # ranges that differ a lot
            ref = plan("reference", x, bits, block_size)
            got = plan("kernels", x, bits, block_size)
            for a, b in zip(ref[:3], got[:3]):
                assert torch.equal(a, b), (R, D)
            assert same_bits(got[3], ref[3]), (R, D)
            assert got[4] == ref[4] or abs(got[4] - ref[4]) <= 1e-12 * abs(ref[4])
            # the transform kernel on the plan's blocks, alone
            perm, sizes, scales = ref[:3]
            want = householder_blocks(x[perm].double(), sizes, scales, False).float()
            assert same_bits(psq.householder_forward.kernels(be, x, perm, sizes, scales), want)


def test_bhq_plan_uses_transforms(host):
    # rows of very different ranges: the plan keeps blocks (the kernel path is exercised)
    x = torch.randn(64, 50)
    x[::8] *= 1000.0
    perm, sizes, scales, y, _ = plan("kernels", x, 2, 8)
    assert int((sizes > 1).sum()) > 0
    ref = plan("reference", x, 2, 8)
    assert torch.equal(sizes, ref[1]) and same_bits(y, ref[3])


@pytest.mark.parametrize("bits", (1, 3, 8))
def test_bhq_dequantize_add(host, bits):
    be = host.backend
    for block_size in (1, 3, 8):
        for R, D in SHAPES + ((64, 50),):
            x = matrix(R, D, seed=bits * 10 + block_size + R + D)
            x[::4] *= 1000.0
            perm, sizes, scales, y, _ = bhq_plan(x, bits, block_size)
            lohi, codes = round_rows(y, bits, _u(y.numel()))
            yhat = dequantize_rows(lohi, codes, bits)
            xhat = householder_blocks(yhat, sizes, scales, inverse=True).to(torch.float32)
            full = torch.empty_like(xhat)
            full[perm] = xhat
            out = torch.randn(R * D)
            want = out + full.reshape(-1)
            psq.bhq_dequantize_add.kernels(be, pack_bits(codes, bits), R, D, lohi, bits, perm,
                                           sizes, scales, out)
            assert same_bits(out, want), (R, D, block_size)


def test_argument_checks(host):
    be = host.backend
    x = torch.randn(4, 5)
    with pytest.raises(ValueError):
        psq.quantize_rows.kernels(be, x, 0, **KEY)
    with pytest.raises(ValueError):
        psq.quantize_rows.kernels(be, x, 9, **KEY)
    with pytest.raises(TypeError):
        psq.quantize_rows.kernels(be, x.double(), 3, **KEY)
    with pytest.raises(ValueError):
        psq.quantize_rows.kernels(be, x.reshape(-1), 3, **KEY)
    with pytest.raises(ValueError):
        psq.dequantize_add.kernels(be, torch.zeros(3, dtype=torch.uint8), 4, 5, lohi_of(x), 3,
                             torch.zeros(20))
    assert psq.quantize_rows.kernels(be, torch.zeros(0, 3), 3, **KEY)[1].numel() == 0


def test_block_argument_checks(host):
    """The BHQ ops check the indices their kernels follow (issue #15): a perm that is not a
    permutation (or rows out of range), block sizes that do not cover the rows, one scale
    per block; ValueError on both paths, never an out-of-bounds access."""
    be = host.backend
    x = matrix(6, 5, seed=3)
    perm, sizes, scales, y, _ = bhq_plan(x, 3, 3)
    lohi, codes = round_rows(y, 3, _u(y.numel()))
    packed = pack_bits(codes, 3)
    bad = [(torch.full_like(perm, 6), sizes, scales),                 # rows out of range
           (torch.cat([perm[:-1], perm[:1]]), sizes, scales),        # a row twice
           (perm, torch.cat([sizes, sizes[:1]]), torch.cat([scales, scales[:1]])),
           (perm, sizes.clamp(max=0), scales), (perm, sizes, scales[:-1])]
    for p, sz, sc in bad:
        for run in (lambda *a: psq.bhq_dequantize_add.kernels(be, *a),
                    psq.bhq_dequantize_add.reference):
            with pytest.raises(ValueError):
                run(packed, 6, 5, lohi, 3, p, sz, sc, torch.zeros(30))
    with pytest.raises(ValueError, match="rows in"):
        psq.householder_forward.kernels(be, x, perm + 1, sizes, scales)
    with pytest.raises(ValueError, match="rows must be in"):
        psq.row_variance.kernels(be, x, 3, perm - 1)


# ---- end to end through the compressors ------------------------------------------------------

def _use(monkeypatch, mode):
    monkeypatch.setenv("HVDCOMP_BACKEND", mode)
    B._choice.clear()


def _roundtrip(spec, grads, monkeypatch, mode, device="cpu"):
    _use(monkeypatch, mode)
    c = hvdcomp.get(spec)
    world = len(grads)
    keys = [TensorKey("w", 3, 7, r, world, 11) for r in range(world)]
    msgs = [c.encode(g, k) for g, k in zip(grads, keys)]
    wire = [m.to_bytes() for m in msgs]
    acc = torch.zeros(grads[0].numel(), device=device)
    finite = c.combine([Message.from_bytes(w) for w in wire], keys, acc)
    assert finite == all(bool(torch.isfinite(g).all()) for g in grads)
    return wire, acc.cpu()


GRADS = [
    ("1-D", lambda: matrix(1, 1000, 1).reshape(-1)),
    ("0-D", lambda: torch.tensor(2.5)),
    ("empty", lambda: torch.zeros(0, 4)),
    ("conv", lambda: matrix(12, 3 * 3 * 5, 2).reshape(12, 5, 3, 3)),
    ("transposed", lambda: matrix(40, 30, 3).t()),
    ("half", lambda: matrix(17, 19, 4, "plain").half()),
    ("bfloat16", lambda: matrix(9, 33, 5, "plain").bfloat16()),
    ("float64", lambda: matrix(8, 21, 6).double()),
    ("ranges", lambda: (torch.randn(64, 50) * torch.logspace(-3, 3, 64).unsqueeze(1))),
]


@pytest.mark.parametrize("spec", ["psq:bits=1", "psq:bits=4", "psq:bits=8",
                                  "psq:bits=3,entropy=True", "bhq:bits=2,block_size=8",
                                  "bhq:bits=4,block_size=3", "bhq:bits=8,block_size=1",
                                  "bhq:bits=3,block_size=16,entropy=True"])
@pytest.mark.parametrize("name,make", GRADS, ids=[g[0] for g in GRADS])
def test_compressor_kernels_equal_reference(monkeypatch, host, spec, name, make):
    grads = [make(), make() * -0.5]
    want = _roundtrip(spec, grads, monkeypatch, "reference")
    got = _roundtrip(spec, grads, monkeypatch, "kernels")
    assert got[0] == want[0], name
    assert same_bits(got[1], want[1]), name


@pytest.mark.parametrize("spec", ["psq:bits=4", "bhq:bits=4,block_size=8"])
def test_nonfinite_and_cross_decode(monkeypatch, host, spec):
    # NaN -> NONFINITE either way; a kernel-made message decodes on the reference path
    g = torch.randn(10, 10)
    g[3, 3] = float("nan")
    assert (_roundtrip(spec, [g], monkeypatch, "kernels")[0]
            == _roundtrip(spec, [g], monkeypatch, "reference")[0])
    x = torch.randn(30, 20)
    key = TensorKey("w", 0, 1, 0, 1, 5)
    _use(monkeypatch, "kernels")
    msg = hvdcomp.get(spec).encode(x, key)
    acc_k = torch.zeros(600)
    hvdcomp.get(spec).decode(msg, key, acc_k)
    _use(monkeypatch, "reference")
    acc_r = torch.zeros(600)
    hvdcomp.get(spec).decode(msg, key, acc_r)
    assert same_bits(acc_k, acc_r)


def test_reference_mode_never_launches(monkeypatch, host):
    _use(monkeypatch, "reference")

    def boom(*a, **k):
        raise AssertionError("kernel launched in reference mode")
    monkeypatch.setattr(host.backend, "launch", boom)
    _roundtrip("bhq:bits=3", [torch.randn(16, 8)], monkeypatch, "reference")


def test_large(monkeypatch, host):
    x = torch.randn(300, 3001) * torch.logspace(-2, 2, 300).unsqueeze(1)
    for spec in ("psq:bits=3", "bhq:bits=3,block_size=8"):
        assert (_roundtrip(spec, [x], monkeypatch, "kernels")
                [0] == _roundtrip(spec, [x], monkeypatch, "reference")[0])


# ---- GPU ----------------------------------------------------------------------------------------

@pytest.mark.requires_cuda
@pytest.mark.parametrize("bits", (1, 3, 8))
def test_psq_kernels_on_gpu(cuda_backend, maybe_host, bits):
    be = cuda_backend.backend
    for R, D in SHAPES + ((300, 3001),):
        x = matrix(R, D, seed=bits + R + D).cuda()
        lohi_r, codes = round_rows(x, bits, _u(R * D).cuda())
        lohi, packed = psq.quantize_rows.kernels(be, x, bits, **KEY)
        assert torch.equal(packed, pack_bits(codes, bits))
        if maybe_host is not None:
            on_host = psq.quantize_rows.kernels(maybe_host.backend, x.cpu(), bits, **KEY)
            assert torch.equal(packed.cpu(), on_host[1])
        out = torch.randn(R * D, device="cuda")
        want = out + dequantize_rows(lohi_r, codes, bits).to(torch.float32).reshape(-1)
        psq.dequantize_add.kernels(be, packed, R, D, lohi, bits, out)
        assert same_bits(out.cpu(), want.cpu())


@pytest.mark.requires_cuda
@pytest.mark.parametrize("block_size", (1, 3, 8))
def test_bhq_kernels_on_gpu(cuda_backend, block_size):
    be = cuda_backend.backend
    for R, D in SHAPES + ((256, 2001),):
        x = (matrix(R, D, seed=R + D, kind="plain")
             * torch.logspace(-3, 3, R).unsqueeze(1)).cuda()
        ref = plan("reference", x, 3, block_size)
        got = plan("kernels", x, 3, block_size)
        for a, b in zip(ref[:3], got[:3]):
            assert torch.equal(a, b)
        assert same_bits(got[3].cpu(), ref[3].cpu())
        perm, sizes, scales, y, _ = ref
        lohi, codes = round_rows(y, 3, _u(y.numel()).cuda())
        xhat = householder_blocks(dequantize_rows(lohi, codes, 3), sizes, scales,
                                  inverse=True).to(torch.float32)
        full = torch.empty_like(xhat)
        full[perm.cuda()] = xhat
        out = torch.randn(R * D, device="cuda")
        want = out + full.reshape(-1)
        psq.bhq_dequantize_add.kernels(be, pack_bits(codes, 3), R, D, lohi, 3, perm.cuda(),
                                       sizes.cuda(), scales.cuda(), out)
        assert same_bits(out.cpu(), want.cpu())


@pytest.mark.requires_cuda
@pytest.mark.parametrize("spec", ["psq:bits=4", "bhq:bits=3,block_size=8"])
def test_compressors_on_gpu(monkeypatch, cuda_backend, spec):
    x = (torch.randn(64, 777) * torch.logspace(-2, 2, 64).unsqueeze(1)).cuda()
    grads = [x, x * 0.5]
    want = _roundtrip(spec, grads, monkeypatch, "reference", "cuda")
    got = _roundtrip(spec, grads, monkeypatch, "kernels", "cuda")
    assert got[0] == want[0]
    assert same_bits(got[1], want[1])
