"""Multi-rank half of test_toy_compressor.py (run by launch/run): the toy compressor of
toy_sign.py through the exchange on both transports and through the drop-in optimizer.

Expected values are the closed form of toy_sign's docstring: every rank rebuilds every
rank's gradient from the seed and averages ``mean(|g_r|) * sign(g_r)`` itself."""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import horovod.torch as hvd  # noqa: E402

import hvdcomp.torch as hvdt  # noqa: E402
from hvdcomp.exchange import Exchange  # noqa: E402
from hvdcomp.transport import HorovodAllreduce, make  # noqa: E402
from toy_sign import ToySign  # noqa: E402

SHAPES = {"a.weight": (7, 13), "a.bias": (13,), "b.weight": (3, 1, 5, 5), "one": (1,)}


def grad_of(name, rank, step):
    g = torch.Generator().manual_seed(1000 * step + 37 * rank + sum(map(ord, name)))
    x = torch.randn(SHAPES[name], generator=g)
    x.view(-1)[0] = 0.0                       # sign(0) is +1 on the wire
    return x


def closed_form(grads):
    """mean over ranks of mean(|g|) * (+1 where g >= 0 else -1), in float64."""
    acc = 0
    for g in grads:
        g = g.double()
        acc = acc + g.abs().mean() * torch.where(g >= 0, 1.0, -1.0).double()
    return acc / len(grads)


def close(got, want):
    """Equal up to float32 rounding of the scales (the average of +-s_r cancels)."""
    return torch.allclose(got.double().reshape(-1), want.reshape(-1), rtol=0,
                          atol=1e-6 * float(want.abs().max()) + 1e-12)


def main():
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    failures = []

    def check(what, ok, detail=""):
        if not ok:
            failures.append(f"rank {rank}: {what} {detail}")

    results = {}
    for tname in ("mpi", "horovod"):
        params = [(n, torch.nn.Parameter(torch.zeros(s))) for n, s in SHAPES.items()]
        ex = Exchange(params, ToySign(), make(tname), allreduce=HorovodAllreduce(hvd),
                      fusion_bytes=300, min_compress_numel=1, compress_1d=True, seed=5)
        for step in (0, 1):
            for n, p in params:
                p.grad = grad_of(n, rank, step)
            ex.begin(step)
            for n in (list(SHAPES) if rank % 2 else list(SHAPES)[::-1]):
                ex.ready(n)
            res, stats = ex.finish()
            for n in SHAPES:
                want = closed_form([grad_of(n, r, step) for r in range(size)]).reshape(-1)
                got = res[n].reshape(-1)
                check(f"{tname} step {step} {n}",
                      close(got, want),
                      f"max err {(got.double() - want).abs().max():.3g}")
                check(f"{tname} {n} compressor", stats.compressors[n] == "toysign",
                      stats.compressors[n])
            results.setdefault(step, []).append(res)
    for step, (r_mpi, r_hvd) in results.items():
        for n in SHAPES:
            check(f"mpi == horovod, step {step} {n}", torch.equal(r_mpi[n], r_hvd[n]))

    # The drop-in optimizer: p.grad averaged when backward returns; replicas stay equal.
    for tname in ("mpi", "horovod"):
        torch.manual_seed(0)
        model = torch.nn.Linear(6, 4)
        opt = hvdt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                        named_parameters=model.named_parameters(),
                                        compression="toysign", transport=tname,
                                        min_compress_numel=1, compress_1d=True)
        xs = [torch.randn(5, 6, generator=torch.Generator().manual_seed(r)) for r in range(size)]
        local = {}
        for r in range(size):       # every rank's local gradient, computed here
            m = torch.nn.Linear(6, 4)
            m.load_state_dict(model.state_dict())
            m(xs[r]).square().sum().backward()
            local[r] = {n: p.grad.clone() for n, p in m.named_parameters()}
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        opt.zero_grad()
        model(xs[rank]).square().sum().backward()
        for n, p in model.named_parameters():
            want = closed_form([local[r][n] for r in range(size)])
            check(f"optimizer {tname} grad {n}",
                  close(p.grad, want),
                  f"got {p.grad.reshape(-1)[:4].tolist()} want {want.reshape(-1)[:4].tolist()} "
                  f"local {local[rank][n].reshape(-1)[:4].tolist()}")
        opt.step()
        for n, p in model.named_parameters():
            gathered = hvd.allgather(p.detach().reshape(1, -1), name=f"toy.{tname}.{n}")
            check(f"optimizer {tname} replicas equal {n}",
                  all(torch.equal(gathered[0], gathered[r]) for r in range(size)))
            check(f"optimizer {tname} moved {n}", not torch.equal(p.detach(), before[n]))
        opt.close() if hasattr(opt, "close") else None

    out = os.environ["HVDCOMP_TEST_OUT"]
    with open(os.path.join(out, f"rank{rank}.txt"), "w") as f:
        f.write("\n".join(failures) if failures else "toy OK")


if __name__ == "__main__":
    main()
