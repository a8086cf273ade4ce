"""The golden training through the drop-in optimizer (under mpirun): each compressor's
averaged gradients of every step and the final parameters, saved per rank for
test_ddp.py to compare with the DDP hook's."""
import sys

import torch

import golden
import hvdcomp.torch as hvd


def main(outdir):
    hvd.init()
    torch.set_num_threads(1)
    rank, size = hvd.rank(), hvd.size()
    for spec in golden.COMPRESSORS:
        model = golden.Golden()
        opt = hvd.DistributedOptimizer(golden.optimizer(model),
                                       named_parameters=model.named_parameters(),
                                       compression=spec, min_compress_numel=16, seed=3,
                                       fusion_bytes=20000, allreduce_summable=False)
        grads = []
        for step in range(golden.STEPS):
            opt.zero_grad()
            model(golden.inputs(rank, step, golden.absent_ok(spec))).backward()
            opt.synchronize()
            grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
            with opt.skip_synchronize():
                opt.step()
        torch.save({"grads": grads, "nonfinite": opt.last_stats.nonfinite,
                    "params": {n: p.detach().clone() for n, p in model.named_parameters()}},
                   golden.out_path(outdir, "hvd", spec, size, rank))
        opt.close()
    print(f"[rank {rank}] hvd golden OK", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
