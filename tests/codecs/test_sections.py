"""hvdcomp.codecs.sections: the code section of a message, packed or rANS-coded.

write_codes / read_codes round-trip the packed codes through the wire bytes for every width
1..8 and odd lengths, with and without entropy coding; a section of the wrong size is a
WireFormatError.
"""
import numpy as np
import pytest
import torch

from hvdcomp.ops.bitpack import pack_bits, packed_size
from hvdcomp.codecs.sections import read_codes, write_codes
from hvdcomp.errors import WireFormatError
from hvdcomp.wire import FLAG_ENTROPY, Message

QSGD, F32 = 10, 1


def wire(section, flags, n):
    """A message carrying ``section`` as its only section, through its bytes and back."""
    msg = Message(codec=QSGD, dtype=F32, shape=(n,), sections=(section,), flags=flags)
    return Message.from_bytes(msg.to_bytes())


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("n", [0, 1, 7, 999, 4097])
@pytest.mark.parametrize("entropy", [False, True])
def test_round_trip(rng, bits, n, entropy):
    codes = torch.from_numpy(rng.integers(0, 1 << bits, n))
    packed = pack_bits(codes, bits)
    section, flags = write_codes(packed, n, bits, entropy)
    assert isinstance(section, np.ndarray) and section.dtype == np.uint8
    assert flags == (FLAG_ENTROPY if entropy else 0)
    if not entropy:
        assert section.tobytes() == packed.numpy().tobytes()
    got = read_codes(wire(section, flags, n), 0, n, bits)
    assert got.dtype == torch.uint8 and got.device.type == "cpu"
    assert torch.equal(got, packed)


@pytest.mark.parametrize("bits,alphabet", [(2, 3), (4, 9), (8, 200)])
def test_round_trip_smaller_alphabet(rng, bits, alphabet):
    n = 3001
    packed = pack_bits(torch.from_numpy(rng.integers(0, alphabet, n)), bits)
    section, flags = write_codes(packed, n, bits, True, alphabet)
    assert torch.equal(read_codes(wire(section, flags, n), 0, n, bits, alphabet=alphabet),
                       packed)
    with pytest.raises(WireFormatError):                # the receiver expects another model
        read_codes(wire(section, flags, n), 0, n, bits)


def test_codes_outside_the_alphabet_raise():
    packed = pack_bits(torch.tensor([0, 1, 2, 3]), 2)
    with pytest.raises(ValueError):
        write_codes(packed, 4, 2, True, 3)


@pytest.mark.parametrize("delta", [-1, 1])
def test_packed_section_of_wrong_size_rejected(rng, delta):
    n, bits = 1001, 3
    packed = pack_bits(torch.from_numpy(rng.integers(0, 8, n)), bits)
    section, flags = write_codes(packed, n, bits, False)
    bad = np.zeros(packed_size(n, bits) + delta, dtype=np.uint8)
    with pytest.raises(WireFormatError, match="sign bits"):
        read_codes(wire(bad, flags, n), 0, n, bits, what="sign bits")
    with pytest.raises(WireFormatError):                # n and bits fix the size
        read_codes(wire(section, flags, n), 0, n + 3, bits)


def test_entropy_section_of_wrong_size_rejected(rng):
    n, bits = 5000, 4
    packed = pack_bits(torch.from_numpy(rng.integers(0, 16, n)), bits)
    section, flags = write_codes(packed, n, bits, True)
    for bad in (section[:-1], np.concatenate([section, np.zeros(2, np.uint8)])):
        with pytest.raises(WireFormatError):
            read_codes(wire(bad, flags, n), 0, n, bits)
    with pytest.raises(WireFormatError):
        read_codes(wire(section, flags, n), 0, n - 1, bits)
