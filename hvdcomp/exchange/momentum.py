"""Momentum correction (DGC, Lin et al. 2018, Sec. 3.2, Alg. 4 "local gradient accumulation
with momentum correction"): the compressor accumulates the SGD momentum itself, on the local
gradient, before it selects the values to send, so the optimizer's own momentum must not be
applied to the average of its tensors again.

The rules shared by the launchers that own an SGD step (the drop-in optimizer,
:mod:`hvdcomp.torch`, and the DDP hook's state, :mod:`hvdcomp.ddp`, once told the
optimizer); the optimizer's ``param_groups`` are never altered:

1. :func:`corrected` names the tensors whose compressor handles momentum (ValueError for an
   SGD group with Nesterov momentum, dampening or maximize: the compressor applies plain
   momentum ``u = m u + g``).
2. Before each exchange the compressor gets each tensor's momentum factor from its group
   (:func:`momentum_factors`; a scheduler may change it between steps) and the group's
   weight decay is folded into the local gradient (:func:`fold_weight_decay`: ``g + wd p``,
   as the paper's reference code does).
3. The optimizer's step runs with those tensors' gradients hidden (:func:`hide`,
   :func:`restore`), and each gets ``p -= lr * average`` instead (:func:`apply_hidden`).
"""
from __future__ import annotations

from typing import Dict, Iterable, Optional

import torch

from ..compressors import Compressor
from ..compressors.protocols import MomentumCorrection
from .plan import Entry

__all__ = ["handles_momentum", "corrected", "groups_by_param", "momentum_factors",
           "fold_weight_decay", "hide", "restore", "apply_hidden"]


def handles_momentum(comp: Compressor) -> bool:
    """Whether ``comp`` applies momentum itself (a MomentumCorrection with it switched on)."""
    return isinstance(comp, MomentumCorrection) and bool(comp.handles_momentum)


def corrected(comp: Compressor, entries: Dict[str, Entry],
              optimizer: Optional[torch.optim.Optimizer]) -> Dict[str, torch.Tensor]:
    """{name: parameter} of the tensors whose compressor (``comp``, routed to them in
    ``entries``) applies momentum itself, when ``optimizer`` is an SGD; empty for other
    compressors and other optimizers (those apply their own rule to the average).  Raises
    ValueError when a group holding such a tensor uses Nesterov momentum, dampening or
    maximize."""
    if not (handles_momentum(comp) and isinstance(optimizer, torch.optim.SGD)):
        return {}
    mine = {n: e.param for n, e in entries.items() if e.compressor is comp}
    ids = {id(p) for p in mine.values()}
    for group in optimizer.param_groups:
        if not any(id(p) in ids for p in group["params"]):
            continue
        if group.get("nesterov") or group.get("dampening") or group.get("maximize"):
            raise ValueError(f"{comp.name} applies momentum correction itself (plain "
                             f"momentum u = m u + g, then p -= lr * update); Nesterov "
                             f"momentum, dampening and maximize are not supported with it")
    return mine


def groups_by_param(param_groups: Iterable[dict]) -> Dict[int, dict]:
    """{id(parameter): its group} of an optimizer's ``param_groups``."""
    return {id(p): g for g in param_groups for p in g["params"]}


def momentum_factors(params: Dict[str, torch.Tensor], groups: Dict[int, dict]
                     ) -> Dict[str, float]:
    """{name: momentum factor of its group (0 without momentum)} for ``params``."""
    return {n: float(groups[id(p)].get("momentum", 0.0) or 0.0) for n, p in params.items()}


def fold_weight_decay(p: torch.Tensor, grad: Optional[torch.Tensor], group: dict) -> None:
    """``grad += wd * p`` in place (``wd``: the group's weight decay; nothing for a missing,
    sparse or undecayed gradient)."""
    if grad is None or grad.is_sparse:
        return
    wd = group.get("weight_decay", 0.0)
    if wd:
        with torch.no_grad():
            grad.add_(p.detach(), alpha=wd)


def hide(params: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Set the dense gradients of ``params`` to None (so the optimizer's step skips them);
    returns {name: the gradient hidden}."""
    hidden = {n: p.grad for n, p in params.items()
              if p.grad is not None and not p.grad.is_sparse}
    for n in hidden:
        params[n].grad = None
    return hidden


def restore(params: Dict[str, torch.Tensor], hidden: Dict[str, torch.Tensor]) -> None:
    """Give the gradients of :func:`hide` back."""
    for n, g in hidden.items():
        params[n].grad = g


def apply_hidden(params: Dict[str, torch.Tensor], hidden: Dict[str, torch.Tensor],
                 groups: Dict[int, dict]) -> None:
    """Apply ``p -= lr * grad`` to each gradient of :func:`hide` (the momentum-corrected
    average; ``lr`` of its group, a float or a tensor)."""
    with torch.no_grad():
        for n, g in hidden.items():
            p = params[n]
            lr = groups[id(p)]["lr"]
            if isinstance(lr, torch.Tensor):
                p.sub_(g * lr)
            else:
                p.add_(g, alpha=-lr)
