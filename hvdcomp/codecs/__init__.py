"""Byte-level codecs shared by the compressors: bit packing (hvdcomp.ops.bitpack), rANS
entropy coding (rans), the code section of a message (sections) and the sparse codecs
(sparse)."""
from ..ops.bitpack import pack_bits, packed_size, unpack_bits
from .rans import decode_codes, decode_symbols, empirical_entropy_bits, encode_codes, encode_symbols

__all__ = ["pack_bits", "unpack_bits", "packed_size", "encode_symbols", "decode_symbols",
           "empirical_entropy_bits", "encode_codes", "decode_codes"]
