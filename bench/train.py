"""The main job over a slow link: wall-clock time to accuracy with and without compression.

    .venv/bin/python bench/train.py --rate 100mbit

For each method it runs `launch/netem RATE -- launch/run -np 4 python examples/train_mnist.py
--compression METHOD` (the README's main job: FC-300-100 on MNIST digits, 4 ranks, 12 epochs,
seed 0) inside a network namespace whose loopback, shared by the four ranks, is limited to
RATE, and records each epoch's test accuracy against the training wall-clock time (from the
first step, start-up excluded).  Reported: the final accuracy, the training time, and the time
to first reach the final accuracy of `none` (uncompressed fp32), or "not reached".
Results: bench/results/train_<rate>.json, .md and .png (accuracy against wall-clock time).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
METHODS = ["none", "fp16", "alq:bits=3", "dgc:density=0.001"]


def run(method: str, rate: str, epochs: int, seed: int) -> dict:
    path = f"/tmp/hvdcomp-train-{rate}-{method.replace(':', '_')}.json"
    cmd = [os.path.join(ROOT, "launch", "netem"), rate, "--",
           os.path.join(ROOT, "launch", "run"), "-np", "4", sys.executable,
           os.path.join(ROOT, "examples", "train_mnist.py"), "--compression", method,
           "--epochs", str(epochs), "--seed", str(seed), "--no-progress", "--json", path]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, timeout=3600)
    with open(path) as f:
        return json.load(f)


def time_to(epochs, target: float):
    """Training seconds at the end of the first epoch whose accuracy is >= target."""
    for e in epochs:
        if e["test_acc"] >= target - 1e-9:
            return e["train_seconds"]
    return None


def render(res) -> str:
    target = res["target_acc"]
    lines = [f"| method | final acc (%) | training time (s) | time to {target:.2f} % (s) | "
             f"speed-up to that accuracy vs none | MB sent per rank per epoch |",
             "|---|---|---|---|---|---|"]
    base = time_to(res["runs"]["none"]["epochs"], target)
    for m, r in res["runs"].items():
        ep = r["epochs"]
        t = time_to(ep, target)
        lines.append(f"| {m} | {ep[-1]['test_acc']:.2f} | {ep[-1]['train_seconds']:.1f} | "
                     f"{'not reached' if t is None else f'{t:.1f}'} | "
                     f"{'-' if t is None else f'{base / t:.1f}x'} | "
                     f"{ep[-1]['bytes_per_rank'] / 1e6:.3f} |")
    return "\n".join(lines) + "\n"


def plot(res, path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for m, r in res["runs"].items():
        ep = r["epochs"]
        ax.plot([e["train_seconds"] for e in ep], [e["test_acc"] for e in ep],
                marker="o", ms=3, label=m)
    ax.axhline(res["target_acc"], color="gray", ls=":", lw=1,
               label=f"none's final accuracy ({res['target_acc']:.2f} %)")
    ax.set_xscale("log")
    ax.set_ylim(80, 100)
    ax.set_xlabel("training wall-clock time (s, log scale; one point per epoch)")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title(f"main job at {res['rate']} (4 ranks sharing the link), bench/train.py")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replot", action="store_true",
                    help="redraw the table and plot from the committed JSON, run nothing")
    ap.add_argument("--rate", default="100mbit")
    ap.add_argument("--methods", default=";".join(METHODS), help="';'-separated specs")
    ap.add_argument("--epochs", type=int, default=12)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    out = os.path.join(ROOT, "bench", "results", f"train_{args.rate}")
    if args.replot:
        with open(out + ".json") as f:
            res = json.load(f)
        with open(out + ".table.md", "w") as f:
            f.write(render(res))
        plot(res, out + ".png")
        return
    runs = {m: run(m, args.rate, args.epochs, args.seed) for m in args.methods.split(";")}
    if "none" not in runs:
        sys.exit("bench/train.py needs the 'none' run: it sets the target accuracy")
    res = {"command": "python bench/train.py " + " ".join(sys.argv[1:]),
           "date": time.strftime("%Y-%m-%d %H:%M"), "rate": args.rate, "ranks": 4,
           "target_acc": runs["none"]["epochs"][-1]["test_acc"], "runs": runs}
    with open(out + ".json", "w") as f:
        json.dump(res, f, indent=1)
    with open(out + ".table.md", "w") as f:
        f.write(render(res))
    plot(res, out + ".png")
    print(render(res))


if __name__ == "__main__":
    main()
