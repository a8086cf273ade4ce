"""Checkpoint and resume through the DDP hook (under torchrun):

    first   N + K steps without interruption, saving a checkpoint per rank (model,
            optimizer, HookState) after step N and the final parameters at the end (run by
            worker_cases.py's launch, after its cases)
    resume  new processes: loads the checkpoint, K more steps; saves the final parameters
            (run by worker_ddp.py's launch, after the golden training)

(No launch of its own: each torchrun start costs 15-30 s on 2 cores.)

test_ddp.py checks that ``resume`` ends with exactly the parameters of the uninterrupted
run, for compressors whose state matters: ALQ with a refit just before and just after the
checkpoint, DGC (momentum and residuals, the optimizer's momentum handed over), EF-SignSGD
and TopK (residuals), LAQ (its lazy rule needs the last step's parameters), NDQSG, TernGrad
(the step feeds the Philox keys), PowerSGD (residuals and the warm start's Q).  Taking the checkpoint must not disturb the run (it
continues from the same objects), so the uninterrupted run and the checkpointed one are one.
"""
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import golden
import hvdcomp.ddp

N, K = 3, 3
SPECS = ["alq:bits=3,bucket_size=512,refit_steps=3/5,refit_every=0",
         "dgc:density=0.05", "signef", "topk:density=0.05", "laq:bits=4", "ndqsg:bits=4",
         "terngrad", "powersgd:rank=2"]


def inputs(rank, step):
    return golden.inputs(rank, 100 + step)       # no NaN (that is golden's last step only)


def build(spec, rank):
    model = golden.Golden()
    opt = golden.optimizer(model)
    ddp = DDP(model, bucket_cap_mb=0.002)
    # (allreduce_summable=False: the uncompressed tensors as wire messages too, decoded in
    # rank order.  Gloo's all_reduce adds 4 ranks' values in an order that depends on where
    # they sit in the summed buffer, i.e. on DDP's buckets, which each process rebuilds
    # after its own first iteration: the resumed run's first step would differ in the last
    # bits from the uninterrupted run's fourth.)
    state = hvdcomp.ddp.HookState(ddp, spec, optimizer=opt, min_compress_numel=16, seed=5,
                                  allreduce_summable=False)
    return model, opt, ddp, state


def run(mode, outdir, rank, size):
    """``first`` or ``resume`` (module docstring) on this rank, torch.distributed set up."""
    for spec in SPECS:
        model, opt, ddp, state = build(spec, rank)
        ckpt = golden.out_path(outdir, "ckpt", spec, size, rank)
        if mode == "resume":
            saved = torch.load(ckpt)
            model.load_state_dict(saved["model"])
            opt.load_state_dict(saved["opt"])
            state.load_state_dict(saved["hook"])
            assert state.step == N
        ddp.register_comm_hook(state, hvdcomp.ddp.hook)
        for step in {"first": range(N + K), "resume": range(N, N + K)}[mode]:
            opt.zero_grad()
            ddp(inputs(rank, step)).backward()
            opt.step()
            if mode == "first" and step == N - 1:
                torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                            "hook": state.state_dict()}, ckpt)
        assert state.step == N + K
        torch.save({n: p.detach().clone() for n, p in model.named_parameters()},
                   golden.out_path(outdir, {"first": "full"}.get(mode, mode), spec, size, rank))
        state.close()


def main(mode, outdir):
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, size = dist.get_rank(), dist.get_world_size()
    run(mode, outdir, rank, size)
    print(f"[rank {rank}] resume {mode} OK", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
