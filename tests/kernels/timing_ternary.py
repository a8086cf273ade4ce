"""TernGrad / EF-SignSGD encode and decode timing, kernels (kernels/ternary.cu) against the
PyTorch reference, through the compressors themselves (not a test: run it directly).

    python tests/kernels/timing_ternary.py [--n 25000000] [--threads 1] [--specs terngrad,signef]

For each spec: one compressor per path (HVDCOMP_BACKEND=reference / kernels); a warm-up
encode (for signef it creates the residual), then the median of --repeats encodes (the
reference: 1) and decodes, wall clock and process CPU time (a shared machine's wall clock
includes waiting for a core).  Checks that both paths give identical message bytes over two
steps, identical decodes and identical residuals.
"""
import argparse
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
from hvdcomp import backends  # noqa: E402
from hvdcomp.backends import host  # noqa: E402
from hvdcomp.compressors.base import TensorKey  # noqa: E402
from hvdcomp.wire import Message  # noqa: E402


def timed(fn, repeats):
    wall, cpu = [], []
    for _ in range(repeats):
        t, c = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
    return statistics.median(wall), statistics.median(cpu)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=25_000_000)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--specs", default="terngrad,terngrad:bucket_size=8192,signef,"
                                        "signef:bucket_size=8192")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    host.load()
    host.set_num_threads(a.threads)
    x = torch.randn(a.n, generator=torch.Generator().manual_seed(5))
    key = TensorKey("w", 3, 7, 2, 4, 11)
    ok = True
    for spec in a.specs.split(","):
        res = {}
        for mode, reps in (("reference", 1), ("kernels", a.repeats)):
            os.environ["HVDCOMP_BACKEND"] = mode
            backends._choice.clear()
            comp = hvdcomp.get(spec)
            m = comp.encode(x, key)
            enc = timed(lambda: comp.encode(x, key), reps)
            out = torch.zeros(a.n)
            dec = timed(lambda: comp.decode(m, key, out), reps)
            c2 = hvdcomp.get(spec)
            msgs = [c2.encode(x, key).to_bytes(), c2.encode(x, key).to_bytes()]
            o = torch.zeros(a.n)
            c2.decode(Message.from_bytes(msgs[1]), key, o)
            res[mode] = (enc, dec, msgs, o, c2.state_dict().get("residuals", {}))
        r, k = res["reference"], res["kernels"]
        same = (r[2] == k[2] and torch.equal(r[3], k[3])
                and all(torch.equal(r[4][q], k[4][q]) for q in r[4]))
        ok &= same
        print(f"{spec:26s} n={a.n} threads={a.threads}  "
              f"encode ref {r[0][0]*1e3:8.1f} ms (cpu {r[0][1]*1e3:8.1f}) "
              f"kernels {k[0][0]*1e3:7.1f} ms (cpu {k[0][1]*1e3:7.1f})  "
              f"x{r[0][0]/k[0][0]:5.1f} wall x{r[0][1]/k[0][1]:5.1f} cpu | "
              f"decode ref {r[1][0]*1e3:7.1f} ms (cpu {r[1][1]*1e3:7.1f}) "
              f"kernels {k[1][0]*1e3:6.1f} ms (cpu {k[1][1]*1e3:6.1f})  "
              f"x{r[1][0]/k[1][0]:5.1f} wall x{r[1][1]/k[1][1]:5.1f} cpu | identical {same}",
              flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
