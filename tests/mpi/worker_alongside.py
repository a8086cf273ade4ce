"""#24 item 5 on the drop-in optimizer's door, under mpirun: synchronized batch norm and
the application's own Horovod collectives in every step next to hvdcomp's exchange, over
both transports (mpi: hvdcomp's own communicator; horovod: Horovod's named collectives).

Every step: an unnamed hvd.allreduce_async started before forward and waited for after
step() (in flight across the whole exchange), a synchronized batch norm's Horovod
collectives in forward and in backward (:class:`CpuSyncBN`: hvd.SyncBatchNorm's pattern;
Horovod's own needs CUDA), and an unnamed metric hvd.allreduce between backward and step().

Expected values from Horovod's own DistributedOptimizer with Compression.none on a twin
model (its own batch norm, the same collectives), never from hvdcomp: for ``none``
(Horovod's allreduce, or hvdcomp's wire messages) the parameters, the batch-norm running
statistics and the metrics after every step; for a compressor (QSGD) the twin follows
the model's parameters, so every step checks the statistics and metrics of the same
model, the replicas stay equal and the exchange ran once per step.  Hangs: cases.py's
barrier after each case aborts the job, and test_mpi_alongside.py's timeout fails it.
"""
import contextlib
import itertools
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from cases import case, run
from common import step_of

import horovod.torch as horovod
import hvdcomp.torch as hvd

STEPS = 5
LR, MOM = 0.1, 0.9
TRANSPORTS = ["mpi", "horovod"]
_cases = itertools.count()
PATHS = ["allreduce", "messages", "qsgd"]


class _SumOverRanks(torch.autograd.Function):
    """A Horovod sum over the ranks in forward, and of the gradient in backward (the
    gradient of a sum over ranks), named ``name`` + ".fwd" / ".bwd" as hvd.SyncBatchNorm
    names its collectives, or unnamed (Horovod numbers them) when ``name`` is None."""

    @staticmethod
    def forward(ctx, x, name):
        ctx.name = name
        return horovod.allreduce(x, op=horovod.Sum, name=name and f"{name}.fwd")

    @staticmethod
    def backward(ctx, g):
        return horovod.allreduce(g, op=horovod.Sum, name=ctx.name and f"{ctx.name}.bwd"), None


class CpuSyncBN(nn.BatchNorm1d):
    """Synchronized batch norm with hvd.SyncBatchNorm's pattern of collectives (Horovod
    collectives in forward and in backward; Horovod's own refuses CPU tensors): every rank's
    per-feature sums, sums of squares and count summed over the ranks in forward, their
    gradients in backward.  Running statistics as BatchNorm1d's over the global batch
    (unbiased variance).  ``name``: as _SumOverRanks."""

    def __init__(self, c, name="sync_batch_norm"):
        super().__init__(c)
        self.name = name

    def forward(self, x):
        if not self.training:
            return super().forward(x)
        c = x.shape[1]
        local = torch.cat([x.sum(0), (x * x).sum(0), x.new_full((1,), float(x.shape[0]))])
        tot = _SumOverRanks.apply(local, self.name)
        n = tot[-1]
        mean = tot[:c] / n
        var = tot[c:2 * c] / n - mean * mean
        with torch.no_grad():
            self.num_batches_tracked.add_(1)
            m = self.momentum
            self.running_mean.mul_(1 - m).add_(mean.detach(), alpha=m)
            self.running_var.mul_(1 - m).add_(var.detach() * (n / (n - 1)), alpha=m)
        return (x - mean) / torch.sqrt(var + self.eps) * self.weight + self.bias


def net(name="sync_batch_norm"):
    torch.manual_seed(5)
    return nn.Sequential(nn.Linear(12, 24), CpuSyncBN(24, name), nn.ReLU(), nn.Linear(24, 3))


def batch(rank, step, n=6):
    g = torch.Generator().manual_seed(100 * step + 10 * rank)
    return torch.randn(n, 12, generator=g) * 3 + 1, torch.randint(0, 3, (n,), generator=g)


def identical_everywhere(model, what):
    flat = torch.cat([t.detach().reshape(-1).double() for t in model.state_dict().values()
                      if t.is_floating_point()])
    got = horovod.allgather(flat.view(1, -1), name=f"alongside.replicas.{what}")
    assert all(torch.equal(got[0], got[r]) for r in range(hvd.size())), what


def one_step(model, opt, rank, step):
    """One training step with the application's collectives around the exchange; returns
    (the metric: the loss averaged by an unnamed hvd.allreduce, the unnamed asynchronous
    sum)."""
    count = torch.tensor([float(step + 1 + rank)])
    handle = horovod.allreduce_async(count, op=horovod.Sum)      # unnamed, in flight
    opt.zero_grad()
    x, y = batch(rank, step)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    metric = horovod.allreduce(loss.detach())                    # unnamed metric average
    opt.step()
    total = horovod.synchronize(handle)
    return float(metric), float(total)


@case.each(PATHS, TRANSPORTS)
def syncbn_metric(path, transport):
    _syncbn_metric(path, transport, "sync_batch_norm")


@case.each(["none", "qsgd:bits=4,bucket_size=64", "alq:bits=3,bucket_size=64"], TRANSPORTS)
def skewed(spec, transport):
    """As syncbn_metric, with ranks out of phase (:func:`out_of_phase`): named collectives
    match whatever the order."""
    with out_of_phase():
        _syncbn_metric("allreduce" if spec == "none" else spec, transport, "sync_batch_norm")


@case.each(TRANSPORTS)
def unnamed_in_backward(transport):
    """The batch norm's collectives unnamed (as the gradient of a differentiable
    hvd.allreduce or hvd.allgather is), with ranks out of phase: Horovod names an unnamed
    collective by a count of every operation started in the process, which hvdcomp's
    threads advance at other moments on each rank; the drop-in optimizer makes the count
    the application's own (hvdcomp.transport.horovod.name_unnamed_collectives), so they
    match.  (Without it: allreduce.noname.6 on one rank, .7 on the other, and Horovod
    waits for ever.)"""
    with out_of_phase():
        _syncbn_metric("allreduce", transport, None)


@contextlib.contextmanager
def out_of_phase():
    """On rank 0 the batch norm's backward collective starts 0.2 s late, on rank 1 every
    sum of hvdcomp's exchange does: hvdcomp's and the application's Horovod operations
    start in different orders on the two ranks (the first bucket, the last layer alone,
    is summed while backward goes on through the batch norm).  The unnamed collectives of
    one_step outside backward are started where the exchange starts none."""
    from hvdcomp.transport.horovod import HorovodAllreduce
    bwd, start = _SumOverRanks.backward, HorovodAllreduce.start

    def late_bwd(ctx, g):
        time.sleep(0.2)
        return bwd(ctx, g)

    def late_start(self, buf, name):
        time.sleep(0.2)
        return start(self, buf, name)

    if hvd.rank() == 0:
        _SumOverRanks.backward = staticmethod(late_bwd)
    else:
        HorovodAllreduce.start = late_start
    try:
        yield
    finally:
        _SumOverRanks.backward, HorovodAllreduce.start = staticmethod(bwd), start


def _syncbn_metric(path, transport, bn_name):
    rank, size = hvd.rank(), hvd.size()
    spec = path if ":" in path else "qsgd:bits=4,bucket_size=64" if path == "qsgd" else "none"
    lossy = spec != "none"
    tag = f"{path.split(':')[0]}.{transport}.{_cases.__next__()}"
    model, twin = net(bn_name), net(bn_name)
    twin.load_state_dict(model.state_dict())
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=LR, momentum=MOM),
        named_parameters=[(f"{tag}.{n}", p) for n, p in model.named_parameters()],
        compression=spec, transport=transport, min_compress_numel=16,
        allreduce_summable=path != "messages",
        # the last layer alone fills the first bucket: its exchange starts while backward
        # goes on through the batch norm
        fusion_bytes=300)
    assert opt.transport == transport, opt.transport
    ref = horovod.DistributedOptimizer(
        torch.optim.SGD(twin.parameters(), lr=LR, momentum=MOM),
        named_parameters=[(f"ref.{tag}.{n}", p)
                          for n, p in twin.named_parameters()],
        compression=horovod.Compression.none)
    try:
        for step in range(STEPS):
            metric, total = one_step(model, opt, rank, step)
            want_metric, want_total = one_step(twin, ref, rank, step)
            assert step_of(opt) == step + 1, (path, transport, step, step_of(opt))
            assert total == want_total == sum(step + 1 + r for r in range(size)), \
                (step, total, want_total)
            assert abs(metric - want_metric) <= 1e-6 * (1 + abs(want_metric)), \
                (path, transport, step, metric, want_metric)
            bn, tbn = model[1], twin[1]
            for name in ("running_mean", "running_var"):
                a, b = getattr(bn, name), getattr(tbn, name)
                assert torch.allclose(a, b, rtol=1e-6, atol=1e-7), (path, transport, step,
                                                                   name, (a - b).abs().max())
            if not lossy:
                for (n, p), q in zip(model.named_parameters(), twin.parameters()):
                    # 2 ranks: (a + b) / 2 in any order: bit for bit; more: to rounding
                    ok = (torch.equal(p, q) if size == 2
                          else torch.allclose(p, q, rtol=1e-6, atol=1e-7))
                    assert ok, (path, transport, step, n, (p - q).abs().max())
            else:
                twin.load_state_dict(model.state_dict())
                ref.load_state_dict(_plain_state(opt))
            identical_everywhere(model, f"{tag}.{step}")
    finally:
        opt.close()


def _plain_state(opt):
    """The wrapped SGD's state_dict (momentum buffers) without hvdcomp's part."""
    sd = dict(opt.state_dict())
    sd.pop("hvdcomp", None)
    return sd


if __name__ == "__main__":
    run()
