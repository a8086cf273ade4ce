"""Golden inputs shared by the multi-rank workers: every rank can rebuild every other
rank's gradients from the seed, so a single process can compute the expected average."""
from __future__ import annotations

import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

# name -> (shape, dtype); odd shapes, odd sizes, half precision, a tensor that is NaN on one
# rank, an all-zero one, a 1-element one, an empty one.
SPECS = {
    "conv.weight": ((7, 3, 5, 5), torch.float32),      # 525: not a multiple of buckets
    "fc1.weight": ((300, 41), torch.float32),           # 12300
    "fc1.bias": ((300,), torch.float32),
    "half.weight": ((33, 40), torch.float16),
    "bhalf.weight": ((40, 33), torch.bfloat16),
    "double.weight": ((50, 30), torch.float64),
    "zero.weight": ((64, 64), torch.float32),
    "nan.weight": ((40, 40), torch.float32),
    "one.weight": ((1, 1), torch.float32),
    "empty.weight": ((0, 5), torch.float32),
}


def golden_grad(name: str, rank: int, seed: int = 7) -> torch.Tensor:
    shape, dtype = SPECS[name]
    g = torch.Generator().manual_seed(seed * 1000 + rank * 37 + sum(map(ord, name)))
    x = torch.randn(shape, generator=g) * (1 + rank)
    if name == "zero.weight":
        x.zero_()
    if name == "nan.weight" and rank == 1:
        x.view(-1)[5] = float("nan")
    return x.to(dtype)


def params():
    out = []
    for n, (shape, dtype) in SPECS.items():
        out.append((n, torch.nn.Parameter(torch.zeros(shape, dtype=dtype))))
    return out


def say(rank, *a):
    """Report success: print, and leave a file per rank for the pytest driver to count."""
    msg = " ".join(str(x) for x in a)
    print(f"[rank {rank}] {msg}", flush=True)
    out = os.environ.get("HVDCOMP_TEST_OUT")
    if out:
        with open(os.path.join(out, f"rank{rank}.ok"), "w") as f:
            f.write(msg)
