"""The mpi4py carrier: Allgather of counts, then Allgatherv of bytes."""
from __future__ import annotations

import ctypes
import os
from typing import List, Optional, Sequence

import numpy as np

from .base import Transport

__all__ = ["MPITransport", "cuda_aware"]


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


class MPITransport(Transport):
    """Allgatherv over a private duplicate of ``comm`` (default MPI.COMM_WORLD), so hvdcomp's
    traffic never matches a user's own mpi4py messages.

    Requires MPI_THREAD_MULTIPLE when Horovod runs in the same process (checked).
    """
    name = "mpi"

    def __init__(self, comm=None, max_chunk: int = 0):
        super().__init__(max_chunk)
        from mpi4py import MPI
        self._MPI = MPI
        self.comm = (comm if comm is not None else MPI.COMM_WORLD).Dup()
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()

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

    def allreduce_sum(self, arr):
        arr = np.ascontiguousarray(arr, dtype=np.float64)
        out = np.empty_like(arr)
        self.comm.Allreduce(arr, out, op=self._MPI.SUM)
        return out

    def broadcast(self, arr, root=0):
        arr = np.ascontiguousarray(arr).copy()
        self.comm.Bcast(arr, root=root)
        return arr
