"""Sparse vectors on the wire: Golomb-Rice coded index gaps and fp32/fp16 values.

The sparsifying compressors (hvdcomp.compressors.sparse: ``topk``, ``randk``, ``dgc``) send
``m`` selected coordinates of a tensor of ``numel`` elements.  DGC's paper (Lin et al., ICLR
2018, arXiv 1712.01887) sends 32-bit values plus 16-bit run lengths of zeros, i.e.
48 bits per selected coordinate.  Here the indices cost about ``log2(numel / m) + 1.5`` bits
each (about 11.5 bits at density 0.1 %) and the values 32 or 16 bits.

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
    1+W+U     R     remainders: r_j in k bits each, LSB-first, packed exactly as
                    hvdcomp.ops.bitpack packs codes (r_j occupies stream bits
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

Values section (``encode_values`` / ``decode_values``)
------------------------------------------------------

    m values, float32 (4 bytes) or float16 (2 bytes) little-endian, in index order.
    float16 values are the float32 values rounded to nearest even after clamping to
    +-65504 (the largest finite float16; senders with error feedback keep the difference).

Validation (``WireFormatError``, nothing decoded): a section shorter than its fixed part,
k > 62, m > numel, m = 0 with anything after the count or k != 0, fewer than m zero bits in
the unary stream, a unary stream longer than its last terminator's byte or with nonzero
padding, nonzero padding bits in the remainders, an index at or beyond numel, a value
section of the wrong length, non-finite values.

Example::

    sec = encode_indices(np.array([1, 4, 5, 13]), numel=16)
    bytes(sec).hex()        # '0104000000' + '72' + '09': k = 1, m = 4, unary, remainders
    decode_indices(sec, 16) # array([ 1,  4,  5, 13])
"""
from __future__ import annotations

import math
import struct
from typing import Tuple

import numpy as np
import torch

from ..errors import WireFormatError
from ..ops.bitpack import pack_bits, unpack_bits

__all__ = ["encode_indices", "decode_indices", "encode_indices_reference",
           "decode_indices_reference", "encode_values", "decode_values",
           "rice_parameter", "kiely_parameter", "count_width", "pack_uint", "unpack_uint",
           "index_section_header", "VALUE_BITS", "MAX_RICE_K", "FP16_MAX"]

MAX_RICE_K = 62
VALUE_BITS = (32, 16)
FP16_MAX = 65504.0
_LN_PHI_1 = math.log((math.sqrt(5.0) - 1.0) / 2.0)      # ln(phi - 1) = -0.4812...


# --- generic LSB-first packing of unsigned codes of 1..63 bits --------------------------------

def pack_uint(codes: np.ndarray, bits: int) -> np.ndarray:
    """Pack non-negative int64 ``codes`` (each < 2**bits) at ``bits`` (1..63) each into an
    LSB-first bit stream: code j occupies stream bits [j*bits, (j+1)*bits).  Returns
    ``ceil(len(codes) * bits / 8)`` uint8 bytes; the last byte's unused high bits are zero.

    bits <= 8 uses hvdcomp.ops.bitpack; 9..56 assemble each code's (at most 8) bytes in
    a 64-bit word; 57..63 go through an explicit bit array.
    """
    if not 1 <= bits <= 63:
        raise ValueError(f"bits must be in 1..63, got {bits}")
    c = np.ascontiguousarray(codes, dtype=np.int64).reshape(-1)
    n = c.size
    nbytes = (n * bits + 7) // 8
    if n == 0:
        return np.zeros(0, dtype=np.uint8)
    if bits <= 8:
        return pack_bits(torch.from_numpy(c), bits).numpy()
    if bits <= 56:
        pos = np.arange(n, dtype=np.int64) * bits
        first = pos >> 3
        w = c.astype(np.uint64) << (pos & 7).astype(np.uint64)       # < 2**(56 + 7)
        acc = np.zeros(nbytes + 8, dtype=np.int64)
        for j in range(8):
            byte = ((w >> np.uint64(8 * j)) & np.uint64(0xFF)).astype(np.float64)
            # codes own disjoint bits, so the sum of their bytes is their bitwise or
            acc += np.bincount(first + j, weights=byte, minlength=nbytes + 8).astype(np.int64)
        return acc[:nbytes].astype(np.uint8)
    stream = ((c[:, None] >> np.arange(bits, dtype=np.int64)) & 1).astype(np.uint8)
    return np.packbits(stream.reshape(-1), bitorder="little")


def unpack_uint(buf: np.ndarray, n: int, bits: int) -> np.ndarray:
    """Inverse of :func:`pack_uint`: ``n`` int64 codes.  Raises WireFormatError if ``buf``
    does not hold exactly ``ceil(n * bits / 8)`` bytes or its padding bits are not zero."""
    if not 1 <= bits <= 63:
        raise ValueError(f"bits must be in 1..63, got {bits}")
    b = np.ascontiguousarray(buf, dtype=np.uint8).reshape(-1)
    need = (n * bits + 7) // 8
    if b.size != need:
        raise WireFormatError(f"{n} codes of {bits} bits need {need} bytes, got {b.size}")
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    used = n * bits - 8 * (need - 1)                 # bits used in the last byte, 1..8
    if int(b[-1]) >> used:
        raise WireFormatError("nonzero padding bits after the last packed code")
    if bits <= 8:
        return unpack_bits(torch.from_numpy(b.copy()), n, bits).numpy()
    if bits <= 56:
        pos = np.arange(n, dtype=np.int64) * bits
        first = pos >> 3
        padded = np.concatenate([b, np.zeros(8, dtype=np.uint8)]).astype(np.uint64)
        w = np.zeros(n, dtype=np.uint64)
        for j in range(8):
            w |= padded[first + j] << np.uint64(8 * j)
        mask = np.uint64((1 << bits) - 1)
        return ((w >> (pos & 7).astype(np.uint64)) & mask).astype(np.int64)
    stream = np.unpackbits(b, bitorder="little", count=n * bits).reshape(n, bits)
    return (stream.astype(np.int64) << np.arange(bits, dtype=np.int64)).sum(axis=1)


# --- Rice parameter -----------------------------------------------------------------------------

def kiely_parameter(mean_gap: float) -> int:
    """Kiely's optimal Rice parameter for geometric gaps of mean ``mean_gap`` (>= 0):
    ``max(0, 1 + floor(log2(ln(phi - 1) / ln(mu / (mu + 1)))))``, capped at 62."""
    if not mean_gap > 0:
        return 0
    ln_theta = math.log1p(-1.0 / (mean_gap + 1.0))
    if ln_theta == 0.0:                         # mu beyond 2**53: the largest parameter
        return MAX_RICE_K
    k = 1 + math.floor(math.log2(_LN_PHI_1 / ln_theta))
    return int(min(max(k, 0), MAX_RICE_K))


def _rice_bits(gaps: np.ndarray, k: int) -> int:
    return int(gaps.size) * (k + 1) + int(np.sum(gaps >> k))


def rice_parameter(gaps: np.ndarray) -> int:
    """The k this codec uses for ``gaps`` (int64 >= 0): the best of Kiely's k0 and its two
    neighbours by exact bit count, the smaller on a tie; 0 for no gaps."""
    g = np.asarray(gaps, dtype=np.int64)
    if g.size == 0:
        return 0
    # float64 mean: exact enough for a parameter estimate even for sums beyond 2**53
    return best_rice_parameter(g.size, float(np.sum(g.astype(np.float64))),
                               lambda k: int(np.sum(g >> k)))


def best_rice_parameter(m: int, gap_sum: float, quotient_sum) -> int:
    """The rule of :func:`rice_parameter` for ``m`` >= 1 gaps whose float64 sum is
    ``gap_sum`` (as np.sum of the gaps in float64 gives it), given ``quotient_sum(k)`` =
    sum of (gap >> k) for k in k0 - 1 .. k0 + 1 (shared by the reference and the kernels)."""
    k0 = kiely_parameter(gap_sum / m)
    best, best_bits = None, None
    for k in (k0 - 1, k0, k0 + 1):
        if 0 <= k <= MAX_RICE_K:
            b = m * (k + 1) + int(quotient_sum(k))
            if best_bits is None or b < best_bits:
                best, best_bits = k, b
    return best


def count_width(numel: int) -> int:
    """Bytes of the count field: 4 for tensors of fewer than 2**32 elements, else 8."""
    return 4 if numel < 2**32 else 8


# --- indices -------------------------------------------------------------------------------------

def index_section_head(k: int, m: int, numel: int) -> bytes:
    """The fixed part of an index section: k, then m in count_width(numel) bytes."""
    return struct.pack("<B" + ("I" if count_width(numel) == 4 else "Q"), k, m)


def encode_indices_reference(indices, numel: int, k: int = -1) -> np.ndarray:
    """The specification of :func:`encode_indices` (NumPy): the index section (module
    docstring) for ``indices``: int64 (numpy array, torch
    tensor or sequence), strictly increasing, in [0, numel).  ``numel`` may be any size up
    to 2**63 - 1 (no tensor is needed: only the index values).  ``k`` forces a Rice
    parameter (0..62); -1 (default) chooses it (:func:`rice_parameter`).

    Returns uint8 bytes: ``1 + W + ceil((m + sum q) / 8) + ceil(m k / 8)``.
    Raises ValueError for indices that are not strictly increasing or out of range.
    """
    if isinstance(indices, torch.Tensor):
        indices = indices.detach().cpu().numpy()
    idx = np.ascontiguousarray(indices, dtype=np.int64).reshape(-1)
    numel = int(numel)
    if numel < 0 or numel >= 2**63:
        raise ValueError(f"numel must be in 0..2**63-1, got {numel}")
    m = idx.size
    if m:
        if idx[0] < 0 or idx[-1] >= numel:
            raise ValueError(f"indices must lie in [0, {numel}), got {idx[0]}..{idx[-1]}")
        if m > 1 and not bool(np.all(idx[1:] > idx[:-1])):
            raise ValueError("indices must be strictly increasing (sorted, no duplicates)")
    gaps = np.empty(m, dtype=np.int64)
    if m:
        gaps[0] = idx[0]
        gaps[1:] = idx[1:] - idx[:-1] - 1
    if k < 0:
        k = rice_parameter(gaps)
    if not 0 <= k <= MAX_RICE_K:
        raise ValueError(f"Rice parameter must be in 0..{MAX_RICE_K}, got {k}")
    if m == 0:
        k = 0
    head = index_section_head(k, m, numel)
    if m == 0:
        return np.frombuffer(head, dtype=np.uint8).copy()
    q = gaps >> k
    total = m + int(q.sum())
    stream = np.ones(total, dtype=np.uint8)
    stream[np.cumsum(q + 1) - 1] = 0                   # the terminators
    unary = np.packbits(stream, bitorder="little")     # pads with zero bits
    rem = pack_uint(gaps & ((1 << k) - 1), k) if k else np.zeros(0, dtype=np.uint8)
    return np.concatenate([np.frombuffer(head, dtype=np.uint8), unary, rem])


def _as_bytes(section) -> np.ndarray:
    if isinstance(section, torch.Tensor):
        section = section.detach().cpu().numpy()
    if isinstance(section, np.ndarray):
        return np.ascontiguousarray(section).view(np.uint8).reshape(-1)
    return np.frombuffer(bytes(section), dtype=np.uint8)


def index_section_header(section, numel: int) -> Tuple[int, int]:
    """(k, m) read from the fixed part of an index section, validated."""
    b = _as_bytes(section)
    w = count_width(numel)
    if b.size < 1 + w:
        raise WireFormatError(f"index section truncated: {b.size} bytes, its fixed part "
                              f"needs {1 + w} (numel {numel})")
    k = int(b[0])
    m = int.from_bytes(b[1:1 + w].tobytes(), "little")
    if k > MAX_RICE_K:
        raise WireFormatError(f"Rice parameter {k} exceeds {MAX_RICE_K}")
    if m > numel:
        raise WireFormatError(f"index section claims {m} indices for a tensor of {numel}")
    return k, m


def check_empty_section(b: np.ndarray, k: int, off: int) -> None:
    if k != 0 or b.size != off:
        raise WireFormatError(f"an empty index section must be exactly {off} bytes with "
                              f"k = 0, got {b.size} bytes and k = {k}")


def check_unary_size(size: int, m: int, k: int, ubytes: int) -> None:
    if ubytes < (m + 7) // 8:
        raise WireFormatError(f"index section truncated: {size} bytes cannot hold {m} "
                              f"indices with k = {k}")


def check_unary_end(unary_bytes: np.ndarray, last: int, ubytes: int) -> None:
    """The last terminator (bit ``last``) must lie in the stream's last byte, followed by
    zero bits only."""
    if last // 8 != ubytes - 1:
        raise WireFormatError(f"unary stream is {ubytes} bytes but its last terminator is "
                              f"in byte {last // 8}")
    if int(unary_bytes[last // 8]) >> (last % 8 + 1):
        raise WireFormatError("nonzero padding bits after the unary stream")


def check_packed_padding(buf: np.ndarray, n: int, bits: int) -> None:
    """As :func:`unpack_uint`'s checks, without unpacking."""
    need = (n * bits + 7) // 8
    if buf.size != need:
        raise WireFormatError(f"{n} codes of {bits} bits need {need} bytes, got {buf.size}")
    if n and int(buf[-1]) >> (n * bits - 8 * (need - 1)):
        raise WireFormatError("nonzero padding bits after the last packed code")


def decode_indices_reference(section, numel: int) -> np.ndarray:
    """The specification of :func:`decode_indices` (NumPy).

    ``section``: bytes, uint8 array or tensor.  Raises WireFormatError for any malformed or
    inconsistent section (module docstring, "Validation").
    """
    b = _as_bytes(section)
    numel = int(numel)
    k, m = index_section_header(b, numel)
    off = 1 + count_width(numel)
    if m == 0:
        check_empty_section(b, k, off)
        return np.zeros(0, dtype=np.int64)
    rbytes = (m * k + 7) // 8
    ubytes = b.size - off - rbytes
    check_unary_size(b.size, m, k, ubytes)
    unary = np.unpackbits(b[off:off + ubytes], bitorder="little")
    zeros = np.flatnonzero(unary == 0)
    if zeros.size < m:
        raise WireFormatError(f"unary stream holds {zeros.size} terminators, expected {m}")
    z = zeros[:m]
    last = int(z[-1])
    if last // 8 != ubytes - 1:
        raise WireFormatError(f"unary stream is {ubytes} bytes but its last terminator is "
                              f"in byte {last // 8}")
    if unary[last + 1:].any():
        raise WireFormatError("nonzero padding bits after the unary stream")
    q = np.empty(m, dtype=np.int64)
    q[0] = z[0]
    q[1:] = np.diff(z) - 1
    # every gap is at most numel - 1: bound q before shifting so nothing can overflow
    if int(q.max()) > (numel - 1) >> k:
        raise WireFormatError(f"index gap out of range for a tensor of {numel} elements")
    r = (unpack_uint(b[off + ubytes:], m, k) if k else np.zeros(m, dtype=np.int64))
    gaps = (q << k) | r
    # The true running sums increase strictly (every gap + 1 >= 1 and < 2**63), and int64
    # wrap-around would make one of them drop below its predecessor: so a strictly
    # increasing result whose last element is < numel proves that nothing overflowed.
    idx = np.cumsum(gaps + 1) - 1
    if (m > 1 and not bool(np.all(idx[1:] > idx[:-1]))) or idx[0] < 0 or idx[-1] >= numel:
        raise WireFormatError(f"indices reach beyond the tensor's {numel} elements")
    return idx


def _kernels(device):
    from ..backends import kernel_backend
    be = kernel_backend(device)
    return None if be is None else be.backend


def encode_indices(indices, numel: int, k: int = -1) -> np.ndarray:
    """The index section (module docstring) for ``indices``: int64 (numpy array, torch
    tensor on any device, or sequence), strictly increasing, in [0, numel).  ``numel`` may
    be any size up to 2**63 - 1 (no tensor is needed: only the index values).  ``k`` forces
    a Rice parameter (0..62); -1 (default) chooses it (:func:`rice_parameter`).

    Returns uint8 bytes (numpy): ``1 + W + ceil((m + sum q) / 8) + ceil(m k / 8)``.
    Raises ValueError for indices that are not strictly increasing or out of range.

    Runs kernels/sparse.cu on the indices' device where a kernel backend is available
    (hvdcomp.backends.kernel_backend; HVDCOMP_BACKEND=reference: never), else
    :func:`encode_indices_reference`; the bytes are identical.
    """
    if isinstance(indices, torch.Tensor):
        dev = indices.device
        t = indices.detach().reshape(-1)
    else:
        dev = torch.device("cpu")
        t = None
    be = _kernels(dev)
    if be is None:
        return encode_indices_reference(indices, numel, k)
    if t is None:
        a = np.ascontiguousarray(indices, dtype=np.int64).reshape(-1)
        t = torch.from_numpy(a if a.flags.writeable else a.copy())
    elif t.dtype != torch.int64:
        t = t.to(torch.int64)
    from ..backends import k_sparse
    return k_sparse.encode(be, t, numel, k).cpu().numpy()


def decode_indices(section, numel: int) -> np.ndarray:
    """Inverse of :func:`encode_indices`: the int64 indices, strictly increasing, < numel.

    ``section``: bytes, uint8 array or tensor (decoded on its device).  Raises
    WireFormatError for any malformed or inconsistent section (module docstring,
    "Validation").  Kernels (kernels/sparse.cu) where a backend is available, else
    :func:`decode_indices_reference`; same indices, same errors.
    """
    dev = section.device if isinstance(section, torch.Tensor) else torch.device("cpu")
    be = _kernels(dev)
    if be is None:
        return decode_indices_reference(section, numel)
    from ..backends import k_sparse
    return k_sparse.decode(be, section, numel).cpu().numpy()


# --- values --------------------------------------------------------------------------------------

def encode_values(values: torch.Tensor, bits: int) -> Tuple[np.ndarray, torch.Tensor]:
    """Values section for float32 ``values`` (1-D, any device) at ``bits`` 32 or 16.

    Returns (uint8 bytes, float32 tensor of what the receiver will decode, on the values'
    device): the values themselves for 32 bits; for 16 bits the float16 rounding of the
    values clamped to +-65504.
    """
    v = values.detach().reshape(-1).to(torch.float32)
    if bits == 32:
        return v.cpu().numpy().astype("<f4").view(np.uint8), v
    if bits == 16:
        h = v.clamp(-FP16_MAX, FP16_MAX).to(torch.float16)
        return h.cpu().numpy().astype("<f2").view(np.uint8), h.to(torch.float32)
    raise ValueError(f"value bits must be 32 or 16, got {bits}")


def decode_values(section, count: int, bits: int) -> torch.Tensor:
    """``count`` float32 values from a values section of ``bits`` 32 or 16 (a CPU tensor).
    Raises WireFormatError for a wrong length or non-finite values."""
    if bits not in VALUE_BITS:
        raise WireFormatError(f"value width {bits} bits; valid: 32, 16")
    b = _as_bytes(section)
    need = count * bits // 8
    if b.size != need:
        raise WireFormatError(f"values section has {b.size} bytes, {count} values of "
                              f"{bits} bits need {need}")
    dt = "<f4" if bits == 32 else "<f2"
    v = torch.from_numpy(np.frombuffer(b.tobytes(), dtype=dt).astype(np.float32))
    if count and not bool(torch.isfinite(v).all()):
        raise WireFormatError("values section holds NaN or Inf")
    return v
