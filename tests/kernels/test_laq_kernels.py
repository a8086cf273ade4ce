"""LAQ's innovation quantizer on the kernels (kernels/laq.cu) against the PyTorch
specification, bit for bit (hvdcomp.ops.laq: each op's kernel implementation against its
reference).

Everything is exact: the codes (packed), R, Qnew, and the two float64 squared norms
||Qnew - x||^2 and ||delta||^2, which the reference sums in laq.fixed_sum's fixed order (the
same as the kernels'), so the lazy rule's decisions and the stored state (Qprev, eps_hat_sq)
are identical whichever path runs.  Decode: out + dequantize_innovation(...), bit for bit.
"""
import math

import numpy as np
import pytest
import torch

import hvdcomp
from hvdcomp import backends
from hvdcomp.ops.bitpack import pack_bits, unpack_bits
from hvdcomp.ops import laq
from hvdcomp.ops.laq import dequantize_innovation, fixed_sum, quantize_innovation

from kernel_cases import same_bits

SIZES = (1, 7, 8, 9, 1000, 2047, 2048, 2049, 8193, 100_003)
BITS = tuple(range(1, 9))


def ref(x, q, bits):
    """(R, packed, qnew, eps_sq, delta_sq) of the reference (LAQ.encode's computation)."""
    qq = torch.zeros_like(x) if q is None else q
    v = x - qq
    R, codes = quantize_innovation(v, bits)
    delta = dequantize_innovation(R, codes, bits)
    qnew = qq + delta
    return (R, pack_bits(codes, bits), qnew, fixed_sum((qnew - x).double().pow(2)),
            fixed_sum(delta.double().pow(2)))


def innovation_inputs(n, seed):
    """(x, q): heavy-tailed gradients, q a previous quantized gradient of similar scale, with
    zeros of both signs, denormals and coordinates where x == q."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp(2.0 * torch.randn(n, generator=g))
    q = x + 0.3 * torch.randn(n, generator=g)
    x[::7] = 0.0
    x[3::11] = -0.0
    x[5::13] *= 1e-39
    q[2::9] = x[2::9]                     # zero innovation coordinates
    q[4::17] = -0.0
    return x.float(), q.float()


def check_same(got, want):
    R, packed, qnew, e, d = want
    assert same_bits(got.R.reshape(1), R.reshape(1))
    assert torch.equal(got.packed, packed)
    assert same_bits(got.qnew, qnew)
    assert got.eps_sq == e and got.delta_sq == d, (got.eps_sq, e, got.delta_sq, d)


@pytest.mark.parametrize("bits", BITS)
def test_encode_matches_reference(host, bits):
    for n in SIZES:
        x, q = innovation_inputs(n, seed=n * 13 + bits)
        for qq in (None, q):
            got = laq.encode_innovation.kernels(host.backend, x, qq, bits)
            check_same(got, ref(x, qq, bits))


def test_encode_large_three_summation_stages(host):
    # > 2048 * 2048 coordinates: fixed_sum needs three stages (chunks of chunk sums)
    n = 2048 * 2048 + 4099
    x, q = innovation_inputs(n, seed=5)
    for bits in (1, 4):
        check_same(laq.encode_innovation.kernels(host.backend, x, q, bits), ref(x, q, bits))


def test_special_values(host):
    for bits in (1, 3, 8):
        z = torch.zeros(37)
        check_same(laq.encode_innovation.kernels(host.backend, z, None, bits),
                   ref(z, None, bits))                                               # R = 0
        x = torch.randn(37)
        check_same(laq.encode_innovation.kernels(host.backend, x, x.clone(), bits),
                   ref(x, x.clone(), bits))                                          # x == q
        nz = -torch.zeros(37)
        check_same(laq.encode_innovation.kernels(host.backend, nz, None, bits),
                   ref(nz, None, bits))
        tiny = torch.full((37,), 1e-45) * torch.sign(torch.randn(37))               # denormal R
        check_same(laq.encode_innovation.kernels(host.backend, tiny, None, bits),
                   ref(tiny, None, bits))
        big = torch.randn(37) * 1e38                                                # huge, finite
        check_same(laq.encode_innovation.kernels(host.backend, big, None, bits),
                   ref(big, None, bits))
        # ties: v exactly halfway between grid points (R = 3, L = 2**bits - 1)
        L = (1 << bits) - 1
        j = torch.arange(L, dtype=torch.float64)
        half = (-3.0 + (2 * j + 1) * 3.0 / L).float()
        half = torch.cat([half, torch.tensor([3.0, -3.0])])
        check_same(laq.encode_innovation.kernels(host.backend, half, None, bits),
                   ref(half, None, bits))


def test_nonfinite_innovations_are_refused(host):
    for bad in (float("nan"), float("inf"), -float("inf")):
        x = torch.randn(3000)
        x[2500] = bad
        assert laq.encode_innovation.kernels(host.backend, x, None, 4) is None
    x = torch.full((10,), 3e38)
    q = torch.full((10,), -3e38)                         # x - q overflows float32
    assert not bool(torch.isfinite(x - q).all())
    assert laq.encode_innovation.kernels(host.backend, x, q, 4) is None


def test_empty(host):
    got = laq.encode_innovation.kernels(host.backend, torch.zeros(0), None, 3)
    check_same(got, ref(torch.zeros(0), None, 3))
    out = torch.zeros(0)
    laq.dequantize_add.kernels(host.backend, torch.zeros(0, dtype=torch.uint8), 0, 1.0, 3, out)


@pytest.mark.parametrize("bits", BITS)
def test_dequantize_add_matches_reference(host, bits):
    for n in (1, 7, 9, 1000, 8193):
        g = torch.Generator().manual_seed(n + 100 * bits)
        codes = torch.randint(0, 1 << bits, (n,), generator=g)
        R = torch.tensor(float(torch.rand(1, generator=g)) * 7.0, dtype=torch.float32)
        acc = torch.randn(n, generator=g)
        want = acc + dequantize_innovation(R, codes, bits)
        got = laq.dequantize_add.kernels(host.backend, pack_bits(codes, bits), n, float(R),
                                         bits, acc.clone())
        assert same_bits(got, want)


def test_fixed_sum_is_a_sum_in_a_fixed_order():
    # the specification itself: close to the exact sum, independent of the thread count
    g = torch.Generator().manual_seed(1)
    for n in (0, 1, 5, 2048, 2049, 300_001):
        t = torch.rand(n, generator=g, dtype=torch.float64) ** 3
        exact = math.fsum(t.tolist())
        assert abs(fixed_sum(t) - exact) <= 1e-13 * max(exact, 1e-300)
    t = torch.rand(100_000, generator=g, dtype=torch.float64)
    nt = torch.get_num_threads()
    try:
        vals = set()
        for th in (1, 2):
            torch.set_num_threads(th)
            vals.add(fixed_sum(t))
    finally:
        torch.set_num_threads(nt)
    assert len(vals) == 1


def test_thread_count_does_not_change_anything(host):
    x, q = innovation_inputs(300_000, seed=9)
    outs = []
    for th in (1, 2, 3):
        host.set_num_threads(th)
        try:
            outs.append(laq.encode_innovation.kernels(host.backend, x, q, 5))
        finally:
            host.set_num_threads(None)
    for o in outs[1:]:
        check_same(o, (outs[0].R, outs[0].packed, outs[0].qnew, outs[0].eps_sq,
                       outs[0].delta_sq))


def test_argument_checks(host):
    x = torch.randn(10)
    with pytest.raises(ValueError):
        laq.encode_innovation.kernels(host.backend, x, None, 0)
    with pytest.raises(ValueError):
        laq.encode_innovation.kernels(host.backend, x, None, 9)
    with pytest.raises(TypeError):
        laq.encode_innovation.kernels(host.backend, x.double(), None, 3)
    with pytest.raises(ValueError):
        laq.encode_innovation.kernels(host.backend, x, torch.randn(11), 3)
    with pytest.raises(TypeError):
        laq.encode_innovation.kernels(host.backend, x, None, True)
    with pytest.raises(ValueError):
        laq.dequantize_add.kernels(host.backend, torch.zeros(3, dtype=torch.uint8), 10, 1.0, 3,
                                   torch.zeros(10))    # 10 codes of 3 bits need 4 bytes
    with pytest.raises(ValueError):
        laq.dequantize_add.kernels(host.backend, torch.zeros(4, dtype=torch.uint8), 10, 1.0, 3,
                                   torch.zeros(9))     # 9 outputs for 10 codes
    # an output the kernel cannot write (not contiguous): the reference serves it
    packed = pack_bits(torch.arange(10) % 8, 3)
    strided = torch.zeros(20)[::2]
    assert laq.dequantize_add.kernels(host.backend, packed, 10, 1.0, 3, strided) is NotImplemented
    want = laq.dequantize_add.kernels(host.backend, packed, 10, 1.0, 3, torch.zeros(10))
    assert same_bits(laq.dequantize_add(packed, 10, 1.0, 3, strided), want)


def test_kernels_reject_bad_geometry(host):
    # the summation order depends on blockDim = 256: anything else is refused, not silent
    x = torch.randn(100)
    out = [torch.empty(100), torch.empty(38, dtype=torch.uint8), torch.empty(2, dtype=torch.float64)]
    with pytest.raises(RuntimeError, match="blockDim"):
        host.backend.launch("hvd_laq_quantize", 1, 128, (x, x, 0, 100, 1.0, 3, *out))
    with pytest.raises(RuntimeError, match="bits"):
        host.backend.launch("hvd_laq_quantize", 1, 256, (x, x, 0, 100, 1.0, 9, *out))


# ---- end to end through the compressor ----------------------------------------------------

def _key(name, step, rank=0, tid=0):
    return hvdcomp.TensorKey(name=name, tensor_id=tid, step=step, rank=rank, world_size=2,
                             seed=3)


def _run(monkeypatch, mode, spec, grads, ranks=2):
    """Drive one LAQ instance per rank for len(grads) steps; returns the wire bytes, the
    combined results and the final state dicts."""
    monkeypatch.setattr(backends, "_choice", {})
    monkeypatch.setenv("HVDCOMP_BACKEND", mode)
    comps = [hvdcomp.get(spec) for _ in range(ranks)]
    wires, outs = [], []
    for step, per_rank in enumerate(grads):
        for name, gs in per_rank.items():
            msgs = []
            for r, c in enumerate(comps):
                m = c.encode(gs[r], _key(name, step, r))
                msgs.append(m)
                wires.append(None if m is None else m.to_bytes())
            for r, c in enumerate(comps):
                keys = [_key(name, step, rr) for rr in range(ranks)]
                o = torch.zeros(gs[0].numel())
                c.combine(msgs, keys, o)
                outs.append(o)
        for c in comps:
            c.after_step(step, 0.01 / (step + 1))
    return wires, outs, [c.state_dict() for c in comps]


def _grads(steps, shapes, dtype=torch.float32, seed=0, noncontig=False):
    g = torch.Generator().manual_seed(seed)
    out = []
    base = {k: torch.randn(*s, generator=g) for k, s in shapes.items()}
    for _ in range(steps):
        per = {}
        for k, s in shapes.items():
            gs = []
            for _r in range(2):
                t = base[k] + 0.05 * torch.randn(*s, generator=g)
                if noncontig and t.dim() == 2:
                    t = t.t()                   # a transposed (non-contiguous) view
                gs.append(t.to(dtype))
            per[k] = gs
        out.append(per)
    return out


@pytest.mark.parametrize("spec,dtype,noncontig", [
    ("laq:bits=4,alpha=0.1", torch.float32, False),
    ("laq:bits=1,alpha=0.5,t_max=3", torch.float32, True),
    ("laq:bits=8,alpha=0.05,stochastic=True", torch.float16, False),
    ("laq:bits=3,alpha=0.1,entropy=True", torch.bfloat16, True),
    ("laq:bits=2,alpha=0.2,split=full", torch.float64, False),
])
def test_compressor_kernels_equal_reference(host, monkeypatch, spec, dtype, noncontig):
    shapes = {"a.weight": (33, 17), "b.bias": (5,), "c": (3, 1, 4099), "d": (1,)}
    grads = _grads(6, shapes, dtype=dtype, seed=len(spec), noncontig=noncontig)
    wk, ok, sk = _run(monkeypatch, "kernels", spec, grads)
    wr, orf, sr = _run(monkeypatch, "reference", spec, grads)
    assert wk == wr                                  # same uploads, skips and bytes
    for a, b in zip(ok, orf):
        assert same_bits(a, b)
    for a, b in zip(sk, sr):
        assert a["history"] == b["history"]
        assert a["tensors"].keys() == b["tensors"].keys()
        for name in a["tensors"]:
            ra, rb = a["tensors"][name], b["tensors"][name]
            for f in ("numel", "eps_hat_sq", "silent", "uploads", "skips"):
                assert ra[f] == rb[f], (name, f)
            for f in ("qprev", "aggregate"):
                if ra[f] is None or rb[f] is None:
                    assert ra[f] is None and rb[f] is None
                else:
                    assert ra[f].shape == rb[f].shape and same_bits(ra[f].reshape(-1),
                                                                    rb[f].reshape(-1))


def test_compressor_skips_and_uploads_through_kernels(host, monkeypatch):
    # a run where the lazy rule both skips and uploads, identical on both paths
    shapes = {"w": (4000,)}
    grads = _grads(8, shapes, seed=4)
    wk, _, _ = _run(monkeypatch, "kernels", "laq:bits=3,alpha=0.01", grads)
    wr, _, _ = _run(monkeypatch, "reference", "laq:bits=3,alpha=0.01", grads)
    assert wk == wr
    assert any(w is None for w in wk) and any(w is not None for w in wk)


def test_compressor_nonfinite_through_kernels(host, monkeypatch):
    g = torch.randn(100)
    g[7] = float("nan")
    msgs = []
    for mode in ("kernels", "reference"):
        monkeypatch.setattr(backends, "_choice", {})
        monkeypatch.setenv("HVDCOMP_BACKEND", mode)
        c = hvdcomp.get("laq:bits=4")
        msgs.append(c.encode(g, _key("w", 0)).to_bytes())
        assert c.qprev("w") is None
    assert msgs[0] == msgs[1]


# ---- GPU ------------------------------------------------------------------------------------

@pytest.mark.requires_cuda
@pytest.mark.parametrize("bits", (1, 3, 8))
def test_gpu_encode_and_decode_match_reference(cuda_backend, bits):
    for n in (1, 9, 2049, 100_003, 2048 * 2048 + 5):
        x, q = innovation_inputs(n, seed=n + bits)
        for qq in (None, q):
            got = laq.encode_innovation.kernels(cuda_backend.backend, x.cuda(),
                                                None if qq is None else qq.cuda(), bits)
            want = ref(x, qq, bits)
            got = laq.Innovation(got.R.cpu(), got.packed.cpu(), got.qnew.cpu(), got.eps_sq,
                                 got.delta_sq)
            check_same(got, want)
        codes = unpack_bits(want[1], n, bits)
        acc = torch.randn(n)
        out = laq.dequantize_add.kernels(cuda_backend.backend, want[1].cuda(), n,
                                         float(want[0]), bits, acc.cuda())
        assert same_bits(out.cpu(), acc + dequantize_innovation(want[0], codes, bits))
    x = torch.randn(1000, device="cuda")
    x[5] = float("nan")
    assert laq.encode_innovation.kernels(cuda_backend.backend, x, None, 4) is None


@pytest.mark.requires_cuda
def test_gpu_compressor_bytes_equal_cpu_reference(cuda_backend, monkeypatch):
    shapes = {"w": (7, 301), "b": (9,)}
    grads = _grads(4, shapes, seed=2)
    gpu = [{k: [t.cuda() for t in v] for k, v in per.items()} for per in grads]
    monkeypatch.setattr(backends, "_choice", {})
    monkeypatch.setenv("HVDCOMP_BACKEND", "kernels")
    cg = hvdcomp.get("laq:bits=4,alpha=0.1")
    monkeypatch.setenv("HVDCOMP_BACKEND", "reference")
    cr = hvdcomp.get("laq:bits=4,alpha=0.1")
    for step, (pg, pc) in enumerate(zip(gpu, grads)):
        for name in pg:
            monkeypatch.setenv("HVDCOMP_BACKEND", "kernels")
            mg = cg.encode(pg[name][0], _key(name, step))
            monkeypatch.setenv("HVDCOMP_BACKEND", "reference")
            mr = cr.encode(pc[name][0], _key(name, step))
            assert (mg is None) == (mr is None)
            if mg is not None:
                assert mg.to_bytes() == mr.to_bytes()
        cg.after_step(step, 0.01)
        cr.after_step(step, 0.01)
    assert np.array_equal(cg.qprev("w").cpu().numpy(), cr.qprev("w").numpy())
