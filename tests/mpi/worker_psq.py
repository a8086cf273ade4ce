"""PSQ and BHQ through the exchange on N ranks: every rank receives exactly the average that
one process computes from the same encoded messages, on both transports."""
import torch

from common import (SPECS, assert_bit_exact, buckets, exchange_step, golden_grad,
                    make_exchange, reference, same)
from cases import case, run

import hvdcomp

COMPRESSORS = ["psq:bits=4", "psq:bits=1", "bhq:bits=4,block_size=8",
               "bhq:bits=2,block_size=3"]


@case.each(COMPRESSORS)
def bit_exact(spec):
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
            for name in ("fc1.weight", "conv.weight", "half.weight", "bhalf.weight",
                         "double.weight", "zero.weight"):
                assert stats.compressors[name] == comp.name, (name, stats.compressors)
            assert stats.compressors["fc1.bias"] == "none"
            # the all-zero tensor averages to exact zeros; the NaN one to all-NaN
            assert torch.equal(res["zero.weight"], torch.zeros(64 * 64))
            assert torch.isnan(res["nan.weight"]).all()
            # the exchange reuses its buffers: keep a copy
            by_transport.setdefault(step, []).append({k: v.clone() for k, v in res.items()})
    for step, (r_mpi, r_hvd) in by_transport.items():
        for name in SPECS:
            assert same(r_mpi[name], r_hvd[name]), (spec, step, "mpi vs horovod", name)


if __name__ == "__main__":
    run()
