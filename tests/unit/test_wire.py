"""hvdcomp.wire: wire format v1 framing, validation and Message.expect().

Expected bytes are built here with struct.pack straight from the layout table in the
hvdcomp.wire docstring (and zlib.crc32), independently of Message.to_bytes.
"""
import dataclasses
import itertools
import struct
import zlib

import numpy as np
import pytest
import torch

import hvdcomp
from hvdcomp.errors import WireFormatError
from hvdcomp.wire import DTYPES, FLAG_ENTROPY, FLAG_NONFINITE, Message

# codec / dtype numbers used below (docstring: hvdcomp.wire.CODECS / DTYPES)
NONE, FP16, QSGD, ALQ = 1, 2, 10, 13
F32 = 1


def build(*, magic=b"HVDC", version=1, codec=ALQ, dtype=F32, flags=0, bits=3, ndim=None,
          nsec=None, reserved=0, bucket_size=4, level_version=2, tensor_id=5, rank=1,
          seed=99, step=12, numel=None, shape=(2, 3), sections=(b"\x00" * 8, b"\x11\x22\x33"),
          lengths=None, extra=b"", crc=None):
    """A wire message assembled field by field per the docstring table:

        0 magic(4) | 4 version | 5 codec | 6 dtype | 7 flags | 8 bits | 9 ndim | 10 nsections
        | 11 reserved | 12 bucket size (u32) | 16 level version (u32) | 20 tensor id (u32)
        | 24 rank (u32) | 28 seed (u32) | 32 step (u64) | 40 numel (u64) | 48 shape (u64 each)
        | section lengths (u64 each) | sections | CRC-32 of everything before (u32)
    """
    if ndim is None:
        ndim = len(shape)
    if nsec is None:
        nsec = len(sections)
    if numel is None:
        numel = int(np.prod(shape, dtype=object)) if shape else 1
    if lengths is None:
        lengths = [len(s) for s in sections]
    head = struct.pack("<4s8B", magic, version, codec, dtype, flags, bits, ndim, nsec, reserved)
    head += struct.pack("<5I", bucket_size, level_version, tensor_id, rank, seed)
    head += struct.pack("<2Q", step, numel)
    head += b"".join(struct.pack("<Q", s) for s in shape)
    head += b"".join(struct.pack("<Q", n) for n in lengths)
    body = head + b"".join(bytes(s) for s in sections) + extra
    return body + struct.pack("<I", zlib.crc32(body) if crc is None else crc)


def sample_message():
    return Message(codec=ALQ, dtype=F32, shape=(2, 3),
                   sections=(np.arange(8, dtype=np.uint8), np.array([7, 8, 9], np.uint8)),
                   flags=0, bits=3, bucket_size=4, level_version=2, tensor_id=5, rank=1,
                   seed=99, step=12)


def assert_same_message(got, want):
    for f in ("codec", "dtype", "shape", "flags", "bits", "bucket_size", "level_version",
              "tensor_id", "rank", "seed", "step"):
        assert getattr(got, f) == getattr(want, f), f
    assert len(got.sections) == len(want.sections)
    for a, b in zip(got.sections, want.sections):
        assert bytes(a) == bytes(np.asarray(b, dtype=np.uint8).tobytes()
                                 if isinstance(b, np.ndarray) else b)


# --- golden bytes -----------------------------------------------------------------------

def test_golden_bytes_built_by_hand():
    msg = sample_message()
    expected = build(codec=ALQ, dtype=F32, flags=0, bits=3, bucket_size=4, level_version=2,
                     tensor_id=5, rank=1, seed=99, step=12, shape=(2, 3),
                     sections=(bytes(range(8)), bytes([7, 8, 9])))
    got = msg.to_bytes()
    assert got == expected
    # and the first bytes literally, read off the table:
    assert got[:12] == b"HVDC" + bytes([1, 13, 1, 0, 3, 2, 2, 0])
    assert got[12:16] == b"\x04\x00\x00\x00"          # bucket size 4
    assert got[32:40] == b"\x0c" + b"\x00" * 7          # step 12
    assert got[40:48] == b"\x06" + b"\x00" * 7          # numel 6
    assert got[48:64] == b"\x02" + b"\x00" * 7 + b"\x03" + b"\x00" * 7   # shape (2, 3)
    assert got[64:80] == b"\x08" + b"\x00" * 7 + b"\x03" + b"\x00" * 7   # lengths 8, 3
    assert got[80:91] == bytes(range(8)) + bytes([7, 8, 9])
    assert got[-4:] == struct.pack("<I", zlib.crc32(got[:-4]))
    assert len(got) == 48 + 8 * 2 + 8 * 2 + 11 + 4


def test_golden_bytes_scalar_no_sections():
    # 0-d tensor, no sections: 48 header bytes + CRC; numel of shape () is 1.
    msg = Message(codec=NONE, dtype=F32, shape=(), step=2**40 + 1, seed=0xDEADBEEF)
    body = (b"HVDC" + bytes([1, 1, 1, 0, 0, 0, 0, 0]) + b"\x00" * 12 + b"\x00" * 4
            + bytes.fromhex("efbeadde") + (2**40 + 1).to_bytes(8, "little")
            + (1).to_bytes(8, "little"))
    assert len(body) == 48
    assert msg.to_bytes() == body + struct.pack("<I", zlib.crc32(body))


def test_length_formula():
    for shape, secs in [((), ()), ((5,), (b"abcde",)), ((1, 2, 3, 4), (b"", b"xy", b"z"))]:
        m = Message(codec=QSGD, dtype=F32, shape=shape, sections=secs)
        assert len(m.to_bytes()) == 48 + 8 * len(shape) + 8 * len(secs) + sum(
            len(s) for s in secs) + 4


# --- round trips ------------------------------------------------------------------------

def test_round_trip_all_fields():
    msg = Message(codec=13, dtype=4, shape=(3, 1, 2), flags=0, bits=7, bucket_size=2**31,
                  level_version=0xFFFFFFFF, tensor_id=123456, rank=0xFFFFFFFF,
                  seed=0x89ABCDEF, step=2**64 - 1,
                  sections=(np.array([1, 2, 3, 4], np.uint8), b"", bytearray(b"\xff" * 5)))
    buf = msg.to_bytes()
    back = Message.from_bytes(buf)
    assert_same_message(back, msg)
    assert back.numel == 6
    assert back.codec_name == "alq"
    assert all(isinstance(s, np.ndarray) and s.dtype == np.uint8 for s in back.sections)
    assert [bytes(s) for s in back.sections] == [b"\x01\x02\x03\x04", b"", b"\xff" * 5]
    assert back.to_bytes() == buf


@pytest.mark.parametrize("kind", ["bytes", "bytearray", "memoryview", "numpy",
                                  "numpy_slice", "numpy_strided"])
def test_from_bytes_input_types(kind):
    msg = sample_message()
    buf = msg.to_bytes()
    if kind == "bytes":
        src = buf
    elif kind == "bytearray":
        src = bytearray(buf)
    elif kind == "memoryview":
        src = memoryview(b"xx" + buf + b"yy")[2:-2]
    elif kind == "numpy":
        src = np.frombuffer(buf, dtype=np.uint8)
    elif kind == "numpy_slice":
        src = np.frombuffer(b"\x00" * 5 + buf + b"\x00", dtype=np.uint8)[5:-1]
    else:   # every other byte of a larger array: not contiguous
        big = np.zeros(2 * len(buf), np.uint8)
        big[::2] = np.frombuffer(buf, np.uint8)
        src = big[::2]
    back = Message.from_bytes(src)
    assert_same_message(back, msg)


def test_nonfinite_message_round_trip():
    msg = Message(codec=QSGD, dtype=F32, shape=(4,), flags=FLAG_NONFINITE, bits=3,
                  bucket_size=8)
    back = Message.from_bytes(msg.to_bytes())
    assert back.flags == FLAG_NONFINITE == 1
    assert back.sections == ()


def test_boundaries_accepted():
    # ndim 8, 8 sections, bits 32 are the largest legal values
    buf = build(shape=(1,) * 8, sections=[b"a"] * 8, bits=32)
    m = Message.from_bytes(buf)
    assert m.shape == (1,) * 8 and len(m.sections) == 8 and m.bits == 32


def test_to_bytes_rejects_too_many_dims_or_sections():
    with pytest.raises(ValueError):
        Message(codec=NONE, dtype=F32, shape=(1,) * 9).to_bytes()
    with pytest.raises(ValueError):
        Message(codec=NONE, dtype=F32, shape=(1,), sections=(b"",) * 9).to_bytes()


# --- malformed messages -----------------------------------------------------------------

def test_truncated_at_every_length():
    buf = sample_message().to_bytes()
    for n in range(len(buf)):
        with pytest.raises(WireFormatError):
            Message.from_bytes(buf[:n])


def test_truncated_numpy_and_memoryview():
    buf = sample_message().to_bytes()
    arr = np.frombuffer(buf, np.uint8)
    for n in (0, 10, 51, 52, 60, len(buf) - 1):
        with pytest.raises(WireFormatError):
            Message.from_bytes(arr[:n])
        with pytest.raises(WireFormatError):
            Message.from_bytes(memoryview(buf)[:n])


def test_every_single_byte_change_is_caught():
    buf = sample_message().to_bytes()
    # every position, every one of the 255 other values of that byte
    for pos, mask in itertools.product(range(len(buf)), range(1, 256)):
        bad = bytearray(buf)
        bad[pos] ^= mask
        try:
            Message.from_bytes(bytes(bad))
        except WireFormatError:
            continue
        pytest.fail(f"byte {pos} ^ 0x{mask:02x} was accepted")


def test_single_byte_change_in_payload_is_the_checksum():
    buf = bytearray(sample_message().to_bytes())
    buf[85] ^= 0x40          # inside section 0
    with pytest.raises(WireFormatError, match="checksum"):
        Message.from_bytes(bytes(buf))


def test_wrong_crc_only():
    good = build()
    crc = struct.unpack("<I", good[-4:])[0]
    with pytest.raises(WireFormatError, match="checksum"):
        Message.from_bytes(build(crc=crc ^ 1))
    Message.from_bytes(good)   # the builder's message itself is valid


def test_numpy_array_corrupted():
    arr = np.frombuffer(sample_message().to_bytes(), np.uint8).copy()
    arr[-1] ^= 0xFF
    with pytest.raises(WireFormatError, match="checksum"):
        Message.from_bytes(arr)


# Each variant has a correct CRC, so the field check (not the checksum) must catch it.
FIELD_CASES = {
    "bad magic": (dict(magic=b"HVDX"), "magic"),
    "bad magic lowercase": (dict(magic=b"hvdc"), "magic"),
    "version 2": (dict(version=2), "version"),
    "version 0": (dict(version=0), "version"),
    "codec 0": (dict(codec=0), "codec"),
    "codec 4": (dict(codec=4), "codec"),
    "codec 255": (dict(codec=255), "codec"),
    "dtype 0": (dict(dtype=0), "dtype"),
    "dtype 11": (dict(dtype=11), "dtype"),
    "dtype 255": (dict(dtype=255), "dtype"),
    "flag bit 2": (dict(flags=0x04), "flag"),
    "flag bit 7": (dict(flags=0x80), "flag"),
    "all flags": (dict(flags=0xFF, sections=(), shape=(2, 3)), "flag"),
    "ndim 9": (dict(shape=(1,) * 9), "ndim"),
    "ndim 255": (dict(ndim=255), "ndim"),
    "nsections 9": (dict(sections=(b"x",) * 9), "section"),
    "nsections 255": (dict(nsec=255), "section"),
    "reserved 1": (dict(reserved=1), "reserved"),
    "reserved 255": (dict(reserved=255), "reserved"),
    "bits 33": (dict(bits=33), "bits"),
    "bits 255": (dict(bits=255), "bits"),
    "numel too big": (dict(numel=7), "numel"),
    "numel zero": (dict(numel=0), "numel"),
    "numel of empty shape": (dict(shape=(2, 0), numel=2), "numel"),
    "empty shape entry 2**63": (dict(shape=(2**63, 0), sections=()), "exceeds 2\\*\\*63"),
    "empty shape entry 2**64-1": (dict(shape=(0, 2**64 - 1), sections=()), "exceeds"),
    "numel 2**63": (dict(shape=(2**32, 2**31), sections=()), "exceeds"),
    "lengths sum short": (dict(lengths=(8, 2)), "section lengths"),
    "lengths sum long": (dict(lengths=(8, 4)), "section lengths"),
    "lengths huge": (dict(lengths=(2**63, 3)), "section lengths"),
    "lengths 3 + 9 for 11 bytes": (dict(lengths=(3, 9)), "section lengths"),
    "trailing extra byte": (dict(extra=b"\x00"), "section lengths"),
    "nonfinite with payload": (dict(flags=FLAG_NONFINITE), "NONFINITE"),
    "nonfinite with one byte": (dict(flags=FLAG_NONFINITE, sections=(b"\x00",)), "NONFINITE"),
    "header cut inside shape": (dict(shape=(2, 3), sections=(), ndim=2, lengths=(),
                                     nsec=8), "truncated"),
}


@pytest.mark.parametrize("case", sorted(FIELD_CASES))
def test_field_checks(case):
    kwargs, field = FIELD_CASES[case]
    buf = build(**kwargs)
    with pytest.raises(WireFormatError, match=field) as ei:
        Message.from_bytes(buf)
    assert "checksum" not in str(ei.value)


def test_lengths_swapped_is_accepted_framing():
    # (3, 8) instead of (8, 3) sums correctly: framing is fine, the sections just split
    # differently (sizes are the codec's business), so this must parse.
    m = Message.from_bytes(build(lengths=(3, 8)))
    assert [len(s) for s in m.sections] == [3, 8]


def test_trailing_byte_without_crc_fix():
    buf = sample_message().to_bytes()
    with pytest.raises(WireFormatError):
        Message.from_bytes(buf + b"\x00")


@pytest.mark.parametrize("buf", [b"", bytearray(), np.zeros(0, np.uint8), b"HVDC"])
def test_empty_and_tiny_buffers(buf):
    with pytest.raises(WireFormatError, match="truncated"):
        Message.from_bytes(buf)


def test_wire_format_error_is_value_error():
    assert issubclass(WireFormatError, ValueError)
    assert hvdcomp.WireFormatError is WireFormatError


# --- Message.expect ---------------------------------------------------------------------

GOOD = dict(codec=ALQ, shape=(2, 3), tensor_id=5, step=12, rank=1, bits=3, bucket_size=4,
            level_version=2, nsections=2)


def test_expect_all_matching_passes():
    msg = Message.from_bytes(sample_message().to_bytes())
    msg.expect(**GOOD)
    msg.expect()
    msg.expect(shape=[2, 3])


@pytest.mark.parametrize("field,wrong,pattern", [
    ("codec", QSGD, r"codec mismatch.*alq.*qsgd"),
    ("shape", (3, 2), r"shape mismatch"),
    ("shape", (6,), r"shape mismatch"),
    ("tensor_id", 6, r"tensor id mismatch"),
    ("step", 13, r"step mismatch"),
    ("rank", 0, r"rank mismatch"),
    ("bits", 4, r"bits mismatch"),
    ("bucket_size", 8, r"bucket size mismatch"),
    ("level_version", 3, r"level-table version mismatch"),
    ("dtype", 2, r"dtype mismatch.*float32.*float16"),
    ("nsections", 1, r"sections"),
    ("nsections", 3, r"sections"),
])
def test_expect_mismatch(field, wrong, pattern):
    msg = Message.from_bytes(sample_message().to_bytes())
    with pytest.raises(WireFormatError, match=pattern) as ei:
        msg.expect(**dict(GOOD, **{field: wrong}))
    if field not in ("shape", "nsections", "codec", "dtype"):
        # the text shows both values: what the message has and what the receiver expects
        assert str(getattr(msg, field)) in str(ei.value)
        assert str(wrong) in str(ei.value)


def test_expect_nsections_not_checked_for_nonfinite():
    msg = Message.from_bytes(Message(codec=QSGD, dtype=F32, shape=(4,),
                                     flags=FLAG_NONFINITE).to_bytes())
    msg.expect(nsections=2)          # a NONFINITE message carries no sections by design


def test_section_size_check():
    msg = Message.from_bytes(sample_message().to_bytes())
    msg.section_size_check(0, 8, "norms")
    with pytest.raises(WireFormatError, match=r"section 1 \(codes\) has 3 bytes, expected 4"):
        msg.section_size_check(1, 4, "codes")


# --- the receiver's header checks (Compressor.decode; issue #15) ------------------------------

def _key(**kw):
    return hvdcomp.TensorKey(**dict(dict(name="w", tensor_id=4, step=6, rank=1, world_size=2,
                                         seed=9), **kw))


def _decode(comp, msg, key):
    return comp.decode(Message.from_bytes(msg.to_bytes()), key, torch.zeros(msg.numel))


def test_dtype_byte_checked_against_the_receivers_parameter():
    """``none`` with its dtype byte changed from float32 to int32 decoded the bytes as
    integers (off by up to 1e9): with the parameter's dtype in the key it is rejected."""
    comp = hvdcomp.get("none")
    x = torch.randn(6)
    msg = comp.encode(x, _key())
    forged = dataclasses.replace(msg, dtype=DTYPES[torch.int32])
    with pytest.raises(WireFormatError, match="dtype mismatch.*int32.*float32"):
        _decode(comp, forged, _key(dtype=torch.float32))
    assert _decode(comp, msg, _key(dtype=torch.float32))
    assert _decode(comp, forged, _key())           # no dtype in the key: not checked


@pytest.mark.parametrize("spec", ["none", "fp16", "psq:bits=3", "laq:bits=2", "signef",
                                  "dqsg:bits=3", "topk:density=0.5"])
@pytest.mark.parametrize("field,pattern", [("level_version", "level-table version"),
                                           ("bucket_size", "bucket size"), ("bits", "bits")])
def test_unused_header_fields_must_be_zero(spec, field, pattern):
    """Level-table version and bucket size (and bits) of codecs that do not use them must be
    0 (or the receiver's own value where they do)."""
    comp = hvdcomp.get(spec)
    msg = comp.encode(torch.randn(5, 4), _key())
    assert msg is not None
    forged = dataclasses.replace(msg, **{field: getattr(msg, field) + 1})
    with pytest.raises(WireFormatError, match=pattern):
        _decode(comp, forged, _key())


def test_every_shape_entry_of_an_empty_tensor_checked():
    """An empty tensor's shape entries beside the 0 were never checked (numel is 0 either
    way): with the parameter's shape in the key every entry is."""
    comp = hvdcomp.get("psq:bits=3")
    msg = comp.encode(torch.zeros(0, 3), _key())
    for shape in ((0, 2**40), (3, 0), (0,), (0, 3, 1)):
        with pytest.raises(WireFormatError, match="shape mismatch"):
            _decode(comp, dataclasses.replace(msg, shape=shape), _key(shape=(0, 3)))
    assert _decode(comp, msg, _key(shape=(0, 3)))


@pytest.mark.parametrize("spec,flags", [("psq:bits=3", FLAG_ENTROPY),
                                        ("psq:bits=3,entropy=True", 0),
                                        ("none", FLAG_ENTROPY),
                                        ("psq:bits=3", FLAG_ENTROPY | FLAG_NONFINITE)])
def test_flags_must_be_the_receivers(spec, flags):
    """ENTROPY is set iff the receiver's entropy setting is; NONFINITE stands alone."""
    comp = hvdcomp.get(spec)
    msg = comp.encode(torch.randn(3, 4), _key())
    forged = dataclasses.replace(msg, flags=flags,
                                 sections=() if flags & FLAG_NONFINITE else msg.sections)
    with pytest.raises(WireFormatError, match="flags"):
        _decode(comp, forged, _key())


def test_write_at_an_offset_is_to_bytes():
    # the one-copy serializer (what frames use) writes exactly to_bytes()'s bytes, where it
    # is told, and touches nothing else: the golden message inside a buffer of 0xAB bytes
    msg = sample_message()
    want = build(codec=ALQ, dtype=F32, flags=0, bits=3, bucket_size=4, level_version=2,
                 tensor_id=5, rank=1, seed=99, step=12, shape=(2, 3),
                 sections=(bytes(range(8)), bytes([7, 8, 9])))
    assert msg.nbytes() == len(want)
    buf = np.full(len(want) + 10, 0xAB, dtype=np.uint8)
    assert msg.write(buf, 3) == 3 + len(want)
    assert buf[3:3 + len(want)].tobytes() == want
    assert (buf[:3] == 0xAB).all() and (buf[3 + len(want):] == 0xAB).all()
    assert_same_message(Message.from_bytes(buf[3:3 + len(want)]), msg)
