"""The optimizer that :func:`hvdcomp.torch.DistributedOptimizer` wraps: whether it can be
wrapped, which of its parameters are exchanged under which names, and the class built on
the fly around it (:func:`make`, as horovod.torch does: a subclass of the wrapped
optimizer's class with :mod:`hvdcomp.torch.optimizer`'s methods)."""
from __future__ import annotations

from ..exchange.driver import Reports, Settings
from ..exchange.owners import Owner
from .optimizer import _DistributedOptimizer

__all__ = ["make", "is_hvdcomp", "check_wrappable", "named_floats"]

#: The module of horovod.torch's DistributedOptimizer (what its helpers compare with).
_HOROVOD_OPTIMIZER_MODULE = "horovod.torch.optimizer"


def is_hvdcomp(optimizer) -> bool:
    """Whether ``optimizer`` is an hvdcomp DistributedOptimizer."""
    return bool(getattr(type(optimizer), "_hvdcomp_optimizer", False))


def check_wrappable(optimizer) -> None:
    """TypeError for an optimizer that already exchanges its gradients: hvdcomp's own
    DistributedOptimizer or Horovod's (both hook the parameters; wrapped again, every
    backward pass would exchange twice)."""
    if is_hvdcomp(optimizer):
        raise TypeError(
            "this optimizer is already an hvdcomp DistributedOptimizer; wrap the torch "
            "optimizer itself (a new hvdcomp DistributedOptimizer built on the same "
            "parameters replaces the old one: see hvdcomp.torch.DistributedOptimizer)")
    if hasattr(optimizer, "_allreduce_grad_async"):
        raise TypeError(
            "this optimizer is already horovod.torch's DistributedOptimizer (it allreduces "
            "the gradients itself); wrap the torch optimizer itself")


def named_floats(param_groups, named_parameters):
    """[(name, parameter)] of the optimizer's floating-point parameters (frozen ones
    too: one unfrozen later is exchanged like the others): named by ``named_parameters``
    (ValueError if it lacks some of them), else ``param.{group}.{index}``."""
    all_params = [p for g in param_groups for p in g["params"]]
    if named_parameters is None:
        named = [(f"param.{i}.{j}", p) for i, g in enumerate(param_groups)
                 for j, p in enumerate(g["params"])]
    else:
        named = list(named_parameters)
        by_id = {id(p): n for n, p in named}
        missing = [i for i, p in enumerate(all_params) if id(p) not in by_id]
        if missing:
            raise ValueError(f"named_parameters lacks {len(missing)} of the optimizer's "
                             f"parameters; pass model.named_parameters() of the model "
                             f"whose parameters the optimizer holds")
        mine = {id(p) for p in all_params}
        named = [(n, p) for n, p in named if id(p) in mine]
    return [(n, p) for n, p in named if p.is_floating_point()]


def make(optimizer, named_parameters, settings: Settings, backward_passes_per_step, op,
         transport, hvd, refused=None):
    """``optimizer`` wrapped: an instance of a subclass of its class with
    :mod:`hvdcomp.torch.optimizer`'s methods and :class:`~hvdcomp.exchange.driver.Reports`'
    properties.  TypeError for an optimizer that is already a DistributedOptimizer
    (hvdcomp's or Horovod's); ValueError when ``named_parameters`` lacks some of its
    parameters.  ``refused``: a ValueError's text, raised on every rank after the settings
    handshake (an option this door refuses, so that no rank is left waiting in the
    handshake)."""
    check_wrappable(optimizer)
    named = named_floats(optimizer.param_groups, named_parameters)
    body = dict(_DistributedOptimizer.__dict__)
    # Horovod's helpers recognise their DistributedOptimizer by its module:
    # broadcast_optimizer_state then initialises the state of a fresh optimizer with the
    # wrapped optimizer's own step (no exchange, which the other ranks would not join)
    # instead of calling step() (docs/semantics.md, "Horovod's helpers").
    body["__module__"] = _HOROVOD_OPTIMIZER_MODULE
    cls = type(optimizer.__class__.__name__, (optimizer.__class__, Reports, Owner), body)
    return cls(optimizer.param_groups, named, settings, backward_passes_per_step, op,
               transport, hvd, refused)
