"""The reduce-scatter's second stage on real gradients (#11 item 5): how much variance the
owner's re-quantization of the averaged shards adds to the allgather's, for candidate second
stages of ALQ 3 bits.

    .venv/bin/python bench/second_stage.py        # about a minute on one core

FC-300-100 on the main job's MNIST digits, trained in one process (SGD, lr 0.1, momentum 0.9,
batch 32, seed 0); at steps 0, 5, 150 and 199 it takes N = 4 and N = 8 mini-batch gradients
of the first layer (235,200 elements) as the ranks' gradients g_r, quantizes each with ALQ
3 bits (bucket 8192: the main job's setting) with the initial table {0, 1/4, 1/2, 1} and
with the table fitted to the ranks' statistics, averages the decoded messages (a, what an
owner holds), and prints, with ||mean g||^2 as the unit:

    A  = sum_r Var Q(g_r) / N^2      the allgather's error (exact, Eq. 2 of Faghri et al.)
    V2 = Var Q2(a)                   the second stage's (exact, given a)

and (A + V2) / A, the two-stage estimate's error against the allgather's, for Q2: the same
3-bit table (the second stage before #11 item 5), the table refined to 5 and 6 bits
(hvdcomp.levels.refine), NUQSGD's 5-bit table, ALQ fitted at 5 bits to the ranks'
statistics or to a's, and hvdcomp's second stage (hvdcomp.exchange.shards.second_stage).
"""
from __future__ import annotations

import os
import sys

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "examples")]

import hvdcomp  # noqa: E402
from hvdcomp import levels as L  # noqa: E402
from hvdcomp.exchange.shards import second_stage  # noqa: E402
from hvdcomp.ops import level_stats as S  # noqa: E402
from mnist import FC300100, load_digits  # noqa: E402

BUCKET = 8192
STEPS = (0, 5, 150, 199)


def alq(bits, table):
    c = hvdcomp.get(f"alq:bits={bits},bucket_size={BUCKET}")
    c.levels = torch.tensor(np.float32(table))
    return c


def main():
    torch.set_num_threads(1)
    x, y, _, _ = load_digits(seed=0)
    torch.manual_seed(0)
    model = FC300100()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    gen = torch.Generator().manual_seed(1)

    def grads(n):
        out = []
        for _ in range(n):
            idx = torch.randint(0, len(x), (32,), generator=gen)
            model.zero_grad()
            torch.nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
            out.append(model[0].weight.grad.reshape(-1).clone())
        return out

    print("| step | ranks | stage-1 table | A | second stage | V2 | (A + V2) / A |")
    print("|---|---|---|---|---|---|---|")
    for step in range(max(STEPS) + 1):
        if step in STEPS:
            gs4 = grads(4)
            for gs in (gs4, gs4 + grads(4)):
                report(step, gs)
        grads(1)
        opt.step()


def report(step, gs):
    n = len(gs)
    unit = float(torch.stack(gs).mean(0).pow(2).sum())
    st = sum(S.histogram_stats(g, BUCKET, "l2").numpy() for g in gs)
    for tname, t3 in (("initial", L.exponential_levels(3)), ("fitted", L.fit_alq(st, 3))):
        q1 = alq(3, t3)
        A = sum(q1.variance(g) for g in gs) / n ** 2
        a = torch.zeros_like(gs[0])
        for r, g in enumerate(gs):
            key = hvdcomp.TensorKey("w", 0, step, r, n, 0)
            q1.decode(q1.encode(g, key), key, a)
        a /= n
        cands = [("same 3 bits", alq(3, t3)), ("refined, 5 bits", alq(5, L.refine(t3, 5))),
                 ("refined, 6 bits", alq(6, L.refine(t3, 6))),
                 ("NUQSGD 5 bits", alq(5, L.exponential_levels(5))),
                 ("ALQ 5 bits fitted to the g_r", alq(5, L.fit_alq(st, 5))),
                 ("ALQ 5 bits fitted to a",
                  alq(5, L.fit_alq(S.histogram_stats(a, BUCKET, "l2").numpy(), 5))),
                 ("**hvdcomp's second_stage**", second_stage(q1))]
        for name, q2 in cands:
            v2 = q2.variance(a)
            print(f"| {step} | {n} | {tname} | {A / unit:.4f} | {name} | {v2 / unit:.4f} | "
                  f"{(A + v2) / A:.3f} |", flush=True)


if __name__ == "__main__":
    main()
