"""LAQ / SLAQ's innovation quantizer on the kernel backends (kernels/laq.cu).

Every function takes the backend's launch object first (``be``: ``hvdcomp.backends.host.backend``
or ``hvdcomp.backends.cuda.backend``) and works on that backend's device.

    encode(be, x, q, bits) -> Innovation(R, packed, qnew, eps_sq, delta_sq), or None when
                              some x - q is not finite
    dequantize_add(be, packed, n, R, bits, out) -> out (+= the decoded innovation)

Bit for bit equal to the reference in hvdcomp/compressors/laq.py (on the host and the GPU,
for any thread count): with ``v = x - q`` (q = 0 when None),
``R, codes = quantize_innovation(v, bits)``, ``delta = dequantize_innovation(R, codes, bits)``:
``packed == pack_bits(codes, bits)``, ``qnew == q + delta``,
``eps_sq == fixed_sum((qnew - x).double().pow(2))`` and
``delta_sq == fixed_sum(delta.double().pow(2))``.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import math

import torch

from ._common import check_int, check_tensor, grid_for, packed_size

__all__ = ["encode", "dequantize_add", "Innovation"]

GROUPS = 256                 # threads per block of the summing kernels (fixes the order)
CHUNK = 8 * GROUPS           # coordinates per block


class Innovation(NamedTuple):
    """What LAQ.encode needs from one quantized innovation."""
    R: torch.Tensor          # float32 0-d, max |x - q| (on x's device)
    packed: torch.Tensor     # uint8 (ceil(n * bits / 8),), codes packed LSB-first
    qnew: torch.Tensor       # float32 (n,), q + delta
    eps_sq: float            # fixed_sum((qnew - x)^2)
    delta_sq: float          # fixed_sum(delta^2)


def _bits(bits) -> int:
    return check_int(bits, "bits", 1, 8)


def _finish_sums(be, sums: torch.Tensor, n: int, narrays: int) -> torch.Tensor:
    """Run hvd_laq_sum_stage until each of the ``narrays`` arrays of ``n`` chunk sums in
    ``sums`` is one value (fixed_sum's later stages).  Returns float64 (narrays,)."""
    while n > 1:
        c = (n + CHUNK - 1) // CHUNK
        out = torch.empty(narrays * c, dtype=torch.float64, device=sums.device)
        be.launch("hvd_laq_sum_stage", min(narrays * c, 2**31 - 1), GROUPS,
                  (sums, n, narrays, out))
        sums, n = out, c
    return sums


def encode(be, x: torch.Tensor, q: Optional[torch.Tensor], bits: int) -> Optional[Innovation]:
    """Quantize the innovation ``x - q`` of flat float32 ``x`` (n,) against the last quantized
    gradient ``q`` (float32 (n,), or None: zeros) on a ``bits``-bit grid (1..8).

    Returns an Innovation (see the module docstring for how it equals the reference), or None
    when some ``x - q`` is NaN or infinite (LAQ's NONFINITE policy; nothing computed then).
    Raises TypeError / ValueError for wrong dtypes, devices, shapes or ``bits``.
    Synchronizes once (R is needed on the host) and once more for the two sums.
    """
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
    nchunks = (n + CHUNK - 1) // CHUNK
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


def dequantize_add(be, packed: torch.Tensor, n: int, R, bits: int,
                   out: torch.Tensor) -> torch.Tensor:
    """``out += dequantize_innovation(R, unpack_bits(packed, n, bits), bits)``, bit for bit.

    packed: uint8 (ceil(n * bits / 8),) on out's device; R: float (or a float32 0-d tensor),
    the message's radius; out: float32 (n,), contiguous, updated in place and returned."""
    b = _bits(bits)
    n = check_int(n, "n", 0, 2**62)
    out = check_tensor(be, out, "out", torch.float32, n, output=True)
    packed = check_tensor(be, packed, "packed", torch.uint8, packed_size(n, b),
                          device=out.device)
    r = float(R)
    if n:
        be.launch("hvd_laq_dequantize_add", grid_for((n + 7) // 8), 256, (packed, n, r, b, out))
    return out
