"""How the exchange scales with the number of hosts: allgather against reduce-scatter,
measured on 2 to 16 emulated hosts, and a model fitted to the measurements that predicts
16 to 1024 hosts.

    .venv/bin/python bench/scaling.py --models resnet50 --hosts 2,4,8 --rates 1gbit,10gbit
    .venv/bin/python bench/scaling.py --fit          # refit the model, redraw, no measuring

Rank 0 logs Auto's plans and cost model (INFO); with HVDCOMP_BENCH_DEBUG=1 also each per-layer
candidate's measured costs (DEBUG).

Each cell (model, hosts, rate) runs `launch/cluster HOSTS RATE -- launch/run -np HOSTS
python bench/scaling.py --worker ...`: one rank per host, each host in its own network
namespace behind its own link of RATE in both directions (MPI over TCP).  For every method
(fp32 and fp16 through Horovod's allreduce; ALQ 3 bits and DGC 0.1 % over the allgather and
over the reduce-scatter; Auto; hvdcomp's PowerSGD at ranks 1, 2, 4, its P and Q summed by
Horovod's allreduce in rounds; Auto per layer, whose first exchange is fp32 and decides its
plan, and which therefore warms up with two exchanges) each rank times a warm-up and --reps exchanges of synthetic
gradients with the model's shapes (bench/shapes.py); with --ddp-methods
(``torch-powersgd:rank=R``) the same ranks then shut Horovod down and time PyTorch's
powerSGD_hook (Vogels et al. 2019; error feedback, warm start) under DDP over Gloo between
the same hosts (one backward pass of bench/exchange.py's synthetic model in one bucket, as
bench/exchange.py's ``ddp:powersgd`` rows; its payload is the elements it all_reduces, no
encode / decode split and no replay).  Reported per method:

* time per exchange: the slowest rank's, median over the reps (and min/max);
* bytes sent and received per rank: exact, from its interface's counters (/proc/net/dev:
  everything MPI and Horovod put on the link, TCP/IP headers included), and hvdcomp's own
  payload counts (StepStats: bytes_sent, recv_bytes);
* the encode / communicate / decode split (StepStats: seconds summed over buckets), the
  communicate stage's local work (the reduce-scatter's re-encoding, reduce_s) and the wire
  part comm_s - reduce_s;
* replay: the same collective calls with the same byte counts, replayed back to back with
  nothing else running, after the reps (the wire alone: on this 2-core machine the
  communicate stage also waits for ranks slowed by the others' encoding; the replay still
  shares the cores with the other ranks' TCP work, which the model's ``gamma`` prices).

Results: bench/results/scaling.json (raw, with the command and time of each cell),
scaling.md (tables, the fitted model and its predictions), scaling.png (predicted time per
exchange against hosts for each method).  The model: bench/scaling_model.py (its module
docstring).
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# (each Auto per layer row right after the fixed row whose error is its budget: rows timed
# minutes apart differed by up to 23 % with the same exchange, after a heavy row, while
# adjacent ones by 2-4 %: bench/results/scaling_diagnostics_20261204.md, section 7)
METHODS = ["none", "fp16", "ag+alq:bits=3", "rs+alq:bits=3", "auto+layer+alq:bits=3",
           "ag+dgc:density=0.001", "rs+dgc:density=0.001", "auto+alq:bits=3",
           "powersgd:rank=1", "auto+layer+powersgd:rank=1", "powersgd:rank=2",
           "powersgd:rank=4"]
# PyTorch's powerSGD_hook, timed under DDP over Gloo between the same hosts (--ddp-methods)
DDP_METHODS = ["torch-powersgd:rank=1", "torch-powersgd:rank=2", "torch-powersgd:rank=4"]
from scaling_model import LABELS  # noqa: E402  (the rows' names, one table for the bench)
RESULTS = os.path.join(ROOT, "bench", "results", "scaling")
CORES = os.cpu_count() or 1


# --- the worker (one rank per host) --------------------------------------------------------

def netdev():
    """(received, sent) bytes of this network namespace's interfaces but loopback."""
    rx = tx = 0
    with open("/proc/net/dev") as f:
        for line in f.readlines()[2:]:
            name, data = line.split(":", 1)
            if name.strip() != "lo":
                v = data.split()
                rx += int(v[0])
                tx += int(v[8])
    return rx, tx


def _recording(base_cls):
    """The transport class ``base_cls`` recording its collective calls (byte counts) while
    ``on``, and replaying them with zero bytes."""
    class Recording(base_cls):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.on, self.calls, self._lock = False, [], threading.Lock()

        def allgather(self, data):
            if self.on:
                with self._lock:
                    self.calls.append(("ag", len(data)))
            return super().allgather(data)

        def alltoall(self, parts):
            if self.on:
                with self._lock:
                    self.calls.append(("aa", [len(p) for p in parts]))
            return super().alltoall(parts)

        def replay(self):
            import numpy as np
            self.on = False
            for kind, n in self.calls:
                if kind == "ag":
                    super().allgather(np.zeros(n, np.uint8))
                else:
                    super().alltoall([np.zeros(c, np.uint8) for c in n])
    return Recording


class RecordingAllreduce:
    """Horovod's allreduce carrier, recording the buffers it sums while ``on``."""

    def __init__(self, inner):
        self.inner, self.dtypes, self.prefix = inner, inner.dtypes, inner.prefix
        self.on, self.calls = False, []

    def start(self, buf, name):
        if self.on:
            self.calls.append((buf.numel(), buf.dtype, name))
        return self.inner.start(buf, name)

    def wait(self, handle):
        self.inner.wait(handle)

    def sum_(self, buf, name):
        self.wait(self.start(buf, name))
        return buf

    def replay(self):
        import torch
        self.on = False
        hs = [self.inner.start(torch.zeros(n, dtype=dt), name) for n, dt, name in self.calls]
        for h in hs:
            self.inner.wait(h)


def worker(args):
    import torch
    import horovod.torch as hvd
    from hvdcomp.auto import from_spec
    from hvdcomp.exchange import Exchange
    from hvdcomp.transport import HorovodAllreduce, MPITransport
    from shapes import bert_base, resnet50, synthetic_params
    hvd.init()
    torch.set_num_threads(1)
    rank, size = hvd.rank(), hvd.size()
    if rank == 0:       # Auto's plan and cost model (INFO, rank 0) into the bench's log
        import logging
        h = logging.StreamHandler(sys.stderr)
        h.setFormatter(logging.Formatter("[hvdcomp] %(message)s"))
        logging.getLogger("hvdcomp").addHandler(h)
        logging.getLogger("hvdcomp").setLevel(
            logging.DEBUG if os.environ.get("HVDCOMP_BENCH_DEBUG") else logging.INFO)
    shapes = {"resnet50": resnet50, "bert_base": bert_base}[args.model]()
    params = synthetic_params(shapes, rank)

    def barrier(tag):
        hvd.allreduce(torch.zeros(1), name=f"barrier.{tag}")

    rows = []
    for spec in args.methods.split(";"):
        comp, collective = from_spec(spec)
        tp = _recording(MPITransport)()
        ar = RecordingAllreduce(HorovodAllreduce(hvd))
        t0 = time.perf_counter()
        ex = Exchange(params, comp, tp, allreduce=ar, seed=1, collective=collective)
        build_s = time.perf_counter() - t0
        reps = []
        # warm-up exchanges, untimed: one; two for Auto per layer, whose first exchange is
        # fp32 and decides the plan, and whose second is its plan's first (the compressors'
        # first step, which every fixed method takes in its own warm-up)
        warm = 2 if spec.startswith("auto+layer") else 1
        for rep in range(args.reps + warm):
            last = rep == args.reps + warm - 1
            tp.on = ar.on = last
            tp.calls, ar.calls = [], []
            barrier(f"{spec}.{rep}")
            rx0, tx0 = netdev()
            t0 = time.perf_counter()
            ex.begin(rep)
            for name, _ in params:
                ex.ready(name)
            _, st = ex.finish()
            dt = time.perf_counter() - t0
            rx1, tx1 = netdev()
            tp.on = ar.on = False
            if rep >= warm:
                reps.append(dict(s=dt, tx=tx1 - tx0, rx=rx1 - rx0, encode=st.encode_s,
                                 comm=st.comm_s, decode=st.decode_s, reduce=st.reduce_s,
                                 sent=st.bytes_sent, recv=st.recv_bytes,
                                 traffic=st.traffic_bytes, fp32=st.fp32_bytes))
        barrier(f"{spec}.replay")
        t0 = time.perf_counter()
        tp.replay()
        ar.replay()
        replay_s = time.perf_counter() - t0
        elements = {}
        for e in ex.entries.values():
            k = f"{e.compressor.name} over {e.path}"
            elements[k] = elements.get(k, 0) + e.param.numel()
        mine = dict(reps=reps, replay_s=replay_s, build_s=build_s, calls=tp.calls,
                    allreduces=[(n, str(dt)) for n, dt, _ in ar.calls])
        everyone = hvd.allgather_object(mine, name=f"gather.{spec}")
        if rank == 0:
            row = dict(method=spec, ranks=everyone, elements=elements,
                       buckets=len(ex.buckets))
            if ex.auto is not None and ex.auto.model is not None:
                row["cost_model"] = ex.auto.model.as_dict()
            if ex.layer is not None:          # a per-layer plan's trial: seconds of each
                row["trial"] = ex.layer.trial
                row["planned"] = sorted({c.spec for c in ex.layer.planned.values()})
            rows.append(row)
            print(json.dumps(summarize(row)), flush=True)
        ex.close()
        del ex
        gc.collect()
    if args.ddp_methods:
        rows += ddp_rows(args, hvd, rank, size)
    if rank == 0:
        with open(args.json, "w") as f:
            json.dump(rows, f)


def _host_address():
    """This host's address on the emulated network (the interface that reaches the
    switch, launch/cluster's 10.213.0.1), or 127.0.0.1."""
    import socket
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.213.0.1", 9))
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


def ddp_rows(args, hvd, rank, size):
    """PyTorch's powerSGD_hook rows (module docstring): Horovod shut down (its background
    thread costs CPU a DDP job does not pay), torch.distributed (Gloo) started with rank 0's
    host address, then per method --reps timed backward passes after 2 vanilla steps and a
    warm-up."""
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
    from torch.nn.parallel import DistributedDataParallel as DDP
    import exchange as bx
    from shapes import bert_base, resnet50
    shapes = {"resnet50": resnet50, "bert_base": bert_base}[args.model]()
    master = hvd.broadcast_object(_host_address(), root_rank=0, name="ddp.master")
    hvd.shutdown()
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = master, str(args.ddp_port)
    if master != "127.0.0.1":       # Gloo between the hosts' links (launch/cluster's eth0)
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "eth0")
    dist.init_process_group("gloo", rank=rank, world_size=size)
    numel = sum(math.prod(s) for _, s in shapes)
    rows = []
    for spec in args.ddp_methods.split(";"):
        if not spec.startswith("torch-powersgd:rank="):
            raise ValueError(f"unknown DDP method {spec!r} (torch-powersgd:rank=R)")
        r = int(spec.split("=")[1])
        model = bx._Synthetic.build(shapes, rank)
        ddp = DDP(model, bucket_cap_mb=1 << 14)      # one bucket (bench/exchange.py)
        st = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=r,
                                start_powerSGD_iter=2, use_error_feedback=True,
                                warm_start=True)
        ddp.register_comm_hook(st, psgd.powerSGD_hook)
        sent = bx._powersgd_bytes(shapes, r)
        x = torch.ones(())
        reps = []
        for rep in range(args.reps + 3):                 # 2 vanilla steps, 1 warm-up
            dist.barrier()
            rx0, tx0 = netdev()
            t0 = time.perf_counter()
            ddp(x).backward()
            dt = time.perf_counter() - t0
            rx1, tx1 = netdev()
            if rep >= 3:
                reps.append(dict(s=dt, tx=tx1 - tx0, rx=rx1 - rx0, encode=0.0, comm=0.0,
                                 decode=0.0, reduce=0.0, sent=sent, recv=0,
                                 traffic=2 * (size - 1) / size * sent, fp32=4 * numel))
            for p in model.parameters():
                p.grad = None
        mine = dict(reps=reps, replay_s=0.0, build_s=0.0, calls=[], allreduces=[])
        everyone = [None] * size
        dist.all_gather_object(everyone, mine)
        if rank == 0:
            row = dict(method=spec, ranks=everyone, elements={"powersgd (PyTorch)": numel},
                       buckets=1)
            rows.append(row)
            print(json.dumps(summarize(row)), flush=True)
        del ddp, model
        gc.collect()
    dist.destroy_process_group()
    return rows


def _med(xs):
    return statistics.median(xs)


def summarize(row):
    """One method's figures from every rank's reps (module docstring)."""
    ranks = row["ranks"]
    nreps = len(ranks[0]["reps"])
    times = [max(r["reps"][i]["s"] for r in ranks) for i in range(nreps)]

    def per_rank(key):
        return [_med([x[key] for x in r["reps"]]) for r in ranks]
    out = dict(method=row["method"], median_s=_med(times), min_s=min(times),
               max_s=max(times), replay_s=max(r["replay_s"] for r in ranks))
    for key in ("tx", "rx", "sent", "recv", "traffic", "encode", "comm", "decode", "reduce"):
        v = per_rank(key)
        out[key] = statistics.mean(v)
        out[key + "_max"] = max(v)
    wire = [c - d for c, d in zip(per_rank("comm"), per_rank("reduce"))]
    out["wire"] = statistics.mean(wire)
    out["wire_min"] = min(wire)
    out["fp32"] = ranks[0]["reps"][0]["fp32"]
    out["elements"] = row["elements"]
    return out


# --- the driver ----------------------------------------------------------------------------

def load():
    if os.path.exists(RESULTS + ".json"):
        with open(RESULTS + ".json") as f:
            return json.load(f)
    return {"cells": {}, "runs": {}}


def driver(args):
    res = load()
    for model in args.models.split(","):
        for hosts in map(int, args.hosts.split(",")):
            for rate in args.rates.split(","):
                cell = f"{model}/{hosts}/{rate}"
                path = os.path.join("/tmp", f"hvdcomp-scaling-{model}-{hosts}-{rate}.json")
                cmd = [os.path.join(ROOT, "launch", "cluster"), str(hosts), rate, "--",
                       os.path.join(ROOT, "launch", "run"), "-np", str(hosts),
                       sys.executable, os.path.abspath(__file__), "--worker", "--model",
                       model, "--reps", str(args.reps), "--methods", args.methods,
                       "--ddp-methods", args.ddp_methods, "--json", path]
                print("+", " ".join(cmd), flush=True)
                t0 = time.time()
                load0 = os.getloadavg()
                subprocess.run(cmd, check=True, timeout=3600,
                               env=dict(os.environ, PYTHONPATH=ROOT))
                with open(path) as f:
                    rows = json.load(f)
                stamp = time.strftime("%Y-%m-%d %H:%M")
                old = {r["method"]: r for r in res["cells"].get(cell, [])}
                for r in rows:
                    r["measured"] = stamp
                    old[r["method"]] = r
                res["cells"][cell] = list(old.values())
                load1 = os.getloadavg()
                res["runs"][stamp] = ("python bench/scaling.py " + " ".join(sys.argv[1:])
                                      + f"  # cell {cell}, {time.time() - t0:.0f} s, load "
                                      f"average (1 min) {load0[0]:.1f} before, "
                                      f"{load1[0]:.1f} after")
                res["cores"] = CORES
                res["conditions"] = args.conditions or res.get("conditions", "")
                for r in rows:
                    s = summarize(r)
                    print(f"{cell:22s} {LABELS.get(s['method'], s['method']):26s} "
                          f"{s['median_s']:7.3f} s  wire {s['wire']:.3f} replay "
                          f"{s['replay_s']:.3f}  tx {s['tx'] / 1e6:8.2f} MB  enc "
                          f"{s['encode']:.3f} dec {s['decode']:.3f}", flush=True)
                with open(RESULTS + ".json", "w") as f:
                    json.dump(res, f)
    report(res)


def report(res):
    """Fit the model, write scaling.md and scaling.png."""
    from scaling_model import fit, render, plot
    fitted = fit(res)
    with open(RESULTS + ".md", "w") as f:
        f.write(render(res, fitted))
    plot(res, fitted, RESULTS + ".png")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--fit", action="store_true", help="refit and redraw, measure nothing")
    ap.add_argument("--models", default="resnet50,bert_base")
    ap.add_argument("--model", default="resnet50", choices=["resnet50", "bert_base"])
    ap.add_argument("--hosts", default="2,4,8")
    ap.add_argument("--rates", default="1gbit,10gbit")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--methods", default=";".join(METHODS))
    ap.add_argument("--ddp-methods", default="",
                    help="PyTorch's PowerSGD hook rows after the Horovod rows, e.g. "
                         + repr(";".join(DDP_METHODS)))
    ap.add_argument("--ddp-port", type=int, default=29561)
    ap.add_argument("--json", default="")
    ap.add_argument("--conditions", default="", help="a line on the machine's state, kept "
                    "with the results")
    args = ap.parse_args()
    if args.worker:
        worker(args)
    elif args.fit:
        report(load())
    else:
        driver(args)


if __name__ == "__main__":
    main()
