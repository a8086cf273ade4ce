"""LAQ's innovation quantizer: the PyTorch references (the specification) and their kernels
(kernels/laq.cu).

Source: Sun, Chen, Giannakis, Yang, "Communication-Efficient Distributed Learning via Lazily
Aggregated Quantized Gradients", NeurIPS 2019 (arXiv 1909.07588), Sec. 2: the innovation
``v = x - Qprev`` of a gradient against the last quantized gradient is quantized on the
uniform grid of ``2**bits`` points over ``[-R, R]``, ``R = max |v_i|`` (hvdcomp/compressors/
laq.py, module docstring, has the grid, the rounding and the lazy rule that uses the sums).

References: :func:`fixed_sum` (a float64 sum in one fixed order), :func:`quantize_innovation`,
:func:`dequantize_innovation`.  Ops (an :class:`~hvdcomp.ops.Op` runs the kernel where a
kernel backend serves the device of its first tensor, else the reference; both give the
same values bit for bit, on the host and the GPU, for any thread count)::

    encode_innovation(x, q, bits) -> Innovation(R, packed, qnew, eps_sq, delta_sq), or None
                                     when some x - q is not finite
    dequantize_add(packed, n, R, bits, out) -> out (+= the decoded innovation)
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional, Tuple

import torch

from ..backends._common import check_int, check_tensor, grid_for, packed_size
from .bitpack import pack_bits, unpack_bits
from . import op

__all__ = ["fixed_sum", "quantize_innovation", "dequantize_innovation", "Innovation",
           "encode_innovation", "dequantize_add", "FIXED_SUM_CHUNK"]

GROUPS = 256                        # threads per block of the summing kernels (fixes the order)
FIXED_SUM_CHUNK = 8 * GROUPS        # coordinates per block: 256 groups of 8


# ---- the references -------------------------------------------------------------------------

def fixed_sum(t: torch.Tensor) -> float:
    """The sum of the float64 values of flat ``t`` in a fixed order (kernels/laq.cu's):
    pad with zeros to a multiple of 2048; per chunk of 2048, each group of 8 (t0..t7) as
    ((t0 + t1) + (t2 + t3)) + ((t4 + t5) + (t6 + t7)), then the 256 group sums folded in
    halves (s[j] = s[j] + s[j + w] for w = 128, 64, ..., 1); repeat on the chunk sums until
    one value is left.  Elementwise float64 additions only, so the result is the same on
    every device and for every thread count (torch.sum's order is neither).  0.0 if empty.
    Padding adds +0.0: exact for the non-negative terms LAQ sums."""
    t = t.reshape(-1).to(torch.float64)
    if t.numel() == 0:
        return 0.0
    while True:
        n = t.numel()
        c = (n + FIXED_SUM_CHUNK - 1) // FIXED_SUM_CHUNK
        if c * FIXED_SUM_CHUNK != n:
            t = torch.cat([t, t.new_zeros(c * FIXED_SUM_CHUNK - n)])
        g = t.view(c, FIXED_SUM_CHUNK // 8, 8)
        s = ((g[..., 0] + g[..., 1]) + (g[..., 2] + g[..., 3])) \
            + ((g[..., 4] + g[..., 5]) + (g[..., 6] + g[..., 7]))
        w = s.shape[1] // 2
        while w >= 1:
            s = s[:, :w] + s[:, w:2 * w]
            w //= 2
        t = s[:, 0]
        if c == 1:
            return float(t[0])


def quantize_innovation(v: torch.Tensor, bits: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """The paper's deterministic quantizer of a flat float32 innovation ``v``.

    Returns ``(R, codes)``: R = max|v_i| as a float32 0-d tensor and int64 codes
    ``clamp(floor((v_i + R) * L / (2R) + 1/2), 0, L)`` (float64 arithmetic, a tie goes up),
    L = 2**bits - 1; all codes 0 when R = 0.
    """
    n = v.numel()
    R = v.abs().max() if n else torch.zeros((), dtype=torch.float32, device=v.device)
    L = (1 << bits) - 1
    if n == 0 or float(R) == 0.0:
        return R, torch.zeros(n, dtype=torch.int64, device=v.device)
    r = R.double()
    u = (v.double() + r) * L / (2.0 * r)
    return R, torch.floor(u + 0.5).clamp_(0, L).to(torch.int64)


def dequantize_innovation(R: torch.Tensor, codes: torch.Tensor, bits: int) -> torch.Tensor:
    """float32 ``R * (2 c - L) / L`` (float64 arithmetic, rounded once): the grid point of
    each code.  The sender adds exactly this to its Qprev, every receiver to its aggregate."""
    L = (1 << bits) - 1
    return (R.double() * (2 * codes - L).double() / L).to(torch.float32)


class Innovation(NamedTuple):
    """One quantized innovation: what LAQ's lazy rule and message need."""
    R: torch.Tensor          # float32 0-d, max |x - q| (on x's device)
    packed: torch.Tensor     # uint8 (ceil(n * bits / 8),), the codes packed LSB-first
    qnew: torch.Tensor       # float32 (n,), q + delta
    eps_sq: float            # fixed_sum((qnew - x)^2)
    delta_sq: float          # fixed_sum(delta^2)


@op
def encode_innovation(x: torch.Tensor, q: Optional[torch.Tensor], bits: int
                      ) -> Optional[Innovation]:
    """Quantize the innovation ``v = x - q`` of flat float32 ``x`` (n,) against the last
    quantized gradient ``q`` (float32 (n,), or None: zeros) on a ``bits``-bit grid (1..8).

    With ``R, codes = quantize_innovation(v, bits)`` and
    ``delta = dequantize_innovation(R, codes, bits)``: returns
    ``Innovation(R, pack_bits(codes, bits), q + delta, fixed_sum((q + delta - x)^2),
    fixed_sum(delta^2))`` (squares of the float32 values in float64), or None when some
    ``x - q`` is NaN or infinite (LAQ's NONFINITE policy).
    """
    qq = torch.zeros_like(x) if q is None else q
    v = x - qq
    if v.numel() and not bool(torch.isfinite(v).all()):
        return None
    R, codes = quantize_innovation(v, bits)
    delta = dequantize_innovation(R, codes, bits)
    qnew = qq + delta
    return Innovation(R, pack_bits(codes, bits), qnew, fixed_sum((qnew - x).double().pow(2)),
                      fixed_sum(delta.double().pow(2)))


@op
def dequantize_add(packed: torch.Tensor, n: int, R, bits: int,
                   out: torch.Tensor) -> torch.Tensor:
    """``out += dequantize_innovation(R, unpack_bits(packed, n, bits), bits)``.

    packed: uint8 (ceil(n * bits / 8),) on out's device; R: the message's radius, a float32
    0-d tensor or a float holding a float32 value; out: float32 (n,), updated in place and
    returned."""
    R = torch.as_tensor(R, dtype=torch.float32, device=packed.device)
    return out.add_(dequantize_innovation(R, unpack_bits(packed, n, bits), bits))


# ---- the kernels ----------------------------------------------------------------------------
# Each kernel implementation receives the launch object ``be`` first, checks its arguments
# (TypeError for a wrong type or dtype, ValueError for a wrong device, shape, layout or
# range), allocates its outputs on the inputs' device and launches.

def _bits(bits) -> int:
    return check_int(bits, "bits", 1, 8)


def _finish_sums(be, sums: torch.Tensor, n: int, narrays: int) -> torch.Tensor:
    """Run hvd_laq_sum_stage until each of the ``narrays`` arrays of ``n`` chunk sums in
    ``sums`` is one value (fixed_sum's later stages).  Returns float64 (narrays,)."""
    while n > 1:
        c = (n + FIXED_SUM_CHUNK - 1) // FIXED_SUM_CHUNK
        out = torch.empty(narrays * c, dtype=torch.float64, device=sums.device)
        be.launch("hvd_laq_sum_stage", min(narrays * c, 2**31 - 1), GROUPS,
                  (sums, n, narrays, out))
        sums, n = out, c
    return sums


@encode_innovation.kernel
def _(be, x, q, bits):
    """Synchronizes once (R is needed on the host) and once more for the two sums."""
    b = _bits(bits)
    x = check_tensor(be, x, "x", torch.float32)
    n = x.numel()
    dev = x.device
    if q is not None:
        q = check_tensor(be, q, "q", torch.float32, n, device=dev)
    has_q = 1 if q is not None else 0
    qq = q if q is not None else x            # not read when has_q == 0
    if n == 0:
        return Innovation(torch.zeros((), dtype=torch.float32, device=dev),
                          torch.empty(0, dtype=torch.uint8, device=dev),
                          torch.empty(0, dtype=torch.float32, device=dev), 0.0, 0.0)
    nchunks = (n + FIXED_SUM_CHUNK - 1) // FIXED_SUM_CHUNK
    grid = min(nchunks, 2**31 - 1)
    part = torch.empty(nchunks, dtype=torch.float32, device=dev)
    be.launch("hvd_laq_absmax", grid, GROUPS, (x, qq, has_q, n, part))
    R = part.amax()                           # max is exact in any order; NaN propagates
    r = float(R)
    if not math.isfinite(r):
        return None
    qnew = torch.empty(n, dtype=torch.float32, device=dev)
    packed = torch.empty(packed_size(n, b), dtype=torch.uint8, device=dev)
    sums = torch.empty(2 * nchunks, dtype=torch.float64, device=dev)
    be.launch("hvd_laq_quantize", grid, GROUPS, (x, qq, has_q, n, r, b, qnew, packed, sums))
    e, d = _finish_sums(be, sums, nchunks, 2).tolist()
    return Innovation(R, packed, qnew, e, d)


@dequantize_add.kernel
def _(be, packed, n, R, bits, out):
    b = _bits(bits)
    n = check_int(n, "n", 0, 2**62)
    if out.numel() != n:
        raise ValueError(f"out must have {n} elements, got shape {tuple(out.shape)}")
    if not (out.dtype == torch.float32 and out.dim() == 1 and out.is_contiguous()):
        return NotImplemented
    out = check_tensor(be, out, "out", torch.float32, n, output=True)
    packed = check_tensor(be, packed, "packed", torch.uint8, packed_size(n, b),
                          device=out.device)
    r = float(R)
    if n:
        be.launch("hvd_laq_dequantize_add", grid_for((n + 7) // 8), 256, (packed, n, r, b, out))
    return out
