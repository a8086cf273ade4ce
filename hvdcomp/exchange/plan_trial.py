"""A per-layer plan's trial: the plan timed against the user's compressor on every planned
tensor, end to end, and the faster kept.

Why: the per-layer plan (:mod:`.layer_plan`) minimizes *predicted* seconds, from codec
costs calibrated on synthetic matrices.  Where ranks share cores the calibration moves from
run to run (8 ranks on 2 cores: top-k 0.1 % calibrated at 4.3 to 22.9 ns per element in
five runs), and a plan it made could be slower than the compressor the user asked for
(BERT-base shapes, 8 ranks x 1 Gbit/s: top-k on every tensor, 1.66-1.93 s per exchange,
against PowerSGD rank 1's 1.32-1.59 s).  Timing the two plans as the exchange runs them
makes "no slower than the user's compressor" hold as measured, whatever the cost model got
wrong.

How (between the first and the second step, every rank together, after the plan is
decided, when the budget allows the user's compressor on every tensor, ``budget`` >= 1,
and the two plans differ; ``Auto(..., trial=N)``, N > 0):

* each rival (:func:`rivals`) gets fresh instances of its
  compressors, thrown away afterwards: the training's compressors start with no state,
  as without a trial;
* the exchange runs the first step's gradients with it: the drop-in optimizer over its
  fusion buckets (``begin`` / ``ready`` / ``finish``, its ``param.grad`` still the first
  step's), the DDP hook as one call of the planned tensors (DDP's buckets are not known
  here), numbered as the first step, with every compressor as from its steady state
  (PowerSGD's ``start_iter`` 0);
* one rival after the other (only one rival's compressor state in memory at a time), one
  untimed exchange (first use allocates), then N timed; a rival's seconds are the least
  over its N of the slowest rank's (one allgather of every rank's times: every rank decides
  alike);
* the faster is adopted (a tie keeps the plan), logged with both times (INFO, rank 0), and
  kept in the planner's ``trial``.

What it costs, once: 2 (N + 1) exchanges of the planned tensors; memory for a copy of the
first step's averages (the trial reuses the exchange's buffers) and one rival's compressor
state (e.g. a residual per tensor), freed after it (8 ranks of BERT-base's shapes on one
24 GiB machine, rivals kept together: killed for memory).  What it does not do: compare
other plans than these two (e.g. another compressor on every tensor), or time the exchange
overlapped with backward as training runs it.
"""
from __future__ import annotations

import gc
import threading
import time
from typing import Callable, Dict, Optional

import torch

from ..auto import _slowest
from ..compressors import get
from ..log import logger

__all__ = ["rivals", "run"]


def run(ex, grads: Dict[str, torch.Tensor], step: int,
        rebuild: Callable[[object], None]) -> Optional[Dict[str, float]]:
    """The trial of exchange ``ex``'s per-layer plan (module docstring; collective: every
    rank together, between steps, right after the plan was decided).  ``grads``: this rank's
    first-step gradients of the planned tensors ({name: tensor}; a missing one counts as
    zeros: the DDP hook's call needs every rank's), read by the DDP hook's call only;
    ``step``: the step just exchanged; ``rebuild(ex)``: matches the exchange's collective
    to its entries' paths (:func:`.core.rebuild_flat`).  Returns {"plan": s, "uniform": s} and adopts the
    faster, or None when there is no trial (``Auto.trial`` 0, or no rival)."""
    layer = ex.layer
    reps = layer.auto.trial
    tried = rivals(layer)
    if reps == 0 or not tried:
        return None
    labels = list(tried)
    mine: Dict[str, list] = {lab: [] for lab in labels}
    for lab in labels:
        fresh = {s: steady(get(s)) for s in sorted({c.spec for c in tried[lab].values()})}
        layer.adopt(ex.plan, tried[lab], fresh)
        try:
            rebuild(ex)
            mine[lab] = [exchange_once(ex, grads, step) for _ in range(reps + 1)][1:]
        finally:                  # (also after an error: the plan's own compressors back)
            layer.adopt(ex.plan)          # the rival's compressors and their state freed
            rebuild(ex)
        del fresh
        gc.collect()
    slow = _slowest(ex.transport, [t for lab in labels for t in mine[lab]])
    seconds = {lab: min(slow[i * reps:(i + 1) * reps]) for i, lab in enumerate(labels)}
    winner = min(labels, key=lambda lab: (seconds[lab], labels.index(lab)))
    layer.choose(tried[winner])
    layer.adopt(ex.plan)
    rebuild(ex)
    layer.trial = seconds
    if ex.rank == 0:
        logger.info("Auto per layer: trial of %d exchanges each: plan %.4g s, %s on every "
                    "tensor %.4g s; kept the %s", reps, seconds["plan"],
                    layer.auto.compressor.spec(), seconds["uniform"],
                    "plan" if winner == "plan" else "user's compressor on every tensor")
    return seconds


def rivals(layer) -> Dict[str, Dict[str, object]]:
    """What a trial compares: {"plan": the solver's choices, "uniform": the user's
    compressor on every tensor over its own path} of ``layer``
    (:class:`~.layer_plan.LayerPlanner`, decided) when the budget allows the latter
    (``budget`` >= 1) and the two differ; else {}."""
    differ = layer.uniform is not None and layer.uniform != layer.planned
    return {"plan": layer.planned, "uniform": layer.uniform} if differ else {}


def steady(comp):
    """``comp`` set to compress from its first step (PowerSGD's ``start_iter`` 0: the trial
    times what the steps after it cost)."""
    if getattr(comp, "start_iter", 0):
        comp.start_iter = 0
    return comp


def exchange_once(ex, grads: Dict[str, torch.Tensor], step: int) -> float:
    """Seconds of one exchange (module docstring) on this rank, until its averages are
    decoded (on a GPU, computed); raises what the exchange raises."""
    t0 = time.perf_counter()
    if ex.fused:
        p = ex.pipeline
        p.begin(step)
        for bucket in ex.buckets:
            for n in bucket:
                p.ready(n)
        p.finish()
    else:
        names = sorted(ex.layer.shapes, key=lambda n: ex.entries[n].tensor_id)
        given = {n: grads[n] if grads.get(n) is not None
                 else torch.zeros_like(ex.entries[n].param) for n in names}
        over = threading.Event()
        failed = []

        def done(_results, _stats, error):
            if error is not None:
                failed.append(error)
            over.set()

        ex.call(0, names, given, step, done)
        over.wait()
        if failed:
            raise failed[0]
    if any(e.param.is_cuda for e in ex.entries.values()):
        torch.cuda.synchronize()
    return time.perf_counter() - t0
