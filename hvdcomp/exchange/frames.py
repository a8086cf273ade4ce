"""What both collectives do around a frame of wire messages
(:class:`~hvdcomp.exchange.collective.Allgather` per tensor,
:class:`~hvdcomp.exchange.scatter.ReduceScatter` per piece of a shard): build this rank's
frame, let an adaptive compressor observe the gradients it encodes, and collect the events
a compressor reports while decoding.  The frame's byte layout (presence bits, JOINED flag,
stamp) is :mod:`hvdcomp.transport.framing`'s.
"""
from __future__ import annotations

from typing import Callable, Iterable, List, Optional, TypeVar

import numpy as np
import torch

from ..compressors import Compressor
from ..compressors.protocols import AdaptiveLevels, ReportsEvents
from ..compressors.state import finite as all_finite
from ..transport import Outgoing, Stamp
from ..wire import Message

__all__ = ["frame", "observe", "drain_events"]

T = TypeVar("T")


def frame(items: Iterable[T], gradient: Callable[[T], Optional[torch.Tensor]],
          encode: Callable[[T, torch.Tensor], Optional[Message]], joined: bool,
          stamp: Stamp, alloc: Optional[Callable[[int], np.ndarray]] = None) -> Outgoing:
    """This rank's frame for ``items`` (tensors or pieces), in their order: for each, the
    message ``encode(item, g)`` of its gradient ``g = gradient(item)``, or, where ``g`` is
    None (this rank has no gradient for it), no message and a presence bit of 0.
    ``joined``: this rank has joined (``hvd.join``); ``stamp``: its step, exchange id and
    SYNC flag; ``alloc``: where to write the frame (:func:`~hvdcomp.transport.join_frames`).
    Exceptions of ``gradient`` and ``encode`` propagate (the collectives send them as error
    frames)."""
    msgs, present = [], []
    for item in items:
        g = gradient(item)
        present.append(g is not None)
        msgs.append(None if g is None else encode(item, g))
    return Outgoing(msgs, present, joined=joined, stamp=stamp, alloc=alloc)


def observe(comp: Compressor, g: torch.Tensor, step: int) -> None:
    """An adaptive compressor (:class:`~hvdcomp.compressors.protocols.AdaptiveLevels`)
    observes the gradient ``g`` it is about to encode, in the steps it collects statistics
    in, when ``g`` is floating point and finite; any other compressor is left alone."""
    if (isinstance(comp, AdaptiveLevels) and comp.wants_stats(step)
            and g.is_floating_point() and all_finite(g)):
        comp.observe(g)


def drain_events(comp: Compressor, label: str) -> List[str]:
    """The events ``comp`` reported since the last drain
    (:class:`~hvdcomp.compressors.protocols.ReportsEvents`), each as ``"label: event"``;
    [] for a compressor that reports none."""
    if isinstance(comp, ReportsEvents):
        return [f"{label}: {ev}" for ev in comp.drain_events()]
    return []
