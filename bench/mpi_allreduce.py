"""Horovod's allreduce over Open MPI on emulated hosts: Open MPI's default algorithm against
the rules launch/run passes (the ring for messages of 1 MiB and more, launch/ompi-allreduce-rules).

    .venv/bin/python bench/mpi_allreduce.py                     # 4 x 100mbit and 4 x 1gbit
    .venv/bin/python bench/mpi_allreduce.py --links 8x1gbit --reps 9

For each link (launch/cluster: one namespace per host behind its own shaped link) and each
setting, one job of one rank per host times ``hvd.allreduce`` (op Sum) of float32 messages of
4 KB, 64 KB and 1 MB, the real task's CNN gradient in fp16 (6.5 MB) and fp32 (13.1 MB): the
median over --reps after one warm-up, each preceded by a one-element allreduce so that the
ranks start together; rank 0's times.  The ideal ring moves 2 (N - 1) / N of the message
through each host's link: its time at the link's rate is printed beside them.  The settings:
``default`` (launch/run with HVDCOMP_MPIRUN_ARGS="--mca coll_tuned_use_dynamic_rules 0",
which replaces the rules) and ``rules`` (launch/run as it is).  Appends to
bench/results/mpi_allreduce.jsonl (one line per link, setting and size) and rewrites
bench/results/mpi_allreduce.md.
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
OUT = os.path.join(ROOT, "bench", "results", "mpi_allreduce")
CNN_ELEMENTS = 3274634          # the real task's CNN (bench/real_task.py): 13.1 MB in fp32
SIZES = [("4 KB", 1024, "float32"), ("64 KB", 16384, "float32"), ("1 MB", 262144, "float32"),
         ("CNN fp16 6.5 MB", CNN_ELEMENTS, "float16"),
         ("CNN fp32 13.1 MB", CNN_ELEMENTS, "float32")]
SETTINGS = {"default": "--mca coll_tuned_use_dynamic_rules 0", "rules": ""}
RATES = {"100mbit": 100e6, "1gbit": 1e9, "10gbit": 10e9}


def worker(reps: int) -> None:
    import torch
    import horovod.torch as hvd
    hvd.init()
    rows = []
    for label, n, dtype in SIZES:
        t = torch.ones(n, dtype=getattr(torch, dtype))
        times = []
        for i in range(reps + 1):
            hvd.allreduce(torch.zeros(1), name=f"sync.{label}.{i}")
            t0 = time.perf_counter()
            hvd.allreduce(t, name=f"{label}.{i}", op=hvd.Sum)
            times.append(time.perf_counter() - t0)
        rows.append(dict(size=label, bytes=n * t.element_size(),
                         median_s=statistics.median(times[1:]), min_s=min(times[1:]),
                         max_s=max(times[1:])))
    if hvd.rank() == 0:
        print("RESULT " + json.dumps(rows), flush=True)


def run(link: str, setting: str, reps: int) -> list:
    hosts, rate = link.split("x")
    cmd = [os.path.join(ROOT, "launch", "cluster"), hosts, rate, "--",
           os.path.join(ROOT, "launch", "run"), "-np", hosts, sys.executable,
           os.path.abspath(__file__), "--worker", "--reps", str(reps)]
    env = dict(os.environ, HVDCOMP_MPIRUN_ARGS=SETTINGS[setting])
    load = round(os.getloadavg()[0], 2)
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    lines = [l for l in p.stdout.splitlines() if l.startswith("RESULT ")]
    if p.returncode != 0 or not lines:
        sys.exit(f"mpi_allreduce.py: {link} {setting} failed:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    date = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())
    return [dict(r, link=link, setting=setting, reps=reps, load=load, date=date,
                 command="python bench/mpi_allreduce.py " + " ".join(sys.argv[1:]))
            for r in json.loads(lines[-1][len("RESULT "):])]


def ideal_s(link: str, nbytes: int) -> float:
    hosts, rate = link.split("x")
    n = int(hosts)
    return 2 * (n - 1) / n * nbytes * 8 / RATES[rate]


def report(rows: list) -> str:
    latest = {}
    for r in rows:
        latest[r["link"], r["setting"], r["size"]] = r
    links = list(dict.fromkeys(r["link"] for r in rows))
    out = ["# Horovod's allreduce over Open MPI: the default algorithm against launch/run's rules",
           "", "Command: `" + rows[-1]["command"] + "` (bench/mpi_allreduce.py's docstring says "
           "what is timed). Rank 0's median of each job's repetitions, seconds; ratio = "
           "default / rules; ideal = a ring at the link's rate (2 (N - 1) / N of the message "
           "through each link).  Raw rows: mpi_allreduce.jsonl.", ""]
    for link in links:
        rr = [latest[k] for k in latest if k[0] == link]
        when = sorted({r["date"] for r in rr})
        loads = sorted({r["load"] for r in rr})
        out += [f"## {link}", "",
                f"Measured {when[0]} to {when[-1]}, 1-minute load {loads[0]}-{loads[-1]} "
                f"(2 shared cores).", "",
                "| message | default (s) | rules (s) | default / rules | ideal ring (s) |",
                "|---|---|---|---|---|"]
        for label, _, _ in SIZES:
            d, r = latest.get((link, "default", label)), latest.get((link, "rules", label))
            if not d or not r:
                continue
            out.append(f"| {label} | {d['median_s']:.4f} | {r['median_s']:.4f} | "
                       f"{d['median_s'] / r['median_s']:.2f}x | {ideal_s(link, d['bytes']):.3g} |")
        out.append("")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--links", default="4x100mbit,4x1gbit", help="HOSTSxRATE,...")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    if args.worker:
        worker(args.reps)
        return
    new = []
    for link in args.links.split(","):
        for setting in SETTINGS:            # side by side: both settings of a link in turn
            rows = run(link, setting, args.reps)
            new += rows
            with open(OUT + ".jsonl", "a") as f:
                for r in rows:
                    f.write(json.dumps(r) + "\n")
            print(link, setting, " | ".join(f"{r['size']} {r['median_s']:.4f}" for r in rows),
                  flush=True)
    allrows = [json.loads(l) for l in open(OUT + ".jsonl") if l.strip()]
    with open(OUT + ".md", "w") as f:
        f.write(report(allrows))
    print("wrote", OUT + ".md")


if __name__ == "__main__":
    main()
