"""Timing of the codec kernels against their NumPy references (not a test: run directly).

    python tests/kernels/timing_codecs.py --device cpu --threads 1
    python tests/kernels/timing_codecs.py --device cuda

rANS: n 3-bit ALQ codes (NUQSGD's initial table, bucket 8192) of a Gaussian gradient, packed
by the quantize kernel; kernel = encode_codes / decode_codes (packed in, packed out),
reference = unpack_bits + encode_symbols.reference / decode_symbols.reference + pack_bits.
Sparse: m sorted random indices out of numel; kernel = rice.encode.kernels / decode.kernels
(numpy bytes out / in), reference = rice.encode.reference / decode.reference.
Bytes are checked identical.  Times: best of --repeats, wall clock (GPU: synchronized).
"""
import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402
import torch  # noqa: E402

from hvdcomp import levels as L  # noqa: E402
from hvdcomp.backends import for_device  # noqa: E402
from hvdcomp.ops.bitpack import pack_bits, unpack_bits  # noqa: E402
from hvdcomp.ops import rans, rice  # noqa: E402


def best(fn, repeats, sync):
    ts, v = [], None
    for _ in range(repeats):
        sync()
        t = time.perf_counter()
        v = fn()
        sync()
        ts.append(time.perf_counter() - t)
    return min(ts), v


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--n", type=int, default=25_000_000)
    ap.add_argument("--m", type=int, default=25_000)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    dev = torch.device(a.device)
    mod = for_device(dev)
    if dev.type == "cpu":
        mod.set_num_threads(a.threads)
    be = mod.backend
    sync = (lambda: torch.cuda.synchronize()) if dev.type == "cuda" else (lambda: None)
    n = a.n
    x = torch.randn(n, generator=torch.Generator().manual_seed(0)).to(dev)
    lv = torch.tensor(L.exponential_levels(3, 0.5), dtype=torch.float32, device=dev)
    _, packed = mod.quantize(x, lv, 3, 8192, "l2", seed=1, rank=0, tensor_id=0, step=0)
    pk_cpu = packed.cpu()
    rans.encode_codes.kernels(be, packed, n, 3, 8)           # warm-up (compilation)
    te, sec = best(lambda: rans.encode_codes.kernels(be, packed, n, 3, 8).cpu().numpy(),
                   a.repeats, sync)
    tre, ref = best(lambda: rans.encode_symbols.reference(unpack_bits(pk_cpu, n, 3).numpy(), 8),
                    1, sync)
    td, dec = best(lambda: rans.decode_codes.kernels(be, sec, n, 3, 8, device=dev), a.repeats,
                   sync)
    trd, dref = best(lambda: pack_bits(torch.from_numpy(rans.decode_symbols.reference(ref, n, 8)),
                                       3), 1, sync)
    print(f"rANS {n} 3-bit codes, {a.device}, {a.threads} thread(s): section {sec.size} bytes "
          f"({8 * sec.size / n:.3f} bits/symbol), identical: {sec.tobytes() == ref.tobytes()}"
          f" / decode identical: {torch.equal(dec.cpu(), pk_cpu) and torch.equal(dref, pk_cpu)}")
    print(f"  encode kernel {te * 1e3:9.2f} ms  reference {tre * 1e3:9.2f} ms  x{tre / te:.1f}")
    print(f"  decode kernel {td * 1e3:9.2f} ms  reference {trd * 1e3:9.2f} ms  x{trd / td:.1f}")
    rng = np.random.default_rng(1)
    numel = n
    idx = np.sort(rng.choice(numel, a.m, replace=False)).astype(np.int64)
    it = torch.from_numpy(idx).to(dev)
    rice.encode.kernels(be, it, numel)
    r = max(a.repeats, 20)
    te, sec = best(lambda: rice.encode.kernels(be, it, numel).cpu().numpy(), r, sync)
    tre, ref = best(lambda: rice.encode.reference(idx, numel).numpy(), r, sync)
    td, dec = best(lambda: rice.decode.kernels(be, sec, numel, device=dev).cpu().numpy(), r,
                   sync)
    trd, dref = best(lambda: rice.decode.reference(ref, numel).numpy(), r, sync)
    print(f"sparse {a.m} of {numel} indices: section {sec.size} bytes, identical: "
          f"{sec.tobytes() == ref.tobytes()} / decode identical: "
          f"{np.array_equal(dec, idx) and np.array_equal(dref, idx)}")
    print(f"  encode kernel {te * 1e3:9.3f} ms  reference {tre * 1e3:9.3f} ms  x{tre / te:.1f}")
    print(f"  decode kernel {td * 1e3:9.3f} ms  reference {trd * 1e3:9.3f} ms  x{trd / td:.1f}")


if __name__ == "__main__":
    main()
