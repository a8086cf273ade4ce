"""hvdcomp's DDP communication hook on synthetic data: each rank trains on its own batches,
and the gradients travel compressed (ALQ, 3 bits) and are averaged over the ranks.
Run: .venv/bin/torchrun --nproc_per_node 2 examples/minimal_ddp.py"""
import hashlib

import torch
import torch.distributed as dist

import hvdcomp.ddp

dist.init_process_group("gloo")                           # nccl for CUDA parameters
torch.manual_seed(0)                                      # the same model and task everywhere
teacher = torch.randn(64, 10)
model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
data = torch.Generator().manual_seed(1 + dist.get_rank())  # but each rank its own data
batches = [(x, (x @ teacher).argmax(1)) for x in torch.randn(30, 32, 64, generator=data)]

ddp_model = torch.nn.parallel.DistributedDataParallel(model)
opt = torch.optim.SGD(model.parameters(), lr=0.1 * dist.get_world_size())
state = hvdcomp.ddp.HookState(ddp_model, compression="alq:bits=3", optimizer=opt)
ddp_model.register_comm_hook(state, hvdcomp.ddp.hook)
losses = []
for x, y in batches:
    opt.zero_grad()
    loss = torch.nn.functional.cross_entropy(ddp_model(x), y)
    loss.backward()                                   # p.grad: the average over the ranks
    opt.step()
    losses.append(loss.item())
print(state.last_stats.bytes_sent, state.last_stats.ratio)   # what this rank sent last step
params = torch.cat([p.detach().flatten() for p in model.parameters()]).numpy().tobytes()
print(f"rank {dist.get_rank()}: loss {losses[0]:.4f} -> {losses[-1]:.4f}, "
      f"params {hashlib.sha256(params).hexdigest()[:16]}")
dist.destroy_process_group()
