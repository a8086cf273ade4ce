"""25M-element timing of the ALQ/AMQ statistics kernels (kernels/stats.cu) and LAQ's innovation
quantizer (kernels/laq.cu) against their PyTorch references, host build, 1 thread (not a test:
run by hand from the repository root: python tests/kernels/timing_stats_laq.py).  Times are
process CPU time (min of 3 kernel runs, 1 reference run), robust on a shared machine; each
line also says whether the results are identical (LAQ) or how close (statistics).
"""
import sys, time, torch, numpy as np
sys.path.insert(0, __import__('os').path.dirname(__import__('os').path.dirname(__import__('os').path.dirname(__import__('os').path.abspath(__file__)))))
from hvdcomp.backends import host
from hvdcomp.ops import laq, level_stats
from hvdcomp.ops.laq import quantize_innovation, dequantize_innovation, fixed_sum
from hvdcomp.ops.bitpack import pack_bits, unpack_bits
torch.set_num_threads(1); host.set_num_threads(1); host.load()
n = 25_000_000
g = torch.Generator().manual_seed(0)
x = torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g))
q = x + 0.1 * torch.randn(n, generator=g)
def t(fn, reps=3):
    fn(); ts=[]
    for _ in range(reps):
        a=time.process_time(); r=fn(); ts.append(time.process_time()-a)
    return min(ts), r
for norm in ("l2",):
    tr, r = t(lambda: level_stats.histogram_stats.reference(x, 8192, norm).numpy(), 1)
    tk, k = t(lambda: level_stats.histogram_stats.kernels(host.backend, x, 8192, norm).numpy())
    print(f"hist {norm}: ref {tr*1e3:.0f} ms kernel {tk*1e3:.0f} ms speedup {tr/tk:.1f}x maxrel {np.max(np.abs(k-r)/np.maximum(np.abs(r),1e-300)):.2e}")
    tr, r = t(lambda: level_stats.bucket_stats.reference(x, 8192, norm).numpy(), 1)
    tk, k = t(lambda: level_stats.bucket_stats.kernels(host.backend, x, 8192, norm).numpy())
    print(f"normal {norm}: ref {tr*1e3:.0f} ms kernel {tk*1e3:.0f} ms speedup {tr/tk:.1f}x rel {np.abs(k-r)/np.abs(r)}")
bits = 4
def ref_enc():
    v = x - q
    assert bool(torch.isfinite(v).all())
    R, codes = quantize_innovation(v, bits)
    d = dequantize_innovation(R, codes, bits)
    qn = q + d
    return R, pack_bits(codes, bits), qn, fixed_sum((qn - x).double().pow(2)), fixed_sum(d.double().pow(2))
tr, r = t(ref_enc, 1)
tk, k = t(lambda: laq.encode_innovation.kernels(host.backend, x, q, bits))
same = bool(torch.equal(r[1], k.packed)) and bool(torch.equal(r[2], k.qnew)) and r[3]==k.eps_sq and r[4]==k.delta_sq and float(r[0])==float(k.R)
print(f"laq encode: ref {tr*1e3:.0f} ms kernel {tk*1e3:.0f} ms speedup {tr/tk:.1f}x identical={same}")
out_r = torch.zeros(n); out_k = torch.zeros(n)
tr, _ = t(lambda: out_r.add_(dequantize_innovation(r[0], unpack_bits(r[1], n, bits), bits)), 1)
tk, _ = t(lambda: laq.dequantize_add.kernels(host.backend, r[1], n, float(r[0]), bits, out_k))
o1 = torch.zeros(n).add_(dequantize_innovation(r[0], unpack_bits(r[1], n, bits), bits))
o2 = laq.dequantize_add.kernels(host.backend, r[1], n, float(r[0]), bits, torch.zeros(n))
print(f"laq decode: ref {tr*1e3:.0f} ms kernel {tk*1e3:.0f} ms speedup {tr/tk:.1f}x identical={bool(torch.equal(o1,o2))}")
