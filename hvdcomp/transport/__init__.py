"""How encoded messages travel between ranks.

:class:`Transport` carries bytes: ``exchange(Outgoing) -> Incoming`` sends one rank's framed
messages of a fusion bucket to every rank (:mod:`.framing`: the frame, the error frame), on a
variable-length allgather.  Interchangeable carriers with identical results (a setting,
``transport=``):
  "mpi"      mpi4py: counts with Allgather, then Allgatherv of MPI.BYTE (default)
  "horovod"  Horovod's allgather of uint8 tensors, with the counts gathered first
  "torch"    torch.distributed's all_gather (Gloo or NCCL) of counts, then of the bytes
             padded to the longest (:mod:`.torch_dist`; the DDP hook's carrier)

All split messages of 2**31 bytes or more into rounds (MPI counts are C ints).
``alltoall(parts) -> parts`` (a variable-length all-to-all: part r to rank r) carries the
shards of the reduce-scatter collective: mpi4py's Alltoallv, or Horovod's alltoall with
splits, the counts of every pair gathered first (the "torch" carrier has none: the DDP hook
uses the allgather).

:func:`select` picks the carrier for a job that runs Horovod (the drop-in optimizer's
``transport=``): by default "mpi" only when MPI's world is Horovod's world, rank for rank
(mpirun, or horovodrun with its MPI controller), else "horovod" (horovodrun --gloo, where
there is no MPI world, or no mpi4py); an explicit "mpi" whose world differs raises.

:class:`Allreduce` carries summable buffers (in-place sums); :class:`HorovodAllreduce` is
Horovod's, :class:`TorchDistAllreduce` torch.distributed's.
"""
import itertools
import os
import sys
from typing import Tuple, Union

from ..log import logger
from .base import Allreduce, Transport
from .framing import (Incoming, Outgoing, Stamp, check_stamps, error_frame, frame_error,
                      join_frames, split_frames)
from .horovod import HorovodAllreduce, HorovodTransport
from .horovod import restart_names as _restart_horovod_names
from .mpi import MPITransport, mpi_world, thread_level_problem
from .torch_dist import TorchDistAllreduce, TorchDistTransport

__all__ = ["Transport", "Allreduce", "MPITransport", "HorovodTransport", "HorovodAllreduce",
           "TorchDistTransport", "TorchDistAllreduce", "make", "select", "restart_names",
           "Outgoing", "Incoming", "Stamp", "split_frames", "join_frames", "error_frame",
           "frame_error", "check_stamps"]

# set by MPI launchers in every process they start (Open MPI; MPICH/Hydra and PMI-2; PMIx)
LAUNCHER_ENV = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK")
_checks = itertools.count()


def make(name: str, **kwargs) -> Transport:
    """A transport by name ("mpi", "horovod" or "torch": the latter needs ``group=``, a
    process group of its own); raises ValueError otherwise."""
    if name == "mpi":
        return MPITransport(**kwargs)
    if name == "horovod":
        return HorovodTransport(**kwargs)
    if name == "torch":
        return TorchDistTransport(**kwargs)
    raise ValueError(f"unknown transport {name!r}; valid: 'mpi', 'horovod', 'torch'")


def restart_names() -> None:
    """:func:`.horovod.restart_names`, and the transport choice's own checks counted from
    zero (an elastic reset: every rank, at the same point, as in a new process)."""
    global _checks
    _checks = itertools.count()
    _restart_horovod_names()


def _mpi_is_horovods(hvd, thread_level: bool) -> Tuple[bool, Union[str, ImportError]]:
    """Whether this rank's MPI world is Horovod's (same rank, same size), and why not (the
    ImportError itself when mpi4py is missing).
    Starts MPI (imports mpi4py.MPI) only where it runs already or a launcher started the
    process: under horovodrun --gloo it stays untouched.  ``thread_level``: also whether
    MPI provides the thread level MPITransport needs (:func:`.mpi.check_thread_level`)."""
    if not (hvd.mpi_enabled() or "mpi4py.MPI" in sys.modules
            or any(v in os.environ for v in LAUNCHER_ENV)):
        return False, ("no MPI world: Horovod runs on Gloo and no MPI launcher started this "
                       "process (horovodrun --gloo)")
    try:
        world = mpi_world()
    except ImportError as e:
        return False, e
    if world is None:
        return False, "MPI is not initialized (mpi4py.rc.initialize is False)"
    if world != (hvd.rank(), hvd.size()):
        return False, (f"MPI's world (rank {world[0]} of {world[1]}) is not Horovod's "
                       f"(rank {hvd.rank()} of {hvd.size()})")
    if thread_level:
        problem = thread_level_problem()
        if problem:
            return False, problem
    return True, "MPI's world is Horovod's, rank for rank"


def _everywhere(hvd, ok: bool) -> bool:
    """Whether ``ok`` holds on every rank (a Horovod allreduce: every rank decides alike)."""
    import torch
    got = hvd.allreduce(torch.tensor([int(bool(ok))], dtype=torch.int32), op=hvd.Sum,
                        name=f"hvdcomp.select.{next(_checks)}")
    return int(got[0]) == hvd.size()


def select(transport: Union[str, Transport, None] = None, hvd=None) -> Transport:
    """The byte carrier for a job whose ranks are Horovod's (``hvd``: the initialized
    horovod.torch module; collective: every rank calls it, in the same order).

    transport: None or "auto": "mpi" (:class:`MPITransport`) when on every rank MPI's world
      is Horovod's world, rank for rank, mpi4py is installed and MPI provides the thread
      level hvdcomp needs; otherwise "horovod" (:class:`HorovodTransport`).  Under mpirun
      and horovodrun's MPI controller that is "mpi", under ``horovodrun --gloo`` "horovod".
      "mpi": MPITransport; RuntimeError on every rank (naming both worlds) when MPI's world
      differs from Horovod's on any rank; ImportError without mpi4py (saying how to install
      it).  "horovod": HorovodTransport.  A Transport instance: used as it is, after the
      same check of its rank and size against Horovod's.
    hvd: None (no Horovod in the job): ``transport`` as :func:`make` builds it ("mpi" for
      None or "auto").

    The choice and its reason are logged (INFO, rank 0).  Raises ValueError for an unknown
    name.
    """
    if transport is None:
        transport = "auto"
    if isinstance(transport, str) and transport not in ("auto", "mpi", "horovod"):
        raise ValueError(f"unknown transport {transport!r}; valid: 'auto' (default), 'mpi', "
                         f"'horovod'")
    if hvd is None:
        return transport if isinstance(transport, Transport) else make(
            "mpi" if transport == "auto" else transport)
    rank, size = hvd.rank(), hvd.size()
    if isinstance(transport, Transport) or transport == "horovod":
        tp = transport if isinstance(transport, Transport) else HorovodTransport()
        same = (tp.rank, tp.size) == (rank, size)
        if not _everywhere(hvd, same):
            raise RuntimeError(
                f"hvdcomp: the transport's world differs from Horovod's on some rank (here: "
                f"transport rank {tp.rank} of {tp.size}, Horovod rank {rank} of {size}); "
                f"it must connect the ranks of Horovod's global process set, in its order")
        why = "as given"
    else:
        explicit = transport == "mpi"
        ok, why = _mpi_is_horovods(hvd, thread_level=not explicit)
        everywhere = _everywhere(hvd, ok)
        if explicit and not everywhere:
            if isinstance(why, ImportError):
                raise why
            raise RuntimeError(
                f"hvdcomp: transport='mpi' needs MPI's world to be Horovod's, rank for rank; "
                f"{'on this rank: ' + why if not ok else 'it is not so on some other rank'}. "
                f"Leave transport unset (hvdcomp then uses Horovod's allgather, as under "
                f"horovodrun --gloo) or pass transport='horovod'.")
        if everywhere:
            tp = MPITransport()     # explicit: raises on a too low thread level (every rank)
        else:
            tp = HorovodTransport()
            why = ("not so on some other rank: " if ok else "") + str(why)
    if rank == 0:
        logger.info("transport %s (%s)", tp.name, why)
    return tp
