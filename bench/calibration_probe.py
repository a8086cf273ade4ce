"""How far Auto per layer's calibration is from the costs of a model's own tensors.

The per-layer planner (hvdcomp.exchange.layer_plan) prices each candidate from a calibration
on synthetic tensors: ``measure_codec`` (2^22 and 4096 elements, a fresh compressor each
repetition) and, for PowerSGD, ``_measure_rounds`` (one 1024 x 4096 matrix, one rank's
rounds).  This probe prints those numbers beside the same compressor's costs on the model's
own matrices (bench/shapes.py), in steady state (one compressor kept over 3 steps, the last
timed), every rank at once, slowest rank:

* a message compressor: encode, zeroing the accumulators, decoding ``world size`` messages
  (this rank's own, as the allgather's N), finalize; nanoseconds per element of the model;
* PowerSGD: one rank's rounds (``simulate``, a world of one) on each matrix.

Run (a diagnostic, not a result the docs quote as a speed):

    launch/run -np 8 .venv/bin/python bench/calibration_probe.py --model bert_base \\
        --methods "topk:density=0.001;powersgd:rank=1"

Results: bench/results/scaling_diagnostics_20261204.md.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="bert_base", choices=["bert_base", "resnet50"])
    ap.add_argument("--methods", default="topk:density=0.001;powersgd:rank=1")
    args = ap.parse_args()
    from mpi4py import MPI
    from hvdcomp.auto import measure_codec
    from hvdcomp.compressors import get
    from hvdcomp.compressors.base import TensorKey
    from hvdcomp.compressors.protocols import SummedRounds
    from hvdcomp.exchange.layer_plan import CALIBRATE_REPS, _measure_rounds
    from hvdcomp.exchange.rounds import simulate
    from hvdcomp.transport import MPITransport
    from shapes import bert_base, resnet50
    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    rank, size = comm.rank, comm.size
    tp = MPITransport()
    shapes = [tuple(s) for _, s in {"bert_base": bert_base, "resnet50": resnet50}[args.model]()
              if len(s) >= 2]
    total = sum(int(np.prod(s)) for s in shapes)
    gen = torch.Generator().manual_seed(rank)
    grads = [torch.randn(*s, generator=gen) * 1e-3 for s in shapes]

    def slowest(t0: float) -> float:
        return comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)

    def ns(t: float) -> str:
        return f"{1e9 * t / total:.2f}"

    for spec in args.methods.split(";"):
        comp = get(spec)
        rounds = isinstance(comp, SummedRounds)     # summed in rounds (PowerSGD)
        cal = (_measure_rounds(comp, tp, 2**22) if rounds
               else measure_codec(comp, tp, 2**22, reps=CALIBRATE_REPS))
        accs = [torch.zeros(int(np.prod(s))) for s in shapes]
        for step in range(3):
            keys = [TensorKey(f"t{i}", i, step, rank, 1 if rounds else size, 1, shape=s,
                              dtype=torch.float32) for i, s in enumerate(shapes)]
            xs = [g * (1 + 0.1 * step) for g in grads]
            comm.Barrier()
            t0 = time.perf_counter()
            if rounds:
                for x, k in zip(xs, keys):
                    simulate([comp], [x], [k])
                te = slowest(t0)
                continue
            msgs = [comp.encode(x, k) for x, k in zip(xs, keys)]
            te = slowest(t0)
            comm.Barrier()
            t0 = time.perf_counter()
            for a in accs:
                a.zero_()
            tz = slowest(t0)
            comm.Barrier()
            t0 = time.perf_counter()
            for m, k, a in zip(msgs, keys, accs):
                for _ in range(size):
                    comp.decode(m, k, a)
            td = slowest(t0)
            comm.Barrier()
            t0 = time.perf_counter()
            for k, a in zip(keys, accs):
                comp.finalize(a, k)
            tf = slowest(t0)
        if rank:
            continue
        head = f"{args.model}, {len(shapes)} matrices, {total} elements, {size} ranks, {spec}:"
        if rounds:
            print(f"{head} calibrated {1e9 * cal.encode_per_elem:.2f} ns/element; the model's "
                  f"matrices {ns(te)} ns/element", flush=True)
        else:
            print(f"{head} calibrated encode {1e9 * cal.encode_per_elem:.2f} ns/element "
                  f"+ {1e3 * cal.encode_fixed:.2f} ms, decode {1e9 * cal.decode_per_elem:.3f} "
                  f"ns/element + {1e3 * cal.decode_fixed:.2f} ms per message; the model's "
                  f"matrices: encode {ns(te)}, zero {ns(tz)}, {size} decodes {ns(td)}, "
                  f"finalize {ns(tf)} ns/element", flush=True)


if __name__ == "__main__":
    main()
