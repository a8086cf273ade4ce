"""kernels/ternary.cu (TernGrad, EF-SignSGD) against the PyTorch reference, bit for bit
(hvdcomp.ops.ternary: each op's kernel implementation against its reference).

* Kernel level (host build): bucket maxima, packed codes and sign bits, residuals and
  decode-accumulate equal the reference's formulas on many sizes and bucket sizes, with
  zeros of both signs, denormals, huge values, NaN/Inf propagation.
* The certified float64 sums: certified_clip_threshold equals clip_threshold and
  certified_signef_scales equals the reference signef_scales wherever they claim certainty
  (and they claim it on almost every input); where they cannot (huge buckets) they say so.
* End to end: each compressor with the kernels vs HVDCOMP_BACKEND=reference gives identical
  message bytes, identical decodes and identical residual state, step after step, for odd
  shapes, non-contiguous and half-precision gradients, empty and tiny tensors, NaN, the
  entropy stage, and with the reference fallbacks forced.
* GPU (requires_cuda): the CUDA backend against the reference, the same way.
"""
import math

import numpy as np
import pytest
import torch

import hvdcomp
from hvdcomp import backends
from hvdcomp.ops.bitpack import pack_bits, unpack_bits
from hvdcomp.compressors.base import TensorKey
from hvdcomp.ops import ternary as T
from hvdcomp.ops.ternary import clip_threshold
from hvdcomp.wire import FLAG_NONFINITE

from kernel_cases import KEY, gradient, same_bits

SIZES = (1, 7, 8, 9, 1000, 8193, 40_000)
BUCKETS = (1, 3, 8, 100, 512, 8192, 0)          # 0: one bucket = the whole tensor


def eff(bs, n):
    return bs if bs else max(n, 1)


def padded_absmax(x, bs):
    n = x.numel()
    nb = (n + bs - 1) // bs
    xp = torch.zeros(nb * bs, dtype=torch.float32, device=x.device)
    xp[:n] = x
    return xp.view(nb, bs).abs().amax(dim=1)


def ref_terngrad(x, bs, clip, key=KEY):
    """(scales, packed, T) of the reference path of TernGrad._encode."""
    norms, t = T.terngrad_scales.reference(x, clip, bs)
    return norms, T.terngrad_pack.reference(x, norms, bs, t, **key), t


def ref_signef(g, e, bs):
    """(scales, bits, new residual) of the reference path of SignEF._encode."""
    p = g.clone() if e is None else g + e
    s = T.signef_scales.reference(p, None, bs)
    n = p.numel()
    neg = p < 0
    sf = s.repeat_interleave(bs)[:n]
    return s, pack_bits(neg.to(torch.int64), 1), p - torch.where(neg, -sf, sf)


# ---- TernGrad, kernel level ------------------------------------------------------------------

@pytest.mark.parametrize("bs", BUCKETS)
def test_terngrad_bucket_max_and_pack(host, bs):
    be = host.backend
    for n in SIZES:
        b = eff(bs, n)
        for clip in (2.5, 0.0, 0.7):
            x = gradient(n, b, seed=n * 7 + b)
            maxima, sums = T.terngrad_bucket_max(be, x, b)
            assert same_bits(maxima, padded_absmax(x, b)), (n, b)
            norms, packed, t_ref = ref_terngrad(x, b, clip)
            t = T.certified_clip_threshold(be, x, clip, sums)
            assert t is None or t == t_ref, (n, b, clip, t, t_ref)
            scales = maxima if math.isinf(t_ref) else maxima.clamp(max=t_ref)
            assert same_bits(scales, norms), (n, b, clip)          # min(max|x|, T) = max|c|
            got = T.terngrad_pack.kernels(be, x, norms, b, t_ref, **KEY)
            assert torch.equal(got, packed), (n, b, clip)


def test_terngrad_bucket_max_propagates_nan_and_inf(host):
    x = torch.randn(50_000)
    x[30_001] = float("nan")
    x[7] = float("-inf")
    for bs in (1, 100, 16_384, 20_000, 50_000):
        got, sums = T.terngrad_bucket_max(host.backend, x, bs)
        assert same_bits(got, padded_absmax(x, bs)), bs
        assert math.isnan(float(sums[1]))


def test_terngrad_clip_threshold_is_the_references(host):
    be = host.backend
    certified = total = 0
    for seed in range(40):
        g = torch.Generator().manual_seed(seed)
        n = int(torch.randint(1, 60_000, (1,), generator=g))
        scale = 10.0 ** float(torch.randint(-30, 30, (1,), generator=g))
        offset = float(torch.randn(1, generator=g)) * (seed % 3)   # mean up to ~2 std
        x = (torch.randn(n, generator=g) + offset) * scale
        for clip in (2.5, 1.0, 1e-3, 7.25):
            t = T.certified_clip_threshold(be, x, clip)
            total += 1
            if t is not None:
                certified += 1
                assert t == clip_threshold(x, clip), (seed, clip, t)
    assert certified >= total * 0.95, (certified, total)


def test_terngrad_clip_threshold_with_a_mean_far_above_the_spread(host):
    # sigma << |mean|: torch's own rounding of the mean dominates its sigma; the kernels'
    # bound sees that and gives up (None) rather than return another value
    for seed in range(10):
        g = torch.Generator().manual_seed(seed)
        x = 1.0 + torch.randn(20_000, generator=g) * 10.0 ** -(seed % 6 + 2)
        t = T.certified_clip_threshold(host.backend, x, 2.5)
        assert t is None or t == clip_threshold(x, 2.5), seed


@pytest.mark.parametrize("x", [torch.zeros(1000), torch.full((1000,), -0.0),
                               torch.full((5,), 3.0), torch.full((4097,), 0.1),
                               torch.tensor([1e-45, -1e-45, 0.0]), torch.tensor([3e38, -3e38]),
                               torch.tensor([2.0])])
def test_terngrad_clip_threshold_edge_cases(host, x):
    for clip in (2.5, 0.0):
        t = T.certified_clip_threshold(host.backend, x, clip)
        assert t is None or t == clip_threshold(x, clip), (x[:3], clip, t)
    assert T.certified_clip_threshold(host.backend, x, 0.0) == math.inf


def test_terngrad_decode_add(host):
    be = host.backend
    for n in SIZES:
        for bs in (1, 3, 8, 100, n):
            g = torch.Generator().manual_seed(n + bs)
            codes = torch.randint(0, 4, (n,), generator=g)             # all four codes
            nb = (n + bs - 1) // bs
            scales = torch.rand(nb, generator=g) * 10.0 ** torch.randint(-40, 38, (nb,),
                                                                         generator=g)
            scales[::5] = 0.0
            scales[1::7] = -0.0          # passes the decoder's check (not < 0): sign of zero
            out0 = torch.randn(n, generator=g)
            out0[::3] = -0.0
            want = T.terngrad_decode_add.reference(pack_bits(codes, 2), n, scales, bs,
                                                   out0.clone())
            got = T.terngrad_decode_add.kernels(be, pack_bits(codes, 2), n, scales, bs,
                                                out0.clone())
            assert same_bits(got, want), (n, bs)


# ---- EF-SignSGD, kernel level ---------------------------------------------------------------

@pytest.mark.parametrize("bs", BUCKETS)
@pytest.mark.parametrize("with_residual", [False, True])
def test_signef_scales_pack_and_residual(host, bs, with_residual):
    be = host.backend
    flagged = buckets = 0
    for n in SIZES:
        b = eff(bs, n)
        g = gradient(n, b, seed=n * 3 + b)
        e = gradient(n, b, seed=n * 5 + b + 1) * 0.25 if with_residual else None
        s_ref, bits_ref, e_ref = ref_signef(g, e, b)
        s, unc = T.certified_signef_scales(be, g, e, b)
        ok = unc == 0
        assert same_bits(s[ok], s_ref[ok]), (n, b)
        flagged += int((~ok).sum())
        buckets += s.numel()
        e_in = None if e is None else e.clone()
        bits, e_new = T.signef_pack.kernels(be, g, e_in, s_ref, b, e_out=e_in)
        assert torch.equal(bits, bits_ref), (n, b)
        assert same_bits(e_new, e_ref), (n, b)
        if e_in is not None:
            assert e_new.data_ptr() == e_in.data_ptr()             # updated in place
    # uncertain: a float32 rounding tie of sum/len within the error bound of an inexact sum
    # (here: 3-coordinate buckets holding a denormal next to ordinary values); rare
    assert flagged <= max(1, buckets // 100), (flagged, buckets)


def test_signef_scales_flag_what_they_cannot_certify(host):
    g = torch.randn(100)
    s, unc = T.certified_signef_scales(host.backend, g, None, 2**52)     # gamma_bs ~ 0.5: no proof
    assert bool((unc == 1).all())
    assert same_bits(s, T.signef_scales.reference(g, None, 2**31))
    g[17] = float("nan")
    s, _ = T.certified_signef_scales(host.backend, g, torch.zeros(100), 10)
    assert math.isnan(float(s[1])) and bool(torch.isfinite(s[[0, 2, 3]]).all())
    g[17] = 3e38
    s, _ = T.certified_signef_scales(host.backend, g, torch.full((100,), 3e38), 10)
    assert math.isinf(float(s[1]))                               # p overflows float32


def test_signef_decode_add(host):
    be = host.backend
    for n in SIZES:
        for bs in (1, 3, 8, 100, n):
            g = torch.Generator().manual_seed(n * 2 + bs)
            bits = torch.randint(0, 2, (n,), generator=g)
            nb = (n + bs - 1) // bs
            s = torch.rand(nb, generator=g) * 10.0 ** torch.randint(-40, 38, (nb,), generator=g)
            s[::4] = 0.0
            s[1::6] = -0.0
            out0 = torch.randn(n, generator=g)
            out0[::3] = -0.0
            sf = s.repeat_interleave(bs)[:n]
            want = out0 + torch.where(bits != 0, -sf, sf)
            got = T.signef_decode_add.kernels(be, pack_bits(bits, 1), n, s, bs, out0.clone())
            assert same_bits(got, want), (n, bs)


def test_argument_checks(host):
    be = host.backend
    x = torch.randn(10)
    with pytest.raises(TypeError):
        T.terngrad_bucket_max(be, x.double(), 4)
    with pytest.raises(ValueError):
        T.terngrad_bucket_max(be, x, 0)
    with pytest.raises(ValueError):
        T.terngrad_bucket_max(be, x[:0], 4)
    with pytest.raises(ValueError):
        T.terngrad_pack.kernels(be, x, torch.ones(3), 4, 0.1, **KEY)    # not a float32 value
    with pytest.raises(ValueError):
        T.terngrad_pack.kernels(be, x, torch.ones(2), 4, 1.0, **KEY)    # wrong number of scales
    with pytest.raises(ValueError):
        T.signef_decode_add.kernels(be, torch.zeros(1, dtype=torch.uint8), 10, torch.ones(1),
                                    10, torch.zeros(10))               # 10 bits need 2 bytes
    with pytest.raises(ValueError):
        T.signef_pack.kernels(be, x, torch.zeros(9), torch.ones(1), 10)
    with pytest.raises(ValueError):
        T.terngrad_decode_add.kernels(be, torch.zeros(3, dtype=torch.uint8), 10, torch.ones(1),
                                      10, torch.zeros(10)[::2])

# ---- end to end: the compressors with and without the kernels --------------------------------

def _backend(monkeypatch, mode):
    monkeypatch.setattr(backends, "_choice", {})
    monkeypatch.setenv("HVDCOMP_BACKEND", mode)


def run_steps(monkeypatch, mode, spec, grads, device="cpu"):
    """Encode each gradient as successive steps of one compressor; decode each message into
    a fresh accumulator.  Returns ([message bytes], [decoded], state_dict)."""
    _backend(monkeypatch, mode)
    comp = hvdcomp.get(spec)
    msgs, outs = [], []
    for step, grad in enumerate(grads):
        key = TensorKey("layer", 5, step, 1, 4, 11)
        m = comp.encode(grad, key)
        msgs.append(m.to_bytes())
        out = torch.zeros(grad.numel(), device=device)
        comp.decode(m, key, out)
        outs.append(out.cpu())
    return msgs, outs, comp.state_dict()


def assert_same_runs(a, b):
    assert a[0] == b[0]
    assert all(same_bits(x, y) for x, y in zip(a[1], b[1]))
    ra, rb = a[2].get("residuals", {}), b[2].get("residuals", {})
    assert ra.keys() == rb.keys()
    assert all(same_bits(ra[k].reshape(-1), rb[k].reshape(-1)) for k in ra)


SPECS = ["terngrad", "terngrad:bucket_size=100", "terngrad:clip=0,bucket_size=7",
         "terngrad:bucket_size=1", "terngrad:entropy=True,bucket_size=512",
         "signef", "signef:bucket_size=100", "signef:bucket_size=1",
         "signef:bucket_size=3,entropy=True", "signef:bucket_size=8192"]


def _grads(shape, steps=3, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = int(np.prod(shape)) if len(shape) else 1
    out = []
    for s in range(steps):
        x = gradient(n, 64, seed=seed * 10 + s).reshape(shape) if n else torch.zeros(shape)
        if n:
            x = x + torch.randn(shape, generator=g) * 0.01
        out.append(x.to(dtype))
    return out


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("shape", [(0,), (1,), (7,), (3, 5, 7), (1000, 33), ()])
def test_end_to_end_identical(monkeypatch, host, spec, shape):
    grads = _grads(shape, seed=len(shape) * 100 + sum(shape))
    assert_same_runs(run_steps(monkeypatch, "reference", spec, grads),
                     run_steps(monkeypatch, "kernels", spec, grads))


@pytest.mark.parametrize("spec", ["terngrad:bucket_size=64", "signef", "signef:bucket_size=50"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_end_to_end_other_dtypes(monkeypatch, host, spec, dtype):
    grads = _grads((37, 29), dtype=dtype, seed=3)
    assert_same_runs(run_steps(monkeypatch, "reference", spec, grads),
                     run_steps(monkeypatch, "kernels", spec, grads))


@pytest.mark.parametrize("spec", ["terngrad", "signef:bucket_size=16"])
def test_end_to_end_non_contiguous(monkeypatch, host, spec):
    base = _grads((64, 48), seed=9)
    grads = [b.t()[:, ::3] for b in base]                      # strided, transposed views
    assert not grads[0].is_contiguous()
    assert_same_runs(run_steps(monkeypatch, "reference", spec, grads),
                     run_steps(monkeypatch, "kernels", spec, grads))


@pytest.mark.parametrize("spec", ["terngrad", "signef", "signef:bucket_size=10"])
def test_end_to_end_nonfinite(monkeypatch, host, spec):
    grads = _grads((300,), steps=4, seed=5)
    grads[1] = grads[1].clone()
    grads[1][123] = float("nan")
    grads[2] = grads[2].double()
    grads[2][7] = 1e300                                    # beyond float32: Inf when cast
    runs = [run_steps(monkeypatch, m, spec, grads) for m in ("reference", "kernels")]
    assert_same_runs(*runs)
    _backend(monkeypatch, "kernels")
    comp = hvdcomp.get(spec)
    m = comp.encode(grads[1], TensorKey("layer", 5, 1, 1, 4, 11))
    assert m.flags & FLAG_NONFINITE


def test_signef_residual_overflow_is_nonfinite_and_kept(monkeypatch, host):
    # p = g + e overflows float32 although g and e are finite: NONFINITE, residual unchanged
    for mode in ("reference", "kernels"):
        _backend(monkeypatch, mode)
        comp = hvdcomp.get("signef:bucket_size=4")
        comp.load_state_dict({"residuals": {"layer": torch.full((10,), 3e38)}})
        m = comp.encode(torch.full((10,), 3e38), TensorKey("layer", 5, 0, 1, 4, 11))
        assert m.flags & FLAG_NONFINITE
        assert torch.equal(comp.residual("layer"), torch.full((10,), 3e38))


def test_end_to_end_with_the_reference_fallbacks(monkeypatch, host):
    """The paths taken when a float64 sum cannot be certified: same bytes again."""
    grads = _grads((5000,), steps=3, seed=11)
    want = {s: run_steps(monkeypatch, "reference", s, grads)
            for s in ("terngrad", "terngrad:bucket_size=300", "signef", "signef:bucket_size=300")}
    real_scales = T.certified_signef_scales
    calls = {"T": 0, "s": 0}

    def no_threshold(*a, **k):
        calls["T"] += 1
        return None

    def all_uncertain(*a, **k):
        calls["s"] += 1
        s, unc = real_scales(*a, **k)
        return s, torch.ones_like(unc)

    monkeypatch.setattr(T, "certified_clip_threshold", no_threshold)
    monkeypatch.setattr(T, "certified_signef_scales", all_uncertain)
    for spec, ref in want.items():
        assert_same_runs(ref, run_steps(monkeypatch, "kernels", spec, grads))
    assert calls["T"] == 6 and calls["s"] == 6


def test_messages_cross_decode(monkeypatch, host):
    """A kernel-encoded message decodes identically on the reference path and vice versa."""
    grads = _grads((4097,), steps=2, seed=13)
    for spec in ("terngrad:bucket_size=1000", "signef:bucket_size=1000"):
        _backend(monkeypatch, "kernels")
        comp = hvdcomp.get(spec)
        msgs = [comp.encode(g, TensorKey("layer", 5, s, 1, 4, 11)) for s, g in enumerate(grads)]
        outs = {}
        for mode in ("kernels", "reference"):
            _backend(monkeypatch, mode)
            dec = hvdcomp.get(spec)
            acc = torch.full((4097,), 0.5)
            for s, m in enumerate(msgs):
                dec.decode(m, TensorKey("layer", 5, s, 1, 4, 11), acc)
            outs[mode] = acc
        assert same_bits(outs["kernels"], outs["reference"]), spec


def test_geometry_helpers_shared():
    from hvdcomp.compressors.bucketing import TensorBuckets
    for spec, bits in (("terngrad", 2), ("signef", 1)):
        for bs in (0, 1, 7, 100):
            c = hvdcomp.get(f"{spec}:bucket_size={bs}")
            assert isinstance(c, TensorBuckets)
            for n in (0, 1, 7, 100, 1001):
                nb = 0 if n == 0 else (1 if bs == 0 else -(-n // bs))
                assert c.num_buckets(n) == nb
                assert c.message_bytes(n) == 4 * nb + (n * bits + 7) // 8


# ---- GPU ------------------------------------------------------------------------------------

@pytest.mark.requires_cuda
@pytest.mark.parametrize("bs", (1, 3, 100, 8192, 0))
def test_kernels_on_gpu(cuda_backend, bs):
    be = cuda_backend.backend
    for n in (1, 9, 1000, 70_001):
        b = eff(bs, n)
        x = gradient(n, b, seed=n + b)
        xc = x.cuda()
        maxima, sums = T.terngrad_bucket_max(be, xc, b)
        assert same_bits(maxima.cpu(), padded_absmax(x, b))
        norms, packed, t_ref = ref_terngrad(x, b, 2.5)
        t = T.certified_clip_threshold(be, xc, 2.5, sums)
        assert t is None or t == t_ref
        got = T.terngrad_pack.kernels(be, xc, norms.cuda(), b, t_ref, **KEY)
        assert torch.equal(got.cpu(), packed)
        out0 = torch.randn(n)
        want = T.terngrad_decode_add.reference(packed, n, norms, b, out0.clone())
        got = T.terngrad_decode_add.kernels(be, packed.cuda(), n, norms.cuda(), b, out0.cuda())
        assert same_bits(got.cpu(), want)

        e = gradient(n, b, seed=n + b + 1) * 0.3
        s_ref, bits_ref, e_ref = ref_signef(x, e, b)
        s, unc = T.certified_signef_scales(be, xc, e.cuda(), b)
        ok = (unc == 0).cpu()
        assert same_bits(s.cpu()[ok], s_ref[ok])
        bits, e_new = T.signef_pack.kernels(be, xc, e.cuda(), s_ref.cuda(), b)
        assert torch.equal(bits.cpu(), bits_ref) and same_bits(e_new.cpu(), e_ref)
        sf = s_ref.repeat_interleave(b)[:n]
        want = out0 + torch.where(unpack_bits(bits_ref, n, 1) != 0, -sf, sf)
        got = T.signef_decode_add.kernels(be, bits_ref.cuda(), n, s_ref.cuda(), b, out0.cuda())
        assert same_bits(got.cpu(), want)


@pytest.mark.requires_cuda
@pytest.mark.parametrize("spec", ["terngrad", "terngrad:bucket_size=100", "signef",
                                  "signef:bucket_size=100", "signef:bucket_size=3,entropy=True"])
def test_end_to_end_on_gpu(monkeypatch, cuda_backend, spec):
    grads = [g.cuda() for g in _grads((300, 7), seed=21)]
    assert_same_runs(run_steps(monkeypatch, "reference", spec, grads, device="cuda"),
                     run_steps(monkeypatch, "kernels", spec, grads, device="cuda"))
