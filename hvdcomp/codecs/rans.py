"""Entropy coding of quantized symbols: static-model rANS in independent chunks.

Format of one entropy-coded section (all integers little-endian):

    u8   precision P          frequencies sum to 2**P (P = 15)
    u8   reserved (0)
    u16  alphabet size A      symbols are 0 .. A-1  (A <= 65536)
    u32  chunk size C         symbols per chunk; the last chunk holds the rest
    u64  number of symbols n
    A x u16 frequencies       the model, carried in the message; present symbols have f >= 1
    K x u32 chunk lengths     bytes of each chunk's stream, K = ceil(n / C)
    K chunk streams           each: u32 final encoder state, then u16 words in read order

Each chunk is coded independently (rANS with a 32-bit state in [2**16, 2**32) and 16-bit
renormalization; Duda, arXiv 1311.2540; the word-oriented variant of Giesen's ryg_rans), so
chunks can be encoded and decoded in parallel: this reference does all chunks in lockstep
with NumPy; a GPU kernel runs one thread (or warp) per chunk and writes the same bytes.

The cost is the empirical entropy of the symbols under the quantized model plus, per chunk,
4 bytes of state, 4 bytes of length and at most 2 bytes of flush, plus 16 + 2A bytes of
model: within 1 % of n * H for messages of a few thousand symbols or more.

Decoding validates everything: the model must sum to 2**P, every chunk must consume exactly
its words and end in the encoder's initial state; anything else raises WireFormatError.
"""
from __future__ import annotations

import struct

import numpy as np

from ..errors import WireFormatError

__all__ = ["encode_symbols", "decode_symbols", "encode_codes", "decode_codes",
           "encode_symbols_reference", "decode_symbols_reference", "quantize_frequencies",
           "section_layout", "parse_section", "PRECISION", "empirical_entropy_bits"]

PRECISION = 15
_L = 1 << 16
_HEAD = struct.Struct("<BBHIQ")


def empirical_entropy_bits(symbols: np.ndarray, alphabet: int) -> float:
    """n * H(empirical distribution), in bits."""
    counts = np.bincount(np.asarray(symbols, dtype=np.int64), minlength=alphabet)
    n = counts.sum()
    p = counts[counts > 0] / n
    return float(-(counts[counts > 0] * np.log2(p)).sum())


def quantize_frequencies(counts: np.ndarray, precision: int = PRECISION) -> np.ndarray:
    """Scale symbol counts to integer frequencies summing to 2**precision, keeping every
    present symbol at >= 1 (absent symbols get 0)."""
    counts = np.asarray(counts, dtype=np.int64)
    total = 1 << precision
    present = counts > 0
    if present.sum() == 0:
        return np.zeros_like(counts)
    if present.sum() > total:
        raise ValueError("alphabet larger than the frequency precision")
    f = np.where(present, np.maximum(1, (counts * total) // counts.sum()), 0)
    # hand out (or take back) the rounding remainder, largest counts first
    diff = total - int(f.sum())
    order = np.argsort(-counts, kind="stable")
    i = 0
    while diff != 0:
        s = order[i % len(order)]
        if present[s]:
            if diff > 0:
                f[s] += 1
                diff -= 1
            elif f[s] > 1:
                f[s] -= 1
                diff += 1
        i += 1
    return f


def _chunk_size(n: int) -> int:
    # About 1024 chunks for large messages (parallel work), at least 4096 symbols each.
    c = max(4096, -(-n // 1024))
    return -(-c // 256) * 256


def _check_alphabet(alphabet: int) -> None:
    if not 1 <= alphabet <= 65536:
        raise ValueError(f"alphabet must be in 1..65536, got {alphabet}")


def _out_of_alphabet(alphabet: int) -> ValueError:
    return ValueError(f"symbols must be in [0, {alphabet})")


def section_layout(n: int, alphabet: int, counts: np.ndarray, chunk_size: int = 0):
    """The parts of a section that depend on the symbol counts alone, shared by the
    reference and the kernels: (C, K, freq int64 (alphabet,), head bytes: the fixed header
    and the model)."""
    C = chunk_size or min(_chunk_size(n), max(n, 1))
    freq = quantize_frequencies(counts, PRECISION)
    K = -(-n // C) if n else 0
    head = _HEAD.pack(PRECISION, 0, alphabet & 0xFFFF, C, n) + freq.astype("<u2").tobytes()
    return C, K, freq, head


def encode_symbols_reference(symbols: np.ndarray, alphabet: int,
                             chunk_size: int = 0) -> np.ndarray:
    """The specification of the section (NumPy, all chunks in lockstep).  symbols: 1-D
    integer array with values in [0, alphabet).  Returns the section as a uint8 array.
    Raises ValueError for symbols outside the alphabet."""
    sym = np.ascontiguousarray(symbols).reshape(-1).astype(np.int64)
    n = sym.size
    _check_alphabet(alphabet)
    if n and (sym.min() < 0 or sym.max() >= alphabet):
        raise _out_of_alphabet(alphabet)
    C, K, freq, head = section_layout(n, alphabet, np.bincount(sym, minlength=alphabet),
                                      chunk_size)
    cum = np.concatenate([[0], np.cumsum(freq)[:-1]]).astype(np.uint64)
    if K == 0:
        return np.frombuffer(head, dtype=np.uint8).copy()
    m_last = n - (K - 1) * C
    pad = np.zeros(K * C, dtype=np.int64)
    pad[:n] = sym
    S = pad.reshape(K, C)
    F = freq.astype(np.uint64)
    x = np.full(K, _L, dtype=np.uint64)
    words = np.zeros((K, C), dtype=np.uint16)
    cnt = np.zeros(K, dtype=np.int64)
    rows = np.arange(K)
    P = np.uint64(PRECISION)
    shift_hi = np.uint64(32 - PRECISION)
    for t in range(C - 1, -1, -1):
        s = S[:, t]
        f = F[s]
        c = cum[s]
        if t >= m_last:                     # the last chunk has no symbol here
            act = rows < K - 1
        else:
            act = None
        emit = x >= (f << shift_hi)
        if act is not None:
            emit &= act
        if emit.any():
            r = rows[emit]
            words[r, cnt[r]] = (x[r] & np.uint64(0xFFFF)).astype(np.uint16)
            cnt[r] += 1
            x[r] >>= np.uint64(16)
        fs = np.where(f > 0, f, np.uint64(1))
        nx = ((x // fs) << P) + (x % fs) + c
        x = nx if act is None else np.where(act, nx, x)
    lengths = (cnt * 2 + 4).astype("<u4")
    out = [head, lengths.tobytes()]
    for k in range(K):
        out.append(struct.pack("<I", int(x[k])))
        out.append(words[k, :cnt[k]][::-1].astype("<u2").tobytes())
    return np.frombuffer(b"".join(out), dtype=np.uint8).copy()


# The chunk-level errors of a section, by the kernels' status code (kernels/rans.cu), in the
# order of priority in which the reference raises them.
_SectionErrors = {
    1: lambda: WireFormatError("entropy stream: initial state out of range"),
    2: lambda: WireFormatError("entropy stream truncated: a chunk ran out of words"),
    3: lambda: WireFormatError("entropy stream corrupted: a chunk did not end in its "
                               "initial state or left words unread"),
}


def parse_section(buf: np.ndarray, n_expected: int, alphabet: int):
    """Validate a section's header, model and chunk table (shared by the reference and the
    kernels).  Returns None for a valid empty section, else (C, n, freq int64 (A,), K,
    lengths int64 (K,), off: byte offset of the first chunk stream).  Raises
    WireFormatError."""
    if buf.size < _HEAD.size:
        raise WireFormatError("entropy section truncated in its header")
    prec, res, A, C, n = _HEAD.unpack_from(buf, 0)
    A = A or 65536
    if prec != PRECISION or res != 0:
        raise WireFormatError(f"entropy section: precision {prec} / reserved {res} invalid")
    if A != alphabet:
        raise WireFormatError(f"entropy section: alphabet {A}, expected {alphabet}")
    if n != n_expected:
        raise WireFormatError(f"entropy section holds {n} symbols, expected {n_expected}")
    if n and C == 0:
        raise WireFormatError("entropy section: chunk size 0")
    off = _HEAD.size
    if buf.size < off + 2 * A:
        raise WireFormatError("entropy section truncated in its model")
    freq = buf[off:off + 2 * A].view("<u2").astype(np.int64)
    off += 2 * A
    if n == 0:
        if buf.size != off:
            raise WireFormatError("entropy section: trailing bytes")
        return None
    if int(freq.sum()) != 1 << PRECISION:
        raise WireFormatError(f"entropy model sums to {int(freq.sum())}, not 2**{PRECISION}")
    K = -(-n // C)
    if buf.size < off + 4 * K:
        raise WireFormatError("entropy section truncated in its chunk table")
    lengths = buf[off:off + 4 * K].view("<u4").astype(np.int64)
    off += 4 * K
    if (lengths < 4).any() or (lengths % 2).any() or off + int(lengths.sum()) != buf.size:
        raise WireFormatError("entropy section: chunk lengths do not match its size")
    return C, n, freq, K, lengths, off


def decode_symbols_reference(section, n_expected: int, alphabet: int) -> np.ndarray:
    """The specification of decoding (NumPy, all chunks in lockstep): inverse of
    :func:`encode_symbols_reference`; returns int64 symbols.  Raises WireFormatError unless
    the section is well formed, holds ``n_expected`` symbols of ``alphabet``."""
    buf = np.ascontiguousarray(section, dtype=np.uint8).reshape(-1)
    parsed = parse_section(buf, n_expected, alphabet)
    if parsed is None:
        return np.zeros(0, dtype=np.int64)
    C, n, freq, K, lengths, off = parsed
    A = freq.size
    nwords = (lengths - 4) // 2
    W = np.zeros((K, max(int(nwords.max()), 1)), dtype=np.uint64)
    x = np.zeros(K, dtype=np.uint64)
    for k in range(K):
        x[k] = int(buf[off:off + 4].view("<u4")[0])
        W[k, :nwords[k]] = buf[off + 4:off + lengths[k]].view("<u2")
        off += int(lengths[k])
    cum = np.concatenate([[0], np.cumsum(freq)[:-1]])
    slot_sym = np.repeat(np.arange(A), freq)           # slot -> symbol, 2**P entries
    F = freq.astype(np.uint64)
    CUM = cum.astype(np.uint64)
    mask = np.uint64((1 << PRECISION) - 1)
    P = np.uint64(PRECISION)
    ptr = np.zeros(K, dtype=np.int64)
    out = np.zeros((K, C), dtype=np.int64)
    rows = np.arange(K)
    m_last = n - (K - 1) * C
    if ((x < _L) | (x >= 1 << 32)).any():
        raise _SectionErrors[1]()
    for t in range(C):
        act = None if t < m_last else rows < K - 1
        slot = x & mask
        s = slot_sym[slot.astype(np.int64)]
        out[:, t] = s
        nx = F[s] * (x >> P) + slot - CUM[s]
        x = nx if act is None else np.where(act, nx, x)
        need = x < _L
        if act is not None:
            need &= act
        if need.any():
            r = rows[need]
            if (ptr[r] >= nwords[r]).any():
                raise _SectionErrors[2]()
            x[r] = (x[r] << np.uint64(16)) | W[r, ptr[r]]
            ptr[r] += 1
    if (x != _L).any() or (ptr != nwords).any():
        raise _SectionErrors[3]()
    return out.reshape(-1)[:n]


# --- public entry points: the kernels (kernels/rans.cu) where a backend runs, else the
# reference above; the bytes are the same either way. --------------------------------------

def _kernels(device, alphabet: int):
    """(backend module, launch object) for ``device``, or None: reference path."""
    if alphabet > 256:
        return None
    from ..backends import kernel_backend
    be = kernel_backend(device)
    return None if be is None else be.backend


def _as_uint8_symbols(symbols, alphabet: int):
    """A uint8 tensor (on the input's device) of in-range integer symbols, or raise
    ValueError as the reference does; None where the input is not integer (the reference
    then decides)."""
    import torch
    if isinstance(symbols, torch.Tensor):
        t = symbols.detach().reshape(-1)
        if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
            return None
        if t.numel():
            lo, hi = int(t.min()), int(t.max())
            if lo < 0 or hi >= alphabet:
                raise _out_of_alphabet(alphabet)
        return (t if t.dtype == torch.uint8 else t.to(torch.uint8)).contiguous()
    a = np.asarray(symbols)
    if a.dtype.kind not in "iu":
        return None
    a = a.reshape(-1)
    if a.size and a.dtype != np.uint8:
        if int(a.min()) < 0 or int(a.max()) >= alphabet:
            raise _out_of_alphabet(alphabet)
        a = a.astype(np.uint8)
    elif a.size and int(a.max()) >= alphabet:
        raise _out_of_alphabet(alphabet)
    a = np.ascontiguousarray(a, dtype=np.uint8)
    return torch.from_numpy(a if a.flags.writeable else a.copy())


def encode_symbols(symbols, alphabet: int, chunk_size: int = 0) -> np.ndarray:
    """The entropy section of ``symbols`` (1-D integer numpy array or tensor, any device,
    values in [0, alphabet)), as a uint8 numpy array.  Raises ValueError for symbols outside
    the alphabet or an alphabet outside 1..65536.

    Alphabets up to 256 run the kernels (kernels/rans.cu) on the symbols' device where a
    kernel backend is available (hvdcomp.backends.kernel_backend), else
    :func:`encode_symbols_reference`; the bytes are identical.  Fastest with uint8 input
    (no conversion pass); packed codes: :func:`encode_codes`.
    """
    import torch
    _check_alphabet(alphabet)
    dev = symbols.device if isinstance(symbols, torch.Tensor) else torch.device("cpu")
    be = _kernels(dev, alphabet)
    if be is not None:
        sym = _as_uint8_symbols(symbols, alphabet)
        if sym is not None:
            from ..backends import k_rans
            return k_rans.encode(be, sym, sym.numel(), 8, alphabet, chunk_size).cpu().numpy()
    if isinstance(symbols, torch.Tensor):
        symbols = symbols.detach().cpu().numpy()
    return encode_symbols_reference(symbols, alphabet, chunk_size)


def decode_symbols(section, n_expected: int, alphabet: int) -> np.ndarray:
    """Inverse of :func:`encode_symbols`; returns int64 symbols (numpy).  Raises
    WireFormatError unless the section is well formed, holds ``n_expected`` symbols of
    ``alphabet``.  Kernels on the CPU where available (alphabet <= 256), else
    :func:`decode_symbols_reference`; same results, same errors."""
    be = _kernels("cpu", alphabet)
    if be is None:
        return decode_symbols_reference(section, n_expected, alphabet)
    from ..backends import k_rans
    return k_rans.decode(be, _section_bytes(section), n_expected, alphabet, 8).numpy() \
        .astype(np.int64)


def _section_bytes(section):
    import torch
    if isinstance(section, torch.Tensor):
        return section
    return np.ascontiguousarray(section, dtype=np.uint8).reshape(-1)


def encode_codes(packed, n: int, bits: int, alphabet: int = 0,
                 chunk_size: int = 0) -> np.ndarray:
    """The entropy section of ``n`` codes packed at ``bits`` (1..8) each (uint8 tensor as
    hvdcomp.codecs.bitpack.pack_bits makes, on any device), alphabet ``alphabet`` (default
    2**bits): the same bytes as ``encode_symbols(unpack_bits(packed, n, bits), alphabet)``
    without unpacking (kernels/rans.cu reads the packed codes).  uint8 numpy array.
    Raises ValueError for codes >= alphabet or bad sizes."""
    from .bitpack import unpack_bits
    alphabet = alphabet or (1 << bits)
    if not 1 <= bits <= 8 or not 1 <= alphabet <= (1 << bits):
        raise ValueError(f"bits must be in 1..8 and alphabet in 1..2**bits, got {bits}, "
                         f"{alphabet}")
    be = _kernels(packed.device, alphabet)
    if be is not None:
        from ..backends import k_rans
        return k_rans.encode(be, packed, n, bits, alphabet, chunk_size).cpu().numpy()
    codes = unpack_bits(packed.reshape(-1), n, bits)
    return encode_symbols_reference(codes.cpu().numpy(), alphabet, chunk_size)


def decode_codes(section, n_expected: int, bits: int, alphabet: int = 0,
                 device=None):
    """Inverse of :func:`encode_codes`: the ``n_expected`` codes packed at ``bits`` (uint8
    tensor on ``device``, default CPU), bytes as ``pack_bits`` would make them.  Raises
    WireFormatError as :func:`decode_symbols`."""
    import torch
    from .bitpack import pack_bits
    alphabet = alphabet or (1 << bits)
    if not 1 <= bits <= 8 or not 1 <= alphabet <= (1 << bits):
        raise ValueError(f"bits must be in 1..8 and alphabet in 1..2**bits, got {bits}, "
                         f"{alphabet}")
    dev = torch.device(device) if device is not None else torch.device("cpu")
    be = _kernels(dev, alphabet)
    if be is not None:
        from ..backends import k_rans
        return k_rans.decode(be, _section_bytes(section), n_expected, alphabet, bits, dev)
    sec = section.detach().cpu().numpy() if isinstance(section, torch.Tensor) else section
    sym = decode_symbols_reference(sec, n_expected, alphabet)
    return pack_bits(torch.from_numpy(sym), bits).to(dev)
