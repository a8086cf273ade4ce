"""TernGrad and EF-SignSGD on N ranks.

* The exchange (both transports) delivers on every rank exactly the average that one process
  computes from every rank's messages; for signef that process keeps one compressor, hence
  one set of residuals, per simulated rank, and the residuals of this rank's compressor must
  equal those of its simulated twin bit for bit (NaN steps leave them unchanged).
* The drop-in optimizer (import hvdcomp.torch as hvd) with compression="signef" (and
  terngrad) takes exactly the SGD steps of that single-process computation.
* optimizer.state_dict() carries the residuals; a new optimizer that loads it holds them bit
  for bit and continues exactly like the reference (and differently from fresh residuals).
"""
import io

import numpy as np
import torch
import torch.nn.functional as F

from common import (LR, SPECS, assert_bit_exact, assert_params, buckets, compressed,
                    exchange_of, exchange_step, golden_grad, local_grads, make_exchange, mlp,
                    reference, reference_grads, same, sgd_reference, twins_of)
from cases import case, run

import hvdcomp
import hvdcomp.torch as hvd

EXCHANGE_SPECS = ["terngrad", "terngrad:clip=0,bucket_size=100", "signef",
                  "signef:bucket_size=100"]
OPTIMIZER_SPECS = ["signef", "signef:bucket_size=64", "terngrad:bucket_size=64"]
TRANSPORTS = ["mpi", "horovod"]


def check_residuals(comp, twin, names, where):
    """The residuals of this rank's compressor equal its simulated twin's, bit for bit."""
    if comp.name != "signef":
        return 0
    mine, ref = comp.state_dict()["residuals"], twin.state_dict()["residuals"]
    assert sorted(mine) == sorted(ref), (where, sorted(mine), sorted(ref))
    for n in mine:
        assert mine[n].dtype == torch.float32 and torch.equal(mine[n], ref[n]), (where, n)
    assert any(bool(mine[n].any()) for n in names if n in mine), where    # not all zero
    return len(mine)


# --------------------------------------------------------------------------------------------
# the exchange on the golden gradients of common.SPECS
# --------------------------------------------------------------------------------------------

@case.each(EXCHANGE_SPECS)
def exchange(spec):
    """Both transports, three steps, each rank's compressor against its simulated twin."""
    by_transport = []
    for tname in TRANSPORTS:
        comp = hvdcomp.get(spec)                       # fresh residuals per transport
        ex = make_exchange(comp, tname)
        rank = ex.rank
        twins = [hvdcomp.get(spec) for _ in range(ex.size)]
        assert len(buckets(ex)) > 1
        names = compressed(ex)
        assert names == sorted(["conv.weight", "fc1.weight", "half.weight", "bhalf.weight",
                                "double.weight", "zero.weight", "nan.weight"]), names
        results = []
        for step in (0, 1, 5):
            res, stats = exchange_step(ex, step, golden_grad)
            want, _ = reference(ex, step, golden_grad, compressor_for=twins_of(comp, twins))
            assert_bit_exact(res, want, SPECS, (spec, tname, step))
            assert stats.nonfinite == ["nan.weight"], stats.nonfinite
            assert stats.compressors["fc1.weight"] == comp.name
            assert stats.compressors["fc1.bias"] == "none"
            assert not res["zero.weight"].any() and not torch.signbit(res["zero.weight"]).any()
            check_residuals(comp, twins[rank], names, (spec, tname, step))
            results.append({k: v.clone() for k, v in res.items()})   # buffers are reused
        if comp.name == "signef":
            # rank 1's nan.weight was NaN at every step: no residual was ever created;
            # the other ranks hold one for it
            assert (comp.residual("nan.weight") is None) == (rank == 1)
            # the residual moved the messages: step 5 differs from step 0 although the
            # gradients are the same (no randomness in signef)
            assert not torch.equal(results[0]["fc1.weight"], results[2]["fc1.weight"])
        by_transport.append(results)
    for a, b in zip(*by_transport):
        for name in SPECS:
            assert same(a[name], b[name]), (spec, "mpi vs horovod", name)


# --------------------------------------------------------------------------------------------
# the drop-in optimizer
# --------------------------------------------------------------------------------------------

def batch(rank, step):
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + 3)
    return torch.randn(8, 20, generator=g), torch.randint(0, 4, (8,), generator=g)


def expected_step(model, opt, twins, step):
    """p - lr * average over ranks of decode(encode_r(g_r)) with rank r's own compressor."""
    grads = [local_grads(model, [batch(r, step)]) for r in range(hvd.size())]
    return sgd_reference(model, reference_grads(model, opt, step, grads,
                                                compressor_for=twins_of(opt.compression,
                                                                        twins)))


def make_opt(model, spec, transport):
    return hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR),
                                    named_parameters=model.named_parameters(),
                                    compression=spec, transport=transport,
                                    min_compress_numel=16)


def step_and_check(model, opt, twins, step, where):
    want = expected_step(model, opt, twins, step)
    opt.zero_grad()
    x, y = batch(hvd.rank(), step)
    F.cross_entropy(model(x), y).backward()
    opt.step()
    assert_params(model, opt, want, (where, step))
    assert opt.last_stats.compressors["0.weight"] == opt.compression.name
    return want


@case.each(OPTIMIZER_SPECS, TRANSPORTS)
def optimizer(spec, transport, steps=4):
    """Four steps against the single-process computation, then a checkpoint through
    torch.save / torch.load whose optimizer continues exactly like it."""
    rank, size = hvd.rank(), hvd.size()
    model = mlp()
    opt = make_opt(model, spec, transport)
    twins = [hvdcomp.get(spec) for _ in range(size)]
    names = compressed(exchange_of(opt))
    assert names == ["0.weight", "2.weight"], names
    for step in range(steps):
        step_and_check(model, opt, twins, step, (spec, transport))
        check_residuals(opt.compression, twins[rank], names, (spec, transport, step))

    # checkpoint: optimizer state (with the residuals) through torch.save / torch.load
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    sd = torch.load(buf)
    assert sd["hvdcomp"]["step"] == steps and sd["hvdcomp"]["compression"] == opt.compression.spec()
    model2 = mlp()
    model2.load_state_dict(model.state_dict())
    opt2 = make_opt(model2, spec, transport)
    opt2.load_state_dict(sd)
    assert opt2.state_dict()["hvdcomp"]["step"] == steps
    n = check_residuals(opt2.compression, opt.compression, names, (spec, "loaded"))
    if opt.compression.name == "signef":
        assert n == 2
        for name in names:
            a, b = opt.compression.residual(name), opt2.compression.residual(name)
            assert np.array_equal(a.numpy().view(np.uint32), b.numpy().view(np.uint32))
        # the loaded residuals matter: with fresh ones the next step would differ
        fresh = [hvdcomp.get(spec) for _ in range(size)]
        other = expected_step(model2, opt2, fresh, steps)
    # the restored optimizer continues exactly like the reference
    want = step_and_check(model2, opt2, twins, steps, (spec, transport, "restored"))
    check_residuals(opt2.compression, twins[rank], names, (spec, transport, "restored"))
    if opt.compression.name == "signef":
        assert any(not torch.equal(want[n], other[n]) for n in names)


if __name__ == "__main__":
    run()
