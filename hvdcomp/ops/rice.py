"""Golomb-Rice coding of a sorted index set: the index section of the sparsifiers' messages.

Golomb, "Run-length encodings", IEEE Trans. Inf. Theory 12(3), 1966; Rice's special case of
a power-of-two divisor; the parameter rule is Kiely's, "Selecting the Golomb parameter in
Rice coding", IPN Progress Report 42-159, 2004.  The section's byte layout, and why the gaps
are coded rather than the indices, is the wire format's: hvdcomp/codecs/sparse_vectors.py.
In short, the indices ``i_0 < ... < i_{m-1}`` become gaps ``d_0 = i_0``,
``d_j = i_j - i_{j-1} - 1``, each ``d = q * 2**k + r``: the section is ``k`` (u8), ``m``
(u32 below 2**32 elements, else u64), the unary quotients (q one-bits and a zero-bit each,
one LSB-first stream, zero padded) and the k-bit remainders (packed LSB-first).

Operations (an :class:`~hvdcomp.ops.Op` each: a NumPy reference, the specification, and
kernels/rice.cu):

    encode(indices, numel, k=-1) -> uint8 tensor    the index section
    decode(section, numel, device=None) -> int64    its indices; WireFormatError if malformed

The kernels compute the gaps, the three bit counts the parameter choice compares, the
unary stream (each thread writes the 64-bit words it owns, from a prefix sum of the code
lengths) and the remainders; on decoding, the terminator positions (per-word zero counts
and a prefix sum) and the gaps.  Both sides give the same bytes, the same indices and the
same errors, in the same order.  The rest here (parameter choice, the fixed part of the
section, its validation) is shared by the two.
"""
from __future__ import annotations

import math
import struct
from typing import Callable, Tuple

import numpy as np
import torch

from ..backends._common import BLOCK, check_int, check_tensor, grid_for
from ..errors import WireFormatError
from . import op

__all__ = ["encode", "decode", "rice_parameter", "kiely_parameter", "count_width",
           "section_head", "section_header", "section_bytes", "pack_uint", "unpack_uint",
           "MAX_RICE_K", "GROUP"]

MAX_RICE_K = 62
GROUP = 256              # indices per thread of the per-index kernels
_LN_PHI_1 = math.log((math.sqrt(5.0) - 1.0) / 2.0)      # ln(phi - 1) = -0.4812...


# --- LSB-first packing of unsigned codes of 1..63 bits (the remainders) ------------------------

def pack_uint(codes: np.ndarray, bits: int) -> np.ndarray:
    """Pack non-negative int64 ``codes`` (each < 2**bits) at ``bits`` (1..63) each into an
    LSB-first bit stream: code j occupies stream bits [j*bits, (j+1)*bits).  Returns
    ``ceil(len(codes) * bits / 8)`` uint8 bytes; the last byte's unused high bits are zero.
    Up to 56 bits a code and its bit offset fit one 64-bit word, split into the bytes it
    spans; 57..63 bits go through an explicit bit array.  ValueError for bits outside 1..63.
    """
    if not 1 <= bits <= 63:
        raise ValueError(f"bits must be in 1..63, got {bits}")
    c = np.ascontiguousarray(codes, dtype=np.int64).reshape(-1)
    n = c.size
    nbytes = (n * bits + 7) // 8
    if n == 0:
        return np.zeros(0, dtype=np.uint8)
    if bits > 56:
        stream = ((c[:, None] >> np.arange(bits, dtype=np.int64)) & 1).astype(np.uint8)
        return np.packbits(stream.reshape(-1), bitorder="little")
    pos = np.arange(n, dtype=np.int64) * bits
    first = pos >> 3
    w = c.astype(np.uint64) << (pos & 7).astype(np.uint64)       # < 2**(56 + 7)
    acc = np.zeros(nbytes + 8, dtype=np.int64)
    for j in range((bits + 14) // 8):                             # bytes a code can span
        byte = ((w >> np.uint64(8 * j)) & np.uint64(0xFF)).astype(np.float64)
        # codes own disjoint bits, so the sum of their bytes is their bitwise or
        acc += np.bincount(first + j, weights=byte, minlength=nbytes + 8).astype(np.int64)
    return acc[:nbytes].astype(np.uint8)


def unpack_uint(buf: np.ndarray, n: int, bits: int) -> np.ndarray:
    """Inverse of :func:`pack_uint`: ``n`` int64 codes.  Raises WireFormatError if ``buf``
    does not hold exactly ``ceil(n * bits / 8)`` bytes or its padding bits are not zero."""
    if not 1 <= bits <= 63:
        raise ValueError(f"bits must be in 1..63, got {bits}")
    b = np.ascontiguousarray(buf, dtype=np.uint8).reshape(-1)
    _check_packed(b, n, bits)
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    if bits > 56:
        stream = np.unpackbits(b, bitorder="little", count=n * bits).reshape(n, bits)
        return (stream.astype(np.int64) << np.arange(bits, dtype=np.int64)).sum(axis=1)
    pos = np.arange(n, dtype=np.int64) * bits
    first = pos >> 3
    padded = np.concatenate([b, np.zeros(8, dtype=np.uint8)]).astype(np.uint64)
    w = np.zeros(n, dtype=np.uint64)
    for j in range((bits + 14) // 8):
        w |= padded[first + j] << np.uint64(8 * j)
    mask = np.uint64((1 << bits) - 1)
    return ((w >> (pos & 7).astype(np.uint64)) & mask).astype(np.int64)


def _check_packed(buf: np.ndarray, n: int, bits: int) -> None:
    need = (n * bits + 7) // 8
    if buf.size != need:
        raise WireFormatError(f"{n} codes of {bits} bits need {need} bytes, got {buf.size}")
    if n and int(buf[-1]) >> (n * bits - 8 * (need - 1)):
        raise WireFormatError("nonzero padding bits after the last packed code")


# --- the Rice parameter ------------------------------------------------------------------------

def kiely_parameter(mean_gap: float) -> int:
    """Kiely's optimal Rice parameter for geometric gaps of mean ``mean_gap`` (>= 0):
    ``max(0, 1 + floor(log2(ln(phi - 1) / ln(mu / (mu + 1)))))``, capped at 62; 0 for 0."""
    if not mean_gap > 0:
        return 0
    ln_theta = math.log1p(-1.0 / (mean_gap + 1.0))
    if ln_theta == 0.0:                         # mu beyond 2**53: the largest parameter
        return MAX_RICE_K
    k = 1 + math.floor(math.log2(_LN_PHI_1 / ln_theta))
    return int(min(max(k, 0), MAX_RICE_K))


def rice_parameter(gaps: np.ndarray) -> int:
    """The k the index section uses for ``gaps`` (int64 >= 0): the best of Kiely's k0 (for
    the mean gap) and its two neighbours by exact bit count ``m (k + 1) + sum(d >> k)``,
    the smaller on a tie; 0 for no gaps."""
    g = np.asarray(gaps, dtype=np.int64)
    if g.size == 0:
        return 0
    # float64 mean: exact enough for a parameter estimate even for sums beyond 2**53
    return _best_parameter(g.size, float(np.sum(g.astype(np.float64))),
                           lambda k: int(np.sum(g >> k)))


def _best_parameter(m: int, gap_sum: float, quotient_sum: Callable[[int], int]) -> int:
    """:func:`rice_parameter` for ``m`` >= 1 gaps whose float64 sum is ``gap_sum`` (as
    np.sum of the gaps in float64 gives it), given ``quotient_sum(k)`` = sum of (gap >> k)
    for k in k0 - 1 .. k0 + 1."""
    k0 = kiely_parameter(gap_sum / m)
    best, best_bits = None, None
    for k in (k0 - 1, k0, k0 + 1):
        if 0 <= k <= MAX_RICE_K:
            b = m * (k + 1) + int(quotient_sum(k))
            if best_bits is None or b < best_bits:
                best, best_bits = k, b
    return best


# --- the fixed part of the section and its checks ----------------------------------------------

def count_width(numel: int) -> int:
    """Bytes of the count field: 4 for tensors of fewer than 2**32 elements, else 8."""
    return 4 if numel < 2**32 else 8


def section_head(k: int, m: int, numel: int) -> bytes:
    """The fixed part of an index section: k, then m in count_width(numel) bytes."""
    return struct.pack("<B" + ("I" if count_width(numel) == 4 else "Q"), k, m)


def section_bytes(section) -> np.ndarray:
    """A section (bytes, NumPy array or tensor on any device) as flat uint8 NumPy bytes."""
    if isinstance(section, torch.Tensor):
        section = section.detach().cpu().numpy()
    if isinstance(section, np.ndarray):
        return np.ascontiguousarray(section).view(np.uint8).reshape(-1)
    return np.frombuffer(bytes(section), dtype=np.uint8)


def section_header(section, numel: int) -> Tuple[int, int]:
    """(k, m) read from the fixed part of an index section, validated (WireFormatError)."""
    b = section_bytes(section)
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


def _check_numel(numel) -> int:
    numel = int(numel)
    if numel < 0 or numel >= 2**63:
        raise ValueError(f"numel must be in 0..2**63-1, got {numel}")
    return numel


def _check_k(k: int) -> None:
    if not 0 <= k <= MAX_RICE_K:
        raise ValueError(f"Rice parameter must be in 0..{MAX_RICE_K}, got {k}")


def _check_empty(b: np.ndarray, k: int, off: int) -> None:
    if k != 0 or b.size != off:
        raise WireFormatError(f"an empty index section must be exactly {off} bytes with "
                              f"k = 0, got {b.size} bytes and k = {k}")


def _check_unary_size(size: int, m: int, k: int, ubytes: int) -> None:
    if ubytes < (m + 7) // 8:
        raise WireFormatError(f"index section truncated: {size} bytes cannot hold {m} "
                              f"indices with k = {k}")


def _check_unary_end(unary_bytes: np.ndarray, last: int, ubytes: int) -> None:
    """The last terminator (bit ``last``) must lie in the stream's last byte, followed by
    zero bits only."""
    if last // 8 != ubytes - 1:
        raise WireFormatError(f"unary stream is {ubytes} bytes but its last terminator is "
                              f"in byte {last // 8}")
    if int(unary_bytes[last // 8]) >> (last % 8 + 1):
        raise WireFormatError("nonzero padding bits after the unary stream")


def _check_decoded(idx_increasing: bool, first: int, last: int, numel: int) -> None:
    # The true running sums increase strictly (every gap + 1 >= 1 and < 2**63), and int64
    # wrap-around would make one of them drop below its predecessor: so a strictly
    # increasing result whose last element is < numel proves that nothing overflowed.
    if not idx_increasing or first < 0 or last >= numel:
        raise WireFormatError(f"indices reach beyond the tensor's {numel} elements")


# --- encode --------------------------------------------------------------------------------------

@op
def encode(indices, numel: int, k: int = -1) -> torch.Tensor:
    """The index section of ``indices``: int64 values (a tensor on any device, a NumPy array
    or a sequence), strictly increasing, in [0, numel).  ``numel``: 0..2**63-1 (only the
    index values are needed, no tensor of that size).  ``k``: a Rice parameter 0..62, or -1
    (default) for :func:`rice_parameter`'s choice; 0 whatever is asked when m = 0.

    Returns a uint8 tensor of ``1 + W + ceil((m + sum q) / 8) + ceil(m k / 8)`` bytes on
    the indices' device (the CPU for arrays and sequences).  Raises ValueError for numel
    out of range, indices out of range or not strictly increasing, or k out of range (in
    that order).
    """
    dev = indices.device if isinstance(indices, torch.Tensor) else torch.device("cpu")
    if isinstance(indices, torch.Tensor):
        indices = indices.detach().cpu().numpy()
    idx = np.ascontiguousarray(indices, dtype=np.int64).reshape(-1)
    numel = _check_numel(numel)
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
    _check_k(k)
    if m == 0:
        return torch.frombuffer(bytearray(section_head(0, 0, numel)), dtype=torch.uint8).to(dev)
    q = gaps >> k
    stream = np.ones(m + int(q.sum()), dtype=np.uint8)
    stream[np.cumsum(q + 1) - 1] = 0                   # the terminators
    unary = np.packbits(stream, bitorder="little")     # pads with zero bits
    rem = pack_uint(gaps & ((1 << k) - 1), k) if k else np.zeros(0, dtype=np.uint8)
    out = np.concatenate([np.frombuffer(section_head(k, m, numel), dtype=np.uint8), unary, rem])
    return torch.from_numpy(out).to(dev)


def _index_tensor(indices) -> torch.Tensor:
    if isinstance(indices, torch.Tensor):
        t = indices.detach().reshape(-1)
        return t if t.dtype == torch.int64 else t.to(torch.int64)
    a = np.ascontiguousarray(indices, dtype=np.int64).reshape(-1)
    return torch.from_numpy(a if a.flags.writeable else a.copy())


@encode.kernel
def _(be, indices, numel: int, k: int = -1) -> torch.Tensor:
    numel = _check_numel(numel)
    k = check_int(k, "k", -2**31, 2**31 - 1)
    idx = check_tensor(be, _index_tensor(indices), "indices", torch.int64)
    dev = idx.device
    m = idx.numel()
    if m:
        first, last = int(idx[0]), int(idx[-1])
        if first < 0 or last >= numel:
            raise ValueError(f"indices must lie in [0, {numel}), got {first}..{last}")
    gaps = torch.empty(m, dtype=torch.int64, device=dev)
    ng = (m + GROUP - 1) // GROUP
    if m:
        bad = torch.empty(ng, dtype=torch.int32, device=dev)
        be.launch("hvd_sparse_gaps", grid_for(ng, 64), 64, (idx, m, GROUP, gaps, bad))
        if m > 1 and bool(bad.any()):
            raise ValueError("indices must be strictly increasing (sorted, no duplicates)")
    if k < 0 and m:
        total = last + 1 - m                          # the exact sum of the gaps
        if total < 2**53:
            fsum = float(total)                       # what np.sum in float64 gives, exactly
        else:                                         # rounding depends on NumPy's order
            fsum = float(np.sum(gaps.cpu().numpy().astype(np.float64)))
        k0 = kiely_parameter(fsum / m)
        sums = torch.empty(3 * ng, dtype=torch.int64, device=dev)
        be.launch("hvd_sparse_rice_sums", grid_for(ng, 64), 64, (gaps, m, GROUP, k0, sums))
        qs = sums.view(ng, 3).sum(dim=0).tolist()
        k = _best_parameter(m, fsum, lambda kk: qs[kk - k0 + 1])
    elif k < 0:
        k = 0
    _check_k(k)
    if m == 0:
        return torch.frombuffer(bytearray(section_head(0, 0, numel)), dtype=torch.uint8).to(dev)
    head = section_head(k, m, numel)
    ends = torch.empty(m, dtype=torch.int64, device=dev)
    be.launch("hvd_sparse_unary_len", grid_for(m), BLOCK, (gaps, m, k, ends))
    torch.cumsum(ends, 0, out=ends)
    total_bits = int(ends[-1])
    ubytes = (total_bits + 7) // 8
    rbytes = (m * k + 7) // 8
    h = len(head)
    out = torch.empty(h + ubytes + rbytes, dtype=torch.uint8, device=dev)
    out[:h] = torch.frombuffer(bytearray(head), dtype=torch.uint8).to(dev)
    be.launch("hvd_sparse_unary", grid_for((ubytes + 7) // 8), BLOCK,
              (ends, m, total_bits, out[h:h + ubytes], ubytes))
    if k:
        be.launch("hvd_sparse_remainders", grid_for((rbytes + 7) // 8), BLOCK,
                  (gaps, m, k, out[h + ubytes:], rbytes))
    return out


def _layout(b: np.ndarray, numel: int):
    """(k, m, off, ubytes) of a section: Rice parameter, index count, offset and length of
    the unary stream, checked against the section's size (WireFormatError); an empty
    section (m = 0) is checked whole here."""
    k, m = section_header(b, numel)
    off = 1 + count_width(numel)
    if m == 0:
        _check_empty(b, k, off)
        return k, 0, off, 0
    ubytes = b.size - off - (m * k + 7) // 8
    _check_unary_size(b.size, m, k, ubytes)
    return k, m, off, ubytes


# --- decode --------------------------------------------------------------------------------------

@op
def decode(section, numel: int, device=None) -> torch.Tensor:
    """Inverse of :func:`encode`: the indices of an index section (bytes, uint8 NumPy array
    or tensor), int64, strictly increasing, < numel, as a tensor on ``device`` (default:
    the section's device if a tensor, else the CPU).

    Raises WireFormatError, nothing decoded, for any malformed or inconsistent section: one
    shorter than its fixed part, k > 62, m > numel, m = 0 with anything after the count or
    k != 0, fewer than m terminators, a unary stream longer than its last terminator's byte
    or with nonzero padding, a quotient beyond (numel - 1) >> k, nonzero padding bits after
    the remainders, an index at or beyond numel.
    """
    dev = torch.device(device) if device is not None else (
        section.device if isinstance(section, torch.Tensor) else torch.device("cpu"))
    b = section_bytes(section)
    numel = int(numel)
    k, m, off, ubytes = _layout(b, numel)
    if m == 0:
        return torch.zeros(0, dtype=torch.int64, device=dev)
    unary = np.unpackbits(b[off:off + ubytes], bitorder="little")
    zeros = np.flatnonzero(unary == 0)
    if zeros.size < m:
        raise WireFormatError(f"unary stream holds {zeros.size} terminators, expected {m}")
    z = zeros[:m]
    _check_unary_end(b[off:off + ubytes], int(z[-1]), ubytes)
    q = np.empty(m, dtype=np.int64)
    q[0] = z[0]
    q[1:] = np.diff(z) - 1
    # every gap is at most numel - 1: bound q before shifting so nothing can overflow
    if int(q.max()) > (numel - 1) >> k:
        raise WireFormatError(f"index gap out of range for a tensor of {numel} elements")
    r = unpack_uint(b[off + ubytes:], m, k) if k else np.zeros(m, dtype=np.int64)
    idx = np.cumsum(((q << k) | r) + 1) - 1
    _check_decoded(m == 1 or bool(np.all(idx[1:] > idx[:-1])), int(idx[0]), int(idx[-1]),
                   numel)
    return torch.from_numpy(idx).to(dev)


@decode.kernel
def _(be, section, numel: int, device=None) -> torch.Tensor:
    if isinstance(section, torch.Tensor):
        sec_t = section.detach().reshape(-1)
        if sec_t.dtype != torch.uint8:
            sec_t = sec_t.contiguous().view(torch.uint8)
        b = sec_t.cpu().numpy()
    else:
        b = section_bytes(section)
        sec_t = None
    dev = torch.device(device) if device is not None else (
        sec_t.device if sec_t is not None else torch.device(be.device_type))
    numel = int(numel)
    k, m, off, ubytes = _layout(b, numel)
    if m == 0:
        return torch.zeros(0, dtype=torch.int64, device=dev)
    rbytes = (m * k + 7) // 8
    if sec_t is None or sec_t.device != dev:
        sec_t = torch.from_numpy(b if b.flags.writeable else b.copy()).to(dev)
    sec_t = check_tensor(be, sec_t, "section", torch.uint8, b.size)
    u = sec_t[off:off + ubytes]
    nw = (ubytes + 7) // 8
    counts = torch.empty(nw, dtype=torch.int64, device=dev)
    be.launch("hvd_sparse_zero_count", grid_for(nw), BLOCK, (u, ubytes, counts))
    rank0 = torch.zeros(nw + 1, dtype=torch.int64, device=dev)
    torch.cumsum(counts, 0, out=rank0[1:])
    nzeros = int(rank0[-1])
    if nzeros < m:
        raise WireFormatError(f"unary stream holds {nzeros} terminators, expected {m}")
    z = torch.empty(m, dtype=torch.int64, device=dev)
    be.launch("hvd_sparse_zero_pos", grid_for(nw), BLOCK, (u, ubytes, rank0, m, z))
    _check_unary_end(b[off:off + ubytes], int(z[-1]), ubytes)
    ng = (m + GROUP - 1) // GROUP
    gp1 = torch.empty(m, dtype=torch.int64, device=dev)
    bad = torch.empty(ng, dtype=torch.int32, device=dev)
    rem = sec_t[off + ubytes:] if rbytes else sec_t[:1]      # a valid pointer when k = 0
    be.launch("hvd_sparse_decode_gaps", grid_for(ng, 64), 64,
              (z, m, rem, rbytes, k, (numel - 1) >> k, GROUP, gp1, bad))
    if bool(bad.any()):
        raise WireFormatError(f"index gap out of range for a tensor of {numel} elements")
    if k:
        _check_packed(b[off + ubytes:], m, k)
    idx = torch.cumsum(gp1, 0)
    idx -= 1
    _check_decoded(m == 1 or bool((idx[1:] > idx[:-1]).all()), int(idx[0]), int(idx[-1]),
                   numel)
    return idx
