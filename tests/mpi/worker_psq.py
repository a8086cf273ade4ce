"""PSQ and BHQ through the exchange on N ranks: every rank receives exactly the average that
one process computes from the same encoded messages, on both transports."""
import math

import torch

from common import SPECS, golden_grad, params, say

import horovod.torch as hvd
import hvdcomp
from hvdcomp.torch.exchange import Exchange
from hvdcomp.transport import make

COMPRESSORS = ["psq:bits=4", "psq:bits=1", "bhq:bits=4,block_size=8",
               "bhq:bits=2,block_size=3"]


def expected(ex: Exchange, step: int):
    """Single-process reference: encode every rank's golden gradient with that rank's key,
    decode in rank order, average, apply the NaN policy."""
    out = {}
    for name, e in ex.entries.items():
        acc = torch.zeros(e.param.numel(), dtype=torch.float32)
        finite = True
        for r in range(ex.size):
            key = hvdcomp.TensorKey(name, e.tensor_id, step, r, ex.size, ex.seed)
            msg = hvdcomp.Message.from_bytes(e.compressor.encode(golden_grad(name, r), key)
                                             .to_bytes())
            finite &= e.compressor.decode(msg, key, acc)
        if finite:
            e.compressor.finalize(acc, hvdcomp.TensorKey(name, e.tensor_id, step, ex.rank,
                                                         ex.size, ex.seed))
            finite = bool(torch.isfinite(acc).all())
        out[name] = acc if finite else torch.full_like(acc, math.nan)
    return out


def run(ex: Exchange, rank: int, step: int):
    for name, e in ex.entries.items():
        e.param.grad = golden_grad(name, rank)
    ex.begin(step)
    names = list(ex.entries)
    for name in (names if rank % 2 == 0 else names[::-1]):
        ex.ready(name)
    return ex.finish()


def main():
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    checked = 0
    for spec in COMPRESSORS:
        comp = hvdcomp.get(spec)
        by_transport = {}
        for tname in ("mpi", "horovod"):
            ex = Exchange(params(), comp, make(tname), hvd=hvd, fusion_bytes=20000,
                          min_compress_numel=16, seed=3, allreduce_summable=False)
            assert len(ex.buckets) > 1
            for step in (0, 5):
                res, stats = run(ex, rank, step)
                want = expected(ex, step)
                for name in SPECS:
                    a, b = res[name], want[name]
                    assert a.dtype == torch.float32 and a.shape == b.shape
                    assert torch.equal(torch.nan_to_num(a, nan=7.5),
                                       torch.nan_to_num(b, nan=7.5)), \
                        (spec, tname, name, (a - b).abs().max())
                    checked += 1
                assert stats.nonfinite == ["nan.weight"], stats.nonfinite
                for name in ("fc1.weight", "conv.weight", "half.weight", "bhalf.weight",
                             "double.weight", "zero.weight"):
                    assert stats.compressors[name] == comp.name, (name, stats.compressors)
                assert stats.compressors["fc1.bias"] == "none"
                # the all-zero tensor averages to exact zeros; the rest is finite
                assert torch.equal(res["zero.weight"], torch.zeros(64 * 64))
                assert torch.isnan(res["nan.weight"]).all()
                by_transport.setdefault(step, []).append(res)
        for step, (r_mpi, r_hvd) in by_transport.items():
            for name in SPECS:
                assert torch.equal(torch.nan_to_num(r_mpi[name]), torch.nan_to_num(r_hvd[name]))
    say(rank, f"psq OK ({checked} tensors bit-exact)")


if __name__ == "__main__":
    main()
