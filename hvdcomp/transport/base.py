"""Transport interface and the frame that carries several messages in one collective."""
from __future__ import annotations

import struct
from typing import List, Sequence

import numpy as np

from ..errors import WireFormatError

__all__ = ["Transport", "join_frames", "split_frames", "error_frame", "frame_error",
           "INT_MAX"]

INT_MAX = 2**31 - 1


class Transport:
    """Collectives over bytes.  Every rank must call them in the same order.

    rank, size: this process's rank and the world size.
    max_chunk: largest number of bytes one rank contributes to one underlying call
    (default 2**31 - 1 split among the ranks, so all counts and displacements fit C ints).
    """
    name = "?"
    rank = 0
    size = 1

    def __init__(self, max_chunk: int = 0):
        self._max_chunk = max_chunk

    @property
    def max_chunk(self) -> int:
        return self._max_chunk or max(INT_MAX // max(self.size, 1), 1)

    def allgather(self, data: np.ndarray) -> List[np.ndarray]:
        """data: 1-D uint8 array (any length, 0 included).  Returns every rank's data,
        indexed by rank, as uint8 arrays."""
        data = np.ascontiguousarray(data, dtype=np.uint8).reshape(-1)
        counts = self._allgather_counts(len(data))
        limit = self.max_chunk
        if max(counts) <= limit:
            return self._allgatherv(data, counts)
        # Messages too large for one call: gather rounds of at most `limit` bytes per rank.
        parts: List[List[np.ndarray]] = [[] for _ in counts]
        rounds = (max(counts) + limit - 1) // limit
        for k in range(rounds):
            lo = k * limit
            chunk = data[lo:lo + limit]
            ccounts = [max(0, min(c - lo, limit)) for c in counts]
            got = self._allgatherv(chunk, ccounts)
            for r, g in enumerate(got):
                if len(g):
                    parts[r].append(g)
        return [np.concatenate(p) if p else np.empty(0, np.uint8) for p in parts]

    def allreduce_sum(self, arr: np.ndarray) -> np.ndarray:
        """Elementwise sum over ranks of a small float64 array."""
        raise NotImplementedError

    def broadcast(self, arr: np.ndarray, root: int = 0) -> np.ndarray:
        """``root``'s copy of a small array (same shape and dtype on every rank)."""
        raise NotImplementedError

    # for subclasses
    def _allgather_counts(self, n: int) -> List[int]:
        raise NotImplementedError

    def _allgatherv(self, data: np.ndarray, counts: Sequence[int]) -> List[np.ndarray]:
        raise NotImplementedError


_FRAME = struct.Struct("<4sI")
_FRAME_MAGIC = b"HVDF"
_ERROR_MAGIC = b"HVDE"


def error_frame(text: str) -> np.ndarray:
    """A frame that tells every rank this rank failed to encode (so nobody waits forever
    for it and every rank raises the same error)."""
    return np.frombuffer(_ERROR_MAGIC + text.encode("utf-8", "replace")[:4000], dtype=np.uint8)


def frame_error(frame: np.ndarray):
    """The error text of an error frame, or None for a normal frame."""
    if len(frame) >= 4 and bytes(frame[:4]) == _ERROR_MAGIC:
        return bytes(frame[4:]).decode("utf-8", "replace")
    return None


def join_frames(messages: Sequence[bytes]) -> np.ndarray:
    """Pack several wire messages into one frame: magic, count, u64 lengths, messages."""
    head = _FRAME.pack(_FRAME_MAGIC, len(messages)) + struct.pack(
        f"<{len(messages)}Q", *(len(m) for m in messages))
    return np.frombuffer(b"".join([head, *messages]), dtype=np.uint8)


def split_frames(frame: np.ndarray, expected: int) -> List[np.ndarray]:
    """Inverse of :func:`join_frames`; raises WireFormatError unless the frame holds exactly
    ``expected`` messages whose lengths add up to the frame's size."""
    n = len(frame)
    if n < _FRAME.size:
        raise WireFormatError(f"frame truncated: {n} bytes")
    magic, count = _FRAME.unpack_from(frame, 0)
    if magic != _FRAME_MAGIC:
        raise WireFormatError(f"bad frame magic {bytes(magic)!r}")
    if count != expected:
        raise WireFormatError(f"frame holds {count} messages, expected {expected} "
                              f"(do the ranks disagree on the model or the compressors?)")
    off = _FRAME.size + 8 * count
    if n < off:
        raise WireFormatError("frame truncated inside its length table")
    lengths = struct.unpack_from(f"<{count}Q", frame, _FRAME.size)
    if off + sum(lengths) != n:
        raise WireFormatError(f"frame lengths sum to {sum(lengths)} bytes, frame carries "
                              f"{n - off}")
    out = []
    for ln in lengths:
        out.append(frame[off:off + ln])
        off += ln
    return out
