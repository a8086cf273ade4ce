"""An elastic DDP job with hvdcomp's hook: it survives a worker's death and a resize.

    export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1       # see below
    .venv/bin/torchrun --nproc_per_node 2 --max-restarts 3 examples/elastic_ddp.py --dir /tmp/ck
    # several hosts, 1 to 4 of them, the same command on each (a host joining or leaving
    # restarts every worker with the new world):
    .venv/bin/torchrun --nnodes 1:4 --nproc_per_node 2 --max-restarts 3 --rdzv-backend c10d \\
        --rdzv-endpoint HOST:29400 --rdzv-id JOB examples/elastic_ddp.py --dir /shared/ck

torchrun restarts every worker when one dies; each (re)started worker resumes from the
newest complete checkpoint in --dir, saved every --every steps: the model and the optimizer
(rank 0, the same on every rank) and hvdcomp's hook state (one file per rank: residuals,
DGC's momentum and LAQ's records are per rank).  Restarted at the same world size, the run
continues bit for bit as if nothing had happened.  Restarted at another world size, every
rank loads rank 0's hook state: hvdcomp keeps the step and the state all ranks share (ALQ's
fitted levels, PowerSGD's Q), resets the per-rank state and logs a warning
(docs/semantics.md, "Elastic restarts").  --fail-at STEP: rank 1 dies (SIGKILL) just before
that step's backward on the first attempt, to try it; the other rank then prints a
traceback ("[rank0]: ... RuntimeError: ... gloo ... Connection closed by peer": its
collective with the dead worker fails) and torchrun logs "failed (exitcode: -9)" before it
restarts both and they print "resumed at step ...": expected, the job goes on.  A Gloo
traceback on the surviving workers at any restart is expected.  --hold STEP:SIZE: at that step, while
the world has SIZE ranks, the workers wait for a host to join or leave (a leaving host makes
their next barrier fail; docs/semantics.md, "Nodes joining and leaving"), to try a resize.
--out DIR: each rank writes its final parameters and hook state there.

TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: with torch 2.13, a restarted group shares the
rendezvous store of the attempt before it and init_process_group("gloo") can read a dead
worker's address and fail (Gloo connectFullMesh, "Connection refused"; 2 restarts in 4 here,
plain DDP without hvdcomp alike; PyTorch issue 135712); a store per attempt avoids it."""
import argparse
import os
import signal
import time

import torch
import torch.distributed as dist

import hvdcomp.ddp

ap = argparse.ArgumentParser()
ap.add_argument("--dir", required=True, help="checkpoint directory, shared by all ranks")
ap.add_argument("--compression", default="alq:bits=3,bucket_size=512,refit_steps=5")
ap.add_argument("--steps", type=int, default=40)
ap.add_argument("--every", type=int, default=10, help="checkpoint every this many steps")
ap.add_argument("--fail-at", type=int, default=-1)
ap.add_argument("--out", default="")
ap.add_argument("--hold", action="append", default=[], metavar="STEP:SIZE",
                help="at STEP, while the world has SIZE ranks, wait until torchrun restarts "
                     "the group (a node joining or leaving); repeatable")
args = ap.parse_args()
holds = {tuple(int(v) for v in h.split(":")) for h in args.hold}

dist.init_process_group("gloo")
rank, size = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)                                  # the same model and task everywhere
teacher = torch.randn(64, 10)
model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
ddp_model = torch.nn.parallel.DistributedDataParallel(model)
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
state = hvdcomp.ddp.HookState(ddp_model, compression=args.compression, optimizer=opt)
ddp_model.register_comm_hook(state, hvdcomp.ddp.hook)


def path(step, name):
    return os.path.join(args.dir, f"step-{step}", name)


def save(step):
    """Every rank its hook state, rank 0 the model and optimizer; then rank 0 marks the
    checkpoint complete (``latest``, replaced atomically) once every rank has saved."""
    os.makedirs(os.path.dirname(path(step, "x")), exist_ok=True)
    torch.save(state.state_dict(), path(step, f"hook.{rank}.pt"))
    if rank == 0:
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "world_size": size},
                   path(step, "main.pt"))
    dist.barrier()
    if rank == 0:
        with open(os.path.join(args.dir, "latest.tmp"), "w") as f:
            f.write(str(step))
        os.replace(os.path.join(args.dir, "latest.tmp"), os.path.join(args.dir, "latest"))


start = 0
if os.path.exists(os.path.join(args.dir, "latest")):
    with open(os.path.join(args.dir, "latest")) as f:
        start = int(f.read())
    main = torch.load(path(start, "main.pt"))
    model.load_state_dict(main["model"])
    opt.load_state_dict(main["opt"])
    mine = rank if main["world_size"] == size else 0      # resized: any rank's will do
    state.load_state_dict(torch.load(path(start, f"hook.{mine}.pt")))
    print(f"rank {rank}: resumed at step {start} (saved by {main['world_size']} ranks, "
          f"now {size})", flush=True)



def hold(step):
    """Wait at ``step`` for a membership change: a node joining makes torchrun stop these
    workers (SIGTERM) and start the group again at the new size; a node leaving makes the
    next barrier raise (its peers are gone), this worker fails and torchrun restarts it."""
    print(f"rank {rank}: holding at step {step} with {size} ranks", flush=True)
    while True:
        dist.barrier()
        time.sleep(0.1)


for step in range(start, args.steps):
    if (step, size) in holds:
        hold(step)
    data = torch.Generator().manual_seed(1000 * step + rank)   # each rank its own batches
    x = torch.randn(32, 64, generator=data)
    loss = torch.nn.functional.cross_entropy(ddp_model(x), (x @ teacher).argmax(1))
    if step == args.fail_at and rank == 1 and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
        os.kill(os.getpid(), signal.SIGKILL)          # a preempted worker
    opt.zero_grad()
    loss.backward()
    opt.step()
    if (step + 1) % args.every == 0:
        save(step + 1)

if args.out:
    os.makedirs(args.out, exist_ok=True)
    torch.save({"params": [p.detach().clone() for p in model.parameters()],
                "hook": state.state_dict()}, os.path.join(args.out, f"rank{rank}.pt"))
print(f"rank {rank} of {size}: step {state.step}, loss {loss.item():.4f}", flush=True)
dist.destroy_process_group()
