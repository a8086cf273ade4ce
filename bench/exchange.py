"""Cost of one full gradient exchange (encode, communicate, decode, average) on 4 ranks.

    .venv/bin/python bench/exchange.py --rates 10gbit,1gbit,100mbit --model resnet50

For each rate it starts `launch/netem RATE -- launch/run -np 4 python bench/exchange.py
--worker ...` (a network namespace whose loopback is limited to RATE: all four ranks share
that one link, like four GPUs behind one NIC), and each worker times, for every method,
--reps exchanges of synthetic gradients with the model's layer shapes (bench/shapes.py):
Horovod's own fp32 and fp16 allreduce (the summable path of hvdcomp.torch's exchange) and
each hvdcomp compressor through the allgather path.  Reported: median and spread of the
exchange time, bytes on the wire per rank, and the encode / communicate / decode split.
Results: bench/results/exchange_<model>.json and .md (written by the driver).

With --ddp-methods, the same workers then time DistributedDataParallel on the same shapes,
link and gradients, over torch.distributed (Gloo) started inside the same four processes:
one step = ``ddp(x).backward()`` of a model whose gradient is the synthetic one, with
hvdcomp's communication hook (``ddp+SPEC``: hvdcomp.ddp.HookState(SPEC)), PyTorch's own
hooks (``ddp:allreduce``: no hook, DDP's fp32 allreduce; ``ddp:fp16``:
default_hooks.fp16_compress_hook; ``ddp:powersgd:rank=R``: powerSGD_hook, Vogels et al.
2019, error feedback and warm start on, compressing from the first timed step), and
``ddp:noop`` (a hook that sends nothing: the cost of backward and DDP's bucketing alone).
DDP's default 25 MB buckets (PyTorch's PowerSGD: one bucket, see ddp_rows).  hvdcomp's
PowerSGD (Vogels et al. 2019) goes through both doors: ``powersgd:rank=R`` (the Horovod
rows: its P and Q summed by Horovod's allreduce in rounds) and ``ddp+powersgd:rank=R`` (the
hook), beside PyTorch's ``ddp:powersgd:rank=R``.  With --rounds N the list of methods runs
N times in turn (each time built afresh, warmed up, then --reps timed steps), so that on a
shared machine every row samples the same stretches of load.
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
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

METHODS = ["none", "fp16", "alq:bits=3", "auto+alq:bits=3", "qsgd:bits=4", "terngrad",
           "signef", "dgc:density=0.001", "auto+dgc:density=0.001", "dqsg:bits=4",
           "ndqsg:bits=4", "psq:bits=4", "bhq:bits=4", "laq:bits=4", "powersgd:rank=1",
           "powersgd:rank=2", "powersgd:rank=4"]


def worker(args):
    import torch
    import horovod.torch as hvd
    import hvdcomp
    from hvdcomp.auto import from_spec       # "auto+SPEC": Auto(SPEC); "rs+SPEC": reduce-scatter
    from hvdcomp.exchange import Exchange
    from hvdcomp.transport import HorovodAllreduce
    from hvdcomp.transport import make
    from shapes import bert_base, resnet50
    hvd.init()
    torch.set_num_threads(1)
    rank = hvd.rank()
    shapes = {"resnet50": resnet50, "bert_base": bert_base}[args.model]()
    g = torch.Generator().manual_seed(100 + rank)
    params = []
    for name, shape in shapes:
        p = torch.nn.Parameter(torch.zeros(shape))
        p.grad = torch.randn(shape, generator=g) * 1e-3
        params.append((name, p))
    rows = []
    specs = [m for m in _split_methods(args.methods)
             if m.split("+")[-1].split(":")[0] in hvdcomp.available()]
    got = {spec: ([], [], None, None) for spec in specs}
    for rnd in range(args.rounds):          # --rounds: the methods in turn, N times
        for spec in specs:
            times, stats, _, _ = got[spec]
            comp, collective = from_spec(spec)
            ex = Exchange(params, comp, make("mpi"), allreduce=HorovodAllreduce(hvd), seed=1,
                          collective=collective,
                          **({"fusion_bytes": args.fusion_bytes} if args.fusion_bytes else {}))
            plan = {}
            for e in ex.entries.values():
                plan[e.compressor.name] = plan.get(e.compressor.name, 0) + e.param.numel()
            for rep in range(args.reps + 1):
                hvd.allreduce(torch.zeros(1), name="barrier")          # start together
                t0 = time.perf_counter()
                ex.begin(rep)
                for name, _ in params:
                    ex.ready(name)
                _, st = ex.finish()
                dt = time.perf_counter() - t0
                if rep:                                                # rep 0 warms up
                    times.append(dt)
                    stats.append(st)
            cost = ex.auto.model.as_dict() if ex.auto is not None else None
            got[spec] = (times, stats, plan, cost)
            ex.close()              # free its buffers and the compressor's state (BERT: GBs)
            del ex
            gc.collect()
    for spec in specs:
        times, stats, plan, cost = got[spec]
        worst = hvd.allreduce(torch.tensor(times, dtype=torch.float64), op=hvd.Max,
                              name=f"t.{spec}")
        row = dict(method=spec, median_s=statistics.median(worst.tolist()),
                   min_s=min(worst.tolist()), max_s=max(worst.tolist()),
                   bytes_per_rank=stats[-1].bytes_sent, fp32_bytes=stats[-1].fp32_bytes,
                   encode_s=statistics.median(s.encode_s for s in stats),
                   comm_s=statistics.median(s.comm_s for s in stats),
                   decode_s=statistics.median(s.decode_s for s in stats),
                   elements_by_compressor=plan, reps=len(times), rounds=args.rounds)
        if cost is not None:
            row["cost_model"] = cost
        rows.append(row)
        if rank == 0:
            print(json.dumps(row), flush=True)
    if args.ddp_methods:
        # Horovod's background thread keeps cycling (a coordination round every cycle
        # time) until shutdown: measured on the 2-core machine it took 0.02-0.05 s of CPU
        # per second per rank, which a DDP job does not pay
        size = hvd.size()
        hvd.shutdown()
        rows += ddp_rows(args, shapes, rank, size)
    if rank == 0:
        with open(args.json, "w") as f:
            json.dump(rows, f)


class _Synthetic:
    """A module whose parameters have the benchmark's shapes and whose loss ``sum_p (p *
    G_p).sum()`` has this rank's synthetic gradient G_p (the Horovod rows' gradients)."""

    @staticmethod
    def build(shapes, rank):
        import torch

        class Synthetic(torch.nn.Module):
            def __init__(self):
                super().__init__()
                g = torch.Generator().manual_seed(100 + rank)
                self.grads = []
                for i, (_, shape) in enumerate(shapes):
                    self.register_parameter(f"p{i}", torch.nn.Parameter(torch.zeros(shape)))
                    self.grads.append(torch.randn(shape, generator=g) * 1e-3)

            def forward(self, x):
                return sum((p * g).sum() for p, g in zip(self.parameters(), self.grads)) * x

        return Synthetic()


def _powersgd_bytes(shapes, rank_r: int, min_rate: float = 2.0) -> int:
    """Bytes PowerSGD allreduces per step: P and Q (4 (n + m) r) for each tensor it
    compresses (n = shape[0], m = the rest; compressed when n m >= (n + m) r min_rate),
    the others in fp32 (its rule, torch.distributed.algorithms.ddp_comm_hooks)."""
    total = 0
    for _, shape in shapes:
        n = shape[0]
        m = 1
        for d in shape[1:]:
            m *= d
        r = min(n, m, rank_r)
        if len(shape) > 1 and n * m >= (n + m) * r * min_rate:
            total += 4 * (n + m) * r
        else:
            total += 4 * n * m
    return total


def ddp_rows(args, shapes, rank, size):
    """The DDP rows (module docstring): the slowest rank's time of one backward pass with
    each hook, median of --reps after warm-up steps."""
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
    from torch.nn.parallel import DistributedDataParallel as DDP
    import hvdcomp.ddp
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(args.ddp_port))
    dist.init_process_group("gloo", rank=rank, world_size=size)
    numel = sum(math.prod(s) for _, s in shapes)
    specs = _split_methods(args.ddp_methods)
    got = {spec: ([], [], None, None) for spec in specs}
    for rnd in range(args.rounds):          # --rounds: the methods in turn, N times
        for spec in specs:
            times, stats, nbytes, plan = got[spec]
            model = _Synthetic.build(shapes, rank)
            # PowerSGD in one bucket: with Gloo, the second all_reduce of each bucket is
            # issued from a completion callback, whose order across buckets differs between
            # ranks (Gloo then aborts: "collective mismatch"); one bucket has one order
            powersgd = spec.startswith("ddp:powersgd")
            ddp = DDP(model, bucket_cap_mb=1024) if powersgd else DDP(model)
            state, warm = None, 1
            if spec == "ddp:allreduce":
                nbytes = 4 * numel
            elif spec == "ddp:noop":
                ddp.register_comm_hook(None, _noop_hook)
                nbytes = 0
            elif spec == "ddp:fp16":
                ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
                nbytes = 2 * numel
            elif spec.startswith("ddp:powersgd:rank="):
                r = int(spec.split("=")[1])
                st = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=r,
                                        start_powerSGD_iter=2, use_error_feedback=True,
                                        warm_start=True)
                ddp.register_comm_hook(st, psgd.powerSGD_hook)
                nbytes, warm = _powersgd_bytes(shapes, r), 3   # 2 vanilla steps first
            elif spec.startswith("ddp+"):
                state = hvdcomp.ddp.HookState(ddp, spec[4:], seed=1)     # the spec string
                ddp.register_comm_hook(state, hvdcomp.ddp.hook)
            else:
                raise ValueError(f"unknown DDP method {spec!r}")
            x = torch.ones(())
            for rep in range(args.reps + warm):
                dist.barrier()
                t0 = time.perf_counter()
                ddp(x).backward()
                dt = time.perf_counter() - t0
                if rep >= warm:
                    times.append(dt)
                    if state is not None:
                        stats.append(state.last_stats)
                for p in model.parameters():
                    p.grad = None
            if state is not None:
                plan = _plan_elements(state)
                state.close()
            got[spec] = (times, stats, nbytes, plan)
            del ddp, model
            gc.collect()
    rows = []
    for spec in specs:
        times, stats, nbytes, plan = got[spec]
        worst = torch.tensor(times, dtype=torch.float64)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        worst = worst.tolist()
        row = dict(method=spec, median_s=statistics.median(worst), min_s=min(worst),
                   max_s=max(worst), fp32_bytes=4 * numel, reps=len(worst),
                   rounds=args.rounds)
        if stats:
            row.update(bytes_per_rank=stats[-1].bytes_sent,
                       encode_s=statistics.median(s.encode_s for s in stats),
                       comm_s=statistics.median(s.comm_s for s in stats),
                       decode_s=statistics.median(s.decode_s for s in stats),
                       elements_by_compressor=plan)
        else:
            row.update(bytes_per_rank=nbytes, encode_s=0.0, comm_s=0.0, decode_s=0.0)
        rows.append(row)
        if rank == 0:
            print(json.dumps(row), flush=True)
    dist.destroy_process_group()
    return rows


def _plan_elements(state):
    plan = {}
    for e in state.exchange.entries.values():
        plan[e.compressor.name] = plan.get(e.compressor.name, 0) + e.param.numel()
    return plan


def _noop_hook(state, bucket):
    import torch
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def _split_methods(text):
    """Methods are separated by ';' (or ',' when no method has a comma inside)."""
    return [m for m in (text.split(";") if ";" in text else text.split(",")) if m]


def driver(args):
    name = args.results or f"exchange_{args.model}"
    res_path = os.path.join(ROOT, "bench", "results", f"{name}.json")
    res = {"model": args.model, "ranks": 4, "results": {}, "runs": {}}
    if os.path.exists(res_path):          # runs at other rates are kept
        with open(res_path) as f:
            old = json.load(f)
        if "runs" in old:
            res = old
    out_rows = res["results"]
    for rate in args.rates.split(","):
        # (this run's own file: another checkout may be running the benchmark too)
        path = os.path.join("/tmp", f"hvdcomp-{name}-{rate}-{os.getpid()}.json")
        cmd = [os.path.join(ROOT, "launch", "netem"), rate, "--",
               os.path.join(ROOT, "launch", "run"), "-np", "4", sys.executable,
               os.path.abspath(__file__), "--worker", "--model", args.model,
               "--reps", str(args.reps), "--methods", args.methods, "--json", path,
               "--fusion-bytes", str(args.fusion_bytes), "--ddp-methods", args.ddp_methods,
               "--rounds", str(args.rounds)]
        print("+", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True, timeout=3600)
        with open(path) as f:
            fresh = json.load(f)
        stamp = time.strftime("%Y-%m-%d %H:%M")
        for r in fresh:
            r["measured"] = stamp
        # rows of this run replace the same methods' rows of earlier runs; others are kept
        kept = [r for r in out_rows.get(rate, []) if r["method"] not in {x["method"] for x in fresh}]
        out_rows[rate] = kept + fresh
        for r in fresh:
            print(f"{rate:8s} {r['method']:20s} {r['median_s']:8.3f} s "
                  f"[{r['min_s']:.3f}-{r['max_s']:.3f}]  {r['bytes_per_rank'] / 1e6:8.2f} MB  "
                  f"enc {r['encode_s']:.3f} comm {r['comm_s']:.3f} dec {r['decode_s']:.3f}",
                  flush=True)
        # measurement time -> the command that made the rows stamped with it
        res["runs"][stamp] = "python bench/exchange.py " + " ".join(sys.argv[1:])
        with open(res_path, "w") as f:
            json.dump(res, f, indent=1)
    with open(os.path.join(ROOT, "bench", "results", f"{name}.table.md"), "w") as f:
        f.write(render(res))
    plot(res, os.path.join(ROOT, "bench", "results", f"{name}.png"))


RATE_BITS = {"100mbit": 1e8, "1gbit": 1e9, "10gbit": 1e10}


def render(res) -> str:
    """The markdown table of a results file, fastest link first."""
    lines = ["| rate | method | time (s), median [min-max] | vs fp32 | vs fp16 | "
             "MB sent per rank | encode / comm / decode (s) | elements by compressor | "
             "measured |",
             "|---|---|---|---|---|---|---|---|---|"]
    for rate in sorted(res["results"], key=lambda r: -RATE_BITS.get(r, 0)):
        rows = res["results"][rate]
        base = {r["method"]: r["median_s"] for r in rows}
        for r in rows:
            vs32 = base["none"] / r["median_s"] if "none" in base else float("nan")
            vs16 = base["fp16"] / r["median_s"] if "fp16" in base else float("nan")
            plan = ", ".join(f"{k} {v / 1e6:.1f}M"
                             for k, v in sorted(r.get("elements_by_compressor", {}).items()))
            v32 = "-" if math.isnan(vs32) else f"{vs32:.1f}x"
            v16 = "-" if math.isnan(vs16) else f"{vs16:.1f}x"
            lines.append(f"| {rate} | {r['method']} | {r['median_s']:.2f} "
                         f"[{r['min_s']:.2f}-{r['max_s']:.2f}] | {v32} | {v16} | "
                         f"{r['bytes_per_rank'] / 1e6:.2f} | {r['encode_s']:.2f} / "
                         f"{r['comm_s']:.2f} / {r['decode_s']:.2f} | {plan} | "
                         f"{r.get('measured', '')} |")
    return "\n".join(lines) + "\n"


def plot(res, path) -> None:
    """Exchange time against link rate, one line per method (log-log)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    series = {}
    for rate, rows in res["results"].items():
        for r in rows:
            series.setdefault(r["method"], []).append((RATE_BITS[rate], r["median_s"]))
    fig, ax = plt.subplots(figsize=(8, 5.5))
    colors = plt.cm.tab20.colors
    markers = "osD^v<>ph*X"
    for i, (method, pts) in enumerate(series.items()):
        pts.sort()
        base = method in ("none", "fp16")
        ax.plot([p[0] / 1e9 for p in pts], [p[1] for p in pts], "--" if base else "-",
                marker=markers[i % len(markers)], color="black" if method == "none" else
                ("gray" if method == "fp16" else colors[i % len(colors)]),
                label=method, lw=2.4 if base else 1.3, ms=5)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("link rate (Gbit/s, shared by 4 ranks)")
    ax.set_ylabel("one gradient exchange (s, median)")
    ax.set_title(f"{res['model']}: gradient exchange, 4 ranks (bench/exchange.py)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def replot(model, name=""):
    """Redraw the table and the plot from the committed JSON (no measurement)."""
    path = os.path.join(ROOT, "bench", "results", name or f"exchange_{model}")
    with open(path + ".json") as f:
        res = json.load(f)
    with open(path + ".table.md", "w") as f:
        f.write(render(res))
    plot(res, path + ".png")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replot", action="store_true", help="redraw table and plot, run nothing")
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--model", default="resnet50", choices=["resnet50", "bert_base"])
    ap.add_argument("--rates", default="10gbit,1gbit,100mbit")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--json", default="")
    ap.add_argument("--results", default="",
                    help="name of the results files in bench/results (default "
                         "exchange_MODEL)")
    ap.add_argument("--ddp-methods", default="",
                    help="DDP rows after the Horovod rows, e.g. 'ddp:noop,ddp:allreduce,"
                         "ddp:fp16,ddp:powersgd:rank=4,ddp:powersgd:rank=1,ddp+alq:bits=3'")
    ap.add_argument("--ddp-port", type=int, default=29533,
                    help="torch.distributed's rendezvous port for the DDP rows")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run the list of methods N times in turn (each time --reps timed "
                         "steps after its warm-up), so that every row samples the same "
                         "stretches of a shared machine's load; a row's median is over "
                         "all N x reps")
    ap.add_argument("--fusion-bytes", type=int, default=0,
                    help="fusion bucket size (default: the optimizer's default)")
    args = ap.parse_args()
    if args.replot:
        replot(args.model, args.results)
    else:
        worker(args) if args.worker else driver(args)


if __name__ == "__main__":
    main()
