"""DGC at 0.1 % density with warm-up against no compression, on 4 ranks, real bytes.

    .venv/bin/python bench/dgc.py [--ranks 4] [--epochs 12] [--out bench/results/dgc]

Every run is a real data-parallel job started with ``launch/run -np RANKS`` (same seeds,
same data shards, SGD lr 0.1 with cosine decay, momentum 0.9, batch 32 per rank):

* the main job, ``examples/train_mnist.py`` (FC-300-100 on the 5,000 MNIST digits), with
  ``--compression none``, DGC (density 0.001 after the paper's warm-up: 25 %, 6.25 %,
  1.5625 %, 0.39 % in epochs 1-4), DGC without warm-up, and plain top-k 0.1 % with error
  feedback (the wrapped optimizer's momentum on the averaged sparse gradient);
* a small convolutional net (bench/common.py SmallCNN) in a copy of that training loop
  inside this script (``--worker``), with none and DGC;
* the main job again with SGD weight decay ``--weight-decay`` (default 5e-4), none and DGC
  with warm-up: DGC folds the weight decay into each rank's local gradient before momentum
  correction and selection, as the paper's reference code does.

Lin et al. (ICLR 2018, arXiv 1712.01887) also warm the learning rate up and train for many
more steps; this job is 12 short epochs (384 steps), no learning-rate warm-up.

Reported per run: final and best test accuracy (1,000 test digits), the compression ratio
measured on the wire (fp32 bytes / bytes a rank sent, headers included; uncompressed biases
and small layers included, as the drop-in routes them: 1-D and < 1,024-element tensors go
dense), both over the last epoch (after warm-up) and over the whole run, and the ratio of the
compressed layers alone (last epoch, the dense tensors' 4 bytes per element subtracted from
the measured bytes).  Writes <out>.json and <out>.md.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TRAIN = os.path.join(ROOT, "examples", "train_mnist.py")
RUN = os.path.join(ROOT, "launch", "run")
N_TRAIN, BATCH = 4000, 32


def steps_per_epoch(ranks: int) -> int:
    return math.ceil((N_TRAIN // ranks) / BATCH)


def dgc_spec(ranks: int, warmup: bool = True) -> str:
    s = "dgc:density=0.001"
    return s + (f",warmup_epochs=4,steps_per_epoch={steps_per_epoch(ranks)}" if warmup else "")


# --------------------------------------------------------------------------------------------
# worker: the main job's loop on another model (run under launch/run)
# --------------------------------------------------------------------------------------------

def worker(args) -> None:
    import torch
    import torch.nn.functional as F
    sys.path.insert(0, HERE)
    from common import SmallCNN, load_digits      # noqa: E402

    import hvdcomp.torch as hvd

    t_start = time.time()
    hvd.init()
    torch.set_num_threads(1)
    rank, size = hvd.rank(), hvd.size()
    torch.manual_seed(args.seed)
    x_tr, y_tr, x_te, y_te = load_digits(args.seed)
    model = SmallCNN()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                   compression=args.compression, seed=args.seed)
    spe = (len(x_tr) // size + BATCH - 1) // BATCH
    total = args.epochs * spe
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda t: 0.5 * (1 + math.cos(math.pi * min(t, total) / total)))
    history = []
    for epoch in range(1, args.epochs + 1):
        model.train()
        g = torch.Generator().manual_seed(args.seed * 1000 + epoch)
        perm = torch.randperm(len(x_tr), generator=g)[rank::size]
        sent = fp32 = 0
        for idx in perm.split(BATCH):
            opt.zero_grad()
            F.cross_entropy(model(x_tr[idx]), y_tr[idx]).backward()
            opt.step()
            sched.step()
            sent += opt.last_stats.bytes_sent
            fp32 += opt.last_stats.fp32_bytes
        model.eval()
        with torch.no_grad():
            acc = (model(x_te).argmax(1) == y_te).float().mean().item() * 100
        per_rank = hvd.allgather(torch.tensor([sent], dtype=torch.float64), name=f"b.{epoch}")
        if rank == 0:
            hi = per_rank.max().item()
            history.append(dict(epoch=epoch, test_acc=acc, bytes_per_rank=hi, fp32_bytes=fp32,
                                ratio=fp32 / hi, seconds=time.time() - t_start))
            print(f"epoch {epoch:2d}  test acc {acc:5.2f} %  ratio {fp32 / hi:7.2f}x  "
                  f"[{time.time() - t_start:5.1f} s]", flush=True)
    if rank == 0:
        with open(args.json, "w") as f:
            json.dump({"compression": opt.compression.spec(), "ranks": size,
                       "args": vars(args), "epochs": history}, f, indent=1)


# --------------------------------------------------------------------------------------------
# driver
# --------------------------------------------------------------------------------------------

def dense_numel(model_name: str) -> tuple:
    """(elements the drop-in sends dense, all elements) for the model: 1-D tensors and
    tensors under 1,024 elements (the default routing)."""
    sys.path.insert(0, HERE)
    from common import FC300100, SmallCNN
    m = FC300100() if model_name == "FC-300-100" else SmallCNN()
    dense = sum(p.numel() for p in m.parameters() if p.dim() <= 1 or p.numel() < 1024)
    return dense, sum(p.numel() for p in m.parameters())


def run_job(model_name, spec, args, tmp, wd=0.0) -> dict:
    out = os.path.join(tmp, f"{len(os.listdir(tmp))}.json")
    if model_name == "FC-300-100":
        cmd = [RUN, "-np", str(args.ranks), sys.executable, TRAIN, "--compression", spec,
               "--epochs", str(args.epochs), "--seed", str(args.seed), "--no-progress"]
        cmd += (["--weight-decay", str(wd)] if wd else []) + ["--json", out]
    else:
        cmd = [RUN, "-np", str(args.ranks), sys.executable, os.path.abspath(__file__),
               "--worker", "--compression", spec, "--epochs", str(args.epochs),
               "--seed", str(args.seed), "--lr", str(args.lr), "--json", out]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    t0 = time.time()
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.time() - t0
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    with open(out) as f:
        res = json.load(f)
    ep = res["epochs"]
    last = ep[-1]
    dense, total = dense_numel(model_name)
    spe = steps_per_epoch(args.ranks)
    # the last epoch's bytes per step, less the dense tensors (4 bytes per element each step)
    sparse_bytes = last["bytes_per_rank"] / spe - 4 * dense
    row = dict(model=model_name, compression=res["compression"], spec=spec, weight_decay=wd,
               final_acc=last["test_acc"], best_acc=max(e["test_acc"] for e in ep),
               ratio_last_epoch=last["ratio"],
               ratio_run=sum(e["fp32_bytes"] for e in ep) / sum(e["bytes_per_rank"] for e in ep),
               ratio_compressed_layers=(4 * (total - dense) / sparse_bytes
                                        if sparse_bytes > 0 and spec != "none" else None),
               bytes_per_step_last_epoch=last["bytes_per_rank"] / spe,
               acc_per_epoch=[e["test_acc"] for e in ep], wall_s=wall,
               command=" ".join(["launch/run"] + cmd[1:3] + [".venv/bin/python"]
                                + [os.path.relpath(c, ROOT) if c.startswith(ROOT) else c
                                   for c in cmd[4:-2]] + ["--json", "OUT.json"]))
    print(f"{model_name:10s} {spec:58s} wd {wd:g} acc {row['final_acc']:5.2f} % (best "
          f"{row['best_acc']:5.2f})  ratio {row['ratio_last_epoch']:7.2f}x last epoch, "
          f"{row['ratio_run']:6.2f}x run  [{wall:.0f} s]", flush=True)
    return row


def markdown(res) -> str:
    lines = [
        "# DGC at 0.1 % density: accuracy and bytes on the wire",
        "",
        f"Command: `{res['command']}`  ",
        f"Machine: {res['machine']}; {res['date']}; total {res['seconds']:.0f} s.",
        "",
        f"{res['ranks']} ranks (launch/run), same seeds and shards; SGD lr 0.1 (cosine), "
        f"momentum 0.9, batch 32 per rank, {res['epochs']} epochs of "
        f"{res['steps_per_epoch']} steps; 4,000 train / 1,000 test MNIST digits. "
        "Ratio = fp32 bytes / bytes a rank sent (whole wire messages with headers, plus the "
        "dense tensors the drop-in sends uncompressed: 1-D and < 1,024 elements). "
        "'Compressed layers' subtracts the dense tensors' 4 bytes per element from the "
        "measured last-epoch bytes. DGC warm-up: density 25 %, 6.25 %, 1.5625 %, 0.39 % in "
        "epochs 1-4, then 0.1 %.",
        "",
        "| model | compression | weight decay | final acc % | best acc % | ratio (last epoch) "
        "| ratio (run) | compressed layers | bytes/step | wall s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in res["runs"]:
        cl = f"{r['ratio_compressed_layers']:.0f}x" if r["ratio_compressed_layers"] else "-"
        lines.append(f"| {r['model']} | `{r['spec']}` | {r['weight_decay']:g} | "
                     f"{r['final_acc']:.2f} | "
                     f"{r['best_acc']:.2f} | {r['ratio_last_epoch']:.1f}x | "
                     f"{r['ratio_run']:.1f}x | {cl} | {r['bytes_per_step_last_epoch']:.0f} | "
                     f"{r['wall_s']:.0f} |")
    lines += ["", "Summary (final test accuracy, DGC with warm-up against none; ratios measured "
              "on the wire over the last epoch):", ""]
    for model, wd in dict.fromkeys((r["model"], r["weight_decay"]) for r in res["runs"]):
        rows = {r["spec"]: r for r in res["runs"]
                if r["model"] == model and r["weight_decay"] == wd}
        base = rows.get("none")
        dgc = next((r for s, r in rows.items() if s.startswith("dgc") and "warmup" in s), None)
        if base and dgc:
            lines.append(f"* {model}{f', weight decay {wd:g}' if wd else ''}: "
                         f"{dgc['final_acc']:.2f} % vs {base['final_acc']:.2f} % "
                         f"({dgc['final_acc'] - base['final_acc']:+.2f} points); "
                         f"{dgc['ratio_last_epoch']:.0f}x for the whole model, "
                         f"{dgc['ratio_compressed_layers']:.0f}x for the compressed layers.")
    lines += ["", "Test accuracy per epoch:", "",
              "| model | compression | weight decay | "
              + " | ".join(str(i + 1) for i in range(res["epochs"]))
              + " |", "|---|---|---|" + "---|" * res["epochs"]]
    for r in res["runs"]:
        lines.append(f"| {r['model']} | `{r['spec']}` | {r['weight_decay']:g} | "
                     + " | ".join(f"{a:.1f}" for a in r["acc_per_epoch"]) + " |")
    lines += ["", "Per-run commands (OUT.json: a temporary file):", ""]
    lines += [f"    {r['command']}" for r in res["runs"]]
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=12)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lr", type=float, default=0.1, help="SmallCNN runs (main job: 0.1)")
    ap.add_argument("--weight-decay", type=float, default=5e-4,
                    help="weight decay of the last two runs (main job, none and DGC)")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "dgc"))
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--compression", default="none", help=argparse.SUPPRESS)
    ap.add_argument("--json", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    t0 = time.time()
    jobs = [("FC-300-100", "none"), ("FC-300-100", dgc_spec(args.ranks)),
            ("FC-300-100", dgc_spec(args.ranks, warmup=False)),
            ("FC-300-100", "topk:density=0.001"),
            ("SmallCNN", "none"), ("SmallCNN", dgc_spec(args.ranks)),
            ("FC-300-100", "none", args.weight_decay),
            ("FC-300-100", dgc_spec(args.ranks), args.weight_decay)]
    with tempfile.TemporaryDirectory() as tmp:
        runs = [run_job(*job[:2], args, tmp, *job[2:]) for job in jobs]
    res = {"command": " ".join([".venv/bin/python", "bench/dgc.py"] + sys.argv[1:]),
           "machine": f"{platform.machine()} {os.cpu_count()} cores, Python "
                      f"{platform.python_version()}",
           "date": time.strftime("%Y-%m-%d"), "ranks": args.ranks, "epochs": args.epochs,
           "steps_per_epoch": steps_per_epoch(args.ranks), "runs": runs,
           "seconds": time.time() - t0}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump(res, f, indent=1)
    with open(args.out + ".md", "w") as f:
        f.write(markdown(res))
    print(f"wrote {args.out}.json and {args.out}.md in {res['seconds']:.0f} s")


if __name__ == "__main__":
    main()
