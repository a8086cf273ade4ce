"""The golden training through the DDP hook on one device type (under torchrun): ``cuda``
(CUDA parameters, the nccl backend) or ``cpu`` (CPU parameters, gloo).  The golden model's
gradients are fixed tensors (golden.py), the same bits on both devices, and hvdcomp's CUDA
kernels give the CPU kernels' bits, so the two runs' averaged gradients must be equal bit
for bit; test_ddp_nccl.py compares them (the parameters are not saved: PyTorch's SGD rounds
half-precision parameters differently on the two devices).

``worker_nccl.py OUTDIR DEVICE``: one file per (compressor, summable) in OUTDIR."""
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import golden
import hvdcomp.ddp


def main(outdir, device):
    rank = int(os.environ.get("RANK", "0"))
    if device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    else:
        dist.init_process_group("gloo")
    size = dist.get_world_size()
    torch.set_num_threads(1)
    failed = []
    for spec in golden.COMPRESSORS:
        for summable in (False, True):
            try:
                model = golden.Golden().to(device)
                opt = golden.optimizer(model)
                ddp = DDP(model, bucket_cap_mb=0.002, find_unused_parameters=True,
                          device_ids=[torch.cuda.current_device()] if device == "cuda" else None)
                state = hvdcomp.ddp.HookState(ddp, spec, optimizer=opt, min_compress_numel=16,
                                              seed=3, allreduce_summable=summable)
                ddp.register_comm_hook(state, hvdcomp.ddp.hook)
                grads = []
                for step in range(golden.STEPS):
                    opt.zero_grad()
                    x = {n: g.to(device) for n, g in golden.inputs(rank, step).items()}
                    ddp(x).backward()
                    grads.append({n: p.grad.detach().cpu().clone()
                                  for n, p in model.named_parameters()})
                    opt.step()
                torch.save({"grads": grads},
                           golden.out_path(outdir, f"nccl{int(summable)}", spec, size, rank,
                                           device))
                state.close()
            except Exception as e:          # report every compressor, not only the first
                failed.append(f"{spec} summable={summable}: {type(e).__name__}: {e}")
                print(f"[rank {rank}] FAILED {failed[-1]}", flush=True)
    dist.destroy_process_group()
    if failed:
        sys.exit(f"[rank {rank}] {len(failed)} failed")
    print(f"[rank {rank}] {device} golden OK", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
