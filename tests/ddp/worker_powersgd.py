"""PowerSGD against PyTorch's powerSGD_hook (issue #22 item 1).

``worker_powersgd.py OUTDIR ddp`` (under torchrun, Gloo): two DDP copies of one model get the
same gradients each step, one through hvdcomp.ddp with ``powersgd``, one through PyTorch's
powerSGD_hook with the same rank, start iteration, min_compression_rate, error feedback and
warm start; every step's averages and bytes are saved per rank.

``worker_powersgd.py OUTDIR hvd`` (under mpirun): the same gradients through the drop-in
optimizer (Horovod's allreduce as the carrier of the rounds), then through
hvdcomp.exchange.Exchange on the mpi transport with no allreduce carrier (Horovod not used:
the rounds summed over mpi4py's allgather), averages saved per rank.

The initial Q differs (PyTorch draws it from torch.manual_seed, hvdcomp from Philox): at the
first compressed step (START) the gradients summed over the ranks have rank <= r (each rank's
is U_w V^T with V shared), so both averages are exact there (P spans the sum's column space
whatever Q was) and both next Qs span the sum's row space; every later result depends on Q
only through its span, so the averages agree to float tolerance at every step.
"""
import sys

import torch
import torch.distributed as dist

import golden

SPECS = {
    "conv.weight": ((16, 3, 3, 3), torch.float32),
    "fc.weight": ((64, 32), torch.float32),
    "fc.bias": ((64,), torch.float32),
    "head.weight": ((10, 100), torch.float32),
    "small.weight": ((10, 40), torch.float32),
    "wide.weight": ((5, 400), torch.float32),
}
RANKS = (1, 2, 4)
START, STEPS = 2, 6


def spec(r: int) -> str:
    return f"powersgd:rank={r},start_iter={START},min_compression_rate=2.0"


def grads(rank: int, step: int, r: int):
    """Each parameter's gradient on ``rank`` at ``step``; at START, rank-r products with a
    factor shared by the ranks (module docstring)."""
    out = {}
    for name, (shape, _) in SPECS.items():
        g = torch.Generator().manual_seed(1000 * step + 37 * rank + sum(map(ord, name)))
        if step == START and len(shape) > 1:
            n = shape[0]
            m = 1
            for d in shape[1:]:
                m *= d
            k = min(r, n, m)
            shared = torch.Generator().manual_seed(77 * step + sum(map(ord, name)))
            v = torch.randn(m, k, generator=shared)
            u = torch.randn(n, k, generator=g)
            out[name] = (u @ v.t()).reshape(shape)
        else:
            out[name] = torch.randn(shape, generator=g)
    return out


def ddp(outdir):
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
    from torch.nn.parallel import DistributedDataParallel as DDP

    import hvdcomp.ddp
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, size = dist.get_rank(), dist.get_world_size()
    for r in RANKS:
        ours, theirs = golden.Golden(SPECS), golden.Golden(SPECS)
        d1, d2 = DDP(ours), DDP(theirs)
        state = hvdcomp.ddp.HookState(d1, spec(r), min_compress_numel=0)
        d1.register_comm_hook(state, hvdcomp.ddp.hook)
        ps = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=r,
                                start_powerSGD_iter=START, min_compression_rate=2,
                                use_error_feedback=True, warm_start=True, random_seed=0)
        d2.register_comm_hook(ps, psgd.powerSGD_hook)
        res = {"ours": [], "torch": [], "bytes": [], "torch_numel": [], "paths": state.paths}
        for step in range(STEPS):
            g = grads(rank, step, r)
            before = ps.total_numel_after_compression
            for model, wrapped in ((ours, d1), (theirs, d2)):
                model.zero_grad(set_to_none=True)
                wrapped(g).backward()
            res["ours"].append({n: p.grad.clone() for n, p in ours.named_parameters()})
            res["torch"].append({n: p.grad.clone() for n, p in theirs.named_parameters()})
            res["bytes"].append(state.last_stats.bytes_sent)
            res["torch_numel"].append(ps.total_numel_after_compression - before)
        torch.save(res, golden.out_path(outdir, "psgd-ddp", spec(r), size, rank))
        state.close()
    print(f"[rank {rank}] powersgd ddp OK", flush=True)
    dist.destroy_process_group()


def hvd(outdir):
    import hvdcomp
    import hvdcomp.torch as hvd
    hvd.init()
    torch.set_num_threads(1)
    rank, size = hvd.rank(), hvd.size()
    for r in RANKS:
        model = golden.Golden(SPECS)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                                       named_parameters=model.named_parameters(),
                                       compression=spec(r), min_compress_numel=0)
        got = []
        for step in range(STEPS):
            opt.zero_grad()
            model(grads(rank, step, r)).backward()
            opt.synchronize()
            got.append({n: p.grad.clone() for n, p in model.named_parameters()})
            with opt.skip_synchronize():
                opt.step()
        # without Horovod's allreduce: hvdcomp.exchange on mpi4py alone, rounds summed over
        # the allgather in rank order
        from hvdcomp.exchange import Exchange
        from hvdcomp.transport import make
        params = list(golden.Golden(SPECS).named_parameters())
        ex = Exchange(params, hvdcomp.get(spec(r)), make("mpi"), allreduce=None,
                      min_compress_numel=0)
        alone = []
        for step in range(STEPS):
            g = grads(rank, step, r)
            for n, p in params:
                p.grad = g[n]
            ex.begin(step)
            for n, _ in reversed(params):
                ex.ready(n)
            res, _ = ex.finish()
            alone.append({n: v.view(g[n].shape).clone() for n, v in res.items()})
        torch.save({"grads": got, "transport": opt.transport, "paths": opt.paths,
                    "alone": alone, "alone_paths": ex.plan.paths()},
                   golden.out_path(outdir, "psgd-hvd", spec(r), size, rank))
        ex.close()
        opt.close()
    print(f"[rank {rank}] powersgd hvd OK", flush=True)


if __name__ == "__main__":
    {"ddp": ddp, "hvd": hvd}[sys.argv[2]](sys.argv[1])
