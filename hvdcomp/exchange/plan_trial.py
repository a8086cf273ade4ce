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

When: right after the plan is decided (the drop-in optimizer: at the end of the first
step's ``finish``; the DDP hook: when the second step's first bucket is ready), every rank
together, if ``Auto(..., trial=N)`` has N > 0 and :func:`rivals` finds two: the user's
compressor on every tensor fits the error budget and differs from the plan.

How:

* each rival gets fresh instances of its compressors, thrown away afterwards: the
  training's compressors start with no state, as without a trial; each as in its steady
  state (``Compressor.steady_state``: without PowerSGD's ``start_iter`` or DGC's warm-up);
* the exchange runs the first step's gradients with it, numbered as the first step: the
  drop-in optimizer over its fusion buckets (``begin`` / ``ready`` / ``finish``, every
  tensor, its ``param.grad`` still the first step's), the DDP hook as one call of the
  planned tensors (DDP's buckets are not known here) into scratch buffers;
* one rival after the other (one rival's compressor state in memory at a time), one
  untimed exchange (first use allocates), then N timed; a rival's seconds are the least
  over its N of the slowest rank's (one allgather of every rank's times: every rank decides
  alike);
* a rival whose exchange raised (on every rank: the exchange raises a step's error
  everywhere) is logged and counts as infinitely slow; if both raised, the plan's error is
  raised (the first step's averages are lost then); a rank that left (OutOfStep) or
  disagrees (Mismatch) is raised at once;
* the faster is adopted (a tie keeps the plan), logged with both times (INFO, rank 0), and
  kept in the planner's ``trial``.

What it costs, once: 2 (N + 1) exchanges (the drop-in optimizer's of every tensor, the
DDP hook's of the planned ones); memory for a copy of the first step's averages (the
drop-in optimizer: the trial reuses the exchange's buffers; the DDP hook: scratch buffers
of the planned tensors) and one rival's compressor state (e.g. a residual per tensor),
freed after it (8 ranks of BERT-base's shapes on one 24 GiB machine, rivals kept
together: killed for memory).  What it does not do: compare other plans than these two
(e.g. another compressor on every tensor), time the exchange overlapped with backward as
training runs it, or see a steady state that needs history (LAQ's skipped uploads: its
first exchange sends every tensor).
"""
from __future__ import annotations

import gc
import math
import threading
import time
from typing import Callable, Dict, Optional

import torch

from ..auto import slowest_over_ranks
from ..compressors import get
from ..errors import Mismatch, OutOfStep
from ..log import logger, warn_limited

__all__ = ["rivals", "run"]


def rivals(layer) -> Dict[str, Dict[str, object]]:
    """What a trial compares: {"plan": the solver's choices, "uniform": the user's
    compressor on every tensor over its own path} of ``layer``
    (:class:`~.layer_plan.LayerPlanner`, decided) when the budget allows the latter (its
    total error within the budget: ``budget`` >= 1) and the two differ; else {}."""
    differ = layer.uniform is not None and layer.uniform != layer.planned
    return {"plan": layer.planned, "uniform": layer.uniform} if differ else {}


def run(ex, grads: Dict[str, torch.Tensor], step: int, rebuild: Callable[[object], None],
        results: Optional[dict] = None) -> Optional[dict]:
    """The trial of exchange ``ex``'s per-layer plan (module docstring; collective: every
    rank together, between steps, right after the plan was decided).  ``grads``: this
    rank's first-step gradients of the planned tensors ({name: tensor}; a missing one
    counts as zeros), read by the DDP hook's call only; ``step``: the first step's number;
    ``rebuild(ex)``: matches the exchange's collective to its entries' paths
    (:func:`.core.rebuild_flat`); ``results``: the first step's averages ({name: tensor},
    in the exchange's buffers), returned as they are, or copied when a trial runs (it
    reuses the buffers).  Adopts the faster rival and sets the planner's ``trial`` to
    {"plan": s, "uniform": s} (inf for a rival that raised); nothing when there is no trial
    (``Auto.trial`` 0, or no rivals).  Raises the plan's error if both rivals raised;
    OutOfStep and Mismatch at once."""
    layer = ex.layer
    reps = layer.auto.trial
    tried = rivals(layer)
    if reps == 0 or not tried:
        return results
    if results is not None:
        results = {n: t.clone() for n, t in results.items()}
    labels = list(tried)
    given, out, failure = scratch(ex, grads)
    mine: Dict[str, list] = {}
    errors: Dict[str, BaseException] = {}
    for lab in labels:
        specs = sorted({c.spec for c in tried[lab].values()})
        fresh = {s: get(s).steady_state() for s in specs}
        layer.adopt(ex.plan, tried[lab], fresh)
        try:
            rebuild(ex)
            mine[lab] = [exchange_once(ex, given, out, step, failure)
                         for _ in range(reps + 1)][1:]
        except (OutOfStep, Mismatch):
            raise
        except Exception as e:       # noqa: BLE001 - raised on every rank: scored, logged
            errors[lab], mine[lab] = e, [math.inf] * reps
            warn_limited(f"hvdcomp: Auto per layer's trial: the {lab} rival raised "
                         f"{type(e).__name__}: {e}; it counts as infinitely slow")
        finally:                  # (also after an error: the plan's own compressors back)
            layer.adopt(ex.plan)          # the rival's compressors and their state freed
            rebuild(ex)
        del fresh
        gc.collect()
    if len(errors) == len(labels):
        raise errors["plan"]
    slow = slowest_over_ranks(ex.transport, [t for lab in labels for t in mine[lab]])
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
    return results


def scratch(ex, grads: Dict[str, torch.Tensor]):
    """For the DDP hook's call (``ex`` without fusion buckets): ({name: gradient}, {name:
    scratch float32 buffer for its average}, None) of the planned tensors, zeros where this
    rank has no gradient; or ({}, {}, the exception) if making them raised on this rank (the
    call then carries it to every rank); in the exchange's tensor order.  The drop-in
    optimizer: ({}, {}, None)."""
    if ex.fused:
        return {}, {}, None
    names = sorted(ex.layer.shapes, key=lambda n: ex.entries[n].tensor_id)
    try:
        given = {n: grads[n] if grads.get(n) is not None
                 else torch.zeros_like(ex.entries[n].param) for n in names}
        out = {n: torch.empty(ex.entries[n].param.numel(), dtype=torch.float32,
                              device=ex.entries[n].param.device) for n in names}
        return given, out, None
    except Exception as e:        # noqa: BLE001 - handed to the call (every rank raises)
        return {n: torch.zeros(0) for n in names}, None, e


def exchange_once(ex, given: Dict[str, torch.Tensor], out, step: int,
                  failure: Optional[BaseException] = None) -> float:
    """Seconds of one exchange (module docstring) on this rank, until its averages are
    decoded (on GPUs, computed); raises what the exchange raises."""
    t0 = time.perf_counter()
    if ex.fused:
        p = ex.pipeline
        p.begin(step)
        for bucket in ex.buckets:
            for n in bucket:
                p.ready(n)
        p.finish()
    else:
        names = list(given)                 # (in tensor order: scratch)
        over = threading.Event()
        failed = []

        def done(_results, _stats, error):
            if error is not None:
                failed.append(error)
            over.set()

        ex.call(0, names, given, step, done, failure, out)
        over.wait()
        if failed:
            raise failed[0]
    for dev in {e.param.device for e in ex.entries.values() if e.param.is_cuda}:
        torch.cuda.synchronize(dev)
    return time.perf_counter() - t0
