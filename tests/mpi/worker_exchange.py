"""The exchange on N ranks delivers, on every rank, exactly the average that one process
computes from the same encoded messages, for every compressor and both transports."""
import math

import numpy as np
import torch

from common import SPECS, golden_grad, params, say

import horovod.torch as hvd
import hvdcomp
from hvdcomp.compressors import NoneCompressor
from hvdcomp.torch.exchange import Exchange
from hvdcomp.transport import make

COMPRESSORS = ["none", "fp16", "bf16", "terngrad", "qsgd:bits=4,bucket_size=512",
               "alq:bits=4,bucket_size=512,entropy=1",
               "qsgdinf:bits=3,bucket_size=100", "nuqsgd:bits=2,bucket_size=1000",
               "alq:bits=3,bucket_size=512", "amq:bits=3,bucket_size=512"]


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
            e.compressor.finalize(acc, hvdcomp.TensorKey(name, e.tensor_id, step, ex.rank, ex.size, ex.seed))
            finite = bool(torch.isfinite(acc).all())
        out[name] = acc if finite else torch.full_like(acc, math.nan)
    return out


def run(ex: Exchange, rank: int, step: int):
    for name, e in ex.entries.items():
        e.param.grad = golden_grad(name, rank)
    ex.begin(step)
    # hooks in an order that differs per rank: the bucket order must still agree
    names = list(ex.entries)
    for name in (names if rank % 2 == 0 else names[::-1]):
        ex.ready(name)
    res, stats = ex.finish()
    return res, stats


def main():
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    checked = 0
    for spec in COMPRESSORS:
        comp = hvdcomp.get(spec)
        by_transport = {}
        for tname in ("mpi", "horovod"):
            # allreduce_summable=False: none/fp16 also go through the allgather path here,
            # so every tensor is compared bit for bit.
            ex = Exchange(params(), comp, make(tname), hvd=hvd, fusion_bytes=20000,
                          min_compress_numel=16, seed=3, allreduce_summable=False)
            assert len(ex.buckets) > 1
            for step in (0, 5):
                res, stats = run(ex, rank, step)
                want = expected(ex, step)
                for name in SPECS:
                    a, b = res[name], want[name]
                    assert a.dtype == torch.float32 and a.shape == b.shape
                    assert torch.equal(torch.nan_to_num(a, nan=7.5), torch.nan_to_num(b, nan=7.5)), \
                        (spec, tname, name, (a - b).abs().max())
                    checked += 1
                assert stats.nonfinite == ["nan.weight"], stats.nonfinite
                assert stats.compressors["fc1.bias"] == "none"
                assert stats.compressors["fc1.weight"] == comp.name
                assert stats.bytes_sent > 0
                by_transport.setdefault(step, []).append(res)
        for step, (r_mpi, r_hvd) in by_transport.items():
            for name in SPECS:
                assert torch.equal(torch.nan_to_num(r_mpi[name]), torch.nan_to_num(r_hvd[name]))
    # Summable tensors through Horovod's allreduce: the average up to float rounding.
    for spec, tol in (("none", 1e-6), ("fp16", 2e-3)):
        comp = hvdcomp.get(spec)
        ex = Exchange(params(), comp, make("mpi"), hvd=hvd, fusion_bytes=20000,
                      min_compress_numel=16, seed=3)
        assert any(e.allreduce for e in ex.entries.values())
        res, stats = run(ex, rank, 1)
        for name, e in ex.entries.items():
            ref = torch.stack([golden_grad(name, r).float() for r in range(size)]).mean(0)
            if not torch.isfinite(ref).all():
                assert torch.isnan(res[name]).all(), name
                continue
            assert torch.allclose(res[name], ref.reshape(-1), rtol=tol, atol=tol * 4), \
                (spec, name, (res[name] - ref.reshape(-1)).abs().max())
    # An encoder that fails on one rank: every rank raises (nobody waits in the allgather),
    # and the exchange keeps working for the next step.
    class Flaky(hvdcomp.QSGD):
        fail = True

        def _encode(self, grad, key):
            if key.rank == 1 and Flaky.fail:
                raise ValueError("boom on rank 1")
            return super()._encode(grad, key)

    ex = Exchange(params(), Flaky(bits=4, bucket_size=512), make("mpi"), hvd=hvd,
                  fusion_bytes=20000, min_compress_numel=16, seed=3, allreduce_summable=False)
    try:
        run(ex, rank, 0)
        raise AssertionError("the encoder error was not raised")
    except ValueError as e:
        assert rank == 1 and "boom" in str(e)
    except RuntimeError as e:
        assert rank != 1 and "rank 1 failed to encode" in str(e) and "boom" in str(e), e
    Flaky.fail = False
    res, _ = run(ex, rank, 1)
    assert torch.equal(res["fc1.weight"], expected(ex, 1)["fc1.weight"])

    # A decoder that fails on every rank for the first bucket, while later buckets are on the
    # wire: every rank raises, none is left waiting in a later bucket's allgather, and the
    # next step works (whether a rank joins a collective never depends on thread timing).
    class BadDecode(hvdcomp.QSGD):
        fail = True

        def _decode(self, msg, key, out):
            if BadDecode.fail:
                raise hvdcomp.WireFormatError("bad message")
            return super()._decode(msg, key, out)

    ex = Exchange(params(), BadDecode(bits=4, bucket_size=512), make("mpi"), hvd=hvd,
                  fusion_bytes=20000, min_compress_numel=16, seed=3, allreduce_summable=False)
    assert len(ex.buckets) > 2
    for step in range(3):
        try:
            run(ex, rank, step)
            raise AssertionError("the decoder error was not raised")
        except hvdcomp.WireFormatError as e:
            assert "bad message" in str(e)
    BadDecode.fail = False
    res, _ = run(ex, rank, 3)
    assert torch.equal(res["fc1.weight"], expected(ex, 3)["fc1.weight"])
    ex.close()
    say(rank, f"exchange OK ({checked} tensors bit-exact)")


if __name__ == "__main__":
    main()
