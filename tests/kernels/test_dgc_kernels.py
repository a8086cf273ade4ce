"""kernels/dgc.cu (hvdcomp/ops/sparsify.py's kernel implementations and launchers) against
the PyTorch reference of the sparsifiers (hvdcomp/ops/sparsify.py), bit for bit.

Low level: each kernel against the reference's own expression for the same quantity.
End to end: DGC, top-k and random-k encode on the kernel path vs the reference path
(``HVDCOMP_BACKEND=reference``): identical message bytes,
identical state (u, v / residuals) after every step, identical decoded sums; many settings
(momentum, clipping, fp16 values, exact_k off, accumulation off, masking off, sample_ratio 0,
warm-up) and inputs (sizes 1, 7, chunk boundaries, zeros, all-equal values, ties at the
threshold, non-contiguous and odd shapes, half / bfloat16 / float64 gradients, NaN / Inf,
overflow of v).  GPU tests (requires_cuda): the same through the CUDA backend.
"""
import contextlib
import math

import numpy as np
import pytest
import torch

import hvdcomp
from hvdcomp import backends
from hvdcomp.compressors import TensorKey
from hvdcomp.compressors.sparsifiers import num_selected
from hvdcomp.ops import sparsify
from hvdcomp.ops.sparsify import sample_positions, topk_indices
from hvdcomp.wire import Message

KEY4 = (11, 2, 3, 7)
TKEY = TensorKey("w", 3, 7, 2, 4, 11)
SIZES = [1, 7, 31, 32, 33, 100, 4095, 4096, 4097, 10_000, 70_000]


def _ref_v(g, u_old, v_old, scale, m):
    """The reference's float32 expressions of DGC._encode (clip, momentum, accumulation)."""
    g = g.clone()
    if scale is not None:
        g = g * torch.tensor(scale, dtype=torch.float32)
    u = None
    if m > 0:
        u = g if u_old is None else u_old * torch.tensor(m, dtype=torch.float32) + g
    add = g if u is None else u
    v = add if v_old is None else v_old + add
    return u, v


def _bits_equal(a, b):
    assert a.shape == b.shape, (a.shape, b.shape)
    assert torch.equal(a.view(torch.int32), b.view(torch.int32))


def _cases():
    g = torch.Generator().manual_seed(5)
    for n in SIZES:
        yield n, torch.randn(n, generator=g) * 1e-3, torch.randn(n, generator=g) * 1e-3, \
            torch.randn(n, generator=g) * 1e-3


FLAG_SETS = [dict(scale=None, m=0.0, has_u=False, has_v=False),
             dict(scale=None, m=0.0, has_u=False, has_v=True),
             dict(scale=0.37, m=0.0, has_u=False, has_v=True),
             dict(scale=None, m=0.9, has_u=False, has_v=False),
             dict(scale=None, m=0.9, has_u=True, has_v=True),
             dict(scale=0.61, m=0.5, has_u=True, has_v=True),
             dict(scale=0.61, m=0.5, has_u=True, has_v=False)]


@pytest.mark.parametrize("fs", FLAG_SETS)
def test_accumulate_and_sample_equal_reference(host, fs):
    be = host.backend
    for n, g, uo, vo in _cases():
        uo = uo if fs["has_u"] else None
        vo = vo if fs["has_v"] else None
        m = float(np.float32(fs["m"]))
        scale = None if fs["scale"] is None else float(np.float32(fs["scale"]))
        ru, rv = _ref_v(g, uo, vo, scale, m)
        mag = rv.abs()
        # sample: mag at the reference's positions
        s = max(1, n // 10)
        smp = sparsify.launch_sample(be, g, s, KEY4, u_old=uo, v_old=vo, scale=scale, momentum=m)
        pos = sample_positions(s, n, KEY4)
        _bits_equal(smp, mag[pos])
        # accumulate: u, v and the per-chunk counts of two thresholds
        t1, t2 = float(mag.max()) / 3, float(mag.median())
        for chunk in (1, 5, 32, 4096):
            u_out = torch.full((n,), 7.0) if m > 0 else None
            v_out = torch.full((n,), 7.0)
            cnt = sparsify.launch_accumulate(be, g, u_old=uo, v_old=vo, scale=scale,
                                             momentum=m, u_out=u_out, v_out=v_out, t1=t1,
                                             t2=t2, chunk=chunk)
            _bits_equal(v_out, rv)
            if m > 0:
                _bits_equal(u_out, ru)
            nc = (n + chunk - 1) // chunk
            pad = torch.zeros(nc * chunk)
            for row, t in ((0, t1), (1, t2)):
                pad[:n] = ((mag >= t) & (mag > 0)).float()
                assert torch.equal(cnt[row], pad.view(nc, chunk).sum(1).long())
            assert int(cnt[2].sum()) == 0


@pytest.mark.parametrize("n", SIZES)
def test_select_equals_nonzero(host, n):
    be = host.backend
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=g)
    x[::3] = 0.0
    x[1::5] = 0.5                               # ties at the threshold
    for t in (0.0, 0.5, float(x.abs().max()), 10.0):
        mag = x.abs()
        ref = torch.nonzero(mag >= t if t > 0 else mag > 0).reshape(-1)
        for chunk in (1, 7, 64, 4096):
            cnt = sparsify.launch_accumulate(be, x, t1=t, t2=t, chunk=chunk)
            ends = torch.cumsum(cnt, 1)
            assert int(ends[0, -1]) == ref.numel()
            xx, u = x.clone(), torch.randn(n)
            u_ref = u.clone()
            idx, vals = sparsify.launch_select(be, xx, t, chunk, ends[0], ref.numel(),
                                               mask_x=True, u=u)
            assert torch.equal(idx, ref)
            _bits_equal(vals, x[ref])
            x_ref = x.clone()
            x_ref[ref] = 0.0
            u_ref[ref] = 0.0
            _bits_equal(xx, x_ref)
            _bits_equal(u, u_ref)


def test_nonfinite_counts(host):
    be = host.backend
    for n in (1, 7, 5000):
        for bad in (float("nan"), float("inf"), -float("inf")):
            g = torch.randn(n)
            g[n // 2] = bad
            cnt = sparsify.launch_accumulate(be, g, chunk=64)
            assert int(cnt[2].sum()) == 1
    # overflow of v = v_old + g with finite inputs
    g = torch.full((10,), 3e38)
    cnt = sparsify.launch_accumulate(be, g, v_old=g.clone(), v_out=torch.empty(10))
    assert int(cnt[2].sum()) == 10


def test_mask_and_scatter_add(host):
    be = host.backend
    n = 1000
    idx = torch.tensor([0, 3, 17, 500, 999])
    dec = torch.randn(5)
    v, u = torch.randn(n), torch.randn(n)
    v_ref, u_ref = v.clone(), u.clone()
    v_ref[idx] = v_ref[idx] - dec
    u_ref[idx] = 0.0
    sparsify.mask.kernels(be, idx, v=v, u=u, dec=dec)
    _bits_equal(v, v_ref)
    _bits_equal(u, u_ref)
    out = torch.randn(n)
    for s in (1.0, float(np.float32(1000 / 3))):
        ref = out.clone().index_add_(0, idx, dec * torch.tensor(s, dtype=torch.float32))
        got = sparsify.launch_scatter_add(be, idx, dec, out.clone(), s)
        _bits_equal(got, ref)
    with pytest.raises(RuntimeError, match="out of range"):
        sparsify.launch_scatter_add(be, torch.tensor([n]), dec[:1], out)
    with pytest.raises(TypeError):
        sparsify.launch_scatter_add(be, idx.int(), dec, out)
    with pytest.raises(ValueError):
        sparsify.mask.kernels(be, idx, v=v, u=v, dec=dec)


def test_sumsq_close_to_torch(host):
    for n in (1, 7, 65535, 65536, 65537, 300_001):
        x = torch.randn(n) * 3
        ref = float(x.double().pow(2).sum())
        got = sparsify.sumsq.kernels(host.backend, x)
        assert abs(got - ref) <= 1e-13 * ref
    assert sparsify.sumsq.kernels(host.backend, torch.zeros(0)) == 0.0


def test_exact_topk_is_topk_indices():
    g = torch.Generator().manual_seed(3)
    for c in (1, 2, 10, 1000):
        vals = torch.randint(1, 5, (c,), generator=g).float() * \
            torch.where(torch.rand(c, generator=g) < 0.5, -1.0, 1.0)   # many ties
        idx = torch.sort(torch.randperm(10 * c, generator=g)[:c]).values
        for k in (1, 2, 5, c):
            ri = topk_indices(vals.abs(), k)
            gi, gv = sparsify.exact_topk(idx, vals, k)
            assert torch.equal(gi, idx[ri])
            _bits_equal(gv, vals[ri])


def test_argument_checks(host):
    be = host.backend
    with pytest.raises(TypeError):
        sparsify.launch_accumulate(be, torch.zeros(4, dtype=torch.float64))
    with pytest.raises(ValueError):
        sparsify.launch_accumulate(be, torch.zeros(4), v_old=torch.zeros(5))
    with pytest.raises(ValueError):
        sparsify.launch_accumulate(be, torch.zeros(4), momentum=0.5)            # no u_out
    with pytest.raises(ValueError):
        sparsify.launch_accumulate(be, torch.zeros(4), chunk=0)
    with pytest.raises(ValueError):
        sparsify.select.kernels(be, torch.zeros(0), 1)
    with pytest.raises(ValueError):
        sparsify.select.kernels(be, torch.zeros(4), 1, mask_x=True)           # x would be g


# ---- end to end ------------------------------------------------------------------------------

@contextlib.contextmanager
def _reference():
    """Context: the compressors' reference path (no kernel backend)."""
    with backends.use("reference"):
        yield


def _run(spec, grads, momentum=None, steps=None, world=4, decode=True):
    """Encode grads[step] for each step with a fresh compressor; returns (wire bytes per
    step, state_dict after each step, decoded sums)."""
    c = hvdcomp.get(spec)
    if momentum is not None:
        c.set_momentum({"w": momentum})
    wires, states, decs = [], [], []
    for step, gr in enumerate(grads):
        key = TensorKey("w", 3, step, 1, world, 11)
        m = c.encode(gr, key)
        wires.append(m.to_bytes())
        states.append(c.state_dict())
        if decode:
            out = torch.zeros(gr.numel())
            c.decode(Message.from_bytes(wires[-1]), key, out)
            decs.append(out)
    return wires, states, decs


def _same(spec, grads, momentum=None):
    from hvdcomp.backends import host
    launches = []
    with pytest.MonkeyPatch.context() as m:
        real = host.backend.launch
        m.setattr(host.backend, "launch", lambda *a: (launches.append(a[0]), real(*a)))
        got = _run(spec, grads, momentum)
    if any(g.numel() for g in grads):             # the kernel path did run
        assert launches, spec
    with _reference():
        ref = _run(spec, grads, momentum)
    for step, (a, b) in enumerate(zip(got[0], ref[0])):
        assert a == b, f"{spec}: message bytes differ at step {step}"
    for step, (a, b) in enumerate(zip(got[1], ref[1])):
        assert a.keys() == b.keys()
        for part in a:
            assert a[part].keys() == b[part].keys(), (spec, step, part)
            for name in a[part]:
                _bits_equal(a[part][name], b[part][name])
    for a, b in zip(got[2], ref[2]):
        _bits_equal(a, b)
    return got


def _grads(shape, steps=4, seed=0, scale=1e-3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g) * scale for _ in range(steps)]


DGC_SPECS = ["dgc:density=0.001",
             "dgc:density=0.01,sample_ratio=0.05",
             "dgc:density=0.01,values=fp16",
             "dgc:density=0.02,exact_k=False",
             "dgc:density=0.02,exact_k=False,sample_ratio=0.001",
             "dgc:density=0.01,accumulate=False",
             "dgc:density=0.01,masking=False",
             "dgc:density=0.05,sample_ratio=0",
             "dgc:density=0.01,clip_norm=0.01",
             "dgc:density=0.01,clip_norm=1000",
             "dgc:density=0.01,clip_norm=0.01,accumulate=False",
             "dgc:density=0.01,momentum_correction=False",
             "dgc:density=0.001,warmup_epochs=3,steps_per_epoch=1",
             "dgc:density=0.001,warmup_epochs=2,warmup_steps=3,values=fp16"]


@pytest.mark.parametrize("spec", DGC_SPECS)
@pytest.mark.parametrize("momentum", [None, 0.9])
@pytest.mark.parametrize("shape", [(1,), (7,), (33, 5), (4097,), (64, 3, 3, 3)])
def test_dgc_end_to_end(host, spec, momentum, shape):
    _same(spec, _grads(shape), momentum)


@pytest.mark.parametrize("spec", ["topk:density=0.01", "topk:density=0.3,values=fp16",
                                  "topk:density=0.01,error_feedback=False",
                                  "randk:density=0.01", "randk:density=0.4,values=fp16",
                                  "randk:density=0.05,unbiased=True",
                                  "randk:density=0.01,error_feedback=False"])
@pytest.mark.parametrize("shape", [(1,), (7,), (33, 5), (4097,), (20_000,)])
def test_topk_randk_end_to_end(host, spec, shape):
    _same(spec, _grads(shape))


@pytest.mark.parametrize("spec", ["dgc:density=0.01", "dgc:density=0.01,exact_k=False",
                                  "topk:density=0.01", "randk:density=0.01"])
def test_special_inputs(host, spec):
    n = 5000
    zeros = torch.zeros(n)
    equal = torch.full((n,), 0.25)
    ties = (torch.arange(n) % 4).float() - 1.5           # |x| in {0.5, 1.5}: ties everywhere
    few = torch.zeros(n)
    few[[3, 70, 4999]] = torch.tensor([1.0, -2.0, 1.0])  # fewer nonzeros than k
    tiny = torch.randn(n) * 1e-40                         # denormals
    huge = torch.randn(n) * 1e37
    for grads in ([zeros, zeros], [equal, equal, equal], [ties, ties], [few, few, zeros],
                  [tiny, tiny], [huge, huge]):
        _same(spec, grads, 0.9 if spec.startswith("dgc") else None)


@pytest.mark.parametrize("spec", ["dgc:density=0.01", "dgc:density=0.01,clip_norm=1",
                                  "topk:density=0.01", "randk:density=0.01"])
def test_nan_policy_state_unchanged(host, spec):
    n = 3000
    good = _grads((n,), 2)
    for bad in (float("nan"), float("inf")):
        g = torch.randn(n) * 1e-3
        g[17] = bad
        got = _same(spec, [good[0], g, good[1]], 0.9 if spec.startswith("dgc") else None)
        assert Message.from_bytes(got[0][1]).flags & hvdcomp.wire.FLAG_NONFINITE
        for part in got[1][0]:
            for name in got[1][0][part]:
                _bits_equal(got[1][0][part][name], got[1][1][part][name])
    # overflow of the accumulated state with finite gradients
    big = torch.full((n,), 3e38)
    _same(spec, [big, big, torch.ones(n)], 0.9 if spec.startswith("dgc") else None)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_dtypes_and_layouts(host, dtype):
    base = _grads((40, 30), 3)
    grads = [g.to(dtype) for g in base]
    _same("dgc:density=0.01", grads, 0.9)
    _same("topk:density=0.01", grads)
    strided = [g.t() for g in base]                       # non-contiguous
    _same("dgc:density=0.01,clip_norm=0.001", strided, 0.9)
    _same("randk:density=0.05", strided)
    _same("dgc:density=0.5", [torch.zeros(0), torch.zeros(0)])   # empty tensor


def test_sparsify_threshold_walk_equals_select(host):
    """sparsify.select's indices = DGC.select(|v|, k, key) for the reference's sample, for
    exact_k on and off, over inputs whose first threshold lets too few through."""
    be = host.backend
    g = torch.Generator().manual_seed(9)
    for n in (50, 1000, 20_000):
        for exact in (True, False):
            c = hvdcomp.get(f"dgc:density=0.05,sample_ratio=0.01,exact_k={exact}")
            for trial in range(6):
                x = torch.randn(n, generator=g) ** 3
                k = num_selected(0.05, n)
                key = TensorKey("w", trial, 1, 0, 4, 5)
                ref = c.select(x.abs(), k, key)
                s = min(n, max(1, math.ceil(0.01 * n)))
                res = sparsify.select.kernels(be, x, k, sample_size=s, exact=exact,
                                              key4=(key.seed, key.rank, key.tensor_id,
                                                    key.step))
                assert torch.equal(res.idx, ref)
                _bits_equal(res.vals, x[ref])


# ---- GPU ----------------------------------------------------------------------------------

@pytest.mark.requires_cuda
@pytest.mark.parametrize("spec", ["dgc:density=0.001", "dgc:density=0.01,values=fp16",
                                  "dgc:density=0.02,exact_k=False,clip_norm=0.01",
                                  "dgc:density=0.01,accumulate=False",
                                  "topk:density=0.01", "randk:density=0.05,unbiased=True",
                                  # quantized values: the GPU sender's residual must hold
                                  # exactly what the (host) receivers decode
                                  "topk:density=0.01,values=int4",
                                  "dgc:density=0.01,values=int8",
                                  "randk:density=0.05,values=int8"])
def test_gpu_equals_reference(cuda_backend, spec):
    grads = _grads((300, 257), 3)
    mom = 0.9 if spec.startswith("dgc") else None
    with _reference():
        ref = _run(spec, grads, mom)
    got = _run(spec, [g.cuda() for g in grads], mom, decode=False)
    assert got[0] == ref[0]
    for a, b in zip(got[1], ref[1]):
        for part in a:
            for name in a[part]:
                _bits_equal(a[part][name].cpu(), b[part][name])
    c = hvdcomp.get(spec)
    key = TensorKey("w", 3, 0, 1, 4, 11)
    out = torch.zeros(grads[0].numel(), device="cuda")
    c.decode(Message.from_bytes(ref[0][0]), key, out)
    _bits_equal(out.cpu(), ref[2][0])


@pytest.mark.requires_cuda
def test_gpu_kernels_equal_host(cuda_backend, host):
    be = cuda_backend.backend
    for n, g, uo, vo in _cases():
        ru, rv = _ref_v(g, uo, vo, 0.37, 0.5)
        gc, uc, vc = g.cuda(), uo.cuda(), vo.cuda()
        u_out, v_out = torch.empty(n, device="cuda"), torch.empty(n, device="cuda")
        cnt = sparsify.launch_accumulate(be, gc, u_old=uc, v_old=vc, scale=0.37,
                                         momentum=0.5, u_out=u_out, v_out=v_out, t1=1e-3,
                                         t2=0.0)
        _bits_equal(u_out.cpu(), ru)
        _bits_equal(v_out.cpu(), rv)
        assert int(cnt[0].sum()) == int(((rv.abs() >= 1e-3) & (rv != 0)).sum())
        smp = sparsify.launch_sample(be, gc, max(1, n // 10), KEY4, u_old=uc, v_old=vc,
                                     scale=0.37, momentum=0.5)
        smp_h = sparsify.launch_sample(host.backend, g, max(1, n // 10), KEY4, u_old=uo,
                                       v_old=vo, scale=0.37, momentum=0.5)
        _bits_equal(smp.cpu(), smp_h)
        assert sparsify.sumsq.kernels(be, gc) == sparsify.sumsq.kernels(host.backend, g)


def test_sparsify_walks_past_both_thresholds(host, monkeypatch):
    """Keys whose sample overshoots twice (t1 and t2 both let fewer than k through): the
    walk continues with further counting passes; the result is still DGC.select's."""
    be = host.backend
    n, k, ratio = 64, 8, 0.5
    c = hvdcomp.get(f"dgc:density={k / n},sample_ratio={ratio}")
    x = torch.randn(n, generator=torch.Generator().manual_seed(2))
    s = min(n, max(1, math.ceil(ratio * n)))
    calls = []
    real = be.launch
    monkeypatch.setattr(be, "launch", lambda *a: (calls.append(a[0]), real(*a)))
    walked = 0
    for seed in range(400):
        key = TensorKey("w", 1, 2, 0, 4, seed)
        calls.clear()
        res = sparsify.select.kernels(be, x, k, sample_size=s, exact=True,
                                      key4=(key.seed, key.rank, key.tensor_id, key.step))
        walked += calls.count("hvd_dgc_accumulate") > 1
        ref = c.select(x.abs(), k, key)
        assert torch.equal(res.idx, ref), seed
        _bits_equal(res.vals, x[ref])
    assert walked >= 3, walked
