"""Byte-level codecs shared by the compressors: bit packing (and, later, entropy coding)."""
from .bitpack import pack_bits, unpack_bits, packed_size

__all__ = ["pack_bits", "unpack_bits", "packed_size"]
