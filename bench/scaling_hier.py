"""Several ranks per host: the flat exchange against the hierarchical one (issue 23), measured
on emulated hosts of K ranks each, and the scaling model refitted with them.

    nice -n 5 .venv/bin/python bench/scaling_hier.py --hosts 2,4 --ranks-per-host 2 --rates 1gbit
    .venv/bin/python bench/scaling_hier.py --fit        # refit the model, rewrite the .md
                                                        # (on --cells, default FIT_CELLS)

Each cell (model, hosts, ranks per host, rate) runs `launch/cluster --ranks-per-host K HOSTS
RATE -- launch/run -np HOSTS*K python bench/scaling_hier.py --worker ...`: each host a
network namespace behind its own link of RATE both ways; the K ranks of a host share it
(and talk to each other over TCP inside the namespace, which no link limits).  Methods:
fp32 and fp16 through Horovod's allreduce (Horovod's CPU allreduce has no hierarchical
variant: it is MPI's allreduce, whose ring crosses each host's link once per direction);
ALQ 3 bits and DGC 0.1 % flat (over the allgather, over the reduce-scatter) and
hierarchical ("host+": float32 sums inside the host, compressed across hosts over the
allgather or the reduce-scatter, hvdcomp/exchange/hier.py); Auto(ALQ 3 bits) with
hierarchy="auto" (it chooses flat or hierarchical: hvdcomp/exchange/hier_choice.py).  Each
rank times a warm-up and --reps exchanges of synthetic gradients of the model's shapes
(bench/shapes.py), as bench/scaling.py does.  Per method:

* time per exchange: the slowest rank's, median over the reps (min, max);
* NIC bytes per host: the host's interface counters (/proc/net/dev of its namespace, all
  but loopback: what crossed its shaped link, TCP/IP headers included), sent and received,
  per exchange, mean over hosts (each rank reads its host's counters; the host's figure is
  the largest reading among its ranks);
* the encode / communicate / decode split (StepStats, seconds summed over buckets, mean
  over ranks); the bytes a rank sent to its host's other ranks (StepStats.host_bytes);
* Auto's decision (its HierChoice: reason, predicted seconds both ways).

Rank 0 appends each method's row to bench/results/scaling_hier.json as it comes (a JSON
list, rewritten per row), with the command, the cell and the load average (1 min) before
and after.  This machine has 2 cores shared with other jobs: with 4 to 8 ranks the
exchange is CPU-bound, so compare methods by their ratios within one cell (measured side by
side, one run), not across machines.  The model: bench/scaling_model.py (ranks per host),
refitted on bench/results/scaling.json and these cells; bench/results/scaling_hier.md.
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

from scaling import RecordingAllreduce, _recording, netdev  # noqa: E402

METHODS = ["none", "fp16", "ag+alq:bits=3", "rs+alq:bits=3", "host+ag+alq:bits=3",
           "host+rs+alq:bits=3", "ag+dgc:density=0.001", "rs+dgc:density=0.001",
           "host+ag+dgc:density=0.001", "host+rs+dgc:density=0.001", "auto+alq:bits=3"]
RESULTS = os.path.join(ROOT, "bench", "results", "scaling_hier")


def worker(args):
    import torch
    import horovod.torch as hvd
    from hvdcomp.auto import from_spec
    from hvdcomp.exchange import Exchange
    from hvdcomp.exchange.driver import split_hierarchy
    from hvdcomp.transport import HorovodAllreduce, MPITransport
    from shapes import bert_base, resnet50, synthetic_params
    hvd.init()
    torch.set_num_threads(1)
    rank, size = hvd.rank(), hvd.size()
    shapes = {"resnet50": resnet50, "bert_base": bert_base}[args.model]()
    params = synthetic_params(shapes, rank)

    def barrier(tag):
        hvd.allreduce(torch.zeros(1), name=f"barrier.{tag}")

    for spec in args.methods.split(";"):
        hier, rest = split_hierarchy(spec)
        auto = rest.lower().startswith("auto+")
        hierarchy = hier or ("auto" if auto else "flat")
        comp, collective = from_spec(rest)
        tp = _recording(MPITransport)()
        ar = RecordingAllreduce(HorovodAllreduce(hvd))
        load0 = os.getloadavg()[0]
        t0 = time.perf_counter()
        ex = Exchange(params, comp, tp, allreduce=ar, seed=1, collective=collective,
                      hierarchy=hierarchy)
        build_s = time.perf_counter() - t0
        reps = []
        for rep in range(args.reps + 1):                 # rep 0 warms up
            barrier(f"{spec}.{rep}")
            rx0, tx0 = netdev()
            t0 = time.perf_counter()
            ex.begin(rep)
            for name, _ in params:
                ex.ready(name)
            _, st = ex.finish()
            dt = time.perf_counter() - t0
            rx1, tx1 = netdev()
            if rep:
                reps.append(dict(s=dt, tx=tx1 - tx0, rx=rx1 - rx0, encode=st.encode_s,
                                 comm=st.comm_s, decode=st.decode_s, reduce=st.reduce_s,
                                 sent=st.bytes_sent, recv=st.recv_bytes,
                                 host_bytes=st.host_bytes, fp32=st.fp32_bytes))
        elements = {}
        for e in ex.entries.values():
            k = f"{e.compressor.name} over {e.path}"
            elements[k] = elements.get(k, 0) + e.param.numel()
        mine = dict(reps=reps, build_s=build_s, host=hvd.cross_rank(),
                    local=hvd.local_rank())
        everyone = hvd.allgather_object(mine, name=f"gather.{spec}")
        if rank == 0:
            row = dict(method=spec, model=args.model, hosts=args.hosts_n,
                       ranks_per_host=size // args.hosts_n, rate=args.rate,
                       hierarchical=ex.hierarchy is not None, ranks=everyone,
                       elements=elements, buckets=len(ex.buckets),
                       measured=time.strftime("%Y-%m-%d %H:%M"), command=args.command,
                       load_before=load0, load_after=os.getloadavg()[0])
            if ex.auto is not None and ex.auto.model is not None:
                row["cost_model"] = ex.auto.model.as_dict()
            if getattr(ex, "hierarchy_choice", None) is not None:
                row["hierarchy_choice"] = ex.hierarchy_choice.as_dict()
            append(row)
            s = summarize(row)
            print(f"{s['method']:28s} {s['median_s']:7.3f} s  NIC tx/host "
                  f"{s['nic_tx'] / 1e6:8.2f} MB  enc {s['encode']:.3f} comm {s['comm']:.3f} "
                  f"dec {s['decode']:.3f}  hier={row['hierarchical']}", flush=True)
        ex.close()
        del ex
        gc.collect()


def use_results(stem: str) -> None:
    """Keep this run's rows in bench/results/<stem>.json (and its table in <stem>.md)."""
    global RESULTS
    RESULTS = os.path.join(ROOT, "bench", "results", stem)


def load(stem: str = "") -> list:
    """The rows of this run (RESULTS.json), or of bench/results/<stem>.json."""
    path = (os.path.join(ROOT, "bench", "results", stem) if stem else RESULTS) + ".json"
    if os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    return []


def append(row: dict) -> None:
    rows = load()
    rows.append(row)
    with open(RESULTS + ".json", "w") as f:
        json.dump(rows, f)


def _med(xs):
    return statistics.median(xs)


def summarize(row: dict) -> dict:
    """One method's figures (module docstring) from every rank's reps."""
    ranks = row["ranks"]
    nreps = len(ranks[0]["reps"])
    times = [max(r["reps"][i]["s"] for r in ranks) for i in range(nreps)]

    def per_rank(key):
        return [_med([x[key] for x in r["reps"]]) for r in ranks]
    out = {k: row[k] for k in ("method", "model", "hosts", "ranks_per_host", "rate",
                               "hierarchical", "elements", "measured")}
    out.update(median_s=_med(times), min_s=min(times), max_s=max(times))
    for key in ("encode", "comm", "decode", "reduce", "sent", "recv", "host_bytes"):
        out[key] = statistics.mean(per_rank(key))
    for key in ("tx", "rx"):
        v = per_rank(key)
        hosts = sorted({r["host"] for r in ranks})
        out["nic_" + key] = statistics.mean(
            max(x for x, r in zip(v, ranks) if r["host"] == h) for h in hosts)
    out["fp32"] = ranks[0]["reps"][0]["fp32"]
    out["choice"] = row.get("hierarchy_choice")
    out["command"] = row.get("command", "")
    out["load"] = (row.get("load_before"), row.get("load_after"))
    return out


def driver(args):
    for model in args.models.split(","):
        for k in map(int, args.ranks_per_host.split(",")):
            for hosts in map(int, args.hosts.split(",")):
                for rate in args.rates.split(","):
                    cmd_line = (f"nice -n 5 python bench/scaling_hier.py --models {model} "
                                f"--hosts {hosts} --ranks-per-host {k} --rates {rate} "
                                f"--reps {args.reps}")
                    cmd = [os.path.join(ROOT, "launch", "cluster"), "--ranks-per-host", str(k),
                           str(hosts), rate, "--", os.path.join(ROOT, "launch", "run"),
                           "-np", str(hosts * k), sys.executable, os.path.abspath(__file__),
                           "--worker", "--model", model, "--reps", str(args.reps),
                           "--methods", args.methods, "--hosts-n", str(hosts),
                           "--rate", rate, "--command", cmd_line,
                           "--results", os.path.basename(RESULTS)]
                    print("+", " ".join(cmd), flush=True)
                    subprocess.run(cmd, check=True, timeout=3600,
                                   env=dict(os.environ, PYTHONPATH=ROOT))
    if os.path.basename(RESULTS) == "scaling_hier":
        report()
    else:
        table()


def table():
    """A run kept apart (--results): its cells, one table each, with the commands."""
    rows = [summarize(r) for r in load()]
    out = [f"# {os.path.basename(RESULTS)}: flat against hierarchical, one run per cell",
           "", "Rows: bench/scaling_hier.py (module docstring says what each column is); "
           "ratios hold within a cell (measured side by side), not across machines.", ""]
    cells = {}
    for r in rows:
        cells.setdefault((r["model"], r["hosts"], r["ranks_per_host"], r["rate"]), []).append(r)
    for (model, hosts, k, rate), rs in cells.items():
        out += [f"## {model}, {hosts} hosts x {k} ranks, {rate} per host", "",
                "    " + rs[0]["command"] + f"  # {rs[0]['measured']}", "",
                "| method | path | time s (min-max) | NIC tx MB per host | NIC rx MB | in-host MB "
                "per rank | encode s | comm s | decode s | load before / after |",
                "|---|---|---|---|---|---|---|---|---|---|"]
        for r in rs:
            out.append(
                f"| {r['method']} | {'hierarchical' if r['hierarchical'] else 'flat'} | "
                f"{r['median_s']:.3f} ({r['min_s']:.3f}-{r['max_s']:.3f}) | "
                f"{r['nic_tx'] / 1e6:.2f} | {r['nic_rx'] / 1e6:.2f} | "
                f"{r['host_bytes'] / 1e6:.2f} | {r['encode']:.3f} | {r['comm']:.3f} | "
                f"{r['decode']:.3f} | {r['load'][0]:.1f} / {r['load'][1]:.1f} |")
        for r in rs:
            if r.get("choice"):
                out.append(f"\n{r['method']}: {r['choice'].get('reason', r['choice'])}")
        out.append("")
    with open(RESULTS + ".md", "w") as f:
        f.write("\n".join(out) + "\n")


#: Where the hand-written part of scaling_hier.md ends: report() keeps what is above it.
MARK = "<!-- above: written by hand; below: bench/scaling_hier.py --fit rewrites it -->"


#: The runs the model is fitted on (bench/results/<stem>.json): the cells measured on the
#: current code (after the in-host stages carry raw float32, 2026-12-03; 2 and 4 ranks per host).
FIT_CELLS = ("scaling_hier_1203", "scaling_hier_recheck_1203", "scaling_hier_4rph")


def report(cells=FIT_CELLS):
    """Rewrite the model's part of RESULTS.md (the cells, the targets, the fit), below
    MARK; what is above MARK (the current numbers and re-checks, written by hand) stays.
    The model is fitted on the rows of ``cells`` (stems in bench/results) and
    bench/results/scaling.json."""
    from scaling_model import render_hier
    text = render_hier([summarize(r) for stem in cells for r in load(stem)])
    old = open(RESULTS + ".md").read() if os.path.exists(RESULTS + ".md") else ""
    if MARK in old:
        _, body = text.split("\n", 1)
        text = (old[:old.index(MARK) + len(MARK)] + "\n\n## The cells the model is fitted "
                f"on ({', '.join(f'{c}.json' for c in cells)}) and the model\n" + body)
    with open(RESULTS + ".md", "w") as f:
        f.write(text)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--fit", action="store_true", help="refit and rewrite, measure nothing")
    ap.add_argument("--models", default="resnet50")
    ap.add_argument("--model", default="resnet50", choices=["resnet50", "bert_base"])
    ap.add_argument("--hosts", default="2,4")
    ap.add_argument("--ranks-per-host", default="2")
    ap.add_argument("--rates", default="1gbit")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--methods", default=";".join(METHODS))
    # (the worker's: the cell it measures, and the driver's command for the record)
    ap.add_argument("--hosts-n", type=int, default=0)
    ap.add_argument("--rate", default="")
    ap.add_argument("--command", default="")
    ap.add_argument("--results", default="scaling_hier",
                    help="keep the rows in bench/results/RESULTS.json (another name: a run "
                         "kept apart from the fitted cells, with its own table)")
    ap.add_argument("--cells", default=",".join(FIT_CELLS),
                    help="--fit: the runs (bench/results/<stem>.json, comma-separated) to "
                         "fit the model on")
    args = ap.parse_args()
    use_results(args.results)
    if args.worker:
        worker(args)
    elif args.fit:
        report(tuple(args.cells.split(",")))
    else:
        driver(args)


if __name__ == "__main__":
    main()
