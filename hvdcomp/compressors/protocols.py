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
* :class:`SummedRounds`: no per-rank wire messages; the tensors are summed across ranks by
  allreduces in rounds, with local computation between them (PowerSGD, Vogels et al. 2019,
  Algorithm 1: P summed, orthogonalized, then Q summed).
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import numpy as np
import torch

__all__ = ["AdaptiveLevels", "MomentumCorrection", "ParamDeltas", "ReportsEvents",
           "SummedRounds"]


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


class SummedRounds:
    """The compressor's tensors are summed across ranks in rounds, by allreduces of float32
    buffers with local computation in between, instead of travelling as per-rank wire
    messages (``encode`` raises TypeError).  The exchange core
    (:mod:`hvdcomp.exchange.rounds`) runs the rounds of all such tensors of a fusion bucket
    (or DDP bucket) together, fusing each round's buffers into one allreduce, and calls,
    on every rank, for every such tensor, with the tensor's key of this rank
    (``key.shape`` is the parameter's shape, ``key.step`` the step):

    1. ``round_sizes(shape, step)``: the float32 elements the tensor adds to each round's
       buffer (a tuple; one entry per round; every rank computes the same);
    2. ``first_round(grad, key, out)``: write this rank's contribution to round 0 into
       ``out`` (a zeroed flat float32 view of ``round_sizes[0]`` elements); ``grad`` is None
       where this rank contributes nothing (no gradient, a non-finite one, a rank that has
       joined or is failing): ``out`` stays zero, but the rounds still run on this rank;
    3. ``next_round(i, summed, key, out)`` for i = 1 .. len(round_sizes) - 1:
       ``summed`` is the tensor's part of round i - 1's sum over ranks (the same on every
       rank), ``out`` this rank's zeroed part of round i;
    4. ``last_round(summed, key, acc)``: from the last round's sum, write the sum of the
       ranks' contributions into ``acc`` (flat float32, the parameter's numel, not zeroed:
       every element must be written); then the
       core averages it (``finalize``, where the compressor may commit the step's state:
       it is called only for a finite result).

    A tensor that no rank has a gradient for, or that is non-finite on some rank (the
    counts summed with round 0 say so on every rank), skips the later rounds (zeros are
    sent in its place) and gets no ``last_round`` nor ``finalize``: the step's work is
    forgotten at the next ``first_round`` and the state stays as it was.
    """

    def round_sizes(self, shape: Tuple[int, ...], step: int) -> Tuple[int, ...]:
        raise NotImplementedError

    def sizes_vary(self, shape: Tuple[int, ...]) -> bool:
        """Whether ``round_sizes(shape, step)`` can differ between two steps (then, with an
        allreduce carrier, the core sums the ranks' step codes before the rounds, so that
        ranks out of step raise OutOfStep instead of handing the carrier buffers of
        different sizes).  Default True."""
        return True

    def first_round(self, grad: Optional[torch.Tensor], key, out: torch.Tensor) -> None:
        raise NotImplementedError

    def next_round(self, i: int, summed: torch.Tensor, key, out: torch.Tensor) -> None:
        raise NotImplementedError

    def last_round(self, summed: torch.Tensor, key, acc: torch.Tensor) -> None:
        raise NotImplementedError
