"""Every hvdcomp compressor as a DistributedDataParallel communication hook.

    import hvdcomp.ddp
    ddp_model = torch.nn.parallel.DistributedDataParallel(model)
    state = hvdcomp.ddp.HookState(ddp_model, compression="alq:bits=3")
    ddp_model.register_comm_hook(state, hvdcomp.ddp.hook)

The hook sends the same messages as the drop-in optimizer (:mod:`hvdcomp.torch`) for the
same gradients, seed, step and rank: both doors drive one lifecycle
(:class:`hvdcomp.exchange.driver.Driver`: the settings and their handshake, the exchange
core, the step, checkpoints, DGC's momentum rules), here with torch.distributed as the
carrier (:mod:`hvdcomp.transport.torch_dist`: Gloo on CPU, NCCL on GPU) and DDP's buckets
in place of the optimizer's fusion buckets.  This module is the wiring: each DDP bucket
goes to :meth:`hvdcomp.exchange.Exchange.call` with its gradient views (a parameter whose
``.grad`` is None is absent on this rank), and the hook returns a ``torch.futures.Future``
at once, completed on the exchange's decode thread with the averaged bucket.  The step's
first bucket starts the step (DGC's momentum factors, LAQ's parameter change), its last
one ends it (ALQ/AMQ's refit).  docs/design.md, "The DDP communication hook", has the
details.

Failures: an encoder that raises on one rank, or a rank that raises while preparing a
bucket, fails every rank's Future (the failing rank its own exception, the others a
:class:`hvdcomp.RankFailure` naming it); ranks out of step raise :class:`hvdcomp.OutOfStep`.

Uneven inputs (``torch.distributed.algorithms.Join([ddp_model])``): a rank out of inputs
shadows the others' buckets outside any backward pass and sends nothing; with DDP's
default ``divide_by_initial_world_size=True`` its gradients are absent (the average
divides by the world size), with ``False`` it has joined (the average divides by the ranks
that have not; ``last_stats.joined``).  LAQ cannot leave a rank out: ValueError on every
rank, as NDQSG's for any absent rank.  Sparse gradients (``nn.Embedding(sparse=True)``,
trainable) are refused at set-up (TypeError on every rank).
"""
import torch
import torch.distributed as dist

from .bucket import exchange_bucket
from .model import check_backend
from .state import HookState

__all__ = ["HookState", "hook", "register", "check_backend"]


def hook(state: "HookState", bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: average the bucket's gradients across ranks with ``state``'s
    compressor, sending real encoded bytes; returns a Future of the averaged bucket without
    waiting (module docstring).

    Example::

        >>> state = hvdcomp.ddp.HookState(ddp_model, compression="alq:bits=3")
        >>> ddp_model.register_comm_hook(state, hvdcomp.ddp.hook)

    Raises TypeError when called with something other than a DDP GradBucket (e.g.
    registered on FSDP); the Future fails (every rank's) when a rank fails to encode or a
    message is malformed.
    """
    if not isinstance(state, HookState):
        raise TypeError(f"hvdcomp.ddp.hook needs a hvdcomp.ddp.HookState as its state; got "
                        f"{type(state).__name__}")
    if not isinstance(bucket, dist.GradBucket):
        raise TypeError(f"hvdcomp.ddp.hook is a DistributedDataParallel communication hook "
                        f"(it takes a GradBucket); got {type(bucket).__name__}")
    return exchange_bucket(state, bucket)


def register(ddp_model, compression=None, **kwargs) -> HookState:
    """``HookState(ddp_model, compression, **kwargs)`` registered on ``ddp_model``; returns
    the state.  TypeError unless ``ddp_model`` is a DistributedDataParallel."""
    if not isinstance(ddp_model, torch.nn.parallel.DistributedDataParallel):
        raise TypeError(f"hvdcomp.ddp.register needs a DistributedDataParallel module; got "
                        f"{type(ddp_model).__name__} (wrap the model in DDP first)")
    kwargs.setdefault("process_group", ddp_model.process_group)
    state = HookState(ddp_model, compression, **kwargs)
    ddp_model.register_comm_hook(state, hook)
    return state
