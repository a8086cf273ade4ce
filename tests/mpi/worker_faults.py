"""Issue 15 items 5 and 10: one rank fails in the middle of training; the job must end.

    worker_faults.py MODE TRANSPORT [COLLECTIVE]
        (MODE: raise-mid, raise-between, interrupt, kill, skip; COLLECTIVE: allgather
        (default) or reduce_scatter)

Rank 1, at step 3: raises a ValueError in the middle of its backward pass (after the last
layer's gradients went to the exchange), or between two steps, or gets SIGINT during
backward (KeyboardInterrupt), or kills itself with SIGKILL.  The other ranks train on;
they must raise a RankFailure naming rank 1 (written to rank<r>.failure before it goes
uncaught), except after SIGKILL, where the launcher ends them.  "skip": rank 1 skips
iteration 3 (no backward, no step) and so ends one step before the others, which then wait
for its part of their last step: they must raise (OutOfStep, written to rank<r>.failure)
instead of waiting forever; rank 1 writes fault.time when it leaves.  The model sends its
weight matrices as QSGD wire messages through TRANSPORT and its biases through Horovod's
allreduce, in several buckets.
"""
import os
import signal
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from common import ROOT  # noqa: F401 - puts the checkout on sys.path

import hvdcomp
import hvdcomp.torch as hvd

FAIL_STEP = 3


class Trap(torch.autograd.Function):
    """Identity; its backward runs ``action`` (on rank 1 at the failing step)."""
    action = None

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        if Trap.action is not None:
            Trap.action()
        return g


def main():
    mode, transport = sys.argv[1], sys.argv[2]
    collective = sys.argv[3] if len(sys.argv) > 3 else "allgather"
    hvd.init()
    rank = hvd.rank()
    torch.manual_seed(0)
    l1, l2 = nn.Linear(32, 64), nn.Linear(64, 64)
    l3 = nn.Linear(64, 4)
    params = [("l1.weight", l1.weight), ("l1.bias", l1.bias), ("l2.weight", l2.weight),
              ("l2.bias", l2.bias), ("l3.weight", l3.weight), ("l3.bias", l3.bias)]
    opt = hvd.DistributedOptimizer(torch.optim.SGD([p for _, p in params], lr=0.1),
                                   named_parameters=params, transport=transport,
                                   compression="qsgd:bits=4,bucket_size=64",
                                   min_compress_numel=256, fusion_bytes=4096,
                                   collective=collective)
    out = os.environ.get("HVDCOMP_TEST_OUT", ".")
    try:
        for step in range(10):
            g = torch.Generator().manual_seed(100 * step + rank)
            x, y = torch.randn(16, 32, generator=g), torch.randint(0, 4, (16,), generator=g)
            failing = rank == 1 and step == FAIL_STEP
            if failing and mode == "skip":
                continue
            if failing:                           # when the fault happens, for the driver
                with open(os.path.join(out, "fault.time"), "w") as f:
                    f.write(repr(time.time()))
            if failing and mode == "raise-between":
                raise ValueError("boom between steps on rank 1")
            if failing and mode == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if failing and mode == "raise-mid":
                def boom():
                    raise ValueError("boom in backward on rank 1")
                Trap.action = boom
            if failing and mode == "interrupt":
                Trap.action = lambda: os.kill(os.getpid(), signal.SIGINT)
            h = torch.tanh(l1(x))
            h = torch.tanh(l2(Trap.apply(h)))      # l3's and l2's gradients come first
            loss = F.cross_entropy(l3(h), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    except (hvdcomp.RankFailure, hvdcomp.OutOfStep) as e:
        with open(os.path.join(out, f"rank{rank}.failure"), "w") as f:
            f.write(f"{getattr(e, 'rank', '')}\n{type(e).__name__}: {e}")
        raise
    except Exception as e:                # noqa: BLE001 - Horovod's own errors, for the driver
        with open(os.path.join(out, f"rank{rank}.failure"), "w") as f:
            f.write(f"\n{type(e).__name__}: {e}")
        raise
    if mode == "skip" and rank == 1:
        with open(os.path.join(out, "fault.time"), "w") as f:
            f.write(repr(time.time()))
        print(f"[rank {rank}] left after its last step (mode {mode})", flush=True)
        return
    print(f"[rank {rank}] trained to the end (mode {mode})", flush=True)


if __name__ == "__main__":
    main()
