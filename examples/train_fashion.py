"""The real task: data-parallel training on Fashion-MNIST (60,000 / 10,000 images) with hvdcomp.

    launch/run -np 4 .venv/bin/python examples/train_fashion.py                  # CNN, ALQ 3 bits
    launch/run -np 4 .venv/bin/python examples/train_fashion.py --compression fp16
    launch/run -np 4 .venv/bin/python examples/train_fashion.py --model resnet --collective reduce_scatter
    horovodrun -np 4 -H localhost:4 .venv/bin/python examples/train_fashion.py
    .venv/bin/torchrun --nproc_per_node 4 examples/train_fashion.py               # DDP hook
    .venv/bin/torchrun --nproc_per_node 4 examples/train_fashion.py --compression torch-powersgd:rank=2
    .venv/bin/torchrun --nproc_per_node 4 examples/train_fashion.py --compression torch-fp16

The same job as examples/train_mnist.py (the same launchers and flags: --compression,
--collective, --log-dir, --json, progress bar, one line per evaluation) on a real data set
(examples/fashion.py: the IDX files of Debian's dataset-fashion-mnist, or
$HVDCOMP_FASHION_MNIST) with one of two models: ``--model cnn`` (3.27M parameters, a
gradient large against its compute) or ``--model resnet`` (a small ResNet with batch
normalization, 0.31M).  Each rank trains on its shard of the training images (the same
number of full batches on every rank); rank 0 evaluates rank 0's model on the whole test
set (10,000 images) --evals-per-epoch times per epoch, outside the training clock.

Under torchrun, PyTorch's own DDP communication hooks serve as baselines:
``torch-fp16`` (default_hooks.fp16_compress_hook) and
``torch-powersgd:rank=R[,start_iter=N,warm_start=1,min_compression_rate=2]``
(powerSGD_hook, Vogels et al., NeurIPS 2019, with error feedback; vanilla allreduce for the
first start_iter steps, default 10).  Their bytes per rank are counted at the all_reduce
calls the hooks make.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fashion  # noqa: E402
from train_mnist import (HorovodJob, Metrics, TorchrunJob, compression_label,  # noqa: E402
                         under_torchrun)

PROG = "train_fashion.py"
# PyTorch's hooks accepted as --compression under torchrun: name -> {setting: (type, default)}
TORCH_HOOKS = {
    "torch-fp16": {},
    "torch-powersgd": {"rank": (int, 1), "start_iter": (int, 10), "warm_start": (int, 1),
                       "min_compression_rate": (float, 2.0)},
}


def first_rank() -> bool:
    """Whether this process is rank 0 (or not started by a launcher), from the launchers'
    environment, before any distributed set-up."""
    return all(os.environ.get(v, "0") == "0"
               for v in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "HOROVOD_RANK", "RANK"))


def fail(msg: str) -> None:
    """One clear line from the first rank (not a traceback per rank), exit status 2."""
    if first_rank():
        print(f"{PROG}: {msg}", file=sys.stderr, flush=True)
    sys.exit(2)


def parse_torch_hook(spec: str):
    """``(name, settings)`` for a PyTorch hook spec (``torch-powersgd:rank=2``), None for
    any other spec.  Raises hvdcomp.ConfigError naming the valid hooks and settings."""
    import hvdcomp
    name, _, rest = spec.partition(":")
    if not name.startswith("torch-"):
        return None
    if name not in TORCH_HOOKS:
        raise hvdcomp.ConfigError(f"unknown PyTorch hook {name!r}; valid: "
                                  f"{', '.join(TORCH_HOOKS)}")
    known = TORCH_HOOKS[name]
    out = {k: d for k, (_, d) in known.items()}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if key not in known or not eq:
            raise hvdcomp.ConfigError(
                f"{name}: unknown setting {item!r}; valid: "
                f"{', '.join(f'{k}=<{t.__name__}>' for k, (t, _) in known.items()) or 'none'}")
        try:
            out[key] = known[key][0](value)
        except ValueError:
            raise hvdcomp.ConfigError(f"{name}: {key}={value!r} is not "
                                      f"{known[key][0].__name__}") from None
    if name == "torch-powersgd":
        if out["rank"] < 1:
            raise hvdcomp.ConfigError(f"torch-powersgd: rank must be >= 1, got {out['rank']}")
        if out["start_iter"] < 2:       # PowerSGDState's own rule with error feedback
            raise hvdcomp.ConfigError("torch-powersgd: start_iter must be >= 2 (PyTorch's "
                                      "PowerSGDState with error feedback or warm start)")
    return name, out


class _CountingDist:
    """torch.distributed as the hook modules see it, counting the bytes of every
    ``all_reduce`` (what each rank sends into the allreduce)."""

    def __init__(self, dist):
        self._dist, self.bytes = dist, 0

    def all_reduce(self, tensor, *a, **kw):
        self.bytes += tensor.numel() * tensor.element_size()
        return self._dist.all_reduce(tensor, *a, **kw)

    def __getattr__(self, name):
        return getattr(self._dist, name)


class _Spec:
    def __init__(self, text):
        self.text = text

    def spec(self):
        return self.text


class _Stats:
    def __init__(self, sent, fp32):
        self.d = dict(bytes_sent=sent, fp32_bytes=fp32)

    def as_dict(self):
        return self.d


class TorchHookJob(TorchrunJob):
    """torchrun: DistributedDataParallel (Gloo) with one of PyTorch's own communication
    hooks (the baselines: TORCH_HOOKS)."""
    name = "torch.distributed (PyTorch hook)"
    collective = "allreduce"

    def __init__(self, hook):
        super().__init__()
        self.hook_name, self.settings = hook

    def wrap(self, model, opt, args):
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
        if args.collective not in (None, "allgather"):
            fail(f"--collective {args.collective}: PyTorch's hooks sum over an allreduce")
        self.counter = _CountingDist(self.dist)
        default_hooks.dist = psgd.dist = self.counter
        self.numel = sum(p.numel() for p in model.parameters())
        if self.hook_name == "torch-fp16":
            ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=25)
            ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
            spec = "torch-fp16"
        else:
            s = self.settings
            # one bucket: with Gloo the second all_reduce of each bucket is issued from a
            # completion callback whose order across buckets can differ between ranks
            ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=1024)
            state = psgd.PowerSGDState(
                process_group=None, matrix_approximation_rank=s["rank"],
                start_powerSGD_iter=s["start_iter"], use_error_feedback=True,
                warm_start=bool(s["warm_start"]),
                min_compression_rate=s["min_compression_rate"], random_seed=args.seed)
            ddp.register_comm_hook(state, psgd.powerSGD_hook)
            spec = ("torch-powersgd:" + ",".join(f"{k}={v}" for k, v in s.items()))
        self._spec = _Spec(spec)
        self._last = 0
        return ddp, opt

    @property
    def compression(self):
        return self._spec

    @property
    def plan(self):
        return None

    specs = plan

    @property
    def last_stats(self):
        sent, self._last = self.counter.bytes - self._last, self.counter.bytes
        return _Stats(sent, 4 * self.numel)

    @property
    def transport(self):
        return "gloo"

    def close(self):
        self.dist.destroy_process_group()


def evaluate(model, x_te, y_te, batch=1000) -> float:
    """Test accuracy (%) of ``model`` on all of (x_te, y_te), in eval mode."""
    model.eval()
    correct = 0
    with torch.no_grad():
        for i in range(0, len(x_te), batch):
            out = model(fashion.normalize(x_te[i:i + batch]))
            correct += (out.argmax(1) == y_te[i:i + batch]).sum().item()
    model.train()
    return 100.0 * correct / max(len(x_te), 1)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="cnn", choices=sorted(fashion.MODELS))
    ap.add_argument("--compression", default=os.environ.get("HVDCOMP_COMPRESSION") or "alq:bits=3",
                    help="hvdcomp compressor spec (none, fp16, alq:bits=3, dgc:density=0.001, "
                         "auto+alq:bits=3, rs+alq:bits=3, ...) or, under torchrun, one of "
                         "PyTorch's hooks: torch-fp16, torch-powersgd:rank=R")
    ap.add_argument("--collective", default=None,
                    choices=["allgather", "reduce_scatter", "auto"],
                    help="as in examples/train_mnist.py")
    ap.add_argument("--hierarchy", default=None, choices=["auto", "flat", "host"],
                    help="as in examples/train_mnist.py")
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=64, help="per rank")
    ap.add_argument("--lr", type=float, default=0.05, help="peak learning rate (cosine decay)")
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--weight-decay", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--transport", default="auto", choices=["auto", "mpi", "horovod"])
    ap.add_argument("--launcher", default="auto", choices=["auto", "horovod", "torchrun"])
    ap.add_argument("--no-allreduce", action="store_true",
                    help="the uncompressed tensors as wire messages too (as train_mnist.py)")
    ap.add_argument("--data", default="",
                    help=f"directory of the four IDX files (default ${fashion.ENV}, else "
                         f"{fashion.DEBIAN_DIR})")
    ap.add_argument("--train-images", type=int, default=0,
                    help="use the first N training images (0: all 60,000)")
    ap.add_argument("--test-images", type=int, default=0,
                    help="evaluate on the first N test images (0: all 10,000)")
    ap.add_argument("--evals-per-epoch", type=int, default=1,
                    help="test-set evaluations per epoch (the accuracy curve's points)")
    ap.add_argument("--max-steps", type=int, default=0,
                    help="stop after this many steps in all (0: every epoch in full)")
    ap.add_argument("--step-times", action="store_true",
                    help="rank 0's seconds of every step in the JSON results")
    ap.add_argument("--log-dir", default="", help="rank 0's metrics.csv (and TensorBoard)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    ap.add_argument("--json", default="", help="write the results here (rank 0)")
    args = ap.parse_args(argv)

    import hvdcomp
    from hvdcomp.auto import from_spec, merge_collective
    try:
        hook = parse_torch_hook(args.compression)
        if hook is None:
            _, in_spec = from_spec(args.compression)
            merge_collective(args.collective, in_spec)
    except hvdcomp.ConfigError as e:
        fail(f"--compression {args.compression!r}: {e}")
    try:
        x_tr, y_tr, x_te, y_te = fashion.load(args.data or None)
    except fashion.DataError as e:
        fail(str(e))
    if args.train_images:
        x_tr, y_tr = x_tr[:args.train_images], y_tr[:args.train_images]
    if args.test_images:
        x_te, y_te = x_te[:args.test_images], y_te[:args.test_images]

    t_start = time.time()
    torchrun = (args.launcher == "torchrun"
                or (args.launcher == "auto" and under_torchrun()))
    if hook is not None and not torchrun:
        fail(f"--compression {args.compression}: PyTorch's hooks run under torchrun "
             f"(DistributedDataParallel); under mpirun/horovodrun use hvdcomp's specs")
    job = (TorchHookJob(hook) if hook is not None else TorchrunJob() if torchrun
           else HorovodJob())
    torch.set_num_threads(1)
    rank, size = job.rank, job.size
    shard = len(x_tr) // size
    steps_per_epoch = shard // args.batch_size
    if steps_per_epoch == 0:
        if torchrun:                     # leave the process group / Horovod before exiting
            job.dist.destroy_process_group()
        else:
            job.hvd.shutdown()
        fail(f"{len(x_tr)} training images make {len(x_tr) // args.batch_size} batches of "
             f"{args.batch_size}, fewer than the {size} ranks: every rank needs at least one "
             f"full batch per epoch (fewer ranks, a smaller --batch-size, or more images)")
    import logging
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"%(name)s[{rank}] %(levelname)s: %(message)s")
    torch.manual_seed(args.seed)
    model = fashion.MODELS[args.model]()
    nparams = sum(p.numel() for p in model.parameters())
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum,
                          weight_decay=args.weight_decay)
    net, opt = job.wrap(model, opt, args)
    label = (job.compression.spec() if hook is not None
             else compression_label(args.compression, job.compression))
    if rank == 0:
        print(f"hvdcomp real task: {args.model} ({nparams:,} parameters), Fashion-MNIST "
              f"{len(x_tr)} train / {len(x_te)} test images, {size} ranks x batch "
              f"{args.batch_size}, {steps_per_epoch} steps per epoch, {job.name}, "
              f"compression {label}, collective {job.collective}",
              flush=True)
    metrics = Metrics(args.log_dir) if rank == 0 and args.log_dir else None
    show = rank == 0 and not args.no_progress
    try:
        from tqdm import tqdm
    except ImportError:
        show = False
    total = args.epochs * steps_per_epoch
    if args.max_steps:
        total = min(total, args.max_steps)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda t: 0.5 * (1 + math.cos(math.pi * min(t, total) / total)))
    evals_at = {round(steps_per_epoch * (i + 1) / args.evals_per_epoch)
                for i in range(max(args.evals_per_epoch, 1))}
    history = []
    job.barrier()
    t_train = time.time()
    eval_s = 0.0                       # rank 0's evaluations, taken off the training clock
    steps = 0
    sent = fp32 = 0
    loss_sum, loss_n, fb_s, step_s, wall_s = 0.0, 0, 0.0, 0.0, 0.0
    step_times = []                    # rank 0's seconds per step (--step-times)
    for epoch in range(1, args.epochs + 1):
        if steps >= total:
            break
        g = torch.Generator().manual_seed(args.seed * 1000 + epoch)
        perm = torch.randperm(len(x_tr), generator=g)[rank::size][:steps_per_epoch * args.batch_size]
        batches = perm.split(args.batch_size)
        it = tqdm(batches, desc=f"epoch {epoch}", leave=False, ncols=80) if show else batches
        for i, idx in enumerate(it, start=1):
            t0 = time.perf_counter()
            opt.zero_grad()
            loss = F.cross_entropy(net(fashion.normalize(x_tr[idx])), y_tr[idx])
            loss.backward()
            t1 = time.perf_counter()
            opt.step()
            sched.step()
            t2 = time.perf_counter()
            fb_s += t1 - t0
            step_s += t2 - t1
            loss_sum += loss.item()
            loss_n += 1
            st = job.last_stats.as_dict()
            t3 = time.perf_counter()
            wall_s += t3 - t0
            step_times.append(t3 - t0)
            sent += st["bytes_sent"]
            fp32 += st["fp32_bytes"]
            steps += 1
            last = steps >= total
            if i in evals_at or last:
                t_eval = time.time()
                per_rank = job.gather(sent, f"bytes.{steps}")
                if rank == 0:
                    acc = evaluate(model, x_te, y_te)
                    hi = per_rank.max().item()
                    row = dict(step=steps, epoch=epoch - 1 + i / steps_per_epoch,
                               test_acc=acc, train_loss=loss_sum / max(loss_n, 1),
                               bytes_per_rank=hi, fp32_bytes=fp32,
                               ratio=fp32 / hi if hi else None,
                               train_seconds=t_eval - t_train - eval_s,
                               forward_backward_s=fb_s, optimizer_step_s=step_s,
                               steps_wall_s=wall_s)
                    history.append(row)
                    if metrics is not None:
                        metrics.write(row)
                    print(f"epoch {row['epoch']:5.2f}  step {steps:5d}  test acc {acc:5.2f} %  "
                          f"loss {row['train_loss']:.4f}  sent/rank {hi / 1e6:8.2f} MB  ratio "
                          f"{(fp32 / hi if hi else float('nan')):6.2f}x  "
                          f"[{row['train_seconds']:6.1f} s]", flush=True)
                loss_sum, loss_n = 0.0, 0
                job.barrier()                       # the others wait for rank 0's evaluation
                eval_s += time.time() - t_eval
            if last:
                break
    if metrics is not None:
        metrics.close()
    if rank == 0:
        print(f"final: test acc {history[-1]['test_acc']:.2f} %, {args.model}, compression "
              f"{label}, {steps} steps, training "
              f"{history[-1]['train_seconds']:.1f} s, wall {time.time() - t_start:.1f} s",
              flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"model": args.model, "params": nparams,
                           "compression": job.compression.spec(),
                           "collective": job.collective, "ranks": size,
                           "launcher": job.name, "transport": job.transport,
                           "steps_per_epoch": steps_per_epoch, "steps": steps,
                           "wall_seconds": time.time() - t_start, "args": vars(args),
                           "evals": history, "final_acc": history[-1]["test_acc"],
                           # {parameter: spec of the compressor it travels with}
                           # (per-layer Auto's choices; None for PyTorch's hooks)
                           "plan": job.specs,
                           **({"step_times": step_times} if args.step_times else {})}, f,
                          indent=1)
    job.close()


if __name__ == "__main__":
    main()
