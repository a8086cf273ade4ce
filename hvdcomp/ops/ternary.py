"""TernGrad's and EF-SignSGD's per-bucket operations: the PyTorch references (the
specification) and their kernels (kernels/ternary.cu).

TernGrad (Wen et al., NeurIPS 2017, arXiv 1705.07878, Sec. 3.1 and 3.3): clipping at
``T = float32(clip * sigma)``, the bucket scales ``s = max |c|`` of the clipped gradient ``c``
and the stochastic ternary codes ``sign << 1 | b``, ``P(b = 1) = |c| / s``.
EF-SignSGD (Karimireddy et al., ICML 2019, arXiv 1901.09847, Algorithm 1): the scaled sign
``C(p) = (||p||_1 / d) sign(p)`` per bucket of ``p = g + e`` and the residual ``p - C(p)``.
The formulas, rounding and sign conventions are those of hvdcomp/compressors/terngrad.py and
hvdcomp/compressors/signef.py (module docstrings).

Ops (an :class:`~hvdcomp.ops.Op` runs the kernel where a kernel backend serves the device of
its first tensor, else the reference; both give the same values bit for bit)::

    terngrad_scales(x, clip, bucket_size) -> (scales, T)
    terngrad_pack(x, scales, bucket_size, T, *, seed, rank, tensor_id, step) -> packed codes
    terngrad_decode_add(packed, n, scales, bucket_size, out) -> out
    signef_scales(g, e, bucket_size) -> scales
    signef_pack(g, e, scales, bucket_size, e_out=None) -> (sign bits, residual)
    signef_decode_add(bits, n, scales, bucket_size, out) -> out

Bucket sizes are effective sizes (>= 1): the compressors map their setting 0 ("one bucket per
tensor") to ``max(n, 1)``.  Codes are packed (hvdcomp.ops.bitpack: code i at bit
``i * bits``, LSB first): 2 bits per coordinate for TernGrad, 1 for EF-SignSGD.

Certificates.  TernGrad's threshold and EF-SignSGD's scales come from float64 sums; the
kernels sum in another order than torch.sum.  :func:`certified_clip_threshold` and
:func:`certified_signef_scales` return a value with a proof that EVERY summation order
rounds to the same float32 (so torch's too); where the proof fails (a float32 rounding
boundary lies within the sums' error bound: rare, and rarer the smaller the tensor or
bucket) the ops' kernel implementations run the reference for that value, so the ops'
results never depend on the backend.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

from ..backends._common import (BLOCK, MAX_GRID, check_int, check_tensor, grid_for,
                                reduce_block, u32)
from .bitpack import pack_bits, unpack_bits
from ..philox import uniform
from . import op, padded_buckets

__all__ = ["clip_threshold", "clip_gradient", "terngrad_scales", "terngrad_pack",
           "terngrad_decode_add", "signef_scales", "signef_pack", "signef_decode_add",
           "terngrad_bucket_max", "certified_clip_threshold", "certified_signef_scales",
           "SEGMENT"]

SEGMENT = 16384        # coordinates per reduction segment (kernels/ternary.cu, "Segments")

_U = 2.0 ** -53        # float64 unit roundoff


# ---- the references -------------------------------------------------------------------------

def clip_threshold(x: torch.Tensor, clip: float) -> float:
    """TernGrad's clipping threshold ``T = float32(clip * sigma)`` (Sec. 3.3) of one gradient,
    as a Python float.

    x: any shape, floating dtype (its float32 values are used); sigma is the population
    standard deviation of the elements, ``sqrt(mean((x - mean x)^2))``, in float64.
    Returns ``inf`` (no clipping) when clip == 0, the tensor is empty, or T == 0.
    """
    x32 = x.detach().reshape(-1).to(torch.float32)
    if clip == 0 or x32.numel() == 0:
        return math.inf
    xd = x32.to(torch.float64)
    sigma = float(torch.sqrt(((xd - xd.mean()) ** 2).mean()))
    t = _f32(clip * sigma)
    return t if t > 0 else math.inf


def clip_gradient(x: torch.Tensor, clip: float) -> torch.Tensor:
    """The clipped gradient ``min(max(x, -T), T)`` as a flat float32 tensor (a new tensor).

    T from :func:`clip_threshold`; ``x`` is read, never modified.
    """
    x32 = x.detach().reshape(-1).to(torch.float32)
    t = clip_threshold(x32, clip)
    return x32.clone() if math.isinf(t) else x32.clamp(-t, t)


def _f32(v: float) -> float:
    """Python float -> float32 -> Python float (round to nearest)."""
    return float(torch.tensor(v, dtype=torch.float64).to(torch.float32))


def _clamp(x: torch.Tensor, t: float) -> torch.Tensor:
    return x if math.isinf(t) else x.clamp(-t, t)


def _per_coordinate(scales: torch.Tensor, bucket_size: int, n: int) -> torch.Tensor:
    """Each coordinate's bucket scale: float32 (n,)."""
    return scales.repeat_interleave(bucket_size)[:n] if n else scales[:0]


@op
def terngrad_scales(x: torch.Tensor, clip: float, bucket_size: int
                    ) -> Tuple[torch.Tensor, float]:
    """TernGrad's threshold and bucket scales: ``(scales, T)`` with T =
    :func:`clip_threshold` ``(x, clip)`` and scales float32 (ceil(n / bucket_size),) the
    maxima of ``|clamp(x, -T, T)|`` per bucket (the zero-padded last bucket included).

    x: float32 (n,), finite; clip >= 0; bucket_size >= 1.
    """
    t = clip_threshold(x, clip)
    return padded_buckets(_clamp(x, t).abs().to(torch.float32), bucket_size).amax(dim=1), t


@op
def terngrad_pack(x: torch.Tensor, scales: torch.Tensor, bucket_size: int, threshold: float,
                  *, seed: int, rank: int, tensor_id: int, step: int) -> torch.Tensor:
    """Clip, ternarize and pack: uint8 (ceil(n / 4),), the 2-bit codes ``sign << 1 | b`` of
    ``c = clamp(x, -T, T)`` (no clamp for T = inf): sign = 1 iff c_i < 0, b = 1 iff
    ``u_i < float32(|c_i| / s)`` (s = 0: b = 0), ``s`` the coordinate's bucket scale and
    ``u = hvdcomp.philox.uniform(n, seed=seed, step=step, rank=rank, tensor_id=tensor_id)``.

    x: float32 (n,), finite; scales: float32 (ceil(n / bucket_size),), the bucket maxima of
    |c| (:func:`terngrad_scales`); threshold: a float32 value > 0, or inf.
    """
    n = x.numel()
    c = _clamp(x, threshold)
    s = _per_coordinate(scales, bucket_size, n)
    r = c.abs() / torch.where(s > 0, s, torch.ones_like(s))
    u = uniform(n, seed=seed, step=step, rank=rank, tensor_id=tensor_id, device=x.device)
    codes = (c < 0).to(torch.int64) << 1 | (u < r).to(torch.int64)
    return pack_bits(codes, 2)


@op
def terngrad_decode_add(packed: torch.Tensor, n: int, scales: torch.Tensor, bucket_size: int,
                        out: torch.Tensor) -> torch.Tensor:
    """``out += sign * s * b`` for the 2-bit codes ``sign << 1 | b`` in ``packed`` (uint8
    (ceil(n / 4),)), s the coordinate's scale in ``scales`` (float32
    (ceil(n / bucket_size),)); out: float32 (n,), updated in place and returned."""
    codes = unpack_bits(packed, n, 2)
    v = (codes & 1).to(torch.float32) * _per_coordinate(scales, bucket_size, n)
    return out.add_(torch.where(codes >= 2, -v, v))


def _p(g: torch.Tensor, e: Optional[torch.Tensor]) -> torch.Tensor:
    return g if e is None else g + e


@op
def signef_scales(g: torch.Tensor, e: Optional[torch.Tensor], bucket_size: int
                  ) -> torch.Tensor:
    """EF-SignSGD's bucket scales of ``p = g + e`` (p = g when e is None): float32
    (ceil(n / bucket_size),), ``float32(sum_{i in b} |p_i| / len(b))``, the L1 sum in float64,
    len(b) the bucket's real length (the last one may be short).  A NaN or Inf in p gives a
    non-finite scale.  g, e: float32 (n,); bucket_size >= 1.
    """
    p = _p(g, e)
    n = p.numel()
    nb = (n + bucket_size - 1) // bucket_size
    a = padded_buckets(p.abs().to(torch.float64), bucket_size)
    counts = torch.full((nb,), float(bucket_size), dtype=torch.float64, device=p.device)
    if nb:
        counts[-1] = n - (nb - 1) * bucket_size
    return (a.sum(dim=1) / counts).to(torch.float32)


@op
def signef_pack(g: torch.Tensor, e: Optional[torch.Tensor], scales: torch.Tensor,
                bucket_size: int, e_out: Optional[torch.Tensor] = None
                ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Sign bits and new residual of ``p = g + e`` (p = g when e is None):
    ``(bits, residual)`` with bits uint8 (ceil(n / 8),) the packed ``p < 0`` (p = 0 and -0.0
    are sent as +, bit 0) and residual float32 (n,) ``p - (bit ? -s : s)``.

    scales: float32 (ceil(n / bucket_size),), the bucket scales of p (:func:`signef_scales`).
    e_out: where to write the residual (may be ``e`` itself: updated in place), else a new
    tensor.
    """
    p = _p(g, e)
    neg = p < 0
    s = _per_coordinate(scales, bucket_size, p.numel())
    residual = p - torch.where(neg, -s, s)
    if e_out is not None:
        residual = e_out.copy_(residual)
    return pack_bits(neg.to(torch.int64), 1), residual


@op
def signef_decode_add(bits: torch.Tensor, n: int, scales: torch.Tensor, bucket_size: int,
                      out: torch.Tensor) -> torch.Tensor:
    """``out += (bit ? -s : s)`` for the sign bits in ``bits`` (uint8 (ceil(n / 8),)), s the
    coordinate's scale in ``scales`` (float32 (ceil(n / bucket_size),)); out: float32 (n,),
    updated in place and returned."""
    s = _per_coordinate(scales, bucket_size, n)
    return out.add_(torch.where(unpack_bits(bits, n, 1) != 0, -s, s))


# ---- the kernels ----------------------------------------------------------------------------
# Each kernel implementation receives the launch object ``be`` first, checks its arguments
# (TypeError for a wrong type or dtype, ValueError for a wrong device, shape, layout or
# range), allocates its outputs on the inputs' device and launches.

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


def _accumulator(out: torch.Tensor, n: int) -> bool:
    """Whether a decode kernel can add into ``out`` (float32, 1-D, contiguous); ValueError
    where ``out`` cannot hold ``n`` values in any implementation."""
    if out.numel() != n:
        raise ValueError(f"out must have {n} elements, got shape {tuple(out.shape)}")
    return out.dtype == torch.float32 and out.dim() == 1 and out.is_contiguous()


def terngrad_bucket_max(be, x: torch.Tensor, bucket_size: int
                        ) -> Tuple[torch.Tensor, torch.Tensor]:
    """The kernel side of :func:`terngrad_scales`: the bucket maxima of |x| and the sums
    TernGrad's clipping needs, in one pass over ``x``.

    x: float32 (n,) with n >= 1; bucket_size >= 1.  Returns (maxima float32 (nb,), sums
    float64 (2,) = [sum x, sum |x|]) with nb = ceil(n / bucket_size).  maxima[b] equals the
    zero-padded ``x.view(nb, bs).abs().amax(dim=1)[b]`` bit for bit (NaN if the bucket holds a
    NaN, Inf for an Inf); the sums are in the kernels' fixed order (inputs of
    :func:`certified_clip_threshold`).
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


def certified_clip_threshold(be, x: torch.Tensor, clip: float,
                             sums: Optional[torch.Tensor] = None) -> Optional[float]:
    """:func:`clip_threshold` ``(x, clip)`` from the kernels' sums, or None where that value
    cannot be certified.

    x: float32 (n,), finite; clip >= 0; sums: [sum x, sum |x|] from
    :func:`terngrad_bucket_max` (computed here when None).  Returns inf for clip == 0, an
    empty x, or a threshold that rounds to 0 (as the reference).

    The reference computes sigma = sqrt(mean((x - mean x)^2)) in float64 with torch's
    summation order, then T = float32(clip * sigma).  Here: m = (sum x) / n and
    V = sum (x - m)^2 in the kernels' order, then an interval that holds the reference's
    sigma for ANY float64 summation order (Higham, "Accuracy and Stability of Numerical
    Algorithms", 2nd ed., Sec. 4.2: gamma_n = n u / (1 - n u) on each sum of n terms,
    u = 2^-53; |m - mean| <= (gamma_n + 3u) sum|x| / n for both means, and
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


@terngrad_scales.kernel
def _(be, x, clip, bucket_size):
    if x.numel() == 0:
        return NotImplemented
    maxima, sums = terngrad_bucket_max(be, x, bucket_size)
    t = certified_clip_threshold(be, x, clip, sums)
    if t is None:                                # not certified: the reference's own value
        t = clip_threshold(x, clip)
    # min(max |x|, T) = max |clamp(x, -T, T)| exactly
    return (maxima if math.isinf(t) else maxima.clamp(max=t)), t


@terngrad_pack.kernel
def _(be, x, scales, bucket_size, threshold, *, seed, rank, tensor_id, step):
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


@terngrad_decode_add.kernel
def _(be, packed, n, scales, bucket_size, out):
    n = check_int(n, "n", 0, 2**62)
    if not _accumulator(out, n):
        return NotImplemented
    bs = _bucket(bucket_size)
    out = check_tensor(be, out, "out", torch.float32, n, output=True)
    dev = out.device
    packed = check_tensor(be, packed, "packed", torch.uint8, (2 * n + 7) // 8, device=dev)
    scales = check_tensor(be, scales, "scales", torch.float32, (n + bs - 1) // bs, device=dev)
    if n:
        be.launch("hvd_terngrad_decode_add", grid_for((n + 7) // 8), BLOCK,
                  (packed, n, scales, bs, out))
    return out


def _g_e(be, g, e):
    g = check_tensor(be, g, "g", torch.float32)
    if e is not None:
        e = check_tensor(be, e, "e", torch.float32, g.numel(), device=g.device)
    return g, e


def certified_signef_scales(be, g: torch.Tensor, e: Optional[torch.Tensor], bucket_size: int
                            ) -> Tuple[torch.Tensor, torch.Tensor]:
    """The kernel side of :func:`signef_scales`: (scales float32 (nb,), uncertain int32
    (nb,)).

    Where uncertain[b] == 0, scales[b] equals the reference's bit for bit whatever its
    summation order (the proof: kernels/ternary.cu, hvd_signef_scales); where it is 1 the
    reference's value must be used.  A NaN or Inf in p gives a non-finite scale.
    g, e: float32 (n,), n >= 1 (e may be None: p = g); bucket_size >= 1.
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


@signef_scales.kernel
def _(be, g, e, bucket_size):
    if g.numel() == 0:
        return NotImplemented
    scales, uncertain = certified_signef_scales(be, g, e, bucket_size)
    if bool(uncertain.any()):                    # not certified: the reference's own scales
        return NotImplemented
    return scales


@signef_pack.kernel
def _(be, g, e, scales, bucket_size, e_out=None):
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


@signef_decode_add.kernel
def _(be, bits, n, scales, bucket_size, out):
    n = check_int(n, "n", 0, 2**62)
    if not _accumulator(out, n):
        return NotImplemented
    bs = _bucket(bucket_size)
    out = check_tensor(be, out, "out", torch.float32, n, output=True)
    dev = out.device
    bits = check_tensor(be, bits, "bits", torch.uint8, (n + 7) // 8, device=dev)
    scales = check_tensor(be, scales, "scales", torch.float32, (n + bs - 1) // bs, device=dev)
    if n:
        be.launch("hvd_signef_decode_add", grid_for((n + 7) // 8), BLOCK,
                  (bits, n, scales, bs, out))
    return out
