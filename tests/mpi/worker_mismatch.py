"""Issue 15 items 6 and 7 on N ranks: mismatched settings (the transport included) are
reported on every rank while the optimizer is built, instead of hanging; a rank that
calls step() twice or skips step() raises OutOfStep on every rank at the next exchange;
replicas that start from different values raise Mismatch naming hvd.broadcast_parameters.
Each case raises on every rank alike, so the ranks go on to the next case together."""
import torch
import torch.nn as nn
import torch.nn.functional as F

from cases import case, run

import hvdcomp
import hvdcomp.torch as hvd

SPEC = "qsgd:bits=4,bucket_size=64"
TRANSPORTS = ["mpi", "horovod"]
SPECS = ["qsgd:bits=4,bucket_size=64", "none"]   # SPEC (wire messages); Horovod's sums
assert SPECS[0] == SPEC
SETTINGS = ["transport", "backward_passes_per_step", "op", "gradient_predivide_factor", "seed",
            "compression", "collective", "collective_in_spec"]


def model_fn(seed=3):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(20, 40), nn.Tanh(), nn.Linear(40, 4))


def make(model, **kw):
    kw.setdefault("compression", SPEC)
    kw.setdefault("min_compress_numel", 64)
    kw.setdefault("fusion_bytes", 2048)
    return hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                    named_parameters=model.named_parameters(), **kw)


def train_step(model, opt, rank, step, apply=True):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x, y = torch.randn(8, 20, generator=g), torch.randint(0, 4, (8,), generator=g)
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    if apply:
        opt.step()


def raises(exc_type, fn, *needles):
    try:
        fn()
    except exc_type as e:
        for n in needles:
            assert n in str(e), (n, str(e))
        return e
    raise AssertionError(f"{exc_type.__name__} not raised")


def odd_rank():
    """The rank that differs: the last one."""
    return hvd.rank() == hvd.size() - 1


@case.each(SETTINGS)
def settings_differ(setting):
    """Item 6: a setting that differs on the last rank is reported on every rank while the
    optimizer is built, naming the setting and the rank."""
    odd, size = odd_rank(), hvd.size()
    kw, needle = {
        "transport": (dict(transport="horovod" if odd else "mpi"), '  transport: "mpi" on rank'),
        "backward_passes_per_step": (dict(backward_passes_per_step=2 if odd else 1),
                                     "  backward_passes_per_step: 1 on"),
        "op": (dict(op=hvd.Sum if odd else hvd.Average), '  op: "Average" on'),
        "gradient_predivide_factor": (dict(gradient_predivide_factor=2.0 if odd else 1.0),
                                      "  gradient_predivide_factor"),
        "seed": (dict(seed=7 if odd else 0), "  seed: 0 on"),
        "compression": (dict(compression="qsgd:bits=2" if odd else SPEC), "  compression:"),
        # the collective (#11 item 2), as a setting and as the spec string's prefix
        "collective": (dict(collective="reduce_scatter" if odd else "allgather"),
                       '  collective: "allgather" on'),
        "collective_in_spec": (dict(compression="rs+" + SPEC if odd else SPEC),
                               '  collective: "default" on'),
    }[setting]
    raises(hvdcomp.Mismatch, lambda: make(model_fn(), **kw), needle, f"on rank {size - 1}")


@case.each(TRANSPORTS, SPECS)
def step_twice(transport, spec):
    """Item 6: step() twice on the last rank: OutOfStep on every rank, naming the others."""
    rank, size, odd = hvd.rank(), hvd.size(), odd_rank()
    model = model_fn()
    opt = make(model, transport=transport, compression=spec)
    train_step(model, opt, rank, 0)
    others = [r for r in range(size) if r != rank]
    if odd:                               # a second step(): exchanges again
        e = raises(hvdcomp.OutOfStep, opt.step, "synchronize()")
    else:
        e = raises(hvdcomp.OutOfStep, lambda: train_step(model, opt, rank, 1),
                   "ranks out of step", "synchronize()")
    assert e.ranks == (others if odd else [size - 1]), e.ranks
    opt.close()


@case.each(TRANSPORTS, SPECS)
def skipped_step(transport, spec):
    """Item 6: the last rank skips step(): OutOfStep on every rank at the next exchange."""
    rank, size, odd = hvd.rank(), hvd.size(), odd_rank()
    others = [r for r in range(size) if r != rank]
    model = model_fn()
    opt = make(model, transport=transport, compression=spec)
    train_step(model, opt, rank, 0, apply=not odd)   # the odd rank skips step()
    e = raises(hvdcomp.OutOfStep, lambda: train_step(model, opt, rank, 1),
               "ranks out of step", f"is in step {0 if odd else 1}")
    assert e.ranks == (others if odd else [size - 1]), e.ranks
    opt.close()


@case
def replicas_differ():
    """Item 7: replicas that start from different values raise Mismatch naming
    hvd.broadcast_parameters; after it, training goes on."""
    rank, size, odd = hvd.rank(), hvd.size(), odd_rank()
    model = model_fn(seed=5 if odd else 3)
    opt = make(model)
    raises(hvdcomp.Mismatch, lambda: train_step(model, opt, rank, 0),
           "hvd.broadcast_parameters", f"ranks {size - 1} hold other values than rank 0")
    opt.close()
    model = model_fn(seed=5 if odd else 3)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = make(model)
    for step in range(3):
        train_step(model, opt, rank, step)
    opt.close()


if __name__ == "__main__":
    run()
