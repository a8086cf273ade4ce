"""#24 item 5 on the DDP door, under torchrun (Gloo): hvdcomp's hook next to the
application's own collectives on the default group, and DDP(static_graph=True) with
no_sync() accumulation.  Expected values from plain torch, never from hvdcomp.

* check_syncbn_metric: a model with a synchronized batch norm (:class:`CpuSyncBN`: the
  collectives of torch.nn.SyncBatchNorm, an all-reduce on the default group in forward and
  another in backward; torch's own refuses CPU tensors) and, every step, a metric
  all-reduce after backward plus an asynchronous one started before forward and waited for
  after step().  Expected: one process training the same model with a plain BatchNorm1d on
  every rank's batch concatenated, the loss the mean of the ranks' losses (what
  synchronized batch norm under data parallelism computes); parameters and running
  statistics after every step, and the metrics.  For ``none`` (summed by all_reduce, and as
  wire messages) to float32 rounding; for a compressor (QSGD) the exchange must still run
  once per step with the metrics and batch-norm statistics right and the replicas equal.
* check_static_no_sync: DDP(static_graph=True) accumulating 3 micro-batches (2 under
  no_sync()) per optimizer step: the hook runs once per optimizer step, and the averaged
  gradients and parameters equal plain DDP(static_graph=True)'s (no hook: DDP's own
  all-reduce) in the same process, and the average of every rank's accumulated gradient
  computed here, for ``none`` both ways.  check_static_first_no_sync: the first iteration
  under no_sync(), which PyTorch's own DDP refuses: the hook does the same.

Each rank writes rank<r>.ok when every check passed; a hang dumps every thread's stack and
exits (faulthandler), so the launcher's timeout is a second watchdog only.
"""
import copy
import faulthandler
import os
import sys
import time
import warnings

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import hvdcomp
import hvdcomp.ddp

# the differentiable all_reduce (its deprecation names a private module as the successor)
warnings.filterwarnings("ignore", "torch.distributed.nn.functional.all_reduce is deprecated")

STEPS = 5
LR, MOM = 0.1, 0.9
B = 6                                   # samples per rank and micro-batch


def say(rank, msg):
    print(f"[rank {rank}] {msg}", flush=True)
    with open(os.path.join(os.environ["HVDCOMP_TEST_OUT"], f"rank{rank}.ok"), "w") as f:
        f.write(msg)


class CpuSyncBN(nn.BatchNorm1d):
    """Synchronized batch norm over the default group, with torch.nn.SyncBatchNorm's
    collectives (torch's refuses CPU tensors): in forward an all-reduce of every rank's
    per-feature sums, sums of squares and count; in backward (torch.distributed.nn's
    differentiable all_reduce) an all-reduce of their gradients.  Running statistics as
    BatchNorm1d's over the global batch (unbiased variance)."""

    def forward(self, x):
        if not self.training:
            return super().forward(x)
        c = x.shape[1]
        local = torch.cat([x.sum(0), (x * x).sum(0), x.new_full((1,), float(x.shape[0]))])
        tot = dist_fn.all_reduce(local)
        n = tot[-1]
        mean = tot[:c] / n
        var = tot[c:2 * c] / n - mean * mean
        with torch.no_grad():
            self.num_batches_tracked.add_(1)
            m = self.momentum
            self.running_mean.mul_(1 - m).add_(mean.detach(), alpha=m)
            self.running_var.mul_(1 - m).add_(var.detach() * (n / (n - 1)), alpha=m)
        return (x - mean) / torch.sqrt(var + self.eps) * self.weight + self.bias


def net(bn):
    torch.manual_seed(5)
    return nn.Sequential(nn.Linear(12, 24), bn(24), nn.ReLU(), nn.Linear(24, 3))


def batch(rank, step, micro=0):
    g = torch.Generator().manual_seed(100 * step + 10 * rank + micro)
    return torch.randn(B, 12, generator=g) * 3 + 1, torch.randint(0, 3, (B,), generator=g)


def check_syncbn_metric(rank, size, spec, summable):
    model = net(CpuSyncBN)
    ref = net(nn.BatchNorm1d)                 # one process, every rank's batch at once
    ref.load_state_dict(model.state_dict())
    ddp = DDP(model, bucket_cap_mb=0.001)     # several buckets
    state = hvdcomp.ddp.HookState(ddp, spec, min_compress_numel=16,
                                  allreduce_summable=summable)
    ddp.register_comm_hook(state, hvdcomp.ddp.hook)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOM)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR, momentum=MOM)
    exact = spec == "none"
    for step in range(STEPS):
        # an application collective in flight over the whole step
        count = torch.tensor([float(step + 1 + rank)])
        work = dist.all_reduce(count, async_op=True)
        opt.zero_grad()
        x, y = batch(rank, step)
        loss = F.cross_entropy(ddp(x), y)
        loss.backward()
        metric = loss.detach().clone()
        dist.all_reduce(metric)               # the metric all-reduce of every step
        metric /= size
        opt.step()
        work.wait()
        assert state.step == step + 1, (spec, step, state.step)
        assert float(count) == sum(step + 1 + r for r in range(size)), (step, float(count))

        # the reference: every rank's batch through one plain BatchNorm1d
        xs, ys = zip(*(batch(r, step) for r in range(size)))
        out = ref(torch.cat(xs))
        losses = [F.cross_entropy(out[r * B:(r + 1) * B], ys[r]) for r in range(size)]
        ref_opt.zero_grad()
        (sum(losses) / size).backward()
        ref_opt.step()
        want_metric = float(sum(losses).detach() / size)
        assert abs(float(metric) - want_metric) <= 1e-5 * (1 + abs(want_metric)), \
            (spec, step, float(metric), want_metric)
        bn, rbn = model[1], ref[1]
        for name in ("running_mean", "running_var"):
            a, b = getattr(bn, name), getattr(rbn, name)
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), (spec, step, name,
                                                               (a - b).abs().max())
        assert int(bn.num_batches_tracked) == step + 1
        if exact:
            for (n, p), q in zip(model.named_parameters(), ref.parameters()):
                assert torch.allclose(p, q, rtol=1e-5, atol=1e-6), (spec, summable, step, n,
                                                                   (p - q).abs().max())
        else:
            # a lossy compressor: the reference follows this rank's parameters, so each
            # step checks the statistics and metric of the same model
            ref.load_state_dict(model.state_dict())
            ref_opt.load_state_dict(opt.state_dict())
        replicas_agree(model, (spec, summable, step))
    assert state.last_stats.fp32_bytes > 0
    state.close()


def replicas_agree(model, what):
    flat = torch.cat([t.detach().reshape(-1).double() for t in model.state_dict().values()
                      if t.is_floating_point()])
    got = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(got, flat)
    assert all(torch.equal(got[0], g) for g in got), what


def local_grads(model, rank, step, micro):
    """{name: gradient} of ``rank``'s ``micro`` micro-batches of ``step`` (each loss divided
    by ``micro``), accumulated on a copy of ``model``: plain torch, one process."""
    m = copy.deepcopy(model)
    m.zero_grad(set_to_none=True)
    for k in range(micro):
        x, y = batch(rank, step, k)
        (F.cross_entropy(m(x), y) / micro).backward()
    return [p.grad for p in m.parameters()]


def micro_steps(ddp, rank, step, micro):
    """``micro`` micro-batches through ``ddp``, all but the last under no_sync()."""
    for k in range(micro):
        x, y = batch(rank, step, k)
        if k < micro - 1:
            with ddp.no_sync():
                (F.cross_entropy(ddp(x), y) / micro).backward()
        else:
            (F.cross_entropy(ddp(x), y) / micro).backward()


def check_static_no_sync(rank, size, summable, micro=3):
    """DDP(static_graph=True), 3 micro-batches per optimizer step (2 under no_sync()); the
    first optimizer step has one micro-batch (PyTorch's own DDP fails when the first
    iteration of a static graph runs under no_sync(): check_static_first_no_sync)."""
    model = net(nn.BatchNorm1d)
    plain_model = copy.deepcopy(model)
    ddp = DDP(model, static_graph=True, bucket_cap_mb=0.001)
    state = hvdcomp.ddp.HookState(ddp, "none", min_compress_numel=16,
                                  allreduce_summable=summable)
    ddp.register_comm_hook(state, hvdcomp.ddp.hook)
    plain = DDP(plain_model, static_graph=True, bucket_cap_mb=0.001)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOM)
    plain_opt = torch.optim.SGD(plain_model.parameters(), lr=LR, momentum=MOM)

    def same(a, b):     # 2 ranks: (a + b) / 2 in any order, bit for bit; more: to rounding
        return torch.equal(a, b) if size == 2 else torch.allclose(a, b, rtol=1e-6, atol=1e-7)

    for step in range(STEPS):
        k = 1 if step == 0 else micro
        # the average of every rank's accumulated gradient, in this process (plain torch)
        per_rank = [local_grads(model, r, step, k) for r in range(size)]
        want = [sum(g[i] for g in per_rank) / size for i in range(len(per_rank[0]))]
        got = {}
        for m, o, tag in ((ddp, opt, "hook"), (plain, plain_opt, "plain")):
            o.zero_grad()
            micro_steps(m, rank, step, k)
            got[tag] = [p.grad.clone() for p in m.module.parameters()]
            o.step()
        # the exchange ran once per optimizer step, not per micro-batch
        assert state.step == step + 1, (summable, step, state.step)
        for (n, _), a, b, w in zip(model.named_parameters(), got["hook"], got["plain"], want):
            assert same(a, b), (summable, step, n, "plain DDP", (a - b).abs().max())
            assert torch.allclose(a, w, rtol=1e-5, atol=1e-7), (summable, step, n, "torch",
                                                                (a - w).abs().max())
        for (n, p), q in zip(model.named_parameters(), plain_model.parameters()):
            assert same(p, q), (summable, step, n)
    state.close()


def check_static_first_no_sync(rank, size):
    """The first iteration of DDP(static_graph=True) under no_sync(): PyTorch's own DDP
    raises (an internal assert of its reducer after its delayed all-reduce of the
    first micro-batch, pytorch/pytorch#143580); with hvdcomp's hook, the same error on
    every rank (the delayed all-reduce calls the hook: one exchange, on every rank), the
    state closes, and the ranks are still in step.  If PyTorch fixes it, both must give
    the same gradients."""
    outcome = {}
    for tag in ("plain", "hook"):
        model = net(nn.BatchNorm1d)
        ddp = DDP(model, static_graph=True, bucket_cap_mb=0.001)
        state = None
        if tag == "hook":
            state = hvdcomp.ddp.HookState(ddp, "none", min_compress_numel=16)
            ddp.register_comm_hook(state, hvdcomp.ddp.hook)
        try:
            micro_steps(ddp, rank, 0, 3)
            outcome[tag] = [p.grad.clone() for p in model.parameters()]
        except RuntimeError as e:
            outcome[tag] = str(e).split(" at ")[0]
        if state is not None:
            state.close()
    a, b = outcome["plain"], outcome["hook"]
    if isinstance(a, str):
        assert a == b, (a, b)
    else:
        assert not isinstance(b, str) and all(torch.equal(x, y) for x, y in zip(a, b)), b
    replicas_agree(net(nn.BatchNorm1d), "after the first no_sync")     # still in step


CHECKS = [
    ("syncbn_metric none allreduce", check_syncbn_metric, ("none", True)),
    ("syncbn_metric none messages", check_syncbn_metric, ("none", False)),
    ("syncbn_metric qsgd", check_syncbn_metric, ("qsgd:bits=4,bucket_size=64", True)),
    ("static_no_sync allreduce", check_static_no_sync, (True,)),
    ("static_no_sync messages", check_static_no_sync, (False,)),
    ("static_first_no_sync", check_static_first_no_sync, ()),
]


def main():
    # a hang becomes a failure: every thread's stack, then exit
    faulthandler.dump_traceback_later(float(os.environ.get("HVDCOMP_WORKER_WAIT", "240")),
                                      exit=True)
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, size = dist.get_rank(), dist.get_world_size()
    for name, fn, args in CHECKS:
        t = time.perf_counter()
        fn(rank, size, *args)
        if rank == 0:
            print(f"{name}: {time.perf_counter() - t:.1f} s", flush=True)
    say(rank, f"alongside OK ({len(CHECKS)} checks)")
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
