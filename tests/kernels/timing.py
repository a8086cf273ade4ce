"""Encode / decode timing of the kernel path against the PyTorch reference, same device,
same process (not a test: run it directly; launch/gpu-check runs it on a GPU).

    python tests/kernels/timing.py --device cpu  --sizes 25000000 --threads 1,2 --json t.json
    python tests/kernels/timing.py --device cuda --sizes 25000000,1000000 --json t.json

Paths, for one fp32 gradient of n elements (bits, bucket size, norm as given):
  reference  encode: quantize.quantize.reference (uniforms + quantize_reference + pack_bits)
             decode: quantize.dequantize_add.reference (unpack_bits + dequantize_reference
             + out.add_)
  kernel     encode: quantize.quantize.kernels (norm kernel + quantize/pack kernel)
             decode: quantize.dequantize_add.kernels (unpack/dequantize/accumulate kernel)
  (hvdcomp.ops.quantize; BucketQuantizer's encode / decode call these ops)
  copy       (cuda) a device-to-device copy of the gradient's n*4 bytes: the memory floor
Each size is also checked: packed codes identical to the reference's given the reference's
norms, decode of the reference's message bit-identical, the kernel's own L2 norms within 1
ulp (and whether they, and so the bytes, are identical outright).  Times: median of --repeats after a warm-up
(GPU: CUDA events on the current stream; CPU: wall clock, plus the process CPU time, since
a shared machine's wall clock includes waiting for a core).
"""
import argparse
import json
import os
import platform
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

from hvdcomp import levels as L  # noqa: E402
from hvdcomp.ops import quantize  # noqa: E402

KEY = dict(seed=11, rank=2, tensor_id=3, step=7)


def _timer(device):
    if device == "cuda":
        def run(fn, repeats):
            times = []
            for _ in range(repeats):
                a = torch.cuda.Event(enable_timing=True)
                b = torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b) / 1e3)
            return times, None
        return run

    def run(fn, repeats):
        times, cpu = [], []
        for _ in range(repeats):
            t, c = time.perf_counter(), time.process_time()
            fn()
            times.append(time.perf_counter() - t)
            cpu.append(time.process_time() - c)
        return times, cpu
    return run


def measure(device, n, bits, bucket_size, norm, threads, repeats, ref_repeats, backend):
    timer = _timer(device)
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=g).to(device)
    lv = torch.tensor(L.exponential_levels(bits, 0.5), dtype=torch.float32, device=device)
    rows = []

    be = backend.backend

    def ref_encode():
        return quantize.quantize.reference(x, lv, bits, bucket_size, norm, **KEY)

    def kernel_encode():
        return quantize.quantize.kernels(be, x, lv, bits, bucket_size, norm, **KEY)

    rn, rp = ref_encode()
    kn, kp = kernel_encode()
    # the guarantees: codes and decode bit-exact given the same norms; L2 norms within 1 ulp
    norms_equal = bool(torch.equal(rn, kn))
    norms_max_ulp = int((rn.view(torch.int32).long() - kn.view(torch.int32).long())
                        .abs().max()) if rn.numel() else 0
    kp_given = quantize.quantize_pack.kernels(be, x, rn, lv, bits, bucket_size, **KEY)
    bytes_equal = bool(torch.equal(rp, kp_given))
    out_r = torch.zeros(n, device=device)
    out_k = torch.zeros(n, device=device)

    def ref_decode():
        quantize.dequantize_add.reference(rp, n, rn, lv, bits, bucket_size, out_r)

    def kernel_decode():
        quantize.dequantize_add.kernels(be, kp, n, kn, lv, bits, bucket_size, out_k)

    ref_decode()
    quantize.dequantize_add.kernels(be, rp, n, rn, lv, bits, bucket_size, out_k)  # ref's message
    decode_equal = bool(torch.equal(out_r, out_k))
    out_r.zero_()
    out_k.zero_()

    cases = [("encode", "reference", ref_encode, ref_repeats),
             ("encode", "kernel", kernel_encode, repeats),
             ("decode", "reference", ref_decode, ref_repeats),
             ("decode", "kernel", kernel_decode, repeats)]
    if device == "cuda":
        dst = torch.empty_like(x)
        cases.append(("copy", "d2d_copy", lambda: dst.copy_(x), repeats))
    for op, path, fn, reps in cases:
        fn()                                        # warm-up (and, for cuda, lazy compile)
        if device == "cuda":
            torch.cuda.synchronize()
        times, cpu = timer(fn, reps)
        row = dict(n=n, op=op, path=path, threads=threads, repeats=reps,
                   median_s=statistics.median(times), min_s=min(times),
                   input_gbps=n * 4 / statistics.median(times) / 1e9)
        if cpu is not None:
            row["cpu_median_s"] = statistics.median(cpu)
        rows.append(row)
    check = dict(n=n, threads=threads, norms_identical=norms_equal,
                 norms_max_ulp=norms_max_ulp,
                 packed_identical_given_norms=bytes_equal,
                 packed_identical_own_norms=bool(torch.equal(rp, kp)),
                 decode_identical=decode_equal)
    return rows, check


def ratios(rows):
    out = []
    keyf = lambda r: (r["n"], r["threads"], r["op"])  # noqa: E731
    by = {}
    for r in rows:
        by.setdefault(keyf(r), {})[r["path"]] = r
    for (n, th, op), d in sorted(by.items(), key=lambda kv: (kv[0][0], str(kv[0][1]),
                                                            kv[0][2])):
        if "reference" in d and "kernel" in d:
            item = dict(n=n, threads=th, op=op,
                        speedup_wall=d["reference"]["median_s"] / d["kernel"]["median_s"])
            if "cpu_median_s" in d["kernel"]:
                item["speedup_cpu"] = (d["reference"]["cpu_median_s"]
                                       / max(d["kernel"]["cpu_median_s"], 1e-9))
            out.append(item)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--sizes", default="25000000,1000000")
    ap.add_argument("--bits", type=int, default=3)
    ap.add_argument("--bucket-size", type=int, default=8192)
    ap.add_argument("--norm", default="l2", choices=("l2", "linf"))
    ap.add_argument("--threads", default="", help="CPU: comma list of thread counts")
    ap.add_argument("--repeats", type=int, default=0, help="default: 20 cuda, 3 cpu")
    ap.add_argument("--ref-repeats", type=int, default=0, help="default: 20 cuda, 1 cpu")
    ap.add_argument("--json", default="")
    a = ap.parse_args(argv)

    if a.device == "cuda":
        from hvdcomp.backends import cuda as backend
        backend.require()
        t0 = time.perf_counter()
        backend.compile_all()
        compile_s = time.perf_counter() - t0
        threads_list = [None]
    else:
        from hvdcomp.backends import host as backend
        t0 = time.perf_counter()
        backend.load()
        compile_s = time.perf_counter() - t0
        threads_list = [int(t) for t in a.threads.split(",") if t] or [torch.get_num_threads()]
    repeats = a.repeats or (20 if a.device == "cuda" else 3)
    ref_repeats = a.ref_repeats or (20 if a.device == "cuda" else 1)

    rows, checks = [], []
    for n in [int(s) for s in a.sizes.split(",") if s]:
        for th in threads_list:
            if th is not None:
                torch.set_num_threads(th)
                backend.set_num_threads(th)
            r, c = measure(a.device, n, a.bits, a.bucket_size, a.norm, th, repeats,
                           ref_repeats, backend)
            rows += r
            checks.append(c)
            for row in r:
                extra = (f"  cpu {row['cpu_median_s'] * 1e3:9.2f} ms"
                         if "cpu_median_s" in row else "")
                print(f"n={n:>10} threads={th!s:>4} {row['op']:6} {row['path']:9} "
                      f"{row['median_s'] * 1e3:10.3f} ms  {row['input_gbps']:8.2f} GB/s{extra}",
                      flush=True)
            print(f"  identical: {c}", flush=True)
    summary = dict(
        device=a.device,
        device_name=(torch.cuda.get_device_name() if a.device == "cuda"
                     else platform.processor() or platform.machine()),
        cpu_count=os.cpu_count(),
        torch=torch.__version__,
        cupy=(__import__("cupy").__version__ if a.device == "cuda" else None),
        host_openmp=(backend.openmp_version() if a.device == "cpu" else None),
        compile_or_load_s=compile_s,
        config=dict(bits=a.bits, bucket_size=a.bucket_size, norm=a.norm, key=KEY),
        results=rows, speedups=ratios(rows), checks=checks,
        all_identical=all(c["packed_identical_given_norms"] and c["decode_identical"]
                          and c["norms_max_ulp"] <= 1 for c in checks),
    )
    for s in summary["speedups"]:
        print(f"speedup n={s['n']} threads={s['threads']} {s['op']}: "
              f"{s['speedup_wall']:.1f}x wall"
              + (f", {s['speedup_cpu']:.1f}x cpu" if "speedup_cpu" in s else ""))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(summary, f, indent=1)
    return 0 if summary["all_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
