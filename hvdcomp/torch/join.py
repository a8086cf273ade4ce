"""``hvdcomp.torch.join``: Horovod's ``hvd.join()`` for the open hvdcomp optimizers."""
from __future__ import annotations

import threading
import weakref
from typing import Dict

import numpy as np

__all__ = ["join", "register", "live"]

#: The open DistributedOptimizers by creation number (what join() drives).
_live: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()


def register(ident: int, optimizer) -> None:
    """Make ``optimizer`` (number ``ident``) one that :func:`join` takes part for."""
    _live[ident] = optimizer


def live() -> list:
    """The open hvdcomp DistributedOptimizers, oldest first."""
    return [o for _, o in sorted(_live.items()) if not o._closed]


def join(device: int = -1) -> int:
    """``hvd.join()`` for hvdcomp: call it on a rank that has run out of data, and on every
    rank once it is done.  Until every rank has joined, this rank takes part in the other
    ranks' steps of every open hvdcomp DistributedOptimizer, each in a thread of its own,
    contributing no gradients: their averages count only the ranks that have not joined
    (as Horovod's join does).  Returns the highest rank among those that joined last.

    Without open hvdcomp optimizers it is horovod.torch.join(device).  While some rank
    waits here, the other ranks may only step their hvdcomp optimizers (a Horovod
    collective of their own, e.g. ``hvd.allreduce`` of a metric, waits for the joined
    ranks).  Compressors whose receivers keep per-rank state or need every rank's message
    (LAQ, NDQSG) raise ValueError on every rank in the first step a rank sits out; the
    optimizers' exceptions are re-raised here.
    """
    opts = live()
    if not opts:
        import horovod.torch as hvd
        return hvd.join(device)
    rounds: Dict[int, int] = {}
    errors = []

    def run(i, opt):
        try:
            rounds[i] = opt._join_rounds()
        except BaseException as e:     # noqa: BLE001 - re-raised below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i, o), name=f"hvdcomp-join-{i}")
               for i, o in enumerate(opts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    ex = opts[0]._exchange
    last = np.zeros(ex.size)
    last[ex.rank] = 1.0 if rounds[0] == 0 else 0.0
    return int(np.flatnonzero(ex.transport.allreduce_sum(last))[-1])
