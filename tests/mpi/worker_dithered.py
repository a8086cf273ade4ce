"""DQSG and NDQSG through the exchange on N ranks: every rank receives exactly the average
that one process computes with combine() over all ranks' messages, and the same events.

Gradients are correlated across ranks (a common base plus small per-rank noise), as NDQSG's
side information needs, except for ``conv.weight``, whose per-rank gradients are unrelated:
there NDQSG's nested ranks fail their checks, fall back, and report events, which must be
the same on every rank.
"""
import hashlib
import math

import numpy as np
import torch

from common import SPECS, golden_grad, params, say

import horovod.torch as hvd
import hvdcomp
from hvdcomp.compressors.protocols import ReportsEvents
from hvdcomp.torch.exchange import Exchange
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


def expected(ex: Exchange, step: int):
    """Single process: every rank's message, combine() over all of them (in the exchange's
    bucket order, so the events come out in the same order), average, NaN policy."""
    out, events = {}, []
    for bucket in ex.buckets:
        for name in bucket:
            e = ex.entries[name]
            keys = [hvdcomp.TensorKey(name, e.tensor_id, step, r, ex.size, ex.seed)
                    for r in range(ex.size)]
            msgs = [hvdcomp.Message.from_bytes(e.compressor.encode(corr_grad(name, r), k)
                                               .to_bytes()) for r, k in enumerate(keys)]
            acc = torch.zeros(e.param.numel(), dtype=torch.float32)
            finite = e.compressor.combine(msgs, keys, acc)
            if isinstance(e.compressor, ReportsEvents):
                events.extend(f"{name}: {ev}" for ev in e.compressor.drain_events())
            if finite:
                e.compressor.finalize(acc, keys[ex.rank])
                finite = bool(torch.isfinite(acc).all())
            out[name] = acc if finite else torch.full_like(acc, math.nan)
    return out, events


def run(ex: Exchange, rank: int, step: int):
    for name, e in ex.entries.items():
        e.param.grad = corr_grad(name, rank)
    ex.begin(step)
    names = list(ex.entries)
    for name in (names if rank % 2 == 0 else names[::-1]):
        ex.ready(name)
    return ex.finish()


def same_everywhere(tp, text: str) -> bool:
    digest = np.frombuffer(hashlib.sha256(text.encode()).digest(), dtype=np.uint8)
    return all(np.array_equal(d, digest) for d in tp.allgather(digest))


def main():
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    checked = n_events = 0
    for spec in COMPRESSORS:
        comp = hvdcomp.get(spec)
        nested = comp.name == "ndqsg" and comp.group_size(size) < size
        by_step = {}
        # the rANS reference coder is slow NumPy: its spec runs on one transport, one step
        transports, steps = (("mpi",), (5,)) if comp.entropy else (("mpi", "horovod"), (0, 5))
        for tname in transports:
            tp = make(tname)
            ex = Exchange(params(), comp, tp, hvd=hvd, fusion_bytes=20000,
                          min_compress_numel=16, seed=3, allreduce_summable=False)
            assert len(ex.buckets) > 1
            for step in steps:
                res, stats = run(ex, rank, step)
                want, want_events = expected(ex, step)
                for name in SPECS:
                    a, b = res[name], want[name]
                    assert a.dtype == torch.float32 and a.shape == b.shape
                    assert torch.equal(torch.nan_to_num(a, nan=7.5),
                                       torch.nan_to_num(b, nan=7.5)), \
                        (spec, tname, name, (a - b).abs().max())
                    checked += 1
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
                n_events += len(stats.events)
                assert stats.nonfinite == ["nan.weight"], stats.nonfinite
                assert stats.compressors["fc1.weight"] == comp.name
                assert stats.compressors["fc1.bias"] == "none"
                # the averages are close to the mean gradient (sanity of the whole path)
                ref = torch.stack([corr_grad("fc1.weight", r).float()
                                   for r in range(size)]).mean(0).reshape(-1)
                delta = float(ref.abs().max()) / (2 ** (comp.bits - 1) - 1)
                assert float((res["fc1.weight"] - ref).abs().max()) <= delta / 2 * 1.05
                by_step.setdefault(step, []).append(res)
        for step, results in by_step.items():
            if len(results) < 2:
                continue
            r_mpi, r_hvd = results
            for name in SPECS:
                assert torch.equal(torch.nan_to_num(r_mpi[name]), torch.nan_to_num(r_hvd[name]))
    say(rank, f"dithered OK ({checked} tensors bit-exact, {n_events} events agreed)")


if __name__ == "__main__":
    main()
