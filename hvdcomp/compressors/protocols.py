"""Opt-in protocols: what a compressor with a special need declares, and what the exchange
core (the drop-in optimizer, the DDP hook) checks for with ``isinstance``.

The base contract (:class:`~hvdcomp.compressors.base.Compressor`) is encode / combine /
state_dict / load_state_dict / message_bytes.  A compressor that needs more from the
training loop also inherits one of these classes and implements its methods; a compressor
that needs none of them inherits none.  Nothing shared changes when a compressor is added.

* :class:`AdaptiveLevels`: levels fitted to statistics of the gradients, summed across ranks,
  fitted on rank 0 and broadcast (ALQ/AMQ, Faghri et al. 2020, Sec. 3).
* :class:`MomentumCorrection`: the compressor applies momentum itself before sparsifying, so
  the wrapped optimizer's momentum must be off for its tensors (DGC, Lin et al. 2018, Sec. 3.2).
* :class:`ParamDeltas`: the compressor's rule needs ``||theta_{k+1} - theta_k||^2`` after every
  step (LAQ's lazy rule, Sun et al. 2019, Eq. 7).
* :class:`ReportsEvents`: notable events to surface in ``StepStats.events`` (e.g. NDQSG's side
  information too far from the truth, Abdi & Fekri 2019).
"""
from __future__ import annotations

from typing import Dict, List, Optional

import numpy as np
import torch

__all__ = ["AdaptiveLevels", "MomentumCorrection", "ParamDeltas", "ReportsEvents"]


class AdaptiveLevels:
    """Levels fitted during training.  The core calls, on every rank:

    1. during the encode of step ``k`` where ``wants_stats(k)``: ``observe(grad)`` for each
       finite gradient this compressor encodes;
    2. after the optimizer step: ``pending_stats()`` (or ``empty_stats()`` where it returns
       None) is summed across ranks (float64 allreduce); if the sum is not all zero, rank 0
       calls ``update(summed, k + 1)`` and broadcasts the float32 result (every other rank
       broadcasts into an array of ``fit_size()`` zeros), and every rank calls
       ``adopt(payload)``, so every rank holds the same table with a new version.
    """

    def wants_stats(self, step: int) -> bool:
        """Whether statistics are collected during ``step``'s encoding."""
        raise NotImplementedError

    def observe(self, grad: torch.Tensor) -> None:
        """Accumulate statistics of one finite gradient."""
        raise NotImplementedError

    def empty_stats(self) -> np.ndarray:
        """Zero statistics, float64, the shape ``pending_stats`` returns."""
        raise NotImplementedError

    def pending_stats(self) -> Optional[np.ndarray]:
        """Statistics gathered since the last call (float64), or None; resets them."""
        raise NotImplementedError

    def update(self, summed_stats: np.ndarray, step: int) -> np.ndarray:
        """Fit from the rank-summed statistics (rank 0 only); returns the payload to
        broadcast (float32, ``fit_size()`` elements)."""
        raise NotImplementedError

    def fit_size(self) -> int:
        """Number of float32 elements of the broadcast payload."""
        raise NotImplementedError

    def adopt(self, payload: np.ndarray) -> None:
        """Install the broadcast payload (identical on every rank)."""
        raise NotImplementedError


class MomentumCorrection:
    """The compressor accumulates momentum itself (``u = m u + g``) before selecting.

    ``handles_momentum`` (an attribute, may depend on the settings) says whether it does so
    for this instance; when it does, the drop-in optimizer (with SGD) keeps the compressor's
    tensors out of the wrapped SGD's step, hands the groups' momentum factors over through
    ``set_momentum`` before each exchange, folds the groups' weight decay into the local
    gradients and applies ``p -= lr * average`` itself.
    """
    handles_momentum: bool = True

    def set_momentum(self, factors: Dict[str, float]) -> None:
        """Momentum factor by parameter name."""
        raise NotImplementedError


class ParamDeltas:
    """The compressor needs the squared parameter change of each step: the core calls
    ``after_step(step, sq)`` after every optimizer step with
    ``sq = sum over all parameters of ||theta_{k+1} - theta_k||^2`` (float)."""

    def after_step(self, step: int, param_delta_sq: float) -> None:
        raise NotImplementedError


class ReportsEvents:
    """Events worth telling the user: the core calls ``drain_events()`` after decoding each
    tensor and reports them in ``StepStats.events`` (and the log).  Append strings to
    ``self._events``."""

    def drain_events(self) -> List[str]:
        ev = getattr(self, "_events", None)
        if not ev:
            return []
        self._events = []
        return ev
