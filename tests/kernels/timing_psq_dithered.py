"""Encode / decode timing of PSQ, BHQ, DQSG and NDQSG through the compressors: the kernel path
(HVDCOMP_BACKEND=kernels) against the PyTorch reference (HVDCOMP_BACKEND=reference), same
device, same process, and a check that the message bytes and the decoded sums are identical.
Not a test: run it directly.

    python tests/kernels/timing_psq_dithered.py --device cpu --n 25000000 --threads 1

encode: compressor.encode(grad, key) (message built, sections on the CPU);
decode: PSQ/BHQ/DQSG decode of one message into a float32 accumulator; NDQSG: combine of a
2-rank exchange (one DQSG-group message, one nested message: coset resolution, checks).
Times: median of --repeats wall-clock runs after a warm-up (GPU: synchronized), plus CPU time.
"""
import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

import hvdcomp  # noqa: E402
import hvdcomp.backends as B  # noqa: E402
from hvdcomp.compressors.base import TensorKey  # noqa: E402

SPECS = ["psq:bits=4", "bhq:bits=4,block_size=8", "dqsg:bits=4,bucket_size=512",
         "ndqsg:bits=4,nested_bits=2,bucket_size=512"]


def _mode(mode):
    os.environ["HVDCOMP_BACKEND"] = mode
    B._choice.clear()


def _time(fn, repeats, device):
    fn()
    walls, cpus = [], []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        t, c = time.perf_counter(), time.process_time()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        walls.append(time.perf_counter() - t)
        cpus.append(time.process_time() - c)
    return statistics.median(walls), statistics.median(cpus)


def measure(spec, n, device, repeats, ref_repeats):
    g = torch.Generator().manual_seed(1)
    rows = 2500 if n % 2500 == 0 else 1
    base = torch.randn(rows, n // rows, generator=g)
    if spec.startswith("bhq"):
        base = base * torch.logspace(-2, 2, rows).unsqueeze(1)     # rows of different ranges
    ndqsg = spec.startswith("ndqsg")
    world = 2 if ndqsg else 1
    grads = [(base + 0.001 * r * torch.randn(base.shape, generator=g)).to(device)
             for r in range(world)]
    keys = [TensorKey("w", 3, 7, r, world, 11) for r in range(world)]
    res = {}
    for mode, reps in (("reference", ref_repeats), ("kernels", repeats)):
        _mode(mode)
        c = hvdcomp.get(spec)
        enc = lambda: c.encode(grads[-1], keys[-1])  # noqa: E731  (nested rank for NDQSG)
        msgs = [c.encode(gr, k) for gr, k in zip(grads, keys)]
        acc = torch.zeros(n, device=device)
        if ndqsg:
            dec = lambda: c.combine(msgs, keys, acc)  # noqa: E731
        else:
            dec = lambda: c.decode(msgs[0], keys[0], acc)  # noqa: E731
        te = _time(enc, reps, device)
        acc.zero_()
        td = _time(dec, reps, device)
        acc.zero_()
        dec()
        res[mode] = dict(encode=te, decode=td, bytes=[m.to_bytes() for m in msgs],
                         acc=acc.cpu().clone(), events=list(getattr(c, "_events", [])))
    r, k = res["reference"], res["kernels"]
    out = dict(spec=spec, n=n, device=device, threads=torch.get_num_threads(),
               identical_bytes=r["bytes"] == k["bytes"],
               identical_decode=torch.equal(r["acc"].view(torch.int32), k["acc"].view(torch.int32)))
    for op in ("encode", "decode"):
        out[op] = dict(reference_s=r[op][0], kernel_s=k[op][0], reference_cpu_s=r[op][1],
                       kernel_cpu_s=k[op][1], speedup_wall=r[op][0] / k[op][0],
                       speedup_cpu=r[op][1] / max(k[op][1], 1e-9))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--n", type=int, default=25_000_000)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--specs", default=",".join(SPECS), help="';'-separated specs")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--ref-repeats", type=int, default=1)
    ap.add_argument("--json", default="")
    a = ap.parse_args(argv)
    if a.device == "cpu":
        from hvdcomp.backends import host
        host.load()
        host.set_num_threads(a.threads)
        torch.set_num_threads(a.threads)
    specs = a.specs.split(";") if ";" in a.specs else (
        SPECS if a.specs == ",".join(SPECS) else [a.specs])
    results = []
    for spec in specs:
        r = measure(spec, a.n, a.device, a.repeats, a.ref_repeats)
        results.append(r)
        print(f"{spec:45} n={a.n} threads={a.threads} bytes identical={r['identical_bytes']} "
              f"decode identical={r['identical_decode']}")
        for op in ("encode", "decode"):
            o = r[op]
            print(f"   {op}: reference {o['reference_s'] * 1e3:9.1f} ms  kernel "
                  f"{o['kernel_s'] * 1e3:8.1f} ms  speedup {o['speedup_wall']:6.1f}x wall, "
                  f"{o['speedup_cpu']:6.1f}x cpu", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0 if all(r["identical_bytes"] and r["identical_decode"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
