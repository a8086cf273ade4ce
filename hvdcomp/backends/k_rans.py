"""Launchers of kernels/rans.cu: chunked static rANS (hvdcomp/codecs/rans.py) on a kernel
backend.

Every function takes the backend object first (``be``: ``host.backend`` or ``cuda.backend``)
and works on tensors of that backend's device.  Symbols are "packed codes" at ``bits`` (1..8)
per symbol, LSB-first (hvdcomp.codecs.bitpack); ``bits = 8`` is a plain uint8 symbol array.
Alphabets of at most 256 symbols (at most ``2**bits``).

The format's own decisions (chunk size, model normalization, header and validation of a
received section) are hvdcomp.codecs.rans's functions, called here, not copies of them.

    histogram(be, packed, n, bits)                       -> int64 (2**bits,) symbol counts
    encode(be, packed, n, bits, alphabet, chunk_size=0)  -> uint8 section, bit for bit
                                                            encode_symbols_reference
    decode(be, section, n, alphabet, bits=8)             -> uint8 packed symbols, bit for bit
                                                            pack_bits(decode_symbols_reference)
"""
from __future__ import annotations

import numpy as np
import torch

from ._common import BLOCK, check_int, check_tensor, grid_for, packed_size

__all__ = ["histogram", "encode", "decode", "SEGMENT", "GATHER_BYTES", "MAX_ALPHABET"]

SEGMENT = 1 << 16        # symbols per histogram thread (a multiple of 8)
GATHER_BYTES = 16        # output bytes per gather thread (kernels/rans.cu kGatherBytes)
MAX_ALPHABET = 256
_SLOTS = 1 << 15         # 2**PRECISION


def _bits(bits) -> int:
    return check_int(bits, "bits", 1, 8)


def histogram(be, packed: torch.Tensor, n: int, bits: int) -> torch.Tensor:
    """Counts of each symbol value in ``n`` packed codes of ``bits`` bits: int64 (2**bits,)
    on the codes' device (np.bincount of the unpacked codes, minlength 2**bits).
    packed: uint8 (ceil(n * bits / 8),).  Raises TypeError / ValueError on bad arguments."""
    b = _bits(bits)
    n = check_int(n, "n", 0, 2**62)
    packed = check_tensor(be, packed, "packed", torch.uint8, packed_size(n, b))
    nb = 1 << b
    nseg = (n + SEGMENT - 1) // SEGMENT
    if nseg == 0:
        return torch.zeros(nb, dtype=torch.int64, device=packed.device)
    partial = torch.empty(nseg * nb, dtype=torch.int32, device=packed.device)
    be.launch("hvd_rans_histogram", grid_for(nseg, 64), 64, (packed, n, b, SEGMENT, partial))
    return partial.view(nseg, nb).to(torch.int64).sum(dim=0)


def _freqcum(freq: np.ndarray, nb: int, device) -> torch.Tensor:
    f = np.zeros(nb, dtype=np.int64)
    f[:freq.size] = freq
    cum = np.concatenate([[0], np.cumsum(f)[:-1]])
    fc = np.stack([f, cum], axis=1).reshape(-1).astype(np.uint32).view(np.int32)
    return torch.from_numpy(fc.copy()).to(device)


def encode(be, packed: torch.Tensor, n: int, bits: int, alphabet: int,
           chunk_size: int = 0) -> torch.Tensor:
    """The entropy section of ``n`` packed codes: uint8 tensor on the codes' device, equal
    byte for byte to ``encode_symbols_reference(unpack_bits(packed, n, bits), alphabet,
    chunk_size)``.

    alphabet: 1..2**bits (and <= 256).  Raises ValueError (as the reference) when a symbol
    is >= alphabet, TypeError / ValueError on bad arguments.  Synchronizes with the device
    twice (the counts, the section's length).
    """
    from ..codecs.rans import _out_of_alphabet, section_layout
    b = _bits(bits)
    n = check_int(n, "n", 0, 2**62)
    alphabet = check_int(alphabet, "alphabet", 1, 1 << b)
    chunk_size = check_int(chunk_size, "chunk_size", 0, 2**32 - 1)
    packed = check_tensor(be, packed, "packed", torch.uint8, packed_size(n, b))
    dev = packed.device
    counts = histogram(be, packed, n, b).cpu().numpy()
    if counts[alphabet:].any():
        raise _out_of_alphabet(alphabet)
    C, K, freq, head = section_layout(n, alphabet, counts[:alphabet], chunk_size)
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


class _Status:
    """The kernel's per-chunk status codes, as the reference's errors (in its priority)."""
    STATE, TRUNCATED, CORRUPTED = 1, 2, 3


def decode(be, section, n_expected: int, alphabet: int, bits: int = 8,
           device=None) -> torch.Tensor:
    """Decode an entropy section on ``be``'s device (``device``, default the backend's):
    the ``n_expected`` symbols packed at ``bits`` (1..8; 8: one uint8 per symbol), equal to
    ``pack_bits(decode_symbols_reference(section, n_expected, alphabet), bits)``.

    section: uint8 numpy array / bytes (validated on the CPU: header, model, chunk table,
    hvdcomp.codecs.rans.parse_section) or uint8 tensor.  alphabet: 1..2**bits (<= 256).
    Raises WireFormatError exactly where the reference does (same messages).
    """
    from ..codecs.rans import _SectionErrors, parse_section
    b = _bits(bits)
    alphabet = check_int(alphabet, "alphabet", 1, 1 << b)
    n_expected = check_int(n_expected, "n_expected", 0, 2**62)
    if isinstance(section, torch.Tensor):
        sec_t = section.detach().reshape(-1)
        buf = sec_t.cpu().numpy()
    else:
        buf = np.ascontiguousarray(section, dtype=np.uint8).reshape(-1)
        sec_t = None
    dev = torch.device(device) if device is not None else (
        sec_t.device if sec_t is not None else torch.device(be.device_type))
    parsed = parse_section(buf, n_expected, alphabet)
    if parsed is None:
        return torch.zeros(0, dtype=torch.uint8, device=dev)
    C, n, freq, K, lengths, off = parsed
    if sec_t is None or sec_t.device != dev:
        sec_t = torch.from_numpy(buf if buf.flags.writeable else buf.copy()).to(dev)
    sec_t = check_tensor(be, sec_t, "section", torch.uint8, buf.size)
    offsets = np.empty(K + 1, dtype=np.int64)
    offsets[0] = off
    np.cumsum(lengths, out=offsets[1:])
    offsets[1:] += off
    offsets_t = torch.from_numpy(offsets).to(dev)
    fc = _freqcum(freq, 1 << b, dev)
    table = torch.empty(_SLOTS, dtype=torch.uint8, device=dev)
    be.launch("hvd_rans_slot_table", grid_for(_SLOTS), BLOCK, (fc, alphabet, table))
    sym = torch.empty(n, dtype=torch.uint8, device=dev)
    status = torch.empty(K, dtype=torch.int32, device=dev)
    be.launch("hvd_rans_decode", grid_for(K, 32), 32,
              (sec_t, offsets_t, K, C, n, table, fc, sym, status))
    st = status.cpu()
    if bool((st != 0).any()):
        for code in (_Status.STATE, _Status.TRUNCATED, _Status.CORRUPTED):
            if bool((st == code).any()):
                raise _SectionErrors[code]()
    if b == 8:
        return sym
    out = torch.empty(packed_size(n, b), dtype=torch.uint8, device=dev)
    be.launch("hvd_rans_pack", grid_for((n + 7) // 8), BLOCK, (sym, n, b, out))
    return out
