"""Worker of tests/launch/test_horovod_elastic.py: hvdcomp's DistributedOptimizer under
``horovodrun --gloo --min-np 2 --max-np 3 --host-discovery-script``, 2 -> 3 -> 2 ranks.

The schedule (steps, the step of the growth, the step of the shrink, the model's width)
and SGD's lr and momentum come from the test ($ELASTIC_SCHEDULE, $ELASTIC_SGD).  Two
models, each with its own hvdcomp optimizer in one ``hvd.elastic.TorchState``: ``a`` with
compression "none" (checked by the test against plain torch), ``b`` with PowerSGD (shared
state Q, per-rank residuals).  Rank 0 rewrites the discovery script's host list before
step GROW (localhost:3) and before step SHRINK (localhost:2); the ranks then poll Horovod's
host updates until the reset comes.  After every (re)start of the training function, and
just before each reset, each rank gathers everyone's parameters, hvdcomp steps, Q and
residual norms, and rank 0 appends them to $HVDCOMP_TEST_OUT/events.jsonl; at the end
rank 0 writes the final parameters to final.pt.
"""
import json
import threading
import os
import sys
import time

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import hvdcomp.torch as hvd  # noqa: E402

OUT = os.environ["HVDCOMP_TEST_OUT"]
HOSTS = os.path.join(OUT, "hosts")
# the schedule and the optimizer's settings, from the test (which rebuilds the run)
STEPS, GROW, SHRINK, DIM = map(int, os.environ["ELASTIC_SCHEDULE"].split(","))
LR, MOMENTUM = map(float, os.environ["ELASTIC_SGD"].split(","))
WAIT_S = 90


def data(step, rank):
    """Rank ``rank``'s batch at ``step`` (the test rebuilds it)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(4, DIM, generator=g), torch.randn(4, DIM, generator=g)


def build(seed):
    torch.manual_seed(seed)
    return torch.nn.Linear(DIM, DIM)


hvd.init()
model_a, model_b = build(1), build(2)
opt_a = hvd.DistributedOptimizer(
    torch.optim.SGD(model_a.parameters(), lr=LR, momentum=MOMENTUM),
    named_parameters=model_a.named_parameters(), compression="none")
opt_b = hvd.DistributedOptimizer(
    torch.optim.SGD(model_b.parameters(), lr=LR, momentum=MOMENTUM),
    named_parameters=model_b.named_parameters(),
    compression=os.environ.get("COMPRESSION_B", "powersgd:rank=2,min_compression_rate=1.0"),
    min_compress_numel=0)


def flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def snapshot(opt):
    st = opt._driver.state_dict()["compressor_state"]
    q = torch.cat([t.reshape(-1) for _, t in sorted(st.get("q", {}).items())] or
                  [torch.zeros(0)])
    res = sum(float(t.abs().sum()) for t in st.get("residual", {}).values())
    return q, res


def record(state, starts):
    """Every rank's view, gathered (``starts``: how many times the training function
    started, or "before" a reset); rank 0 appends it."""
    q, res = snapshot(opt_b)
    mine = {"rank": hvd.rank(), "size": hvd.size(), "step": state.step, "pid": os.getpid(),
            "starts": starts, "hvdcomp_steps": [opt_a._driver.step, opt_b._driver.step],
            "a": flat(model_a).tolist(), "b": flat(model_b).tolist(), "q": q.tolist(),
            "residual": res, "transports": [opt_a.transport, opt_b.transport],
            "threads": sorted(t.name for t in threading.enumerate()
                              if t.name.startswith("hvdcomp-"))}
    every = hvd.allgather_object(mine, name="test.record")
    if hvd.rank() == 0:
        with open(os.path.join(OUT, "events.jsonl"), "a") as f:
            f.write(json.dumps(every) + "\n")


def request(hosts):
    record(state, "before")
    if hvd.rank() == 0:
        with open(HOSTS + ".tmp", "w") as f:
            f.write(hosts + "\n")
        os.replace(HOSTS + ".tmp", HOSTS)
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:      # every rank alike (a collective per check)
        time.sleep(0.25)
        state.check_host_updates()          # raises HostsUpdatedInterrupt
    raise RuntimeError(f"no reset within {WAIT_S} s after asking for {hosts}")


starts = [0]


@hvd.elastic.run
def train(state):
    starts[0] += 1
    record(state, starts[0])
    while state.step < STEPS:
        if state.step == GROW and hvd.size() == 2:
            request("localhost:3")
        if state.step == SHRINK and hvd.size() == 3:
            request("localhost:2")
        x, y = data(state.step, hvd.rank())
        for model, opt in ((model_a, opt_a), (model_b, opt_b)):
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            opt.step()
        state.step += 1
        state.sizes = state.sizes + [hvd.size()]
        state.commit()
    record(state, starts[0])


state = hvd.elastic.TorchState(model_a=model_a, opt_a=opt_a, model_b=model_b, opt_b=opt_b,
                               step=0, sizes=[])
train(state)
if hvd.rank() == 0:
    torch.save({"a": flat(model_a), "b": flat(model_b), "sizes": state.sizes},
               os.path.join(OUT, "final.pt"))
print(f"elastic worker done: rank {hvd.rank()} of {hvd.size()}", flush=True)
