"""Gradients in, averages out: what every collective does before encoding and after
decoding, whatever it sends.

In: a missing gradient counts as zeros, a sparse one is densified, and each is divided by
``predivide`` (Horovod's gradient_predivide_factor).  Out: the compressor turns the sum of
the decoded contributions into the average (``finalize``), multiplied back by the world size
for op=Sum and by ``predivide``; the NaN policy makes a tensor that was non-finite on any
rank (or whose average overflowed) NaN on every rank and names it in ``StepStats.nonfinite``.
"""
from __future__ import annotations

from typing import Dict

import torch

from ..compressors import TensorKey
from ..compressors.state import finite as all_finite
from .plan import Entry
from .stats import StepStats

__all__ = ["Averaging"]


class Averaging:
    """size: world size; average: False for op=Sum; predivide: Horovod's
    gradient_predivide_factor (1.0: none).

    Keeps one float32 accumulator per tensor, reused from step to step (a fresh gradient-
    sized allocation every step costs a page fault per 4 KiB): a step's results are valid
    until the next step.
    """

    def __init__(self, size: int, average: bool = True, predivide: float = 1.0):
        self.size = size
        self.average = average
        self.predivide = float(predivide)
        self._accs: Dict[str, torch.Tensor] = {}

    def gradient(self, e: Entry) -> torch.Tensor:
        """``e``'s gradient as the compressor gets it (zeros if None, dense, predivided)."""
        g = e.param.grad
        if g is None:
            g = torch.zeros_like(e.param)
        if g.is_sparse:
            g = g.to_dense()
        if self.predivide != 1.0:
            g = g / self.predivide
        return g

    def accumulator(self, e: Entry) -> torch.Tensor:
        """A zeroed flat float32 accumulator for ``e`` on its parameter's device."""
        acc = self._accs.get(e.name)
        if acc is None or acc.device != e.param.device:
            acc = torch.zeros(e.param.numel(), dtype=torch.float32, device=e.param.device)
            self._accs[e.name] = acc
        else:
            acc.zero_()
        return acc

    def finish(self, e: Entry, acc: torch.Tensor, finite: bool, key: TensorKey,
               stats: StepStats) -> torch.Tensor:
        """The result of ``e`` from ``acc`` (the sum of every rank's contribution, in place):
        averaged (``finite``: no rank's message was NONFINITE), or NaN (NaN policy)."""
        if finite:
            e.compressor.finalize(acc, key)
            if not self.average:
                acc.mul_(self.size)
            if self.predivide != 1.0:
                acc.mul_(self.predivide)
            finite = all_finite(acc)
        if not finite:
            acc.fill_(float("nan"))
            stats.nonfinite.append(e.name)
        return acc

    def clear(self) -> None:
        """Free the accumulators."""
        self._accs.clear()
