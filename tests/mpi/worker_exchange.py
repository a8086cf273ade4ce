"""The exchange on N ranks delivers, on every rank, exactly the average that one process
computes from the same encoded messages, for every compressor and both transports; the
summable tensors through Horovod's allreduce; an encoder or decoder that fails leaves no
rank waiting and the next step working."""
import torch

from common import (SPECS, assert_bit_exact, buckets, entries, exchange_step, golden_grad,
                    make_exchange, reference, same)
from cases import case, run

import hvdcomp

COMPRESSORS = ["none", "fp16", "bf16", "terngrad", "qsgd:bits=4,bucket_size=512",
               "alq:bits=4,bucket_size=512,entropy=1",
               "qsgdinf:bits=3,bucket_size=100", "nuqsgd:bits=2,bucket_size=1000",
               "alq:bits=3,bucket_size=512", "amq:bits=3,bucket_size=512"]
SUMMABLE = ["none", "fp16"]
TOLERANCE = {"none": 1e-6, "fp16": 2e-3}


@case.each(COMPRESSORS)
def bit_exact(spec):
    """Both transports, two steps, bit for bit; the same results on both transports."""
    comp = hvdcomp.get(spec)
    by_transport = {}
    for tname in ("mpi", "horovod"):
        ex = make_exchange(comp, tname)
        assert len(buckets(ex)) > 1
        for step in (0, 5):
            res, stats = exchange_step(ex, step, golden_grad)
            want, _ = reference(ex, step, golden_grad)
            assert_bit_exact(res, want, SPECS, (spec, tname, step))
            assert stats.nonfinite == ["nan.weight"], stats.nonfinite
            assert stats.compressors["fc1.bias"] == "none"
            assert stats.compressors["fc1.weight"] == comp.name
            assert stats.bytes_sent > 0
            # the exchange reuses its buffers: keep a copy
            by_transport.setdefault(step, []).append({k: v.clone() for k, v in res.items()})
    for step, (r_mpi, r_hvd) in by_transport.items():
        for name in SPECS:
            assert same(r_mpi[name], r_hvd[name]), (spec, step, "mpi vs horovod", name)


@case.each(SUMMABLE)
def allreduce_summable(spec):
    """Summable tensors through Horovod's allreduce: the average up to float rounding."""
    tol = TOLERANCE[spec]
    ex = make_exchange(hvdcomp.get(spec), "mpi", allreduce_summable=True)
    assert any(e.allreduce for e in entries(ex))
    res, stats = exchange_step(ex, 1, golden_grad)
    for name in SPECS:
        ref = torch.stack([golden_grad(name, r).float() for r in range(ex.size)]).mean(0)
        if not torch.isfinite(ref).all():
            assert torch.isnan(res[name]).all(), name
            continue
        assert torch.allclose(res[name], ref.reshape(-1), rtol=tol, atol=tol * 4), \
            (spec, name, (res[name] - ref.reshape(-1)).abs().max())


@case
def encoder_error_on_one_rank():
    """An encoder that fails on one rank: every rank raises (nobody waits in the
    allgather), and the exchange keeps working for the next step."""
    class Flaky(hvdcomp.QSGD):
        fail = True

        def _encode(self, grad, key):
            if key.rank == 1 and Flaky.fail:
                raise ValueError("boom on rank 1")
            return super()._encode(grad, key)

    ex = make_exchange(Flaky(bits=4, bucket_size=512), "mpi")
    rank = ex.rank
    try:
        exchange_step(ex, 0, golden_grad)
        raise AssertionError("the encoder error was not raised")
    except ValueError as e:
        assert rank == 1 and "boom" in str(e)
    except RuntimeError as e:
        assert rank != 1 and "rank 1 failed to encode" in str(e) and "boom" in str(e), e
    Flaky.fail = False
    res, _ = exchange_step(ex, 1, golden_grad)
    assert torch.equal(res["fc1.weight"], reference(ex, 1, golden_grad)[0]["fc1.weight"])


@case
def decoder_error_on_every_rank():
    """A decoder that fails on every rank for the first bucket, while later buckets are on
    the wire: every rank raises, none is left waiting in a later bucket's allgather, and the
    next step works (whether a rank joins a collective never depends on thread timing)."""
    class BadDecode(hvdcomp.QSGD):
        fail = True

        def _decode(self, msg, key, out):
            if BadDecode.fail:
                raise hvdcomp.WireFormatError("bad message")
            return super()._decode(msg, key, out)

    ex = make_exchange(BadDecode(bits=4, bucket_size=512), "mpi")
    assert len(buckets(ex)) > 2
    for step in range(3):
        try:
            exchange_step(ex, step, golden_grad)
            raise AssertionError("the decoder error was not raised")
        except hvdcomp.WireFormatError as e:
            assert "bad message" in str(e)
    BadDecode.fail = False
    res, _ = exchange_step(ex, 3, golden_grad)
    assert torch.equal(res["fc1.weight"], reference(ex, 3, golden_grad)[0]["fc1.weight"])
    ex.close()


if __name__ == "__main__":
    run()
