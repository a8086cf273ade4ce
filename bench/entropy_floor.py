"""How few bits can entropy-coded scalar steps reach at step 0? (#22 target (c), the two
gradients that bench/bits_variance.py does not bring under 2.0 bits.)

    .venv/bin/python bench/entropy_floor.py > bench/results/entropy_floor.md

For the step-0 gradients of the small CNN and the Fashion-MNIST CNN (bench/bits_variance.py's
tensors), one step s for the whole model (the allocation of least total error), codes
q = sign(p) floor(|p| / s + theta) with rounding offsets theta in {0.5 (nearest), 0.42, 0.35,
0.25} (a dead zone), and optionally each tensor's nonzero codes decoded at (|q| - delta) s
with delta the mean offset that minimizes the squared error (centroid reconstruction).  The
bits are the codes' empirical entropy (a per-tensor static model: what an ideal order-0 coder
reaches) with no framing; the error is sum ||x_hat - g||^2 / sum ||g||^2.  Printed: the fewest
bits at an error no higher than CGX 4 bits / bucket 1024 (maxmin_variance), over steps
s = sqrt(12 v m), v = 0.003 x 1.05^i: the lowest found on that grid (not a proven bound) for
hvdcomp's uniformef, which also sends a header, its steps and an rANS model per message.
"""
from __future__ import annotations

import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bits_variance as bv  # noqa: E402
from common import SmallCNN, training_gradients  # noqa: E402


def entropy_bits(q: torch.Tensor) -> float:
    """Empirical (order-0) entropy of the codes ``q``, in bits, times their count."""
    _, counts = torch.unique(q, return_counts=True)
    pr = counts.double() / counts.sum()
    return float(-(pr * pr.log2()).sum()) * q.numel()


def fewest_bits(grads, ref, theta, centroid):
    sq = sum(float(g.double().pow(2).sum()) for g in grads.values())
    n = sum(g.numel() for g in grads.values())
    best = None
    for i in range(80):
        s = math.sqrt(12 * 0.003 * 1.05 ** i * sq / n)
        err = bits = 0.0
        for g in grads.values():
            p = g.reshape(-1).double()
            a = p.abs() / s
            q = torch.floor(a + theta)
            nz = q > 0
            delta = float((q[nz] - a[nz]).mean()) if centroid and bool(nz.any()) else 0.0
            x_hat = torch.where(nz, (q - delta) * s, torch.zeros_like(a)) * torch.sign(p)
            err += float((x_hat - p).pow(2).sum())
            bits += entropy_bits(q * torch.sign(p))
        if err / sq <= ref and (best is None or bits / n < best[0]):
            best = (bits / n, err / sq)
    return best


def main():
    torch.set_num_threads(1)
    print("# " + " ".join(__doc__.split("\n\n")[0].split()) + "\n\nCommand: "
          "`.venv/bin/python bench/entropy_floor.py > bench/results/entropy_floor.md` "
          "(what is measured: the docstring of bench/entropy_floor.py)\n")
    print("| gradient (step 0) | coordinates | CGX 4b error | offset theta | centroid "
          "| fewest bits at <= CGX (error) |\n|---|---|---|---|---|---|")
    for model, grads in (
            ("small CNN", bv.compressible(training_gradients(SmallCNN, points=[0])[0])),
            ("Fashion-MNIST CNN", bv.compressible(bv.fashion_gradients([0], 64)[0]))):
        sq = sum(float(g.double().pow(2).sum()) for g in grads.values())
        ref = sum(bv.maxmin_variance(g, 4, 1024) for g in grads.values()) / sq
        n = sum(g.numel() for g in grads.values())
        for theta in (0.5, 0.42, 0.35, 0.25):
            for centroid in (False, True):
                b = fewest_bits(grads, ref, theta, centroid)
                cell = f"{b[0]:.3f} ({b[1]:.4f})" if b else "> tested"
                print(f"| {model} | {n:,} | {ref:.4f} | {theta} | {'yes' if centroid else 'no'} "
                      f"| {cell} |")


if __name__ == "__main__":
    main()
