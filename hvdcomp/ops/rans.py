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
chunks can be encoded and decoded in parallel: the reference does all chunks in lockstep
with NumPy; kernels/rans.cu runs one thread per chunk and writes the same bytes.

The cost is the empirical entropy of the symbols under the quantized model plus, per chunk,
4 bytes of state, 4 bytes of length and at most 2 bytes of flush, plus 16 + 2A bytes of
model: within 1 % of n * H for messages of a few thousand symbols or more.

Decoding validates everything: the model must sum to 2**P, every chunk must hold at most one
word per symbol (a decode step reads at most one), consume exactly its words and end in the
encoder's initial state; anything else raises WireFormatError.  So a decode iterates and
allocates within a small multiple of n and of the section's size, whatever its chunk size
field says (a chunk size above n means one chunk of n symbols).

The ops (hvdcomp.ops: the kernel where a backend serves the device, else the reference; the
same bytes and the same errors either way):

    encode_symbols(symbols, alphabet, chunk_size=0)       -> uint8 numpy section
    decode_symbols(section, n_expected, alphabet)         -> int64 numpy symbols
    encode_codes(packed, n, bits, alphabet=0, chunk_size=0)
                                                          -> uint8 tensor section
    decode_codes(section, n_expected, bits, alphabet=0, *, device=None)
                                                          -> uint8 tensor, codes packed at bits
    histogram(packed, n, bits)                            -> int64 tensor (2**bits,) counts

The references of encode_symbols / decode_symbols are the specification; the codes ops
read and write codes packed at ``bits`` (1..8) each (hvdcomp.ops.bitpack), so the kernels
never unpack them.  The kernels serve alphabets of at most 256 symbols (MAX_ALPHABET) and
integer symbols; for anything else they return NotImplemented and the reference runs.
"""
from __future__ import annotations

import struct

import numpy as np
import torch

from ..backends._common import BLOCK, check_int, check_tensor, grid_for
from ..errors import WireFormatError
from . import op
from .bitpack import pack_bits, packed_size, unpack_bits

__all__ = ["encode_symbols", "decode_symbols", "encode_codes", "decode_codes", "histogram",
           "quantize_frequencies", "PRECISION", "MAX_ALPHABET"]

PRECISION = 15
MAX_ALPHABET = 256       # the kernels' largest alphabet (symbols are uint8 there)
SEGMENT = 1 << 16        # symbols per histogram thread (a multiple of 8)
GATHER_BYTES = 16        # output bytes per gather thread (kernels/rans.cu kGatherBytes)
_L = 1 << 16             # the state's lower bound, and every chunk's initial state
_HEAD = struct.Struct("<BBHIQ")

# The chunk-level errors of a section, by the kernels' status code (kernels/rans.cu), in the
# order of priority in which the reference raises them.
_STATE, _TRUNCATED, _CORRUPTED = 1, 2, 3
_CHUNK_ERRORS = {
    _STATE: "entropy stream: initial state out of range",
    _TRUNCATED: "entropy stream truncated: a chunk ran out of words",
    _CORRUPTED: "entropy stream corrupted: a chunk did not end in its initial state or left "
                "words unread",
}


# ---- the format's decisions, shared by the references and the kernels ----------------------

def quantize_frequencies(counts: np.ndarray, precision: int = PRECISION) -> np.ndarray:
    """Scale symbol counts to integer frequencies summing to 2**precision, keeping every
    present symbol at >= 1 (absent symbols get 0).  counts: int (A,); returns int64 (A,).
    Raises ValueError if more than 2**precision symbols are present."""
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


def _check_alphabet(alphabet: int) -> None:
    if not 1 <= alphabet <= 65536:
        raise ValueError(f"alphabet must be in 1..65536, got {alphabet}")


def _codes_alphabet(bits: int, alphabet: int) -> int:
    """The alphabet of codes packed at ``bits``: ``alphabet`` or, if 0, 2**bits.  Raises
    ValueError unless 1 <= bits <= 8 and 1 <= alphabet <= 2**bits."""
    alphabet = alphabet or (1 << bits)
    if not 1 <= bits <= 8 or not 1 <= alphabet <= (1 << bits):
        raise ValueError(f"bits must be in 1..8 and alphabet in 1..2**bits, got {bits}, "
                         f"{alphabet}")
    return alphabet


def _out_of_alphabet(alphabet: int) -> ValueError:
    return ValueError(f"symbols must be in [0, {alphabet})")


def _chunk_size(n: int) -> int:
    # About 1024 chunks for large messages (parallel work), at least 4096 symbols each.
    c = max(4096, -(-n // 1024))
    return -(-c // 256) * 256


def _section_layout(n: int, alphabet: int, counts: np.ndarray, chunk_size: int = 0):
    """The parts of a section that depend on the symbol counts alone: (C, K, freq int64
    (alphabet,), head bytes: the fixed header and the model)."""
    C = chunk_size or min(_chunk_size(n), max(n, 1))
    freq = quantize_frequencies(counts, PRECISION)
    K = -(-n // C) if n else 0
    head = _HEAD.pack(PRECISION, 0, alphabet & 0xFFFF, C, n) + freq.astype("<u2").tobytes()
    return C, K, freq, head


def _section_array(section) -> np.ndarray:
    """A section (uint8 numpy array, bytes or tensor on any device) as a flat uint8 array."""
    if isinstance(section, torch.Tensor):
        section = section.detach().reshape(-1).cpu().numpy()
    return np.ascontiguousarray(section, dtype=np.uint8).reshape(-1)


def _parse_section(buf: np.ndarray, n_expected: int, alphabet: int):
    """Validate a section's header, model and chunk table.  Returns None for a valid empty
    section, else (C, n, freq int64 (A,), K, lengths int64 (K,), off: byte offset of the
    first chunk stream).  Raises WireFormatError."""
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
    # A chunk reads at most one word per symbol: so a decoder's work and memory stay within
    # a small multiple of n and of the section's size, whatever the chunk size field says.
    symbols = np.full(K, min(C, n), dtype=np.int64)
    symbols[-1] = n - (K - 1) * C
    if ((lengths - 4) // 2 > symbols).any():
        raise WireFormatError("entropy section: a chunk holds more words than symbols")
    return C, n, freq, K, lengths, off


def _device(section, device) -> torch.device:
    """Where decoded codes go: ``device``, else the section's device, else the CPU."""
    if device is not None:
        return torch.device(device)
    return section.device if isinstance(section, torch.Tensor) else torch.device("cpu")


# ---- symbols: the specification -------------------------------------------------------------

@op
def encode_symbols(symbols, alphabet: int, chunk_size: int = 0) -> np.ndarray:
    """The entropy section of ``symbols``, the specification (NumPy, all chunks in lockstep).

    symbols: 1-D integer numpy array or tensor (any device), values in [0, alphabet).
    alphabet: 1..65536.  chunk_size: symbols per chunk (0: the format's choice).
    Returns the section as a uint8 numpy array.  Raises ValueError for symbols outside the
    alphabet or an alphabet outside 1..65536.  Kernel: integer symbols, alphabet <= 256
    (fastest with uint8 symbols: no conversion pass).
    """
    if isinstance(symbols, torch.Tensor):
        symbols = symbols.detach().cpu().numpy()
    sym = np.ascontiguousarray(symbols).reshape(-1).astype(np.int64)
    n = sym.size
    _check_alphabet(alphabet)
    if n and (sym.min() < 0 or sym.max() >= alphabet):
        raise _out_of_alphabet(alphabet)
    C, K, freq, head = _section_layout(n, alphabet, np.bincount(sym, minlength=alphabet),
                                       chunk_size)
    if K == 0:
        return np.frombuffer(head, dtype=np.uint8).copy()
    cum = np.concatenate([[0], np.cumsum(freq)[:-1]]).astype(np.uint64)
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
    for t in range(C - 1, -1, -1):          # rANS codes in reverse
        s = S[:, t]
        f = F[s]
        c = cum[s]
        act = None if t < m_last else rows < K - 1     # the last chunk has no symbol here
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


@op
def decode_symbols(section, n_expected: int, alphabet: int) -> np.ndarray:
    """Inverse of :func:`encode_symbols`, the specification (NumPy, all chunks in lockstep).

    section: uint8 numpy array, bytes or tensor (any device).  Returns the ``n_expected``
    symbols as an int64 numpy array.  Raises WireFormatError unless the section is well
    formed and holds ``n_expected`` symbols of ``alphabet``.  Kernel: alphabet <= 256.
    """
    buf = _section_array(section)
    parsed = _parse_section(buf, n_expected, alphabet)
    if parsed is None:
        return np.zeros(0, dtype=np.int64)
    C, n, freq, K, lengths, off = parsed
    A = freq.size
    steps = min(C, n)                                  # symbols of the longest chunk
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
    out = np.zeros((K, steps), dtype=np.int64)
    rows = np.arange(K)
    m_last = n - (K - 1) * C
    if ((x < _L) | (x >= 1 << 32)).any():
        raise WireFormatError(_CHUNK_ERRORS[_STATE])
    for t in range(steps):
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
                raise WireFormatError(_CHUNK_ERRORS[_TRUNCATED])
            x[r] = (x[r] << np.uint64(16)) | W[r, ptr[r]]
            ptr[r] += 1
    if (x != _L).any() or (ptr != nwords).any():
        raise WireFormatError(_CHUNK_ERRORS[_CORRUPTED])
    return out.reshape(-1)[:n]


# ---- packed codes -------------------------------------------------------------------------

@op
def encode_codes(packed: torch.Tensor, n: int, bits: int, alphabet: int = 0,
                 chunk_size: int = 0) -> torch.Tensor:
    """The entropy section of ``n`` codes packed at ``bits`` (1..8) each.

    packed: uint8 tensor of ``packed_size(n, bits)`` bytes (any device), as
    hvdcomp.ops.bitpack.pack_bits makes it.  alphabet: 1..2**bits (0: 2**bits).
    Returns a uint8 tensor on the codes' device, byte for byte
    ``encode_symbols.reference(unpack_bits(packed, n, bits), alphabet, chunk_size)``.
    Raises ValueError for codes >= alphabet or bad sizes.  The kernel reads the packed codes
    and synchronizes with the device twice (the counts, the section's length).
    """
    alphabet = _codes_alphabet(bits, alphabet)
    codes = unpack_bits(packed.reshape(-1), n, bits)
    section = encode_symbols.reference(codes.cpu().numpy(), alphabet, chunk_size)
    return torch.from_numpy(section).to(packed.device)


@op
def decode_codes(section, n_expected: int, bits: int, alphabet: int = 0, *,
                 device=None) -> torch.Tensor:
    """Inverse of :func:`encode_codes`: the ``n_expected`` codes packed at ``bits`` (1..8),
    a uint8 tensor of ``packed_size(n_expected, bits)`` bytes on ``device`` (default: the
    section's device if a tensor, else the CPU), byte for byte
    ``pack_bits(decode_symbols.reference(section, n_expected, alphabet), bits)``.

    section: uint8 numpy array, bytes or tensor.  alphabet: 1..2**bits (0: 2**bits).
    Raises WireFormatError exactly where :func:`decode_symbols` does (same messages).
    """
    alphabet = _codes_alphabet(bits, alphabet)
    sym = decode_symbols.reference(section, n_expected, alphabet)
    return pack_bits(torch.from_numpy(sym), bits).to(_device(section, device))


@op
def histogram(packed: torch.Tensor, n: int, bits: int) -> torch.Tensor:
    """Counts of each code value among ``n`` codes packed at ``bits`` (1..8): int64 tensor
    (2**bits,) on the codes' device (the bincount of the unpacked codes).
    packed: uint8 (packed_size(n, bits),).  Raises ValueError on bad sizes."""
    codes = unpack_bits(packed.reshape(-1), n, bits)
    return torch.bincount(codes, minlength=1 << bits)


# ---- kernels/rans.cu ----------------------------------------------------------------------

def _as_uint8_symbols(symbols, alphabet: int):
    """A uint8 tensor (on the input's device) of in-range integer symbols, or raise
    ValueError as the reference does; None where the input is not integer (the reference
    then decides)."""
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


def _freqcum(freq: np.ndarray, nb: int, device) -> torch.Tensor:
    """The model as the kernels read it: int32 (2 nb,) pairs (frequency, cumulative)."""
    f = np.zeros(nb, dtype=np.int64)
    f[:freq.size] = freq
    cum = np.concatenate([[0], np.cumsum(f)[:-1]])
    fc = np.stack([f, cum], axis=1).reshape(-1).astype(np.uint32).view(np.int32)
    return torch.from_numpy(fc.copy()).to(device)


@encode_symbols.kernel
def _(be, symbols, alphabet: int, chunk_size: int = 0):
    _check_alphabet(alphabet)
    if alphabet > MAX_ALPHABET:
        return NotImplemented
    sym = _as_uint8_symbols(symbols, alphabet)
    if sym is None:
        return NotImplemented
    return encode_codes.kernels(be, sym, sym.numel(), 8, alphabet, chunk_size).cpu().numpy()


@decode_symbols.kernel
def _(be, section, n_expected: int, alphabet: int):
    if not 1 <= alphabet <= MAX_ALPHABET:
        return NotImplemented
    packed = decode_codes.kernels(be, section, n_expected, 8, alphabet)
    return packed.cpu().numpy().astype(np.int64)


@histogram.kernel
def _(be, packed: torch.Tensor, n: int, bits: int) -> torch.Tensor:
    b = check_int(bits, "bits", 1, 8)
    n = check_int(n, "n", 0, 2**62)
    packed = check_tensor(be, packed, "packed", torch.uint8, packed_size(n, b))
    nb = 1 << b
    nseg = (n + SEGMENT - 1) // SEGMENT
    if nseg == 0:
        return torch.zeros(nb, dtype=torch.int64, device=packed.device)
    partial = torch.empty(nseg * nb, dtype=torch.int32, device=packed.device)
    be.launch("hvd_rans_histogram", grid_for(nseg, 64), 64, (packed, n, b, SEGMENT, partial))
    return partial.view(nseg, nb).to(torch.int64).sum(dim=0)


@encode_codes.kernel
def _(be, packed: torch.Tensor, n: int, bits: int, alphabet: int = 0,
      chunk_size: int = 0) -> torch.Tensor:
    alphabet = _codes_alphabet(bits, alphabet)
    b = check_int(bits, "bits", 1, 8)
    n = check_int(n, "n", 0, 2**62)
    alphabet = check_int(alphabet, "alphabet", 1, 1 << b)
    chunk_size = check_int(chunk_size, "chunk_size", 0, 2**32 - 1)
    packed = check_tensor(be, packed, "packed", torch.uint8, packed_size(n, b))
    dev = packed.device
    counts = histogram.kernels(be, packed, n, b).cpu().numpy()
    if counts[alphabet:].any():
        raise _out_of_alphabet(alphabet)
    C, K, freq, head = _section_layout(n, alphabet, counts[:alphabet], chunk_size)
    head_t = torch.frombuffer(bytearray(head), dtype=torch.uint8)
    if K == 0:
        return head_t.to(dev)
    slot_size = min(C, n)
    slots = torch.empty(K * slot_size, dtype=torch.int16, device=dev)
    states = torch.empty(K, dtype=torch.int32, device=dev)
    cnt = torch.empty(K, dtype=torch.int64, device=dev)
    fc = _freqcum(freq, 1 << b, dev)
    be.launch("hvd_rans_encode", grid_for(K, 32), 32,
              (packed, n, b, C, K, slot_size, fc, slots, states, cnt))
    lengths = cnt * 2 + 4
    offsets = torch.zeros(K + 1, dtype=torch.int64, device=dev)
    torch.cumsum(lengths, 0, out=offsets[1:])
    total = int(offsets[K])
    base = len(head) + 4 * K
    out = torch.empty(base + total, dtype=torch.uint8, device=dev)
    out[:len(head)] = head_t.to(dev)
    out[len(head):base] = lengths.to(torch.int32).view(torch.uint8)   # little-endian u32
    be.launch("hvd_rans_gather", grid_for((total + GATHER_BYTES - 1) // GATHER_BYTES),
              BLOCK, (slots, states, cnt, offsets, K, slot_size, out[base:], total))
    return out


@decode_codes.kernel
def _(be, section, n_expected: int, bits: int, alphabet: int = 0, *,
      device=None) -> torch.Tensor:
    alphabet = _codes_alphabet(bits, alphabet)
    b = check_int(bits, "bits", 1, 8)
    alphabet = check_int(alphabet, "alphabet", 1, 1 << b)
    n_expected = check_int(n_expected, "n_expected", 0, 2**62)
    dev = _device(section, device)
    buf = _section_array(section)          # the header, model and chunk table: on the CPU
    parsed = _parse_section(buf, n_expected, alphabet)
    if parsed is None:
        return torch.zeros(0, dtype=torch.uint8, device=dev)
    C, n, freq, K, lengths, off = parsed
    if isinstance(section, torch.Tensor):
        sec_t = section.detach().reshape(-1).to(dev)
    else:
        sec_t = torch.from_numpy(buf if buf.flags.writeable else buf.copy()).to(dev)
    sec_t = check_tensor(be, sec_t, "section", torch.uint8, buf.size)
    offsets = np.empty(K + 1, dtype=np.int64)
    offsets[0] = off
    np.cumsum(lengths, out=offsets[1:])
    offsets[1:] += off
    fc = _freqcum(freq, 1 << b, dev)
    table = torch.empty(1 << PRECISION, dtype=torch.uint8, device=dev)
    be.launch("hvd_rans_slot_table", grid_for(1 << PRECISION), BLOCK, (fc, alphabet, table))
    sym = torch.empty(n, dtype=torch.uint8, device=dev)
    status = torch.empty(K, dtype=torch.int32, device=dev)
    be.launch("hvd_rans_decode", grid_for(K, 32), 32,
              (sec_t, torch.from_numpy(offsets).to(dev), K, C, n, table, fc, sym, status))
    status = status.cpu()
    for code, message in _CHUNK_ERRORS.items():
        if bool((status == code).any()):
            raise WireFormatError(message)
    if b == 8:
        return sym
    out = torch.empty(packed_size(n, b), dtype=torch.uint8, device=dev)
    be.launch("hvd_rans_pack", grid_for((n + 7) // 8), BLOCK, (sym, n, b, out))
    return out
