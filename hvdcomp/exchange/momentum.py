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

__all__ = ["Correction", "handles_momentum", "corrected", "groups_by_param", "momentum_factors",
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


class Correction:
    """The rules above for one exchange (:class:`hvdcomp.exchange.Exchange`), as both
    doors use them: :meth:`attach` the optimizer (rule 1), :meth:`set_momentum` and
    :meth:`fold_weight_decay` before each exchange (rule 2), :meth:`hide` and
    :meth:`unhide` around the optimizer's step (rule 3).  ``corrected``: {name: parameter}
    of rule 1; ``optimizer``: the one attached, or None."""

    def __init__(self, exchange):
        self.exchange = exchange
        self.optimizer: Optional[torch.optim.Optimizer] = None
        self.corrected: Dict[str, torch.Tensor] = {}
        self._groups: Dict[int, dict] = {}
        self._step_hooks: list = []
        self._hidden: Dict[str, torch.Tensor] = {}

    def attach(self, optimizer: torch.optim.Optimizer, hook_steps: bool = False) -> None:
        """The optimizer that applies the averages: with a compressor that applies momentum
        itself (DGC) and an SGD, its tensors are :attr:`corrected` (ValueError for Nesterov
        momentum, dampening or maximize, before anything changes).  ``hook_steps``: the
        optimizer's step is not the door's own (the DDP hook): the corrected tensors are
        left out of it through its step pre/post hooks (:meth:`hide`, :meth:`unhide`)."""
        mine = corrected(self.exchange.compression, self.exchange.entries, optimizer)
        for h in self._step_hooks:
            h.remove()
        self.corrected, self.optimizer, self._step_hooks = mine, optimizer, []
        if hook_steps and mine:
            self._step_hooks = [optimizer.register_step_pre_hook(self._before_opt_step),
                                optimizer.register_step_post_hook(self._after_opt_step)]

    def _before_opt_step(self, optimizer, args, kwargs):
        # A closure (zero_grad, backward) must run before the gradients are hidden: its
        # backward pass is the exchange.  Run it here and hand the step its loss.  (args[0]
        # is the optimizer itself: the hook sees step's own arguments.)
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
            if "closure" in kwargs:
                kwargs = dict(kwargs, closure=lambda: loss)
            else:
                args = (args[0], lambda: loss) + tuple(args[2:])
        self._hidden = self.hide()
        return tuple(args), kwargs

    def _after_opt_step(self, optimizer, args, kwargs) -> None:
        hidden, self._hidden = self._hidden, {}
        self.unhide(hidden)                   # p -= lr * the averaged update

    def set_momentum(self) -> None:
        """Before each exchange: the groups' momentum factors to the compressor, through
        :meth:`Exchange.set_momentum` (also under the reduce-scatter's piece names).
        RuntimeError when the compressor applies momentum itself and no optimizer is
        attached (its own momentum would be applied a second time)."""
        comp = self.exchange.compression
        if handles_momentum(comp) and self.optimizer is None:
            raise RuntimeError(
                f"hvdcomp.ddp: {comp.name} applies momentum correction itself (Lin et al. "
                f"2018, Sec. 3.2), so the optimizer's momentum must be off for its tensors: "
                f"pass optimizer= to HookState or call state.attach_optimizer(optimizer) "
                f"before the first step (Lightning: in configure_optimizers), or use "
                f"{comp.name}:momentum_correction=False")
        if self.corrected:
            self._groups = groups_by_param(self.optimizer.param_groups)
            self.exchange.set_momentum(momentum_factors(self.corrected, self._groups))

    def fold_weight_decay(self, name: str, p: torch.Tensor,
                          grad: Optional[torch.Tensor]) -> None:
        """DGC's local gradient: the group's weight decay folded in (``grad += wd p``)
        before momentum correction and selection, for the corrected tensors."""
        if name in self.corrected:
            fold_weight_decay(p, grad, self._groups[id(p)])

    def hide(self) -> Dict[str, torch.Tensor]:
        """Before the optimizer's step: the corrected tensors' gradients set aside."""
        return hide(self.corrected)

    def unhide(self, hidden: Dict[str, torch.Tensor], apply: bool = True) -> None:
        """After it: the gradients given back and (``apply``) ``p -= lr * average``."""
        restore(self.corrected, hidden)
        if hidden and apply:
            apply_hidden(self.corrected, hidden, groups_by_param(self.optimizer.param_groups))
