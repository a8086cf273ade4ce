"""How encoded messages travel between ranks.

:class:`Transport` carries bytes: ``exchange(Outgoing) -> Incoming`` sends one rank's framed
messages of a fusion bucket to every rank (:mod:`.framing`: the frame, the error frame), on a
variable-length allgather.  Two interchangeable carriers with identical results (a setting,
``transport=``):
  "mpi"      mpi4py: counts with Allgather, then Allgatherv of MPI.BYTE (default)
  "horovod"  Horovod's allgather of uint8 tensors, with the counts gathered first

Both split messages of 2**31 bytes or more into rounds (MPI counts are C ints).

:class:`Allreduce` carries summable buffers (in-place sums); :class:`HorovodAllreduce` is
Horovod's.
"""
from .base import Allreduce, Transport
from .framing import (Incoming, Outgoing, Stamp, check_stamps, error_frame, frame_error,
                      join_frames, split_frames)
from .horovod import HorovodAllreduce, HorovodTransport
from .mpi import MPITransport

__all__ = ["Transport", "Allreduce", "MPITransport", "HorovodTransport", "HorovodAllreduce",
           "make", "Outgoing", "Incoming", "Stamp", "split_frames", "join_frames", "error_frame",
           "frame_error", "check_stamps"]


def make(name: str, **kwargs) -> Transport:
    """A transport by name ("mpi" or "horovod"); raises ValueError otherwise."""
    if name == "mpi":
        return MPITransport(**kwargs)
    if name == "horovod":
        return HorovodTransport(**kwargs)
    raise ValueError(f"unknown transport {name!r}; valid: 'mpi', 'horovod'")

