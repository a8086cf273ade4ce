"""The golden training through the DDP hook (under torchrun), with DDP buckets small (many
buckets, rebuilt after the first iteration) and large (one), a parameter unused on rank 1
in one step (find_unused_parameters=True): each compressor's averaged
gradients of every step and the final parameters, saved per rank for test_ddp.py.

``worker_ddp.py OUTDIR TAGS resume``: then, in these processes, the second part of the
checkpoint test (worker_resume.run("resume"): the checkpoint that worker_cases.py's launch
saved in OUTDIR, K more steps)."""
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import golden
import hvdcomp.ddp
import worker_resume

BUCKETS = {"small": 0.002, "large": 25}      # bucket_cap_mb


def main(outdir, tags="small,large", resume=""):
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, size = dist.get_rank(), dist.get_world_size()
    for spec in golden.COMPRESSORS:
        for tag in tags.split(","):
            cap = BUCKETS[tag]
            model = golden.Golden()
            opt = golden.optimizer(model)
            ddp = DDP(model, bucket_cap_mb=cap, find_unused_parameters=True)
            state = hvdcomp.ddp.HookState(ddp, spec, optimizer=opt, min_compress_numel=16,
                                          seed=3, allreduce_summable=False)
            ddp.register_comm_hook(state, hvdcomp.ddp.hook)
            grads, buckets = [], []
            for step in range(golden.STEPS):
                opt.zero_grad()
                ddp(golden.inputs(rank, step, golden.absent_ok(spec))).backward()
                grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
                opt.step()
            torch.save({"grads": grads, "nonfinite": state.last_stats.nonfinite,
                        "step": state.step,
                        "params": {n: p.detach().clone() for n, p in model.named_parameters()}},
                       golden.out_path(outdir, "ddp", spec, size, rank, tag))
            state.close()
    print(f"[rank {rank}] ddp golden OK", flush=True)
    if resume:
        worker_resume.run("resume", outdir, rank, size)
        print(f"[rank {rank}] resume OK", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
