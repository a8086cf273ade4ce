"""The exchange core: a plan, fusion buckets and a pipeline driving a collective (the
allgather, or the reduce-scatter when some tensors take it).

Any launcher drives it the same way.  The drop-in optimizer: per step ``begin(step)``,
``ready(name)`` as each gradient becomes final, ``finish()`` for the averages, over fixed
fusion buckets.  The DDP communication hook, whose buckets DDP forms: ``call(...)`` per DDP
bucket.  Both: ``before_step()`` / ``after_step(step)`` around the parameter update (or its
two halves, ``report_param_deltas`` and ``refit_levels``), for the compressors that need
the training loop (the opt-in protocols of :mod:`hvdcomp.compressors.protocols`).  A rank
that has run out of data takes part in the others' steps with ``begin(step, joined=True)``
and ``finish()``: it contributes nothing, and the others' averages count only the ranks
that have not joined.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ..auto import Auto
from ..compressors import Compressor
from ..log import logger
from ..transport import Allreduce, Transport
from ..transport.mpi import cuda_aware
from .averaging import Averaging
from . import plan_trial, shutdown
from .buckets import agree_settings, check_replicas, fuse, handshake
from .collective import Allgather
from .hier import Hierarchical, plan_hierarchy
from .hier_choice import settle
from .layer_plan import planner
from .loop import LoopProtocols, refit
from .pipeline import Done, Pipeline
from .plan import Entry, Plan, qualifies
from .shards import refusal
from .scatter import ReduceScatter
from .step_stats import StepStats

__all__ = ["Exchange", "refit", "report_plan"]


class Exchange(LoopProtocols):
    """Averages gradients across ranks with real encoded bytes.

    named_params: [(name, parameter)] in registration order; names unique (ValueError).
    compression: the compressor for tensors that qualify (``none`` for the rest: see
      :mod:`hvdcomp.exchange.plan`), or an :class:`hvdcomp.Auto`.
    transport: the byte carrier; allreduce: the carrier of summable tensors, or None.
    fusion_bytes: gradient bytes per fusion bucket (ValueError if < 1); None: no fixed
      buckets, the exchange runs through :meth:`call` only.
    seed: the shared seed of the Philox streams; average: False for a sum (op=Sum);
    predivide: Horovod's gradient_predivide_factor; sparse_as_dense: densify sparse
    gradients before sending them (else they travel as indices and values, uncompressed).
    collective: how the compressed tensors' messages travel: "allgather",
      "reduce_scatter" (:mod:`hvdcomp.exchange.scatter`) or "auto" (per tensor, by the cost
      model); None: "auto" with an Auto, else "allgather".  ConfigError for another name,
      for "reduce_scatter" on one rank or with a compressor that refuses it (NDQSG, LAQ).
    ident: this exchange's number in the frames' stamps (the same on every rank; the
    drop-in optimizer passes its creation number); check_replicas: compare a digest of the
    parameters' values across ranks at the first step (:func:`~.buckets.check_replicas`);
    agreed: the ranks have already agreed on every setting (a door's
    :class:`~.driver.Settings` handshake), so only the plan and the carriers are compared;
    False: the settings are compared first, before anything is planned or measured.
    hierarchy: "flat" (default: every rank a host of its own), "host" or "auto": with
      several ranks per host, the tensors that use the compression are summed in float32
      inside each host and compressed only across hosts (:mod:`.hier`,
      :func:`~.hier.plan_hierarchy`: when it applies, and the ConfigError of "host" where
      it cannot).

    Construction is collective (Auto's measurements, the handshake): every rank builds its
    exchanges together, in the same order; :class:`~hvdcomp.errors.Mismatch` (a
    RuntimeError) on every rank if they disagree on the collective (checked first), the
    model, the routing or the settings, or (at the first step) on the parameters' values.
    Every collective of a step carries the step (:mod:`.collective`): :class:`~hvdcomp.errors.OutOfStep` on every rank when
    ranks exchange different steps.  On a transport between processes, the exit handler of
    :mod:`.shutdown` stops the pipeline at interpreter exit and, when this rank fails, makes
    the other ranks raise a :class:`~hvdcomp.errors.RankFailure` naming it.
    """

    def __init__(self, named_params: Sequence[Tuple[str, torch.Tensor]],
                 compression, transport: Transport, *, allreduce: Optional[Allreduce] = None,
                 fusion_bytes: Optional[int] = 25 * 2**20, min_compress_numel: int = 1024,
                 compress_1d: bool = False, seed: int = 0, average: bool = True,
                 predivide: float = 1.0, sparse_as_dense: bool = False, ident: int = 0,
                 check_replicas: bool = True,
                 collective: Optional[str] = None, agreed: bool = False,
                 hierarchy: str = "flat"):
        self.transport, self.allreduce = transport, allreduce
        self.rank, self.size = transport.rank, transport.size
        self.seed = int(seed) & 0xFFFFFFFF
        if collective is None:
            collective = "auto" if isinstance(compression, Auto) else "allgather"
        if not agreed:
            # before anything else: ranks that disagree would measure different things (Auto,
            # the per-layer planner: whether the reduce-scatter is offered depends on
            # fusion_bytes, which tensors are planned on min_compress_numel and compress_1d)
            agree_settings(transport, dict(
                seed=self.seed, average=bool(average), predivide=float(predivide),
                sparse_as_dense=bool(sparse_as_dense), compression=compression.spec(),
                fusion_bytes=fusion_bytes and int(fusion_bytes), hierarchy=hierarchy,
                min_compress_numel=int(min_compress_numel), compress_1d=bool(compress_1d),
                collective=collective, check_replicas=bool(check_replicas)),
                "the exchange settings")
        self.fused = fusion_bytes is not None      # else the caller forms buckets (call())
        self.buckets = fuse(named_params, fusion_bytes) if self.fused else []
        self.plan = Plan(named_params, compression, transport, allreduce,
                         min_compress_numel=min_compress_numel, compress_1d=compress_1d,
                         collective=collective)
        self.collective_setting = collective
        #: a per-layer Auto's planner (:mod:`.layer_plan`), else None; its exchange is flat
        self.layer, hierarchy = planner(
            self.plan, hierarchy, transport, allreduce, seed=self.seed, buckets=self.buckets,
            scatter=collective == "auto" and self.fused and transport.size > 1)
        decides = hierarchy == "auto" and getattr(self.auto, "model", None) is not None
        self.hierarchy = plan_hierarchy(hierarchy, transport, self.compression, collective,
                                        log=not decides)    # Auto's decision: settle logs it
        #: Auto's flat-or-hierarchical decision (hier_choice.py), or None
        self.hierarchy, self.hierarchy_choice = settle(
            self.hierarchy, self.auto if hierarchy == "auto" else None, transport, allreduce,
            self.entries, collective, len(self.buckets), fusion_bytes is not None)
        across = None                  # the hierarchy's collective across hosts
        if self.hierarchy is not None:
            if collective == "reduce_scatter" and self.hierarchy[1].size > 1 and self.fused:
                across = self.buckets
            for e in self.entries.values():
                e.hier = (not e.allreduce and not e.rounds and e.param.numel() > 0
                          and qualifies(e.param, min_compress_numel, compress_1d)
                          and refusal(e.compressor) is None
                          and (self.hierarchy_choice is None
                               or self.hierarchy_choice.paths.get(e.name) == "hierarchical"))
                e.scatter = e.scatter and not e.hier
            if not any(e.hier for e in self.entries.values()):
                for t in self.hierarchy[:2]:        # nothing to compress: all flat
                    t.close()
                    if hasattr(t, "free"):
                        t.free()
        # the carriers' name prefixes too: Horovod matches collectives by name
        self.ident = int(ident) & 0xFFFFFFFF
        carriers = {"transport": transport.name, "exchange id": self.ident,
                    "transport prefix": getattr(transport, "prefix", ""),
                    "allreduce prefix": allreduce.prefix if allreduce is not None else None,
                    "hierarchy": (None if self.hierarchy is None
                                  else list(self.hierarchy[2].hosts))}
        # the settings were agreed before planning (above, or by the door's handshake)
        handshake(transport, carriers, self.buckets, self.entries)
        # (MPI's CUDA support matters to the MPI-based carriers only)
        self.cuda_aware = (report_cuda(named_params, self.rank)
                           if transport.name in ("mpi", "horovod") else None)
        if self.rank == 0:
            report_plan(self)
        self.averaging = Averaging(self.size, average, predivide, sparse_as_dense)
        if self.hierarchy is not None and any(e.hier for e in self.entries.values()):
            host, cross, _ = self.hierarchy
            self.collective = Hierarchical(transport, allreduce, host, cross, self.averaging,
                                           self.seed, self.entries, len(self.entries),
                                           self.ident, buckets=across)
        else:
            self.collective = flat_collective(self)
        self.pipeline = Pipeline(self.buckets, self.entries, self.collective)
        if transport.interprocess:
            shutdown.register(self.pipeline, self.rank)
        self._check_replicas = bool(check_replicas)
        self.params_before: Optional[List[torch.Tensor]] = None

    @property
    def entries(self) -> Dict[str, Entry]:
        """{name: :class:`~hvdcomp.exchange.plan.Entry`} in registration order."""
        return self.plan.entries

    @property
    def compression(self) -> Compressor:
        """The compressor (with Auto, Auto's compressor)."""
        return self.plan.compression

    @property
    def auto(self) -> Optional[Auto]:
        """The Auto that made the plan (its ``model``: the measured costs), or None."""
        return self.plan.auto

    @property
    def cost_model(self):
        """With an Auto, its measured :class:`hvdcomp.auto.CostModel` (link and codec
        costs, ``as_dict()``); None otherwise."""
        return self.plan.auto.model if self.plan.auto is not None else None

    def second_stages(self) -> list:
        """The reduce-scatter's second-stage compressors with state of their own, else []."""
        c = self.collective
        return c.second_stages() if isinstance(c, (ReduceScatter, Hierarchical)) else []

    # --- per step -------------------------------------------------------------------
    @property
    def in_step(self) -> bool:
        """Whether a step has begun and not finished."""
        return self.pipeline.in_step

    @property
    def results(self) -> Dict[str, torch.Tensor]:
        """{name: averaged gradient} of the tensors averaged so far in this step."""
        return self.pipeline.results

    def begin(self, step: int, joined: bool = False, sync: bool = False) -> None:
        """Start step ``step`` (before the first ``ready``).  ``joined``: this rank has
        joined (``hvd.join()``) and takes part in the others' step with no gradients;
        ``sync``: the step was started by synchronize()/step(), not by a backward pass
        (ranks must agree on it: a rank that calls step() twice is out of step).  The first
        call compares the parameters' values across ranks (``check_replicas``):
        :class:`~hvdcomp.errors.Mismatch` on every rank if they differ."""
        self.check_replicas_once()
        self.averaging.joined = bool(joined)
        self.pipeline.begin(step, sync)

    def set_joined(self, joined: bool) -> None:
        """For :meth:`call` (between steps; ``begin`` sets it for a step): whether this rank
        has joined and takes part in the others' calls with no gradients (DDP's Join)."""
        self.averaging.joined = bool(joined)

    def ready(self, name: str) -> None:
        """The gradient of ``name`` is final for this step; its bucket goes when complete.
        RuntimeError outside a step."""
        self.pipeline.ready(name)

    def finish(self) -> Tuple[Dict[str, torch.Tensor], StepStats]:
        """Submit what is left, wait, and return {name: averaged gradient} and the step's
        statistics.  An average is flat float32, or a sparse COO tensor of the parameter's
        shape for a sparse gradient sent as indices and values.  A tensor that no rank had
        a gradient for (``param.grad`` None on every rank, e.g. frozen) has no entry; one
        that some ranks lack counts zeros from them (see :mod:`.averaging` for the
        compressors that keep per-rank state).  The averaged gradients of compressed
        tensors live in buffers that the next step reuses: copy what you keep.  Re-raises
        the step's first error (e.g. WireFormatError, or a RuntimeError naming a rank that
        failed to encode) on the calling thread, and those of :meth:`settle_plan`."""
        results, stats = self.pipeline.finish()
        if self.layer is not None and self.layer.pending:
            self.layer.record(None if self.averaging.joined else
                              {n: self.entries[n].param.grad for n in self.layer.shapes})
            results = self.settle_plan(stats.step, results)
        return results, stats

    def settle_plan(self, step: int, results: Optional[dict] = None) -> Optional[dict]:
        """A per-layer Auto's plan, while pending: decided from the first step's gradients
        (``step``: its number), adopted, then tried (:mod:`.plan_trial`; collective);
        returns ``results`` (that step's averages), copied if a trial reuses their buffers."""
        if self.layer is not None and self.layer.pending:
            grads = self.layer.settle(self.plan, self.transport)
            rebuild_flat(self)
            results = plan_trial.run(self, grads, step, rebuild_flat, results)
        return results

    def check_replicas_once(self) -> None:
        """The first time only, if built with ``check_replicas``: compare the parameters'
        values across ranks (:func:`~.buckets.check_replicas`; collective, with no
        collective of this exchange in flight: ``begin`` calls it, the DDP hook before its
        first ``call``).  :class:`~hvdcomp.errors.Mismatch` on every rank if they differ."""
        if self._check_replicas:
            self._check_replicas = False
            check_replicas(self.transport, [(e.name, e.param) for e in self.entries.values()])

    def call(self, k: int, names: Sequence[str], grads: Dict[str, torch.Tensor], step: int,
             done: Done, failure: Optional[BaseException] = None,
             out: Optional[Dict[str, torch.Tensor]] = None) -> None:
        """Exchange the gradients ``grads`` ({name: gradient} for each of ``names``, read on
        the encode thread: leave them unchanged until ``done``) of step ``step`` now, as one
        collective bucket numbered ``k``, and return at once; ``done(results, stats,
        error)`` runs on the pipeline's decode thread when they are averaged
        (:meth:`hvdcomp.exchange.pipeline.Calls.call`): {name: average, flat float32, reused
        by the next call of the same tensor} and the call's own statistics, or ({}, stats,
        the exception) after an error, raised on every rank.  ``done`` must not raise (what
        it raises is logged and dropped).  Every rank makes the same calls in the same
        order.  ``failure``: this rank could not prepare the call (it still makes the
        collectives, contributing nothing; every rank's ``done`` gets an error: this rank
        ``failure``, the others a RuntimeError naming it).  ``out``: {name: tensor} where
        the averages may be written (a contiguous float32 tensor of the parameter's numel;
        the DDP hook passes its bucket's views, which the encoder has read by then), saving
        a copy; the results are then those tensors, flattened.  ValueError for a name the
        exchange does not hold; RuntimeError during a step of begin / ready / finish."""
        unknown = [n for n in names if n not in self.entries]
        if unknown:
            raise ValueError(f"call(): not parameters of this exchange: {unknown}")
        if self.layer is not None and self.layer.pending and not self.averaging.joined:
            self.layer.record(grads, copy=True)
        self.pipeline.call(k, [self.entries[n] for n in names], step, grads, done, failure,
                           out)

    def close(self) -> None:
        """Stop the worker threads (they hold this exchange, its buffers and its compressors'
        state until then).  Call between steps; the exchange cannot be used afterwards."""
        self.pipeline.close()
        transport = getattr(self.collective, "transport", None)
        if transport is not None:
            transport.close()           # stop listening for farewells


def scatter_key(ex: "Exchange") -> tuple:
    """(name, compressor instance id) of each entry of ``ex`` marked ``scatter``: what a
    reduce-scatter's layout and second stages are built for."""
    return tuple(sorted((n, id(e.compressor)) for n, e in ex.entries.items() if e.scatter))


def flat_collective(ex: "Exchange"):
    """A ReduceScatter for the entries of ``ex`` marked ``scatter`` (its layout: theirs, in
    the fusion buckets), an Allgather when none is; ``ex.scattered`` records what it was
    built for (:func:`scatter_key`)."""
    ex.scattered = scatter_key(ex)
    if ex.scattered:
        return ReduceScatter(ex.transport, ex.allreduce, ex.averaging, ex.seed, ex.buckets,
                             ex.entries, len(ex.entries), ex.ident)
    return Allgather(ex.transport, ex.allreduce, ex.averaging, ex.seed, ex.ident)


def rebuild_flat(ex: "Exchange") -> None:
    """After a per-layer plan was adopted (decided, or loaded from a checkpoint): if the
    tensors of ``ex`` marked for the reduce-scatter are not those its flat collective
    serves, build it anew for them (between steps: the pipeline's threads are stopped first
    and start again with the next call; a hierarchical exchange keeps its collective)."""
    if scatter_key(ex) == getattr(ex, "scattered", ()) or isinstance(ex.collective,
                                                                     Hierarchical):
        return
    ex.pipeline.stop()
    # (the old one is not closed: Allgather.close clears the averaging buffers, which hold
    # the averages the caller has just been given)
    ex.collective = ex.pipeline.collective = flat_collective(ex)


def report_cuda(named_params: Sequence[Tuple[str, torch.Tensor]], rank: int) -> Optional[bool]:
    """With CUDA parameters, whether MPI is CUDA-aware (None: unknown), also logged (INFO,
    rank 0, :mod:`hvdcomp.log`); None without.  Their gradients are encoded and decoded on
    their device; the compressed messages are staged through host memory for the
    collective."""
    if not any(p.is_cuda for _, p in named_params):
        return None
    aware = cuda_aware()
    if rank == 0:
        logger.info("CUDA parameters; MPI CUDA-aware: %s; compressed messages are staged "
                    "through host memory", {True: "yes", False: "no", None: "unknown"}[aware])
    return aware


def report_plan(ex: "Exchange") -> None:
    """Log (INFO) the exchange's start-up facts: transport, buckets (where the exchange
    forms them), and with an Auto how many tensors go each way and a one-line summary of
    the cost model it measured (:meth:`~hvdcomp.auto.CostModel.summary`; the whole model,
    and the hierarchy choice, at DEBUG)."""
    # (without fusion buckets the caller forms them, e.g. DDP: their number is its own)
    buckets = f" in {len(ex.buckets)} buckets" if ex.fused else ""
    # (with an Auto, the Auto's own spec: its inner compressor is only one of its paths)
    shown = ex.auto.spec() if ex.auto is not None else ex.compression.spec()
    logger.info("exchange: %d tensors%s, %d ranks, transport %s, compression %s",
                len(ex.entries), buckets, ex.size, ex.transport.name, shown)
    if ex.auto is not None:
        counts: Dict[str, int] = {}
        for e in ex.entries.values():
            counts[e.compressor.name] = counts.get(e.compressor.name, 0) + 1
        model = ex.cost_model
        summary = model.summary() if model is not None else "none"
        if ex.layer is not None and ex.layer.pending:
            # no plan yet: the first step's gradients decide it (LayerPlanner.log says it)
            logger.info("Auto per layer: plan pending; the first step sends every tensor "
                        "as fp32 (tensors per path in it: %s), the plan chosen from its "
                        "gradients is logged after it; cost model: %s", counts, summary)
        else:
            logger.info("Auto's plan (tensors per path): %s; cost model: %s", counts,
                        summary)
        logger.debug("Auto's cost model: %s", model.as_dict() if model is not None else None)
        if ex.hierarchy_choice is not None:     # (its decision: logged once, by settle)
            logger.debug("Auto's hierarchy: %s", ex.hierarchy_choice.as_dict())
