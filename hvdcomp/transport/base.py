"""The two carriers the exchange drives: :class:`Transport` (bytes, every rank's messages to
every rank) and :class:`Allreduce` (in-place sums of summable buffers)."""
from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

import numpy as np
import torch

from ..errors import RankFailure
from .framing import STOP_MARK, Incoming, Outgoing, check_stamps, frame_error

__all__ = ["Transport", "Allreduce", "INT_MAX", "raise_failed"]

INT_MAX = 2**31 - 1


class Transport:
    """Collectives over bytes.  Every rank must call them in the same order.

    rank, size: this process's rank and the world size.
    max_chunk: largest number of bytes one rank contributes to one underlying call
    (default 2**31 - 1 split among the ranks, so all counts and displacements fit C ints).

    A carrier implements ``_allgather_counts``, ``_allgatherv``, ``_count_matrix``,
    ``_alltoallv``, ``allreduce_sum`` and ``broadcast``; framing, error frames and the
    rounds for large messages are shared.
    """
    name = "?"
    rank = 0
    size = 1
    #: The ranks are separate processes (MPI, Horovod): the exchanges on this transport are
    #: stopped by the exit handler (:mod:`hvdcomp.exchange.shutdown`).
    interprocess = False

    def __init__(self, max_chunk: int = 0):
        self._max_chunk = max_chunk

    #: This carrier delivers farewells (:meth:`farewell`, :meth:`departed`).
    farewells = False

    def farewell(self, step: int, ident: int, text: str) -> None:
        """Tell the other ranks, without waiting for them, that this rank is leaving after
        step ``step`` of exchange ``ident`` (``text``: for their error message).  A carrier
        on which a rank still waiting for this one would wait forever implements it (MPI);
        on the others it does nothing (Horovod's shutdown fails the other ranks' pending
        collectives)."""

    def close(self) -> None:
        """Stop listening for farewells (the exchange is closing)."""

    def free(self) -> None:
        """:meth:`close`, then free what this carrier holds (communicators, process groups):
        for its owner (a door that built it), on every rank, with no collective of it in
        flight; the carrier cannot be used afterwards.  Here: only :meth:`close`."""
        self.close()

    def departed(self, ident: int) -> Optional[Tuple[int, str]]:
        """(last step, text) of a farewell another rank sent for exchange ``ident`` on this
        transport, or None.  Polled by a rank waiting for a step
        (:meth:`hvdcomp.exchange.pipeline.Pipeline.finish`): a rank that left after step s
        will never send its part of a later step."""
        return None

    @property
    def max_chunk(self) -> int:
        return self._max_chunk or max(INT_MAX // max(self.size, 1), 1)

    def exchange(self, out: Outgoing, what: str = "messages",
                 counts: Optional[Sequence[int]] = None) -> Incoming:
        """Every rank's messages of one call (:mod:`hvdcomp.transport.framing`).

        out: this rank's messages, framed (or its error); what: names them in errors;
        counts: how many messages each rank's frame holds (default: ``out.count`` for all).
        Returns every rank's frames, split.  Raises, on every rank, when some rank sent an
        error frame: that rank re-raises its own ``out.failure``, the others a
        :class:`~hvdcomp.errors.RankFailure` naming the first failed rank and its error
        text.  Raises :class:`~hvdcomp.errors.OutOfStep` (on every rank) when the ranks'
        stamps differ (step, exchange id, SYNC flag: :func:`check_stamps`), WireFormatError
        when a frame is malformed.
        """
        frames = self.allgather(out.data)
        raise_failed(frames, out.failure, what)
        incoming = Incoming(frames, out.count if counts is None else counts)
        check_stamps(incoming.stamps, incoming.joined, out.stamp, self.rank, what)
        return incoming

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

    def alltoall(self, parts: Sequence[np.ndarray]) -> List[np.ndarray]:
        """A variable-length all-to-all: ``parts[r]`` (1-D uint8, any length, 0 included) goes
        to rank r; returns what every rank sent to this one, indexed by the sender (this
        rank's own part is returned as its own entry).  The byte counts of every pair go
        first (one allgather of ``size`` counts per rank), so every rank knows how many
        rounds of at most ``max_chunk`` bytes per pair the parts need.  Raises ValueError
        unless ``len(parts) == size``."""
        if len(parts) != self.size:
            raise ValueError(f"alltoall needs one part per rank ({self.size}), got "
                             f"{len(parts)}")
        parts = [np.ascontiguousarray(p, dtype=np.uint8).reshape(-1) for p in parts]
        counts = self._count_matrix([len(p) for p in parts])     # counts[s][r]: s -> r
        recv = [int(c) for c in counts[:, self.rank]]
        limit = self.max_chunk
        top = int(counts.max()) if counts.size else 0
        if top <= limit:
            return self._alltoallv(parts, recv)
        got: List[List[np.ndarray]] = [[] for _ in range(self.size)]
        for k in range((top + limit - 1) // limit):
            lo = k * limit
            chunk = self._alltoallv([p[lo:lo + limit] for p in parts],
                                    [max(0, min(c - lo, limit)) for c in recv])
            for s, g in enumerate(chunk):
                if len(g):
                    got[s].append(g)
        return [np.concatenate(g) if g else np.empty(0, np.uint8) for g in got]

    def allreduce_sum(self, arr: np.ndarray) -> np.ndarray:
        """Elementwise sum over ranks of a small float64 array."""
        raise NotImplementedError

    # --- sub-groups (the hierarchical exchange: :mod:`hvdcomp.exchange.hier`) ---------
    #: Why this carrier cannot make sub-groups (:meth:`split`), or None when it can.
    split_refusal: Optional[str] = "this transport cannot make sub-groups of its ranks"

    def host_key(self) -> str:
        """A text naming this rank's host, the same on the ranks of one host and different
        between hosts (:mod:`hvdcomp.transport.topology`).  Local work only."""
        import socket
        return socket.gethostname()

    def split(self, colors: Sequence[int]) -> "Transport":
        """A transport of the same kind over the ranks whose ``colors[r]`` equals this
        rank's, in rank order (collective: every rank calls it with the same ``colors``,
        in the same order).  RuntimeError where :attr:`split_refusal` says why not."""
        raise RuntimeError(f"hvdcomp: the {self.name} transport: {self.split_refusal}")

    def broadcast(self, arr: np.ndarray, root: int = 0) -> np.ndarray:
        """``root``'s copy of a small array (same shape and dtype on every rank)."""
        raise NotImplementedError

    # for subclasses
    def _allgather_counts(self, n: int) -> List[int]:
        raise NotImplementedError

    def _allgatherv(self, data: np.ndarray, counts: Sequence[int]) -> List[np.ndarray]:
        raise NotImplementedError

    def _count_matrix(self, send: Sequence[int]) -> np.ndarray:
        """Every rank's ``send`` (``size`` byte counts) as an int64 (size, size) matrix,
        row s = what rank s sends to each rank."""
        raise NotImplementedError

    def _alltoallv(self, parts: Sequence[np.ndarray], recv: Sequence[int]) -> List[np.ndarray]:
        """One all-to-all call: ``parts[r]`` to rank r, ``recv[s]`` bytes from rank s."""
        raise NotImplementedError


def packed(parts: Sequence[np.ndarray]) -> np.ndarray:
    """``parts`` (1-D uint8) end to end in one array, for an all-to-all's send buffer: the
    one non-empty part itself where only one is (no copy; e.g. the hierarchical exchange's
    stage 1 with 2 ranks per host, whose own part stays home)."""
    full = [p for p in parts if len(p)]
    if len(full) == 1:
        return full[0]
    return np.concatenate(parts) if full else np.empty(0, np.uint8)


def raise_failed(frames: Sequence[np.ndarray], failure: Optional[BaseException],
                 what: str) -> None:
    """Raise when some frame is an error frame: this rank's own ``failure`` if it has one,
    else a :class:`~hvdcomp.errors.RankFailure` naming the first rank whose frame is one and
    quoting its text (a stop mark, :data:`~hvdcomp.transport.framing.STOP_MARK`: that rank
    is stopping after an error)."""
    failed = [(r, text) for r, text in enumerate(map(frame_error, frames))
              if text is not None]
    if not failed:
        return
    if failure is not None:
        raise failure
    r, text = failed[0]
    if text.startswith(STOP_MARK):
        raise RankFailure(f"hvdcomp: rank {r} stopped during {what}: "
                          f"{text[len(STOP_MARK):]}", r)
    raise RankFailure(f"hvdcomp: rank {r} failed to encode {what}: {text}", r)


class Allreduce:
    """In-place sums across ranks of summable buffers (the casts of ``none``/``fp16``),
    started asynchronously and waited for later.  Every rank starts the same buffers (same
    size, dtype and name) in the same order.

    dtypes: the buffer dtypes it can sum.  prefix: what the names of its collectives start
    with, unique to this carrier (so two exchanges never share a name); the exchange's
    handshake checks that every rank has the same.
    """
    dtypes: Tuple[torch.dtype, ...] = ()
    prefix: str = ""

    def start(self, buf: torch.Tensor, name: str) -> Any:
        """Start summing ``buf`` (1-D, contiguous) in place; returns a handle for wait."""
        raise NotImplementedError

    def wait(self, handle: Any) -> None:
        """Block until the sum of ``handle`` is in its buffer."""
        raise NotImplementedError

    def free(self) -> None:
        """Free what this carrier holds (as :meth:`Transport.free`); here nothing."""

    def sum_(self, buf: torch.Tensor, name: str) -> torch.Tensor:
        """``buf`` summed in place across ranks, synchronously."""
        self.wait(self.start(buf, name))
        return buf
