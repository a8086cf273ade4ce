"""Byte-level codecs shared by the compressors: bit packing and rANS entropy coding."""
from .bitpack import pack_bits, packed_size, unpack_bits
from .rans import decode_symbols, empirical_entropy_bits, encode_symbols

__all__ = ["pack_bits", "unpack_bits", "packed_size", "encode_symbols", "decode_symbols",
           "empirical_entropy_bits"]
