"""``import hvdcomp.torch as hvd``: all of horovod.torch, with a DistributedOptimizer whose
``compression=`` takes any hvdcomp compressor and sends its real encoded bytes, and an
``init()`` that lets mpi4py own MPI (see :func:`init`)."""
import os

from horovod.torch import *  # noqa: F401,F403  (the whole horovod.torch surface)
import horovod.torch as _hvd

from .exchange import Exchange, StepStats
from .optimizer import DistributedOptimizer, join  # join: hvdcomp's, over Horovod's

_MPI_LAUNCH = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS")


def init(*args, **kwargs):
    """``horovod.torch.init``, after initializing MPI through mpi4py when the job was
    started by an MPI launcher (mpirun, horovodrun over MPI) and Horovod has MPI.

    Why: Horovod finalizes MPI from its background thread when it initialized MPI itself
    and any rank shuts Horovod down (e.g. a rank that raised an exception exits); any
    thread of the other ranks still using MPI then crashes (a segmentation fault).  With
    mpi4py owning MPI, MPI is finalized only at interpreter exit, after hvdcomp's exit
    handler has stopped its threads (:mod:`hvdcomp.exchange.shutdown`).  mpi4py requests
    MPI_THREAD_MULTIPLE, what Horovod requests too."""
    if (_hvd.mpi_built() and any(os.environ.get(v) for v in _MPI_LAUNCH)
            and not os.environ.get("HOROVOD_GLOO_RENDEZVOUS_ADDR")
            and os.environ.get("HOROVOD_CONTROLLER", "mpi").lower() != "gloo"):
        try:
            from mpi4py import MPI  # noqa: F401 - initializes MPI
        except ImportError:
            pass
    return _hvd.init(*args, **kwargs)


def __getattr__(name):
    # Anything horovod.torch has that the star import did not bring (private helpers).
    return getattr(_hvd, name)
