"""DQSG and NDQSG through the exchange on N ranks: every rank receives exactly the average
that one process computes with combine() over all ranks' messages, and the same events.

Gradients are correlated across ranks (a common base plus small per-rank noise), as NDQSG's
side information needs, except for ``conv.weight``, whose per-rank gradients are unrelated:
there NDQSG's nested ranks fail their checks, fall back, and report events, which must be
the same on every rank.
"""
import hashlib

import numpy as np
import torch

from common import (SPECS, assert_bit_exact, buckets, exchange_step, golden_grad,
                    make_exchange, reference, same)
from cases import case, run

import hvdcomp
from hvdcomp.transport import make

COMPRESSORS = ["dqsg:bits=4,bucket_size=128", "dqsg:bits=2,bucket_size=1000",
               "ndqsg:bits=4,nested_bits=2,bucket_size=128",
               "ndqsg:bits=3,nested_bits=2,bucket_size=100,entropy=true",
               "ndqsg:bits=5,nested_bits=3,bucket_size=64,dqsg_ranks=1"]
UNRELATED = "conv.weight"


def corr_grad(name: str, rank: int) -> torch.Tensor:
    """base (rank 0's golden gradient) + 1 % noise per rank; golden_grad's per-rank gradients
    for UNRELATED; the NaN of golden_grad on rank 1 for nan.weight."""
    if name == UNRELATED:
        return golden_grad(name, rank)
    shape, dtype = SPECS[name]
    base = golden_grad(name, 0).float()
    g = torch.Generator().manual_seed(1000 + rank * 7 + sum(map(ord, name)))
    scale = float(base.abs().max()) if base.numel() else 0.0
    x = base + 0.01 * scale * (2 * torch.rand(shape, generator=g) - 1)
    if name == "zero.weight":
        x.zero_()
    if name == "nan.weight" and rank == 1:
        x.view(-1)[5] = float("nan")
    return x.to(dtype)


def same_everywhere(tp, text: str) -> bool:
    digest = np.frombuffer(hashlib.sha256(text.encode()).digest(), dtype=np.uint8)
    return all(np.array_equal(d, digest) for d in tp.allgather(digest))


@case.each(COMPRESSORS)
def bit_exact(spec):
    """Bit for bit and the same events as one process that combine()s all ranks' messages
    in the exchange's bucket order; the same events on every rank; the same results on both
    transports."""
    comp = hvdcomp.get(spec)
    by_step = {}
    # the rANS reference coder is slow NumPy: its spec runs on one transport, one step
    transports, steps = (("mpi",), (5,)) if comp.entropy else (("mpi", "horovod"), (0, 5))
    for tname in transports:
        tp = make(tname)
        ex = make_exchange(comp, tp)
        size = ex.size
        nested = comp.name == "ndqsg" and comp.group_size(size) < size
        assert len(buckets(ex)) > 1
        for step in steps:
            res, stats = exchange_step(ex, step, corr_grad)
            want, want_events = reference(ex, step, corr_grad, combine=True)
            assert_bit_exact(res, want, SPECS, (spec, tname, step))
            assert stats.events == want_events, (spec, tname, stats.events, want_events)
            assert same_everywhere(tp, "\n".join(stats.events))
            if nested:
                # the unrelated tensor fails its checks on every nested rank, the
                # correlated ones never do
                assert stats.events and all(ev.startswith(f"{UNRELATED}: ndqsg: side "
                                                          f"information too far off")
                                            for ev in stats.events), stats.events
                assert len(stats.events) == size - comp.group_size(size)
            else:
                assert stats.events == []
            assert stats.nonfinite == ["nan.weight"], stats.nonfinite
            assert stats.compressors["fc1.weight"] == comp.name
            assert stats.compressors["fc1.bias"] == "none"
            # the averages are close to the mean gradient (sanity of the whole path)
            ref = torch.stack([corr_grad("fc1.weight", r).float()
                               for r in range(size)]).mean(0).reshape(-1)
            delta = float(ref.abs().max()) / (2 ** (comp.bits - 1) - 1)
            assert float((res["fc1.weight"] - ref).abs().max()) <= delta / 2 * 1.05
            # the exchange reuses its buffers: keep a copy
            by_step.setdefault(step, []).append({k: v.clone() for k, v in res.items()})
    for step, results in by_step.items():
        if len(results) < 2:
            continue
        r_mpi, r_hvd = results
        for name in SPECS:
            assert same(r_mpi[name], r_hvd[name]), (spec, step, "mpi vs horovod", name)


if __name__ == "__main__":
    run()
