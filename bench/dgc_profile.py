"""DGC's whole CPU path for one exchange on ResNet-50's shapes, in one process (not a test).

    python bench/dgc_profile.py [--spec dgc:density=0.001] [--reps 3] [--profile]
                                [--backend auto|reference] [--digest]

One "exchange" per rep: encode all 161 tensors (bench/shapes.py, N(0, 1e-3) gradients as
bench/exchange.py makes them) with one compressor instance (rank 0 of 4), serialize each
message (Message.to_bytes), then for each tensor parse and decode 4 messages (the same
message from "ranks" 0..3 with their keys: rank 0's bytes with the rank field rewritten)
into a float32 accumulator via combine() and finalize().  1 thread (torch and host kernels).
Prints the median encode and decode seconds per exchange and, with --digest, a SHA-256 over
all message bytes and the final u/v state (to compare backends).
"""
from __future__ import annotations

import argparse
import cProfile
import dataclasses
import hashlib
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
from hvdcomp.compressors import TensorKey  # noqa: E402
from hvdcomp.wire import Message  # noqa: E402
from shapes import resnet50  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--spec", default="dgc:density=0.001")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--backend", default=None)
    ap.add_argument("--digest", action="store_true")
    ap.add_argument("--momentum", type=float, default=None)
    args = ap.parse_args()
    if args.backend:
        os.environ["HVDCOMP_BACKEND"] = args.backend
    torch.set_num_threads(1)
    try:
        from hvdcomp.backends import host
        host.set_num_threads(1)
    except Exception:
        pass
    shapes = resnet50()
    world = 4
    comp = hvdcomp.get(args.spec)
    if args.momentum is not None:
        comp.set_momentum({n: args.momentum for n, _ in shapes})
    g = torch.Generator().manual_seed(100)
    grads = [(name, torch.randn(shape, generator=g) * 1e-3) for name, shape in shapes]
    digest = hashlib.sha256()
    cpu = []

    def exchange(step):
        t0, c0 = time.perf_counter(), time.process_time()
        wires = []
        for tid, (name, gr) in enumerate(grads):
            m = comp.encode(gr, TensorKey(name, tid, step, 0, world, 1))
            wires.append(m.to_bytes())
        t1, c1 = time.perf_counter(), time.process_time()
        for tid, (name, gr) in enumerate(grads):
            msgs, keys = [], []
            for r in range(world):
                m = Message.from_bytes(wires[tid])
                msgs.append(dataclasses.replace(m, rank=r))
                keys.append(TensorKey(name, tid, step, r, world, 1))
            acc = torch.zeros(gr.numel(), dtype=torch.float32)
            comp.combine(msgs, keys, acc)
            comp.finalize(acc, keys[0])
            if args.digest:
                digest.update(acc.numpy().tobytes())
        t2, c2 = time.perf_counter(), time.process_time()
        if args.digest:
            for w in wires:
                digest.update(w)
        cpu.append((c1 - c0, c2 - c1))
        return t1 - t0, t2 - t1

    exchange(0)                                 # warm-up (builds, first-touch)
    if args.profile:
        pr = cProfile.Profile(time.process_time)
        pr.enable()
        exchange(1)
        pr.disable()
        pstats.Stats(pr).sort_stats("tottime").print_stats(25)
        return
    enc, dec = [], []
    for rep in range(1, args.reps + 1):
        e, d = exchange(rep)
        enc.append(e)
        dec.append(d)
    print(f"{args.spec} backend={os.environ.get('HVDCOMP_BACKEND', 'auto')}: encode "
          f"{statistics.median(enc):.3f} s, decode {statistics.median(dec):.3f} s per exchange "
          f"(median of {args.reps}; all {['%.3f' % x for x in enc]} / "
          f"{['%.3f' % x for x in dec]})")
    cpu = cpu[1:]
    print(f"  process CPU time: encode {statistics.median(c[0] for c in cpu):.3f} s, decode "
          f"{statistics.median(c[1] for c in cpu):.3f} s")
    if args.digest:
        st = comp.state_dict()
        for part in sorted(st):
            for k in sorted(st[part]):
                digest.update(st[part][k].numpy().tobytes())
        print("digest", digest.hexdigest())


if __name__ == "__main__":
    main()
