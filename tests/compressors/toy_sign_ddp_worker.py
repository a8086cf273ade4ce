"""DDP half of test_toy_compressor.py (run by torchrun, Gloo): the toy compressor of
toy_sign.py through the DDP communication hook (hvdcomp.ddp), which sends over the
allgather.  Expected values: toy_sign_reference.closed_form of every rank's local gradient,
computed in this process."""
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import hvdcomp.ddp  # noqa: E402
from toy_sign import ToySign  # noqa: E402,F401  (registers "toysign")
from toy_sign_reference import close, closed_form  # noqa: E402


def main():
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, size = dist.get_rank(), dist.get_world_size()
    failures = []
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3))
    init = {k: v.clone() for k, v in model.state_dict().items()}
    ddp = DDP(model)
    state = hvdcomp.ddp.HookState(ddp, "toysign", min_compress_numel=1, compress_1d=True,
                                  seed=5)
    ddp.register_comm_hook(state, hvdcomp.ddp.hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for step in range(2):
        xs = [torch.randn(5, 6, generator=torch.Generator().manual_seed(10 * step + r))
              for r in range(size)]
        local = {}
        for r in range(size):       # every rank's local gradient, computed here
            m = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.Tanh(),
                                    torch.nn.Linear(4, 3))
            m.load_state_dict(init)
            m(xs[r]).square().sum().backward()
            local[r] = {n: p.grad.clone() for n, p in m.named_parameters()}
        opt.zero_grad()
        ddp(xs[rank]).square().sum().backward()
        for n, p in model.named_parameters():
            want = closed_form([local[r][n] for r in range(size)])
            if not close(p.grad, want):
                failures.append(f"rank {rank} step {step} {n}: got "
                                f"{p.grad.reshape(-1)[:4].tolist()} want "
                                f"{want.reshape(-1)[:4].tolist()}")
        opt.step()
        init = {k: v.clone() for k, v in model.state_dict().items()}
    for n, p in model.named_parameters():
        got = [torch.empty_like(p.detach()) for _ in range(size)]
        dist.all_gather(got, p.detach())
        if not all(torch.equal(got[0], g) for g in got):
            failures.append(f"rank {rank}: replicas differ in {n}")
    with open(os.path.join(os.environ["HVDCOMP_TEST_OUT"], f"ddp{rank}.txt"), "w") as f:
        f.write("\n".join(failures) if failures else "toy OK")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
