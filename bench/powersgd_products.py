"""PowerSGD's per-rank products with M, two ways, on one CPU thread (not a test).

    .venv/bin/python bench/powersgd_products.py            # writes bench/results/powersgd_products.{json,md}

For each compressed matrix of bench/shapes.py's ResNet-50 and the real task's Fashion-MNIST
CNN (examples/fashion.py) and each rank r in 1, 2, 4: the seconds of this rank's two
products per step, M Q (n x r) and M^T P (m x r), computed as ``torch.mm(M, Q)`` and
``torch.mm(M.t(), P)`` (what PyTorch's powerSGD_hook and hvdcomp before 2026-12-04 run) and
as hvdcomp.compressors.powersgd.skinny_product runs them ((Q^T M^T)^T, (P^T M)^T for r >= 2).
Both ways alternate in one process (median of --reps), summed over the model's matrices;
the ratio is what the change buys, measured side by side.  The largest difference between
the two results (float32 rounding) is reported too.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "examples"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from hvdcomp.compressors.powersgd import PowerSGD, skinny_product  # noqa: E402


def models():
    import fashion
    from shapes import resnet50
    cnn = [(n, tuple(p.shape)) for n, p in fashion.FashionCNN().named_parameters()]
    return {"resnet50": resnet50(), "fashion_cnn": cnn}


def seconds(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def measure(shapes, r, reps):
    comp = PowerSGD(rank=r)
    mats = [comp.matrix(s) for _, s in shapes]
    mats = [mt for mt in mats if mt is not None]
    gen = torch.Generator().manual_seed(0)
    data = [(torch.randn(n, m, generator=gen), torch.randn(m, rr, generator=gen),
             torch.randn(n, rr, generator=gen), torch.empty(n, rr), torch.empty(m, rr))
            for n, m, rr in mats]

    def plain():
        for M, q, p, P, Q in data:
            torch.mm(M, q, out=P)
            torch.mm(M.t(), p, out=Q)

    def skinny():
        for M, q, p, P, Q in data:
            skinny_product(M, q, P)
            skinny_product(M.t(), p, Q)

    plain(), skinny()                          # warm-up
    t_plain, t_skinny = [], []
    for _ in range(reps):                      # alternate: the same load on both
        t_plain.append(seconds(plain))
        t_skinny.append(seconds(skinny))
    diff = 0.0
    for M, q, p, P, Q in data:
        a, b = torch.mm(M, q), skinny_product(M, q, torch.empty_like(P))
        diff = max(diff, float((a - b).abs().max() / a.abs().max().clamp_min(1e-30)))
    return {"matrices": len(mats), "elements": sum(n * m for n, m, _ in mats),
            "plain_s": statistics.median(t_plain), "skinny_s": statistics.median(t_skinny),
            "max_rel_diff": diff}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--ranks", default="1,2,4")
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = []
    for model, shapes in models().items():
        for r in [int(x) for x in args.ranks.split(",")]:
            row = dict(model=model, rank=r, **measure(shapes, r, args.reps))
            rows.append(row)
            print(json.dumps(row), flush=True)
    load = os.getloadavg()[0]
    base = os.path.join(ROOT, "bench", "results", "powersgd_products")
    with open(base + ".json", "w") as f:
        json.dump({"rows": rows, "load_1min": load, "reps": args.reps,
                   "measured": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())},
                  f, indent=1)
    with open(base + ".md", "w") as f:
        f.write("# PowerSGD's products with M on one CPU thread (bench/powersgd_products.py)\n\n"
                f"`.venv/bin/python bench/powersgd_products.py`, "
                f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, torch "
                f"{torch.__version__}, load average {load:.2f}; median of {args.reps} "
                "alternating repetitions.  Seconds per step of this rank's two products (M Q "
                "and M^T P) over the model's compressed matrices: `torch.mm(M, Q)` as "
                "PyTorch's powerSGD_hook computes them, against hvdcomp's `skinny_product` "
                "((Q^T M^T)^T for rank >= 2).\n\n"
                "| model | rank | matrices | elements | torch.mm (ms) | skinny_product (ms) "
                "| speed-up | largest relative difference |\n|---|---|---|---|---|---|---|---|\n")
        for r in rows:
            f.write(f"| {r['model']} | {r['rank']} | {r['matrices']} | {r['elements']:,} | "
                    f"{1e3 * r['plain_s']:.2f} | {1e3 * r['skinny_s']:.2f} | "
                    f"{r['plain_s'] / r['skinny_s']:.2f}x | {r['max_rel_diff']:.1e} |\n")


if __name__ == "__main__":
    main()
