"""Kernel operations of DQSG and NDQSG (kernels/dithered.cu), for either kernel backend.

Every function takes the backend's launch object first (``be`` = ``hvdcomp.backends.host
.backend`` for CPU tensors or ``hvdcomp.backends.cuda.backend`` for CUDA tensors) and equals a
function of the PyTorch specification, hvdcomp/compressors/dithered.py, bit for bit.  The
per-element work (bucket maxima, the dithered quantization with its Philox dither, packing,
the per-bucket checks with their Philox weights, validation of received codes, unpacking,
reconstruction, the nested-lattice decode against the side information) runs in the kernels.
Glue left to torch: ``delta = max / M`` on nb values (a division by a Python scalar, which
PyTorch computes as a true division on the CPU and as a multiplication by the reciprocal on
CUDA: the torch op keeps the reference's bytes on either device).

Raises TypeError / ValueError (hvdcomp.backends._common.check_tensor / check_int) for
arguments of the wrong type, dtype, device, shape or range.
"""
from __future__ import annotations

from typing import Tuple

import torch

from ._common import (BLOCK, MAX_GRID, check_int, check_tensor, grid_for, packed_size,
                      reduce_block, u32)

__all__ = ["steps", "quantize_pack", "checks", "validate", "decode_add", "resolve_add"]


def _key(seed, rank, tensor_id, step):
    return (u32(seed, "seed"), u32(rank, "rank"), u32(tensor_id, "tensor_id"),
            u32(step, "step"))


def _bucket(bucket_size) -> int:
    return check_int(bucket_size, "bucket_size", 1, 2**62)


def _nb(n: int, bs: int) -> int:
    return (n + bs - 1) // bs


def _bucket_block(bs: int) -> int:
    """Threads per block of the per-bucket kernels (each thread takes groups of 8
    coordinates; the checks are sums mod 2**32, exact in any order)."""
    return reduce_block(bs // 8 + 1)


def steps(be, x: torch.Tensor, bits: int, bucket_size: int) -> torch.Tensor:
    """Delta float32 (nb,) of dqsg_quantize: the bucket max |x| (kernel hvd_bucket_norms_linf,
    exact) divided by M = 2**(bits-1) - 1 (torch, as the reference)."""
    b = check_int(bits, "bits", 2, 8)
    x = check_tensor(be, x, "x", torch.float32)
    bs = _bucket(bucket_size)
    n = x.numel()
    nb = _nb(n, bs)
    m = torch.empty(nb, dtype=torch.float32, device=x.device)
    if nb:
        be.launch("hvd_bucket_norms_linf", min(nb, MAX_GRID), reduce_block(bs), (x, n, bs, m))
    return m / ((1 << (b - 1)) - 1)


def quantize_pack(be, x: torch.Tensor, delta: torch.Tensor, bits: int, bucket_size: int,
                  nested_bits: int = 0, *, seed: int, rank: int, tensor_id: int,
                  step: int) -> torch.Tensor:
    """Packed codes of dqsg_quantize(x, bits, bucket_size, dither(n, key)) given its delta.

    nested_bits == 0: ``pack_bits(q + M, bits)`` (DQSG); else ``pack_bits(q & (k - 1),
    nested_bits)``, k = 2**nested_bits (NDQSG's nested group).  x float32 (n,) finite, delta
    float32 (nb,).  Returns uint8 (ceil(n * width / 8),).
    """
    b = check_int(bits, "bits", 2, 8)
    nbits = check_int(nested_bits, "nested_bits", 0, b - 1)
    x = check_tensor(be, x, "x", torch.float32)
    bs = _bucket(bucket_size)
    n = x.numel()
    delta = check_tensor(be, delta, "delta", torch.float32, _nb(n, bs), device=x.device)
    out = torch.empty(packed_size(n, nbits or b), dtype=torch.uint8, device=x.device)
    if n:
        be.launch("hvd_dqsg_quantize_pack", grid_for((n + 7) // 8), BLOCK,
                  (x, n, delta, bs, b, nbits, *_key(seed, rank, tensor_id, step), out))
    return out


def checks(be, x: torch.Tensor, delta: torch.Tensor, bits: int, bucket_size: int, *,
           seed: int, rank: int, tensor_id: int, step: int) -> torch.Tensor:
    """NDQSG's per-bucket check of x's DQSG indices: int64 (nb,) holding uint32 values,
    = bucket_checksums(q, check_weights(n, key), bucket_size)."""
    b = check_int(bits, "bits", 2, 8)
    x = check_tensor(be, x, "x", torch.float32)
    bs = _bucket(bucket_size)
    n = x.numel()
    nb = _nb(n, bs)
    delta = check_tensor(be, delta, "delta", torch.float32, nb, device=x.device)
    out = torch.empty(nb, dtype=torch.int32, device=x.device)
    if nb:
        be.launch("hvd_ndqsg_checks", min(nb, MAX_GRID), _bucket_block(bs),
                  (x, n, delta, bs, b, *_key(seed, rank, tensor_id, step), out))
    return out.to(torch.int64) & 0xFFFFFFFF


def validate(be, packed: torch.Tensor, n: int, delta: torch.Tensor, bucket_size: int,
             width: int, zero_code: int, max_code: int) -> Tuple[bool, bool]:
    """(any code > max_code, any code != zero_code in a bucket with delta == 0) for n packed
    codes of ``width`` bits (uint8 (ceil(n*width/8),)) and delta float32 (nb,)."""
    w = check_int(width, "width", 1, 8)
    n = check_int(n, "n", 0, 2**62)
    bs = _bucket(bucket_size)
    packed = check_tensor(be, packed, "packed", torch.uint8, packed_size(n, w))
    delta = check_tensor(be, delta, "delta", torch.float32, _nb(n, bs), device=packed.device)
    if n == 0:
        return False, False
    flags = torch.empty((n + 7) // 8, dtype=torch.uint8, device=packed.device)
    be.launch("hvd_dqsg_validate", grid_for((n + 7) // 8), BLOCK,
              (packed, n, delta, bs, w, check_int(zero_code, "zero_code", 0, 255),
               check_int(max_code, "max_code", 0, 255), flags))
    return bool((flags & 1).any()), bool((flags & 2).any())


def decode_add(be, packed: torch.Tensor, n: int, delta: torch.Tensor, bits: int,
               bucket_size: int, out: torch.Tensor, *, seed: int, rank: int, tensor_id: int,
               step: int) -> torch.Tensor:
    """``out += dqsg_reconstruct(delta, unpack_bits(packed, n, bits) - M, dither(n, key),
    bucket_size)`` bit for bit; out float32 (n,) contiguous, updated in place and returned."""
    b = check_int(bits, "bits", 2, 8)
    n = check_int(n, "n", 0, 2**62)
    bs = _bucket(bucket_size)
    out = check_tensor(be, out, "out", torch.float32, n, output=True)
    dev = out.device
    packed = check_tensor(be, packed, "packed", torch.uint8, packed_size(n, b), device=dev)
    delta = check_tensor(be, delta, "delta", torch.float32, _nb(n, bs), device=dev)
    if n:
        be.launch("hvd_dqsg_decode_add", grid_for((n + 7) // 8), BLOCK,
                  (packed, n, delta, bs, b, *_key(seed, rank, tensor_id, step), out))
    return out


def resolve_add(be, packed: torch.Tensor, n: int, delta: torch.Tensor, check: torch.Tensor,
                side_sum: torch.Tensor, group: int, bits: int, nested_bits: int,
                bucket_size: int, out: torch.Tensor, *, seed: int, rank: int, tensor_id: int,
                step: int) -> torch.Tensor:
    """One nested rank of NDQSG.resolve added into ``out``: ``out += values[r]`` bit for bit,
    where values[r] is what NDQSG.resolve computes from the residues (uint8 packed at
    nested_bits), delta float32 (nb,), the sent check (int64 or int32 (nb,), uint32 values)
    and side_sum float32 (n,) (the DQSG group's sum, rank order; side information
    side_sum / group).  Returns the failed flags, bool (nb,)."""
    b = check_int(bits, "bits", 2, 8)
    nbits = check_int(nested_bits, "nested_bits", 1, b - 1)
    n = check_int(n, "n", 0, 2**62)
    g = check_int(group, "group", 1, 2**31 - 1)
    bs = _bucket(bucket_size)
    nb = _nb(n, bs)
    out = check_tensor(be, out, "out", torch.float32, n, output=True)
    dev = out.device
    packed = check_tensor(be, packed, "packed", torch.uint8, packed_size(n, nbits), device=dev)
    delta = check_tensor(be, delta, "delta", torch.float32, nb, device=dev)
    check = check.to(device=dev)
    if check.dtype != torch.int32:
        check = (check.to(torch.int64) & 0xFFFFFFFF).to(torch.int32)   # same 32 bits
    check = check_tensor(be, check, "check", torch.int32, nb, device=dev)
    side_sum = check_tensor(be, side_sum, "side_sum", torch.float32, n, device=dev)
    failed = torch.zeros(nb, dtype=torch.uint8, device=dev)
    if nb:
        be.launch("hvd_ndqsg_resolve_add", min(nb, MAX_GRID), _bucket_block(bs),
                  (packed, n, delta, check, side_sum, g, bs, b, nbits,
                   *_key(seed, rank, tensor_id, step), out, failed))
    return failed.bool()
