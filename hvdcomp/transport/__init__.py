"""How encoded messages travel between ranks: variable-length allgather of bytes.

Two interchangeable carriers with identical results (a setting, ``transport=``):
  "mpi"      mpi4py: counts with Allgather, then Allgatherv of MPI.BYTE (default)
  "horovod"  Horovod's allgather of uint8 tensors, with the counts gathered first

Both split messages of 2**31 bytes or more into rounds (MPI counts are C ints).
"""
from .base import Transport, error_frame, frame_error, join_frames, split_frames
from .mpi import MPITransport

__all__ = ["Transport", "MPITransport", "HorovodTransport", "make", "split_frames",
           "join_frames", "error_frame", "frame_error"]


def make(name: str, **kwargs) -> Transport:
    """A transport by name ("mpi" or "horovod"); raises ValueError otherwise."""
    if name == "mpi":
        return MPITransport(**kwargs)
    if name == "horovod":
        from .horovod import HorovodTransport
        return HorovodTransport(**kwargs)
    raise ValueError(f"unknown transport {name!r}; valid: 'mpi', 'horovod'")


def __getattr__(name):
    if name == "HorovodTransport":
        from .horovod import HorovodTransport
        return HorovodTransport
    raise AttributeError(name)
