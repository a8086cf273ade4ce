"""hvdcomp's messages: every one goes through ``logging.getLogger("hvdcomp")``.

Nothing in the library prints.  What it says, and at which level:

* INFO, on rank 0 only: start-up facts (the transport chosen and why, whether MPI is
  CUDA-aware when a model has CUDA parameters, ``Auto``'s plan and measured cost model).
* WARNING: things that change what is computed or how fast: a device without a kernel
  backend (the PyTorch reference runs instead), compressor events (NDQSG's side
  information too far off, LAQ state anomalies), rate-limited per kind of event
  (:func:`warn_limited`).

Python shows WARNING and above on stderr when the application configured no logging (the
"last resort" handler); INFO needs ``logging.basicConfig(level=logging.INFO)`` or a handler
on the "hvdcomp" logger (the main job, examples/train_mnist.py, sets one up on rank 0).
"""
from __future__ import annotations

import logging
import re
import threading
import time
from typing import Dict, List

__all__ = ["logger", "warn_limited", "RateLimit"]

logger = logging.getLogger("hvdcomp")


class RateLimit:
    """Which messages of one kind to let through: the first ``burst`` of a kind, then at
    most one per ``interval`` seconds, which then says how many were held back since.

    The kind of a message is its text with every number replaced by ``#`` (so
    "ndqsg: ... in 3 of 40 buckets of rank 2 (step 7 ...)" and the same at step 8 are one
    kind).  Thread-safe (the exchange decodes on a worker thread)."""

    def __init__(self, burst: int = 3, interval: float = 60.0, clock=time.monotonic):
        self.burst, self.interval, self.clock = int(burst), float(interval), clock
        self._seen: Dict[str, List[float]] = {}     # kind -> [count, last shown, held back]
        self._lock = threading.Lock()

    @staticmethod
    def kind(text: str) -> str:
        return re.sub(r"[-+]?\d+(\.\d*)?([eE][-+]?\d+)?", "#", text)

    def admit(self, text: str) -> str:
        """The text to log for ``text`` ("" to hold it back)."""
        k = self.kind(text)
        now = self.clock()
        with self._lock:
            s = self._seen.setdefault(k, [0, -float("inf"), 0])
            s[0] += 1
            if s[0] <= self.burst:
                s[1] = now
                if s[0] == self.burst:
                    return (text + f" (further messages like this: at most one per "
                                   f"{self.interval:g} s)")
                return text
            if now - s[1] >= self.interval:
                held, s[1], s[2] = int(s[2]), now, 0
                return (text + f" ({held} similar held back since the last one)"
                        if held else text)
            s[2] += 1
            return ""


_events = RateLimit()


def warn_limited(text: str, limit: RateLimit = None) -> bool:
    """Log ``text`` at WARNING on the "hvdcomp" logger unless its kind was logged too often
    (:class:`RateLimit`: the first 3 of a kind, then one per minute).  Returns whether it
    was logged."""
    shown = (limit or _events).admit(text)
    if shown:
        logger.warning(shown)
    return bool(shown)
