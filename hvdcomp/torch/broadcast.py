"""Horovod's ``broadcast_optimizer_state`` for hvdcomp's DistributedOptimizer, and
:func:`broadcast_state`, which makes hvdcomp's own state (the step, the compressor's
state: residuals, momentum, fitted levels, LAQ's aggregates) equal on every rank.

Horovod's helper makes a fresh optimizer's state exist before broadcasting it: on the
ranks whose state is empty it sets every gradient to zero and runs a step.  With
hvdcomp's optimizer that step is the wrapped optimizer's own (no exchange: hvdcomp's
optimizer is recognised as a Horovod DistributedOptimizer, :func:`hvdcomp.torch.wrapped.make`),
so ranks restored from a checkpoint and fresh ones never wait for each other and no
compressed message of zeros is sent.
"""
from __future__ import annotations

from .wrapped import is_hvdcomp

__all__ = ["broadcast_state", "broadcast_optimizer_state"]


def broadcast_state(optimizer, root_rank: int = 0, per_rank: bool = True) -> None:
    """Make hvdcomp's state of ``optimizer`` (an hvdcomp DistributedOptimizer) on every
    rank equal to ``root_rank``'s: the step counter (the messages' step and Philox keys)
    and the compressor's state (:meth:`hvdcomp.exchange.driver.Driver.state_dict`: level
    tables, residuals / error feedback, DGC's momentum, LAQ's aggregates and last
    uploads).  Collective: every rank calls it, between steps.

    Per-rank state (residuals, DGC's momentum, LAQ's last uploads) becomes a copy of
    ``root_rank``'s on every rank: the right thing when only ``root_rank`` was restored
    from a checkpoint (the others would otherwise run with empty state while it runs with
    its own, and LAQ's receivers would disagree); when every rank restored its own, load
    each rank's checkpoint instead and do not call this.  The level tables and the step
    are the same on every rank anyway after a run; this makes them so after a restore.
    ``per_rank=False``: only the step and the state every rank shares (level tables,
    PowerSGD's Q: ``Compressor.shared_state``) come from ``root_rank``; each rank keeps its
    own per-rank state (what an elastic reset needs: :mod:`hvdcomp.torch.elastic`).

    Raises TypeError for an optimizer that is not hvdcomp's, RuntimeError during a step
    (gradients of a backward pass not applied yet) or on a closed optimizer, ValueError
    (on every rank) when ``root_rank``'s state is of another compressor.
    """
    import horovod.torch as hvd
    if not is_hvdcomp(optimizer):
        raise TypeError(f"broadcast_state needs an hvdcomp DistributedOptimizer; got "
                        f"{type(optimizer).__name__}")
    optimizer._check_open()
    d = optimizer._driver
    # Between steps on every rank, else the same RuntimeError on every rank (a rank that
    # raised alone would leave the others waiting in the broadcast)
    busy = bool(d.exchange.in_step or optimizer._passes)
    name = f"hvdcomp.broadcast_state.{optimizer._ident}"
    if any(hvd.allgather_object(busy, name=name + ".busy")):
        raise RuntimeError("broadcast_state() during a step (a backward pass's gradients "
                           "not exchanged or applied yet on some rank): call it between "
                           "steps, on every rank")
    got = hvd.broadcast_object(d.state_dict() if hvd.rank() == root_rank else None,
                               root_rank, name=name)
    if per_rank:
        d.load_state_dict(got)
    else:
        d.load_shared(got)


def broadcast_optimizer_state(optimizer, root_rank: int, model=None, *,
                              per_rank: bool = True) -> None:
    """``horovod.torch.broadcast_optimizer_state``, then, for an hvdcomp
    DistributedOptimizer, :func:`broadcast_state`: the wrapped optimizer's state and
    options and hvdcomp's state equal ``root_rank``'s on every rank.  Other optimizers:
    Horovod's helper alone.  Collective, between steps.

    A fresh hvdcomp optimizer's state is first made to exist as hvdcomp's own steps make
    it (:func:`_init_state`: gradients set to zero, the wrapped optimizer's step, with the
    tensors whose momentum DGC applies itself left out, as every hvdcomp step leaves them
    out), so that a rank restored from a checkpoint and fresh ones hold the same entries
    (Horovod's helper alone would give the fresh ranks SGD momentum buffers for DGC's
    tensors that the restored rank lacks: a mismatch error in the broadcast).
    ``per_rank``: as :func:`broadcast_state`'s."""
    import horovod.torch as hvd
    if is_hvdcomp(optimizer):
        optimizer._check_open()
        _init_state(optimizer, model)
    hvd.broadcast_optimizer_state(optimizer, root_rank, model=model)
    if is_hvdcomp(optimizer):
        broadcast_state(optimizer, root_rank, per_rank=per_rank)


def _init_state(optimizer, model) -> None:
    """What Horovod's helper does to an optimizer whose state is empty (zero gradients,
    sparse ones for SparseAdam and SGD's sparse embeddings, one step of the wrapped
    optimizer: no exchange), with DGC's corrected tensors hidden from that step."""
    import torch
    if len(optimizer.state):
        return
    sparse = set()
    if model is not None:
        sparse = {id(p) for m in model.modules()
                  if isinstance(m, torch.nn.Embedding) and m.sparse for p in m.parameters()}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
                if isinstance(optimizer, torch.optim.SparseAdam) or (
                        isinstance(optimizer, torch.optim.SGD) and id(p) in sparse):
                    p.grad = p.grad.to_sparse()
    momentum = optimizer._driver.momentum
    hidden = momentum.hide()
    try:
        super(type(optimizer), optimizer).step()
    finally:
        momentum.unhide(hidden, apply=False)
