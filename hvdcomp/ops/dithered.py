"""DQSG and NDQSG arithmetic: the subtractive dither, the dithered quantizer, the nested-lattice
encode with its 32-bit bucket check, and the decode of a nested message with side information.

Source: A. Abdi and F. Fekri, "Nested Dithered Quantization for Communication Reduction in
Distributed Training", arXiv 1904.01197 (2019).  DQSG is the paper's subtractive dithered
quantizer of the stochastic gradient, ``Q(v + u) - u`` with a dither ``u`` both sides can
generate; NDQSG sends only the fine index modulo the coarse lattice and the receiver resolves
the coset with side information.  The compressors (hvdcomp.compressors.dithered) describe the
messages; this module is the arithmetic.  Everything is float32 unless stated.

* ``bits`` (2..8) is the whole code width, sign included: M = 2**(bits-1) - 1 positive levels,
  the fine lattice is ``Delta * {-M, ..., M}`` (2**bits - 1 points).
* Per bucket b of ``bucket_size`` consecutive coordinates of the flat gradient x (the last
  bucket may be short):  m_b = max_{i in b} |x_i|,  Delta_b = min(float32(m_b / M), Delta_max)
  where Delta_max = :func:`max_step` (bits) is the largest float32 with
  Delta_max * (M + 1/2) <= the float32 maximum: so every reconstruction (at most
  Delta (M + 1/2) in magnitude) is finite.  The cap acts only on buckets whose maximum lies
  within a factor (M + 1/2) / M of the float32 maximum (there the largest values are
  clamped to q = +-M: biased by at most Delta/2 more); receivers reject larger steps.
  (:func:`variance_steps`: the steps set by a variance target instead, never below m_b / M.)
* Dither (Philox, hvdcomp.philox, keyed by the tensor's key: seed, step, rank, tensor id and
  the coordinate index i, so a receiver regenerates it bit-exactly from the header):
      s_i = hvdcomp.philox.uniform(n, seed, step, rank, tensor_id)[i] - 1/2   in [-1/2, 1/2)
      u_i = float32(s_i * Delta_b)
  (``s_i`` is exact in float32: the uniform numbers are multiples of 2**-24.)
* Quantization (``q = round((x + u) / Delta)`` computed as ``x / Delta + s``, so nothing
  overflows next to the float32 maximum; D_b = Delta_b, or 1 where Delta_b = 0):
      q_i = clamp(floor(float32(float32(x_i / D_b) + s_i) + 0.5), -M, M)        (int)
  In exact arithmetic q_i is already in [-M, M] unless Delta_b was capped; otherwise the
  clamp only acts where float32 rounding lands within a few ulps of +-(M + 1/2).
* Reconstruction:  x_hat_i = float32(float64(Delta_b) * q_i - float64(u_i)); x_hat - x is
  uniform on [-Delta_b/2, Delta_b/2] and independent of x given Delta_b (the paper's "SGD
  plus an independent bounded uniform noise").  Buckets with Delta = 0 (all zero, or a
  maximum below M * 2**-149) have q = 0 and decode to exactly 0.
* NDQSG's nested encode: the residue ``q mod k`` (k = 2**nested_bits) and per bucket the check
      S_b = sum_{i in b} q_i * w_i  mod 2**32,   w_i = (Philox word at index CHECK_OFFSET + i
  of the sender's key) | 1, an odd pseudo-random weight.
* NDQSG's decode with side information y (the mean of the DQSG group's reconstructions):
  z_i = float32(float32(y_i / D_b) + s_i), q_hat_i = the member of the coset c_i = q_i mod k
  in [-M, M] nearest to z_i (:func:`nested_resolve`; 0 where Delta_b = 0), exact whenever
  |y_i - x_i| < (k - 1) * Delta_b / 2.  A bucket whose recomputed check differs from the sent
  one (a wrong q_hat changes it except with probability about 2**-(32 - bits)) is *failed*:
  it decodes to y there; the other buckets decode to Delta * q_hat - u as DQSG.

Ops (each a reference, the specification, and a kernel implementation, kernels/dithered.cu):
:func:`bucket_steps`, :func:`dqsg_encode`, :func:`nested_encode`, :func:`validate_codes`,
:func:`dqsg_decode_add`, :func:`nested_decode_add`; and uniformef's rounding on the same
steps without a dither (hvdcomp.compressors.uniformef), :func:`uniform_encode` and
:func:`uniform_decode_add`.  ``key`` arguments are any object with
integer fields ``seed``, ``step``, ``rank`` and ``tensor_id`` (a hvdcomp.TensorKey).  Packed
codes are uint8 tensors as hvdcomp.ops.bitpack.pack_bits makes them.  The kernel
implementations raise TypeError / ValueError (hvdcomp.backends._common.check_tensor /
check_int) for arguments of the wrong type, dtype, device, shape or range; the decodes return
NotImplemented (the reference runs) for an accumulator that is not a contiguous float32 (n,).
"""
from __future__ import annotations

import math
from typing import Tuple

import numpy as np
import torch

from ..backends._common import (BLOCK, MAX_GRID, check_int, check_tensor, grid_for, packed_size,
                                reduce_block, u32)
from .bitpack import pack_bits, unpack_bits
from ..philox import random_words, uniform
from . import divide, op, padded_buckets

__all__ = ["CHECK_OFFSET", "max_step", "dither", "check_weights", "dqsg_quantize",
           "dqsg_reconstruct", "bucket_checksums", "nested_resolve", "bucket_steps",
           "variance_steps", "floor_steps", "per_coordinate",
           "dqsg_encode", "nested_encode", "validate_codes", "dqsg_decode_add",
           "nested_decode_add", "uniform_encode", "uniform_decode_add"]

#: Philox index offset of the check weights (the dither uses indices 0 .. numel-1).
CHECK_OFFSET = 1 << 60
_MASK = 0xFFFFFFFF


# --- the reference steps ----------------------------------------------------------------------

def dither(n: int, key, device=None) -> torch.Tensor:
    """The normalized dither s = U - 1/2 of ``key``'s tensor: float32 (n,) in [-1/2, 1/2);
    U = hvdcomp.philox.uniform(n, seed, step, rank, tensor_id).  The dither proper is
    u = s * Delta of the coordinate's bucket."""
    return uniform(n, seed=key.seed, step=key.step, rank=key.rank, tensor_id=key.tensor_id,
                   device=device) - 0.5


def check_weights(n: int, key, device=None) -> torch.Tensor:
    """Odd 32-bit weights w_i of NDQSG's bucket check: int64 (n,) in [1, 2**32),
    w_i = (Philox word of ``key`` at index CHECK_OFFSET + i) | 1."""
    return random_words(n, seed=key.seed, step=key.step, rank=key.rank,
                        tensor_id=key.tensor_id, offset=CHECK_OFFSET, device=device) | 1


def max_step(bits: int) -> float:
    """Delta_max of ``bits`` (2..8): the largest float32 d with d * (M + 1/2) <= the float32
    maximum, M = 2**(bits-1) - 1 (in float64, as the reconstruction computes), so that
    |x_hat| <= Delta (M + 1/2) never exceeds it."""
    top = float(np.finfo(np.float32).max)
    half = _levels(bits) + 0.5
    d = np.float32(top / half)
    while float(d) * half > top:
        d = np.nextafter(d, np.float32(0))
    return float(d)


def _nb(n: int, bucket_size: int) -> int:
    return (n + bucket_size - 1) // bucket_size


def per_coordinate(vals: torch.Tensor, bucket_size: int, n: int) -> torch.Tensor:
    """Per-bucket values (nb,) -> per-coordinate values (n,) (the last bucket may be short;
    n elements are allocated, never nb * bucket_size)."""
    nb = vals.numel()
    if nb == 0 or n == 0:
        return vals[:0]
    reps = torch.full((nb,), bucket_size, dtype=torch.int64, device=vals.device)
    reps[-1] = n - (nb - 1) * bucket_size
    return vals.repeat_interleave(reps, output_size=n)


def _levels(bits: int) -> int:
    """M = 2**(bits-1) - 1."""
    return (1 << (bits - 1)) - 1


def dqsg_quantize(x: torch.Tensor, delta: torch.Tensor, bits: int, bucket_size: int,
                  s: torch.Tensor) -> torch.Tensor:
    """The dithered indices q: int64 (n,) in [-M, M] (module docstring).

    x: flat finite float32 (n,); delta: float32 (nb,) its steps (:func:`bucket_steps`);
    s: float32 (n,) the dither (:func:`dither`)."""
    M = _levels(bits)
    n = x.numel()
    safe = per_coordinate(torch.where(delta > 0, delta, torch.ones_like(delta)), bucket_size, n)
    return torch.floor(x / safe + s + 0.5).clamp_(-M, M).to(torch.int64)


def dqsg_reconstruct(delta: torch.Tensor, q: torch.Tensor, s: torch.Tensor,
                     bucket_size: int) -> torch.Tensor:
    """x_hat = float32(float64(Delta) * q - float64(u)), u = float32(s * Delta): float32 (n,)
    from delta float32 (nb,), q int64 (n,) and s float32 (n,)."""
    d = per_coordinate(delta, bucket_size, q.numel())
    u = s * d
    return (d.to(torch.float64) * q.to(torch.float64) - u.to(torch.float64)).to(torch.float32)


def bucket_checksums(q: torch.Tensor, w: torch.Tensor, bucket_size: int) -> torch.Tensor:
    """S_b = sum_{i in b} q_i * w_i mod 2**32: int64 (nb,).

    q: int64 (n,) with |q| < 2**8; w: int64 (n,) < 2**32.  Each product is reduced mod 2**32
    before the sum, so a bucket of up to 2**31 coordinates cannot overflow int64."""
    return padded_buckets((q * w) & _MASK, bucket_size).sum(dim=1) & _MASK


def nested_resolve(c: torch.Tensor, z: torch.Tensor, bits: int,
                   nested_bits: int) -> torch.Tensor:
    """Coset resolution: the q in [-M, M] with q = c (mod k) nearest to z (ties: the larger).

    c: int64 (n,) residues in [0, k); z: float32 (n,) the side information in lattice units
    (+-inf count as beyond the lattice's ends, NaN as 0).  Returns int64 (n,).  Exact whenever
    |z - q_sent| < k/2."""
    M = _levels(bits)
    k = 1 << nested_bits
    zz = torch.nan_to_num(z.to(torch.float64), nan=0.0, posinf=M + k, neginf=-(M + k))
    zz = zz.clamp(-(M + k), M + k)
    t = torch.floor((zz - c.to(torch.float64)) / k + 0.5).to(torch.int64)
    qh = c + k * t
    lo = torch.remainder(c + M, k) - M            # smallest member of the coset >= -M
    hi = lo + k * torch.div(M - lo, k, rounding_mode="floor")   # largest <= M
    return torch.minimum(torch.maximum(qh, lo), hi)


# --- kernel launch helpers --------------------------------------------------------------------

def _key(key) -> Tuple[int, int, int, int]:
    return (u32(key.seed, "seed"), u32(key.rank, "rank"), u32(key.tensor_id, "tensor_id"),
            u32(key.step, "step"))


def _bucket(bucket_size) -> int:
    return check_int(bucket_size, "bucket_size", 1, 2**62)


def _bucket_block(bs: int) -> int:
    """Threads per block of the per-bucket kernels (each thread takes groups of 8
    coordinates; the checks are sums mod 2**32, exact in any order)."""
    return reduce_block(bs // 8 + 1)


def _serves(out: torch.Tensor) -> bool:
    """Whether a decode kernel can add into ``out`` (a contiguous float32 (n,))."""
    return out.dtype == torch.float32 and out.dim() == 1 and out.is_contiguous()


def _encode_args(be, x, delta, bits, bucket_size):
    """The encode kernels' checked arguments: (bits, x, delta, bucket_size)."""
    b = check_int(bits, "bits", 2, 8)
    x = check_tensor(be, x, "x", torch.float32)
    bs = _bucket(bucket_size)
    delta = check_tensor(be, delta, "delta", torch.float32, _nb(x.numel(), bs), device=x.device)
    return b, x, delta, bs


def _quantize_pack(be, x, delta, b, bs, nbits, key) -> torch.Tensor:
    """Kernel hvd_dqsg_quantize_pack on checked arguments: the codes q + M packed at ``b``
    bits (nbits 0), or the residues q mod 2**nbits packed at ``nbits``."""
    n = x.numel()
    out = torch.empty(packed_size(n, nbits or b), dtype=torch.uint8, device=x.device)
    if n:
        be.launch("hvd_dqsg_quantize_pack", grid_for((n + 7) // 8), BLOCK,
                  (x, n, delta, bs, b, nbits, *_key(key), out))
    return out


# --- encode -----------------------------------------------------------------------------------

def _over_levels(m: torch.Tensor, bits: int) -> torch.Tensor:
    """float32(m / M), correctly rounded, the same bits on every device: float32 (nb,)
    (:func:`hvdcomp.ops.divide`: ``m / M`` by a Python number is a multiplication by
    float32(1/M) on CUDA, which rounds differently for a third of the inputs)."""
    return divide(m, _levels(bits))


@op
def bucket_steps(x: torch.Tensor, bits: int, bucket_size: int) -> torch.Tensor:
    """Delta_b = min(float32(max_{i in b} |x_i| / M), max_step(bits)): float32 (nb,) for a
    flat finite float32 x (n,), nb = ceil(n / bucket_size)."""
    xp = padded_buckets(x.abs().to(torch.float32), bucket_size)
    return _over_levels(xp.amax(dim=1), bits).clamp_(max=max_step(bits))


@bucket_steps.kernel
def _(be, x, bits, bucket_size):
    # the bucket max |x| is kernel hvd_bucket_norms_linf (exact); the division by M is the
    # reference's (_over_levels: correctly rounded on the CPU and on CUDA)
    b = check_int(bits, "bits", 2, 8)
    x = check_tensor(be, x, "x", torch.float32)
    bs = _bucket(bucket_size)
    n = x.numel()
    nb = _nb(n, bs)
    m = torch.empty(nb, dtype=torch.float32, device=x.device)
    if nb:
        be.launch("hvd_bucket_norms_linf", min(nb, MAX_GRID), reduce_block(bs), (x, n, bs, m))
    return _over_levels(m, b).clamp_(max=max_step(b))


def variance_steps(x: torch.Tensor, bits: int, bucket_size: int,
                   target: float) -> torch.Tensor:
    """Steps set by a normalized variance ``target`` (> 0) instead of by the bucket maximum:
    float32 (nb,) for a flat finite float32 x (n,), nb = ceil(n / bucket_size).

    The subtractive dither makes the error of a step Delta uniform, with variance
    Delta**2 / 12 per coordinate whatever x is, so per bucket b of n_b coordinates

        Delta*_b = float32(||x_b||_2) * float32(sqrt(12 target / n_b))
        Delta_b  = min(max(Delta*_b, bucket_steps_b), max_step(bits))    (0 for a zero bucket)

    gives E||x_hat_b - x_b||^2 = target ||x_b||^2 wherever Delta*_b wins.  ``bucket_steps``
    (max |x| / M) is the smallest step whose codes fit in [-M, M]: a bucket whose maximum lies
    beyond M Delta*_b gets that larger step, and more variance than the target.  With
    entropy-coded codes the rate then follows the gradient's distribution (uniform steps with
    entropy coding: Gish & Pierce, IEEE Trans. Inf. Theory 14(5), 1968; with a subtractive
    dither: Zamir & Feder, IEEE Trans. Inf. Theory 38(2), 1992).  ||x_b||_2 is
    hvdcomp.ops.quantize.bucket_norms (a float64 sum rounded once), the product and the
    maximum are float32 operations rounded once: the same bits on the CPU and on CUDA."""
    if not target > 0:
        raise ValueError(f"target must be > 0, got {target}")
    from .quantize import bucket_norms              # (quantize imports nothing from here)
    by_max = bucket_steps(x, bits, bucket_size)
    nb = by_max.numel()
    bs = _bucket(bucket_size)
    counts = np.full(nb, float(bs))
    if nb:
        counts[-1] = x.numel() - (nb - 1) * bs
    scale = torch.from_numpy(np.sqrt(12.0 * float(target) / counts).astype(np.float32))
    return _at_least(bucket_norms(x, bs, "l2") * scale.to(x.device), by_max, bits)


def _at_least(star: torch.Tensor, by_max: torch.Tensor, bits: int) -> torch.Tensor:
    """min(max(star, by_max), max_step(bits)), 0 where by_max is 0 (a zero bucket): the
    steps of :func:`variance_steps` and :func:`floor_steps` from their wanted ``star``."""
    delta = torch.maximum(star, by_max).clamp_(max=max_step(bits))
    return torch.where(by_max > 0, delta, torch.zeros_like(delta))


def floor_steps(x: torch.Tensor, bits: int, bucket_size: int, step: float) -> torch.Tensor:
    """Steps from one step for every bucket (set elsewhere, e.g. model-wide from a mean
    square) instead of from each bucket's own norm: float32 (nb,) for a flat finite float32
    x (n,), nb = ceil(n / bucket_size),

        Delta_b = min(max(float32(step), bucket_steps_b), max_step(bits))   (0 for a zero bucket)

    ``step`` >= 0 and finite (ValueError otherwise); as in :func:`variance_steps`, a bucket
    whose maximum lies beyond M steps gets the larger step max |x_b| / M so that its codes
    fit in [-M, M].  The same bits on the CPU and on CUDA (a maximum of float32s)."""
    if not (math.isfinite(step) and step >= 0):
        raise ValueError(f"step must be finite and >= 0, got {step}")
    by_max = bucket_steps(x, bits, bucket_size)
    return _at_least(torch.full_like(by_max, float(np.float32(min(step, max_step(bits))))),
                     by_max, bits)


@op
def dqsg_encode(x: torch.Tensor, delta: torch.Tensor, bits: int, bucket_size: int,
                key) -> torch.Tensor:
    """DQSG's codes q + M packed at ``bits``: uint8 (ceil(n * bits / 8),), for x flat finite
    float32 (n,) with its steps delta float32 (nb,) and the dither of ``key``."""
    q = dqsg_quantize(x, delta, bits, bucket_size, dither(x.numel(), key, device=x.device))
    return pack_bits(q + _levels(bits), bits)


@dqsg_encode.kernel
def _(be, x, delta, bits, bucket_size, key):
    b, x, delta, bs = _encode_args(be, x, delta, bits, bucket_size)
    return _quantize_pack(be, x, delta, b, bs, 0, key)


@op
def nested_encode(x: torch.Tensor, delta: torch.Tensor, bits: int, nested_bits: int,
                  bucket_size: int, key) -> Tuple[torch.Tensor, torch.Tensor]:
    """NDQSG's nested message for x as :func:`dqsg_encode`: (residues q mod k packed at
    ``nested_bits``, uint8 (ceil(n * nested_bits / 8),); checks S_b, int64 (nb,) holding
    uint32 values), k = 2**nested_bits, 1 <= nested_bits < bits."""
    n = x.numel()
    q = dqsg_quantize(x, delta, bits, bucket_size, dither(n, key, device=x.device))
    residues = pack_bits(q & ((1 << nested_bits) - 1), nested_bits)
    return residues, bucket_checksums(q, check_weights(n, key, device=x.device), bucket_size)


@nested_encode.kernel
def _(be, x, delta, bits, nested_bits, bucket_size, key):
    b, x, delta, bs = _encode_args(be, x, delta, bits, bucket_size)
    residues = _quantize_pack(be, x, delta, b, bs,
                              check_int(nested_bits, "nested_bits", 1, b - 1), key)
    n = x.numel()
    nb = _nb(n, bs)
    check = torch.empty(nb, dtype=torch.int32, device=x.device)
    if nb:
        be.launch("hvd_ndqsg_checks", min(nb, MAX_GRID), _bucket_block(bs),
                  (x, n, delta, bs, b, *_key(key), check))
    return residues, check.to(torch.int64) & _MASK


# --- decode -----------------------------------------------------------------------------------

@op
def validate_codes(packed: torch.Tensor, n: int, delta: torch.Tensor, bucket_size: int,
                   width: int, zero_code: int, max_code: int) -> Tuple[bool, bool]:
    """Checks of received codes: (any code > max_code, any code != zero_code in a bucket with
    delta == 0) for n codes packed at ``width`` bits (uint8 (ceil(n * width / 8),)) and
    delta float32 (nb,)."""
    codes = unpack_bits(packed, n, width)
    zero = per_coordinate(delta == 0, bucket_size, n)
    return bool((codes > max_code).any()), bool((zero & (codes != zero_code)).any())


@validate_codes.kernel
def _(be, packed, n, delta, bucket_size, width, zero_code, max_code):
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


@op
def dqsg_decode_add(packed: torch.Tensor, n: int, delta: torch.Tensor, bits: int,
                    bucket_size: int, out: torch.Tensor, key) -> torch.Tensor:
    """``out += x_hat`` of a DQSG message: n codes q + M packed at ``bits`` (validated), its
    steps delta float32 (nb,) and the dither of ``key``; out float32 (n,), updated in place
    and returned.  The reference computes x_hat on the CPU (the kernel gives the same bits on
    either device)."""
    q = unpack_bits(packed.cpu(), n, bits) - _levels(bits)
    x_hat = dqsg_reconstruct(delta.cpu(), q, dither(n, key), bucket_size)
    return out.add_(x_hat.to(out.device))


def _decode_args(be, packed, n, delta, bits, bucket_size, out):
    """The decode-add kernels' checked arguments: (packed, n, delta, bucket_size, bits,
    out), codes packed at ``bits`` into a contiguous float32 (n,) ``out``."""
    b = check_int(bits, "bits", 2, 8)
    n = check_int(n, "n", 0, 2**62)
    bs = _bucket(bucket_size)
    out = check_tensor(be, out, "out", torch.float32, n, output=True)
    dev = out.device
    packed = check_tensor(be, packed, "packed", torch.uint8, packed_size(n, b), device=dev)
    delta = check_tensor(be, delta, "delta", torch.float32, _nb(n, bs), device=dev)
    return packed, n, delta, bs, b, out


@dqsg_decode_add.kernel
def _(be, packed, n, delta, bits, bucket_size, out, key):
    if not _serves(out):
        return NotImplemented
    packed, n, delta, bs, b, out = _decode_args(be, packed, n, delta, bits, bucket_size, out)
    if n:
        be.launch("hvd_dqsg_decode_add", grid_for((n + 7) // 8), BLOCK,
                  (packed, n, delta, bs, b, *_key(key), out))
    return out


@op
def nested_decode_add(packed: torch.Tensor, n: int, delta: torch.Tensor, check: torch.Tensor,
                      side_sum: torch.Tensor, group: int, bits: int, nested_bits: int,
                      bucket_size: int, out: torch.Tensor, key) -> torch.Tensor:
    """``out += x_hat`` of one nested NDQSG message, decoded with side information
    y = side_sum / group (module docstring); returns the failed buckets, bool (nb,), on
    out's device.

    packed: n residues at ``nested_bits`` (validated); delta float32 (nb,); check: the sent
    S_b, int64 or int32 (nb,) holding uint32 values; side_sum float32 (n,): the sum of the
    DQSG group's reconstructions in rank order; out float32 (n,).  The reference computes on
    the CPU (a division by the scalar ``group`` rounds differently on CUDA); the kernel gives
    the same bits on either device."""
    dev = out.device
    delta, check = delta.cpu(), check.cpu().to(torch.int64) & _MASK
    c = unpack_bits(packed.cpu(), n, nested_bits)
    y = side_sum.cpu() / group
    s = dither(n, key)
    d = per_coordinate(delta, bucket_size, n)
    z = y / torch.where(d > 0, d, torch.ones_like(d)) + s
    qh = nested_resolve(c, z, bits, nested_bits)
    qh = torch.where(d > 0, qh, torch.zeros_like(qh))
    failed = bucket_checksums(qh, check_weights(n, key), bucket_size) != check
    v = torch.where(per_coordinate(failed, bucket_size, n), y,
                    dqsg_reconstruct(delta, qh, s, bucket_size))
    out.add_(v.to(dev))
    return failed.to(dev)


@nested_decode_add.kernel
def _(be, packed, n, delta, check, side_sum, group, bits, nested_bits, bucket_size, out, key):
    if not _serves(out):
        return NotImplemented
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
        check = (check.to(torch.int64) & _MASK).to(torch.int32)   # the same 32 bits
    check = check_tensor(be, check, "check", torch.int32, nb, device=dev)
    side_sum = check_tensor(be, side_sum, "side_sum", torch.float32, n, device=dev)
    failed = torch.zeros(nb, dtype=torch.uint8, device=dev)
    if nb:
        be.launch("hvd_ndqsg_resolve_add", min(nb, MAX_GRID), _bucket_block(bs),
                  (packed, n, delta, check, side_sum, g, bs, b, nbits, *_key(key), out,
                   failed))
    return failed.bool()


# --- uniformef: nearest rounding on the steps, no dither --------------------------------------

@op
def uniform_encode(x: torch.Tensor, delta: torch.Tensor, bits: int,
                   bucket_size: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """uniformef's quantizer (hvdcomp.compressors.uniformef, module docstring): for x flat
    finite float32 (n,) and its steps delta float32 (nb,), per coordinate i of bucket b,
    D_b = Delta_b (1 where Delta_b = 0), M = 2**(bits-1) - 1,

        q_i = clamp(floor(float32(x_i / D_b) + 0.5), -M, M)
        e_i = float32(x_i - float32(q_i * Delta_b))

    Returns (codes q + M packed at ``bits``: uint8 (ceil(n * bits / 8),), the residuals e:
    float32 (n,), a new tensor): DQSG's quantizer (:func:`dqsg_quantize`) with a zero
    dither.  The same bits from the kernel on either device."""
    q = dqsg_quantize(x, delta, bits, bucket_size, torch.zeros_like(x))
    residual = x - q.to(torch.float32) * per_coordinate(delta, bucket_size, x.numel())
    return pack_bits(q + _levels(bits), bits), residual


@uniform_encode.kernel
def _(be, x, delta, bits, bucket_size):
    b, x, delta, bs = _encode_args(be, x, delta, bits, bucket_size)
    n = x.numel()
    packed = torch.empty(packed_size(n, b), dtype=torch.uint8, device=x.device)
    residual = torch.empty(n, dtype=torch.float32, device=x.device)
    if n:
        be.launch("hvd_uniform_round_pack", grid_for((n + 7) // 8), BLOCK,
                  (x, n, delta, bs, b, residual, packed))
    return packed, residual


@op
def uniform_decode_add(packed: torch.Tensor, n: int, delta: torch.Tensor, bits: int,
                       bucket_size: int, out: torch.Tensor) -> torch.Tensor:
    """``out += x_hat`` of a uniformef message: n codes q + M packed at ``bits`` (validated
    before: :func:`validate_codes`), its steps delta float32 (nb,); x_hat_i =
    float32(float32(q_i) * Delta_b); out float32 (n,) on the codes' device, updated in place
    and returned."""
    q = unpack_bits(packed, n, bits) - _levels(bits)
    return out.add_(q.to(torch.float32) * per_coordinate(delta, bucket_size, n))


@uniform_decode_add.kernel
def _(be, packed, n, delta, bits, bucket_size, out):
    if not _serves(out):
        return NotImplemented
    packed, n, delta, bs, b, out = _decode_args(be, packed, n, delta, bits, bucket_size, out)
    if n:
        be.launch("hvd_uniform_decode_add", grid_for((n + 7) // 8), BLOCK,
                  (packed, n, delta, bs, b, out))
    return out
