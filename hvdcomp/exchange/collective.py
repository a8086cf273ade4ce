"""Collectives: how one fusion bucket's gradients become every rank's averages.

:class:`Collective` is what the pipeline (:mod:`hvdcomp.exchange.pipeline`) drives;
:class:`Allgather` is the one in use: every rank's messages go to every rank, which decodes
them in rank order (the same float32 order on every rank, so every rank holds the same
average, bit for bit), and summable tensors go through an
:class:`~hvdcomp.transport.Allreduce` carrier when there is one.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from ..compressors.protocols import AdaptiveLevels, ReportsEvents
from ..compressors.state import finite as all_finite
from ..transport import Allreduce, Incoming, Outgoing, Transport
from ..wire import Message
from .averaging import Averaging
from .plan import Entry, wire_dtype
from .stats import StepStats

__all__ = ["Collective", "Allgather"]


class Collective:
    """Three stages per fusion bucket.  For every bucket ``k`` of every step, in bucket
    order, on every rank, the pipeline calls

        job = encode(k, entries, step, stats)   on its encode thread
        communicate(job, stats)                 on its communicate thread
        decode(job, stats) -> {name: average}   on its decode thread

    so that bucket k is on the wire while k+1 is being encoded and k-1 decoded.  ``entries``
    are the bucket's :class:`~hvdcomp.exchange.plan.Entry` objects; ``job`` is the
    collective's own per-bucket state; ``decode`` returns each tensor's average as a flat
    float32 tensor on the parameter's device (it may be reused by the next step).  ``stats``
    is the step's :class:`~hvdcomp.exchange.stats.StepStats`: a collective adds what it sends
    (``bytes_sent``, ``traffic_bytes``), ``events`` and ``nonfinite``; the pipeline records
    the compressors, ``fp32_bytes`` and the stage timings.

    The rules that keep every rank in step:

    * Every collective call happens in ``communicate`` (or is started asynchronously in
      ``encode`` and waited for in ``communicate``), and every rank makes the same calls for
      every bucket, whatever happened elsewhere: ``encode`` runs even after an error earlier
      in the step, and an encoder error is sent (an error frame:
      :meth:`hvdcomp.transport.Outgoing.failed`), not skipped, so that ``communicate``
      raises it on every rank.  Where ``encode`` itself raises, the pipeline skips the
      bucket's ``communicate`` on this rank.
    * ``decode`` is local work only: the pipeline skips it after any error of the step.

    A reduce-scatter collective plugs in here without changing the pipeline: ``encode``
    splits the bucket into N shards and encodes shard j for rank j; ``communicate`` sends
    shard j to rank j (an alltoallv), decodes every rank's messages for its own shard,
    averages them, re-encodes the average and allgathers it; ``decode`` decodes every
    rank's averaged shard into the bucket's results.  Each rank then sends about 2/N of its
    compressed gradient instead of all of it to all.
    """

    def encode(self, k: int, entries: Sequence[Entry], step: int, stats: StepStats) -> Any:
        raise NotImplementedError

    def communicate(self, job: Any, stats: StepStats) -> None:
        raise NotImplementedError

    def decode(self, job: Any, stats: StepStats) -> Dict[str, torch.Tensor]:
        raise NotImplementedError

    def close(self) -> None:
        """Free buffers kept from step to step."""


@dataclass
class _Job:
    k: int
    step: int
    messages: List[Entry]                  # wire messages, in this order in the frame
    out: Optional[Outgoing]                # their frame (None: no wire part)
    sums: List[Tuple[Any, torch.Tensor, List[Tuple[Entry, int]]]] = field(default_factory=list)
    incoming: Optional[Incoming] = None


class Allgather(Collective):
    """Every rank's messages to every rank (``transport.exchange``, one frame per rank and
    bucket); decoded by every rank in rank order and averaged in float32.  Summable tensors
    (``Entry.allreduce``) are cast, flattened per wire dtype and summed by ``allreduce``
    (started in the encode stage, waited for in the communicate stage).

    transport: the byte carrier; allreduce: the summable carrier or None; averaging:
    gradients in and averages out; seed: the shared seed of the tensor keys.
    """

    def __init__(self, transport: Transport, allreduce: Optional[Allreduce],
                 averaging: Averaging, seed: int):
        self.transport = transport
        self.allreduce = allreduce
        self.averaging = averaging
        self.rank, self.size, self.seed = transport.rank, transport.size, seed

    def encode(self, k, entries, step, stats):
        """Start the sums of the summable tensors, encode the others into one frame (an
        encoder error becomes an error frame)."""
        job = _Job(k, step, [e for e in entries if not e.allreduce], None)
        by_dtype: Dict[torch.dtype, List[Entry]] = {}
        for e in entries:
            if e.allreduce:
                by_dtype.setdefault(wire_dtype(e.compressor), []).append(e)
        for dt, es in by_dtype.items():
            job.sums.append(self._start_sum(k, dt, es))
        if job.messages:
            try:
                job.out = Outgoing([self._encode(e, step) for e in job.messages])
            except Exception as exc:          # noqa: BLE001 - re-raised on all ranks
                job.out = Outgoing.failed(exc)
        return job

    def communicate(self, job, stats):
        """Exchange the frame and wait for the sums; raises on every rank if some rank
        failed to encode the bucket (transport.exchange)."""
        for _, flat, _ in job.sums:
            nbytes = flat.numel() * flat.element_size()
            stats.bytes_sent += nbytes
            stats.traffic_bytes += 2 * (self.size - 1) / self.size * nbytes
        try:
            if job.messages:
                names = [e.name for e in job.messages]
                job.incoming = self.transport.exchange(
                    job.out, what=f"bucket {job.k} (tensors {names})")
                stats.bytes_sent += len(job.out)
                stats.traffic_bytes += (self.size - 1) / self.size * sum(job.incoming.nbytes)
        finally:
            for h, _, _ in job.sums:
                self.allreduce.wait(h)

    def decode(self, job, stats):
        """Every rank's messages decoded in rank order (``Compressor.combine``) and
        averaged; the sums unflattened and averaged."""
        out = {}
        for _, flat, groups in job.sums:
            off = 0
            for e, n in groups:
                acc = flat[off:off + n].to(torch.float32).clone()
                off += n
                out[e.name] = self.averaging.finish(e, acc, True, self._key(e, job.step),
                                                    stats)
        for i, e in enumerate(job.messages):
            acc = self.averaging.accumulator(e)
            keys = [e.key(job.step, r, self.size, self.seed) for r in range(self.size)]
            finite = e.compressor.combine(job.incoming.messages(i), keys, acc)
            if isinstance(e.compressor, ReportsEvents):
                stats.events.extend(f"{e.name}: {ev}" for ev in e.compressor.drain_events())
            out[e.name] = self.averaging.finish(e, acc, finite, keys[self.rank], stats)
        return out

    def close(self):
        self.averaging.clear()

    def _key(self, e: Entry, step: int):
        return e.key(step, self.rank, self.size, self.seed)

    def _encode(self, e: Entry, step: int) -> Optional[Message]:
        """This rank's message for ``e`` (None: a skipped upload); an adaptive compressor
        observes the finite gradients of the steps it collects statistics in."""
        g = self.averaging.gradient(e)
        comp = e.compressor
        if (isinstance(comp, AdaptiveLevels) and comp.wants_stats(step)
                and g.is_floating_point() and all_finite(g)):
            comp.observe(g)
        return comp.encode(g, self._key(e, step))

    def _start_sum(self, k: int, dt: torch.dtype, es: List[Entry]):
        """Flatten the gradients of ``es`` cast to ``dt`` and start their sum."""
        parts, groups = [], []
        for e in es:
            x = self.averaging.gradient(e).reshape(-1).to(torch.float32)
            if e.compressor.prescaled:
                x = x / self.size           # divide before the cast so sums cannot overflow
            parts.append(x.to(dt))
            groups.append((e, x.numel()))
        flat = torch.cat(parts)
        return self.allreduce.start(flat, f"hvdcomp.ar.{k}.{str(dt)[6:]}"), flat, groups
