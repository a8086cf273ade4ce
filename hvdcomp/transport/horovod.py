"""The Horovod carriers: hvd.allgather of uint8 tensors (counts gathered first, since
Horovod's allgather does not return the per-rank sizes), hvd.alltoall of uint8 tensors with
splits (every rank's counts gathered first), and Horovod's asynchronous allreduce of
summable buffers.

Horovod matches collectives by name.  Every carrier built in a process takes the next
number of one process-wide count into the prefix of its names ("hvdcomp.3."), the same on
every rank since every rank builds the same optimizers in the same order (the exchange's
handshake checks it): two optimizers' collectives never share a name, even when their
exchanges run at the same time.

The application's unnamed collectives next to the exchange: :func:`name_unnamed_collectives`."""
from __future__ import annotations

import functools
import inspect
import itertools
import threading
from typing import List, Sequence

import numpy as np
import torch

from .base import Allreduce, Transport

__all__ = ["HorovodTransport", "HorovodAllreduce", "name_unnamed_collectives",
           "restart_names"]


_instances = itertools.count()


def _prefix(prefix: str) -> str:
    return f"{prefix}.{next(_instances)}"


class HorovodTransport(Transport):
    """Needs ``horovod.torch`` initialized.  Its names carry its creation number (module
    docstring; ``numbered=False``: ``prefix`` as it is, for a fixed channel that every rank
    names alike whatever it built before); its calls are sequential, so the names can
    repeat from call to call (which keeps Horovod's response cache small)."""
    name = "horovod"
    interprocess = True

    def __init__(self, max_chunk: int = 0, prefix: str = "hvdcomp", numbered: bool = True):
        super().__init__(max_chunk)
        import horovod.torch as hvd
        if not hvd.is_initialized():
            raise RuntimeError("HorovodTransport needs hvd.init() first")
        self.hvd = hvd
        self.rank = hvd.rank()
        self.size = hvd.size()
        self.prefix = _prefix(prefix) if numbered else prefix

    split_refusal = ("the hierarchical exchange needs sub-groups of the ranks, which "
                     "Horovod's process sets would give at the cost of one process set per "
                     "host and per local rank, not supported today: use transport='mpi' "
                     "(mpirun), or hierarchy='flat'")

    def host_key(self):
        """Horovod's ``cross_rank()``: its host number."""
        return f"horovod:{self.hvd.cross_rank()}"

    def _name(self, what: str) -> str:
        return f"{self.prefix}.{what}"

    def _allgather_counts(self, n: int) -> List[int]:
        got = self.hvd.allgather(torch.tensor([n], dtype=torch.int64), name=self._name("n"))
        return [int(c) for c in got]

    def _allgatherv(self, data: np.ndarray, counts: Sequence[int]) -> List[np.ndarray]:
        t = torch.from_numpy(np.array(data, dtype=np.uint8))
        got = self.hvd.allgather(t, name=self._name("ag")).numpy()
        out, off = [], 0
        for c in counts:
            out.append(got[off:off + c])
            off += c
        return out

    def _count_matrix(self, send):
        got = self.hvd.allgather(torch.tensor([list(send)], dtype=torch.int64),
                                 name=self._name("cm"))
        return got.numpy().reshape(self.size, self.size)

    def _alltoallv(self, parts, recv):
        t = torch.from_numpy(np.concatenate(parts) if any(len(p) for p in parts)
                             else np.empty(0, np.uint8))
        splits = torch.tensor([len(p) for p in parts], dtype=torch.int32)
        got, _ = self.hvd.alltoall(t, splits=splits, name=self._name("a2a"))
        got = got.numpy()
        out, off = [], 0
        for c in recv:
            out.append(got[off:off + c])
            off += c
        return out

    def allreduce_sum(self, arr):
        t = torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float64).copy())
        return self.hvd.allreduce(t, op=self.hvd.Sum, name=self._name("ar")).numpy()

    def broadcast(self, arr, root=0):
        t = torch.from_numpy(np.ascontiguousarray(arr).copy())
        return self.hvd.broadcast(t, root_rank=root, name=self._name("bc")).numpy()


class HorovodAllreduce(Allreduce):
    """hvd.allreduce_async_ with op=Sum of float32, float64 and float16 buffers (Horovod
    fuses them with its own tensor fusion and sums in its own, e.g. MPI's, order).

    hvd: the initialized ``horovod.torch`` module.  Its names are ``prefix`` + "." + the
    name given to :meth:`start` (``prefix`` carries its creation number: module docstring).
    """
    dtypes = (torch.float32, torch.float64, torch.float16)

    def __init__(self, hvd, prefix: str = "hvdcomp"):
        self.hvd = hvd
        self.prefix = _prefix(prefix)

    def start(self, buf, name):
        return self.hvd.allreduce_async_(buf, name=f"{self.prefix}.{name}", op=self.hvd.Sum)

    def wait(self, handle):
        self.hvd.synchronize(handle)


# horovod.torch.mpi_ops' functions that start a collective, each with a ``name`` argument
_STARTERS = ("_allreduce_async", "_grouped_allreduce_async", "_allgather_async",
             "_grouped_allgather_async", "_broadcast_async", "_alltoall_async",
             "_reducescatter_async", "_grouped_reducescatter_async")
_unnamed = itertools.count()
_naming = threading.Lock()
_named_ops = None                   # the horovod.torch.mpi_ops module once patched


def name_unnamed_collectives() -> None:
    """Name the application's unnamed Horovod collectives by a count of their own.

    Horovod 0.28.1 names a collective started without a name by its handle
    ("allreduce.noname.<handle>"), a per-process count of every operation started,
    hvdcomp's included.  hvdcomp's threads start theirs (the sums of summable buckets,
    the horovod transport's allgathers) as each rank's backward pass completes a bucket,
    at moments that differ from rank to rank; an unnamed collective that the application
    starts meanwhile (during backward: the gradient of a differentiable hvd.allreduce or
    hvd.allgather, an unnamed synchronized batch norm) would then get different names on
    different ranks, and Horovod would wait for ever.  After this call an unnamed
    collective is named "hvdcomp.unnamed.<k>", k counting the unnamed collectives alone
    (every hvdcomp collective has a name): the same on every rank whenever every rank
    starts its unnamed collectives in the same order, which is Horovod's own rule.
    Collectives given a name keep it.

    Every rank calls it at the same point of its program (the drop-in optimizer's
    constructor, after its handshake, before its first exchange thread); idempotent.
    Wraps the start functions of ``horovod.torch.mpi_ops`` (``_STARTERS``), which
    Horovod's public functions and autograd functions call."""
    global _named_ops
    with _naming:
        if _named_ops is not None:
            return
        import horovod.torch.mpi_ops as ops
        for fn_name in _STARTERS:
            fn = getattr(ops, fn_name, None)
            if fn is not None:
                setattr(ops, fn_name, _with_a_name(fn))
        _named_ops = ops


def restart_names() -> None:
    """Count the carriers' and the unnamed collectives' names from zero again, as in a new
    process: after Horovod was shut down and initialised again (an elastic reset), where
    the workers that join build their carriers from zero.  Every rank, at the same point."""
    global _instances, _unnamed
    _instances, _unnamed = itertools.count(), itertools.count()


def _with_a_name(fn):
    sig = inspect.signature(fn)

    @functools.wraps(fn)
    def start(*args, **kwargs):
        bound = sig.bind(*args, **kwargs)
        if bound.arguments.get("name") is None:
            bound.arguments["name"] = f"hvdcomp.unnamed.{next(_unnamed)}"
        return fn(*bound.args, **bound.kwargs)
    return start
