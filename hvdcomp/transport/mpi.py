"""The mpi4py carrier: Allgather of counts, then Allgatherv of bytes; for the all-to-all,
Allgather of every rank's counts, then Alltoallv of bytes.

Thread level.  hvdcomp calls MPI from its pipeline's communicate thread during a step, and
from the thread that builds and steps the optimizer otherwise (the rank handshake, Auto's
measurements, the ALQ/AMQ refit), never from both at once (as long as the steps of two
optimizers do not overlap): MPI_THREAD_SERIALIZED is enough for hvdcomp's own calls.  When
Horovod runs on MPI in the same process, its background thread calls MPI at any time,
concurrently with the communicate thread: then it needs MPI_THREAD_MULTIPLE (what mpi4py and
Horovod request by default).  The application's own MPI calls during a step (between the
first backward hook and ``step()``) also need MPI_THREAD_MULTIPLE.  So does a second transport in one process (several optimizers): their
exchanges may run at the same time, each on its own communicator, e.g. when one backward
pass produces gradients for two optimizers.  :class:`MPITransport` checks the provided
level when it is built (:func:`check_thread_level`); with less, ``transport="horovod"``
makes no MPI call of hvdcomp's own (the default then).  With HOROVOD_MPI_THREADS_DISABLE=1
(Horovod's setting for an MPI without thread support) Horovod starts MPI at
MPI_THREAD_SINGLE (:func:`hvdcomp.torch.init` leaves it to Horovod).
"""
from __future__ import annotations

import ctypes
import os
import re
import struct
import sys
import time
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from .base import Transport, packed

__all__ = ["MPITransport", "cuda_aware", "check_thread_level", "horovod_on_mpi",
           "horovod_threads_disabled", "mpi4py", "mpi_world", "thread_level_problem"]


def mpi4py():
    """The mpi4py.MPI module (importing it starts MPI, as mpi4py does).  mpi4py is optional:
    only this transport needs it.  Raises ImportError saying how to install it."""
    try:
        from mpi4py import MPI
    except ImportError as e:
        raise ImportError(
            f"hvdcomp's 'mpi' transport needs mpi4py, built against the MPI that runs the "
            f"job: MPICC=mpicc pip install 'hvdcomp[mpi]' (or pip install mpi4py); without "
            f"it use transport='horovod' (the drop-in optimizer's default then) ({e})") from e
    return MPI


def mpi_world() -> Optional[Tuple[int, int]]:
    """(rank, size) of MPI.COMM_WORLD, or None when MPI is not initialized (or finalized).
    ImportError without mpi4py (:func:`mpi4py`)."""
    MPI = mpi4py()
    if not MPI.Is_initialized() or MPI.Is_finalized():
        return None
    return MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()


def thread_level_problem() -> Optional[str]:
    """Why an :class:`MPITransport` built now would refuse MPI's thread level
    (:func:`check_thread_level`), or None when it would accept it."""
    MPI = mpi4py()
    try:
        check_thread_level(MPI.Query_thread(), horovod_on_mpi(), MPI,
                           several=MPITransport._built > 0)
    except RuntimeError as e:
        return str(e)
    return None


def cuda_aware() -> Optional[bool]:
    """Whether the MPI library can read CUDA device buffers: $HVDCOMP_CUDA_AWARE (0/1) if
    set, else Open MPI's MPIX_Query_cuda_support() (True/False), else None (unknown, e.g. an
    MPI without that extension).  hvdcomp reports it when a model has CUDA parameters; its
    messages travel through host memory either way (each carries a host-built header and
    CRC), so only the compressed bytes, never the dense gradient, cross to the host."""
    env = os.environ.get("HVDCOMP_CUDA_AWARE")
    if env is not None and env.strip():
        return env.strip() not in ("0", "false", "no")
    try:
        from mpi4py import MPI
        lib = ctypes.CDLL(MPI.__file__, mode=ctypes.RTLD_GLOBAL)
        fn = lib.MPIX_Query_cuda_support
    except (OSError, AttributeError, ImportError):
        return None
    fn.restype = ctypes.c_int
    return bool(fn())


def horovod_threads_disabled() -> bool:
    """Whether $HOROVOD_MPI_THREADS_DISABLE is a positive integer (read as Horovod reads it:
    its leading digits): Horovod's setting for an MPI without thread support, with which it
    starts MPI at MPI_THREAD_SINGLE itself (:func:`hvdcomp.torch.init`)."""
    m = re.match(r"\s*\+?(\d+)", os.environ.get("HOROVOD_MPI_THREADS_DISABLE", ""))
    return bool(m and int(m.group(1)) > 0)


def horovod_on_mpi() -> bool:
    """Whether horovod.torch is initialized in this process and runs on MPI (not Gloo)."""
    hvd = sys.modules.get("horovod.torch")
    return bool(hvd is not None and hvd.is_initialized() and hvd.mpi_enabled())


def check_thread_level(provided: int, horovod_mpi: bool, MPI, several: bool = False) -> None:
    """Raise RuntimeError when the MPI library's thread level ``provided`` is below what
    hvdcomp needs (module docstring): MPI_THREAD_MULTIPLE when ``horovod_mpi`` (Horovod runs
    on MPI in this process) or ``several`` (another MPITransport exists in this process),
    else MPI_THREAD_SERIALIZED.  ``MPI``: the mpi4py.MPI module (its THREAD_* constants)."""
    need = MPI.THREAD_MULTIPLE if horovod_mpi or several else MPI.THREAD_SERIALIZED
    if provided >= need:
        return
    names = {getattr(MPI, f"THREAD_{x}"): f"MPI_THREAD_{x}"
             for x in ("SINGLE", "FUNNELED", "SERIALIZED", "MULTIPLE")}
    why = ("Horovod's background thread and hvdcomp's communicate thread call MPI "
           "concurrently" if horovod_mpi else
           "the exchanges of several optimizers may call MPI concurrently" if several else
           "hvdcomp's communicate thread calls MPI, and it is not the main thread")
    if horovod_threads_disabled():
        why += "; HOROVOD_MPI_THREADS_DISABLE is set, so Horovod started MPI without threads"
    raise RuntimeError(
        f"hvdcomp: the MPI library provides {names.get(provided, provided)}; the mpi "
        f"transport needs {names[need]} ({why}). Start MPI with it (mpi4py requests "
        f"MPI_THREAD_MULTIPLE unless mpi4py.rc.thread_level or $MPI4PY_RC_THREAD_LEVEL says "
        f"otherwise; the MPI library must be built with thread support) or use "
        f"transport='horovod'.")


_BYE_TAG = 7
_BYE_MAX = 1024
_BYE_BUFFERS: list = []              # farewell buffers MPI may still use (never freed)
_BYE = struct.Struct("<QI")          # a farewell: last step (u64), exchange id (u32), text


class MPITransport(Transport):
    """Allgatherv and Alltoallv over a private duplicate of ``comm`` (default MPI.COMM_WORLD), so hvdcomp's
    traffic never matches a user's own mpi4py messages.

    Raises ImportError without mpi4py (saying how to install it); RuntimeError when MPI
    provides less than MPI_THREAD_SERIALIZED, or less than
    MPI_THREAD_MULTIPLE while Horovod runs on MPI or for the second transport of a process
    (module docstring); Horovod initialized after the transport is built is not seen.
    """
    name = "mpi"
    interprocess = True
    _built = 0                      # transports built in this process

    def __init__(self, comm=None, max_chunk: int = 0):
        super().__init__(max_chunk)
        MPI = mpi4py()
        check_thread_level(MPI.Query_thread(), horovod_on_mpi(), MPI,
                           several=MPITransport._built > 0)
        MPITransport._built += 1
        self._MPI = MPI
        self.comm = (comm if comm is not None else MPI.COMM_WORLD).Dup()
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        # Farewells (Transport.farewell): one small message per other rank on a communicator
        # of their own, received by a standing Irecv that a waiting rank polls from its own
        # thread while the communicate thread is inside a collective (MPI_THREAD_MULTIPLE).
        self._bye_comm = self.comm.Dup()
        self._bye_buf = np.zeros(_BYE.size + _BYE_MAX, dtype=np.uint8)
        # MPI may write into it until the Irecv is cancelled or completes, which can be after
        # this transport is garbage (an exit without farewell): it must never be freed
        _BYE_BUFFERS.append(self._bye_buf)
        self._bye_req = None
        self._bye_status = MPI.Status()
        self._byes: Dict[int, Tuple[int, str]] = {}
        self._bye_sent: list = []
        self._listening = MPI.Query_thread() == MPI.THREAD_MULTIPLE and self.size > 1
        self._listen()

    @property
    def farewells(self) -> bool:
        return self._bye_req is not None or bool(self._byes)

    def _listen(self) -> None:
        if self._listening:
            self._bye_req = self._bye_comm.Irecv([self._bye_buf, self._MPI.BYTE],
                                                 source=self._MPI.ANY_SOURCE, tag=_BYE_TAG)

    def farewell(self, step: int, ident: int, text: str) -> None:
        """Send the farewell to every other rank (one eager message each; waits at most a
        second for the sends), then stop listening for theirs."""
        MPI = self._MPI
        if self.size < 2 or MPI.Is_finalized():
            return
        data = np.frombuffer(_BYE.pack(int(step), int(ident) & 0xFFFFFFFF)
                             + text.encode("utf-8", "replace")[:_BYE_MAX], dtype=np.uint8)
        reqs = [self._bye_comm.Isend([data, MPI.BYTE], dest=r, tag=_BYE_TAG)
                for r in range(self.size) if r != self.rank]
        self._bye_sent.append((reqs, data))        # both must live until the sends end
        _BYE_BUFFERS.append(data)
        deadline = time.monotonic() + 1.0
        while not MPI.Request.Testall(reqs) and time.monotonic() < deadline:
            time.sleep(0.001)
        self._stop_listening()                      # leaving: nothing to wait for any more

    def departed(self, ident: int) -> Optional[Tuple[int, str]]:
        while self._bye_req is not None and self._bye_req.Test(self._bye_status):
            n = self._bye_status.Get_count(self._MPI.BYTE)
            if n >= _BYE.size:
                step, who = _BYE.unpack_from(self._bye_buf)
                text = bytes(self._bye_buf[_BYE.size:n]).decode("utf-8", "replace")
                self._byes.setdefault(who, (step, text))
            self._listen()
        return self._byes.get(int(ident) & 0xFFFFFFFF)

    def close(self) -> None:
        self._stop_listening()

    def free(self) -> None:
        """:meth:`close`, then free this transport's two communicators (MPI_Comm_free:
        call it on every rank, with no collective of it in flight; the transport cannot
        be used afterwards).  For the owner of the transport (an optimizer that built it),
        so that optimizers built again and again do not exhaust MPI's communicators."""
        self.close()
        if self._MPI.Is_finalized():
            return
        for comm in (self._bye_comm, self.comm):
            if comm != self._MPI.COMM_NULL:
                comm.Free()

    def _stop_listening(self) -> None:
        self._listening = False
        req, self._bye_req = self._bye_req, None
        if req is not None and not self._MPI.Is_finalized():
            try:
                req.Cancel()
                req.Wait()
            except Exception:                   # noqa: BLE001 - leaving anyway
                pass

    def _allgather_counts(self, n: int) -> List[int]:
        mine = np.array([n], dtype=np.int64)
        out = np.empty(self.size, dtype=np.int64)
        self.comm.Allgather([mine, self._MPI.INT64_T], [out, self._MPI.INT64_T])
        return [int(c) for c in out]

    def _allgatherv(self, data: np.ndarray, counts: Sequence[int]) -> List[np.ndarray]:
        MPI = self._MPI
        counts = np.asarray(counts, dtype=np.int64)
        displs = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
        recv = np.empty(int(counts.sum()), dtype=np.uint8)
        self.comm.Allgatherv([data, len(data), MPI.BYTE],
                             [recv, counts.astype(np.int32), displs.astype(np.int32), MPI.BYTE])
        return [recv[d:d + c] for d, c in zip(displs, counts)]

    def _count_matrix(self, send):
        mine = np.asarray(send, dtype=np.int64)
        out = np.empty((self.size, self.size), dtype=np.int64)
        self.comm.Allgather([mine, self._MPI.INT64_T], [out, self._MPI.INT64_T])
        return out

    def _alltoallv(self, parts, recv):
        MPI = self._MPI
        scounts = np.array([len(p) for p in parts], dtype=np.int64)
        rcounts = np.asarray(recv, dtype=np.int64)
        sdispl = np.concatenate([[0], np.cumsum(scounts)[:-1]]).astype(np.int64)
        rdispl = np.concatenate([[0], np.cumsum(rcounts)[:-1]]).astype(np.int64)
        send = packed(parts)
        got = np.empty(int(rcounts.sum()), dtype=np.uint8)
        self.comm.Alltoallv([send, (scounts.astype(np.int32), sdispl.astype(np.int32)),
                             MPI.BYTE],
                            [got, (rcounts.astype(np.int32), rdispl.astype(np.int32)),
                             MPI.BYTE])
        return [got[d:d + c] for d, c in zip(rdispl, rcounts)]

    split_refusal = None

    def host_key(self):
        """The world rank of rank 0 of this communicator's ``COMM_TYPE_SHARED`` split (the
        ranks that share memory: one host)."""
        shared = self.comm.Split_type(self._MPI.COMM_TYPE_SHARED, key=self.rank)
        try:
            first = self.comm.Get_group().Translate_ranks(None, shared.Get_group())
            lowest = min(r for r, s in enumerate(first) if s != self._MPI.UNDEFINED)
        finally:
            shared.Free()
        return f"shm:{lowest}"

    def split(self, colors):
        """An MPITransport over ``comm.Split(colors[rank], key=rank)`` (the split
        communicator is duplicated by the new transport, and freed)."""
        sub = self.comm.Split(int(colors[self.rank]), key=self.rank)
        try:
            return MPITransport(sub, self._max_chunk)
        finally:
            sub.Free()

    def allreduce_sum(self, arr):
        arr = np.ascontiguousarray(arr, dtype=np.float64)
        out = np.empty_like(arr)
        self.comm.Allreduce(arr, out, op=self._MPI.SUM)
        return out

    def broadcast(self, arr, root=0):
        arr = np.ascontiguousarray(arr).copy()
        self.comm.Bcast(arr, root=root)
        return arr
