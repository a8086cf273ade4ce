"""``import hvdcomp.torch as hvd``: all of horovod.torch, with a DistributedOptimizer whose
``compression=`` takes any hvdcomp compressor and sends its real encoded bytes, and an
``init()`` that lets mpi4py own MPI (see :func:`init`)."""
import os

try:
    import horovod.torch as _hvd
except ImportError as _e:
    raise ImportError(
        f"hvdcomp.torch needs Horovod built with PyTorch support (horovod.torch could not be "
        f"imported: {_e}). Install it with: HOROVOD_WITH_PYTORCH=1 pip install "
        f"'hvdcomp[horovod]' (Horovod 0.28.1 from source; see the README's 'Installing with "
        f"pip' and launch/setup, which builds it). The compressors (import hvdcomp) and "
        f"hvdcomp.exchange work without Horovod.") from _e
from horovod.torch import *  # noqa: F401,F403,E402  (the whole horovod.torch surface)

from ..transport.mpi import horovod_threads_disabled  # noqa: E402
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
    MPI_THREAD_MULTIPLE, what Horovod requests too.

    Except with HOROVOD_MPI_THREADS_DISABLE=1 (an MPI without thread support): Horovod then
    starts MPI itself with MPI_THREAD_SINGLE from its background thread, as its
    documentation says, and hvdcomp's messages go through Horovod's allgather (the mpi
    transport needs MPI_THREAD_MULTIPLE next to Horovod: :mod:`hvdcomp.transport.mpi`)."""
    if (_hvd.mpi_built() and any(os.environ.get(v) for v in _MPI_LAUNCH)
            and not os.environ.get("HOROVOD_GLOO_RENDEZVOUS_ADDR")
            and os.environ.get("HOROVOD_CONTROLLER", "mpi").lower() != "gloo"
            and not horovod_threads_disabled()):
        try:
            from mpi4py import MPI  # noqa: F401 - initializes MPI
        except ImportError:
            pass
    return _hvd.init(*args, **kwargs)


def __getattr__(name):
    # Anything horovod.torch has that the star import did not bring (private helpers).
    return getattr(_hvd, name)
