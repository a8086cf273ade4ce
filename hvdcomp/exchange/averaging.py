"""Gradients in, averages out: what every collective does before encoding and after
decoding, whatever it sends.

In: a missing gradient is absent (the rank sends nothing for it), a sparse one is densified
with ``sparse_as_dense`` and sent as indices and values otherwise (:mod:`.coo`), and each is
divided by ``predivide`` (Horovod's gradient_predivide_factor); a rank that has joined
(``hvd.join()``) has no gradients at all.  Out: the compressor turns the sum of the
contributions into the average (``finalize``), over the ranks that had not joined, then
multiplied by that count for op=Sum and by ``predivide``; the NaN policy makes a tensor that
was non-finite on any rank (or whose average overflowed) NaN on every rank and names it in
``StepStats.nonfinite``.

Who counts: a tensor that no rank has a gradient for has no average (its ``p.grad`` stays
None); one that some ranks lack counts zeros from those ranks (the average divides by every
rank that has not joined), except for compressors whose receivers keep per-rank state
(``Compressor.absent_rank`` ABSENT_LAST, LAQ: the absent rank's last upload stands, as when
its lazy rule skips; a joined rank cannot be left out) or need every rank's message
(ABSENT_REFUSE, NDQSG: a clear error).

Casts never lose range (:meth:`Averaging.cast_fallback`, :meth:`Averaging.combine`): a
cast of a finite gradient that would overflow its wire dtype is sent as the gradient's own
values instead (``none``), and a float32 sum that overflows although every contribution was
finite is summed again with each contribution divided by the world size first.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ..compressors import ABSENT_LAST, ABSENT_ZEROS, Compressor, TensorKey, get
from ..compressors.state import finite as all_finite
from ..ops import divide, divide_
from ..wire import Message
from .plan import Entry
from .step_stats import StepStats

__all__ = ["Averaging"]


class Averaging:
    """size: world size; average: False for op=Sum; predivide: Horovod's
    gradient_predivide_factor (1.0: none); sparse_as_dense: densify sparse gradients before
    they are sent (else they travel as indices and values).

    ``joined``: set before a step in which this rank contributes nothing (``hvd.join()``).

    Keeps one float32 accumulator per tensor, reused from step to step (a fresh gradient-
    sized allocation every step costs a page fault per 4 KiB): a step's results are valid
    until the next step.
    """

    def __init__(self, size: int, average: bool = True, predivide: float = 1.0,
                 sparse_as_dense: bool = False):
        self.size = size
        self.average = average
        self.predivide = float(predivide)
        self.sparse_as_dense = bool(sparse_as_dense)
        self.joined = False
        self._accs: Dict[str, torch.Tensor] = {}
        self._none = get("none")

    def gradient(self, e: Entry, grads: Optional[Dict[str, Optional[torch.Tensor]]] = None
                 ) -> Optional[torch.Tensor]:
        """``e``'s gradient as the compressor gets it: None when absent (no gradient, or
        this rank has joined), dense unless sparse and not ``sparse_as_dense``, predivided.
        ``grads``: {name: gradient, or None when absent} given by the launcher in place of
        ``e.param.grad`` (the DDP hook's views into its bucket); None: ``e.param.grad``."""
        if self.joined:
            g = None
        elif grads is not None and e.name in grads:
            g = grads[e.name]
        else:
            g = e.param.grad
        if g is None:
            return None
        if g.is_sparse and self.sparse_as_dense:
            g = g.to_dense()
        if self.predivide != 1.0:
            g = divide(g, self.predivide)
        return g

    def accumulator(self, e: Entry, out: Optional[torch.Tensor] = None,
                    zero: bool = True) -> torch.Tensor:
        """A zeroed flat float32 accumulator for ``e`` on its parameter's device: ``out``
        (zeroed) when it can serve, i.e. a contiguous float32 tensor of ``e``'s numel on that
        device (the DDP hook's views into its bucket: the average is then written where it
        is wanted, with no copy), else one kept for ``e`` from step to step.  ``zero=False``:
        not zeroed (for a caller that writes every element)."""
        if (out is not None and out.dtype == torch.float32 and out.is_contiguous()
                and out.numel() == e.param.numel() and out.device == e.param.device):
            return out.view(-1).zero_() if zero else out.view(-1)
        acc = self._accs.get(e.name)
        if acc is None or acc.device != e.param.device:
            acc = torch.zeros(e.param.numel(), dtype=torch.float32, device=e.param.device)
            self._accs[e.name] = acc
        elif zero:
            acc.zero_()
        return acc

    # --- casts that keep their range ---------------------------------------------------
    def cast_fallback(self, e: Entry, g: torch.Tensor, key: TensorKey) -> Optional[Message]:
        """For a cast compressor (fp16, bf16) and a finite dense ``g`` whose cast would not
        be finite: a ``none`` message of ``g`` (divided by the world size first when the
        cast is prescaled, as fp16 is) in ``g``'s own dtype; None otherwise."""
        comp = e.compressor
        if comp.wire_dtype is None or not g.is_floating_point() or not all_finite(g):
            return None
        x = g.detach()
        if comp.prescaled:
            x = divide(x.to(torch.float64 if x.dtype == torch.float64 else torch.float32),
                       self.size)
        if all_finite(x.to(comp.wire_dtype)):
            return None
        return self._none.encode(x.to(g.dtype) if comp.prescaled else x, key)

    # --- out -----------------------------------------------------------------------------
    def combine(self, e: Entry, msgs: Sequence[Optional[Message]], keys: List[TensorKey],
                present: Sequence[bool], acc: torch.Tensor, joined: int = 0
                ) -> Tuple[bool, bool]:
        """Decode the messages of ``e`` (``msgs[r]`` from rank r, ``present[r]`` whether rank
        r had a gradient; at least one did; ``joined`` ranks had joined) into ``acc``.
        Returns (finite, prescaled):
        finite is False if a message was NONFINITE; prescaled is True when ``acc`` holds
        the sum of each contribution divided by the world size (the overflow rescue, or a
        prescaled compressor), False when it holds the plain sum.  Raises ValueError when
        the compressor cannot leave out an absent rank (module docstring)."""
        comp = e.compressor
        if not all(present) and comp.absent_rank != ABSENT_ZEROS:
            if comp.absent_rank == ABSENT_LAST and not joined:
                # the absent rank's last upload stands
                return comp.combine([m if p else None for m, p in zip(msgs, present)], keys,
                                    acc), comp.prescaled
            raise ValueError(
                f"{comp.name} needs every rank's gradient of {e.name}, but ranks "
                f"{[r for r, p in enumerate(present) if not p]} had none in this step "
                f"(a parameter unused on some ranks only, or ranks that have joined); "
                f"use another compressor for it")
        pairs = [(m, k) for m, k, p in zip(msgs, keys, present) if p]
        if not comp.sends_values:
            return comp.combine([m for m, _ in pairs], [k for _, k in pairs], acc), \
                comp.prescaled
        finite = True
        for m, k in pairs:
            finite &= self._decoder(comp, m, k).decode(m, k, acc)
        if finite and not comp.prescaled and not all_finite(acc):
            # the float32 sum overflowed although every contribution was finite: sum each
            # contribution divided by the world size instead (rank order, as before)
            acc.zero_()
            part = torch.empty_like(acc)
            for m, k in pairs:
                part.zero_()
                self._decoder(comp, m, k).decode(m, k, part)
                acc.add_(divide_(part, self.size))
            return True, True
        return finite, comp.prescaled

    def _decoder(self, comp: Compressor, msg: Optional[Message], key: TensorKey) -> Compressor:
        if msg is None:
            comp._require_message(msg, key)         # raises WireFormatError
        if msg.codec == self._none.codec and comp.wire_dtype is not None:
            return self._none                       # a cast's fallback (cast_fallback)
        return comp

    def mean(self, e: Entry, acc: torch.Tensor, key: TensorKey, joined: int = 0,
             prescaled: Optional[bool] = None) -> None:
        """Turn ``acc``, the sum of ``e``'s finite contributions (``prescaled``, default the
        compressor's: each divided by the world size), into their average over the
        ``size - joined`` ranks that had not joined, in place (``Compressor.finalize``)."""
        prescaled = e.compressor.prescaled if prescaled is None else prescaled
        n = self.size - joined
        if prescaled:
            if n != self.size:
                acc.mul_(self.size / n)
        else:
            e.compressor.finalize(acc, key if n == self.size
                                  else dataclasses.replace(key, world_size=n))

    def finish(self, e: Entry, acc: torch.Tensor, finite: bool, key: TensorKey,
               stats: StepStats, joined: int = 0, prescaled: Optional[bool] = None,
               averaged: bool = False) -> torch.Tensor:
        """The result of ``e`` from ``acc`` (in place), ``joined`` ranks having joined:
        acc holds the sum of the contributions (:meth:`mean`), or with ``averaged`` already
        their average (as the reduce-scatter delivers it); averaged over the
        ``size - joined`` ranks that contribute (``finite``: no rank's message was
        NONFINITE), times that count for op=Sum and ``predivide``, or NaN (NaN policy)."""
        n = self.size - joined
        if finite:
            if not averaged:
                self.mean(e, acc, key, joined, prescaled)
            if not self.average:
                acc.mul_(n)
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
