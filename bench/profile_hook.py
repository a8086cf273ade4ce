"""Where the DDP hook's time goes, against the Horovod path, on the same ranks and gradients.

    launch/netem 1gbit -- launch/run -np 4 .venv/bin/python bench/profile_hook.py [--reps 5]

Paths: ``hvd`` (the Horovod path's exchange, as bench/exchange.py's Horovod rows), ``ddp``
(``ddp(x).backward()`` with hvdcomp's hook, as its ``ddp+SPEC`` rows), ``noop`` (DDP with a
hook that sends nothing), ``torch-powersgd:rank=R`` (PyTorch's powerSGD_hook, as
bench/exchange.py's ``ddp:powersgd:rank=R`` rows, one DDP bucket).  ``--bucket-mb``: DDP's
bucket size for the ``ddp`` path (default DDP's 25).  Per rank and path: wall time per step, the process's CPU time
per step, per stage (encode / communicate / decode, the hook's own calls, the transport's
collectives) the wall and thread CPU seconds summed over the step's buckets, and every
thread's CPU seconds per step (from /proc: the pipeline's threads by name, MainThread is
forward + backward + DDP, Gloo's and Horovod's threads by their system names, Horovod's
background thread shows as "python"); rank 0 also prints the last step's timeline (stage
start and end per bucket, from the step's start).  CPU seconds are the robust numbers on a
shared machine; wall times need a quiet one.
"""
from __future__ import annotations

import argparse
import collections
import math
import os
import statistics
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

ACC = collections.defaultdict(lambda: [0.0, 0.0, 0])    # name -> [wall, cpu, calls]
TL = []                                                # (name, start, end, thread)
T0 = [0.0]
LOCK = threading.Lock()


def timed(name, fn):
    def wrapper(*a, **k):
        w0, c0 = time.perf_counter(), time.thread_time()
        try:
            return fn(*a, **k)
        finally:
            w1, c1 = time.perf_counter(), time.thread_time()
            with LOCK:
                acc = ACC[name]
                acc[0] += w1 - w0
                acc[1] += c1 - c0
                acc[2] += 1
                TL.append((name, w0 - T0[0], w1 - T0[0], threading.current_thread().name))
    return wrapper


def patch():
    from hvdcomp.exchange import collective as C
    from hvdcomp.transport import base as B, mpi as M, torch_dist as TD
    from hvdcomp import ddp as D
    from hvdcomp.exchange import averaging as A
    for cls, names in ((C.Allgather, ("encode", "communicate", "decode", "_frame",
                                      "_decode_frames")),
                       (M.MPITransport, ("_allgather_counts", "_allgatherv")),
                       (TD.TorchDistTransport, ("_allgather_counts", "_allgatherv")),
                       (B.Transport, ("exchange",)),
                       (A.Averaging, ("combine", "accumulator", "finish")),
                       (D, ("exchange_bucket",))):
        for n in names:
            setattr(cls, n, timed(f"{cls.__name__}.{n}", getattr(cls, n)))
    from hvdcomp.exchange import rounds as R
    from hvdcomp.compressors import powersgd as PS
    for cls, names in ((R.Rounds, ("encode", "communicate", "wait", "check", "decode",
                                   "_sum")),
                       (PS.PowerSGD, ("first_round", "next_round", "last_round",
                                      "finalize"))):
        for n in names:
            setattr(cls, n, timed(f"{cls.__name__}.{n}", getattr(cls, n)))
    import hvdcomp.transport.framing as F
    F.Incoming.__init__ = timed("Incoming.__init__", F.Incoming.__init__)
    F.Incoming.messages = timed("Incoming.messages", F.Incoming.messages)
    F.Outgoing.__init__ = timed("Outgoing.__init__", F.Outgoing.__init__)


CLK = os.sysconf("SC_CLK_TCK")


def thread_cpu():
    """{thread label: CPU seconds so far} for every thread of this process (/proc)."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                st = f.read()
            with open(f"/proc/self/task/{tid}/comm") as f:
                comm = f.read().strip()
        except OSError:
            continue
        fields = st[st.rindex(")") + 2:].split()
        label = names.get(int(tid), comm)
        out[f"{label}[{tid}]"] = (int(fields[11]) + int(fields[12])) / CLK
    return out


THREADS = collections.defaultdict(float)


def thread_delta(before):
    after = thread_cpu()
    for k, v in after.items():
        THREADS[k] += v - before.get(k, 0.0)


def report(tag, rank, walls, cpus, reps):
    lines = [f"[{tag} rank {rank}] wall/step {statistics.median(walls):.3f} s "
             f"(all {', '.join(f'{w:.3f}' for w in walls)}); process CPU/step "
             f"{statistics.median(cpus):.3f} s"]
    for name, (w, c, n) in sorted(ACC.items()):
        lines.append(f"    {name:36s} wall {w / reps:7.3f}  cpu {c / reps:7.3f}  "
                     f"calls/step {n / reps:5.1f}")
    by = collections.defaultdict(float)
    for k, v in THREADS.items():
        by[k.split("[")[0]] += v
    lines.append("    threads (CPU s/step): " + ", ".join(
        f"{k} {v / reps:.3f}" for k, v in sorted(by.items(), key=lambda kv: -kv[1]) if v > 0))
    lines.append("    top threads: " + ", ".join(
        f"{k} {v / reps:.3f}" for k, v in sorted(THREADS.items(), key=lambda kv: -kv[1])[:8]))
    THREADS.clear()
    print("\n".join(lines), flush=True)


def timeline(tag):
    rows = sorted(TL, key=lambda r: r[1])
    print(f"[{tag} rank 0] timeline of the last step (s from its start):")
    for name, a, b, th in rows:
        if name.split(".")[-1] in ("encode", "communicate", "decode", "exchange_bucket",
                                   "_allgather_counts", "_allgatherv", "done"):
            print(f"    {a:7.3f} {b:7.3f} {b - a:7.3f}  {th:22s} {name}")
    sys.stdout.flush()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--spec", default="alq:bits=3")
    ap.add_argument("--paths", default="hvd,ddp,noop")
    ap.add_argument("--port", type=int, default=29541)
    ap.add_argument("--bucket-mb", type=float, default=25.0)
    ap.add_argument("--keep-horovod", action="store_true",
                    help="leave Horovod running during the DDP paths (bench/exchange.py "
                         "shuts it down first: its background thread costs CPU)")
    args = ap.parse_args()
    import torch
    import horovod.torch as hvd
    from hvdcomp.auto import from_spec
    from hvdcomp.exchange import Exchange
    from hvdcomp.transport import HorovodAllreduce
    from hvdcomp.transport import make
    from shapes import resnet50
    import exchange as bx
    hvd.init()
    torch.set_num_threads(1)
    rank, size = hvd.rank(), hvd.size()
    shapes = resnet50()
    patch()
    paths = args.paths.split(",")
    if "hvd" in paths:
        g = torch.Generator().manual_seed(100 + rank)
        params = []
        for name, shape in shapes:
            p = torch.nn.Parameter(torch.zeros(shape))
            p.grad = torch.randn(shape, generator=g) * 1e-3
            params.append((name, p))
        comp, coll = from_spec(args.spec)
        ex = Exchange(params, comp, make("mpi"), allreduce=HorovodAllreduce(hvd), seed=1,
                      collective=coll)
        walls, cpus = [], []
        for rep in range(args.reps + 1):
            hvd.allreduce(torch.zeros(1), name="barrier")
            if rep == 1:
                ACC.clear()
                THREADS.clear()
            TL.clear()
            before = thread_cpu()
            c0 = time.process_time()
            T0[0] = t0 = time.perf_counter()
            ex.begin(rep)
            for name, _ in params:
                ex.ready(name)
            ex.finish()
            if rep:
                walls.append(time.perf_counter() - t0)
                cpus.append(time.process_time() - c0)
                thread_delta(before)
        report("hvd", rank, walls, cpus, args.reps)
        if rank == 0:
            timeline("hvd")
        ex.close()
        del ex, params
    if not args.keep_horovod:
        hvd.shutdown()
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    import hvdcomp.ddp
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(args.port))
    dist.init_process_group("gloo", rank=rank, world_size=size)
    for path in paths:
        if path == "hvd":
            continue
        model = bx._Synthetic.build(shapes, rank)
        state, warm = None, 1
        if path.startswith("torch-powersgd:rank="):
            from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
            ddp = DDP(model, bucket_cap_mb=1024)          # one bucket (bench/exchange.py)
            st = psgd.PowerSGDState(process_group=None,
                                    matrix_approximation_rank=int(path.split("=")[1]),
                                    start_powerSGD_iter=2, use_error_feedback=True,
                                    warm_start=True)
            ddp.register_comm_hook(st, psgd.powerSGD_hook)
            warm = 3
        elif path == "noop":
            ddp = DDP(model)
            ddp.register_comm_hook(None, bx._noop_hook)
        else:
            ddp = DDP(model, bucket_cap_mb=args.bucket_mb)
            state = hvdcomp.ddp.HookState(ddp, from_spec(args.spec)[0], seed=1)
            ddp.register_comm_hook(state, hvdcomp.ddp.hook)
        x = torch.ones(())
        walls, cpus = [], []
        for rep in range(args.reps + warm):
            dist.barrier()
            if rep == warm:
                ACC.clear()
                THREADS.clear()
            TL.clear()
            before = thread_cpu()
            c0 = time.process_time()
            T0[0] = t0 = time.perf_counter()
            ddp(x).backward()
            if rep >= warm:
                walls.append(time.perf_counter() - t0)
                cpus.append(time.process_time() - c0)
                thread_delta(before)
            for p in model.parameters():
                p.grad = None
        report(path, rank, walls, cpus, args.reps)
        if rank == 0:
            timeline(path)
        if state is not None:
            state.close()
        del ddp, model
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
