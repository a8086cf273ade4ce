"""``import hvdcomp.torch as hvd``: all of horovod.torch, with a DistributedOptimizer whose
``compression=`` takes any hvdcomp compressor and sends its real encoded bytes, an
``init()`` that lets mpi4py own MPI (see :func:`init`), and an ``elastic`` whose ``run``
rebuilds hvdcomp's exchange at every reset (:mod:`hvdcomp.torch.elastic`)."""
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
from ..exchange import StepStats  # noqa: E402,F401
from ..exchange.driver import Settings  # noqa: E402
from .wrapped import make as _make  # noqa: E402
from .join import join  # noqa: E402,F401  (hvdcomp's, over Horovod's)
from .broadcast import broadcast_optimizer_state, broadcast_state  # noqa: E402,F401
# hvdcomp's elastic module over Horovod's (the star import bound ``elastic`` to
# horovod.torch.elastic, so ``from . import elastic`` alone would not load ours)
import importlib as _importlib  # noqa: E402
elastic = _importlib.import_module(__name__ + ".elastic")

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


def _from_horovod(compression):
    """Horovod's own Compression.none / Compression.fp16 as hvdcomp's spec; else as is."""
    if compression is _hvd.Compression.none:
        return "none"
    return "fp16" if compression is _hvd.Compression.fp16 else compression


def DistributedOptimizer(optimizer, named_parameters=None, compression=None,
                         backward_passes_per_step=1, op=None, gradient_predivide_factor=1.0,
                         num_groups=0, groups=None, sparse_as_dense=False, process_set=None,
                         *, transport=None, fusion_bytes=25 * 2**20, min_compress_numel=1024,
                         compress_1d=False, seed=0, check_replicas=True,
                         collective=None, allreduce_summable=True, hierarchy=None):
    """Wrap ``optimizer`` so that ``p.grad`` holds gradients averaged across ranks, sent with
    ``compression`` as real encoded bytes, when ``loss.backward()`` returns (README,
    "Training-loop semantics").

    Same signature as ``horovod.torch.DistributedOptimizer``, plus keyword-only settings.
    The settings the DDP hook shares (compression, also Horovod's Compression.none/fp16;
    collective, hierarchy, sparse_as_dense, fusion_bytes, min_compress_numel, compress_1d,
    seed, check_replicas, allreduce_summable; gradient_predivide_factor as in Horovod) mean
    what :class:`hvdcomp.exchange.driver.Settings` says; ``optimizer.plan``,
    ``optimizer.specs`` and ``optimizer.paths`` show what they chose per tensor.  The others:

    backward_passes_per_step: the gradients of k backward passes are summed locally and
        exchanged in the k-th.
    op: hvd.Average (default) or hvd.Sum; others (Adasum, Min, Max, Product) raise
        ValueError.  gradient_predivide_factor other than 1 with op=Sum: ValueError (as in
        Horovod).
    num_groups, groups: not used (hvdcomp fuses by ``fusion_bytes``); anything but the
        defaults raises ValueError.
    process_set: only the global process set is supported (ValueError otherwise).
    Each of these errors is raised on every rank, after the ranks have compared their
    settings.
    transport: the carrier of the wire messages, with identical results either way:
        None or "auto" (default) picks "mpi" when MPI's world is Horovod's, rank for rank
        (mpirun, horovodrun's MPI controller), else "horovod" (horovodrun --gloo; no
        mpi4py); "mpi" (mpi4py Allgatherv; RuntimeError at construction when MPI's world
        is not Horovod's); "horovod" (hvd.allgather); or a
        :class:`hvdcomp.transport.Transport`.  ``optimizer.transport`` names the one used
        (also logged at INFO on rank 0: :mod:`hvdcomp.log`).

    Built again on the same parameters (e.g. to change the learning rate), it replaces the
    open hvdcomp optimizer that hooks them: that one is closed (its hooks removed, its
    threads stopped; its ``step()`` then raises RuntimeError) and hvdcomp's state starts
    fresh (``new.load_state_dict(old.state_dict())`` carries it); ValueError if the old
    one also holds parameters the new one does not.  TypeError for an optimizer that is
    already a DistributedOptimizer (hvdcomp's or Horovod's), and for pickling or copying
    the result (save its ``state_dict()``).  Horovod's ``broadcast_optimizer_state``
    treats it as Horovod's own (no exchange in its state-initialising step);
    :func:`hvdcomp.torch.broadcast_state` makes hvdcomp's state equal across ranks
    (docs/semantics.md, "Horovod's helpers and options").

    Raises ValueError / TypeError for invalid settings, :class:`hvdcomp.Mismatch` (a
    RuntimeError) on every rank if the ranks disagree on the model or any setting (each
    difference named), or at the first step on the parameters' values;
    :class:`hvdcomp.OutOfStep` on every rank when ranks exchange different steps (a rank that
    skipped step() or called it twice); :class:`hvdcomp.RankFailure` naming a rank that
    failed (README, "Failures").  After each step, ``optimizer.last_stats`` holds the bytes sent.
    """
    hvd = _hvd
    if not hvd.is_initialized():
        raise RuntimeError("call hvd.init() before creating the DistributedOptimizer")
    if op is None:
        op = hvd.Average
    refused = _refused(op, gradient_predivide_factor, num_groups, groups, process_set)
    settings = Settings(
        compression=_from_horovod(compression), collective=collective, seed=seed,
        min_compress_numel=min_compress_numel, compress_1d=compress_1d,
        allreduce_summable=allreduce_summable, check_replicas=check_replicas,
        fusion_bytes=fusion_bytes, average=op == hvd.Average,
        predivide=gradient_predivide_factor, sparse_as_dense=sparse_as_dense,
        hierarchy=hierarchy)
    return _make(optimizer, named_parameters, settings, backward_passes_per_step, op,
                 transport, hvd, refused)


def _refused(op, predivide, num_groups, groups, process_set):
    """The text of the ValueError for Horovod options this door does not honour, or None.
    Raised after the settings handshake, so that every rank raises it (a rank that raised
    before would leave the others waiting in the handshake)."""
    if num_groups or groups is not None:
        return ("hvdcomp fuses tensors into buckets of fusion_bytes; num_groups and groups "
                "are not supported (leave them at their defaults; set fusion_bytes=)")
    if process_set is not None and process_set is not _hvd.global_process_set:
        return ("hvdcomp supports only the global process set (process_set=None or "
                "hvd.global_process_set)")
    if predivide != 1.0 and op != _hvd.Average:
        return "gradient_predivide_factor not supported with op != Average (as in Horovod)"
    return None


def __getattr__(name):
    # Anything horovod.torch has that the star import did not bring (private helpers).
    return getattr(_hvd, name)
