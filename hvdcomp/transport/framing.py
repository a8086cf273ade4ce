"""The frame: several wire messages (or one rank's encoder error) in one collective call.

A frame is what one rank contributes to one collective for one fusion bucket:

    offset      size           field
    0           4              magic b"HVDF"
    4           4              count (u32, little-endian)
    8           8              step (u64): the sender's step of the exchange
    16          4              exchange id (u32): which exchange (optimizer) of the sender
    20          8*count        message lengths (u64 each; 0: no message, see below)
    20+8*count  1              flags: bit 0 JOINED (the sender has joined: it contributes
                               nothing to any tensor, and averages count only the others);
                               bit 1 SYNC (the sender's step was started by synchronize() or
                               step(), not by a backward pass)
    21+8*count  ceil(count/8)  presence bitmap: bit i (LSB first) set when the sender has a
                               gradient for tensor i; a clear bit comes with length 0
    ...                        the messages (hvdcomp.wire), back to back

A zero-length message with its presence bit set is a skipped upload (LAQ's lazy rule); with
the bit clear, the sender had no gradient for that tensor (frozen or unused there).

Every receiver checks the step, the exchange id and the SYNC flag of every rank's frame
against its own (joined ranks: the step and id only): ranks that fell out of step raise on
every rank at the first collective where it happens (:class:`~hvdcomp.errors.OutOfStep`).

An error frame, b"HVDE" followed by at most 4000 bytes of UTF-8 text, replaces it when the
rank failed to encode, or is stopping after an error (see :mod:`hvdcomp.exchange.shutdown`):
every rank still takes part in the collective, and every rank raises.

:class:`Outgoing` (built by the encode stage: serializing and checksumming happen there) and
:class:`Incoming` (every rank's frames; each message parsed when the decode stage asks for it)
are what :meth:`hvdcomp.transport.Transport.exchange` takes and returns.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple, Union

import numpy as np

from ..errors import OutOfStep, WireFormatError
from ..wire import Message, layout_size, write_layout

__all__ = ["Outgoing", "Incoming", "Stamp", "join_frames", "split_frames", "error_frame",
           "frame_error", "check_stamps", "FRAME_JOINED", "FRAME_SYNC", "STOP_MARK"]

_FRAME = struct.Struct("<4sIQI")
_FRAME_MAGIC = b"HVDF"
FRAME_JOINED = 0x01
FRAME_SYNC = 0x02
_KNOWN_FLAGS = FRAME_JOINED | FRAME_SYNC
_ERROR_MAGIC = b"HVDE"
_ERROR_TEXT_MAX = 4000
#: An error frame whose text starts with this is a stop mark: the sender is stopping after
#: an error outside the encoder (:mod:`hvdcomp.exchange.shutdown`), not failing to encode.
STOP_MARK = "hvdcomp-stop: "


def error_frame(text: str) -> np.ndarray:
    """A frame that tells every rank this rank failed (to encode, or it is stopping after
    an error), so nobody waits forever for it and every rank raises; ``text`` is cut to
    4000 bytes."""
    return np.frombuffer(_ERROR_MAGIC + text.encode("utf-8", "replace")[:_ERROR_TEXT_MAX],
                         dtype=np.uint8)


def frame_error(frame: np.ndarray) -> Optional[str]:
    """The error text of an error frame, or None for a normal frame."""
    if len(frame) >= 4 and bytes(frame[:4]) == _ERROR_MAGIC:
        return bytes(frame[4:]).decode("utf-8", "replace")
    return None


@dataclass(frozen=True)
class Stamp:
    """What a frame says about its sender's step: ``step`` (u64), ``ident`` (u32: which
    exchange, i.e. which optimizer, the same number on every rank) and ``sync`` (the step
    was started by synchronize()/step() rather than by a backward pass)."""
    step: int = 0
    ident: int = 0
    sync: bool = False

    def describe(self) -> str:
        how = "started by synchronize()/step()" if self.sync else "started by backward"
        return f"step {self.step} of exchange {self.ident} ({how})"


def join_frames(messages: Sequence[Union[bytes, Message, None]],
                present: Optional[Sequence[bool]] = None, joined: bool = False,
                stamp: Stamp = Stamp(),
                alloc: Optional[Callable[[int], np.ndarray]] = None) -> np.ndarray:
    """Pack messages into one frame (uint8 array): magic, count, step, exchange id, u64
    lengths, flags, presence bitmap, messages.  Each message is a :class:`Message`
    (serialized straight into the frame: one copy of its sections), its bytes (or anything
    with ``to_bytes()``), or None (zero length).  ``present`` (default: all True) marks the
    tensors the sender has a gradient for; an absent tensor's message must be empty
    (ValueError).  ``stamp``: the sender's step, exchange id and SYNC flag.
    ``alloc(nbytes)``: where to write the frame (a writable uint8 array of that many bytes;
    default a new one)."""
    n = len(messages)
    present = [True] * n if present is None else [bool(p) for p in present]
    if len(present) != n:
        raise ValueError(f"{len(present)} presence bits for {n} messages")
    parts = [m.layout() if isinstance(m, Message) else b"" if m is None else
             m.to_bytes() if hasattr(m, "to_bytes") else m for m in messages]
    sizes = [layout_size(*p) if isinstance(p, tuple) else len(p) for p in parts]
    if any(z and not ok for z, ok in zip(sizes, present)):
        raise ValueError("a message for a tensor marked absent")
    bitmap = np.packbits(np.array(present, dtype=bool), bitorder="little").tobytes()
    flags = (FRAME_JOINED if joined else 0) | (FRAME_SYNC if stamp.sync else 0)
    head = (_FRAME.pack(_FRAME_MAGIC, n, stamp.step, stamp.ident)
            + struct.pack(f"<{n}Q", *sizes) + bytes([flags]) + bitmap)
    total = len(head) + sum(sizes)
    out = np.empty(total, dtype=np.uint8) if alloc is None else alloc(total)
    out[:len(head)] = np.frombuffer(head, dtype=np.uint8)
    off = len(head)
    for p, z in zip(parts, sizes):
        if isinstance(p, tuple):
            write_layout(out, off, *p)
        elif z:
            out[off:off + z] = np.frombuffer(memoryview(p).cast("B"), dtype=np.uint8)
        off += z
    return out


def split_frames(frame: np.ndarray, expected: int
                 ) -> Tuple[List[np.ndarray], List[bool], bool, Stamp]:
    """Inverse of :func:`join_frames`: views of the ``expected`` messages of ``frame``, the
    presence bits, whether the sender had joined, and the sender's :class:`Stamp`.

    Raises WireFormatError unless the frame holds exactly ``expected`` messages whose lengths
    add up to the frame's size (truncated, bad magic, wrong count, lengths off), its flags
    are known, and every absent tensor's message is empty.
    """
    n = len(frame)
    if n < _FRAME.size:
        raise WireFormatError(f"frame truncated: {n} bytes")
    magic, count, step, ident = _FRAME.unpack_from(frame, 0)
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
    if flags & ~_KNOWN_FLAGS:
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
    return out, present, bool(flags & FRAME_JOINED), Stamp(step, ident, bool(flags & FRAME_SYNC))


def check_stamps(stamps: Sequence[Stamp], joined: Sequence[bool], mine: Stamp, rank: int,
                 what: str) -> None:
    """Raise :class:`~hvdcomp.errors.OutOfStep` unless every rank's stamp equals ``mine``
    (``joined`` ranks: step and exchange id only; they take part without a backward pass).
    Every rank sees the same stamps, so every rank raises."""
    bad = [(r, s) for r, (s, j) in enumerate(zip(stamps, joined))
           if (s.step, s.ident) != (mine.step, mine.ident)
           or (s.sync != mine.sync and not j and not joined[rank])]
    if bad:
        theirs = "; ".join(f"rank {r}: {s.describe()}" for r, s in bad[:8])
        raise OutOfStep(
            f"hvdcomp: ranks out of step in {what}: this rank (rank {rank}) is in "
            f"{mine.describe()}, but {theirs}. Every rank must run the same steps: the same "
            f"number of backward passes and step() calls of each optimizer, in the same "
            f"order (a rank that skipped an iteration or called step() twice?)",
            ranks=[r for r, _ in bad])


class Outgoing:
    """This rank's part of one collective call: ``messages`` serialized into a frame (None:
    a zero-length message), or, through :meth:`failed`, the error that stopped the encoding.

    present: per message, whether this rank has a gradient for the tensor (default all;
    an absent tensor's message must be None); joined: this rank has joined (hvd.join), so
    it contributes nothing; stamp: this rank's step (:class:`Stamp`).
    data: the frame (1-D uint8); count: number of messages; failure: the exception or None.
    """

    def __init__(self, messages: Sequence[Optional[Message]],
                 present: Optional[Sequence[bool]] = None, joined: bool = False,
                 stamp: Stamp = Stamp(), alloc: Optional[Callable[[int], np.ndarray]] = None):
        self.count = len(messages)
        self.stamp, self.joined = stamp, joined
        self.data = join_frames(messages, present, joined, stamp, alloc)
        self.failure: Optional[BaseException] = None

    @classmethod
    def failed(cls, exc: BaseException, text: Optional[str] = None) -> "Outgoing":
        """An error frame carrying ``text`` (default ``exc``'s type and text); the
        collective still happens, and this rank re-raises ``exc``."""
        out = cls.__new__(cls)
        out.count, out.failure, out.stamp, out.joined = 0, exc, Stamp(), False
        out.data = error_frame(f"{type(exc).__name__}: {exc}" if text is None else text)
        return out

    def __len__(self) -> int:
        return len(self.data)


class Incoming:
    """Every rank's frame of one collective call, split (raises WireFormatError unless each
    holds exactly ``count`` messages: one number for every frame, or one per frame).

    nbytes: each rank's frame size; joined: per rank, whether it had joined; stamps: per
    rank, its :class:`Stamp`.
    :meth:`messages` parses (and checksums) one column, :meth:`message` one message,
    :meth:`present` a column's presence bits.
    """

    def __init__(self, frames: Sequence[np.ndarray], count: Union[int, Sequence[int]]):
        counts = [count] * len(frames) if isinstance(count, int) else list(count)
        self.nbytes = [len(f) for f in frames]
        split = [split_frames(f, c) for f, c in zip(frames, counts, strict=True)]
        self._parts = [s[0] for s in split]
        self._present = [s[1] for s in split]
        self.joined = [s[2] for s in split]
        self.stamps = [s[3] for s in split]

    def message(self, r: int, i: int) -> Optional[Message]:
        """Message ``i`` of rank ``r``'s frame (None for a zero-length message).  Raises
        WireFormatError for a malformed message."""
        p = self._parts[r][i]
        return Message.from_bytes(p) if len(p) else None

    def raw(self, r: int, i: int) -> np.ndarray:
        """The bytes of message ``i`` of rank ``r``'s frame, unparsed (a uint8 view; empty
        for a zero-length message): for frames whose messages are plain bytes."""
        return self._parts[r][i]

    def messages(self, i: int) -> List[Optional[Message]]:
        """Message ``i`` of every rank, indexed by rank (None where that rank sent a zero-
        length message).  Raises WireFormatError for a malformed message."""
        return [self.message(r, i) for r in range(len(self._parts))]

    def present(self, i: int) -> List[bool]:
        """Whether each rank had a gradient for tensor ``i`` (False for joined ranks)."""
        return [p[i] for p in self._present]

    def present_of(self, r: int, i: int) -> bool:
        """Whether rank ``r`` had a gradient for tensor ``i`` of its frame."""
        return self._present[r][i]
