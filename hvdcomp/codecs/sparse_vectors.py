"""Sparse vectors on the wire: Golomb-Rice coded index gaps and fp32 / fp16 / 8- or 4-bit values.

The sparsifying compressors (hvdcomp.compressors.sparsifiers: ``topk``, ``randk``,
``dgc``) send ``m`` selected coordinates of a tensor of ``numel`` elements.  DGC's paper
(Lin et al., ICLR 2018, arXiv 1712.01887) sends 32-bit values plus 16-bit run lengths of
zeros, i.e. 48 bits per selected coordinate.  Here the indices cost about
``log2(numel / m) + 1.5`` bits each (about 11.5 bits at density 0.1 %) and the values 32,
16, 8.125 or 4.125 bits.

Index section (``encode_indices`` / ``decode_indices``; all integers little-endian)
---------------------------------------------------------------------------------------

The indices ``i_0 < i_1 < ... < i_{m-1}`` (int64; strictly increasing; all < numel) are sent
as gaps minus one, ``d_0 = i_0`` and ``d_j = i_j - i_{j-1} - 1`` (so every ``d_j >= 0`` and
a non-increasing sequence cannot even be expressed), each Golomb-Rice coded with one
parameter ``k`` for the section: ``d = q * 2**k + r`` with ``0 <= r < 2**k``.

    offset    size  field
    0         1     k, the Rice parameter, 0..62 (0 when m = 0)
    1         W     m, the number of indices: u32 if numel < 2**32, else u64 (W = 4 or 8:
                    the width follows the tensor's size); m <= numel
    1+W       U     unary stream: for each j in order, q_j one-bits then one zero-bit, in
                    one LSB-first bit stream (bit b of the stream is bit b % 8 of byte
                    b // 8); padded with zero bits to a whole byte.  Its length is
                    U = ceil((m + sum q_j) / 8) bytes.
    1+W+U     R     remainders: r_j in k bits each, LSB-first, packed exactly as the
                    quantizers pack their codes (r_j occupies stream bits
                    [j*k, (j+1)*k)); R = ceil(m * k / 8) bytes; unused high bits zero.

U is what remains of the section after the fixed parts, so the section needs no length
field of its own.  Decoding is vectorized: the quotients are the distances between the zero
bits of the unary stream (``q_0 = z_0``, ``q_j = z_j - z_{j-1} - 1`` for the positions
``z_j`` of its first m zero bits).

Choice of k: from the mean gap ``mu = sum d / m``, Kiely's rule for geometrically
distributed gaps ("Selecting the Golomb parameter in Rice coding", IPN Progress Report
42-159, 2004): ``k0 = max(0, 1 + floor(log2(ln(phi - 1) / ln(mu / (mu + 1)))))`` with phi
the golden ratio (k0 = 0 for mu = 0; ln(mu / (mu + 1)) evaluated as log1p(-1 / (mu + 1)),
k0 capped at 62); then, as gaps are not exactly geometric, the one of
``k0 - 1, k0, k0 + 1`` (within 0..62) that gives the fewest bits ``m (k + 1) + sum(d >> k)``,
the smaller on a tie.  The decoder reads k from the section; any k in 0..62 is valid.

The coding itself (NumPy specification and kernels/rice.cu, the parameter choice, the
checks) is hvdcomp.ops.rice; this module gives its sections as host bytes.

Values section (``encode_values`` / ``decode_values``)
------------------------------------------------------

``bits`` 32 or 16: m values, float32 (4 bytes) or float16 (2 bytes) little-endian, in
index order.  float16 values are the float32 values rounded to nearest even after clamping
to +-65504 (the largest finite float16; senders with error feedback keep the difference).

``bits`` 8 or 4 (quantized values, as the slow-link systems that combine sparsification
with quantization send them, e.g. CocktailSGD: Wang et al., ICML 2023): the m
values in blocks of ``VALUE_BLOCK`` = 256 (the last block shorter), each block with one
scale ``s`` = its largest magnitude, and each value a signed integer ``q`` in [-Q, Q],
``Q = 2**(bits - 1) - 1`` (127 or 7), rounded to NEAREST (ties to even; deterministic: the
senders of these messages keep the rounding error as error feedback):

    q = round((v / s) * Q)            float32, 0 where s = 0
    decoded value = (q / Q) * s       float32, in this order (no overflow, no division by 0)

    offset    size                field
    0         4 ceil(m / 256)     the scales, float32 little-endian, finite, >= 0 (not -0)
    4 nb      ceil(m bits / 8)    the codes u = q + Q in [0, 2Q], ``bits`` each, LSB-first
                                  (value j in stream bits [j bits, (j + 1) bits)); unused
                                  high bits of the last byte zero

so a value costs ``bits + 32 / 256`` bits (8.125 or 4.125) where float32 costs 32: at density
0.1 % a selected coordinate costs about 11.5 + 8.125 bits instead of 11.5 + 32.  The
relative error of a value is at most ``s / (2 Q |v|)``.

Validation (``WireFormatError``, nothing decoded): a section shorter than its fixed part,
k > 62, m > numel, m = 0 with anything after the count or k != 0, fewer than m zero bits in
the unary stream, a unary stream longer than its last terminator's byte or with nonzero
padding, nonzero padding bits in the remainders, an index at or beyond numel, a value
section of the wrong length, non-finite values; for quantized values also a scale that is
negative (-0 included) or not finite, a code above 2Q, a nonzero code in a block of scale 0,
nonzero padding bits.

Example::

    sec = encode_indices(np.array([1, 4, 5, 13]), numel=16)
    bytes(sec).hex()        # '0104000000' + '72' + '09': k = 1, m = 4, unary, remainders
    decode_indices(sec, 16) # array([ 1,  4,  5, 13])
"""
from __future__ import annotations

from typing import Tuple

import numpy as np
import torch

from ..errors import WireFormatError
from ..ops import bitpack, rice

__all__ = ["encode_indices", "decode_indices", "encode_values", "decode_values",
           "VALUE_BITS", "VALUE_BLOCK", "FP16_MAX", "values_bytes"]

VALUE_BITS = (32, 16, 8, 4)
VALUE_BLOCK = 256
FP16_MAX = 65504.0


# --- indices -------------------------------------------------------------------------------------

def encode_indices(indices, numel: int, k: int = -1) -> np.ndarray:
    """The index section (module docstring) for ``indices``: int64 (NumPy array, torch
    tensor on any device, or sequence), strictly increasing, in [0, numel).  ``numel`` may
    be any size up to 2**63 - 1 (no tensor is needed: only the index values).  ``k`` forces
    a Rice parameter (0..62); -1 (default) chooses it (hvdcomp.ops.rice.rice_parameter).

    Returns uint8 bytes (NumPy, host memory): ``1 + W + ceil((m + sum q) / 8) +
    ceil(m k / 8)``.  Raises ValueError for indices that are not strictly increasing or
    out of range.  Coded on the indices' device (hvdcomp.ops.rice.encode).
    """
    return rice.encode(indices, numel, k).cpu().numpy()


def decode_indices(section, numel: int) -> np.ndarray:
    """Inverse of :func:`encode_indices`: the int64 indices (NumPy), strictly increasing,
    < numel.  ``section``: bytes, uint8 array or tensor (decoded on its device).  Raises
    WireFormatError for any malformed or inconsistent section (module docstring,
    "Validation")."""
    return rice.decode(section, numel).cpu().numpy()


# --- values --------------------------------------------------------------------------------------

def values_bytes(count: int, bits: int) -> int:
    """Bytes of the values section of ``count`` values at ``bits`` (module docstring)."""
    if bits >= 16:
        return count * bits // 8
    return 4 * -(-count // VALUE_BLOCK) + bitpack.packed_size(count, bits)


def _block_scales(v: torch.Tensor) -> torch.Tensor:
    """Per block of VALUE_BLOCK values, its largest magnitude (float32, v's device)."""
    m = v.numel()
    nb = -(-m // VALUE_BLOCK)
    pad = torch.zeros(nb * VALUE_BLOCK, dtype=torch.float32, device=v.device)
    pad[:m] = v.abs()
    return pad.view(nb, VALUE_BLOCK).amax(dim=1)


def _dequantize(codes: torch.Tensor, s: torch.Tensor, bits: int) -> torch.Tensor:
    """(q / Q) * s per value, float32, on the codes' device, from codes u = q + Q (any
    integer dtype) and ``s`` each value's block scale.  q / Q comes from a table divided
    on the host: CUDA divides a tensor by a number as a multiplication by its reciprocal,
    which differs in the last bit for some q, and a GPU sender must keep in its residual
    exactly what the receivers decode."""
    Q = 2 ** (bits - 1) - 1
    levels = (torch.arange(2 * Q + 1, dtype=torch.float32) - Q) / Q        # on the host
    return levels.to(codes.device)[codes.long()] * s.to(codes.device)


def _encode_quantized(v: torch.Tensor, bits: int) -> Tuple[np.ndarray, torch.Tensor]:
    Q = 2 ** (bits - 1) - 1
    m = v.numel()
    if m == 0:
        return np.zeros(0, dtype=np.uint8), v
    scales = _block_scales(v)
    s = scales.repeat_interleave(VALUE_BLOCK)[:m]
    # a block of scale 0 holds zeros only: divided by 1 they stay (+-) 0, code Q
    t = v / torch.where(s > 0, s, torch.ones_like(s))
    u = (torch.round(t * float(Q)).clamp(-Q, Q) + Q).to(torch.uint8)
    sec = np.concatenate([scales.cpu().numpy().astype("<f4").view(np.uint8),
                          bitpack.pack_bits(u, bits).cpu().numpy()])
    return sec, _dequantize(u, s, bits)


def encode_values(values: torch.Tensor, bits: int) -> Tuple[np.ndarray, torch.Tensor]:
    """Values section for float32 ``values`` (1-D, any device) at ``bits`` 32, 16, 8 or 4.

    Returns (uint8 bytes, float32 tensor of what the receiver will decode, on the values'
    device): the values themselves for 32 bits; for 16 bits the float16 rounding of the
    values clamped to +-65504; for 8 and 4 bits the values quantized per block of 256
    (module docstring).  The values must be finite (the sparsifiers check before they
    send).  Raises ValueError for another width.
    """
    v = values.detach().reshape(-1).to(torch.float32)
    if bits in (8, 4):
        return _encode_quantized(v, bits)
    if bits == 32:
        return v.cpu().numpy().astype("<f4").view(np.uint8), v
    if bits == 16:
        h = v.clamp(-FP16_MAX, FP16_MAX).to(torch.float16)
        return h.cpu().numpy().astype("<f2").view(np.uint8), h.to(torch.float32)
    raise ValueError(f"value bits must be 32, 16, 8 or 4, got {bits}")


def decode_values(section, count: int, bits: int) -> torch.Tensor:
    """``count`` float32 values from a values section of ``bits`` 32, 16, 8 or 4 (a CPU
    tensor).  Raises WireFormatError for a wrong length, non-finite values, and for
    quantized values a negative or non-finite scale, a code above 2Q or nonzero padding."""
    if bits not in VALUE_BITS:
        raise WireFormatError(f"value width {bits} bits; valid: 32, 16, 8, 4")
    b = rice.section_bytes(section)
    need = values_bytes(count, bits)
    if b.size != need:
        raise WireFormatError(f"values section has {b.size} bytes, {count} values of "
                              f"{bits} bits need {need}")
    if bits in (8, 4):
        return _decode_quantized(b, count, bits)
    dt = "<f4" if bits == 32 else "<f2"
    v = torch.from_numpy(np.frombuffer(b.tobytes(), dtype=dt).astype(np.float32))
    if count and not bool(torch.isfinite(v).all()):
        raise WireFormatError("values section holds NaN or Inf")
    return v


def _decode_quantized(b: np.ndarray, count: int, bits: int) -> torch.Tensor:
    if count == 0:
        return torch.zeros(0, dtype=torch.float32)
    nb = -(-count // VALUE_BLOCK)
    scales = np.frombuffer(b[:4 * nb].tobytes(), dtype="<f4").astype(np.float32)
    if not (np.isfinite(scales).all() and (scales >= 0).all()) or np.signbit(scales).any():
        raise WireFormatError("values section: a block scale is negative, NaN or Inf")
    u = rice.unpack_uint(b[4 * nb:], count, bits)           # checks the padding bits
    Q = 2 ** (bits - 1) - 1
    if int(u.max()) > 2 * Q:
        raise WireFormatError(f"values section: a code above {2 * Q} ({bits}-bit values)")
    s = np.repeat(scales, VALUE_BLOCK)[:count]
    if (u[s == 0] != Q).any():
        raise WireFormatError("values section: a block of scale 0 with a nonzero value")
    return _dequantize(torch.from_numpy(u), torch.from_numpy(s), bits)
