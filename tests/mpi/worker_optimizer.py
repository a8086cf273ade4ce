"""The drop-in optimizer on N ranks: its step equals a hand-computed averaged step; ALQ
refits give an identical level table on every rank; state round-trips; Horovod's own
optimizer refuses to sum hvdcomp codes; disagreeing ranks get a clear error, not a hang."""
import copy
import sys

import numpy as np
import torch
import torch.nn.functional as F

from common import say

import hvdcomp
import hvdcomp.torch as hvd

LR = 0.1


def model_fn():
    torch.manual_seed(11)
    return torch.nn.Sequential(torch.nn.Linear(20, 30), torch.nn.Tanh(), torch.nn.Linear(30, 4))


def batch(rank, step, bp=0):
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + bp)
    return torch.randn(8, 20, generator=g), torch.randint(0, 4, (8,), generator=g)


def local_grads(model, rank, step, bpps=1):
    m = copy.deepcopy(model)
    m.zero_grad()
    for bp in range(bpps):
        x, y = batch(rank, step, bp)
        F.cross_entropy(m(x), y).backward()
    return {n: p.grad.detach().clone() for n, p in m.named_parameters()}


def expected_step(model, opt, step, size, bpps=1):
    """p - lr * average over ranks of decode(encode(g_r)), computed in this one process."""
    ex = opt._exchange
    grads = [local_grads(model, r, step, bpps) for r in range(size)]
    new = {}
    for name, p in model.named_parameters():
        e = ex.entries[name]
        acc = torch.zeros(p.numel())
        for r in range(size):
            key = hvdcomp.TensorKey(name, e.tensor_id, step, r, size, ex.seed)
            e.compressor.decode(hvdcomp.Message.from_bytes(
                e.compressor.encode(grads[r][name], key).to_bytes()), key, acc)
        e.compressor.finalize(acc, hvdcomp.TensorKey(name, e.tensor_id, step, hvd.rank(), size, ex.seed))
        new[name] = p.detach().clone().add_(acc.view(p.shape), alpha=-LR)  # SGD: p += -lr*g
    return new


def train_steps(spec, transport, steps, bpps=1, **kw):
    rank, size = hvd.rank(), hvd.size()
    model = model_fn()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR),
                                   named_parameters=model.named_parameters(),
                                   compression=spec, transport=transport,
                                   backward_passes_per_step=bpps, min_compress_numel=16,
                                   **kw)
    for step in range(steps):
        want = expected_step(model, opt, step, size, bpps)
        opt.zero_grad()
        for bp in range(bpps):
            x, y = batch(rank, step, bp)
            F.cross_entropy(model(x), y).backward()
        opt.step()
        for name, p in model.named_parameters():
            e = opt._exchange.entries[name]
            if e.allreduce:   # summed by Horovod in MPI's order, fp16 sums in fp16
                tol = 1e-4 if e.compressor.name == "fp16" else 1e-7
                assert torch.allclose(p.detach(), want[name], rtol=1e-6, atol=tol), (spec, step, name, (p.detach() - want[name]).abs().max())
            else:                                       # decoded in rank order: exact
                assert torch.equal(p.detach(), want[name]), (spec, transport, step, name)
    return model, opt


class _Probe(torch.autograd.Function):
    """Identity whose backward waits until the exchange has already averaged the last
    layer's gradient: proof that communication overlaps the rest of backward."""
    ex = None
    seen = None

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        import time
        deadline = time.time() + 20
        while "4.weight" not in _Probe.ex.results and time.time() < deadline:
            time.sleep(0.01)
        _Probe.seen = sorted(_Probe.ex.results)
        return g


def check_overlap(rank):
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(20, 30), torch.nn.Tanh(), torch.nn.Linear(30, 30),
                                torch.nn.Tanh(), torch.nn.Linear(30, 4))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR),
                                   named_parameters=model.named_parameters(),
                                   compression="qsgd:bits=4", min_compress_numel=16,
                                   fusion_bytes=1)             # one bucket per tensor
    _Probe.ex = opt._exchange
    x, y = batch(rank, 0)
    h = _Probe.apply(model[1](model[0](x)))                   # between layer 0 and layer 2
    F.cross_entropy(model[4](model[3](model[2](h))), y).backward()
    opt.step()
    # while layer 0's gradient was still being computed, layers 4 (and 2) were averaged
    assert "4.weight" in _Probe.seen and "0.weight" not in _Probe.seen, _Probe.seen


def main():
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    check_overlap(rank)
    for spec in ("none", "fp16", "qsgd:bits=4,bucket_size=64", "alq:bits=3,bucket_size=64"):
        for transport in ("mpi", "horovod"):
            train_steps(spec, transport, 3)
    train_steps("amq:bits=3,bucket_size=64", "mpi", 2, bpps=2)

    # ALQ refit: statistics of step 1 summed across ranks, fitted, broadcast before step 2.
    model, opt = train_steps("alq:bits=3,bucket_size=64,refit_steps=2/4,refit_every=0",
                             "mpi", 5)
    comp = opt.compression
    assert comp.level_version == 2, comp.level_version
    lv = hvd.allgather(comp.levels.view(1, -1), name="levels")
    assert all(torch.equal(lv[0], lv[r]) for r in range(size)), lv
    assert not torch.equal(comp.levels, torch.tensor(comp.initial_levels(), dtype=torch.float32))
    # state_dict round trip restores levels, version and step bit-exactly
    sd = opt.state_dict()
    model2, opt2 = model_fn(), None
    opt2 = hvd.DistributedOptimizer(torch.optim.SGD(model2.parameters(), lr=LR),
                                    named_parameters=model2.named_parameters(),
                                    compression="alq:bits=3,bucket_size=64",
                                    min_compress_numel=16)
    opt2.load_state_dict(sd)
    assert torch.equal(opt2.compression.levels, comp.levels)
    assert opt2.compression.level_version == 2 and opt2._hvdcomp_step == 5

    # Horovod's own optimizer and allreduce never sum hvdcomp codes.
    import horovod.torch as horovod
    m = model_fn()
    try:
        hopt = horovod.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=LR),
                                            named_parameters=m.named_parameters(),
                                            compression=hvdcomp.get("alq"))
        x, y = batch(rank, 0)
        F.cross_entropy(m(x), y).backward()
        hopt.step()
        raise AssertionError("Horovod summed ALQ codes")
    except TypeError as e:
        assert "hvdcomp.torch.DistributedOptimizer" in str(e), e
    t = torch.full((5,), float(rank + 1))
    avg = horovod.allreduce(t, compression=hvdcomp.get("fp16"), name="fp16check")
    assert torch.allclose(avg, torch.full((5,), (size + 1) / 2)), avg
    try:
        horovod.allreduce(t, compression=hvdcomp.get("qsgd"), name="qsgdcheck")
        raise AssertionError("hvd.allreduce summed QSGD codes")
    except TypeError as e:
        assert "DistributedOptimizer" in str(e)

    # Auto: given costs that favour QSGD for the 600-element weight and fp32 for the
    # 120-element one (hand-worked: t32 = 2e-6 * 4n; tQSGD = 1e-6 * (100 + n / 2) + N * 5e-4),
    # the plan is that, identical on every rank, and the step is exact as above.
    from hvdcomp.auto import CodecCost, LinkCost
    auto = hvdcomp.Auto("qsgd:bits=4,bucket_size=64",
                        link=LinkCost(0.0, 2e-6, 0.0, 1e-6),
                        codec=CodecCost(0.0, 0.0, 5e-4, 0.0, 100.0, 0.5, 1e-3))
    _, opt = train_steps(auto, "mpi", 2)
    plan = opt.plan
    assert plan["0.weight"] == "qsgd" and plan["2.weight"] == "none", plan
    assert plan["0.bias"] == "none" and plan["2.bias"] == "none", plan
    assert opt.compression is auto.compressor and auto.plan == {"0.weight": "qsgd",
                                                                "2.weight": "none"}
    # measured costs: whatever the plan, every rank makes the same one and steps exactly
    _, opt = train_steps(hvdcomp.Auto("qsgd:bits=4,bucket_size=64"), "mpi", 1)
    digests = hvd.allgather_object(sorted(opt.plan.items()))
    assert all(d == digests[0] for d in digests), digests

    # Ranks that disagree on the compressor: every rank raises, nobody hangs.
    spec = "alq:bits=3" if rank == 0 else "alq:bits=4"
    m = model_fn()
    try:
        hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=LR),
                                 named_parameters=m.named_parameters(), compression=spec)
        raise AssertionError("disagreeing ranks were not detected")
    except RuntimeError as e:
        assert "disagree" in str(e)
    say(rank, "optimizer OK")


if __name__ == "__main__":
    main()
