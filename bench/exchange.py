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
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

METHODS = ["none", "fp16", "alq:bits=3", "qsgd:bits=4", "terngrad", "signef",
           "dgc:density=0.001", "dqsg:bits=4", "ndqsg:bits=4", "psq:bits=4", "bhq:bits=4",
           "laq:bits=4"]


def worker(args):
    import torch
    import horovod.torch as hvd
    import hvdcomp
    from hvdcomp.torch.exchange import Exchange
    from hvdcomp.transport import make
    from shapes import bert_base, resnet50
    hvd.init()
    torch.set_num_threads(1)
    rank, size = hvd.rank(), hvd.size()
    shapes = {"resnet50": resnet50, "bert_base": bert_base}[args.model]()
    g = torch.Generator().manual_seed(100 + rank)
    params = []
    for name, shape in shapes:
        p = torch.nn.Parameter(torch.zeros(shape))
        p.grad = torch.randn(shape, generator=g) * 1e-3
        params.append((name, p))
    rows = []
    for spec in args.methods.split(","):
        if spec.split(":")[0] not in hvdcomp.available():
            continue
        ex = Exchange(params, hvdcomp.get(spec), make("mpi"), hvd=hvd, seed=1)
        times, stats = [], []
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
        worst = hvd.allreduce(torch.tensor(times, dtype=torch.float64), op=hvd.Max,
                              name=f"t.{spec}")
        row = dict(method=spec, median_s=statistics.median(worst.tolist()),
                   min_s=min(worst.tolist()), max_s=max(worst.tolist()),
                   bytes_per_rank=stats[-1].bytes_sent, fp32_bytes=stats[-1].fp32_bytes,
                   encode_s=statistics.median(s.encode_s for s in stats),
                   comm_s=statistics.median(s.comm_s for s in stats),
                   decode_s=statistics.median(s.decode_s for s in stats))
        rows.append(row)
        if rank == 0:
            print(json.dumps(row), flush=True)
    if rank == 0:
        with open(args.json, "w") as f:
            json.dump(rows, f)


def driver(args):
    out_rows = {}
    for rate in args.rates.split(","):
        path = os.path.join("/tmp", f"hvdcomp-exchange-{args.model}-{rate}.json")
        cmd = [os.path.join(ROOT, "launch", "netem"), rate, "--",
               os.path.join(ROOT, "launch", "run"), "-np", "4", sys.executable,
               os.path.abspath(__file__), "--worker", "--model", args.model,
               "--reps", str(args.reps), "--methods", args.methods, "--json", path]
        print("+", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True, timeout=3600)
        with open(path) as f:
            out_rows[rate] = json.load(f)
        for r in out_rows[rate]:
            print(f"{rate:8s} {r['method']:20s} {r['median_s']:8.3f} s "
                  f"[{r['min_s']:.3f}-{r['max_s']:.3f}]  {r['bytes_per_rank'] / 1e6:8.2f} MB  "
                  f"enc {r['encode_s']:.3f} comm {r['comm_s']:.3f} dec {r['decode_s']:.3f}",
                  flush=True)
    res = {"command": "python bench/exchange.py " + " ".join(sys.argv[1:]),
           "date": time.strftime("%Y-%m-%d"), "model": args.model, "ranks": 4,
           "results": out_rows}
    with open(os.path.join(ROOT, "bench", "results", f"exchange_{args.model}.json"), "w") as f:
        json.dump(res, f, indent=1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--model", default="resnet50", choices=["resnet50", "bert_base"])
    ap.add_argument("--rates", default="10gbit,1gbit,100mbit")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    worker(args) if args.worker else driver(args)


if __name__ == "__main__":
    main()
