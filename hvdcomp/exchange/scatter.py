"""The reduce-scatter collective: shards to their owners, averaged there, re-encoded and
allgathered, so each rank sends and decodes about two compressed gradients' worth whatever
the number of ranks.

Per fusion bucket, with N ranks and the bucket's scattered tensors cut into N shards
(:mod:`hvdcomp.exchange.shards`: along quantization-bucket boundaries), on every rank:

1. encode: each piece of every shard with the tensor's compressor and a key of its own
   (``Piece.key``: this rank, the piece's tensor id), a tensor's N pieces (one per owner)
   in one ``Compressor.encode_pieces`` call (the bucketed quantizers: one kernel launch
   with the pieces' boundaries, so the cost of a piece is its coordinates', not a call's;
   bench/host_kernels.py --pieces); one frame per owner;
2. communicate: frame r to rank r (``Transport.alltoall``); decode the N contributions to
   this rank's own pieces in rank order (``Compressor.combine``, float32), average them
   (``finalize``), re-encode each average with the second-stage compressor and key
   (:func:`~hvdcomp.exchange.shards.second_stage`: the bucketed quantizers with 2 more bits
   and their table refined; ``Piece.key2``: the owner's rank, the piece's second tensor
   id, so an independent Philox stream: unbiased compressors stay unbiased; biased ones
   keep a residual for it by piece name, as DeepSpeed's compressed allreduce does for
   1-bit Adam, Tang et al. 2021);
   allgather the averaged pieces (``Transport.exchange``);
3. decode: every owner's averaged pieces into the tensors' accumulators, a tensor's pieces
   in one ``Compressor.decode_pieces`` call (in owner order: the same bits).

Every rank decodes the same averaged messages, each coordinate from one message, so every
rank holds the same result bit for bit.  With an unbiased compressor Q the result is
unbiased, and its error is that of the second quantization of the average plus the average
of the first ones: E||y - g||^2 = sum_r Var Q_r(g_r) / N^2 + E Var Q2(a), with a the
average of the decoded contributions and Q2 the second stage
(tests/exchange/test_scatter.py checks it).

Bytes per rank, with m1 and m2 the stage-1 and stage-2 messages of one whole gradient (equal
but for the bucketed quantizers, whose m2 has 2 more bits a coordinate): (N-1)/N m1 out in
step 2's all-to-all, m2/N to each of N-1 ranks in the allgather (a ring: (N-1)/N of the N
averaged shards): about (N-1)/N (m1 + m2), against (N-1) m1 for the allgather collective.
Decode work per rank: two gradients' worth, against N.

Training-loop semantics (as the allgather's, :mod:`hvdcomp.exchange.averaging`): stage-1
frames carry each sender's presence bits and JOINED flag.  A rank without a gradient for a
tensor (frozen or unused there, or joined) sends no message for its pieces; an owner
averages the contributions present, counting zeros for ranks absent on some tensor and
leaving out the joined ranks (the average is over ``size - joined``), and marks a piece
absent in its stage-2 frame when no rank had that tensor: such a tensor has no average.
Joined ranks still own their shards: they average and re-encode them like the others.
A sparse gradient (``sparse_as_dense`` off) cannot be cut into dense shards: it is an
encoder error (ValueError naming the tensor and the two ways out), raised on every rank.
A cast (fp16, bf16: only without a summable carrier) keeps its range in both stages
(:meth:`~hvdcomp.exchange.averaging.Averaging.cast_fallback`, the overflow rescue of
:meth:`~hvdcomp.exchange.averaging.Averaging.combine`).

Both stages' frames carry the sender's :class:`~hvdcomp.transport.framing.Stamp` (step,
exchange id, SYNC flag), checked by every receiver: every rank sends a stage-1 frame to
every owner (with no pieces for it, an empty one), so every rank sees every rank's stamp
and ranks out of step raise :class:`~hvdcomp.errors.OutOfStep` on every rank.

Errors (every rank raises, none waits): an encoder error goes out as an error frame to every
owner, and so do the error marks of a rank that is stopping after an error (``failing``,
:mod:`hvdcomp.exchange.shutdown`); every owner receives them, raises a
:class:`~hvdcomp.errors.RankFailure` naming that rank, and still takes part in step 2's
allgather with an error frame.  An owner that cannot decode a shard (a malformed message)
sends an error frame in place of its averaged pieces, so every rank raises in step 2's
allgather (the owner its own exception, the others a RankFailure naming the owner).
Summable tensors and the tensors over the allgather travel through an
:class:`~hvdcomp.exchange.collective.Allgather` that the reduce-scatter holds, in the same
bucket; both build and read their frames with :mod:`.frames`.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch

from ..compressors import Compressor
from ..errors import RankFailure, WireFormatError
from ..log import warn_limited
from ..transport import Allreduce, Incoming, Outgoing, Stamp, Transport
from ..transport.base import raise_failed
from ..transport.framing import STOP_MARK, check_stamps
from .averaging import Averaging
from .collective import Allgather, Collective, _Job
from .frames import frame, observe
from .plan import Entry
from .scatter_owner import ShardOwner
from .shards import Piece, layout

__all__ = ["ReduceScatter"]


@dataclass
class _ScatterJob:
    gather: _Job                                  # the bucket's allgather and sums
    scattered: List[Entry]                        # its tensors over the reduce-scatter
    parts: Optional[List[np.ndarray]] = None      # frame per owner (None: no pieces)
    stamp: Stamp = Stamp()                        # this rank's step, exchange id, SYNC
    failure: Optional[BaseException] = None       # this rank's encoder error
    failure_text: Optional[str] = None            # its error frames' text (a stop mark)
    averaged: Optional[Incoming] = None           # every owner's averaged pieces
    joined: int = 0                               # ranks that had joined (stage-1 flags)
    events: List[str] = field(default_factory=list)


class ReduceScatter(Collective):
    """The reduce-scatter collective (module docstring) for the entries marked ``scatter``;
    the others go through :attr:`allgather`, an
    :class:`~hvdcomp.exchange.collective.Allgather` of the same transport, carriers and
    exchange id, which also holds the exchange's failure state (``failing``,
    ``failure_seen``: one for both parts).

    transport, allreduce, averaging, seed, ident: as Allgather's; buckets: the fusion
    buckets (names); entries: name -> :class:`~hvdcomp.exchange.plan.Entry`; first_id: the
    first tensor id free for the pieces (after the tensors' own).  Raises ValueError on one
    rank.
    """

    def __init__(self, transport: Transport, allreduce: Optional[Allreduce],
                 averaging: Averaging, seed: int, buckets: List[List[str]],
                 entries: Dict[str, Entry], first_id: int, ident: int = 0):
        self.allgather = Allgather(transport, allreduce, averaging, seed, ident)
        self.transport, self.averaging, self.seed = transport, averaging, seed
        self.rank, self.size = transport.rank, transport.size
        self.ident = self.allgather.ident
        if self.size < 2:
            raise ValueError("the reduce-scatter collective needs 2 or more ranks")
        self.entries = entries
        self.layout = layout(buckets, entries, self.size, first_id)
        # per bucket: (tensor name, its pieces as (owner, index in the owner's list, piece)),
        # tensors in bucket order, pieces in owner order (so in increasing flat order)
        self._by_tensor: List[List[Tuple[str, List[Tuple[int, int, Piece]]]]] = []
        for b in self.layout:
            groups: Dict[str, List[Tuple[int, int, Piece]]] = {}
            for r, mine in enumerate(b):
                for i, p in enumerate(mine):
                    groups.setdefault(p.name, []).append((r, i, p))
            self._by_tensor.append(list(groups.items()))
        #: the owner's stage 2 and every rank's decode of its averages (scatter_owner.py)
        self.owner = ShardOwner(entries, averaging, seed, self.rank, self.size)

    # One failure state for both parts (Collective.failing, Collective.failure_seen): the
    # allgather's, set by the pipeline and by either part, read by both.
    failing = property(lambda self: self.allgather.failing,
                       lambda self, text: setattr(self.allgather, "failing", text))
    failure_seen = property(lambda self: self.allgather.failure_seen,
                            lambda self, seen: setattr(self.allgather, "failure_seen", seen))

    def pieces(self) -> List[Piece]:
        """Every piece of every bucket, in bucket and owner order."""
        return [p for b in self.layout for mine in b for p in mine]

    def second_stages(self) -> List[Compressor]:
        """The second-stage compressors that keep state of their own
        (:meth:`~.scatter_owner.ShardOwner.second_stages`)."""
        return self.owner.second_stages()

    # --- the three stages ---------------------------------------------------------------
    def encode(self, k, entries, step, stats, sync=False, grads=None, failure=None):
        """The allgather part, then every piece of the bucket's shards, one frame per owner
        with this rank's presence bits, JOINED flag and stamp (an encoder error becomes an
        error frame to every owner; so does everything once ``failing``, or with
        ``failure``).  ``grads`` (the DDP hook's per-call gradients) is not served: the
        reduce-scatter's buckets are the exchange's own fusion buckets."""
        if grads is not None and any(e.scatter for e in entries):
            raise ValueError("the reduce-scatter collective serves the exchange's own fusion "
                             "buckets (begin/ready/finish), not per-call gradients")
        job = _ScatterJob(self.allgather.encode(k, [e for e in entries if not e.scatter],
                                                step, stats, sync, grads, failure),
                          [e for e in entries if e.scatter],
                          stamp=Stamp(step, self.ident, bool(sync)))
        if not any(self.layout[k]):
            return job
        if failure is not None:
            job.failure = failure
            job.parts = [Outgoing.failed(failure).data] * self.size
            return job
        failing = self.failing
        if failing is not None:
            job.failure = RankFailure(failing, self.rank)
            job.failure_text = STOP_MARK + failing
            job.parts = [Outgoing.failed(job.failure, job.failure_text).data] * self.size
            return job
        try:
            flat = {e.name: self._gradient(e, step) for e in job.scattered}
            msgs = self._encode_pieces(k, flat, step)
            job.parts = [frame(mine, lambda p: flat[p.name], lambda p, g: msgs[p.tensor_id],
                               self.averaging.joined, job.stamp).data
                         for mine in self.layout[k]]
        except Exception as exc:                    # noqa: BLE001 - re-raised on all ranks
            job.failure = exc
            job.parts = [Outgoing.failed(exc).data] * self.size
        return job

    def communicate(self, job, stats):
        """All-to-all of the shards, their averages re-encoded, allgather of the averages;
        then the allgather part.  Every rank makes every call; raises on every rank if any
        rank failed (module docstring)."""
        err = None
        if job.parts is not None:
            try:
                self._scatter(job, stats)
            except BaseException as e:              # noqa: BLE001 - after the allgather part
                err = e
        self.allgather.communicate(job.gather, stats)
        if err is not None:
            raise err

    def decode(self, job, stats, out=None):
        """The allgather part, then every owner's averaged pieces into the accumulators: a
        tensor whose pieces are all absent (no rank had its gradient) has no average.
        ``out``: as the allgather's, for the tensors that take it (the scattered ones go to
        the accumulators)."""
        out = self.allgather.decode(job.gather, stats, out)
        if job.parts is None:
            return out
        stats.joined = max(stats.joined, job.joined)
        stats.events.extend(job.events)
        for ev in job.events:       # each owner drains the events of its own pieces
            warn_limited(ev)
        accs: Dict[str, torch.Tensor] = {}
        finite: Dict[str, bool] = {}
        seen: Dict[str, set] = {e.name: set() for e in job.scattered}
        for name, items in self._by_tensor[job.gather.k]:
            # every owner's averaged piece of this tensor, in owner order
            msgs, keys, spans = [], [], []
            for r, i, p in items:
                seen[name].add(job.averaged.present_of(r, i))
                if not job.averaged.present_of(r, i):
                    continue
                key = p.key2(job.gather.step, self.seed)
                msg = job.averaged.message(r, i)
                if msg is None:
                    raise WireFormatError(f"rank {r} sent an empty message for the "
                                          f"averaged shard {key.name}")
                msgs.append(msg)
                keys.append(key)
                spans.append((p.lo, p.hi))
            if not msgs:
                continue
            e = self.entries[name]
            accs[name] = acc = self.averaging.accumulator(e)
            finite[name] = self.owner.decode_averages(e, msgs, keys, spans, acc)
        for e in job.scattered:
            if len(seen[e.name]) > 1:
                raise WireFormatError(f"the owners disagree on whether any rank had a "
                                      f"gradient of {e.name}")
            if e.name in accs:
                key = e.key(job.gather.step, self.rank, self.size, self.seed)
                out[e.name] = self.averaging.finish(e, accs[e.name], finite[e.name], key,
                                                    stats, job.joined, averaged=True)
        return out

    def close(self):
        self.allgather.close()
        self.owner.close()

    # --- helpers ------------------------------------------------------------------------
    def _gradient(self, e: Entry, step: int) -> Optional[torch.Tensor]:
        """``e``'s gradient as its compressor gets it, flat (None: absent); an adaptive
        compressor observes the whole tensor (its statistics are the same as the
        allgather's).  Raises ValueError for a sparse gradient."""
        g = self.averaging.gradient(e)
        if g is None:
            return None
        if g.is_sparse:
            raise ValueError(f"the gradient of {e.name} is sparse, and the reduce-scatter "
                             f"cuts dense shards: pass sparse_as_dense=True, or "
                             f"collective='allgather' (indices and values to every rank)")
        observe(e.compressor, g, step)
        return g.reshape(-1)

    def _encode_pieces(self, k: int, flat: Dict[str, Optional[torch.Tensor]],
                       step: int) -> Dict[int, object]:
        """{piece tensor id: this rank's stage-1 message} of every piece of bucket ``k``
        whose tensor has a gradient here: each tensor's pieces (one per owner) in one
        ``Compressor.encode_pieces`` call; a cast's pieces one by one
        (:meth:`_encode_piece`: each may need its fallback)."""
        out: Dict[int, object] = {}
        for name, items in self._by_tensor[k]:
            g = flat[name]
            if g is None:
                continue
            comp = self.entries[name].compressor
            if comp.wire_dtype is not None:
                for _, _, p in items:
                    out[p.tensor_id] = self._encode_piece(
                        p, g[p.lo:p.hi].reshape(p.shape), step)
                continue
            keys = [p.key(step, self.rank, self.size, self.seed) for _, _, p in items]
            msgs = comp.encode_pieces(g, [(p.lo, p.hi) for _, _, p in items], keys)
            for (_, _, p), m in zip(items, msgs):
                out[p.tensor_id] = m
        return out

    def _encode_piece(self, p: Piece, x: torch.Tensor, step: int):
        """This rank's stage-1 message of piece ``p`` (a cast that would overflow: the
        piece's own values, :meth:`Averaging.cast_fallback`)."""
        key = p.key(step, self.rank, self.size, self.seed)
        e = self.entries[p.name]
        fallback = self.averaging.cast_fallback(e, x, key)
        if fallback is not None:
            return fallback
        return e.compressor.encode(x, key)

    def _scatter(self, job: _ScatterJob, stats) -> None:
        k, n, me = job.gather.k, self.size, self.rank
        what = f"bucket {k} of step {job.gather.step} (shards)"
        frames = self.transport.alltoall(job.parts)
        out_bytes = sum(len(p) for r, p in enumerate(job.parts) if r != me)
        stats.bytes_sent += out_bytes
        stats.traffic_bytes += out_bytes
        stats.recv_bytes += sum(len(f) for s, f in enumerate(frames) if s != me)
        failure, out = job.failure, None
        if failure is None:
            try:
                try:
                    raise_failed(frames, None, what)
                except RankFailure:
                    self.failure_seen = True    # every owner got that rank's error frame
                    raise
                incoming = Incoming(frames, len(self.layout[k][me]))
                check_stamps(incoming.stamps, incoming.joined, job.stamp, me, what)
                t0 = time.perf_counter()
                out, job.joined = self.owner.reduce(
                    self.layout[k][me], incoming, job.gather.step, job.stamp, job.events)
                stats.reduce_s += time.perf_counter() - t0
            except Exception as exc:                # noqa: BLE001 - re-raised on all ranks
                failure = exc
        else:
            self.failure_seen = True                # this rank's error frames went to all
        if failure is not None:
            out = Outgoing.failed(failure, job.failure_text if failure is job.failure
                                  else None)
        try:
            job.averaged = self.transport.exchange(
                out, what=f"the averaged shards of bucket {k} of step {job.gather.step}",
                counts=[len(mine) for mine in self.layout[k]])
        except RankFailure:
            self.failure_seen = True
            raise
        stats.bytes_sent += len(out)
        stats.recv_bytes += sum(job.averaged.nbytes) - len(out)
        stats.traffic_bytes += (n - 1) / n * sum(job.averaged.nbytes)
