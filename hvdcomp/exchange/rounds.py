"""Tensors summed in rounds: the compressors that declare
:class:`~hvdcomp.compressors.protocols.SummedRounds` (PowerSGD: P summed, orthogonalized,
then Q summed; Vogels et al. 2019, Algorithm 1) send no wire messages.  For the tensors of
one bucket, round i's parts of every such tensor are fused into one float32 buffer, summed
across ranks, and handed back to the compressors, which compute round i + 1's parts from it
(as PyTorch's powerSGD_hook batches its Ps and Qs).

Each buffer ends like the summed buffers of :mod:`.sums`: round 0 with three counts per
tensor (ranks with a gradient, a sparse one, a non-finite one) and the joined count, every
round with one slot per rank holding its :func:`~.sums.slot_code` (0: the rank failed), so
that ranks out of step, or a failed rank, raise on every rank (:meth:`Sums.check`).  Where
the rounds' sizes can change from one step to another
(:meth:`~hvdcomp.compressors.protocols.SummedRounds.sizes_vary`: PowerSGD before and after
its ``start_iter``), ranks out of step could hand the carrier buffers of different sizes,
which it cannot sum: with a carrier, such a bucket's rounds are then preceded by a sum of
the slots alone (``size`` float32), and ranks out of step raise OutOfStep from it on every
rank without starting the rounds.  (Without a carrier the allgather's frames carry the
step and raise it.)  A tensor
no rank has, or one that is non-finite on some rank, sends zeros in the later rounds, gets no
average (absent) or NaN (the NaN policy), and its compressor's state stays as it was.

Who sums: with an :class:`~hvdcomp.transport.Allreduce` carrier (Horovod's allreduce,
torch.distributed's all_reduce), every round but the last is summed on the encode thread,
which issues all of the carrier's collectives (the last round is waited for on the
communicate thread), so the collectives keep one order on every rank; without one
(``allreduce_summable=False``, or an exchange built without a carrier), every round is an
allgather of the buffers on the communicate thread, summed in rank order in float32 (then
the same on every rank and on every transport, bit for bit: :func:`simulate`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from ..compressors import TensorKey
from ..compressors.state import finite as all_finite
from ..errors import WireFormatError
from ..transport import Allreduce, Transport
from .averaging import Averaging
from .plan import Entry
from .step_stats import StepStats
from .sums import Sum, Sums, slot_code

__all__ = ["Rounds", "RoundsJob", "simulate"]


@dataclass
class RoundsJob:
    """The rounds of one bucket's tensors: ``sizes[j]`` the elements tensor j adds to each
    round; ``sums`` each round's buffer (summed, but the last one's ``handle`` may still be
    in flight); ``views[i][j]`` tensor j's part of round i; ``failure``: this rank's own
    error while computing a round (the other ranks see its zero slot)."""
    entries: List[Entry]
    keys: List[TensorKey]
    sizes: List[Tuple[int, ...]]
    failing: bool = False
    sums: List[Sum] = field(default_factory=list)
    views: List[List[torch.Tensor]] = field(default_factory=list)
    handle: Any = None
    failure: Optional[BaseException] = None
    pre: Optional[Sum] = None        # the slots summed before the rounds (sizes_vary)

    @property
    def all_sums(self) -> List[Sum]:
        return ([self.pre] if self.pre is not None else []) + self.sums


class Rounds:
    """The rounds of an exchange's :class:`~hvdcomp.exchange.plan.Entry` objects with
    ``rounds`` set (module docstring).  ``transport``, ``allreduce`` (or None), ``averaging``,
    ``seed``, ``ident``: as the :class:`~hvdcomp.exchange.collective.Allgather`'s.  Per
    bucket: :meth:`encode` (encode thread), :meth:`communicate` inside the communicate
    stage and :meth:`wait` in its ``finally``, :meth:`check` after it, :meth:`decode`."""

    def __init__(self, transport: Transport, allreduce: Optional[Allreduce],
                 averaging: Averaging, seed: int, ident: int):
        self.transport, self.allreduce, self.averaging = transport, allreduce, averaging
        self.rank, self.size, self.seed = transport.rank, transport.size, seed
        self.sums = Sums(allreduce, averaging, self.rank, self.size, ident)

    def encode(self, k: int, es: Sequence[Entry], job, failing: bool) -> RoundsJob:
        """The bucket's rounds job; with a carrier, every round is started here (all but the
        last summed)."""
        keys = [e.key(job.step, self.rank, self.size, self.seed) for e in es]
        rj = RoundsJob(list(es), keys,
                       [tuple(e.compressor.round_sizes(tuple(e.param.shape), job.step))
                        for e in es], failing=failing or job.failure is not None)
        if self.allreduce is not None:
            self._run(k, rj, job)
        return rj

    def communicate(self, rj: RoundsJob, job) -> None:
        """Without a carrier: every round, over the transport's allgather."""
        if self.allreduce is None:
            self._run(job.k, rj, job)

    def wait(self, rj: RoundsJob) -> None:
        """Wait for the last round's sum (with a carrier)."""
        if rj.handle is not None:
            handle, rj.handle = rj.handle, None
            self.allreduce.wait(handle)

    def check(self, rj: RoundsJob, job, stats: StepStats) -> None:
        """Count what was sent (``stats``) and raise, every rank alike, when a rank failed
        or ranks are out of step (:meth:`Sums.check`; this rank's own error where it is
        the one that failed)."""
        for s in rj.all_sums:
            nbytes = s.flat.numel() * s.flat.element_size()
            stats.bytes_sent += nbytes
            if self.allreduce is not None:
                stats.traffic_bytes += 2 * (self.size - 1) / self.size * nbytes
            else:
                stats.recv_bytes += (self.size - 1) * nbytes
                stats.traffic_bytes += (self.size - 1) * nbytes
        if rj.failure is not None:
            raise rj.failure
        for s in rj.all_sums:
            self.sums.check(s, job)

    def decode(self, rj: RoundsJob, stats: StepStats,
               dest: Optional[Dict[str, torch.Tensor]] = None) -> Dict[str, torch.Tensor]:
        """{name: average} of the bucket's tensors summed in rounds (into ``dest[name]``
        where it can serve: :meth:`Averaging.accumulator`)."""
        out: Dict[str, torch.Tensor] = {}
        counts = rj.sums[0].counts
        joined = int(round(float(counts[-1])))
        stats.joined = max(stats.joined, joined)
        for j, e in enumerate(rj.entries):
            if counts[3 * j] == 0:             # no rank had a gradient: no average
                continue
            finite = bool(counts[3 * j + 2] == 0)
            # last_round writes every element (SummedRounds): no zeroing needed then
            acc = self.averaging.accumulator(e, (dest or {}).get(e.name), zero=not finite)
            if finite:
                e.compressor.last_round(rj.views[len(rj.sizes[j]) - 1][j], rj.keys[j], acc)
            out[e.name] = self.averaging.finish(e, acc, finite, rj.keys[j], stats, joined)
        return out

    # --- the rounds -------------------------------------------------------------------
    def _run(self, k: int, rj: RoundsJob, job) -> None:
        """Every round of ``rj``; each buffer summed, the last one only started when there
        is a carrier.  Every rank makes the same calls whatever fails (zeros, and a zero
        slot for this rank once it has failed)."""
        es, nrounds = rj.entries, max(len(s) for s in rj.sizes)
        device = es[0].param.device
        active = [True] * len(es)
        if self.allreduce is not None and any(
                e.compressor.sizes_vary(tuple(e.param.shape)) for e in es):
            pre = torch.zeros(self.size, dtype=torch.float32, device=device)
            if not rj.failing:
                pre[self.rank] = float(slot_code(job.step, job.sync, self.averaging.joined))
            self._sum(pre, f"{k}.rounds.step")
            rj.pre = Sum(None, pre, [], self.size)
            try:
                self.sums.check(rj.pre, job)
            except Exception:               # noqa: BLE001 - raised by check(), every rank
                return                      # alike (the same sum): no rounds started
        for i in range(nrounds):
            parts = [s[i] if i < len(s) else 0 for s in rj.sizes]
            tail = (3 * len(es) + 1 if i == 0 else 0) + self.size
            flat = torch.zeros(sum(parts) + tail, dtype=torch.float32, device=device)
            views = list(torch.split(flat[:sum(parts)], parts))
            counts: List[float] = []
            for j, (e, key) in enumerate(zip(es, rj.keys)):
                if i == 0:
                    counts += self._first(rj, j, e, key, views[j], job)
                elif i < len(rj.sizes[j]) and active[j] and not rj.failing:
                    self._call(rj, e.compressor.next_round, i, rj.views[i - 1][j], key,
                               views[j])
            if rj.failing:
                flat.zero_()
            if i == 0:
                counts.append(float(self.averaging.joined))
                flat[sum(parts):sum(parts) + len(counts)] = torch.tensor(counts)
            if not rj.failing:
                flat[-self.size + self.rank] = float(slot_code(job.step, job.sync,
                                                               self.averaging.joined))
            s = Sum(None, flat, [(e, p) for e, p in zip(es, parts)] if i == 0 else [],
                    self.size)
            rj.sums.append(s)
            rj.views.append(views)
            name = f"{k}.round{i}"
            if i == nrounds - 1 and self.allreduce is not None:
                rj.handle = s.handle = self.allreduce.start(flat, name)
                break
            self._sum(flat, name)
            if i == 0:
                c = rj.sums[0].counts
                active = [bool(c[3 * j] > 0 and c[3 * j + 2] == 0) for j in range(len(es))]

    def _first(self, rj: RoundsJob, j: int, e: Entry, key: TensorKey, out: torch.Tensor,
               job) -> List[float]:
        """Round 0 of tensor ``j`` on this rank; its three counts."""
        g = None if rj.failing else self.averaging.gradient(e, job.grads)
        if g is not None and g.is_sparse:
            rj.failure = rj.failure or TypeError(
                f"hvdcomp: {e.compressor.name} averages dense gradients only; the gradient "
                f"of {e.name} is sparse (pass sparse_as_dense=True)")
            rj.failing = True
            return [0.0, 1.0, 0.0]
        bad = g is not None and g.is_floating_point() and not all_finite(g)
        self._call(rj, e.compressor.first_round, None if bad else g, key, out)
        return [float(g is not None), 0.0, float(bad)]

    def _call(self, rj: RoundsJob, fn, *args) -> None:
        """A compressor's round; what it raises fails this rank (its zero slot)."""
        if rj.failing:
            return
        try:
            fn(*args)
        except Exception as exc:                # noqa: BLE001 - raised by check()
            rj.failure, rj.failing = exc, True

    def _sum(self, flat: torch.Tensor, name: str) -> None:
        """``flat`` summed across ranks in place: by the carrier, or by an allgather summed
        in rank order."""
        if self.allreduce is not None:
            self.allreduce.wait(self.allreduce.start(flat, name))
            return
        host = flat.detach().to("cpu", copy=True)
        got = self.transport.allgather(host.numpy().view(np.uint8))
        total = torch.zeros_like(host)
        for r, g in enumerate(got):
            if len(g) != 4 * host.numel():
                raise WireFormatError(f"rounds buffer {name}: rank {r} sent {len(g)} bytes, "
                                      f"this rank {4 * host.numel()} (ranks that disagree "
                                      f"on the plan or the step)")
            total += torch.from_numpy(np.array(g, dtype=np.uint8, copy=True).view(np.float32))
        flat.copy_(total)


def simulate(comps: Sequence, grads: Sequence[Optional[torch.Tensor]],
             keys: Sequence[TensorKey]) -> List[Optional[torch.Tensor]]:
    """One process playing every rank of one tensor summed in rounds: rank r's compressor
    ``comps[r]``, gradient ``grads[r]`` (None: absent) and key ``keys[r]``; each round
    summed in rank order in float32, as the exchange sums without a carrier.  Returns every
    rank's average (flat float32, after ``finalize``, so each compressor's state moves on
    as in the exchange), None where no rank had a gradient, all NaN where some rank's was
    non-finite."""
    size = len(comps)
    shape = tuple(keys[0].shape)
    sizes = tuple(comps[0].round_sizes(shape, keys[0].step))
    bad = [g is not None and not all_finite(g) for g in grads]
    outs = [torch.zeros(sizes[0]) for _ in range(size)]
    for c, g, b, k, o in zip(comps, grads, bad, keys, outs):
        c.first_round(None if b else g, k, o)
    if all(g is None for g in grads):
        return [None] * size
    numel = int(np.prod(shape))
    if any(bad):
        return [torch.full((numel,), float("nan")) for _ in range(size)]
    for i in range(1, len(sizes) + 1):
        summed = torch.zeros(sizes[i - 1])
        for o in outs:
            summed += o
        if i == len(sizes):
            break
        outs = [torch.zeros(sizes[i]) for _ in range(size)]
        for c, k, o in zip(comps, keys, outs):
            c.next_round(i, summed, k, o)
    res = []
    for c, k in zip(comps, keys):
        acc = torch.zeros(numel)
        c.last_round(summed, k, acc)
        res.append(c.finalize(acc, k))
    return res
