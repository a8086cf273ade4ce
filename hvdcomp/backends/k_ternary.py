"""Launchers of kernels/ternary.cu: TernGrad (hvdcomp/compressors/terngrad.py) and EF-SignSGD
(hvdcomp/compressors/signef.py).

Every function takes the launch object first (``be``: ``hvdcomp.backends.host.backend`` for
CPU tensors, ``hvdcomp.backends.cuda.backend`` for CUDA tensors), checks its arguments
(TypeError for a wrong type or dtype, ValueError for a wrong device, shape, layout or
range), allocates its outputs with torch on the inputs' device and launches.  Every number
comes from the kernels; the few torch operations here are glue on per-bucket or scalar
values (a clamp of the bucket maxima by the threshold, reading back three float64 sums).

What equals the reference bit for bit:

* ``terngrad_pack`` / ``terngrad_decode_add``, ``signef_pack`` / ``signef_decode_add``:
  given the same scales (and threshold), always.
* ``terngrad_bucket_max``: the bucket maxima of |x| (max is exact in any order).
* ``terngrad_clip_threshold`` and ``signef_scales`` come from float64 sums whose order
  differs from torch.sum's; each result is returned only with a proof that EVERY summation
  order gives the same float32 (so the reference's too); where the proof fails (a float32
  rounding boundary lies within the sums' error bound: rare, and rarer the smaller the
  tensor or bucket), ``terngrad_clip_threshold`` returns None and ``signef_scales`` flags
  the bucket, and the caller recomputes with the reference.  The compressors do so, so their
  messages are byte-identical to the reference's in every case.

Bucket sizes here are effective sizes (>= 1); the compressors map their setting 0 ("one
bucket per tensor") to max(n, 1) before calling.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

from ._common import MAX_GRID, BLOCK, check_int, check_tensor, grid_for, reduce_block, u32

__all__ = ["SEGMENT", "terngrad_bucket_max", "terngrad_clip_threshold", "terngrad_pack",
           "terngrad_decode_add", "signef_scales", "signef_pack", "signef_decode_add"]

SEGMENT = 16384        # coordinates per reduction segment (kernels/ternary.cu, "Segments")

_U = 2.0 ** -53        # float64 unit roundoff


def _bucket(bs) -> int:
    return check_int(bs, "bucket_size", 1, 2**62)


def _segments(n: int, bs: int) -> Tuple[int, int, int]:
    """(nb, spb, block): buckets, segments per bucket, threads per segment block.  Fixed by
    (n, bs) alone, so the float64 partial sums are the same on every device."""
    nb = (n + bs - 1) // bs
    longest = min(bs, n)
    spb = max(1, (longest + SEGMENT - 1) // SEGMENT)
    return nb, spb, reduce_block(min(longest, SEGMENT))


def _sum_rows(be, parts: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    out = torch.empty(rows, dtype=torch.float64, device=parts.device)
    be.launch("hvd_sum_rows_f64", grid_for(rows), BLOCK, (parts, rows, cols, out))
    return out


# ---- TernGrad ---------------------------------------------------------------------------------

def terngrad_bucket_max(be, x: torch.Tensor, bucket_size: int
                        ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Bucket maxima of |x| and the sums TernGrad's clipping needs, in one pass over ``x``.

    x: float32 (n,) with n >= 1; bucket_size: effective bucket size >= 1.
    Returns (maxima float32 (nb,), sums float64 (2,) = [sum x, sum |x|]) with
    nb = ceil(n / bucket_size).  maxima[b] equals ``xp.view(nb, bs).abs().amax(dim=1)[b]``
    of the zero-padded x bit for bit (NaN if the bucket holds a NaN, Inf for an Inf); the
    sums are in the kernels' fixed order (inputs of terngrad_clip_threshold).
    """
    x = check_tensor(be, x, "x", torch.float32)
    bs = _bucket(bucket_size)
    n = x.numel()
    if n == 0:
        raise ValueError("x must not be empty")
    nb, spb, block = _segments(n, bs)
    nseg = nb * spb
    segmax = torch.empty(nseg, dtype=torch.float32, device=x.device)
    sums = torch.empty(2 * nseg, dtype=torch.float64, device=x.device)
    be.launch("hvd_terngrad_segments", min(nseg, MAX_GRID), block,
              (x, n, bs, SEGMENT, spb, segmax, sums))
    maxima = torch.empty(nb, dtype=torch.float32, device=x.device)
    be.launch("hvd_max_rows", grid_for(nb), BLOCK, (segmax, nb, spb, maxima))
    return maxima, _sum_rows(be, sums, 2, nseg)


def _f32(v: float) -> float:
    """Python float -> float32 -> Python float, exactly as terngrad.clip_threshold rounds."""
    return float(torch.tensor(v, dtype=torch.float64).to(torch.float32))


def terngrad_clip_threshold(be, x: torch.Tensor, clip: float,
                            sums: Optional[torch.Tensor] = None) -> Optional[float]:
    """``hvdcomp.compressors.terngrad.clip_threshold(x, clip)``, or None where that value
    cannot be certified from the kernels' sums (then the caller runs the reference).

    x: float32 (n,), finite (not checked: the compressor checks first); clip >= 0;
    sums: [sum x, sum |x|] from terngrad_bucket_max (computed here when None).
    Returns inf for clip == 0, an empty x, or a threshold that rounds to 0 (as the reference).

    The reference computes sigma = sqrt(mean((x - mean x)^2)) in float64 with torch's
    summation order, then T = float32(clip * sigma).  Here: m = (sum x) / n and
    V = sum (x - m)^2 in the kernels' order, then an interval that holds the reference's
    sigma for ANY float64 summation order (Higham's bound gamma_n = n u / (1 - n u) on each
    sum of n terms, u = 2^-53; |m - mean| <= (gamma_n + 3u) sum|x| / n for both means, and
    sum (x - m')^2 = sum (x - mean)^2 + n (m' - mean)^2 for any m'; each square and
    difference rounds at most twice; torch's pow may be off by one more rounding).  T is
    returned when both ends of the interval give the same float32, which, every step being
    monotone, is then the reference's.
    """
    x = check_tensor(be, x, "x", torch.float32)
    n = x.numel()
    if clip == 0 or n == 0:
        return math.inf
    if n * _U >= 1e-3:
        return None
    if sums is None:
        sums = terngrad_bucket_max(be, x, n)[1]
    s1, sa = (float(v) for v in sums.tolist())
    nb, spb, block = _segments(n, n)
    part = torch.empty(spb, dtype=torch.float64, device=x.device)
    be.launch("hvd_terngrad_sqdev", min(spb, MAX_GRID), block,
              (x, n, n, SEGMENT, spb, s1 / n, part))
    v = float(_sum_rows(be, part, 1, spb)[0])
    gamma = n * _U / (1.0 - n * _U)                        # any order of n terms
    depth = (min(n, SEGMENT) + block - 1) // block + spb + 12
    gamma_k = depth * _U / (1.0 - depth * _U)              # the kernels' trees (height)
    a_hi = sa / (1.0 - gamma) * (1.0 + 8 * _U)             # >= the exact sum |x|
    e_mean = (gamma + 3 * _U) * a_hi / n * (1.0 + 8 * _U)  # >= |m - mean| for both means
    w = 2.0 * n * e_mean * e_mean * (1.0 + 8 * _U)
    eps = 1.01 * (gamma + gamma_k) + 16 * _U
    s_lo = max(0.0, v * (1.0 - eps) - w)
    s_hi = v * (1.0 + eps) + w
    sig_lo = math.sqrt(s_lo / n) * (1.0 - 2.0 ** -49)
    sig_hi = math.sqrt(s_hi / n) * (1.0 + 2.0 ** -49)
    t_lo, t_hi = _f32(clip * sig_lo), _f32(clip * sig_hi)
    if t_lo != t_hi:
        return None
    return t_lo if t_lo > 0 else math.inf


def terngrad_pack(be, x: torch.Tensor, scales: torch.Tensor, bucket_size: int, threshold: float,
                  *, seed: int, rank: int, tensor_id: int, step: int) -> torch.Tensor:
    """Clip, ternarize and pack: uint8 (ceil(n / 4),) equal to ``pack_bits(codes, 2)`` with
    ``codes = quantize_reference(c, {0, 1}, bucket_size, "linf", u)[1]``,
    ``c = x.clamp(-threshold, threshold)`` (no clamp for threshold = inf) and
    ``u = hvdcomp.random.uniform(n, seed=seed, step=step, rank=rank, tensor_id=tensor_id)``,
    given ``scales`` = the reference's bucket norms of c, float32 (ceil(n / bucket_size),).
    x: float32 (n,), finite; threshold: a float32 value > 0, or inf.
    """
    x = check_tensor(be, x, "x", torch.float32)
    bs = _bucket(bucket_size)
    n = x.numel()
    nb = (n + bs - 1) // bs
    scales = check_tensor(be, scales, "scales", torch.float32, nb, device=x.device)
    t = float(threshold)
    if not t > 0 or _f32(t) != t:
        raise ValueError(f"threshold must be a float32 value > 0 or inf, got {threshold!r}")
    out = torch.empty((2 * n + 7) // 8, dtype=torch.uint8, device=x.device)
    if n:
        be.launch("hvd_terngrad_pack", grid_for((n + 7) // 8), BLOCK,
                  (x, n, scales, bs, t, u32(seed, "seed"), u32(rank, "rank"),
                   u32(tensor_id, "tensor_id"), u32(step, "step"), out))
    return out


def terngrad_decode_add(be, packed: torch.Tensor, n: int, scales: torch.Tensor,
                        bucket_size: int, out: torch.Tensor) -> torch.Tensor:
    """``out += dequantize_reference(scales, unpack_bits(packed, n, 2), {0, 1}, bucket_size,
    1)``, bit for bit, without a dense copy.  packed: uint8 (ceil(n / 4),); scales: float32
    (ceil(n / bucket_size),); out: float32 (n,), contiguous, updated in place and returned."""
    n = check_int(n, "n", 0, 2**62)
    bs = _bucket(bucket_size)
    out = check_tensor(be, out, "out", torch.float32, n, output=True)
    dev = out.device
    packed = check_tensor(be, packed, "packed", torch.uint8, (2 * n + 7) // 8, device=dev)
    scales = check_tensor(be, scales, "scales", torch.float32, (n + bs - 1) // bs, device=dev)
    if n:
        be.launch("hvd_terngrad_decode_add", grid_for((n + 7) // 8), BLOCK,
                  (packed, n, scales, bs, out))
    return out


# ---- EF-SignSGD -------------------------------------------------------------------------------

def _g_e(be, g, e):
    g = check_tensor(be, g, "g", torch.float32)
    if e is not None:
        e = check_tensor(be, e, "e", torch.float32, g.numel(), device=g.device)
    return g, e


def signef_scales(be, g: torch.Tensor, e: Optional[torch.Tensor], bucket_size: int
                  ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-bucket scales of p = g + e (p = g when e is None): (scales float32 (nb,),
    uncertain int32 (nb,)).

    scales[b] = float32(sum_{i in b} |p_i| / len(b)), the L1 sum in float64 (SignEF.scales).
    Where uncertain[b] == 0 the scale equals the reference's bit for bit whatever its
    summation order (the proof: kernels/ternary.cu, hvd_signef_scales); where it is 1 the
    caller must use the reference's scales.  A NaN or Inf in p gives a non-finite scale.
    g, e: float32 (n,), n >= 1; bucket_size: effective bucket size >= 1.
    """
    g, e = _g_e(be, g, e)
    bs = _bucket(bucket_size)
    n = g.numel()
    if n == 0:
        raise ValueError("g must not be empty")
    nb, spb, block = _segments(n, bs)
    part = torch.empty(nb * spb, dtype=torch.float64, device=g.device)
    minnz = torch.empty(nb * spb, dtype=torch.float32, device=g.device)
    be.launch("hvd_signef_segments", min(nb * spb, MAX_GRID), block,
              (g, g if e is None else e, 0 if e is None else 1, n, bs, SEGMENT, spb, part,
               minnz))
    scales = torch.empty(nb, dtype=torch.float32, device=g.device)
    uncertain = torch.empty(nb, dtype=torch.int32, device=g.device)
    be.launch("hvd_signef_scales", grid_for(nb), BLOCK,
              (part, nb, spb, n, bs, SEGMENT, block, minnz, scales, uncertain))
    return scales, uncertain


def signef_pack(be, g: torch.Tensor, e: Optional[torch.Tensor], scales: torch.Tensor,
                bucket_size: int, e_out: Optional[torch.Tensor] = None
                ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Sign bits and new residual of p = g + e (p = g when e is None), as SignEF._encode:
    (bits uint8 (ceil(n / 8),) = pack_bits(p < 0, 1), e_out float32 (n,) = p - decoded).

    scales: float32 (ceil(n / bucket_size),), the bucket scales of p.  e_out: where to write
    the residual (may be ``e`` itself: updated in place); a new tensor when None.
    """
    g, e = _g_e(be, g, e)
    bs = _bucket(bucket_size)
    n = g.numel()
    nb = (n + bs - 1) // bs
    scales = check_tensor(be, scales, "scales", torch.float32, nb, device=g.device)
    if e_out is None:
        e_out = torch.empty(n, dtype=torch.float32, device=g.device)
    e_out = check_tensor(be, e_out, "e_out", torch.float32, n, output=True, device=g.device)
    bits = torch.empty((n + 7) // 8, dtype=torch.uint8, device=g.device)
    if n:
        be.launch("hvd_signef_pack", grid_for((n + 7) // 8), BLOCK,
                  (g, g if e is None else e, 0 if e is None else 1, n, scales, bs, bits, e_out))
    return bits, e_out


def signef_decode_add(be, bits: torch.Tensor, n: int, scales: torch.Tensor, bucket_size: int,
                      out: torch.Tensor) -> torch.Tensor:
    """``out += where(unpack_bits(bits, n, 1) != 0, -s, s)`` (s: each coordinate's bucket
    scale), bit for bit, as SignEF._decode, without a dense copy.  bits: uint8
    (ceil(n / 8),); scales: float32 (ceil(n / bucket_size),); out: float32 (n,), contiguous,
    updated in place and returned."""
    n = check_int(n, "n", 0, 2**62)
    bs = _bucket(bucket_size)
    out = check_tensor(be, out, "out", torch.float32, n, output=True)
    dev = out.device
    bits = check_tensor(be, bits, "bits", torch.uint8, (n + 7) // 8, device=dev)
    scales = check_tensor(be, scales, "scales", torch.float32, (n + bs - 1) // bs, device=dev)
    if n:
        be.launch("hvd_signef_decode_add", grid_for((n + 7) // 8), BLOCK,
                  (bits, n, scales, bs, out))
    return out
