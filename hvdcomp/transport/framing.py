"""The frame: several wire messages (or one rank's encoder error) in one collective call.

A frame is what one rank contributes to one collective for one fusion bucket:

    offset      size           field
    0           4              magic b"HVDF"
    4           4              count (u32, little-endian)
    8           8*count        message lengths (u64 each; 0: no message, see below)
    8+8*count   1              flags: bit 0 JOINED (the sender has joined: it contributes
                               nothing to any tensor, and averages count only the others)
    9+8*count   ceil(count/8)  presence bitmap: bit i (LSB first) set when the sender has a
                               gradient for tensor i; a clear bit comes with length 0
    ...                        the messages (hvdcomp.wire), back to back

A zero-length message with its presence bit set is a skipped upload (LAQ's lazy rule); with
the bit clear, the sender had no gradient for that tensor (frozen or unused there).

An error frame, b"HVDE" followed by at most 4000 bytes of UTF-8 text, replaces it when the
rank failed to encode: every rank still takes part in the collective, and every rank raises.

:class:`Outgoing` (built by the encode stage: serializing and checksumming happen there) and
:class:`Incoming` (every rank's frames; each message parsed when the decode stage asks for it)
are what :meth:`hvdcomp.transport.Transport.exchange` takes and returns.
"""
from __future__ import annotations

import struct
from typing import List, Optional, Sequence, Tuple

import numpy as np

from ..errors import WireFormatError
from ..wire import Message

__all__ = ["Outgoing", "Incoming", "join_frames", "split_frames", "error_frame",
           "frame_error", "FRAME_JOINED"]

_FRAME = struct.Struct("<4sI")
_FRAME_MAGIC = b"HVDF"
FRAME_JOINED = 0x01
_ERROR_MAGIC = b"HVDE"
_ERROR_TEXT_MAX = 4000


def error_frame(text: str) -> np.ndarray:
    """A frame that tells every rank this rank failed to encode (so nobody waits forever
    for it and every rank raises the same error); ``text`` is cut to 4000 bytes."""
    return np.frombuffer(_ERROR_MAGIC + text.encode("utf-8", "replace")[:_ERROR_TEXT_MAX],
                         dtype=np.uint8)


def frame_error(frame: np.ndarray) -> Optional[str]:
    """The error text of an error frame, or None for a normal frame."""
    if len(frame) >= 4 and bytes(frame[:4]) == _ERROR_MAGIC:
        return bytes(frame[4:]).decode("utf-8", "replace")
    return None


def join_frames(messages: Sequence[bytes], present: Optional[Sequence[bool]] = None,
                joined: bool = False) -> np.ndarray:
    """Pack serialized messages into one frame (uint8 array): magic, count, u64 lengths,
    flags, presence bitmap, messages.  ``present`` (default: all True) marks the tensors the
    sender has a gradient for; an absent tensor's message must be empty (ValueError)."""
    n = len(messages)
    present = [True] * n if present is None else [bool(p) for p in present]
    if len(present) != n:
        raise ValueError(f"{len(present)} presence bits for {n} messages")
    if any(len(m) and not p for m, p in zip(messages, present)):
        raise ValueError("a message for a tensor marked absent")
    bitmap = np.packbits(np.array(present, dtype=bool), bitorder="little").tobytes()
    head = (_FRAME.pack(_FRAME_MAGIC, n) + struct.pack(f"<{n}Q", *(len(m) for m in messages))
            + bytes([FRAME_JOINED if joined else 0]) + bitmap)
    return np.frombuffer(b"".join([head, *messages]), dtype=np.uint8)


def split_frames(frame: np.ndarray, expected: int
                 ) -> Tuple[List[np.ndarray], List[bool], bool]:
    """Inverse of :func:`join_frames`: views of the ``expected`` messages of ``frame``, the
    presence bits and whether the sender had joined.

    Raises WireFormatError unless the frame holds exactly ``expected`` messages whose lengths
    add up to the frame's size (truncated, bad magic, wrong count, lengths off), its flags
    are known, and every absent tensor's message is empty.
    """
    n = len(frame)
    if n < _FRAME.size:
        raise WireFormatError(f"frame truncated: {n} bytes")
    magic, count = _FRAME.unpack_from(frame, 0)
    if magic != _FRAME_MAGIC:
        raise WireFormatError(f"bad frame magic {bytes(magic)!r}")
    if count != expected:
        raise WireFormatError(f"frame holds {count} messages, expected {expected} "
                              f"(do the ranks disagree on the model or the compressors?)")
    nbitmap = (count + 7) // 8
    off = _FRAME.size + 8 * count + 1 + nbitmap
    if n < off:
        raise WireFormatError("frame truncated inside its length table")
    lengths = struct.unpack_from(f"<{count}Q", frame, _FRAME.size)
    flags = int(frame[_FRAME.size + 8 * count])
    if flags & ~FRAME_JOINED:
        raise WireFormatError(f"unknown frame flags 0x{flags:02x}")
    bits = np.unpackbits(np.asarray(frame[off - nbitmap:off]), bitorder="little")
    present = [bool(b) for b in bits[:count]]
    if off + sum(lengths) != n:
        raise WireFormatError(f"frame lengths sum to {sum(lengths)} bytes, frame carries "
                              f"{n - off}")
    if any(ln and not p for ln, p in zip(lengths, present)):
        raise WireFormatError("frame carries a message for a tensor it marks absent")
    out = []
    for ln in lengths:
        out.append(frame[off:off + ln])
        off += ln
    return out, present, bool(flags & FRAME_JOINED)


class Outgoing:
    """This rank's part of one collective call: ``messages`` serialized into a frame (None:
    a zero-length message), or, through :meth:`failed`, the error that stopped the encoding.

    present: per message, whether this rank has a gradient for the tensor (default all;
    an absent tensor's message must be None); joined: this rank has joined (hvd.join), so
    it contributes nothing.
    data: the frame (1-D uint8); count: number of messages; failure: the exception or None.
    """

    def __init__(self, messages: Sequence[Optional[Message]],
                 present: Optional[Sequence[bool]] = None, joined: bool = False):
        self.count = len(messages)
        self.data = join_frames([b"" if m is None else m.to_bytes() for m in messages],
                                present, joined)
        self.failure: Optional[BaseException] = None

    @classmethod
    def failed(cls, exc: BaseException) -> "Outgoing":
        """An error frame carrying ``exc``'s type and text (the collective still happens)."""
        out = cls.__new__(cls)
        out.count, out.failure = 0, exc
        out.data = error_frame(f"{type(exc).__name__}: {exc}")
        return out

    def __len__(self) -> int:
        return len(self.data)


class Incoming:
    """Every rank's frame of one collective call, split (raises WireFormatError unless each
    holds exactly ``count`` messages).

    nbytes: each rank's frame size; joined: per rank, whether it had joined.
    :meth:`messages` parses (and checksums) one column, :meth:`present` its presence bits.
    """

    def __init__(self, frames: Sequence[np.ndarray], count: int):
        self.nbytes = [len(f) for f in frames]
        split = [split_frames(f, count) for f in frames]
        self._parts = [s[0] for s in split]
        self._present = [s[1] for s in split]
        self.joined = [s[2] for s in split]

    def messages(self, i: int) -> List[Optional[Message]]:
        """Message ``i`` of every rank, indexed by rank (None where that rank sent a zero-
        length message).  Raises WireFormatError for a malformed message."""
        return [Message.from_bytes(p[i]) if len(p[i]) else None for p in self._parts]

    def present(self, i: int) -> List[bool]:
        """Whether each rank had a gradient for tensor ``i`` (False for joined ranks)."""
        return [p[i] for p in self._present]
