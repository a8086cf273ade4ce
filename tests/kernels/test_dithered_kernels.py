"""DQSG and NDQSG kernels (kernels/dithered.cu, the kernel implementations of the ops in
hvdcomp/ops/dithered.py) against their PyTorch references, bit for bit: the host build here, the
CUDA backend on a GPU (tests marked requires_cuda), and end to end through the compressors
(kernel path vs HVDCOMP_BACKEND=reference: identical message bytes, decoded sums, events),
NDQSG's fallback where the side information is too far off included; uniformef, whose steps
are those ops' too (variance_steps) and whose rounding is uniform_encode / uniform_decode_add,
against the references and end to end.
"""
import dataclasses

import numpy as np
import pytest
import torch

import hvdcomp
import hvdcomp.backends as B
from hvdcomp.ops.bitpack import pack_bits, unpack_bits
from hvdcomp.compressors.base import TensorKey
from hvdcomp.ops import dithered
from hvdcomp.ops.dithered import (bucket_checksums, check_weights, dither, dqsg_quantize,
                                  dqsg_reconstruct)
from hvdcomp.errors import WireFormatError
from hvdcomp.wire import Message

from kernel_cases import same_bits

KEY = TensorKey("w", 3, 7, 2, 4, 11)
SIZES = (1, 7, 8, 9, 1000, 8193)
BUCKETS = (1, 3, 8, 100, 512)


def gradient(n, bs, seed):
    """float32: heavy tails, ±0, denormals, an all-zero bucket, a bucket of tiny values whose
    step underflows, values at the bucket maximum."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp(2.0 * torch.randn(n, generator=g))
    x[::7] = 0.0
    x[3::11] = -0.0
    x[5::13] *= 1e-39
    if n > 2 * bs:
        x[bs:2 * bs] = 0.0
    if n > 3 * bs:
        x[2 * bs:3 * bs] = 1e-45                       # delta = m / M underflows to 0
    if n > 5 * bs:
        x[4 * bs:5 * bs] = 3e38                        # near the float32 maximum
    return x.to(torch.float32)


def quantize(x, bits, bs, key=KEY):
    """(Delta, q) of the reference."""
    delta = dithered.bucket_steps.reference(x, bits, bs)
    return delta, dqsg_quantize(x, delta, bits, bs, dither(x.numel(), key, device=x.device))


def reference_encode(x, bits, bs, nested_bits=0, key=KEY):
    delta, q = quantize(x, bits, bs, key)
    M = (1 << (bits - 1)) - 1
    if nested_bits:
        return delta, q, pack_bits(q & ((1 << nested_bits) - 1), nested_bits)
    return delta, q, pack_bits(q + M, bits)


# ---- kernels vs the reference functions (host) ------------------------------------------------

@pytest.mark.parametrize("bits", range(2, 9))
def test_quantize_pack_and_decode(host, bits):
    be = host.backend
    for n in SIZES:
        for bs in BUCKETS:
            x = gradient(n, bs, seed=bits * 1000 + n + bs)
            delta_r, q, packed_r = reference_encode(x, bits, bs)
            delta = dithered.bucket_steps.kernels(be, x, bits, bs)
            assert same_bits(delta, delta_r), (n, bs)
            assert torch.equal(dithered.dqsg_encode.kernels(be, x, delta, bits, bs, KEY),
                               packed_r), (n, bs)
            for nb in range(1, bits):
                got = dithered.nested_encode.kernels(be, x, delta, bits, nb, bs, KEY)[0]
                assert torch.equal(got, reference_encode(x, bits, bs, nb)[2]), (n, bs, nb)
            out = torch.randn(n)
            want = out + dqsg_reconstruct(delta_r, q, dither(n, KEY), bs)
            dithered.dqsg_decode_add.kernels(be, packed_r, n, delta_r, bits, bs, out, KEY)
            assert same_bits(out, want), (n, bs)


def test_uniform_encode_hand_worked(host):
    """uniformef's rounding on a hand-worked bucket, the reference and the kernel bit for
    bit: bits 3 (M = 3), Delta 0.5, q = clamp(floor(x / 0.5 + 1/2), -3, 3), codes q + 3,
    residual x - 0.5 q (-0.0 stays -0.0); a bucket with step 0 sends 0 and keeps x whole."""
    x = torch.tensor([0.26, -0.74, 1.24, -0.0, 5.0, 1e-44, -2e-44], dtype=torch.float32)
    delta = torch.tensor([0.5, 0.0])
    want = torch.tensor([0.26 - 0.5, -0.74 + 0.5, 1.24 - 1.0, -0.0, 5.0 - 1.5, 1e-44, -2e-44],
                        dtype=torch.float32)
    for packed, residual in (dithered.uniform_encode.reference(x, delta, 3, 5),
                             dithered.uniform_encode.kernels(host.backend, x, delta, 3, 5)):
        assert unpack_bits(packed, 7, 3).tolist() == [4, 2, 5, 3, 6, 3, 3]
        assert torch.allclose(residual, want, rtol=1e-6, atol=0)
        assert same_bits(residual[3:], want[3:])       # exact: -0.0, 3.5, x where Delta = 0
        for decode in (dithered.uniform_decode_add.reference,
                       lambda *a: dithered.uniform_decode_add.kernels(host.backend, *a)):
            out = torch.full((7,), 10.0)
            decode(packed, 7, delta, 3, 5, out)
            assert out.tolist() == [10.5, 9.5, 11.0, 10.0, 11.5, 10.0, 10.0]


def test_uniform_kernels_on_arbitrary_steps(host):
    """Steps no step rule makes (zero, denormal, negative, -0.0, huge: the clamp acts) and
    values on the rounding ties, signed zeros, denormals and the float32 extremes: the
    kernel gives the reference's bits."""
    be = host.backend
    g = torch.Generator().manual_seed(5)
    choices = torch.tensor([0.0, 1e-45, 1e-40, 1e-30, 0.5, 0.1, 3.0, 1e30, -0.5, -0.0, 3.4e38])
    for bits in (2, 3, 6, 8):
        M = (1 << (bits - 1)) - 1
        for n in (1, 13, 4099):
            for bs in (1, 7, 8, 1000):
                nb = (n + bs - 1) // bs
                x = torch.randn(n, generator=g) * torch.exp(3 * torch.randn(n, generator=g))
                x[::3] = (torch.randint(-M - 3, M + 3, (x[::3].numel(),), generator=g).float()
                          + 0.5) * 0.5                               # ties at Delta 0.5
                x[1::17] = -0.0
                x[2::19] = 1e-45
                x[4::23] = 3.4e38
                x[6::29] = -3.4e38
                delta = choices[torch.randint(0, len(choices), (nb,), generator=g)]
                packed, residual = dithered.uniform_encode.reference(x, delta, bits, bs)
                got_p, got_r = dithered.uniform_encode.kernels(be, x, delta, bits, bs)
                assert torch.equal(got_p, packed) and same_bits(got_r, residual), (bits, n, bs)
                out = torch.randn(n, generator=g)
                out[::5] = -0.0
                want = dithered.uniform_decode_add.reference(packed, n, delta, bits, bs,
                                                             out.clone())
                got = dithered.uniform_decode_add.kernels(be, packed, n, delta, bits, bs, out)
                assert same_bits(got, want), (bits, n, bs)


@pytest.mark.parametrize("bits", range(2, 9))
def test_uniform_kernels_equal_reference(host, bits):
    """hvd_uniform_round_pack / hvd_uniform_decode_add against uniform_encode /
    uniform_decode_add, bit for bit, on steps set by a variance target and by one step for
    every bucket (zero buckets, steps that underflow, values near the float32 maximum)."""
    be = host.backend
    for n in SIZES:
        for bs in BUCKETS:
            x = gradient(n, bs, seed=bits * 100 + n + bs)
            for delta in (dithered.variance_steps(x, bits, bs, 0.05),
                          dithered.floor_steps(x, bits, bs, 0.3)):
                packed, residual = dithered.uniform_encode.reference(x, delta, bits, bs)
                got_p, got_r = dithered.uniform_encode.kernels(be, x, delta, bits, bs)
                assert torch.equal(got_p, packed), (n, bs)
                assert same_bits(got_r, residual), (n, bs)
                out = torch.randn(n)
                want = dithered.uniform_decode_add.reference(packed, n, delta, bits, bs,
                                                             out.clone())
                got = dithered.uniform_decode_add.kernels(be, packed, n, delta, bits, bs, out)
                assert same_bits(got, want), (n, bs)


def test_uniform_kernel_arguments(host):
    be = host.backend
    x, d = torch.randn(10), torch.ones(1)
    with pytest.raises(ValueError):
        dithered.uniform_encode.kernels(be, x, d, 1, 10)
    with pytest.raises(ValueError):
        dithered.uniform_encode.kernels(be, x, torch.ones(2), 4, 10)
    out64 = torch.zeros(10, dtype=torch.float64)
    assert dithered.uniform_decode_add.kernels(be, torch.zeros(5, dtype=torch.uint8), 10, d, 4,
                                               10, out64) is NotImplemented
    packed, residual = dithered.uniform_encode.kernels(be, torch.zeros(0), torch.zeros(0), 4, 10)
    assert packed.numel() == 0 and residual.numel() == 0


@pytest.mark.parametrize("bits", (2, 4, 8))
def test_checks(host, bits):
    be = host.backend
    for n in SIZES:
        for bs in BUCKETS + (8192,):
            x = gradient(n, bs, seed=bits + n + bs)
            delta, q, _ = reference_encode(x, bits, bs)
            want = bucket_checksums(q, check_weights(n, KEY), bs)
            got = dithered.nested_encode.kernels(be, x, delta, bits, 1, bs, KEY)[1]
            assert torch.equal(got, want), (n, bs)


def test_validate(host):
    be = host.backend
    bits, bs, n = 3, 10, 95
    M = 3

    def validate(codes, delta):
        return dithered.validate_codes.kernels(be, pack_bits(codes, bits), n, delta, bs, bits,
                                               M, 2 * M)
    delta = torch.rand(10) + 0.1
    codes = torch.randint(0, 2 * M + 1, (n,))
    assert validate(codes, delta) == (False, False)
    bad = codes.clone()
    bad[94] = 2 * M + 1
    assert validate(bad, delta)[0]
    d0 = delta.clone()
    d0[4] = 0.0
    zc = codes.clone()
    zc[40:50] = M
    assert validate(zc, d0) == (False, False)
    zc[47] = M + 1
    assert validate(zc, d0) == (False, True)


def _resolve_reference(msgs_q, keys, deltas, bits, nbits, bs, n, G):
    """values of the nested ranks as NDQSG.resolve computes them, from their true q."""
    from hvdcomp.ops.dithered import nested_resolve, per_coordinate
    side = torch.zeros(n)
    for r in range(G):
        side.add_(dqsg_reconstruct(deltas[r], msgs_q[r], dither(n, keys[r]), bs))
    y = side / G
    vals, fails = [], []
    for r in range(G, len(keys)):
        s = dither(n, keys[r])
        d = per_coordinate(deltas[r], bs, n)
        z = y / torch.where(d > 0, d, torch.ones_like(d)) + s
        c = msgs_q[r] & ((1 << nbits) - 1)
        qh = nested_resolve(c, z, bits, nbits)
        qh = torch.where(d > 0, qh, torch.zeros_like(qh))
        check = bucket_checksums(msgs_q[r], check_weights(n, keys[r]), bs)
        bad = bucket_checksums(qh, check_weights(n, keys[r]), bs) != check
        v = dqsg_reconstruct(deltas[r], qh, s, bs)
        vals.append(torch.where(per_coordinate(bad, bs, n), y, v))
        fails.append(bad)
    return side, vals, fails


@pytest.mark.parametrize("bits,nbits", [(2, 1), (4, 2), (4, 3), (6, 2), (8, 7)])
@pytest.mark.parametrize("spread", (0.0, 0.02, 3.0))
def test_resolve_add(host, bits, nbits, spread):
    be = host.backend
    world, G = 4, 2
    for n, bs in ((1, 1), (9, 3), (1000, 64), (5003, 512)):
        base = gradient(n, bs, seed=n + bs)
        keys = [TensorKey("w", 3, 7, r, world, 11) for r in range(world)]
        xs, deltas, qs = [], [], []
        for r in range(world):
            g = torch.Generator().manual_seed(r)
            x = base + spread * base.abs() * torch.randn(n, generator=g)
            d, q = quantize(x, bits, bs, keys[r])
            xs.append(x)
            deltas.append(d)
            qs.append(q)
        side, vals, fails = _resolve_reference(qs, keys, deltas, bits, nbits, bs, n, G)
        for j, r in enumerate(range(G, world)):
            k = keys[r]
            check = bucket_checksums(qs[r], check_weights(n, k), bs)
            packed = pack_bits(qs[r] & ((1 << nbits) - 1), nbits)
            out = torch.randn(n)
            want = out + vals[j]
            failed = dithered.nested_decode_add.kernels(be, packed, n, deltas[r], check, side,
                                                        G, bits, nbits, bs, out, k)
            assert torch.equal(failed, fails[j]), (n, bs)
            assert same_bits(out, want), (n, bs)


def test_argument_checks(host):
    be = host.backend
    x = torch.randn(10)
    d = torch.ones(1)
    with pytest.raises(ValueError):
        dithered.dqsg_encode.kernels(be, x, d, 1, 10, KEY)
    with pytest.raises(ValueError):
        dithered.nested_encode.kernels(be, x, d, 4, 4, 10, KEY)
    with pytest.raises(ValueError):
        dithered.dqsg_encode.kernels(be, x, torch.ones(2), 4, 10, KEY)
    # an accumulator the kernel cannot write (not float32): the reference serves it
    out64 = torch.zeros(10, dtype=torch.float64)
    assert dithered.dqsg_decode_add.kernels(be, torch.zeros(5, dtype=torch.uint8), 10, d, 4, 10,
                                            out64, KEY) is NotImplemented
    with pytest.raises(ValueError):
        dithered.nested_decode_add.kernels(be, torch.zeros(3, dtype=torch.uint8), 10, d,
                                           torch.zeros(1), torch.zeros(10), 0, 4, 2, 10,
                                           torch.zeros(10), KEY)
    assert dithered.dqsg_encode.kernels(be, torch.zeros(0), torch.zeros(0), 4, 10,
                                        KEY).numel() == 0


# ---- end to end through the compressors ------------------------------------------------------

def _use(monkeypatch, mode):
    monkeypatch.setenv("HVDCOMP_BACKEND", mode)
    B._choice.clear()


def _run(spec, grads, monkeypatch, mode, device="cpu", wire=None):
    """Encode every rank's gradient, each with its own compressor (or take ``wire``),
    combine on every rank's behalf once; returns (message bytes, accumulator, events)."""
    _use(monkeypatch, mode)
    c = hvdcomp.get(spec)
    world = len(grads)
    keys = [TensorKey("w", 3, 7, r, world, 11) for r in range(world)]
    if wire is None:
        wire = [hvdcomp.get(spec).encode(g, k).to_bytes() for g, k in zip(grads, keys)]
    acc = torch.zeros(grads[0].numel(), device=device)
    finite = c.combine([Message.from_bytes(w) for w in wire], keys, acc)
    assert finite == all(bool(torch.isfinite(g.float()).all()) for g in grads)
    return wire, acc.cpu(), list(getattr(c, "_events", []))


def _grads(make, world, spread, relative=True):
    """world gradients: make() plus per-rank noise of scale spread (times |value| when
    relative)."""
    base = make()
    out = []
    for r in range(world):
        g = torch.Generator().manual_seed(r)
        noise = torch.randn(base.shape, generator=g).float() * spread
        if relative:
            noise = noise * base.float().abs()
        out.append(base + noise.to(base.dtype))
    return out


GRADS = [
    ("1-D", lambda: gradient(3001, 100, 1)),
    ("0-D", lambda: torch.tensor(-1.25)),
    ("empty", lambda: torch.zeros(0, 3)),
    ("conv", lambda: gradient(8 * 5 * 9, 64, 2).reshape(8, 5, 3, 3)),
    ("transposed", lambda: gradient(40 * 30, 64, 3).reshape(40, 30).t()),
    ("half", lambda: torch.randn(33, 19).half()),
    ("bfloat16", lambda: torch.randn(1025).bfloat16()),
    ("float64", lambda: gradient(999, 7, 4).double()),
]
SPECS = ["dqsg:bits=4,bucket_size=512", "dqsg:bits=2,bucket_size=3", "dqsg:bits=8,bucket_size=64",
         "dqsg:bits=4,bucket_size=100,entropy=True",
         "dqsg:bits=8,bucket_size=64,entropy=True,variance_target=0.02",
         "dqsg:bits=3,bucket_size=100,variance_target=0.5",
         "uniformef:bits=6,bucket_size=64,variance_target=0.03",
         "uniformef:bits=3,bucket_size=100,variance_target=0.5,entropy=False",
         "ndqsg:bits=4,nested_bits=2,bucket_size=64",
         "ndqsg:bits=5,nested_bits=3,bucket_size=7",
         "ndqsg:bits=8,nested_bits=1,bucket_size=512,dqsg_ranks=1",
         "ndqsg:bits=4,nested_bits=2,bucket_size=100,entropy=True"]


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("name,make", GRADS, ids=[g[0] for g in GRADS])
def test_compressor_kernels_equal_reference(monkeypatch, host, spec, name, make):
    grads = _grads(make, 4, 0.01)
    want = _run(spec, grads, monkeypatch, "reference")
    got = _run(spec, grads, monkeypatch, "kernels")
    assert got[0] == want[0], name
    assert same_bits(got[1], want[1]), name
    assert got[2] == want[2]


def _model_scope_run(monkeypatch, mode, device):
    """uniformef with step_scope "model" over three steps of two tensors (the steps after
    the first come from the previous step's mean square): every message's bytes, and the
    residuals at the end."""
    _use(monkeypatch, mode)
    c = hvdcomp.get("uniformef:bits=6,bucket_size=256,variance_target=0.03,step_scope=model")
    wire = []
    for step in range(3):
        for i, (name, n) in enumerate((("a", 5000), ("b", 3001))):
            g = gradient(n, 256, 10 * step + i).to(device) * (1.0 if i else 0.05)
            wire.append(c.encode(g, TensorKey(name, i, step, 0, 2, 11)).to_bytes())
    return wire, [c.residual(n).cpu() for n in ("a", "b")]


def test_uniformef_model_scope_kernels_equal_reference(monkeypatch, host):
    want = _model_scope_run(monkeypatch, "reference", "cpu")
    got = _model_scope_run(monkeypatch, "kernels", "cpu")
    assert got[0] == want[0]
    assert all(same_bits(a, b) for a, b in zip(got[1], want[1]))


@pytest.mark.requires_cuda
def test_uniformef_model_scope_on_gpu(monkeypatch, cuda_backend):
    want = _model_scope_run(monkeypatch, "reference", "cpu")
    got = _model_scope_run(monkeypatch, "kernels", "cuda")
    assert got[0] == want[0]
    assert all(same_bits(a, b) for a, b in zip(got[1], want[1]))


@pytest.mark.parametrize("spec", ["ndqsg:bits=4,nested_bits=2,bucket_size=64",
                                  "ndqsg:bits=3,nested_bits=1,bucket_size=5,dqsg_ranks=2"])
@pytest.mark.parametrize("spread", (0.3, 5.0))
def test_ndqsg_fallback_when_side_information_fails(monkeypatch, host, spec, spread):
    grads = _grads(lambda: torch.randn(4000), 5, spread, relative=False)
    want = _run(spec, grads, monkeypatch, "reference")
    got = _run(spec, grads, monkeypatch, "kernels")
    assert want[2], "the workers differ enough for some buckets to fail"
    assert got[0] == want[0] and got[2] == want[2]
    assert same_bits(got[1], want[1])


def test_kernel_messages_decode_on_the_reference_path(monkeypatch, host):
    spec = "ndqsg:bits=4,nested_bits=2,bucket_size=64"
    grads = _grads(lambda: gradient(2000, 64, 5), 3, 0.05)
    wire = _run(spec, grads, monkeypatch, "kernels")[0]
    got = _run(spec, grads, monkeypatch, "kernels", wire=wire)
    want = _run(spec, grads, monkeypatch, "reference", wire=wire)
    assert same_bits(got[1], want[1]) and got[2] == want[2]


def test_nonfinite_and_malformed(monkeypatch, host):
    spec = "ndqsg:bits=4,nested_bits=2,bucket_size=10"
    grads = _grads(lambda: torch.randn(100), 3, 0.01)
    bad = [g.clone() for g in grads]
    bad[2][5] = float("inf")
    assert _run(spec, bad, monkeypatch, "kernels")[0] == _run(spec, bad, monkeypatch,
                                                              "reference")[0]
    # malformed sections: the same error on both paths
    _use(monkeypatch, "reference")
    c = hvdcomp.get(spec)
    keys = [TensorKey("w", 3, 7, r, 3, 11) for r in range(3)]
    msgs = [c.encode(g, k) for g, k in zip(grads, keys)]
    delta0 = np.zeros(10, dtype="<f4").view(np.uint8)
    cases = [
        [msgs[0], msgs[1], dataclasses.replace(msgs[2], sections=(delta0,) + msgs[2].sections[1:])],
        [dataclasses.replace(msgs[0], sections=(msgs[0].sections[0],
                                                np.full(50, 0xFF, dtype=np.uint8))),
         msgs[1], msgs[2]],
        [dataclasses.replace(msgs[0], sections=(delta0, msgs[0].sections[1])), msgs[1],
         msgs[2]],
    ]
    for case in cases:
        errs = []
        for mode in ("reference", "kernels"):
            _use(monkeypatch, mode)
            with pytest.raises(WireFormatError) as e:
                hvdcomp.get(spec).combine(case, keys, torch.zeros(100))
            errs.append(str(e.value))
        assert errs[0] == errs[1]


def test_reference_mode_never_launches(monkeypatch, host):
    def boom(*a, **k):
        raise AssertionError("kernel launched in reference mode")
    monkeypatch.setattr(host.backend, "launch", boom)
    _run("ndqsg:bits=4,nested_bits=2", _grads(lambda: torch.randn(300), 3, 0.01), monkeypatch,
         "reference")


def test_large(monkeypatch, host):
    grads = _grads(lambda: torch.randn(1_000_003), 3, 0.001)
    for spec in ("dqsg:bits=4,bucket_size=512", "ndqsg:bits=4,nested_bits=2,bucket_size=512"):
        want = _run(spec, grads, monkeypatch, "reference")
        got = _run(spec, grads, monkeypatch, "kernels")
        assert got[0] == want[0] and same_bits(got[1], want[1]) and got[2] == want[2]


# ---- GPU ----------------------------------------------------------------------------------------

def _float32_patterns(seed):
    """float32 values from random bit patterns (every exponent, subnormals) and gradients."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 2**31 - 1, (400_000,), generator=g, dtype=torch.int64)
    x = x.to(torch.int32).view(torch.float32).abs()
    return torch.cat([x[torch.isfinite(x)], gradient(100_000, 7, seed).abs()])


@pytest.mark.parametrize("bits", range(2, 9))
def test_steps_are_the_correctly_rounded_quotient(bits):
    """Delta = float32(m / M) correctly rounded (NumPy's float32 division), the same bits on
    both devices (hvdcomp.ops.divide); so is the float64 route (a multiplication by the
    float64 reciprocal, rounded to float32).  A float32 reciprocal (what m / M on a CUDA
    float32 tensor computes) differs for a third of these values at bits 3..8: the test
    would catch it."""
    M = (1 << (bits - 1)) - 1
    m = _float32_patterns(bits)
    want = torch.from_numpy(m.numpy() / np.float32(M))
    got = dithered._over_levels(m, bits)
    assert same_bits(got, want)
    cuda_route = (m.to(torch.float64) * (1.0 / M)).to(torch.float32)
    assert same_bits(cuda_route, want)
    steps = dithered.bucket_steps.reference(m, bits, 1)
    assert same_bits(steps, torch.clamp(want, max=dithered.max_step(bits)))
    if M > 1:
        f32_route = m * torch.tensor(1.0 / M, dtype=torch.float32)
        assert not same_bits(f32_route, want)


def test_divide_is_the_correctly_rounded_quotient():
    """hvdcomp.ops.divide_ (the average's division by the world size) against NumPy's float32
    division; on CUDA test_divide_on_gpu checks the same bits."""
    from hvdcomp.ops import divide_
    x = _float32_patterns(11)
    x[::2] *= -1
    from hvdcomp.ops import divide
    for k in (1, 2, 3, 5, 6, 7, 12):
        want = torch.from_numpy(x.numpy() / np.float32(k))
        assert same_bits(divide_(x.clone(), k), want), k
        assert same_bits(divide(x, k), want), k
        x64 = x.double() * 1.1
        assert torch.equal(divide(x64, k), torch.from_numpy(x64.numpy() / np.float64(k))), k
        h = (x[:100_000] * 1e-3).half()              # finite float16 values
        want_h = torch.from_numpy((h.numpy().astype(np.float64) / k).astype(np.float16))
        assert torch.equal(divide(h, k), want_h), k
        assert divide(x, k) is not x


@pytest.mark.requires_cuda
def test_divide_on_gpu(cuda_backend):
    from hvdcomp.ops import divide_
    x = _float32_patterns(12)
    for k in (3, 5, 6, 7, 12):
        want = torch.from_numpy(x.numpy() / np.float32(k))
        assert same_bits(divide_(x.cuda(), k).cpu(), want), k
        assert same_bits(dithered._over_levels(x.cuda(), 4).cpu(),
                         torch.from_numpy(x.numpy() / np.float32(7)))


@pytest.mark.requires_cuda
@pytest.mark.parametrize("bits", (2, 4, 8))
def test_dqsg_kernels_on_gpu(cuda_backend, maybe_host, bits):
    be = cuda_backend.backend
    for n in SIZES + (1_000_003,):
        for bs in BUCKETS:
            x = gradient(n, bs, seed=bits + n + bs).cuda()
            delta_r, q = quantize(x, bits, bs)
            delta = dithered.bucket_steps.kernels(be, x, bits, bs)
            assert same_bits(delta.cpu(), delta_r.cpu())
            M = (1 << (bits - 1)) - 1
            packed = dithered.dqsg_encode.kernels(be, x, delta, bits, bs, KEY)
            assert torch.equal(packed, pack_bits(q + M, bits))
            if maybe_host is not None:
                assert torch.equal(packed.cpu(), dithered.dqsg_encode.kernels(
                    maybe_host.backend, x.cpu(), delta.cpu(), bits, bs, KEY))
            want = bucket_checksums(q, check_weights(n, KEY, device="cuda"), bs)
            assert torch.equal(dithered.nested_encode.kernels(be, x, delta, bits, 1, bs, KEY)[1],
                               want)
            out = torch.randn(n, device="cuda")
            exp = out + dqsg_reconstruct(delta_r, q, dither(n, KEY, device="cuda"), bs)
            dithered.dqsg_decode_add.kernels(be, packed, n, delta, bits, bs, out, KEY)
            assert same_bits(out.cpu(), exp.cpu())


@pytest.mark.requires_cuda
@pytest.mark.parametrize("bits", (2, 6, 8))
def test_uniform_kernels_on_gpu(cuda_backend, maybe_host, bits):
    be = cuda_backend.backend
    for n in SIZES + (1_000_003,):
        for bs in BUCKETS:
            x = gradient(n, bs, seed=bits + n + bs)
            delta = dithered.variance_steps(x, bits, bs, 0.05)
            packed, residual = dithered.uniform_encode.reference(x, delta, bits, bs)
            got_p, got_r = dithered.uniform_encode.kernels(be, x.cuda(), delta.cuda(), bits, bs)
            assert torch.equal(got_p.cpu(), packed) and same_bits(got_r.cpu(), residual)
            out = torch.randn(n)
            want = dithered.uniform_decode_add.reference(packed, n, delta, bits, bs, out.clone())
            got = dithered.uniform_decode_add.kernels(be, packed.cuda(), n, delta.cuda(), bits,
                                                      bs, out.cuda())
            assert same_bits(got.cpu(), want)


@pytest.mark.requires_cuda
@pytest.mark.parametrize("spec", ["dqsg:bits=4,bucket_size=512",
                                  "dqsg:bits=8,bucket_size=4096,entropy=True,variance_target=0.03",
                                  "uniformef:bits=6,bucket_size=4096,variance_target=0.03",
                                  "ndqsg:bits=4,nested_bits=2,bucket_size=64"])
@pytest.mark.parametrize("spread", (0.01, 2.0))
def test_compressors_on_gpu(monkeypatch, cuda_backend, spec, spread):
    # the reference resolves NDQSG on the CPU; the kernels on the GPU give the same bits
    grads = [g.cuda() for g in _grads(lambda: gradient(100_003, 64, 3), 4, spread)]
    want = _run(spec, grads, monkeypatch, "reference", "cuda")
    got = _run(spec, grads, monkeypatch, "kernels", "cuda")
    assert got[0] == want[0] and got[2] == want[2]
    assert same_bits(got[1], want[1])
