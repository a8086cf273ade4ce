"""Byte-level codecs shared by the compressors: bit packing and rANS entropy coding."""
from .bitpack import pack_bits, packed_size, unpack_bits
from .rans import decode_codes, decode_symbols, empirical_entropy_bits, encode_codes, encode_symbols

__all__ = ["pack_bits", "unpack_bits", "packed_size", "encode_symbols", "decode_symbols",
           "empirical_entropy_bits", "code_section", "read_code_section", "encode_codes",
           "decode_codes"]


def code_section(codes, bits: int, entropy: bool):
    """The symbol section of a quantizer's message and the header flag it needs:
    ``codes`` (int tensor, values < 2**bits) packed at ``bits`` each, or rANS-coded."""
    from ..wire import FLAG_ENTROPY
    if entropy:
        return encode_symbols(codes, 1 << bits), FLAG_ENTROPY
    return pack_bits(codes, bits).cpu().numpy(), 0


def read_code_section(msg, index: int, n: int, bits: int, what: str = "codes"):
    """Inverse of :func:`code_section` for section ``index`` of a validated message: the
    ``n`` codes as an int64 tensor.  Raises WireFormatError for a malformed section."""
    import numpy as np
    import torch
    from ..wire import FLAG_ENTROPY
    if msg.flags & FLAG_ENTROPY:
        return torch.from_numpy(decode_symbols(msg.sections[index], n, 1 << bits))
    msg.section_size_check(index, packed_size(n, bits), what)
    return unpack_bits(torch.from_numpy(np.array(msg.sections[index])), n, bits)
