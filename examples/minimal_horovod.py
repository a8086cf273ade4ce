"""hvdcomp's drop-in optimizer on synthetic data: each rank trains on its own batches, and
the gradients travel compressed (ALQ, 3 bits) and are averaged over the ranks.
Run: launch/run -np 2 .venv/bin/python examples/minimal_horovod.py"""
import hashlib

import torch

import hvdcomp.torch as hvd          # all of horovod.torch, plus compression that is real

hvd.init()
torch.manual_seed(0)                                      # the same model and task everywhere
teacher = torch.randn(64, 10)
model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
data = torch.Generator().manual_seed(1 + hvd.rank())      # but each rank its own data
batches = [(x, (x @ teacher).argmax(1)) for x in torch.randn(30, 32, 64, generator=data)]

opt = torch.optim.SGD(model.parameters(), lr=0.1 * hvd.size())
opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                               compression="alq:bits=3")    # or hvdcomp.ALQ(bits=3)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)   # every rank starts alike
hvd.broadcast_optimizer_state(opt, root_rank=0)
losses = []
for x, y in batches:
    opt.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()                                   # p.grad: the average over the ranks
    opt.step()
    losses.append(loss.item())
print(opt.last_stats.bytes_sent, opt.last_stats.ratio)   # what this rank sent in the last step
params = torch.cat([p.detach().flatten() for p in model.parameters()]).numpy().tobytes()
print(f"rank {hvd.rank()}: loss {losses[0]:.4f} -> {losses[-1]:.4f}, "
      f"params {hashlib.sha256(params).hexdigest()[:16]}")
