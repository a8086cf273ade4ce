"""Pack unsigned B-bit codes (1 <= B <= 8) densely into bytes, and back.

Bit order (pinned by a golden-bytes test): code i occupies bits [i*B, (i+1)*B) of the
message's little-endian bit stream, least significant bit first.  So for B = 3 the codes
c0, c1, c2 ... give byte 0 = c0 | c1 << 3 | (c2 & 3) << 6, byte 1 = c2 >> 2 | c3 << 1 | ...
The packed length is ceil(n * B / 8) bytes; unused high bits of the last byte are zero.

Implementation: 8 codes hold exactly B bytes, so each group of 8 codes is assembled into one
64-bit word and split into its B low bytes.  Works on CPU and CUDA tensors.

Packed codes are the currency between the layers (the kernels read and write them in this
order; hvdcomp.ops.rans codes them without unpacking), so this module sits in the ops layer,
below the codecs, with the other coders that have kernels (rans, rice).
"""
from __future__ import annotations

import torch

__all__ = ["pack_bits", "unpack_bits", "packed_size"]


def packed_size(n: int, bits: int) -> int:
    """Bytes needed for ``n`` codes of ``bits`` bits."""
    return (n * bits + 7) // 8


def _check_bits(bits: int) -> None:
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be in 1..8, got {bits}")


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes: 1-D integer tensor with values in [0, 2**bits); returns a uint8 tensor of
    ``packed_size(len(codes), bits)`` bytes on the same device."""
    _check_bits(bits)
    n = codes.numel()
    if n == 0:
        return torch.empty(0, dtype=torch.uint8, device=codes.device)
    groups = (n + 7) // 8
    c = torch.zeros(groups * 8, dtype=torch.int64, device=codes.device)
    c[:n] = codes.reshape(-1).to(torch.int64)
    c = c.view(groups, 8)
    shifts = torch.arange(8, device=codes.device, dtype=torch.int64) * bits
    word = (c << shifts).sum(dim=1)            # disjoint bit ranges: sum == bitwise or
    byte_shifts = torch.arange(bits, device=codes.device, dtype=torch.int64) * 8
    out = ((word.unsqueeze(1) >> byte_shifts) & 0xFF).to(torch.uint8).reshape(-1)
    return out[:packed_size(n, bits)]


def unpack_bits(packed: torch.Tensor, n: int, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: returns ``n`` codes as an int64 tensor.

    Raises ValueError if ``packed`` does not hold exactly ``packed_size(n, bits)`` bytes.
    """
    _check_bits(bits)
    need = packed_size(n, bits)
    if packed.numel() != need:
        raise ValueError(f"{n} codes of {bits} bits need {need} bytes, got {packed.numel()}")
    if n == 0:
        return torch.empty(0, dtype=torch.int64, device=packed.device)
    groups = (n + 7) // 8
    b = torch.zeros(groups * bits, dtype=torch.int64, device=packed.device)
    b[:need] = packed.reshape(-1).to(torch.int64)
    b = b.view(groups, bits)
    byte_shifts = torch.arange(bits, device=packed.device, dtype=torch.int64) * 8
    word = (b << byte_shifts).sum(dim=1)
    shifts = torch.arange(8, device=packed.device, dtype=torch.int64) * bits
    codes = (word.unsqueeze(1) >> shifts) & ((1 << bits) - 1)
    return codes.reshape(-1)[:n]
