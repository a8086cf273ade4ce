"""The hierarchical exchange: several ranks per host, compression only across hosts.

With ``H`` hosts of ``L`` ranks each (:mod:`hvdcomp.transport.topology`), every tensor that
uses the compression (``Entry.hier``) is cut into ``L`` pieces along its compressor's units
(:func:`hvdcomp.exchange.shards.boundaries`: quantization buckets, rows, elements; the same
cut for every tensor on every host, whatever the fusion buckets): local rank ``l`` owns
piece ``l`` of every such tensor.  Per bucket (a fusion bucket, or a DDP hook's call):

1. inside the host, a reduce-scatter of the uncompressed float32 gradients: each rank sends
   piece ``l`` of its gradients to local rank ``l`` (raw float32 in a frame, over an
   all-to-all of the host's transport: :mod:`~hvdcomp.exchange.host_pieces`); local rank
   ``l`` sums them in local-rank order in float32 and divides by ``L``: the host's mean of
   piece ``l``;
2. across hosts, the host means of piece ``l`` go through the flat compressed collective
   (:class:`~hvdcomp.exchange.collective.Allgather`; with ``collective="reduce_scatter"``
   and fusion buckets, :class:`~hvdcomp.exchange.scatter.ReduceScatter` over each fusion
   bucket's pieces, its second stage's state on the owners) among the ``H`` ranks of local
   rank ``l`` (one per host; ``L`` such groups in parallel): the compressor encodes each host's
   mean with its own state kept under the piece's name (``name[lo:hi]``: residuals, DGC's
   momentum, on the piece's owner), and every rank of the group decodes the ``H``
   messages in host order and averages them (``Compressor.finalize`` over ``H``);
3. inside the host, an allgather of the averaged pieces (raw float32): every rank assembles
   every tensor's average.

So each rank encodes and decodes ``1/L`` of the compressed gradient, and each host sends
one compressed gradient's worth (``L`` pieces) across the network instead of ``L`` of them.
The average is the same bits on every rank (step 2's decode is in host order on the ``H``
ranks that hold a piece; step 3 copies bytes), and equal to a single-process computation
from the same messages: per host the float32 sum of its ranks' pieces in local-rank order,
divided by ``L``, encoded with key (piece, host number, ``H``), decoded in host order and
finalized.  Each piece's cross-host messages carry their own tensor id (``first_id + 3 (t
L + l) + 1``), so each draws its own Philox streams.

Joined and absent ranks: a rank with no gradient for a tensor contributes zeros to its
host's sum, and a host where no rank has it sends nothing for its pieces (absent, as a
rank of the flat exchange); the average is then over the ranks that have not joined (their
count summed across hosts: one small sum of 8 bytes per bucket among the ranks of a local
rank).  NaN policy: a piece whose host sum
holds a non-finite contribution is NaN, sent NONFINITE across hosts, and the tensor is NaN
on every rank.
Errors: an encoder error or a stop mark travels as error frames through all three
stages, so every rank of every host raises and none waits.

Tensors that do not use the compression (or are summed: ``Entry.allreduce``, ``rounds``)
go through :attr:`Hierarchical.flat`, the flat allgather over every rank, as they would
without the hierarchy.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch

from ..errors import ConfigError, RankFailure, WireFormatError
from ..log import logger
from ..transport import Incoming, Outgoing, Stamp, Transport
from ..transport.base import raise_failed
from ..transport.framing import STOP_MARK, check_stamps
from ..transport.topology import Topology, discover
from .averaging import Averaging
from .collective import Allgather, Collective, _Job
from .scatter import ReduceScatter
from .host_pieces import HostPiece, HostPieces, cuts
from .plan import Entry
from .shards import refusal
from .step_stats import StepStats

__all__ = ["Hierarchical", "HostPiece", "cuts", "plan_hierarchy", "HIERARCHIES"]


@dataclass
class _HierJob:
    flat: _Job                                    # the bucket's other tensors
    mine: List[Entry]                             # its tensors over the hierarchy
    step: int = 0
    sync: bool = False
    parts: Optional[List[np.ndarray]] = None      # stage-1 frame per owner (None: nothing)
    own: Dict[str, Optional[torch.Tensor]] = field(default_factory=dict)  # its gradients
    stamp: Stamp = Stamp()
    failure: Optional[BaseException] = None       # this rank's encoder error
    failure_text: Optional[str] = None
    averaged: Optional[Incoming] = None           # every owner's averaged pieces (stage 3)
    joined: int = 0                               # ranks that had joined, every host
    events: List[str] = field(default_factory=list)


class Hierarchical(Collective):
    """The hierarchical collective (module docstring) for the entries marked ``hier``; the
    others go through :attr:`flat`, an :class:`Allgather` of ``transport`` (the world).

    transport: every rank's carrier (the flat part, the joined counts); allreduce: the
    flat part's summable carrier or None; host: the carrier among this host's ranks (local
    rank = its rank); cross: among the ranks of this local rank on every host (host
    number = its rank); averaging: the exchange's (predivide, op=Sum, joined); seed,
    ident: as Allgather's; entries: name -> Entry; first_id: the first tensor id free for
    the pieces.
    """

    def __init__(self, transport: Transport, allreduce, host: Transport, cross: Transport,
                 averaging: Averaging, seed: int, entries: Dict[str, Entry], first_id: int,
                 ident: int = 0, buckets: Optional[List[List[str]]] = None):
        self.flat = Allgather(transport, allreduce, averaging, seed, ident)
        self.transport, self.host, self.cross = transport, host, cross
        self.averaging, self.seed = averaging, seed
        self.rank, self.size = transport.rank, transport.size
        self.local, self.local_size = host.rank, host.size
        self.hosts = cross.size
        self.ident = self.flat.ident
        self.entries = entries
        #: the pieces (``pieces``: {name: [HostPiece or None per owner]}; ``virtual``: this
        #: rank's pieces as the inner collective's entries) and their messages in the host
        self.layout = HostPieces(entries, host.size, host.rank, first_id, seed,
                                 scatter=buckets is not None)
        self.pieces, self.virtual = self.layout.pieces, self.layout.virtual
        # the inner collective: host means, averaged over the H hosts, no predivide; the
        # reduce-scatter over the fusion buckets' pieces, else the allgather
        self._inner_avg = _Given(self.hosts)
        if buckets is not None:
            self.inner: Collective = ReduceScatter(
                cross, None, self._inner_avg, seed,
                [[self.virtual[n].name for n in b if n in self.virtual] for b in buckets],
                {v.name: v for v in self.virtual.values()},
                first_id + 3 * len(entries) * self.local_size, ident)
        else:
            self.inner = Allgather(cross, None, self._inner_avg, seed, ident)

    failing = property(lambda self: self.flat.failing,
                       lambda self, text: setattr(self.flat, "failing", text))
    failure_seen = property(lambda self: self.flat.failure_seen,
                            lambda self, seen: setattr(self.flat, "failure_seen", seen))

    def labels(self) -> Dict[str, str]:
        """{piece label: parameter name} of this rank's pieces (the names its compressor
        keeps state under, e.g. DGC's momentum factors; across hosts over the
        reduce-scatter, also the labels of the pieces' own pieces)."""
        out = {v.name: n for n, v in self.virtual.items()}
        if isinstance(self.inner, ReduceScatter):
            for p in self.inner.pieces():
                out[p.label] = out[p.name]
        return out

    def second_stages(self) -> list:
        """The cross-host reduce-scatter's second stages that keep state, else []."""
        return (self.inner.second_stages() if isinstance(self.inner, ReduceScatter)
                else [])

    # --- the three stages ---------------------------------------------------------------
    def encode(self, k, entries, step, stats, sync=False, grads=None, failure=None):
        """The flat part, then stage 1's frames: piece ``l`` of every hierarchical tensor,
        float32, for local rank ``l`` (an encoder error: error frames to every owner; so
        does everything once ``failing``, or with ``failure``)."""
        mine = [e for e in entries if e.hier]
        job = _HierJob(self.flat.encode(k, [e for e in entries if not e.hier], step, stats,
                                        sync, grads, failure),
                       mine, step, bool(sync), stamp=Stamp(step, self.ident, bool(sync)))
        if not mine:
            return job
        L = self.local_size
        if failure is not None:
            job.failure = failure
            job.parts = [Outgoing.failed(failure).data] * L
            return job
        failing = self.failing
        if failing is not None:
            job.failure = RankFailure(failing, self.rank)
            job.failure_text = STOP_MARK + failing
            job.parts = [Outgoing.failed(job.failure, job.failure_text).data] * L
            return job
        try:
            flat = {e.name: self._gradient(e, grads) for e in mine}
            job.parts = self.layout.frames(mine, flat, self.averaging.joined, job.stamp,
                                           job.flat.k)
            job.own = flat
        except Exception as exc:                    # noqa: BLE001 - re-raised on all ranks
            job.failure = exc
            job.parts = [Outgoing.failed(exc).data] * L
        return job

    def communicate(self, job, stats):
        """Stage 1 (the host's all-to-all, the host means), the joined counts, stage 2 (the
        cross-host collective of this rank's pieces) and stage 3 (the host's allgather of
        the averaged pieces); then the flat part.  Every rank makes every call; raises on
        every rank of every host if any rank failed."""
        err = None
        if job.parts is not None:
            try:
                self._hier(job, stats)
            except BaseException as e:              # noqa: BLE001 - after the flat part
                err = e
        self.flat.communicate(job.flat, stats)
        if err is not None:
            raise err

    def decode(self, job, stats, out=None):
        """The flat part, then every owner's averaged pieces into each tensor's
        accumulator (``out[name]`` where it can serve): a tensor no rank had has no
        average."""
        res = self.flat.decode(job.flat, stats, out)
        if job.parts is None:
            return res
        stats.joined = max(stats.joined, job.joined)
        stats.events.extend(job.events)
        dest = out or {}
        index = self.layout.index([e.name for e in job.mine])
        n_active = self.size - job.joined
        for e in job.mine:
            row = self.pieces[e.name]
            present = [job.averaged.present_of(l, index[(e.name, l)])
                       for l, p in enumerate(row) if p is not None]
            if len(set(present)) > 1:
                raise WireFormatError(f"the owners disagree on whether any rank had a "
                                      f"gradient of {e.name}")
            if not present[0]:
                continue
            acc = self.averaging.accumulator(e, dest.get(e.name))
            finite = self.layout.assemble(e.name, job.averaged, index, acc)
            if finite and n_active != self.size:
                acc.mul_(self.size / n_active)      # the mean over the ranks not joined
            key = e.key(job.step, self.rank, self.size, self.seed)
            res[e.name] = self.averaging.finish(e, acc, finite, key, stats, job.joined,
                                                averaged=True)
        return res

    def close(self):
        self.flat.close()
        self.inner.close()
        for t in (self.host, self.cross):
            t.close()
            free = getattr(t, "free", None)
            if free is not None:
                free()

    # --- helpers ------------------------------------------------------------------------
    def _gradient(self, e: Entry, grads) -> Optional[torch.Tensor]:
        """``e``'s gradient, flat float32 (None: absent).  ValueError for a sparse one."""
        g = self.averaging.gradient(e, grads)
        if g is None:
            return None
        if g.is_sparse:
            raise ValueError(f"the gradient of {e.name} is sparse, and the hierarchical "
                             f"exchange cuts dense pieces: pass sparse_as_dense=True, or "
                             f"hierarchy='flat'")
        return g.detach().reshape(-1).to(torch.float32)

    def _hier(self, job: _HierJob, stats: StepStats) -> None:
        L, me, step = self.local_size, self.local, job.step
        what = f"bucket {job.flat.k} of step {step} (the host's pieces)"
        names = [e.name for e in job.mine]
        mine = self.layout.owned(names, me)
        # this rank's own frame stays here (an empty part to itself: no copy through MPI)
        frames = self.host.alltoall([p if r != me else _NOTHING
                                     for r, p in enumerate(job.parts)])
        frames[me] = job.parts[me]
        stats.host_bytes += sum(len(p) for r, p in enumerate(job.parts) if r != me)
        failure = job.failure
        means: Dict[str, Optional[torch.Tensor]] = {}
        host_joined = 0
        if failure is None:
            try:
                try:
                    raise_failed(frames, None, what)
                except RankFailure:
                    self.failure_seen = True
                    raise
                incoming = Incoming(frames, len(mine))
                check_stamps(incoming.stamps, incoming.joined, job.stamp, me, what)
                host_joined = sum(incoming.joined)
                t0 = time.perf_counter()
                means = self.layout.means(mine, incoming, job.own)
                stats.reduce_s += time.perf_counter() - t0
            except Exception as exc:                # noqa: BLE001 - re-raised on all ranks
                failure = exc
        else:
            self.failure_seen = True
        # the ranks that had joined, every host's (each owner saw its host's JOINED flags);
        # every rank takes part, also after a failure
        job.joined = int(round(float(self.cross.allreduce_sum(
            np.array([host_joined], dtype=np.float64))[0])))
        # stage 2: across hosts
        inner_stats = StepStats(step=step)
        entries = [self.virtual[p.name] for p in mine]
        self._inner_avg.current = {self.virtual[n].name: m for n, m in means.items()}
        averages: Dict[str, torch.Tensor] = {}
        err = failure
        ijob = self.inner.encode(job.flat.k, entries, step, inner_stats, job.sync, None,
                                 failure)
        try:
            self.inner.communicate(ijob, inner_stats)
            if err is None:
                averages = self.inner.decode(ijob, inner_stats)
                job.events.extend(inner_stats.events)
        except BaseException as e:                  # noqa: BLE001 - to stage 3, then raised
            err = err or e
        if self.inner.failure_seen:
            self.failure_seen = True
        stats.bytes_sent += inner_stats.bytes_sent
        stats.recv_bytes += inner_stats.recv_bytes
        stats.traffic_bytes += inner_stats.traffic_bytes
        # stage 3: the averaged pieces to every rank of the host
        if err is not None:
            out = Outgoing.failed(err, job.failure_text if err is job.failure else None)
        else:
            out = self.layout.averaged(mine, averages, job.stamp, job.flat.k)
        try:
            job.averaged = self.host.exchange(
                out, what=f"the averaged pieces of bucket {job.flat.k} of step {step}",
                counts=[len(self.layout.owned(names, l)) for l in range(L)])
        except RankFailure:
            self.failure_seen = True
            raise
        stats.host_bytes += (L - 1) * len(out)


_NOTHING = np.empty(0, dtype=np.uint8)


class _Given(Averaging):
    """The inner collective's averaging: each piece's gradient is the host mean set in
    ``current`` ({label: tensor or None}) for the bucket at hand (the communicate thread
    sets it before the inner collective's encode)."""

    def __init__(self, size: int):
        super().__init__(size)
        self.current: Dict[str, Optional[torch.Tensor]] = {}

    def gradient(self, e, grads=None):
        return self.current.get(e.name)


#: The settings of ``hierarchy=``.
HIERARCHIES = ("auto", "flat", "host")


def plan_hierarchy(hierarchy: str, transport: Transport, compression, collective: str,
                   log: bool = True) -> Optional[Tuple[Transport, Transport, Topology]]:
    """Whether the exchange over ``transport`` is hierarchical, and its carriers:
    ``(host, cross, topology)``, or None for the flat exchange.  Collective where it
    discovers the topology (every rank alike, with the same settings: agreed first).

    hierarchy: "flat" (None, no collective); "host" (hierarchical, or ConfigError on
    every rank when it cannot be: a transport without sub-groups, hosts with unequal rank
    counts, a compressor that cannot be cut into pieces);
    "auto": hierarchical where "host" would be, with more than one host, else flat with
    the reason logged (INFO, rank 0).  One rank per host is flat in both (the same
    exchange as today's).  ConfigError for another value.  ``log``: False leaves the
    hierarchical outcome unlogged (Auto decides afterwards and logs its decision:
    :func:`~.hier_choice.settle`)."""
    if hierarchy not in HIERARCHIES:
        raise ConfigError(f"hierarchy must be one of {', '.join(HIERARCHIES)}; got "
                          f"{hierarchy!r}")
    if hierarchy == "flat" or transport.size < 2:
        return None
    forced = hierarchy == "host"

    def flat(why: str):
        if forced:
            raise ConfigError(f"hvdcomp: hierarchy='host' cannot be used here: {why}; pass "
                              f"hierarchy='auto' (flat where it cannot be hierarchical) or "
                              f"'flat'")
        if transport.rank == 0:
            logger.info("exchange: flat (hierarchy='auto'): %s", why)
        return None

    if transport.split_refusal is not None:
        return flat(f"the {transport.name} transport: {transport.split_refusal}")
    topo = discover(transport)      # (before anything the ranks may not agree on yet)
    why = refusal(compression)
    if why is not None:
        return flat(f"{compression.name} cannot be cut into pieces: {why}")
    if not topo.equal:
        return flat(f"the hosts have unequal numbers of ranks ({topo.describe()}: ranks "
                    f"per host {topo.counts})")
    if topo.local_size == 1:
        if transport.rank == 0:
            logger.info("exchange: flat: one rank per host (%s)", topo.describe())
        return None
    if topo.host_count == 1 and not forced:
        return flat(f"all {transport.size} ranks are on one host: nothing crosses a "
                    f"network")
    host = transport.split(list(topo.hosts))
    cross = transport.split([topo.local_rank_of(r) for r in range(topo.size)])
    if transport.rank == 0 and log:
        logger.info("exchange: hierarchical, %s: float32 sums inside each host, "
                    "compression across hosts", topo.describe())
    return host, cross, topo
