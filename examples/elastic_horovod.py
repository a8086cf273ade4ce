"""An elastic Horovod job with hvdcomp's drop-in optimizer: workers come and go.

On one machine (the hosts all "localhost"; a resize: edit hosts.txt while it runs):

    printf 'localhost:2\n' > hosts.txt
    printf '#!/bin/sh\ncat hosts.txt\n' > discover_hosts.sh && chmod +x discover_hosts.sh
    .venv/bin/horovodrun --gloo --network-interface lo -np 2 --min-np 1 --max-np 4 \
        --host-discovery-script ./discover_hosts.sh .venv/bin/python examples/elastic_horovod.py --steps 1500
    # meanwhile: printf 'localhost:3\n' > hosts.txt   (3 ranks), then back to localhost:2

(``discover_hosts.sh`` prints the available hosts, one ``host:slots`` a line, as Horovod's
elastic documentation describes.  Without ``--network-interface lo`` on one machine the job
waits silently.  A worker Horovod removes prints "has been removed from elastic job" and
exits 134 (horovodrun reports its exit code); at a reset the remaining workers may print a
Gloo traceback (their collective with the departed worker fails) before Horovod resets
them: both expected, the job goes on.)  Written as for Horovod's own optimizer: ``import hvdcomp.torch as hvd``,
``hvd.elastic.TorchState`` holding the model and the optimizer, ``state.commit()`` every
few steps, the training function decorated with ``hvd.elastic.run``.

What hvdcomp adds at each reset (a host added or removed, or a worker failed):
``hvd.elastic.run`` rebuilds the optimizer's exchange for the new world (new collective
names, the settings handshake, new carriers; the old threads stopped first), and the
TorchState carries hvdcomp's state: ``commit()`` saves it with the optimizer's state_dict,
``restore()`` loads it, and the sync after a reset gives every rank rank 0's step and
shared state (ALQ's levels, PowerSGD's Q).  At another world size the per-rank state
(error-feedback residuals, DGC's momentum) is reset with a warning; LAQ and NDQSG are
refused (docs/semantics.md, "Elastic restarts").
"""
import argparse

import torch
import torch.nn.functional as F

import hvdcomp.torch as hvd

ap = argparse.ArgumentParser()
ap.add_argument("--compression", default="alq:bits=3,bucket_size=512,refit_steps=5")
ap.add_argument("--steps", type=int, default=200)
ap.add_argument("--commit-every", type=int, default=10)
args = ap.parse_args()

hvd.init()
torch.manual_seed(0)                                  # the same model and task everywhere
teacher = torch.randn(64, 10)
model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                               named_parameters=model.named_parameters(),
                               compression=args.compression)


def on_reset():
    if hvd.rank() == 0:
        print(f"reset: now {hvd.size()} ranks", flush=True)


@hvd.elastic.run
def train(state):
    while state.step < args.steps:
        g = torch.Generator().manual_seed(state.step * 1000 + hvd.rank())
        x = torch.randn(32, 64, generator=g)
        opt.zero_grad()
        loss = F.cross_entropy(model(x), (x @ teacher).argmax(1))
        loss.backward()
        opt.step()
        state.step += 1
        if state.step % args.commit_every == 0:
            state.commit()            # saves hvdcomp's state too; raises at a host change
            if hvd.rank() == 0:
                print(f"step {state.step}: loss {loss.item():.4f} on {hvd.size()} ranks",
                      flush=True)


state = hvd.elastic.TorchState(model=model, optimizer=opt, step=0)
state.register_reset_callbacks([on_reset])
train(state)
