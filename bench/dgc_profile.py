"""DGC's (or top-k's / random-k's) whole CPU path per exchange, kernel path vs the PyTorch
reference, in one process (not a test: run it by hand).

    python bench/dgc_profile.py                                  # ResNet-50 shapes, DGC 0.1 %
    python bench/dgc_profile.py --numel 25000000 --momentum 0.9  # one 25M-element gradient
    python bench/dgc_profile.py --routed         # only what the Exchange compresses (54)
    python bench/dgc_profile.py --spec topk:density=0.001 --reps 5
    python bench/dgc_profile.py --profile [--backend reference]  # cProfile of one exchange

One "exchange" per rep: encode every tensor (bench/shapes.py's ResNet-50: 161 tensors,
25.6M parameters; or one tensor of --numel) with one compressor instance as rank 0 of 4
(N(0, 1e-3) gradients, as bench/exchange.py makes them), serialize each message
(Message.to_bytes), then for each tensor parse 4 messages (rank 0's bytes under ranks
0..3) and combine() them into a fresh float32 accumulator, then finalize().  1 thread
(torch and the host kernels).  Both paths run in this process, alternately (the reference
with HVDCOMP_BACKEND=reference, hvdcomp.backends.use), on their own compressor
instances; every message's bytes, every decoded sum and the final state are compared.
Reported: median encode and decode seconds per exchange, wall clock and process CPU time
(on a shared machine the wall clock includes waiting for a core).
"""
from __future__ import annotations

import argparse
import cProfile
import dataclasses
import math
import os
import pstats
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import hvdcomp  # noqa: E402
from hvdcomp import backends  # noqa: E402
from hvdcomp.compressors import TensorKey  # noqa: E402
from hvdcomp.wire import Message  # noqa: E402
from shapes import resnet50  # noqa: E402

WORLD = 4


class Path:
    def __init__(self, name, spec, shapes, momentum):
        self.name = name
        self.comp = hvdcomp.get(spec)
        if momentum is not None:
            self.comp.set_momentum({n: momentum for n, _ in shapes})
        self.enc, self.dec, self.enc_cpu, self.dec_cpu = [], [], [], []

    def __enter__(self):
        self._use = backends.use(self.name)           # "reference" or "kernels"
        self._use.__enter__()
        return self

    def __exit__(self, *exc):
        self._use.__exit__(*exc)


def exchange(path, grads, step, record=True):
    with path:
        t0, c0 = time.perf_counter(), time.process_time()
        wires = [path.comp.encode(gr, TensorKey(name, tid, step, 0, WORLD, 1)).to_bytes()
                 for tid, (name, gr) in enumerate(grads)]
        t1, c1 = time.perf_counter(), time.process_time()
        sums = []
        for tid, (name, gr) in enumerate(grads):
            m0 = Message.from_bytes(wires[tid])
            msgs = [m0] + [dataclasses.replace(Message.from_bytes(wires[tid]), rank=r)
                           for r in range(1, WORLD)]
            keys = [TensorKey(name, tid, step, r, WORLD, 1) for r in range(WORLD)]
            acc = torch.zeros(gr.numel(), dtype=torch.float32)
            path.comp.combine(msgs, keys, acc)
            path.comp.finalize(acc, keys[0])
            sums.append(acc)
        t2, c2 = time.perf_counter(), time.process_time()
    if record:
        path.enc.append(t1 - t0)
        path.dec.append(t2 - t1)
        path.enc_cpu.append(c1 - c0)
        path.dec_cpu.append(c2 - c1)
    return wires, sums


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", default="dgc:density=0.001")
    ap.add_argument("--numel", type=int, default=0, help="one tensor of this size instead "
                    "of ResNet-50's shapes")
    ap.add_argument("--momentum", type=float, default=None, help="DGC: set_momentum for all")
    ap.add_argument("--routed", action="store_true", help="only the tensors that "
                    "hvdcomp.torch's Exchange compresses (dim > 1, numel >= 1024: 54 of "
                    "ResNet-50's 161; the others go through allreduce)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--profile", action="store_true", help="cProfile (CPU time) of one "
                    "exchange of --backend's path")
    ap.add_argument("--backend", default="kernels", choices=("kernels", "reference"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    from hvdcomp.backends import host
    host.set_num_threads(1)
    shapes = [("w", (args.numel,))] if args.numel else resnet50()
    if args.routed:
        shapes = [(n, sh) for n, sh in shapes if len(sh) > 1 and math.prod(sh) >= 1024]
    g = torch.Generator().manual_seed(100)
    grads = [(name, torch.randn(shape, generator=g) * 1e-3) for name, shape in shapes]
    print(f"{args.spec}, momentum {args.momentum}: {len(grads)} tensors, "
          f"{sum(x.numel() for _, x in grads):,} parameters, 1 thread", flush=True)
    if args.profile:
        p = Path(args.backend, args.spec, shapes, args.momentum)
        exchange(p, grads, 0)
        pr = cProfile.Profile(time.process_time)
        pr.enable()
        exchange(p, grads, 1)
        pr.disable()
        pstats.Stats(pr).sort_stats("tottime").print_stats(30)
        return 0
    ref = Path("reference", args.spec, shapes, args.momentum)
    ker = Path("kernels", args.spec, shapes, args.momentum)
    identical = True
    for step in range(args.reps + 1):             # step 0 warms up (first-step allocations)
        wr, sr = exchange(ref, grads, step, record=step > 0)
        wk, sk = exchange(ker, grads, step, record=step > 0)
        identical &= wr == wk and all(torch.equal(a, b) for a, b in zip(sr, sk))
    st_r, st_k = ref.comp.state_dict(), ker.comp.state_dict()
    for part in st_r:
        identical &= st_r[part].keys() == st_k[part].keys() and all(
            torch.equal(st_r[part][n], st_k[part][n]) for n in st_r[part])
    med = statistics.median
    for p in (ref, ker):
        print(f"  {p.name:9s} encode {med(p.enc):.3f} s (cpu {med(p.enc_cpu):.3f}), "
              f"decode {med(p.dec):.3f} s (cpu {med(p.dec_cpu):.3f}) per exchange; "
              f"median of {args.reps}", flush=True)
    print(f"  speedup: encode {med(ref.enc) / med(ker.enc):.1f}x wall, "
          f"{med(ref.enc_cpu) / med(ker.enc_cpu):.1f}x cpu; decode "
          f"{med(ref.dec) / med(ker.dec):.1f}x wall, {med(ref.dec_cpu) / med(ker.dec_cpu):.1f}x"
          f" cpu")
    print(f"  message bytes, decoded sums and state identical: {identical}")
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
