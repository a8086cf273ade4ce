"""The main job: data-parallel training of FC-300-100 on real MNIST digits with hvdcomp.

    launch/run -np 4 .venv/bin/python examples/train_mnist.py                     # ALQ 3 bits
    launch/run -np 4 .venv/bin/python examples/train_mnist.py --compression none

Each rank trains on its shard of the 4,000 training digits; gradients are exchanged as real
encoded bytes.  Rank 0 prints, per epoch, the test accuracy on the 1,000 test digits, the
bytes each rank sent and the compression ratio against fp32.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mnist import FC300100, load_digits  # noqa: E402

import hvdcomp.torch as hvd  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--compression", default=os.environ.get("HVDCOMP_COMPRESSION") or "alq:bits=3",
                    help="compressor spec, e.g. none, fp16, qsgd:bits=4, alq:bits=3, "
                         "auto+alq:bits=3 "
                         "(default: $HVDCOMP_COMPRESSION, else alq:bits=3)")
    ap.add_argument("--epochs", type=int, default=12)
    ap.add_argument("--batch-size", type=int, default=32, help="per rank")
    ap.add_argument("--lr", type=float, default=0.1, help="peak learning rate (cosine decay)")
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--weight-decay", type=float, default=0.0,
                    help="SGD weight decay (DGC folds it into the local gradient)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--transport", default="mpi", choices=["mpi", "horovod"])
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    ap.add_argument("--json", default="", help="write the per-epoch results here (rank 0)")
    args = ap.parse_args(argv)
    try:
        import hvdcomp
        from hvdcomp.auto import from_spec
        from_spec(args.compression)          # "auto+SPEC": hvdcomp.Auto(SPEC)
    except hvdcomp.ConfigError as e:
        # one clear line (from the first rank only) instead of a traceback per rank
        if os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMI_RANK", "0")) == "0":
            print(f"train_mnist.py: --compression {args.compression!r}: {e}", file=sys.stderr)
        sys.exit(2)

    t_start = time.time()
    hvd.init()
    torch.set_num_threads(1)
    rank, size = hvd.rank(), hvd.size()
    torch.manual_seed(args.seed)
    x_tr, y_tr, x_te, y_te = load_digits(args.seed)
    model = FC300100()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum,
                          weight_decay=args.weight_decay)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                   compression=args.compression, transport=args.transport,
                                   seed=args.seed)
    if rank == 0:
        print(f"hvdcomp main job: FC-300-100, {len(x_tr)} train / {len(x_te)} test MNIST "
              f"digits, {size} ranks, compression {opt.compression.spec()}", flush=True)
        if args.compression.strip().lower().startswith("auto+"):
            counts = {}
            for c in opt.plan.values():
                counts[c] = counts.get(c, 0) + 1
            print(f"Auto's plan (tensors per path): {counts}", flush=True)
    show = rank == 0 and not args.no_progress
    try:
        from tqdm import tqdm
    except ImportError:
        show = False
    history = []
    steps_per_epoch = (len(x_tr) // size + args.batch_size - 1) // args.batch_size
    total = args.epochs * steps_per_epoch
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda t: 0.5 * (1 + math.cos(math.pi * min(t, total) / total)))
    hvd.allreduce(torch.zeros(1), name="start")          # every rank starts the clock together
    t_train = time.time()
    for epoch in range(1, args.epochs + 1):
        model.train()
        g = torch.Generator().manual_seed(args.seed * 1000 + epoch)
        perm = torch.randperm(len(x_tr), generator=g)[rank::size]    # this rank's shard
        batches = perm.split(args.batch_size)
        sent = fp32 = traffic = 0
        it = tqdm(batches, desc=f"epoch {epoch}", leave=False, ncols=80) if show else batches
        for idx in it:
            opt.zero_grad()
            loss = F.cross_entropy(model(x_tr[idx]), y_tr[idx])
            loss.backward()
            opt.step()
            sched.step()
            st = opt.last_stats
            sent += st.bytes_sent
            fp32 += st.fp32_bytes
            traffic += st.traffic_bytes
        model.eval()
        with torch.no_grad():
            acc = (model(x_te).argmax(1) == y_te).float().mean().item() * 100
        per_rank = hvd.allgather(torch.tensor([sent], dtype=torch.float64),
                                 name=f"bytes.{epoch}")
        if rank == 0:
            lo, hi = per_rank.min().item(), per_rank.max().item()
            row = dict(epoch=epoch, test_acc=acc, bytes_per_rank=hi, fp32_bytes=fp32,
                       ratio=fp32 / hi, seconds=time.time() - t_start,
                       train_seconds=time.time() - t_train)
            history.append(row)
            print(f"epoch {epoch:2d}  test acc {acc:5.2f} %  sent/rank {hi / 1e6:7.3f} MB"
                  f" (min {lo / 1e6:.3f})  fp32 {fp32 / 1e6:7.3f} MB  ratio {fp32 / hi:6.2f}x"
                  f"  [{time.time() - t_start:5.1f} s]", flush=True)
    if rank == 0:
        print(f"final: test acc {history[-1]['test_acc']:.2f} %, compression "
              f"{opt.compression.spec()}, ratio {history[-1]['ratio']:.2f}x, "
              f"wall {time.time() - t_start:.1f} s", flush=True)
        if args.json:
            import json
            with open(args.json, "w") as f:
                json.dump({"compression": opt.compression.spec(), "ranks": size,
                           "args": vars(args), "epochs": history}, f, indent=1)


if __name__ == "__main__":
    main()
