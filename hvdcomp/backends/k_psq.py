"""Kernel operations of PSQ and BHQ (kernels/psq.cu), for either kernel backend.

Every function takes the backend's launch object first (``be`` = ``hvdcomp.backends.host
.backend`` for CPU tensors or ``hvdcomp.backends.cuda.backend`` for CUDA tensors) and equals a
function of the PyTorch specification, hvdcomp/compressors/psq.py, bit for bit on the same
device.  The per-element work (stochastic rounding with its Philox uniforms, packing,
unpacking, dequantization, the Householder reflections, the per-coordinate variance terms)
runs in the kernels; what stays as torch ops (glue) is:

* the per-row min and max (``torch.amin`` / ``torch.amax``, exactly as the reference: which
  of -0.0 and +0.0 they return is PyTorch's choice, and it is on the wire);
* the per-row step ``(hi - lo) / L`` (a division by a Python scalar, which PyTorch computes
  as a true division on the CPU and as a multiplication by the reciprocal on CUDA);
* BHQ's grouping (:func:`bhq_plan`): the sort of the R row ranges, the block scales, the row
  sums of the variance terms (``torch.sum``, the reference's order) and the choice per
  block, all on R or G values.

Raises TypeError / ValueError (hvdcomp.backends._common.check_tensor / check_int) for
arguments of the wrong type, dtype, device, shape or range.
"""
from __future__ import annotations

from typing import Tuple

import torch

from ._common import BLOCK, check_int, check_tensor, grid_for, packed_size, u32

__all__ = ["lohi_of", "steps_of", "quantize_pack", "quantize_rows", "dequantize_add",
           "row_terms", "row_variance", "bhq_forward", "bhq_plan", "bhq_dequantize_add"]


def _bits(bits) -> int:
    return check_int(bits, "bits", 1, 8)


def lohi_of(x: torch.Tensor) -> torch.Tensor:
    """Per-row (min, max) of float32 ``x`` (R, D): float32 (R, 2), as quantize_rows (glue)."""
    return torch.stack([x.amin(dim=1), x.amax(dim=1)], dim=1)


def steps_of(lohi: torch.Tensor, bits: int) -> torch.Tensor:
    """float64 (R,) grid steps (hi - lo) / (2**bits - 1), as dequantize_rows computes them."""
    lo = lohi[:, 0].to(torch.float64).unsqueeze(1)
    return ((lohi[:, 1].to(torch.float64).unsqueeze(1) - lo) / ((1 << bits) - 1)).reshape(-1)


def _key(seed, rank, tensor_id, step):
    return (u32(seed, "seed"), u32(rank, "rank"), u32(tensor_id, "tensor_id"),
            u32(step, "step"))


def quantize_pack(be, x: torch.Tensor, D: int, lohi: torch.Tensor, bits: int, *, seed: int,
                  rank: int, tensor_id: int, step: int) -> torch.Tensor:
    """Packed PSQ codes of the rows of flat float32 ``x`` (n = R * D,) with per-row (min, max)
    ``lohi`` float32 (R, 2) (contiguous; flattened to (2R,)).

    Returns uint8 (ceil(n * bits / 8),) = ``pack_bits(quantize_rows(x.view(R, D), bits, u)[1],
    bits)``, u = hvdcomp.random.uniform(n, seed, step, rank, tensor_id), when ``lohi`` is the
    reference's (:func:`lohi_of`).  bits: 1..8.
    """
    b = _bits(bits)
    x = check_tensor(be, x, "x", torch.float32)
    n = x.numel()
    D = check_int(D, "D", 1, 2**62)
    if n % D:
        raise ValueError(f"x has {n} elements, not a multiple of D = {D}")
    lohi = check_tensor(be, lohi.reshape(-1), "lohi", torch.float32, 2 * (n // D),
                        device=x.device)
    out = torch.empty(packed_size(n, b), dtype=torch.uint8, device=x.device)
    if n:
        be.launch("hvd_psq_quantize_pack", grid_for((n + 7) // 8), BLOCK,
                  (x, n, D, lohi, b, *_key(seed, rank, tensor_id, step), out))
    return out


def quantize_rows(be, x: torch.Tensor, bits: int, *, seed: int, rank: int, tensor_id: int,
                  step: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(lohi float32 (R, 2), packed uint8) of float32 ``x`` (R, D): psq.quantize_rows with the
    uniforms of the key, its codes packed (pack_bits); (R, 2) zeros and no bytes if R*D == 0."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError("x must be a 2-D tensor (R, D)")
    R, D = x.shape
    if R * D == 0:
        return (torch.zeros(R, 2, dtype=torch.float32, device=x.device),
                torch.empty(0, dtype=torch.uint8, device=x.device))
    lohi = lohi_of(x)
    packed = quantize_pack(be, x.reshape(-1), D, lohi, bits, seed=seed, rank=rank,
                           tensor_id=tensor_id, step=step)
    return lohi, packed


def dequantize_add(be, packed: torch.Tensor, R: int, D: int, lohi: torch.Tensor, bits: int,
                   out: torch.Tensor) -> torch.Tensor:
    """``out += dequantize_rows(lohi, unpack_bits(packed, R*D, bits), bits).float().reshape(-1)``
    bit for bit.  packed uint8 (ceil(R*D*bits/8),), lohi float32 (R, 2), out float32 (R*D,)
    contiguous, updated in place and returned."""
    b = _bits(bits)
    R = check_int(R, "R", 0, 2**62)
    D = check_int(D, "D", 0, 2**62)
    n = R * D
    out = check_tensor(be, out, "out", torch.float32, n, output=True)
    dev = out.device
    packed = check_tensor(be, packed, "packed", torch.uint8, packed_size(n, b), device=dev)
    lohi = check_tensor(be, lohi.reshape(-1), "lohi", torch.float32, 2 * R, device=dev)
    if n:
        steps = steps_of(lohi.view(R, 2), b).contiguous()
        be.launch("hvd_psq_dequantize_add", grid_for((n + 7) // 8), BLOCK,
                  (packed, n, D, lohi, steps, b, out))
    return out


def row_terms(be, x: torch.Tensor, rows: torch.Tensor, lohi: torch.Tensor,
              bits: int) -> torch.Tensor:
    """float64 (R, D) terms q (1 - q) of row_variance for the rows ``x[rows]`` of float32 ``x``
    (R0, D), ``rows`` int64 (R,), ``lohi`` float32 (R, 2) the per-row (min, max) of x[rows]."""
    b = _bits(bits)
    if x.dim() != 2:
        raise ValueError("x must be 2-D (R0, D)")
    D = x.shape[1]
    xf = check_tensor(be, x.reshape(-1), "x", torch.float32)
    rows = check_tensor(be, rows, "rows", torch.int64, device=xf.device)
    R = rows.numel()
    lohi = check_tensor(be, lohi.reshape(-1), "lohi", torch.float32, 2 * R, device=xf.device)
    out = torch.empty(R, D, dtype=torch.float64, device=xf.device)
    if R * D:
        be.launch("hvd_psq_row_terms", grid_for((R * D + 7) // 8), BLOCK,
                  (xf, rows, R, D, lohi, b, out))
    return out


def row_variance(be, x: torch.Tensor, rows: torch.Tensor, lohi: torch.Tensor,
                 bits: int) -> torch.Tensor:
    """psq.row_variance(x[rows], bits), float64 (R,): the terms from the kernel, the row sums
    and the scaling as the reference's torch ops.  Bit for bit up to the sign of zero
    sums (where ``lohi`` differs from the reference's by the sign of a zero bound)."""
    R = rows.numel()
    D = x.shape[1]
    if R * D == 0:
        return torch.zeros(R, dtype=torch.float64, device=x.device)
    L = (1 << bits) - 1
    lo64 = lohi[:, 0].to(torch.float64).unsqueeze(1)
    span = lohi[:, 1].to(torch.float64).unsqueeze(1) - lo64
    return row_terms(be, x, rows, lohi, bits).sum(dim=1) * (span.squeeze(1) / L) ** 2


def _starts(sizes: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(sizes, 0) - sizes


def bhq_forward(be, x: torch.Tensor, perm: torch.Tensor, sizes: torch.Tensor,
                scales: torch.Tensor) -> torch.Tensor:
    """``householder_blocks(x[perm].double(), sizes, scales, inverse=False).float()``: float32
    (len(perm), D) for float32 ``x`` (R0, D); perm int64 (R,) rows of x, sizes int64 (G,)
    summing to R, scales float32 (G,), all on x's device."""
    if x.dim() != 2:
        raise ValueError("x must be 2-D (R0, D)")
    D = x.shape[1]
    xf = check_tensor(be, x.reshape(-1), "x", torch.float32)
    dev = xf.device
    perm = check_tensor(be, perm, "perm", torch.int64, device=dev)
    sizes = check_tensor(be, sizes, "sizes", torch.int64, device=dev)
    G = sizes.numel()
    scales = check_tensor(be, scales, "scales", torch.float32, G, device=dev)
    y = torch.empty(perm.numel(), D, dtype=torch.float32, device=dev)
    if G * D:
        be.launch("hvd_bhq_forward", grid_for(G * D), BLOCK,
                  (xf, D, perm, _starts(sizes).contiguous(), sizes, scales, G, y))
    return y


def bhq_plan(be, x: torch.Tensor, bits: int, block_size: int):
    """psq.bhq_plan(x, bits, block_size) with the per-element work in kernels: the same
    (perm int64 (R,), sizes int64 (G,), scales float32 (G,), y float32 (R, D), variance)
    (perm, sizes, scales on the CPU; y on x's device), bit for bit on the same device.

    Glue: the grouping on R row ranges and G blocks (sort, scales, choice) is the reference's
    own torch code; the transform (:func:`bhq_forward`) and the per-coordinate variance terms
    (:func:`row_variance`) are kernels; the row sums are torch.sum as in the reference.
    """
    R, D = x.shape
    if R * D == 0:
        return (torch.arange(R, dtype=torch.int64), torch.ones(R, dtype=torch.int64),
                torch.ones(R, dtype=torch.float32), x, 0.0)
    from ..compressors.psq import BhqBlocks      # (psq imports this module)
    dev = x.device
    x = x.contiguous()
    xmin, xmax = x.amin(dim=1), x.amax(dim=1)
    mag = (xmax.to(torch.float64) - xmin.to(torch.float64)).cpu()
    blk = BhqBlocks(mag, block_size)
    perm_d = blk.perm.to(dev)
    yc = bhq_forward(be, x, perm_d, blk.sizes.to(dev), blk.a32.to(dev))
    ident = torch.arange(blk.nvar, dtype=torch.int64, device=dev)
    lohi_xb = torch.stack([xmin, xmax], dim=1)[perm_d].contiguous()
    use_row, out_sizes, out_scales, total = blk.choose(
        row_variance(be, yc, ident, lohi_of(yc), bits),
        row_variance(be, x, perm_d, lohi_xb, bits), yc)
    perm_all, sizes_all, scales_all = blk.with_constant_rows(out_sizes, out_scales)
    if bool(use_row.any()):
        # where(use_row, yc, x[perm]) and the constant rows: blocks that keep the transform
        # are recomputed (same arithmetic, same bits); the others are singletons of scale 1,
        # i.e. float32(float64(x) * 1) = x.
        y = bhq_forward(be, x, perm_all.to(dev), sizes_all.to(dev), scales_all.to(dev))
    else:
        y = x[perm_all.to(dev)]
    return perm_all, sizes_all, scales_all, y, total


def bhq_dequantize_add(be, packed: torch.Tensor, R: int, D: int, lohi: torch.Tensor,
                       bits: int, perm: torch.Tensor, sizes: torch.Tensor,
                       scales: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The BHQ receiver: with yhat = dequantize_rows(lohi, unpack_bits(packed, R*D, bits), bits),
    xhat = householder_blocks(yhat, sizes, scales, inverse=True).float(),
    ``out.view(R, D)[perm] += xhat`` bit for bit.  perm int64 (R,) a permutation (validated by
    the caller: BHQ.read_blocks), sizes int64 (G,) summing to R, scales float32 (G,);
    out float32 (R*D,) contiguous, updated in place and returned."""
    b = _bits(bits)
    R = check_int(R, "R", 0, 2**62)
    D = check_int(D, "D", 0, 2**62)
    n = R * D
    out = check_tensor(be, out, "out", torch.float32, n, output=True)
    dev = out.device
    packed = check_tensor(be, packed, "packed", torch.uint8, packed_size(n, b), device=dev)
    lohi = check_tensor(be, lohi.reshape(-1), "lohi", torch.float32, 2 * R, device=dev)
    perm = check_tensor(be, perm, "perm", torch.int64, R, device=dev)
    sizes = check_tensor(be, sizes, "sizes", torch.int64, device=dev)
    G = sizes.numel()
    scales = check_tensor(be, scales, "scales", torch.float32, G, device=dev)
    if n:
        steps = steps_of(lohi.view(R, 2), b).contiguous()
        be.launch("hvd_bhq_dequantize_add", grid_for(G * D), BLOCK,
                  (packed, n, D, lohi, steps, perm, _starts(sizes).contiguous(), sizes,
                   scales, G, b, out))
    return out
