"""The main job: data-parallel training of FC-300-100 on real MNIST digits with hvdcomp.

    launch/run -np 4 .venv/bin/python examples/train_mnist.py                     # ALQ 3 bits
    launch/run -np 4 .venv/bin/python examples/train_mnist.py --compression none
    launch/run -np 8 .venv/bin/python examples/train_mnist.py --collective reduce_scatter
    .venv/bin/torchrun --nproc_per_node 4 examples/train_mnist.py                 # DDP hook

Each rank trains on its shard of the 4,000 training digits; gradients are exchanged as real
encoded bytes: under mpirun by hvdcomp.torch's DistributedOptimizer (Horovod), under torchrun
(detected from its environment, or --launcher torchrun) by DistributedDataParallel with
hvdcomp's communication hook (hvdcomp.ddp, Gloo).  The same seed gives the same messages on
both.  Rank 0 prints, per epoch, the test accuracy on the 1,000 test digits, the bytes each
rank sent and the compression ratio against fp32.  The same under horovodrun (Horovod's MPI
controller, or --gloo):

    horovodrun -np 4 -H localhost:4 .venv/bin/python examples/train_mnist.py
    horovodrun --gloo -np 4 -H localhost:4 .venv/bin/python examples/train_mnist.py

--log-dir DIR: rank 0 writes the per-epoch metrics to DIR/metrics.csv and, when the
tensorboard package is installed, to TensorBoard event files in DIR.

--checkpoint-dir DIR: a checkpoint after every epoch, and a (re)started job resumes from the
newest one; with torchrun's --max-restarts the job survives a worker's death (torchrun
restarts every worker) and a resize (another world size: hvdcomp keeps its shared state,
resets the per-rank state and warns).  --fail-at STEP kills rank 1 at that step on the first
attempt, to try it:

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 .venv/bin/torchrun --nproc_per_node 2 \\
        --max-restarts 1 examples/train_mnist.py --checkpoint-dir /tmp/ck --fail-at 300

(the variable: see examples/elastic_ddp.py)
"""
from __future__ import annotations

import argparse
import csv
import logging
import math
import os
import signal
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mnist import FC300100, load_digits  # noqa: E402


def compression_label(spec: str, compressor) -> str:
    """The compression as the banner and the ``final:`` line name it.  ``spec``: the user's
    --compression; ``compressor``: the exchange's compressor (with Auto, Auto's inner one).
    A spec with exchange prefixes ("host+", "flat+", "auto+", "auto+layer+", "rs+", "ag+")
    is shown as given, the compressor's full settings after it in parentheses, e.g.
    "auto+alq:bits=3 (alq:bits=3,bucket_size=8192,...)"; a plain one as the compressor's
    full settings alone ("alq:bits=3,bucket_size=8192,...")."""
    import hvdcomp
    from hvdcomp.auto import from_spec
    from hvdcomp.exchange.driver import split_hierarchy
    hierarchy, rest = split_hierarchy(spec)
    comp, collective = from_spec(rest)
    if hierarchy is None and collective is None and not isinstance(comp, hvdcomp.Auto):
        return compressor.spec()
    return f"{spec.strip()} ({compressor.spec()})"


def under_torchrun() -> bool:
    """torchrun (torch.distributed.run) sets TORCHELASTIC_RUN_ID for every worker."""
    return "TORCHELASTIC_RUN_ID" in os.environ


class HorovodJob:
    """Horovod under mpirun: hvdcomp.torch's drop-in DistributedOptimizer."""
    name = "Horovod (hvdcomp.torch.DistributedOptimizer)"

    def __init__(self):
        import hvdcomp.torch as hvd
        self.hvd = hvd
        hvd.init()
        self.rank, self.size = hvd.rank(), hvd.size()

    def wrap(self, model, opt, args):
        """(the module to call, the optimizer to step, the exchange)"""
        self.hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        self.opt = self.hvd.DistributedOptimizer(
            opt, named_parameters=model.named_parameters(), compression=args.compression,
            transport=args.transport, seed=args.seed, allreduce_summable=not args.no_allreduce,
            collective=args.collective, hierarchy=args.hierarchy)
        return model, self.opt

    @property
    def collective(self):
        return self.opt.collective

    @property
    def compression(self):
        return self.opt.compression

    @property
    def plan(self):
        return self.opt.plan

    @property
    def specs(self):
        return self.opt.specs

    @property
    def last_stats(self):
        return self.opt.last_stats

    @property
    def transport(self):
        return self.opt.transport

    def barrier(self):
        self.hvd.allreduce(torch.zeros(1), name="start")

    def gather(self, x: float, tag: str) -> torch.Tensor:
        return self.hvd.allgather(torch.tensor([x], dtype=torch.float64), name=tag)

    def checkpointed(self):
        return {}                  # hvdcomp's state is in the optimizer's state_dict

    def close(self):
        self.opt.close()


class TorchrunJob:
    """torchrun: DistributedDataParallel (Gloo) with hvdcomp's communication hook."""
    name = "torch.distributed (DDP hook)"

    def __init__(self):
        import torch.distributed as dist
        self.dist = dist
        dist.init_process_group("gloo")
        self.rank, self.size = dist.get_rank(), dist.get_world_size()

    collective = "allgather"     # the hook's carrier (torch.distributed) has no all-to-all

    def wrap(self, model, opt, args):
        import hvdcomp.ddp
        if args.collective not in (None, "allgather"):
            raise SystemExit(f"train_mnist.py: --collective {args.collective} needs the Horovod "
                             f"path (mpirun or horovodrun); the DDP hook sends over the "
                             f"allgather")
        # (broadcasts rank 0's parameters) 25 MiB buckets given explicitly: DDP's default
        # makes the first one 1 MiB; so one bucket per step, as the drop-in optimizer's
        # 25 MiB fusion bucket, and the same frames on the wire
        ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=25)
        self.state = hvdcomp.ddp.register(ddp, args.compression, optimizer=opt,
                                          seed=args.seed,
                                          allreduce_summable=not args.no_allreduce,
                                          hierarchy=args.hierarchy)
        return ddp, opt

    @property
    def compression(self):
        return self.state.compression

    @property
    def plan(self):
        return self.state.plan

    @property
    def specs(self):
        return self.state.specs

    @property
    def last_stats(self):
        return self.state.last_stats

    @property
    def transport(self):
        return self.state.exchange.transport.name

    def barrier(self):
        self.dist.barrier()

    def gather(self, x: float, tag: str) -> torch.Tensor:
        out = [torch.zeros(1, dtype=torch.float64) for _ in range(self.size)]
        self.dist.all_gather(out, torch.tensor([x], dtype=torch.float64))
        return torch.cat(out)

    def checkpointed(self):
        return {"hook": self.state}

    def close(self):
        self.state.close()
        self.dist.destroy_process_group()


class Checkpoints:
    """--checkpoint-dir: after each epoch every rank saves what it needs to resume
    (DIR/epoch-E/rank-R.pt: the model, the optimizer with hvdcomp's part, the LR schedule,
    the hook's state under torchrun, the step and the history); rank 0 then marks the epoch
    complete (DIR/latest, replaced atomically) once every rank has saved.  A (re)started job
    resumes from the newest complete epoch, each rank from its own file (hvdcomp's residuals
    are per rank); a world of another size from rank 0's."""

    def __init__(self, path: str, job):
        self.path, self.job = path, job

    def _file(self, epoch: int, rank: int) -> str:
        return os.path.join(self.path, f"epoch-{epoch}", f"rank-{rank}.pt")

    def save(self, epoch: int, objects: dict, steps: int, history: list) -> None:
        os.makedirs(os.path.dirname(self._file(epoch, 0)), exist_ok=True)
        torch.save({"epoch": epoch, "steps": steps, "history": history, "size": self.job.size,
                    **{k: o.state_dict() for k, o in objects.items()}},
                   self._file(epoch, self.job.rank))
        self.job.barrier()
        if self.job.rank == 0:
            with open(os.path.join(self.path, "latest.tmp"), "w") as f:
                f.write(str(epoch))
            os.replace(os.path.join(self.path, "latest.tmp"), os.path.join(self.path, "latest"))

    def load(self, objects: dict):
        """(first epoch to run, steps so far, history) after loading the newest checkpoint
        into ``objects``; (1, 0, []) when there is none."""
        latest = os.path.join(self.path, "latest")
        if not os.path.exists(latest):
            return 1, 0, []
        with open(latest) as f:
            epoch = int(f.read())
        saved = torch.load(self._file(epoch, 0), weights_only=False)
        if saved["size"] == self.job.size:
            saved = torch.load(self._file(epoch, self.job.rank), weights_only=False)
        for k, o in objects.items():
            o.load_state_dict(saved[k])
        if self.job.rank == 0:
            print(f"resumed after epoch {epoch} (saved by {saved['size']} ranks, now "
                  f"{self.job.size})", flush=True)
        return epoch + 1, saved["steps"], saved["history"]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--compression", default=os.environ.get("HVDCOMP_COMPRESSION") or "alq:bits=3",
                    help="compressor spec, e.g. none, fp16, qsgd:bits=4, alq:bits=3, "
                         "auto+alq:bits=3 "
                         "(default: $HVDCOMP_COMPRESSION, else alq:bits=3)")
    ap.add_argument("--collective", default=None,
                    choices=["allgather", "reduce_scatter", "auto"],
                    help="how the compressed gradients travel: every rank's messages to "
                         "every rank (allgather), shards averaged by their owners and "
                         "re-encoded (reduce_scatter), or per tensor by the cost model "
                         "(auto); default: the spec string's ('rs+SPEC' / 'ag+SPEC'), else "
                         "auto with 'auto+SPEC' and allgather otherwise")
    ap.add_argument("--hierarchy", default=None, choices=["auto", "flat", "host"],
                    help="several ranks per host: sum inside each host in float32 and "
                         "compress only across hosts (host), where the hosts have equal "
                         "rank counts (auto), or every rank a host of its own (flat); "
                         "default: the spec string's ('host+SPEC' / 'flat+SPEC'), else auto")
    ap.add_argument("--epochs", type=int, default=12)
    ap.add_argument("--batch-size", type=int, default=32, help="per rank")
    ap.add_argument("--lr", type=float, default=0.1, help="peak learning rate (cosine decay)")
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--weight-decay", type=float, default=0.0,
                    help="SGD weight decay (DGC folds it into the local gradient)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--transport", default="auto", choices=["auto", "mpi", "horovod"],
                    help="Horovod path: carrier of the wire messages (default: mpi when MPI's "
                         "world is Horovod's, else horovod, e.g. under horovodrun --gloo)")
    ap.add_argument("--launcher", default="auto", choices=["auto", "horovod", "torchrun"],
                    help="auto: torchrun when its environment says so, else Horovod")
    ap.add_argument("--no-allreduce", action="store_true",
                    help="send the uncompressed tensors as wire messages too (no allreduce): "
                         "the averages are then the same bits under mpirun and torchrun")
    ap.add_argument("--max-steps", type=int, default=0,
                    help="stop after this many steps in all (0: run every epoch in full)")
    ap.add_argument("--log-dir", default="",
                    help="rank 0 writes per-epoch metrics here: metrics.csv, and TensorBoard "
                         "events when the tensorboard package is installed")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    ap.add_argument("--checkpoint-dir", default="",
                    help="save a checkpoint here after every epoch and resume from the newest "
                         "one (torchrun --max-restarts: survive a worker's death or a resize)")
    ap.add_argument("--fail-at", type=int, default=-1,
                    help="rank 1 kills itself (SIGKILL) at this step on the first attempt "
                         "(TORCHELASTIC_RESTART_COUNT 0), to try --checkpoint-dir")
    ap.add_argument("--json", default="", help="write the per-epoch results here (rank 0)")
    args = ap.parse_args(argv)
    try:
        import hvdcomp
        from hvdcomp.auto import from_spec, merge_collective
        from hvdcomp.exchange.driver import merge_hierarchy, split_hierarchy
        merge_hierarchy(args.hierarchy, args.compression)   # "host+SPEC": hierarchical
        _, in_spec = from_spec(split_hierarchy(args.compression)[1])   # "auto+SPEC": Auto
        merge_collective(args.collective, in_spec)    # "rs+SPEC": over the reduce-scatter
    except hvdcomp.ConfigError as e:
        # one clear line (from the first rank only) instead of a traceback per rank
        if all(os.environ.get(v, "0") == "0"
               for v in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "HOROVOD_RANK", "RANK")):
            print(f"train_mnist.py: --compression {args.compression!r}: {e}", file=sys.stderr)
        sys.exit(2)

    t_start = time.time()
    torchrun = (args.launcher == "torchrun"
                or (args.launcher == "auto" and under_torchrun()))
    job = TorchrunJob() if torchrun else HorovodJob()
    torch.set_num_threads(1)
    rank, size = job.rank, job.size
    # hvdcomp's start-up facts (transport, Auto's plan) at INFO from rank 0, warnings from all
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"%(name)s[{rank}] %(levelname)s: %(message)s")
    torch.manual_seed(args.seed)
    x_tr, y_tr, x_te, y_te = load_digits(args.seed)
    model = FC300100()
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum,
                          weight_decay=args.weight_decay)
    net, opt = job.wrap(model, opt, args)
    label = compression_label(args.compression, job.compression)
    if rank == 0:
        print(f"hvdcomp main job: FC-300-100, {len(x_tr)} train / {len(x_te)} test MNIST "
              f"digits, {size} ranks, {job.name}, compression {label}, "
              f"collective {job.collective}", flush=True)
    show = rank == 0 and not args.no_progress
    try:
        from tqdm import tqdm
    except ImportError:
        show = False
    steps_per_epoch = (len(x_tr) // size + args.batch_size - 1) // args.batch_size
    total = args.epochs * steps_per_epoch
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda t: 0.5 * (1 + math.cos(math.pi * min(t, total) / total)))
    checkpoints = Checkpoints(args.checkpoint_dir, job) if args.checkpoint_dir else None
    saved = {"model": model, "opt": opt, "sched": sched, **job.checkpointed()}
    first, steps, history = checkpoints.load(saved) if checkpoints else (1, 0, [])
    metrics = Metrics(args.log_dir, append=first > 1) if rank == 0 and args.log_dir else None
    job.barrier()                                         # every rank starts the clock together
    t_train = time.time()
    for epoch in range(first, args.epochs + 1):
        if args.max_steps and steps >= args.max_steps:
            break
        model.train()
        g = torch.Generator().manual_seed(args.seed * 1000 + epoch)
        perm = torch.randperm(len(x_tr), generator=g)[rank::size]    # this rank's shard
        batches = perm.split(args.batch_size)
        sent = fp32 = traffic = 0
        phases = {"encode_s": 0.0, "comm_s": 0.0, "decode_s": 0.0, "events": 0}
        it = tqdm(batches, desc=f"epoch {epoch}", leave=False, ncols=80) if show else batches
        for idx in it:
            opt.zero_grad()
            loss = F.cross_entropy(net(x_tr[idx]), y_tr[idx])
            if (steps == args.fail_at and rank == 1
                    and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"):
                os.kill(os.getpid(), signal.SIGKILL)     # a preempted worker
            loss.backward()
            opt.step()
            sched.step()
            st = job.last_stats.as_dict()
            sent += st["bytes_sent"]
            fp32 += st["fp32_bytes"]
            traffic += st["traffic_bytes"]
            for k in ("encode_s", "comm_s", "decode_s"):
                phases[k] += st[k]
            phases["events"] += len(st["events"])
            steps += 1
            if args.max_steps and steps >= args.max_steps:
                break
        model.eval()
        with torch.no_grad():
            acc = (model(x_te).argmax(1) == y_te).float().mean().item() * 100
        per_rank = job.gather(sent, f"bytes.{epoch}")
        if rank == 0:
            lo, hi = per_rank.min().item(), per_rank.max().item()
            row = dict(epoch=epoch, test_acc=acc, bytes_per_rank=hi, fp32_bytes=fp32,
                       ratio=fp32 / hi, seconds=time.time() - t_start,
                       train_seconds=time.time() - t_train)
            history.append(row)
            if metrics is not None:
                metrics.write(dict(row, traffic_bytes=traffic, steps=steps, **phases))
            print(f"epoch {epoch:2d}  test acc {acc:5.2f} %  sent/rank {hi / 1e6:7.3f} MB"
                  f" (min {lo / 1e6:.3f})  fp32 {fp32 / 1e6:7.3f} MB  ratio {fp32 / hi:6.2f}x"
                  f"  [{time.time() - t_start:5.1f} s]", flush=True)
        if checkpoints is not None:
            checkpoints.save(epoch, saved, steps, history)
    if metrics is not None:
        metrics.close()
    if rank == 0:
        print(f"final: test acc {history[-1]['test_acc']:.2f} %, compression "
              f"{label}, ratio {history[-1]['ratio']:.2f}x, "
              f"wall {time.time() - t_start:.1f} s", flush=True)
        if args.json:
            import json
            with open(args.json, "w") as f:
                json.dump({"compression": job.compression.spec(), "collective": job.collective,
                           "ranks": size, "launcher": job.name, "transport": job.transport,
                           "args": vars(args), "epochs": history}, f, indent=1)
    job.close()


class Metrics:
    """Per-epoch metrics of rank 0: DIR/metrics.csv (one row per epoch, header first) and,
    when ``torch.utils.tensorboard`` can be imported (the tensorboard package), TensorBoard
    scalars under DIR (tag = column, step = epoch)."""

    def __init__(self, log_dir: str, append: bool = False):
        os.makedirs(log_dir, exist_ok=True)
        self.path = os.path.join(log_dir, "metrics.csv")
        self._append = append and os.path.exists(self.path)   # a resumed job: no new header
        self._file = open(self.path, "a" if self._append else "w", newline="")
        self._csv = None
        try:
            from torch.utils.tensorboard import SummaryWriter
            self.tb = SummaryWriter(log_dir)
        except ImportError:                 # no tensorboard package: the CSV only
            self.tb = None

    def write(self, row: dict) -> None:
        if self._csv is None:
            self._csv = csv.DictWriter(self._file, fieldnames=list(row))
            if not self._append:
                self._csv.writeheader()
        self._csv.writerow(row)
        self._file.flush()
        if self.tb is not None:
            for k, v in row.items():
                if k != "epoch":
                    self.tb.add_scalar(k, v, row["epoch"])
            self.tb.flush()

    def close(self) -> None:
        self._file.close()
        if self.tb is not None:
            self.tb.close()


if __name__ == "__main__":
    main()
