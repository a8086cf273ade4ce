"""Counter-based random numbers: Philox4x32-10, keyed by (seed, step, rank, tensor, index).

Every random draw in hvdcomp (stochastic rounding, dither, random-k indices) comes from here,
so that any rank can regenerate any other rank's bits, on CPU or GPU alike.

Layout of one Philox call (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3",
SC 2011): a 128-bit counter and a 64-bit key give four 32-bit outputs.

    key     = (seed, rank)                                  two uint32 words
    counter = (block_lo, block_hi, tensor_id, step)         four uint32 words
    block   = index // 4, output word = index % 4           index is 64-bit

so element ``index`` of tensor ``tensor_id`` at ``step`` on ``rank`` always draws the same word.
``step`` is taken modulo 2**32.

This module is the reference implementation (PyTorch int64 arithmetic, CPU or CUDA); the
known-answer vectors of Random123 pin it in tests/unit/test_philox.py.  The ops
hvdcomp.ops.philox_draws.random_words / uniform run it, or the kernels of kernels/random.cu
where a kernel backend serves the device (the same bits).
"""
from __future__ import annotations

import torch

__all__ = ["philox4x32", "random_words", "uniform"]

_M0 = 0xD2511F53
_M1 = 0xCD9E8D57
_W0 = 0x9E3779B9
_W1 = 0xBB67AE85
_MASK = 0xFFFFFFFF


def _mulhilo(a: int, b: torch.Tensor):
    # a < 2**32 and b < 2**32, so a*b < 2**64: the int64 product wraps, but its bit pattern
    # is the exact 64-bit product; masking recovers both halves.
    p = b * a
    return (p >> 32) & _MASK, p & _MASK


def philox4x32(c0, c1, c2, c3, k0: int, k1: int, rounds: int = 10):
    """Philox4x32 on int64 tensors holding uint32 values (any shape, broadcastable).

    Returns the four output words as int64 tensors with values in [0, 2**32).
    """
    k0 &= _MASK
    k1 &= _MASK
    for r in range(rounds):
        if r:
            k0 = (k0 + _W0) & _MASK
            k1 = (k1 + _W1) & _MASK
        hi0, lo0 = _mulhilo(_M0, c0)
        hi1, lo1 = _mulhilo(_M1, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


def random_words(n: int, *, seed: int, step: int, rank: int, tensor_id: int,
                 offset: int = 0, device=None) -> torch.Tensor:
    """The uint32 words for indices ``offset .. offset+n-1`` as an int64 tensor of shape (n,)."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    first = offset // 4
    last = (offset + n + 3) // 4
    blocks = torch.arange(first, last, dtype=torch.int64, device=device)
    c0 = blocks & _MASK
    c1 = blocks >> 32
    c2 = torch.full_like(blocks, tensor_id & _MASK)
    c3 = torch.full_like(blocks, step & _MASK)
    words = torch.stack(philox4x32(c0, c1, c2, c3, seed, rank), dim=1).reshape(-1)
    start = offset - first * 4
    return words[start:start + n]


def uniform(n: int, *, seed: int, step: int, rank: int, tensor_id: int,
            offset: int = 0, device=None) -> torch.Tensor:
    """Uniform float32 numbers in [0, 1), shape (n,): the top 24 bits of each word times 2**-24.

    Every value is exactly representable in float32, so CPU and GPU agree bit for bit.
    """
    w = random_words(n, seed=seed, step=step, rank=rank, tensor_id=tensor_id,
                     offset=offset, device=device)
    return (w >> 8).to(torch.float32) * (1.0 / 16777216.0)
