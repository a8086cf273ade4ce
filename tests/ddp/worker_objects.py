"""Issue 24 item 3 through the DDP hook, under torchrun (Gloo, CPU): a new DDP wrapper
around the same module with the same HookState or a new one, copies and pickles of the
state and of the model, and a state shared by two DDP wrappers in one backward pass
(refused).  Expected averages come from plain torch (every rank recomputes every rank's
gradient on a hook-free copy of the model), never from hvdcomp.  Every rank writes
rank<r>.ok at the end; test_ddp_objects.py's timeout turns a hang into a failure (and
faulthandler prints where each rank was).
"""
import copy
import faulthandler
import io
import os
import pickle
import sys
import threading

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import hvdcomp
import hvdcomp.ddp

LR = 0.1


def model_fn(seed=11):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(20, 30), nn.Tanh(), nn.Linear(30, 4))


def batch(rank, step, n=8):
    g = torch.Generator().manual_seed(1000 * step + 10 * rank)
    return torch.randn(n, 20, generator=g), torch.randint(0, 4, (n,), generator=g)


def loss_of(model, rank, step):
    x, y = batch(rank, step)
    return F.cross_entropy(model(x), y)


def mean_grads(module, step):
    """{name: average of every rank's gradient} of plain torch on copies of ``module``."""
    size = dist.get_world_size()
    acc = {}
    for r in range(size):
        m = copy.deepcopy(module)
        m.zero_grad(set_to_none=True)
        loss_of(m, r, step).backward()
        for n, p in m.named_parameters():
            acc[n] = acc.get(n, 0) + p.grad.double()
    return {n: (g / size).float() for n, g in acc.items()}


def close(got, want, what, tol=1e-6):
    for n, w in want.items():
        assert torch.allclose(got[n], w, rtol=tol, atol=tol), (what, n,
                                                               float((got[n] - w).abs().max()))


def grads(module):
    return {n: p.grad.detach().clone() for n, p in module.named_parameters()}


def backward(ddp, module, step, check=True):
    """One backward pass through ``ddp``; with ``check``, p.grad against plain torch."""
    want = mean_grads(module, step) if check else None
    module.zero_grad(set_to_none=True)
    loss_of(ddp, dist.get_rank(), step).backward()
    if check:
        close(grads(module), want, f"averages at step {step}")


def raises(fn, exc, *words):
    try:
        fn()
    except exc as e:
        missing = [w for w in words if w not in str(e)]
        assert not missing, (missing, str(e))
        return
    raise AssertionError(f"no {exc.__name__} raised")


def identical_everywhere(module, what):
    flat = torch.cat([p.detach().reshape(-1) for p in module.parameters()])
    got = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(got, flat)
    assert all(torch.equal(got[0], g) for g in got), what


def new_wrappers(spec):
    """A new DDP wrapper around the same module with the same HookState (used in turn with
    the old one: one wrapper at a time works), then one with a new HookState, which
    replaces the old state (closed: its threads stopped, no thread more than one exchange
    has); the old wrapper, still holding the old state, then raises on every rank."""
    summable = spec != "none"
    m = model_fn()
    ddp1 = DDP(m, bucket_cap_mb=0.001)
    state = hvdcomp.ddp.HookState(ddp1, compression=spec, min_compress_numel=16,
                                  allreduce_summable=summable)
    ddp1.register_comm_hook(state, hvdcomp.ddp.hook)
    check = spec == "none"
    backward(ddp1, m, 0, check)
    threads = threading.active_count()
    ddp2 = DDP(m, bucket_cap_mb=0.01)                # other buckets
    ddp2.register_comm_hook(state, hvdcomp.ddp.hook)
    for step, ddp in [(1, ddp2), (2, ddp1), (3, ddp2)]:
        backward(ddp, m, step, check)
        assert state.step == step + 1, (state.step, step)          # one exchange each
        assert state.last_stats.step == step
    assert threading.active_count() == threads
    # a new state for a new wrapper: the old state is replaced
    ddp3 = DDP(m)
    state2 = hvdcomp.ddp.HookState(ddp3, compression=spec, min_compress_numel=16,
                                   allreduce_summable=summable)
    assert state.exchange is None                    # closed: threads, groups gone
    ddp3.register_comm_hook(state2, hvdcomp.ddp.hook)
    backward(ddp3, m, 4, check)
    assert state2.step == 1 and state.step == 0
    assert threading.active_count() == threads, (threading.active_count(), threads)
    identical_everywhere(m, "replicas")
    raises(lambda: backward(ddp2, m, 5, check=False), RuntimeError,
           "replaced by HookState number")
    state2.close()


def copies(spec):
    """The live HookState (and the DDP wrapper holding it): pickle, deepcopy, copy and
    torch.save raise TypeError naming state_dict(); its state_dict goes through torch.save into a HookState of a new
    wrapper.  A deep copy of the model (an EMA / SWA twin) trains without any exchange."""
    m = model_fn()
    ddp = DDP(m)
    state = hvdcomp.ddp.register(ddp, compression=spec, min_compress_numel=16)
    backward(ddp, m, 0, check=spec == "none")
    for fn in [lambda: pickle.dumps(state), lambda: copy.deepcopy(state),
               lambda: copy.copy(state), lambda: torch.save(state, io.BytesIO())]:
        raises(fn, TypeError, "cannot be pickled, copied or deep-copied", "state_dict()")
    # the DDP wrapper holds the state among its comm hooks: the same error
    raises(lambda: copy.deepcopy(ddp), TypeError, "state_dict()")
    twin = copy.deepcopy(m)
    loss_of(twin, dist.get_rank(), 1).backward()
    local = copy.deepcopy(m)
    loss_of(local, dist.get_rank(), 1).backward()
    close(grads(twin), grads(local), "the twin's local gradients", tol=0)
    assert state.step == 1
    buf = io.BytesIO()
    torch.save(state.state_dict(), buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=False)
    ddp2 = DDP(m)
    state2 = hvdcomp.ddp.register(ddp2, compression=spec, min_compress_numel=16)  # replaces
    state2.load_state_dict(saved)
    assert state2.step == 1 and state.exchange is None
    backward(ddp2, m, 1, check=spec == "none")
    assert state2.step == 2
    state2.close()


def two_live_refused():
    """One HookState registered on two DDP wrappers of the same module, both run forward
    before one backward pass: RuntimeError on every rank naming the fix."""
    m = model_fn()
    a, b = DDP(m), DDP(m)
    state = hvdcomp.ddp.HookState(a, compression="none", min_compress_numel=16)
    a.register_comm_hook(state, hvdcomp.ddp.hook)
    b.register_comm_hook(state, hvdcomp.ddp.hook)
    x, y = batch(dist.get_rank(), 0)

    def both():
        (F.cross_entropy(a(x), y) + F.cross_entropy(b(x), y)).backward()
    raises(both, RuntimeError, "two DistributedDataParallel wrappers")
    state.close()


def main():
    faulthandler.dump_traceback_later(int(os.environ.get("HVDCOMP_WATCHDOG", "240")),
                                      exit=True)
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    for spec in ["none", "topk:density=0.1"]:
        new_wrappers(spec)
        copies(spec)
    two_live_refused()
    dist.barrier()
    with open(os.path.join(os.environ["HVDCOMP_TEST_OUT"], f"rank{rank}.ok"), "w") as f:
        f.write("objects OK")
    print(f"[rank {rank}] objects OK", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
