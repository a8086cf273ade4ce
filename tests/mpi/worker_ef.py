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
import copy
import io
import math

import numpy as np
import torch
import torch.nn.functional as F

from common import SPECS, golden_grad, params, say

import hvdcomp
import hvdcomp.torch as hvd
from hvdcomp.torch.exchange import Exchange
from hvdcomp.transport import make

LR = 0.1
EXCHANGE_SPECS = ["terngrad", "terngrad:clip=0,bucket_size=100", "signef",
                  "signef:bucket_size=100"]
OPTIMIZER_SPECS = ["signef", "signef:bucket_size=64", "terngrad:bucket_size=64"]


def same(a, b):
    """Bit-identical float tensors (NaN where the other has NaN)."""
    return a.shape == b.shape and torch.equal(torch.nan_to_num(a, nan=7.5),
                                              torch.nan_to_num(b, nan=7.5))


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

def expected(ex, step, twins):
    """Encode every rank's golden gradient with that rank's own compressor (twins[r]) and
    key, decode in rank order, average, apply the NaN policy."""
    out = {}
    for name, e in ex.entries.items():
        compressed = e.compressor is ex.compression
        acc = torch.zeros(e.param.numel(), dtype=torch.float32)
        finite = True
        for r in range(ex.size):
            comp = twins[r] if compressed else e.compressor
            key = hvdcomp.TensorKey(name, e.tensor_id, step, r, ex.size, ex.seed)
            msg = hvdcomp.Message.from_bytes(comp.encode(golden_grad(name, r), key).to_bytes())
            finite &= comp.decode(msg, key, acc)
        if finite:
            key = hvdcomp.TensorKey(name, e.tensor_id, step, ex.rank, ex.size, ex.seed)
            (twins[ex.rank] if compressed else e.compressor).finalize(acc, key)
            finite = bool(torch.isfinite(acc).all())
        out[name] = acc if finite else torch.full_like(acc, math.nan)
    return out


def run(ex, rank, step):
    for name, e in ex.entries.items():
        e.param.grad = golden_grad(name, rank)
    ex.begin(step)
    names = list(ex.entries)
    for name in (names if rank % 2 == 0 else names[::-1]):
        ex.ready(name)
    return ex.finish()


def check_exchange(rank, size):
    checked = 0
    for spec in EXCHANGE_SPECS:
        by_transport = []
        for tname in ("mpi", "horovod"):
            comp = hvdcomp.get(spec)                       # fresh residuals per transport
            twins = [hvdcomp.get(spec) for _ in range(size)]
            ex = Exchange(params(), comp, make(tname), hvd=hvd, fusion_bytes=20000,
                          min_compress_numel=16, seed=3, allreduce_summable=False)
            assert len(ex.buckets) > 1
            compressed = [n for n, e in ex.entries.items() if e.compressor is comp]
            assert sorted(compressed) == sorted(["conv.weight", "fc1.weight", "half.weight",
                                                 "bhalf.weight", "double.weight", "zero.weight",
                                                 "nan.weight"]), compressed
            results = []
            for step in (0, 1, 5):
                res, stats = run(ex, rank, step)
                want = expected(ex, step, twins)
                for name in SPECS:
                    assert res[name].dtype == torch.float32
                    assert same(res[name], want[name]), \
                        (spec, tname, step, name, (res[name] - want[name]).abs().max())
                    checked += 1
                assert stats.nonfinite == ["nan.weight"], stats.nonfinite
                assert stats.compressors["fc1.weight"] == comp.name
                assert stats.compressors["fc1.bias"] == "none"
                assert not res["zero.weight"].any() and not torch.signbit(res["zero.weight"]).any()
                check_residuals(comp, twins[rank], compressed, (spec, tname, step))
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
    return checked


# --------------------------------------------------------------------------------------------
# the drop-in optimizer
# --------------------------------------------------------------------------------------------

def model_fn():
    torch.manual_seed(11)
    return torch.nn.Sequential(torch.nn.Linear(20, 30), torch.nn.Tanh(), torch.nn.Linear(30, 4))


def batch(rank, step):
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + 3)
    return torch.randn(8, 20, generator=g), torch.randint(0, 4, (8,), generator=g)


def local_grads(model, rank, step):
    m = copy.deepcopy(model)
    m.zero_grad()
    x, y = batch(rank, step)
    F.cross_entropy(m(x), y).backward()
    return {n: p.grad.detach().clone() for n, p in m.named_parameters()}


def expected_step(model, opt, twins, step, size):
    """p - lr * average over ranks of decode(encode_r(g_r)) with rank r's own compressor."""
    ex = opt._exchange
    grads = [local_grads(model, r, step) for r in range(size)]
    new = {}
    for name, p in model.named_parameters():
        e = ex.entries[name]
        compressed = e.compressor is opt.compression
        acc = torch.zeros(p.numel())
        for r in range(size):
            comp = twins[r] if compressed else e.compressor
            key = hvdcomp.TensorKey(name, e.tensor_id, step, r, size, ex.seed)
            comp.decode(hvdcomp.Message.from_bytes(comp.encode(grads[r][name], key).to_bytes()),
                        key, acc)
        key = hvdcomp.TensorKey(name, e.tensor_id, step, hvd.rank(), size, ex.seed)
        (twins[hvd.rank()] if compressed else e.compressor).finalize(acc, key)
        new[name] = p.detach().clone().add_(acc.view(p.shape), alpha=-LR)
    return new


def make_opt(model, spec, transport):
    return hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR),
                                    named_parameters=model.named_parameters(),
                                    compression=spec, transport=transport,
                                    min_compress_numel=16)


def step_and_check(model, opt, twins, step, size, where):
    rank = hvd.rank()
    want = expected_step(model, opt, twins, step, size)
    opt.zero_grad()
    x, y = batch(rank, step)
    F.cross_entropy(model(x), y).backward()
    opt.step()
    for name, p in model.named_parameters():
        e = opt._exchange.entries[name]
        if e.allreduce:        # biases: summed by Horovod in MPI's order
            assert torch.allclose(p.detach(), want[name], rtol=1e-6, atol=1e-7), (where, name)
        else:                  # decoded in rank order: exact
            assert torch.equal(p.detach(), want[name]), (where, step, name)
    assert opt.last_stats.compressors["0.weight"] == opt.compression.name
    return want


def check_optimizer(spec, transport, size, steps=4):
    rank = hvd.rank()
    model = model_fn()
    opt = make_opt(model, spec, transport)
    twins = [hvdcomp.get(spec) for _ in range(size)]
    compressed = [n for n, e in opt._exchange.entries.items() if e.compressor is opt.compression]
    assert sorted(compressed) == ["0.weight", "2.weight"], compressed
    for step in range(steps):
        step_and_check(model, opt, twins, step, size, (spec, transport))
        check_residuals(opt.compression, twins[rank], compressed, (spec, transport, step))

    # checkpoint: optimizer state (with the residuals) through torch.save / torch.load
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    sd = torch.load(buf)
    assert sd["hvdcomp"]["step"] == steps and sd["hvdcomp"]["compression"] == opt.compression.spec()
    model2 = model_fn()
    model2.load_state_dict(model.state_dict())
    opt2 = make_opt(model2, spec, transport)
    opt2.load_state_dict(sd)
    assert opt2._hvdcomp_step == steps
    n = check_residuals(opt2.compression, opt.compression, compressed, (spec, "loaded"))
    if opt.compression.name == "signef":
        assert n == 2
        for name in compressed:
            a, b = opt.compression.residual(name), opt2.compression.residual(name)
            assert np.array_equal(a.numpy().view(np.uint32), b.numpy().view(np.uint32))
        # the loaded residuals matter: with fresh ones the next step would differ
        fresh = [hvdcomp.get(spec) for _ in range(size)]
        other = expected_step(model2, opt2, fresh, steps, size)
    # the restored optimizer continues exactly like the reference
    want = step_and_check(model2, opt2, twins, steps, size, (spec, transport, "restored"))
    check_residuals(opt2.compression, twins[rank], compressed, (spec, transport, "restored"))
    if opt.compression.name == "signef":
        assert any(not torch.equal(want[n], other[n]) for n in compressed)


def main():
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    checked = check_exchange(rank, size)
    for spec in OPTIMIZER_SPECS:
        for transport in ("mpi", "horovod"):
            check_optimizer(spec, transport, size)
    say(rank, f"ef OK ({checked} exchanged tensors bit-exact)")


if __name__ == "__main__":
    main()
