"""Entropy coding of quantized symbols (the codec API): static-model rANS in independent
chunks, the section format of hvdcomp.ops.rans (Duda, arXiv 1311.2540).

    encode_symbols(symbols, alphabet, chunk_size=0)          -> uint8 numpy section
    decode_symbols(section, n_expected, alphabet)            -> int64 numpy symbols
    encode_codes(packed, n, bits, alphabet=0, chunk_size=0)  -> uint8 numpy section
    decode_codes(section, n_expected, bits, alphabet=0, *, device=None)
                                                             -> uint8 tensor, packed codes
    empirical_entropy_bits(symbols, alphabet)                -> n * H in bits

Sections are host memory (numpy), as messages carry them; packed codes stay on their
device.  The ops run kernels/rans.cu where a kernel backend serves the device, else the
NumPy specification; the bytes are the same either way.
"""
from __future__ import annotations

import numpy as np
import torch

from ..ops import rans as rans_ops
from ..ops.rans import decode_codes, decode_symbols, encode_symbols

__all__ = ["encode_symbols", "decode_symbols", "encode_codes", "decode_codes",
           "empirical_entropy_bits"]


def encode_codes(packed: torch.Tensor, n: int, bits: int, alphabet: int = 0,
                 chunk_size: int = 0) -> np.ndarray:
    """The entropy section of ``n`` codes packed at ``bits`` (1..8) each (uint8 tensor as
    hvdcomp.codecs.pack_bits makes, on any device), alphabet ``alphabet`` (default
    2**bits), as a uint8 numpy array: the bytes of
    ``encode_symbols(unpack_bits(packed, n, bits), alphabet)``, coded without unpacking.
    Raises ValueError for codes >= alphabet or bad sizes."""
    return rans_ops.encode_codes(packed, n, bits, alphabet, chunk_size).cpu().numpy()


def empirical_entropy_bits(symbols: np.ndarray, alphabet: int) -> float:
    """n * H(empirical distribution) of integer ``symbols`` in [0, alphabet), in bits."""
    counts = np.bincount(np.asarray(symbols, dtype=np.int64), minlength=alphabet)
    n = counts.sum()
    p = counts[counts > 0] / n
    return float(-(counts[counts > 0] * np.log2(p)).sum())
