"""What the exchange does for the compressors that need the training loop (the opt-in
protocols of :mod:`hvdcomp.compressors.protocols`): momentum factors for a
MomentumCorrection compressor (DGC), the parameters' change for a ParamDeltas one (LAQ),
the collective refit of an AdaptiveLevels one (ALQ/AMQ).  :class:`LoopProtocols` is a base of
:class:`hvdcomp.exchange.core.Exchange`, whose ``compression``, ``entries``,
``collective``, ``transport`` and ``params_before`` it reads.
"""
from __future__ import annotations

from typing import Dict

import numpy as np

from ..compressors.protocols import AdaptiveLevels, MomentumCorrection, ParamDeltas
from ..transport import Transport
from .hier import Hierarchical
from .scatter import ReduceScatter

__all__ = ["LoopProtocols", "refit"]


class LoopProtocols:
    """The training-loop half of :class:`~hvdcomp.exchange.core.Exchange` (module
    docstring): ``set_momentum``, and around the parameter update ``before_step`` /
    ``after_step`` (or its two halves, ``report_param_deltas`` and ``refit_levels``)."""

    def set_momentum(self, factors: Dict[str, float]) -> None:
        """Momentum factors by parameter name for a MomentumCorrection compressor (DGC),
        also under the names of the reduce-scatter's pieces of those parameters; nothing
        for other compressors."""
        if not isinstance(self.compression, MomentumCorrection):
            return
        more = dict(factors)
        if isinstance(self.collective, ReduceScatter):
            for p in self.collective.pieces():
                if p.name in factors:
                    more[p.label] = factors[p.name]
        if isinstance(self.collective, Hierarchical):
            for label, name in self.collective.labels().items():
                if name in factors:
                    more[label] = factors[name]
        self.compression.set_momentum(more)

    # --- around the parameter update ------------------------------------------------
    def before_step(self) -> None:
        """Call before the parameters are updated: a ParamDeltas compressor needs their
        change, so they are copied into ``params_before`` (None for other compressors;
        part of a checkpoint taken between before_step and after_step)."""
        self.params_before = ([e.param.detach().clone() for e in self.entries.values()]
                              if isinstance(self.compression, ParamDeltas) else None)

    def after_step(self, step: int) -> None:
        """Call after the parameters of step ``step`` were updated, on every rank:
        :meth:`report_param_deltas` then :meth:`refit_levels`."""
        self.report_param_deltas(step)
        self.refit_levels(step)

    def report_param_deltas(self, step: int) -> None:
        """A ParamDeltas compressor gets ``sum ||theta_{k+1} - theta_k||^2`` of step
        ``step`` (the parameters now against ``params_before``); nothing without
        ``params_before``."""
        if self.params_before is not None:
            sq = sum(float((e.param.detach() - b).double().pow(2).sum())
                     for e, b in zip(self.entries.values(), self.params_before))
            self.params_before = None
            self.compression.after_step(step, sq)

    def refit_levels(self, step: int) -> None:
        """Each AdaptiveLevels compressor in use that collected statistics during ``step``
        refits (the exchange's, then the others of a per-layer plan, in entry order)
        (:func:`refit`; collective: every rank calls it, with no call in flight)."""
        seen: list = []         # (a per-layer plan's tensors may use several instances)
        for comp in [self.compression] + [e.compressor for e in self.entries.values()]:
            if isinstance(comp, AdaptiveLevels) and not any(comp is c for c in seen):
                seen.append(comp)
                if comp.wants_stats(step):
                    refit(comp, self.transport, step)


def refit(comp: AdaptiveLevels, transport: Transport, step: int) -> None:
    """ALQ/AMQ (Faghri et al. 2020, Sec. 3): sum the statistics of ``step`` across ranks,
    fit on rank 0, broadcast, so that every rank adopts an identical level table with a new
    version.  Nothing happens (on every rank) when no rank observed anything."""
    local = comp.pending_stats()
    summed = transport.allreduce_sum(comp.empty_stats() if local is None else local)
    if not np.any(summed):
        return
    payload = (np.asarray(comp.update(summed, step + 1), dtype=np.float32)
               if transport.rank == 0 else np.zeros(comp.fit_size(), dtype=np.float32))
    comp.adopt(transport.broadcast(payload, root=0))
