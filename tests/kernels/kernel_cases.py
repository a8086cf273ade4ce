"""Inputs and comparisons shared by the kernel tests (host build and GPU).

Everything is generated from fixed seeds, so every run sees the same inputs.
"""
import os
import shutil

import numpy as np
import torch

from hvdcomp import levels as L
from hvdcomp.ops.bitpack import pack_bits
from hvdcomp.ops import quantize as Q
from hvdcomp.philox import uniform

SIZES = (1, 7, 8, 9, 1000, 8193)          # odd, < 8, == 8, not multiples of 8 or of buckets
BUCKETS = (1, 3, 8, 100, 512, 8192)
BITS = tuple(range(2, 9))
NORMS = ("l2", "linf")
KEY = dict(seed=11, rank=2, tensor_id=3, step=7)


def tables(bits):
    """Level tables of the family, float32: QSGD's uniform, NUQSGD's exponential, an AMQ-like
    exponential with another multiplier, and an ALQ-like table with irregular interior levels."""
    rng = np.random.default_rng(1000 + bits)
    s = L.num_levels(bits) - 1
    interior = np.sort(rng.uniform(0.0, 1.0, size=s - 1) ** 2) if s > 1 else np.zeros(0)
    out = {
        "uniform": L.uniform_levels(bits),
        "exp0.5": L.exponential_levels(bits, 0.5),
        "exp0.7": L.exponential_levels(bits, 0.7),
        "fitted": np.concatenate([[0.0], interior, [1.0]]),
    }
    res = {}
    for k, v in out.items():
        t = torch.tensor(v, dtype=torch.float32)
        assert bool((t[1:] > t[:-1]).all()), (k, v)
        res[k] = t
    return res


def gradient(n, bucket_size, seed):
    """A float32 gradient with what real ones have and kernels get wrong: heavy tails, exact
    zeros of both signs, an all-zero bucket, denormals, a value at the bucket's norm."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp(2.0 * torch.randn(n, generator=g))
    x[::7] = 0.0
    x[3::11] = -0.0
    x[5::13] *= 1e-39                                   # denormal float32
    if n > 2 * bucket_size:
        x[bucket_size:2 * bucket_size] = 0.0            # a zero bucket in the middle
    if n >= bucket_size:                                # last full bucket: one coordinate
        x[bucket_size - 1] = -3.5                       # alone against zeros, r == 1 exactly
        if bucket_size > 1:
            x[:bucket_size - 1] = 0.0
    return x.to(torch.float32)


def on_levels(levels, n, seed):
    """Linf-normalized coordinates exactly equal to levels (p == 0 and p == 1 boundaries)."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, levels.numel(), (n,), generator=g)
    sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
    x = levels[idx] * sign
    x[0] = 1.0                                          # every bucket max: 1 (first bucket)
    return x.to(torch.float32)


def reference(x, levels, bits, bucket_size, norm, key=KEY):
    """(norms, codes, packed) of the PyTorch specification."""
    u = uniform(x.numel(), seed=key["seed"], step=key["step"], rank=key["rank"],
                tensor_id=key["tensor_id"], device=x.device)
    norms, codes = Q.quantize_reference(x, levels, bucket_size, norm, u)
    assert int(max(int(levels.numel() - 1).bit_length(), 1)) == bits - 1
    return norms, codes, pack_bits(codes, bits)


def ref_norms(x, bucket_size, norm):
    n = x.numel()
    nb = (n + bucket_size - 1) // bucket_size
    xp = torch.zeros(nb * bucket_size, dtype=torch.float32, device=x.device)
    xp[:n] = x
    return Q.bucket_norms.reference(xp, bucket_size, norm)


def ref_decode_add(out, norms, codes, levels, bits, bucket_size):
    return out + Q.dequantize_reference(norms, codes, levels, bucket_size, bits - 1)


def same_bits(a, b):
    """Bit-identical float32 tensors, except that any NaN equals any NaN (NaN payloads are
    not part of the specification)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    both_nan = torch.isnan(a) & torch.isnan(b)
    eq = a.view(torch.int32) == b.view(torch.int32)
    return bool((eq | both_nan).all())


def ulp_distance(a, b):
    """|a - b| in float32 ulps (finite, same-sign values), elementwise, as int64."""
    ia = a.view(torch.int32).to(torch.int64)
    ib = b.view(torch.int32).to(torch.int64)
    return (ia - ib).abs()


def nvcc_path():
    """nvcc: $NVCC, else the one on PATH, else None."""
    return os.environ.get("NVCC") or shutil.which("nvcc")
