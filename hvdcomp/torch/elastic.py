"""``hvd.elastic`` after ``import hvdcomp.torch as hvd``: Horovod's elastic training
(``run``, ``TorchState``, ``ElasticSampler``) with hvdcomp's DistributedOptimizer carried
through every reset (docs/semantics.md, "Elastic restarts").

* :func:`run` is Horovod's ``hvd.elastic.run`` whose reset (Horovod shut down and
  initialised again for the new world, when a host is added or removed or a worker
  failed) also rebuilds every open hvdcomp DistributedOptimizer's exchange for the new
  world: its threads stopped and carriers freed before Horovod shuts down; afterwards the
  collective names counted from zero, the settings handshake and the exchange built again,
  in creation order, as a worker that joins now builds them in its constructor, and the
  optimizer's hvdcomp state loaded into it: bit for bit at the same world size, and at
  another the shared state (fitted levels, PowerSGD's Q) kept and the per-rank state
  (residuals, DGC's momentum) reset with a warning, the rule of a restarted torchrun job
  (:meth:`hvdcomp.exchange.checkpoint.Checkpoints.load_state_dict`).
* ``TorchState`` is Horovod's.  Importing this module registers a state handler for
  hvdcomp's optimizers with Horovod's TorchState: ``commit()`` saves, and ``restore()``
  loads, the optimizer's ``state_dict()``, which holds hvdcomp's state (Horovod's handler
  does the same); its sync (at the start and after every reset) makes the wrapped
  optimizer's state equal to rank 0's (hvdcomp's :func:`broadcast_optimizer_state`) and
  hvdcomp's step and shared state too, while each rank keeps its own per-rank state (a
  worker that joined starts with none).

Refused with ValueError on every rank, before any collective: a training function run by
Horovod's own ``horovod.torch.elastic.run`` (its reset would leave the exchange connected
to the old world), and LAQ or NDQSG (``Compressor.absent_rank`` other than zeros: LAQ's
receivers keep every rank's last upload, which a worker that joins does not have and one
that leaves takes away; NDQSG resolves each message against every rank's).
"""
from __future__ import annotations

import functools

import horovod.torch as _hvd
from horovod.common.elastic import run_fn
from horovod.torch.elastic import ElasticSampler, TorchState
from horovod.torch.elastic.state import (OptimizerStateHandler, get_handler_registry,
                                         set_handler_registry)

from ..compressors import ABSENT_ZEROS
from ..log import logger
from ..transport import restart_names
from .broadcast import broadcast_optimizer_state
from .join import live
from .wrapped import is_hvdcomp

__all__ = ["run", "TorchState", "ElasticSampler"]

_running = 0        # hvdcomp's run() wrappers active in this process


def run(func):
    """Horovod's ``hvd.elastic.run`` decorator (the same contract: ``func(state, ...)``,
    with ``state`` a :class:`TorchState`, commits and resets as Horovod documents), whose
    reset also rebuilds the open hvdcomp DistributedOptimizers for the new world (module
    docstring).  ValueError on every rank, before anything collective, for a ``state``
    holding an hvdcomp optimizer whose compressor cannot follow a change of the ranks
    (LAQ, NDQSG) or that was built with a Transport instance (it connects one world)."""
    inner = run_fn(func, _reset)

    @functools.wraps(func)
    def wrapper(state, *args, **kwargs):
        global _running
        for opt in {id(o): o for o in live() + _hvdcomp_optimizers(state)}.values():
            _check_elastic(opt)       # (every open one is rebuilt at a reset)
        _running += 1
        try:
            return inner(state, *args, **kwargs)
        finally:
            _running -= 1
    return wrapper


def _hvdcomp_optimizers(state) -> list:
    handlers = getattr(state, "_handlers", {}) or {}
    return [h.value for h in handlers.values() if is_hvdcomp(getattr(h, "value", None))]


def _check_elastic(opt) -> None:
    if not (opt._transport_arg is None or isinstance(opt._transport_arg, str)):
        raise ValueError("hvdcomp: a DistributedOptimizer built with a Transport instance "
                         "cannot follow an elastic reset (the instance connects the old "
                         "world); pass transport=None, 'horovod' or 'mpi'")
    comp = opt._driver.compression
    if comp.absent_rank != ABSENT_ZEROS:
        raise ValueError(
            f"hvdcomp: compression {comp.spec()!r} cannot run under Horovod elastic "
            f"(hvd.elastic.run): its receivers keep state for every rank or need every "
            f"rank's message (LAQ's last uploads, NDQSG's nested ranks), which a worker that "
            f"joins lacks and one that leaves takes away.  Use another compressor, or a "
            f"fixed world (docs/semantics.md, 'Elastic restarts')")


def _reset() -> None:
    """Horovod's reset (shutdown, init) with hvdcomp's exchanges taken down before and built
    again after, every rank at the same point (a worker that joins builds its optimizers
    in their constructors, before its first sync)."""
    from . import init
    opts = live()
    saved = [_leave_world(o) for o in opts]
    _hvd.shutdown()
    init()
    restart_names()
    for o, state in zip(opts, saved):
        _join_world(o, state)


def _leave_world(opt):
    """Before Horovod shuts down: hvdcomp's state of ``opt`` kept aside and returned, its
    exchange's threads stopped and the carriers built for it freed.  A step that Horovod
    broke (a rank failed) is finished and its averages dropped."""
    d = opt._driver
    try:
        d.drop()
    except Exception as e:        # noqa: BLE001 - the step a failed rank broke
        logger.warning("hvdcomp: the step interrupted by the reset is dropped (%s)", e)
    saved = d.state_dict()
    d.close()
    opt._passes, opt._fresh, opt._queued, opt._fired = 0, False, False, set()
    return saved


def _join_world(opt, saved) -> None:
    """After Horovod's re-init: the settings handshake and the exchange of ``opt`` built
    again for the new world (as the constructor of a worker that joins now builds them),
    then ``saved`` loaded (:meth:`hvdcomp.exchange.checkpoint.Checkpoints.load_state_dict`:
    bit for bit at the same world size; at another, the shared state kept and the per-rank
    state reset with a warning)."""
    opt._agree([])
    opt._build_driver()
    opt._driver.load_state_dict(saved)


class _HvdcompOptimizerType(type):
    def __instancecheck__(cls, obj):
        return is_hvdcomp(obj)


class HvdcompOptimizer(metaclass=_HvdcompOptimizerType):
    """``isinstance(x, HvdcompOptimizer)``: ``x`` is an hvdcomp DistributedOptimizer (the
    key of :class:`OptimizerHandler` in Horovod's handler registry)."""


class OptimizerHandler(OptimizerStateHandler):
    """Horovod's TorchState handler for an hvdcomp DistributedOptimizer: save and restore
    as Horovod's (the optimizer's ``state_dict()``, hvdcomp's state included); sync as the
    module docstring says.  RuntimeError on every rank when the training function is not
    run by :func:`run` (``horovod.torch.elastic.run`` does not rebuild the exchange at a
    reset)."""

    def sync(self):
        if not _running:
            raise RuntimeError(
                "hvdcomp: a TorchState holding an hvdcomp DistributedOptimizer must be run "
                "by hvdcomp's elastic run (hvd.elastic.run after 'import hvdcomp.torch as "
                "hvd', or hvdcomp.torch.elastic.run), which rebuilds hvdcomp's exchange for "
                "the new world at every reset; horovod.torch.elastic.run does not")
        broadcast_optimizer_state(self.value, root_rank=0, per_rank=False)


def _register() -> None:
    registry = get_handler_registry()
    if not any(h is OptimizerHandler for _, h in registry):
        set_handler_registry([(HvdcompOptimizer, OptimizerHandler)] + list(registry))


_register()
