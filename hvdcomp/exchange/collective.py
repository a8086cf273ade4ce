"""Collectives: how one fusion bucket's gradients become every rank's averages.

:class:`Collective` is what the pipeline (:mod:`hvdcomp.exchange.pipeline`) drives;
:class:`Allgather` is the one in use: every rank's messages go to every rank, which decodes
them in rank order (the same float32 order on every rank, so every rank holds the same
average, bit for bit), and summable tensors go through an
:class:`~hvdcomp.transport.Allreduce` carrier when there is one.

Every rank learns, in the collectives it already makes, which ranks had which gradient
and which ranks had joined: frames carry a presence bitmap and a JOINED flag
(:mod:`hvdcomp.transport.framing`), summed buffers end with counts (:mod:`.sums`).

Every collective of a step also carries the step: frames carry its :class:`Stamp` (step,
exchange id, SYNC flag), and each summed buffer ends with one slot per rank, where only
that rank writes a small code of its step (:func:`.sums.slot_code`; 0: the rank has failed and is
stopping).  Every rank checks them, so ranks that fell out of step, or a rank that stops,
raise on every rank at the first collective where it happens.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

import torch

from ..errors import RankFailure, WireFormatError
from ..log import warn_limited
from ..transport import Allreduce, Incoming, Outgoing, Stamp, Transport
from ..transport.framing import STOP_MARK
from ..wire import Message
from . import coo
from .averaging import Averaging
from .frames import drain_events, frame, observe
from .plan import Entry, wire_dtype
from .rounds import Rounds, RoundsJob
from .step_stats import StepStats
from .sums import Sum, Sums

__all__ = ["Collective", "Allgather"]

class Collective:
    """Three stages per fusion bucket.  For every bucket ``k`` of every step, in bucket
    order, on every rank, the pipeline calls

        job = encode(k, entries, step, stats, sync, grads)   on its encode thread
        communicate(job, stats)                        on its communicate thread
        decode(job, stats, out) -> {name: average}     on its decode thread

    so that bucket k is on the wire while k+1 is being encoded and k-1 decoded.  ``entries``
    are the bucket's :class:`~hvdcomp.exchange.plan.Entry` objects; ``grads`` is None (each
    entry's gradient is its parameter's ``grad``) or {name: gradient, None when absent} (the
    DDP hook's views into its bucket: :meth:`hvdcomp.exchange.Exchange.call`); ``job`` is the
    collective's own per-bucket state; ``decode`` returns each tensor's average as a flat
    float32 tensor on the parameter's device (it may be reused by the next step), written
    into ``out[name]`` where ``out`` (None, or {name: tensor}) has a contiguous float32
    tensor of the parameter's numel there (the DDP hook's views into its bucket; a
    collective may ignore ``out``: the caller copies what is not already there).  ``stats``
    is the step's :class:`~hvdcomp.exchange.step_stats.StepStats`: a collective adds what
    it sends (``bytes_sent``, ``traffic_bytes``), ``events``, ``nonfinite`` and ``joined``;
    the pipeline records the compressors, ``fp32_bytes`` and the stage timings.

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

    #: Set (to the text other ranks should see) when this rank is stopping after an error
    #: (:mod:`hvdcomp.exchange.shutdown`): from then on ``encode`` sends error marks
    #: instead of gradients, and every rank's ``communicate`` raises.
    failing: Optional[str] = None
    #: Some collective of this exchange carried a rank's error marks (an error frame, a
    #: failing rank's slot): every rank saw them and raised.
    failure_seen: bool = False

    def encode(self, k: int, entries: Sequence[Entry], step: int, stats: StepStats,
               sync: bool = False, grads: Optional[Dict[str, Optional[torch.Tensor]]] = None,
               failure: Optional[BaseException] = None) -> Any:
        """``sync``: the step was started by synchronize()/step(), not by backward.
        ``grads``: {name: gradient or None} instead of each parameter's ``.grad``.
        ``failure``: this rank failed before encoding; the bucket's collectives still run,
        carrying this rank's error marks, and ``communicate`` raises on every rank."""
        raise NotImplementedError

    def communicate(self, job: Any, stats: StepStats) -> None:
        raise NotImplementedError

    def decode(self, job: Any, stats: StepStats,
               out: Optional[Dict[str, torch.Tensor]] = None) -> Dict[str, torch.Tensor]:
        raise NotImplementedError

    def close(self) -> None:
        """Free buffers kept from step to step."""


@dataclass
class _Job:
    k: int
    step: int
    sync: bool
    messages: List[Entry]                  # wire messages, in this order in the frame
    out: Optional[Outgoing]                # their frame (None: no wire part)
    sums: List[Sum] = field(default_factory=list)
    incoming: Optional[Incoming] = None
    sparse: List[Entry] = field(default_factory=list)   # summed tensors sparse somewhere
    sparse_in: Optional[Incoming] = None
    grads: Optional[Dict[str, Optional[torch.Tensor]]] = None   # None: each param.grad
    failure: Optional[BaseException] = None      # this rank failed before encoding
    rounds: Optional[RoundsJob] = None           # tensors summed in rounds (.rounds)


class Allgather(Collective):
    """Every rank's messages to every rank (``transport.exchange``, one frame per rank and
    bucket); decoded by every rank in rank order and averaged in float32.  Summable tensors
    (``Entry.allreduce``) are cast, flattened per wire dtype and summed by ``allreduce``
    (started in the encode stage, waited for in the communicate stage), each buffer followed
    by counts that every rank reads the same: per tensor the ranks that had a dense
    gradient, a sparse one and a non-finite one, then the ranks that had joined.  Tensors
    that are sparse somewhere then travel as indices and values in a second allgather;
    tensors whose sum overflowed although every rank's gradient was finite are summed
    again in float32, each rank's gradient divided by the world size first.  Tensors whose
    compressor sums in rounds (``Entry.rounds``: PowerSGD) go through :mod:`.rounds`.

    transport: the byte carrier; allreduce: the summable carrier or None; averaging:
    gradients in and averages out; seed: the shared seed of the tensor keys; ident: the
    exchange's id in the frames' stamps (the same on every rank).
    """

    def __init__(self, transport: Transport, allreduce: Optional[Allreduce],
                 averaging: Averaging, seed: int, ident: int = 0):
        self.transport = transport
        self.allreduce = allreduce
        self.averaging = averaging
        self.rank, self.size, self.seed = transport.rank, transport.size, seed
        self.ident = int(ident) & 0xFFFFFFFF
        self.sums = Sums(allreduce, averaging, self.rank, self.size, self.ident)
        self.rounds = Rounds(transport, allreduce, averaging, seed, self.ident)

    def encode(self, k, entries, step, stats, sync=False, grads=None, failure=None):
        """Start the sums of the summable tensors, encode the others into one frame (an
        encoder error becomes an error frame; so does everything once ``failing``, or with
        ``failure``: then the sums carry this rank's failure slot, so that every rank
        raises in ``communicate``, this one ``failure``)."""
        if failure is not None:
            grads = {e.name: None for e in entries}
        job = _Job(k, step, bool(sync),
                   [e for e in entries if not e.allreduce and not e.rounds], None,
                   grads=grads, failure=failure)
        failing = self.failing
        by_dtype: Dict[torch.dtype, List[Entry]] = {}
        for e in entries:
            if e.allreduce:
                by_dtype.setdefault(wire_dtype(e.compressor), []).append(e)
        for dt, es in by_dtype.items():
            job.sums.append(self.sums.start(k, dt, es, job,
                                            failing is not None or failure is not None))
        in_rounds = [e for e in entries if e.rounds]
        if in_rounds:
            job.rounds = self.rounds.encode(k, in_rounds, job,
                                            failing is not None or failure is not None)
        if job.messages:
            if failing is not None:
                job.out = Outgoing.failed(RankFailure(failing, self.rank), STOP_MARK + failing)
                return job
            if failure is not None:
                job.out = Outgoing.failed(failure)
                return job
            try:
                job.out = self._frame(job.messages, job)
            except Exception as exc:          # noqa: BLE001 - re-raised on all ranks
                job.out = Outgoing.failed(exc)
        return job

    def communicate(self, job, stats):
        """Exchange the frame and wait for the sums, then (every rank alike, from the
        counts) sum again what overflowed and gather the sparse tensors.  Raises on every
        rank if some rank failed to encode the bucket (transport.exchange), or if a tensor
        is sparse on some ranks and dense on others."""
        for s in job.sums:
            nbytes = s.flat.numel() * s.flat.element_size()
            stats.bytes_sent += nbytes
            stats.traffic_bytes += 2 * (self.size - 1) / self.size * nbytes
        try:
            if job.messages:
                names = [e.name for e in job.messages]
                try:
                    job.incoming = self.transport.exchange(
                        job.out, what=f"bucket {job.k} of step {job.step} (tensors {names})")
                except BaseException as e:
                    if job.out.failure is not None or isinstance(e, RankFailure):
                        self.failure_seen = True        # an error frame: every rank saw it
                    raise
                stats.bytes_sent += len(job.out)
                stats.recv_bytes += sum(job.incoming.nbytes) - len(job.out)
                stats.traffic_bytes += (self.size - 1) / self.size * sum(job.incoming.nbytes)
            if job.rounds is not None:
                self.rounds.communicate(job.rounds, job)
        finally:
            for s in job.sums:
                self.allreduce.wait(s.handle)
            if job.rounds is not None:
                self.rounds.wait(job.rounds)
        if job.rounds is not None:
            if any(0 in s.slots for s in job.rounds.all_sums):
                self.failure_seen = True
            self.rounds.check(job.rounds, job, stats)
        for s in job.sums:
            if 0 in s.slots:                    # a failing rank's marks: every rank sees them
                self.failure_seen = True
            self.sums.check(s, job)
        for i, s in enumerate(job.sums):
            self.sums.again(job.k, i, s, stats, job.grads)
            counts = s.counts
            for j, (e, _) in enumerate(s.groups):
                dense, sparse = counts[3 * j] > 0, counts[3 * j + 1] > 0
                if sparse and dense:
                    raise RuntimeError(f"hvdcomp: the gradient of {e.name} is sparse on some "
                                       f"ranks and dense on others")
                if sparse:
                    job.sparse.append(e)
        if job.sparse:
            out = self._frame(job.sparse, job)
            job.sparse_in = self.transport.exchange(
                out, what=f"bucket {job.k} (sparse {[e.name for e in job.sparse]})")
            stats.bytes_sent += len(out)
            stats.traffic_bytes += (self.size - 1) / self.size * sum(job.sparse_in.nbytes)

    def decode(self, job, stats, out=None):
        """Every rank's messages decoded in rank order (``Compressor.combine``) and
        averaged; the sums unflattened and averaged (each into ``out[name]`` where it can
        serve: :meth:`Averaging.accumulator`)."""
        dest = out or {}
        out = {}
        for s in job.sums:
            counts = s.counts
            joined = int(round(float(counts[-1])))
            stats.joined = max(stats.joined, joined)
            off = 0
            for j, (e, n) in enumerate(s.groups):
                sl = s.flat[off:off + n]
                off += n
                if counts[3 * j] == 0:         # no dense gradient anywhere: sparse or absent
                    continue
                prescaled = None
                if e.name in s.fallback:
                    acc, prescaled = s.fallback[e.name], True
                else:
                    acc = (sl.to(torch.float32).clone() if e.name not in dest else
                           self.averaging.accumulator(e, dest[e.name]).copy_(sl))
                out[e.name] = self.averaging.finish(e, acc, True, self._key(e, job.step),
                                                    stats, joined, prescaled)
        if job.rounds is not None:
            out.update(self.rounds.decode(job.rounds, stats, dest))
        if job.sparse:
            out.update(self._decode_frames(job.sparse, job.sparse_in, job.step, stats))
        if job.messages:
            out.update(self._decode_frames(job.messages, job.incoming, job.step, stats,
                                           dest))
        return out

    def close(self):
        self.averaging.clear()

    def _key(self, e: Entry, step: int):
        return e.key(step, self.rank, self.size, self.seed)

    # --- frames ---------------------------------------------------------------------------
    def _frame(self, entries: Sequence[Entry], job: _Job) -> Outgoing:
        """This rank's frame for ``entries``: a message per tensor it has a gradient for."""
        return frame(entries, lambda e: self.averaging.gradient(e, job.grads),
                     lambda e, g: self._encode(e, g, job.step), self.averaging.joined,
                     Stamp(job.step, self.ident, job.sync))

    def _encode(self, e: Entry, g: torch.Tensor, step: int) -> Optional[Message]:
        """This rank's message for ``e`` (None: a skipped upload): sparse gradients as
        indices and values, a cast that would overflow as the gradient itself; an adaptive
        compressor observes the finite gradients of the steps it collects statistics in."""
        key = self._key(e, step)
        if g.is_sparse:
            return coo.encode(g, key)
        fallback = self.averaging.cast_fallback(e, g, key)
        if fallback is not None:
            return fallback
        observe(e.compressor, g, step)
        return e.compressor.encode(g, key)

    def _decode_frames(self, entries: Sequence[Entry], incoming: Incoming, step: int,
                       stats: StepStats, dest: Optional[Dict[str, torch.Tensor]] = None
                       ) -> Dict[str, torch.Tensor]:
        out = {}
        joined = sum(incoming.joined)
        stats.joined = max(stats.joined, joined)
        for i, e in enumerate(entries):
            present = incoming.present(i)
            if not any(present):               # no rank had a gradient: no average
                continue
            msgs = incoming.messages(i)
            keys = [e.key(step, r, self.size, self.seed) for r in range(self.size)]
            if any(m is not None and m.codec == coo.CODEC for m in msgs):
                out[e.name] = self._sparse_average(e, msgs, keys, present, joined, stats)
                continue
            acc = self.averaging.accumulator(e, dest.get(e.name) if dest else None)
            finite, prescaled = self.averaging.combine(e, msgs, keys, present, acc, joined)
            events = drain_events(e.compressor, e.name)
            stats.events.extend(events)
            if self.rank == 0:         # every rank decodes the same messages: same events
                for ev in events:
                    warn_limited(ev)
            out[e.name] = self.averaging.finish(e, acc, finite, keys[self.rank], stats, joined,
                                                prescaled)
        return out

    def _sparse_average(self, e, msgs, keys, present, joined, stats) -> torch.Tensor:
        got = [(m, k) for m, k, p in zip(msgs, keys, present) if p]
        if any(m is None or m.codec != coo.CODEC for m, _ in got):
            raise WireFormatError(f"the gradient of {e.name} is sparse on some ranks and "
                                  f"dense on others")
        av = self.averaging
        divisor = (self.size - joined if av.average else 1) / av.predivide
        res, finite = coo.combine([m for m, _ in got], [k for _, k in got],
                                  tuple(e.param.shape), e.param.dtype, divisor, e.param.device)
        if not finite:
            stats.nonfinite.append(e.name)
        return res
