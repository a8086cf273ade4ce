"""The code section of a message: ``n`` codes of ``bits`` bits, packed or rANS-coded.

Every compressor that sends fixed-width codes writes them with :func:`write_codes` and reads
them with :func:`read_codes`; the packed form (``hvdcomp.ops.bitpack.pack_bits``: code i
at bit ``i * bits``, little-endian within bytes) is the currency on both sides, so the
kernels never unpack to int64 and back.  With ``entropy`` the section is the rANS coding of
the codes (hvdcomp.ops.rans, alphabet ``2**bits`` unless given) and the message carries
FLAG_ENTROPY.
"""
from __future__ import annotations

from typing import Tuple

import numpy as np
import torch

from ..ops.bitpack import packed_size
from ..ops.rans import decode_codes, encode_codes
from ..wire import FLAG_ENTROPY, Message

__all__ = ["write_codes", "read_codes"]


def write_codes(packed: torch.Tensor, n: int, bits: int, entropy: bool,
                alphabet: int = 0) -> Tuple[np.ndarray, int]:
    """(section, flag) for ``n`` codes packed at ``bits`` each.

    packed: uint8 tensor of ``packed_size(n, bits)`` bytes on any device.
    entropy: rANS-code the codes (flag FLAG_ENTROPY), else send the packed bytes (flag 0).
    alphabet: number of distinct codes for the entropy coder (default ``2**bits``).
    Returns the section as a uint8 NumPy array (host memory) and the header flag.
    Raises ValueError for codes outside the alphabet.
    """
    if entropy:
        return encode_codes(packed, n, bits, alphabet).cpu().numpy(), FLAG_ENTROPY
    return packed.cpu().numpy(), 0


def read_codes(msg: Message, index: int, n: int, bits: int, *, alphabet: int = 0,
               device=None, what: str = "codes") -> torch.Tensor:
    """Inverse of :func:`write_codes` for section ``index`` of a validated message: the
    ``n`` codes packed at ``bits`` (uint8 tensor of ``packed_size(n, bits)`` bytes on
    ``device``, default CPU).  Raises WireFormatError for a section of the wrong size or a
    malformed entropy section (``what`` names the section in the error)."""
    if msg.flags & FLAG_ENTROPY:
        return decode_codes(msg.sections[index], n, bits, alphabet, device=device)
    msg.section_size_check(index, packed_size(n, bits), what)
    out = torch.from_numpy(np.array(msg.sections[index], dtype=np.uint8))
    return out if device is None else out.to(device)
