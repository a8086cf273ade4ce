"""Wire format v1: one self-describing message per tensor per rank per step.

Layout (all integers little-endian; see docs/wire-format.md for the full description):

    offset  size  field
    0       4     magic b"HVDC"
    4       1     format version (1)
    5       1     codec id                 (hvdcomp.wire.CODECS)
    6       1     dtype code of the gradient (hvdcomp.wire.DTYPES)
    7       1     flags                    bit 0: NONFINITE (no payload, see docs)
                                           bit 1: ENTROPY (symbols are rANS-coded)
    8       1     bits per coordinate      (0 for codecs without a bit width)
    9       1     ndim                     (0..8)
    10      1     number of sections       (0..8)
    11      1     reserved, must be 0
    12      4     bucket size              (coordinates per quantization bucket, 0 if unused)
    16      4     level-table version
    20      4     tensor id                (index of the parameter in the fixed name order)
    24      4     rank of the sender
    28      4     seed
    32      8     step
    40      8     numel                    (must equal the product of the shape)
    48      8*ndim          shape
    ..      8*nsections     section lengths in bytes
    ..      sum(lengths)    sections, back to back
    end-4   4     CRC-32 (zlib) of every byte before it

A message is decoded only after every field has been validated; anything else raises
:class:`hvdcomp.WireFormatError` naming the field.
"""
from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import numpy as np
import torch

from .errors import WireFormatError

__all__ = ["Message", "MAGIC", "VERSION", "CODECS", "BUILTIN_CODECS", "USER_CODECS",
           "register_codec", "DTYPES", "FLAG_NONFINITE", "FLAG_ENTROPY",
           "dtype_code", "code_dtype", "HEADER_SIZE", "MAX_NDIM", "MAX_SECTIONS", "MAX_DIM"]

MAGIC = b"HVDC"
VERSION = 1
MAX_NDIM = 8
MAX_SECTIONS = 8
MAX_DIM = 2**63 - 1          # a shape entry (and the numel) fits a torch size (int64)
FLAG_NONFINITE = 0x01
FLAG_ENTROPY = 0x02          # the symbol section is rANS-coded (hvdcomp.ops.rans)
_KNOWN_FLAGS = FLAG_NONFINITE | FLAG_ENTROPY

_FIXED = struct.Struct("<4sBBBBBBBBIIIIIQQ")
HEADER_SIZE = _FIXED.size  # 48
_CRC = struct.Struct("<I")

# Codec ids are part of the wire format: never renumbered, only added.  Each compressor
# registers its own next to its class (``@hvdcomp.register(name, codec=ID)``): hvdcomp's own
# with ids in BUILTIN_CODECS (tests/unit/test_codec_ids.py holds them against a frozen
# table), those defined outside hvdcomp (a user's or a test's own module) in USER_CODECS.
# CODECS fills as hvdcomp.compressors is imported (hvdcomp's __init__ does so first).
CODECS = {
    # a sparse gradient's indices and values, uncompressed (hvdcomp.exchange.coo): not a
    # compressor, so it has no class to register from
    "coo": 25,
}
_CODEC_NAMES = {v: k for k, v in CODECS.items()}

BUILTIN_CODECS = range(1, 128)
USER_CODECS = range(128, 256)


def register_codec(name: str, codec: int, *, builtin: bool = False) -> int:
    """Give the compressor ``name`` the wire id ``codec`` and return it: an int in 128..255
    (USER_CODECS), or with ``builtin`` (hvdcomp's own compressors) in 1..127
    (BUILTIN_CODECS).  Registering the same (name, id) again is a no-op (a module imported
    twice); an id or a name already taken otherwise raises ValueError."""
    ids, what = ((BUILTIN_CODECS, "1..127 (hvdcomp's own)") if builtin else
                 (USER_CODECS, "128..255 (ids below 128 are hvdcomp's own)"))
    if isinstance(codec, bool) or not isinstance(codec, int) or codec not in ids:
        raise ValueError(f"codec id of {name!r} must be an int in {what}, got {codec!r}")
    if CODECS.get(name) == codec:
        return codec
    if name in CODECS or codec in _CODEC_NAMES:
        raise ValueError(f"cannot register codec {name!r} as {codec}: "
                         f"{name!r} has id {CODECS.get(name)}, id {codec} is "
                         f"{_CODEC_NAMES.get(codec)!r}")
    CODECS[name] = codec
    _CODEC_NAMES[codec] = name
    return codec


DTYPES = {
    torch.float32: 1,
    torch.float16: 2,
    torch.bfloat16: 3,
    torch.float64: 4,
    torch.uint8: 5,
    torch.int8: 6,
    torch.int16: 7,
    torch.int32: 8,
    torch.int64: 9,
    torch.bool: 10,
}
_DTYPE_OF = {v: k for k, v in DTYPES.items()}


def dtype_code(dtype: torch.dtype) -> int:
    try:
        return DTYPES[dtype]
    except KeyError:
        raise TypeError(f"hvdcomp cannot send tensors of dtype {dtype}; "
                        f"supported: {', '.join(str(d) for d in DTYPES)}") from None


def code_dtype(code: int) -> torch.dtype:
    try:
        return _DTYPE_OF[code]
    except KeyError:
        raise WireFormatError(f"unknown dtype code {code}") from None


def raw_bytes(t: torch.Tensor) -> np.ndarray:
    """The bytes of ``t`` (any shape and dtype), flat: a uint8 view where it is on the CPU
    and contiguous."""
    t = t.detach().contiguous().reshape(-1).cpu()
    if t.dtype in (torch.float16, torch.bfloat16):
        t = t.view(torch.int16)            # numpy has no bfloat16: move the raw 2-byte words
    elif t.dtype == torch.bool:
        t = t.view(torch.uint8)
    return t.numpy().view(np.uint8)


def layout_size(head: bytes, secs: Sequence[np.ndarray]) -> int:
    """The serialized length of a message of header ``head`` and ``secs``
    (:meth:`Message.layout`)."""
    return len(head) + sum(s.size for s in secs) + _CRC.size


def write_layout(buf: np.ndarray, offset: int, head: bytes, secs: Sequence[np.ndarray]) -> int:
    """Write a message (:meth:`Message.layout`'s ``head`` and ``secs``) and its CRC-32 into
    the 1-D uint8 ``buf`` from ``offset``, each section copied once; returns the end."""
    end = offset + len(head)
    buf[offset:end] = np.frombuffer(head, dtype=np.uint8)
    for s in secs:
        buf[end:end + s.size] = s
        end += s.size
    _CRC.pack_into(buf, end, zlib.crc32(memoryview(buf[offset:end])))
    return end + _CRC.size


@dataclass(frozen=True)
class Message:
    """One encoded tensor: header fields plus a tuple of byte sections.

    ``sections`` hold the payload as ``numpy.uint8`` arrays (or anything ``bytes()`` accepts);
    what each section means is defined by the codec (see docs/wire-format.md).
    """
    codec: int
    dtype: int
    shape: Tuple[int, ...]
    sections: Tuple = ()
    flags: int = 0
    bits: int = 0
    bucket_size: int = 0
    level_version: int = 0
    tensor_id: int = 0
    rank: int = 0
    seed: int = 0
    step: int = 0

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def codec_name(self) -> str:
        return _CODEC_NAMES.get(self.codec, f"<unknown {self.codec}>")

    def layout(self) -> Tuple[bytes, List[np.ndarray]]:
        """The serialized header (fixed part, shape, section lengths) and the sections as
        uint8 views (no copies): the message is their concatenation and a CRC-32 of it.
        ValueError for too many dimensions or sections."""
        if len(self.shape) > MAX_NDIM:
            raise ValueError(f"tensors of more than {MAX_NDIM} dimensions are not supported "
                             f"(got {len(self.shape)}); reshape before compressing")
        if len(self.sections) > MAX_SECTIONS:
            raise ValueError(f"at most {MAX_SECTIONS} sections, got {len(self.sections)}")
        secs = [np.frombuffer(memoryview(s), dtype=np.uint8) if not isinstance(s, np.ndarray)
                else s.view(np.uint8).reshape(-1) for s in self.sections]
        head = _FIXED.pack(MAGIC, VERSION, self.codec, self.dtype, self.flags, self.bits,
                           len(self.shape), len(secs), 0, self.bucket_size,
                           self.level_version & 0xFFFFFFFF, self.tensor_id & 0xFFFFFFFF,
                           self.rank, self.seed & 0xFFFFFFFF, self.step, self.numel)
        head += struct.pack(f"<{len(self.shape)}Q", *self.shape)
        head += struct.pack(f"<{len(secs)}Q", *(s.size for s in secs))
        return head, secs

    def nbytes(self) -> int:
        """The serialized length: ``48 + 8*ndim + 8*nsections + sum(section lengths) + 4``."""
        head, secs = self.layout()
        return layout_size(head, secs)

    def write(self, buf: np.ndarray, offset: int = 0) -> int:
        """Serialize into ``buf[offset:]`` (1-D uint8, at least :meth:`nbytes` long from
        ``offset``), each section copied once; returns the offset after the message.  The
        bytes are :meth:`to_bytes`'s."""
        return write_layout(buf, offset, *self.layout())

    def to_bytes(self) -> bytes:
        """Serialize; the length is ``48 + 8*ndim + 8*nsections + sum(section lengths) + 4``."""
        head, secs = self.layout()
        buf = np.empty(layout_size(head, secs), dtype=np.uint8)
        write_layout(buf, 0, head, secs)
        return buf.tobytes()

    @staticmethod
    def from_bytes(buf) -> "Message":
        """Parse and validate the framing of one message (header, lengths, checksum).

        ``buf``: bytes, bytearray, memoryview or a 1-D uint8 numpy array.
        Raises WireFormatError for any truncated, corrupted or unknown field.
        Codec-specific checks (section sizes, levels) are the compressor's ``decode``.
        """
        try:
            mv = memoryview(buf).cast("B") if not isinstance(buf, np.ndarray) else memoryview(
                np.ascontiguousarray(buf, dtype=np.uint8).reshape(-1))
        except (TypeError, ValueError) as e:
            raise WireFormatError(f"not a contiguous byte buffer: {e}") from None
        n = len(mv)
        if n < HEADER_SIZE + _CRC.size:
            raise WireFormatError(f"message truncated: {n} bytes, a header needs at least "
                                  f"{HEADER_SIZE + _CRC.size}")
        (magic, version, codec, dtype, flags, bits, ndim, nsec, reserved, bucket_size,
         level_version, tensor_id, rank, seed, step, numel) = _FIXED.unpack_from(mv, 0)
        if magic != MAGIC:
            raise WireFormatError(f"bad magic {bytes(magic)!r}, expected {MAGIC!r}")
        if version != VERSION:
            raise WireFormatError(f"unsupported wire format version {version}; "
                                  f"this hvdcomp reads version {VERSION}")
        if codec not in _CODEC_NAMES:
            raise WireFormatError(f"unknown codec id {codec}")
        code_dtype(dtype)
        if flags & ~_KNOWN_FLAGS:
            raise WireFormatError(f"unknown flag bits 0x{flags & ~_KNOWN_FLAGS:02x}")
        if ndim > MAX_NDIM:
            raise WireFormatError(f"ndim {ndim} exceeds {MAX_NDIM}")
        if nsec > MAX_SECTIONS:
            raise WireFormatError(f"{nsec} sections exceed {MAX_SECTIONS}")
        if reserved != 0:
            raise WireFormatError(f"reserved byte is {reserved}, must be 0")
        if bits > 32:
            raise WireFormatError(f"bits {bits} out of range 0..32")
        var = HEADER_SIZE + 8 * ndim + 8 * nsec
        if n < var + _CRC.size:
            raise WireFormatError(f"message truncated inside the header: {n} bytes, "
                                  f"need {var + _CRC.size}")
        (crc,) = _CRC.unpack_from(mv, n - _CRC.size)
        if zlib.crc32(mv[:n - _CRC.size]) != crc:
            raise WireFormatError("checksum mismatch: the message is corrupted or truncated")
        shape = struct.unpack_from(f"<{ndim}Q", mv, HEADER_SIZE)
        lengths = struct.unpack_from(f"<{nsec}Q", mv, HEADER_SIZE + 8 * ndim)
        if numel > MAX_DIM or any(s > MAX_DIM for s in shape):
            raise WireFormatError(f"numel {numel} or an entry of shape {tuple(shape)} exceeds "
                                  f"2**63 - 1 (the largest tensor size)")
        prod = 1
        for s in shape:
            prod *= s
        if prod != numel:
            raise WireFormatError(f"numel {numel} does not match shape {tuple(shape)}")
        if var + sum(lengths) + _CRC.size != n:
            raise WireFormatError(f"section lengths {list(lengths)} sum to "
                                  f"{sum(lengths)} bytes but the message carries "
                                  f"{n - var - _CRC.size}")
        if flags & FLAG_NONFINITE and sum(lengths) != 0:
            raise WireFormatError("a NONFINITE message must carry no payload")
        arr = np.frombuffer(mv, dtype=np.uint8)
        secs = []
        off = var
        for ln in lengths:
            secs.append(arr[off:off + ln])
            off += ln
        return Message(codec=codec, dtype=dtype, shape=tuple(shape), sections=tuple(secs),
                       flags=flags, bits=bits, bucket_size=bucket_size,
                       level_version=level_version, tensor_id=tensor_id, rank=rank,
                       seed=seed, step=step)

    def expect(self, *, codec: Optional[int] = None, shape: Optional[Sequence[int]] = None,
               dtype: Optional[int] = None,
               tensor_id: Optional[int] = None, step: Optional[int] = None,
               rank: Optional[int] = None, seed: Optional[int] = None,
               bits: Optional[int] = None,
               bucket_size: Optional[int] = None, level_version: Optional[int] = None,
               nsections: Optional[int] = None) -> None:
        """Check header fields against what the receiver expects (None: not checked);
        ``dtype`` is a dtype code (:func:`dtype_code`).  Raises WireFormatError naming the
        first field that differs."""
        checks = (("codec", codec, self.codec), ("dtype", dtype, self.dtype),
                  ("tensor id", tensor_id, self.tensor_id),
                  ("step", step, self.step), ("rank", rank, self.rank),
                  ("seed", None if seed is None else seed & 0xFFFFFFFF, self.seed),
                  ("bits", bits, self.bits), ("bucket size", bucket_size, self.bucket_size),
                  ("level-table version", level_version, self.level_version))
        for what, want, got in checks:
            if want is not None and want != got:
                if what == "codec":
                    want = _CODEC_NAMES.get(want, want)
                    got = _CODEC_NAMES.get(got, got)
                elif what == "dtype":
                    want = _DTYPE_OF.get(want, want)
                    got = _DTYPE_OF.get(got, got)
                raise WireFormatError(f"{what} mismatch: message has {got}, receiver "
                                      f"expects {want}")
        if shape is not None and tuple(shape) != tuple(self.shape):
            raise WireFormatError(f"shape mismatch: message has {tuple(self.shape)}, "
                                  f"receiver expects {tuple(shape)}")
        if (nsections is not None and not self.flags & FLAG_NONFINITE
                and len(self.sections) != nsections):
            raise WireFormatError(f"{self.codec_name} expects {nsections} sections, "
                                  f"message has {len(self.sections)}")

    def section_size_check(self, i: int, expected: int, what: str) -> None:
        got = len(self.sections[i])
        if got != expected:
            raise WireFormatError(f"{self.codec_name} section {i} ({what}) has {got} bytes, "
                                  f"expected {expected}")
