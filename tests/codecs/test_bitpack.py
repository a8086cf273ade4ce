"""hvdcomp.ops.bitpack: dense LSB-first packing of B-bit codes.

Golden bytes are worked by hand from the bit order in the module docstring: code i occupies
bits [i*B, (i+1)*B) of a little-endian bit stream, least significant bit first.  Random
cases are compared with a reference built on one Python integer (the whole bit stream).
"""
import pytest
import torch

from hvdcomp.ops.bitpack import pack_bits, packed_size, unpack_bits


def ref_pack(codes, bits):
    """The bit stream as one Python int: sum of code_i << (i*bits); then its bytes."""
    acc = 0
    for i, c in enumerate(codes):
        assert 0 <= c < 2**bits
        acc |= int(c) << (i * bits)
    nbytes = (len(codes) * bits + 7) // 8
    return list(acc.to_bytes(nbytes, "little"))


def _codes(values):
    return torch.tensor(values, dtype=torch.int64)


# --- golden bytes, worked by hand -----------------------------------------------------

def test_golden_bits3():
    # codes 1, 2, 3, 4 with B = 3 occupy stream bits [0,3), [3,6), [6,9), [9,12):
    #   byte 0 = c0 | c1 << 3 | (c2 & 0b11) << 6 = 1 + 16 + (3 << 6 = 192) = 209
    #   byte 1 = c2 >> 2 | c3 << 1               = 0 + (4 << 1 = 8)       = 8
    # 4 * 3 = 12 bits -> 2 bytes; bits 12..15 of byte 1 are zero.
    packed = pack_bits(_codes([1, 2, 3, 4]), 3)
    assert packed.dtype == torch.uint8
    assert packed.tolist() == [209, 8]
    assert unpack_bits(packed, 4, 3).tolist() == [1, 2, 3, 4]


def test_golden_bits3_full_group():
    # eight codes 7, 0, 0, 0, 0, 0, 0, 7 (B = 3) fill exactly 24 bits = 3 bytes:
    #   c0 = 7 -> bits 0..2 -> byte 0 = 0b00000111 = 7
    #   c7 = 7 -> bits 21..23 -> byte 2 bits 5..7 = 0b11100000 = 224
    packed = pack_bits(_codes([7, 0, 0, 0, 0, 0, 0, 7]), 3)
    assert packed.tolist() == [7, 0, 224]


def test_golden_bits1():
    # B = 1: code i is bit i.  codes 1,0,1,1,0,0,0,1 -> bits 0, 2, 3, 7 set:
    #   byte 0 = 1 + 4 + 8 + 128 = 141; the ninth code (1) is bit 0 of byte 1 -> 1.
    packed = pack_bits(_codes([1, 0, 1, 1, 0, 0, 0, 1, 1]), 1)
    assert packed.tolist() == [141, 1]
    assert unpack_bits(packed, 9, 1).tolist() == [1, 0, 1, 1, 0, 0, 0, 1, 1]


def test_golden_bits5():
    # B = 5: codes 22 (0b10110) and 13 (0b01101) -> stream value 22 | 13 << 5 = 22 + 416
    #   = 438 = 0b1_1011_0110 -> byte 0 = 0b10110110 = 182, byte 1 = 0b1 = 1.
    # 10 bits -> 2 bytes.
    packed = pack_bits(_codes([22, 13]), 5)
    assert packed.tolist() == [182, 1]
    assert unpack_bits(packed, 2, 5).tolist() == [22, 13]


def test_golden_bits5_three_codes():
    # codes 31, 1, 2 (B = 5): 31 | 1 << 5 | 2 << 10 = 31 + 32 + 2048 = 2111 = 0x083F
    #   -> bytes 0x3F = 63, 0x08 = 8 (15 bits -> 2 bytes).
    assert pack_bits(_codes([31, 1, 2]), 5).tolist() == [63, 8]


def test_golden_bits8_is_identity():
    vals = [0, 1, 127, 128, 200, 255, 3]
    assert pack_bits(_codes(vals), 8).tolist() == vals


def test_golden_bits7_high_bit_of_group():
    # B = 7, 8 codes = 56 bits = 7 bytes; only the last code is 127 -> bits 49..55 set:
    # byte 6 = bits 48..55 -> 0b11111110 = 254, byte 5 = 0 ... byte 0 = 0.
    assert pack_bits(_codes([0] * 7 + [127]), 7).tolist() == [0, 0, 0, 0, 0, 0, 254]


def test_golden_bits8_high_values_in_last_slot():
    # B = 8 puts code 7 in bits 56..63 of the 64-bit group word (the sign bit of int64):
    # 255 there must still come out as byte 255.
    vals = [1, 2, 3, 4, 5, 6, 7, 255, 128]
    assert pack_bits(_codes(vals), 8).tolist() == vals
    assert unpack_bits(pack_bits(_codes(vals), 8), 9, 8).tolist() == vals


# --- round trips against the reference ----------------------------------------------------

@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 1001])
def test_round_trip_and_reference(bits, n, gen):
    codes = torch.randint(0, 2**bits, (n,), generator=gen, dtype=torch.int64)
    if n:
        codes[-1] = 2**bits - 1          # the all-ones code in the last (partial) group
        codes[0] = 2**bits - 1
    packed = pack_bits(codes, bits)
    assert packed.dtype == torch.uint8
    assert packed.numel() == (n * bits + 7) // 8
    assert packed.tolist() == ref_pack(codes.tolist(), bits)
    out = unpack_bits(packed, n, bits)
    assert out.dtype == torch.int64
    assert out.shape == (n,)
    assert torch.equal(out, codes)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int32, torch.int16])
def test_pack_accepts_other_integer_dtypes(dtype):
    codes = torch.tensor([1, 2, 3, 4], dtype=dtype)
    assert pack_bits(codes, 3).tolist() == [209, 8]


def test_pack_accepts_2d_codes_in_row_major_order():
    codes = torch.tensor([[1, 2], [3, 4]])
    assert pack_bits(codes, 3).tolist() == [209, 8]


def test_padding_bits_of_last_byte_are_zero():
    # unused high bits of the last byte are zero: 3 codes of 3 bits = 9 bits -> bits 9..15
    # of byte 1 must be 0 even for all-ones codes.
    packed = pack_bits(_codes([7, 7, 7]), 3)
    assert packed.tolist() == [255, 1]


# --- errors ----------------------------------------------------------------------------

@pytest.mark.parametrize("bits,n,wrong", [(3, 4, 1), (3, 4, 3), (1, 9, 1), (8, 5, 4),
                                          (8, 5, 6), (5, 0, 1), (2, 1, 0)])
def test_unpack_wrong_length_raises(bits, n, wrong):
    assert wrong != packed_size(n, bits)
    with pytest.raises(ValueError, match="bytes"):
        unpack_bits(torch.zeros(wrong, dtype=torch.uint8), n, bits)


@pytest.mark.parametrize("bits", [0, 9, -1, 16])
def test_bits_out_of_range_raise(bits):
    with pytest.raises(ValueError, match="bits"):
        pack_bits(_codes([0, 1]), bits)
    with pytest.raises(ValueError, match="bits"):
        unpack_bits(torch.zeros(2, dtype=torch.uint8), 2, bits)


@pytest.mark.parametrize("n", [0, 1, 2, 7, 8, 9, 15, 16, 17, 1001, 10**9 + 7])
@pytest.mark.parametrize("bits", range(1, 9))
def test_packed_size_formula(n, bits):
    # ceil(n * bits / 8) computed as a float-free ceiling division
    expected = -(-n * bits // 8)
    assert packed_size(n, bits) == expected
    assert packed_size(n, bits) * 8 >= n * bits > (packed_size(n, bits) - 1) * 8 or n == 0
