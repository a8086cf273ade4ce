"""Auto per layer: a compressor for each tensor, chosen under a total error budget.

``hvdcomp.Auto(compressor, per_layer=True, budget=1.0)`` (spec ``"auto+layer+alq:bits=3"``)
chooses, for every tensor that the exchange would compress, one of these candidates
(:func:`candidates`):

* fp32 and fp16 (Auto's ``fallbacks``), summed by the allreduce carrier (or, without one,
  sent as messages over the allgather);
* the user's compressor at its own settings and, for a compressor with a ``bits`` setting,
  its family at each of ``bits`` (default 2..5), over the allgather;
* top-k (:class:`hvdcomp.TopK`, error feedback) at each of ``densities``, over the allgather;
* PowerSGD (:class:`hvdcomp.PowerSGD`) at each of ``ranks``, summed in rounds by the
  allreduce carrier (:mod:`.rounds`);
* where the exchange may take the reduce-scatter (``collective="auto"``, 2 or more ranks,
  the exchange's own fusion buckets: the drop-in optimizer, not the DDP hook), each
  quantizer candidate (:func:`scatterable`) over the reduce-scatter as well.

All of these travel together in one exchange: the allgather collective carries each
tensor's messages with its own compressor, the sums of the casts and the rounds of PowerSGD
in the same fusion bucket (:class:`~.collective.Allgather`); a plan that sends some tensors
over the reduce-scatter makes the exchange build a :class:`~.scatter.ReduceScatter` for
them once the plan is adopted (:func:`hvdcomp.exchange.core.rebuild_flat`: its shard layout
depends on which tensors it carries), whose allgather part carries the others.  The
hierarchical exchange is left out (``hierarchy="auto"`` is flat with a per-layer Auto,
``"host"`` a ConfigError).

The choice minimizes the predicted step time subject to the budget (:func:`solve`):

    minimize  sum_i t_i(c_i) + sum_(b, k) L_k   subject to   sum_i e_i(c_i) <= B

``t_i(c)``: the predicted seconds of tensor i with candidate c on this job's measured link
and codec costs (:class:`hvdcomp.auto.CostModel`, fused: without the collectives'
latencies, which the second sum adds: ``L_k`` the measured latency of collective k, once
for every fusion bucket b where some tensor's choice runs it, :func:`collectives` and
:func:`solve_paths`, exact in one bucket and a heuristic in several; the DDP hook's
buckets are DDP's, unknown here, and counted as one; PowerSGD: its local rounds' measured
seconds per element plus its ``4 r (n + m)`` bytes through the allreduce; over the
reduce-scatter: CostModel's prediction with the candidate's first- and second-stage
costs).  ``e_i(c)``: the squared error of what training sees, the ranks' average, on
tensor i's real gradients of the first step, **measured** (:func:`measure_errors`):

    e_i(c) = || (1/N) sum_r (C(g_r) - g_r) ||^2        (N ranks with a finite gradient)

Each rank compresses and decompresses its own gradient with a fresh copy of each
candidate (as a world of one, so without error feedback's history, with a Philox seed of
its own: the ranks' stochastic roundings are independent, as in training), keeps the same
``S = min(numel, sample)`` pseudo-random coordinates of its residual ``C(g_r) - g_r`` as
every other rank (``sample``: Auto's setting, default 1024), and one allgather of all
tensors' and candidates' samples, summed in rank order, gives every rank the same
estimate ``(numel / S) ||(1/N) sum_r d_r[subset]||^2``, unbiased (exact when ``S =
numel``); every rank therefore computes the same plan.  This is the error that matters,
and one rank's error ``||C(g_r) - g_r||^2`` is not: an unbiased stochastic quantizer's
independent errors average out (about ``1/N`` of one rank's), while a biased,
deterministic method's (top-k, PowerSGD) on the ranks' similar gradients are aligned and
stay about one rank's.  Two corrections make the families comparable:

* a quantizer whose levels are fitted (ALQ, AMQ) is measured with a table fitted as its
  first refit would fit it, one per candidate, to the statistics of every planned tensor
  on every rank (:func:`fitted_levels`, the exchange's refit: a small sum and broadcast per candidate);
* a biased compressor (``Compressor.biased``: top-k, DGC, sign, PowerSGD, LAQ) is charged
  the variance of the unbiased compressor its contraction is worth, ``e / (1 - rho)``
  with ``rho`` the ranks' mean of ``||C(g_r) - g_r||^2 / ||g_r||^2`` on the whole tensor
  (:func:`effective_error`), not its one-step error, which its error feedback makes look
  small (top-k at 0.1 %: ``rho`` about 0.9, charged 10 times its error).

A candidate over the reduce-scatter is charged its error over the allgather plus its
second stage's (:func:`second_stage_errors`: the owners re-encode the average of the
ranks' decoded messages with the family at ``bits + 2``, an unbiased error that adds;
measured on a few buckets per tensor, one more allgather).

``B = budget x`` the total error of the user's compressor at its settings, charged the
same way, over the allgather (``budget=1.0``: no more error than the user's choice, which
is therefore always feasible; the user's compressor over the reduce-scatter adds its second
stage's error and needs a ``budget`` above 1, or other tensors to take less error).

What it costs, once: every candidate's encode and decode of every planned tensor on each
rank, and an allgather of ``tensors x (1 + candidates x (S + 1))`` float32 values per rank
(ResNet-50's 54 compressed weights, 11 candidates, ``S = 1024``: 2.4 MB per rank).
Its limits: it is one step's error, while error feedback (top-k, PowerSGD) carries what a
step leaves out into later steps, where biased errors accumulate and PowerSGD's warm start
improves on the first step's single power iteration (the contraction is a worst-case
exchange rate, not a measurement of training); and a compressor summed in rounds
(PowerSGD) is measured as each rank's own low-rank approximation, averaged, while the
exchange approximates the average with factors the ranks share.

Timeline: the exchange is built with the qualifying tensors in fp32 (exact); the first
step's gradients are recorded, and before the second step (the drop-in optimizer: at the
end of the first step's ``finish``; the DDP hook: when the second step begins) the errors
are measured and the plan is applied, on every rank together; then, unless
``Auto(..., trial=0)``, the plan is timed against the user's compressor on every tensor on
those gradients and the faster is kept (:mod:`.plan_trial`: the cost model's prediction
checked by measurement).  The plan, the budget and
every candidate's state are part of the exchange's checkpoint (:meth:`LayerPlanner.state_dict`):
a restart keeps the same plan.

The solver (:func:`solve`): dominated candidates dropped per tensor; a greedy start (from
the least-error choice, repeatedly the move with the most seconds saved per unit of error
added that still fits the budget: the Lagrangian's marginal rate); then an exact
branch-and-bound search (bounds: the remaining tensors' least error, and the linear
relaxation's least time within the error left: :class:`_LPBound`), which returns the
proven optimum, or the best found within ``max_nodes`` nodes (logged).

Per-layer choices under an error budget are those of L-GreCo (Markov et al., "L-GreCo:
Layerwise-adaptive gradient compression for efficient data-parallel deep learning", MLSys
2024, Sec. 3: a knapsack of per-layer compression errors), here with measured times in place
of a compression-ratio objective and PowerSGD and top-k among the choices.
"""
from __future__ import annotations

import bisect
import hashlib
import itertools
import json
import math
import time
from dataclasses import asdict, dataclass, replace
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from ..auto import (SAMPLE, Auto, CodecCost, CostModel, measure_codec, measure_link,
                    slowest_over_ranks)
from ..compressors import Compressor, TensorKey, get
from ..compressors.protocols import AdaptiveLevels, SummedRounds
from ..errors import ConfigError
from ..log import logger, warn_limited
from .buckets import agree
from .loop import refit
from .rounds import simulate
from .shards import refusal, second_stage as stage_two

__all__ = ["Choice", "LayerPlanner", "MIN_DELTA", "SAMPLE", "candidates", "effective_error",
           "fitted_levels", "measure_candidates", "measure_errors", "measure_key", "planner",
           "residual", "sample_index",
           "scatterable", "second_stage_errors", "solve", "stage2_buckets"]

#: Relative slack of the budget test (sums of the same errors in another order may differ
#: in the last bits).
SLACK = 1e-9
#: The search skips a branch that cannot beat the best plan by more than this factor.
NEAR = 1 - 1e-12
#: Prefix of a candidate's second-stage costs among the planner's ``codecs`` (the
#: reduce-scatter's re-encoding of the averages: :func:`~.shards.second_stage`)
STAGE2 = "stage2:"


def candidates(compressor: Compressor, fallbacks: Sequence[str] = ("none", "fp16"),
               bits: Sequence[int] = (2, 3, 4, 5), densities: Sequence[float] = (0.01, 0.001),
               ranks: Sequence[int] = (1, 2, 4)) -> List[Compressor]:
    """The candidates of a per-layer plan (module docstring), without duplicates (by spec),
    the user's ``compressor`` itself (its instance) first.  Bit widths outside the
    family's range are skipped.  ConfigError for a bad setting."""
    out: List[Compressor] = [compressor] + [get(f) for f in fallbacks]   # its own first
    s = compressor.settings()
    if "bits" in s:
        for b in bits:
            try:
                out.append(type(compressor)(**dict(s, bits=int(b))))
            except (ValueError, ConfigError):
                pass
    out += [get(f"topk:density={float(d)!r}") for d in densities]
    out += [get(f"powersgd:rank={int(r)}") for r in ranks]
    seen, uniq = set(), []
    for c in out:
        if c.spec() not in seen:
            seen.add(c.spec())
            uniq.append(c)
    return uniq


def measure_key(name: str, rank: int, seed: int = 0) -> TensorKey:
    """The key rank ``rank`` measures tensor ``name`` with (:func:`residual`): rank 0 of a
    world of one at step 0 (so that a decode needs no other rank's message and the result
    is this rank's contribution, undivided), with a Philox seed of its own derived from the
    exchange's ``seed``, ``rank`` and ``name`` (32 bits of BLAKE2b), so that the ranks'
    stochastic roundings are independent, as they are in training."""
    mixed = int.from_bytes(hashlib.blake2b(f"{int(seed)}:{int(rank)}:{name}".encode(),
                                           digest_size=4).digest(), "little")
    return TensorKey(name, 0, 0, 0, 1, mixed)


def residual(comp: Compressor, g: torch.Tensor, key: TensorKey,
             levels: Optional[np.ndarray] = None) -> torch.Tensor:
    """``C(g) - g``, flat float32 on ``g``'s device (a compressor summed in rounds: on the
    host), of one compress and decompress of ``g`` (any shape, float; a float16 / bfloat16
    gradient is cast first) by a fresh copy of ``comp`` (``comp``'s state is untouched,
    so error feedback has no history) with ``key`` (:func:`measure_key`; world size 1).
    A compressor whose levels are fitted to the gradients (ALQ, AMQ: AdaptiveLevels) is
    measured with a fitted table, as it trains after its first refit (its initial table is
    there for the first ``refit_steps[0]`` steps only, and errs several times more):
    ``levels`` (a payload of :func:`fitted_levels`), else one fitted to ``g`` alone.
    Meaningless for a non-finite ``g`` (:func:`measure_errors` skips those)."""
    fresh = get(comp.spec())
    g32 = g.detach().to(torch.float32)
    key = TensorKey(key.name, key.tensor_id, key.step, key.rank, key.world_size, key.seed,
                    shape=tuple(g.shape), dtype=torch.float32)
    if isinstance(fresh, AdaptiveLevels):          # the table it trains with once fitted
        if levels is None:
            fresh.observe(g32)
            levels = fresh.update(fresh.pending_stats(), 1)
        fresh.adopt(levels)
    if isinstance(fresh, SummedRounds):            # (simulate's buffers are on the host)
        g32 = g32.cpu()
        out = simulate([fresh], [g32], [key])[0]
    else:
        msg = fresh.encode(g32, key)
        out = torch.zeros(g32.numel(), device=g32.device)
        fresh.combine([msg], [key], out)
        out = fresh.finalize(out, key)
    return out.reshape(-1) - g32.reshape(-1)


def sample_index(name: str, numel: int, sample: int, seed: int = 0) -> Optional[np.ndarray]:
    """The coordinates of tensor ``name`` (``numel`` elements) whose error
    :func:`measure_errors` estimates from: None (all of them) when ``numel <= sample``,
    else ``sample`` distinct ones drawn uniformly without replacement (int64, increasing)
    by NumPy's Philox generator keyed by the exchange's ``seed`` and 64 bits of BLAKE2b of
    ``name`` (Python's ``hash`` differs between processes): the same on every rank."""
    if numel <= sample:
        return None
    return _drawn(name, numel, sample, seed)


def _drawn(label: str, population: int, size: int, seed: int) -> np.ndarray:
    """``size`` distinct integers of ``range(population)`` drawn uniformly without
    replacement (int64, increasing) by NumPy's Philox generator keyed by ``seed`` and 64
    bits of BLAKE2b of ``label`` (Python's ``hash`` differs between processes): the same on
    every rank."""
    tag = int.from_bytes(hashlib.blake2b(label.encode(), digest_size=8).digest(), "little")
    gen = np.random.Generator(np.random.Philox(key=[int(seed) & 0xFFFFFFFFFFFFFFFF, tag]))
    return np.sort(gen.choice(int(population), size=int(size), replace=False)).astype(np.int64)


def fitted_levels(cands: Sequence[Compressor], grads: Dict[str, Optional[torch.Tensor]],
                  transport) -> Dict[int, Optional[np.ndarray]]:
    """{index into ``cands``: level payload} for each candidate whose levels are fitted
    (AdaptiveLevels: ALQ, AMQ): one table per candidate, fitted by the exchange's own
    refit (:func:`~.loop.refit`: statistics summed across ranks, fitted on rank 0,
    broadcast) to every finite gradient of ``grads`` on every rank, as training's first
    refit fits the one table of a compressor instance; None where no rank had a finite
    gradient (the initial table stays).  Collective: every rank calls it with the same
    candidates."""
    out = {}
    for k, c in enumerate(cands):
        if not isinstance(c, AdaptiveLevels):
            continue
        fresh = get(c.spec())
        for g in grads.values():
            if g is not None and g.numel() and bool(torch.isfinite(g).all()):
                fresh.observe(g.detach().to(torch.float32))
        version = fresh.level_version
        refit(fresh, transport, 0)
        out[k] = fresh.levels.numpy() if fresh.level_version != version else None
    return out


def measure_errors(cands: Sequence[Compressor], grads: Dict[str, Optional[torch.Tensor]],
                   shapes: Dict[str, Tuple[int, ...]], transport, sample: int = SAMPLE,
                   seed: int = 0, with_ratios: bool = False,
                   tables: Optional[Dict[int, Optional[np.ndarray]]] = None):
    """{name: [error of each candidate]}: for each tensor of ``shapes`` ({name: shape},
    the same on every rank) and candidate c, an unbiased estimate of the squared error of
    the ranks' average, ``||(1/N) sum_r (C(g_r) - g_r)||^2`` over the N ranks whose
    gradient ``grads[name]`` (this rank's, of that shape, or None: it has none) was
    finite.  Each rank computes its residual ``d_r = C(g_r) - g_r`` (:func:`residual`,
    :func:`measure_key`: independent stochastic roundings per rank; fitted levels from
    :func:`fitted_levels`, one table per candidate over every tensor and rank) and keeps
    the ``S = min(numel, sample)`` coordinates of :func:`sample_index`; one allgather of
    every tensor's and candidate's samples (float32: the residuals are float32, so nothing
    is lost), summed in float64 in rank order, gives every rank the same ``s = sum_r
    d_r[subset]`` and the estimate ``(numel / S) ||s / N||^2`` (exact when ``S = numel``).
    A tensor no rank had a finite gradient for gets NaN errors.  ``with_ratios``: return
    ``(errors, ratios)``, ``ratios`` {name: [the mean over those ranks of
    ``||d_r||^2 / ||g_r||^2`` over the whole tensor (0 for a zero gradient), per
    candidate]} (the same allgather: a biased compressor's contraction,
    :func:`effective_error`).  ``tables``: :func:`fitted_levels`'s result when the caller
    has it (else fitted here).  ValueError (on every rank, after the collective) for a
    gradient of another numel than its shape's, or a ``sample`` below 1."""
    if int(sample) < 1:
        raise ValueError(f"sample must be >= 1, got {sample!r}")
    if tables is None:
        tables = fitted_levels(cands, grads, transport)
    names = sorted(shapes)
    K = len(cands)
    sizes = [int(np.prod(shapes[n])) for n in names]
    widths = [min(s, int(sample)) for s in sizes]
    offsets = np.cumsum([0] + [1 + K * (w + 1) for w in widths])   # count, samples, ratios
    vals = np.zeros(int(offsets[-1]), dtype=np.float32)
    for i, n in enumerate(names):
        g = grads.get(n)
        if g is None or not bool(torch.isfinite(g).all()):
            continue
        if g.numel() != sizes[i]:
            vals[int(offsets[i])] = -1.0                   # raised below, on every rank
            continue
        idx = sample_index(n, sizes[i], int(sample), seed)
        key = measure_key(n, transport.rank, seed)
        lo, w = int(offsets[i]), widths[i]
        vals[lo] = 1.0                                     # this rank counts
        norm2 = float(g.detach().double().pow(2).sum())
        for k, c in enumerate(cands):
            d = residual(c, g, key, tables.get(k))
            vals[lo + 1 + K * w + k] = float(d.double().pow(2).sum()) / norm2 if norm2 else 0.0
            if idx is not None:
                d = d[torch.from_numpy(idx).to(d.device)]
            vals[lo + 1 + k * w:lo + 1 + (k + 1) * w] = d.cpu().numpy()
    got = transport.allgather(vals.view(np.uint8))
    total = np.zeros(vals.shape, dtype=np.float64)
    for r, data in enumerate(got):                 # rank order: the same sum everywhere
        v = np.frombuffer(data.tobytes(), dtype=np.float32)
        bad = [n for i, n in enumerate(names) if v[int(offsets[i])] < 0]
        if bad:
            raise ValueError(f"rank {r}'s gradient of {bad[0]} does not have the "
                             f"{sizes[names.index(bad[0])]} elements of its shape "
                             f"{tuple(shapes[bad[0]])}")
        total += v
    out, ratios = {}, {}
    for i, n in enumerate(names):
        lo, w = int(offsets[i]), widths[i]
        count = total[lo]
        if count <= 0:
            out[n], ratios[n] = [math.nan] * K, [math.nan] * K
            continue
        mean = total[lo + 1:lo + 1 + K * w].reshape(K, w) / count
        scale = sizes[i] / w if w else 0.0
        out[n] = [float(scale * np.dot(m, m)) for m in mean]
        ratios[n] = [float(x) / count for x in total[lo + 1 + K * w:lo + 1 + K * (w + 1)]]
    return (out, ratios) if with_ratios else out


def scatterable(comp: Compressor) -> bool:
    """Whether a per-layer plan may send ``comp`` over the reduce-scatter
    (:mod:`.scatter`): per-rank wire messages that can be cut into shards
    (:func:`~.shards.refusal`), re-encoded by a second stage that keeps no state of its own
    and whose variance has a closed form (the quantizers' ``Finer``: the error
    :func:`second_stage_errors` charges).  Casts (summed by the carrier) and PowerSGD
    (summed in rounds) never are."""
    if comp.spec() in ("none", "fp16") or comp.summable or isinstance(comp, SummedRounds):
        return False
    if refusal(comp) is not None:
        return False
    two = stage_two(comp)
    return not two.keeps_state and hasattr(two, "variance")


#: Buckets of the second stage's variance estimate per tensor and candidate (at least; more
#: for small buckets: :func:`stage2_buckets`)
STAGE2_BUCKETS = 2


def stage2_buckets(name: str, numel: int, bucket: int, sample: int, seed: int = 0
                   ) -> np.ndarray:
    """The buckets (of ``bucket`` elements; the last may be short) of tensor ``name`` whose
    second-stage variance :func:`second_stage_errors` evaluates: all of them when there are
    at most ``max(STAGE2_BUCKETS, ceil(16 sample / bucket))``, else that many drawn without
    replacement, the same on every rank (NumPy's Philox keyed like :func:`sample_index`);
    int64, increasing."""
    nb = -(-int(numel) // int(bucket))
    m = max(STAGE2_BUCKETS, -(-16 * int(sample) // int(bucket)))
    if nb <= m:
        return np.arange(nb, dtype=np.int64)
    return _drawn(f"stage2:{name}", nb, m, seed)


def second_stage_errors(cands: Sequence[Compressor], which: Sequence[int],
                        grads: Dict[str, Optional[torch.Tensor]],
                        shapes: Dict[str, Tuple[int, ...]], transport, sample: int = SAMPLE,
                        seed: int = 0, tables: Optional[Dict[int, Optional[np.ndarray]]] = None
                        ) -> Dict[str, Dict[int, float]]:
    """{name: {k: e2}} for each tensor of ``shapes`` and each candidate index k of
    ``which`` (:func:`scatterable` ones): an estimate of the squared error the
    reduce-scatter's second stage adds to the ranks' average,

        e2 = E || Q2(b) - b ||^2 ,   b = (1/N) sum_r C(g_r) ,

    Q2 being the owner's re-encoding (``Compressor.second_stage``: the family at ``bits +
    2``, unbiased, so its error adds to the first stage's) of the average ``b`` of the
    ranks' decoded first-stage messages, which carries their quantization noise as well as
    the gradient.  Q2's variance is a sum over its buckets, each bucket's exact given the
    bucket (the quantizer's ``variance``: Faghri et al., "Adaptive gradient quantization for
    data-parallel SGD", NeurIPS 2020, Eq. 2): every rank decodes its own message (as
    :func:`measure_errors` does: :func:`residual`, :func:`measure_key`, levels from
    ``tables``), keeps the buckets of :func:`stage2_buckets` (the first stage's bucket
    size), and one allgather, summed in rank order, gives every rank the same ``b`` there;
    the estimate is their variance times (buckets / buckets kept): unbiased over the draw of
    buckets, exact when every bucket is kept (the reduce-scatter's owners bucket their
    shards from the shard's start, which this does not model).  NaN for a tensor no rank had
    a finite gradient for.  Collective."""
    names = sorted(shapes)
    which = list(which)
    tables = tables or {}
    sizes = [int(np.prod(shapes[n])) for n in names]
    # per tensor, per candidate: (element indices of the kept buckets, buckets / kept)
    spans: List[List[Tuple[np.ndarray, float]]] = []
    for n, size in zip(names, sizes):
        per = []
        for k in which:
            b = int(cands[k].bucket_size)
            kept = stage2_buckets(n, size, b, sample, seed)
            idx = (np.concatenate([np.arange(i * b, min((i + 1) * b, size)) for i in kept])
                   .astype(np.int64) if size else np.zeros(0, dtype=np.int64))
            per.append((idx, -(-size // b) / max(len(kept), 1)))
        spans.append(per)
    widths = [1 + sum(len(idx) for idx, _ in per) for per in spans]
    offsets = np.cumsum([0] + widths)
    vals = np.zeros(int(offsets[-1]), dtype=np.float32)
    for i, n in enumerate(names):
        g = grads.get(n)
        if (not which or g is None or g.numel() != sizes[i]
                or not bool(torch.isfinite(g).all())):
            continue                   # (a wrong numel: measure_errors has raised already)
        lo = int(offsets[i])
        vals[lo] = 1.0
        g32 = g.detach().to(torch.float32).reshape(-1)
        key = measure_key(n, transport.rank, seed)
        at = lo + 1
        for k, (idx, _) in zip(which, spans[i]):
            dec = (g32 + residual(cands[k], g, key, tables.get(k)).to(g32.device)).cpu()
            vals[at:at + len(idx)] = dec[torch.from_numpy(idx)].numpy()
            at += len(idx)
    got = transport.allgather(vals.view(np.uint8))
    total = np.zeros(vals.shape, dtype=np.float64)
    for data in got:                   # rank order: the same sum everywhere
        total += np.frombuffer(data.tobytes(), dtype=np.float32)
    out: Dict[str, Dict[int, float]] = {}
    for i, n in enumerate(names):
        lo = int(offsets[i])
        count = total[lo]
        if count <= 0:
            out[n] = {k: math.nan for k in which}
            continue
        out[n], at = {}, lo + 1
        for k, (idx, scale) in zip(which, spans[i]):
            avg = torch.from_numpy(total[at:at + len(idx)] / count)
            at += len(idx)
            fresh = get(cands[k].spec())
            if isinstance(fresh, AdaptiveLevels) and tables.get(k) is not None:
                fresh.adopt(tables[k])
            out[n][k] = float(stage_two(fresh).variance(avg)) * scale
    return out


#: The least contraction :func:`effective_error` credits a biased compressor with (its
#: residual as large as the gradient itself: no contraction measured).
MIN_DELTA = 1e-6


def effective_error(comp: Compressor, error: float, ratio: float) -> float:
    """The error the plan charges ``comp`` on a tensor: ``error`` (the squared error of the
    ranks' average, :func:`measure_errors`) for an unbiased compressor, whose error is a
    variance; for a biased one (``comp.biased``: top-k, DGC, sign, PowerSGD, LAQ,
    corrected by error feedback) the variance of the unbiased compressor its contraction
    is worth, ``error / delta`` with ``delta = 1 - ratio`` (at least :data:`MIN_DELTA`),
    ``ratio`` the ranks' mean of ``||C(g_r) - g_r||^2 / ||g_r||^2`` over the whole
    tensor (:func:`measure_errors` ``with_ratios``).

    Why: a compressor that keeps ``||C(x) - x||^2 <= (1 - delta) ||x||^2`` (contractive,
    biased) and an unbiased one of variance ``omega ||x||^2`` are matched by ``delta = 1 /
    (1 + omega)``, the scaled unbiased compressor ``C / (1 + omega)`` being
    ``delta``-contractive (Beznosikov, Horvath, Richtarik and Safaryan, "On biased
    compression for distributed learning", JMLR 24, 2023, Sec. 2; Stich, Cordonnier and
    Jaggi, NeurIPS 2018, Sec. 2): a step of it is worth ``1 / delta`` of an exact one.
    Charged at its one-step error instead, top-k at density 0.1 % (``ratio`` about 0.9)
    would look ten times better than its unbiased equivalent, and a plan of top-k
    everywhere would fit any budget an unbiased quantizer sets (measured on
    bench/real_task.py: 89.2 % against fp32's 90.1 %).  The contraction is measured per
    rank on the whole tensor (exact), not on the sampled coordinates, where top-k at 0.1 %
    keeps about one of 1024."""
    if not comp.biased:
        return float(error)
    return float(error) / max(1.0 - float(ratio), MIN_DELTA)


def _pareto(times: Sequence[float], errors: Sequence[float]) -> List[int]:
    """Indices of the options no other option beats in both time and error (ties: the
    first), by increasing error."""
    order = sorted(range(len(times)), key=lambda j: (errors[j], times[j], j))
    keep, best_t = [], math.inf
    for j in order:
        if times[j] < best_t:
            keep.append(j)
            best_t = times[j]
    return keep


def solve(times: Sequence[Sequence[float]], errors: Sequence[Sequence[float]], budget: float,
          max_nodes: int = 200_000) -> Tuple[List[int], bool]:
    """``(choice, proven)``: for each tensor i the index into ``times[i]`` / ``errors[i]``
    (seconds and squared error of each option, finite, >= 0) minimizing ``sum times``
    subject to ``sum errors <= budget`` (module docstring: greedy start, then branch and
    bound); ``proven``: the search finished (the choice is optimal; else it is the best
    found within ``max_nodes``).  ConfigError when even the least-error plan exceeds the budget (naming both)."""
    T = len(times)
    if T == 0:
        return [], True
    opts = [_pareto(times[i], errors[i]) for i in range(T)]
    cap = budget + SLACK * abs(budget)
    least = sum(errors[i][opts[i][0]] for i in range(T))
    if least > cap:
        raise ConfigError(f"hvdcomp.Auto(per_layer=True): error budget {budget:.6g} cannot be "
                          f"met: the least total error of any plan is {least:.6g}")
    # greedy: from the least-error plan, the best seconds saved per error added that fits
    pick = [0] * T                                # positions in opts[i]
    used = least
    while True:
        best = None
        for i in range(T):
            o, cur = opts[i], opts[i][pick[i]]
            for p in range(pick[i] + 1, len(o)):
                de = errors[i][o[p]] - errors[i][cur]
                dt = times[i][cur] - times[i][o[p]]
                if used + de <= cap and dt > 0:
                    rate = dt / de if de > 0 else math.inf
                    if best is None or rate > best[0]:
                        best = (rate, i, p, de)
        if best is None:
            break
        _, i, p, de = best
        pick[i], used = p, used + de
    inc = [opts[i][pick[i]] for i in range(T)]
    best_t = sum(times[i][inc[i]] for i in range(T))
    # branch and bound, tensors with the widest time spread first
    order = sorted(range(T), key=lambda i: -(times[i][opts[i][0]] - times[i][opts[i][-1]]))
    min_e = [errors[i][opts[i][0]] for i in order]
    rest_e = [sum(min_e[k:]) for k in range(T + 1)]
    bound = _LPBound([[(errors[i][j], times[i][j]) for j in opts[i]] for i in order])
    cur = [0] * T
    nodes = 0
    state = {"t": best_t, "sol": list(inc)}

    def dfs(k: int, t: float, e: float) -> bool:
        nonlocal nodes
        nodes += 1
        if nodes > max_nodes:
            return False
        if k == T:
            if t < state["t"]:
                sol = [0] * T
                for kk, i in enumerate(order):
                    sol[i] = cur[kk]
                state.update(t=t, sol=sol)
            return True
        i = order[k]
        for j in sorted(opts[i], key=lambda j: (times[i][j], errors[i][j], j)):
            t2, e2 = t + times[i][j], e + errors[i][j]
            if (e2 + rest_e[k + 1] > cap
                    or t2 + bound(k + 1, cap - e2 - rest_e[k + 1]) >= state["t"] * NEAR):
                continue
            cur[k] = j
            if not dfs(k + 1, t2, e2):
                return False
        return True

    proven = dfs(0, 0.0, 0.0)
    return state["sol"], proven


def collectives(options: Sequence[Tuple[int, str]], cands: Sequence[Compressor], link,
                carrier: bool) -> Tuple[List[Tuple[str, ...]], Dict[str, float]]:
    """The collectives each option ``(candidate index, path)`` runs, as :func:`solve_paths`
    takes them, and their fixed seconds on the measured ``link``
    (:class:`hvdcomp.auto.LinkCost`): the allgather of messages (``ag_latency``), the
    reduce-scatter's all-to-all and its own allgather of the averaged shards
    (``aa_latency`` + ``ag_latency``), fp16's allreduce (``ar_latency``) and PowerSGD's two
    rounds (2 ``ar_latency``).  fp32 (``none``) is charged nothing: the tensors the plan
    leaves out (biases, small ones) run its collective anyway; without a ``carrier`` that
    collective is the allgather, which fp16 and the compressors' messages then share
    (charged nothing), and PowerSGD's rounds are allgathers (2 ``ag_latency``)."""
    ar = link.ar_latency if carrier else link.ag_latency
    latency = {"allgather": link.ag_latency if carrier else 0.0,
               "all-to-all": link.aa_latency, "shard allgather": link.ag_latency,
               "allreduce fp16": ar, "rounds": 2 * ar}
    keys: List[Tuple[str, ...]] = []
    for k, path in options:
        spec = cands[k].spec()
        keys.append(() if spec == "none" else
                    ("all-to-all", "shard allgather") if path == "reduce_scatter" else
                    ("rounds",) if path == "rounds" else
                    ("allreduce fp16",) if path == "allreduce" else ("allgather",))
    return keys, latency


def solve_paths(times: Sequence[Sequence[float]], errors: Sequence[Sequence[float]],
                budget: float, keys: Sequence[Tuple[str, ...]], latency: Dict[str, float],
                buckets: Sequence[int] = (), max_nodes: int = 200_000
                ) -> Tuple[List[int], bool]:
    """:func:`solve` where a plan also pays each collective it uses once per fusion bucket:
    option j of every tensor runs the collectives ``keys[j]`` (names; empty: only ones the
    step runs anyway, charged nothing), ``latency[name]`` the fixed seconds of one,
    ``buckets[i]`` tensor i's fusion bucket (default: all in one).  Solves once for each
    set of the options' distinct ``keys`` (at most 2^4 = 16 solves with
    :func:`collectives`' four) restricted to it, and returns the plan of least ``sum
    times + sum over the (bucket, collective) pairs it uses of latency``: the optimum in
    one bucket (the best plan's own set is among those solved), a heuristic in several
    (each set is shared by every bucket).  ``proven``: every solve finished.  ConfigError
    as :func:`solve` when no plan meets the budget (the least-error plan over every
    collective exceeds it)."""
    T = len(times)
    buckets = list(buckets) or [0] * T
    groups = sorted({ks for ks in keys if ks})
    best: Optional[Tuple[float, List[int]]] = None
    all_proven = True
    for size in range(len(groups), -1, -1):
        for subset in itertools.combinations(groups, size):
            allowed = [j for j, ks in enumerate(keys) if not ks or ks in subset]
            if not allowed:
                continue
            try:
                pick, proven = solve([[t[j] for j in allowed] for t in times],
                                     [[e[j] for j in allowed] for e in errors], budget,
                                     max_nodes)
            except ConfigError:
                if size == len(groups):
                    raise                 # every collective allowed: no plan at all
                continue
            all_proven = all_proven and proven
            pick = [allowed[j] for j in pick]
            used = sorted({(buckets[i], k) for i, j in enumerate(pick) for k in keys[j]})
            total = (sum(times[i][j] for i, j in enumerate(pick))
                     + sum(latency[k] for _, k in used))      # (sorted: the same sum everywhere)
            if best is None or total < best[0]:
                best = (total, pick)
    assert best is not None
    return best[1], all_proven


class _LPBound:
    """The linear relaxation's least time of the tensors ``k..`` within an error allowance
    (Sinha and Zoltners, "The multiple-choice knapsack problem", Oper. Res. 27(3), 1979):
    from each tensor's least-error option, the segments of its lower convex hull in (error,
    time), taken by decreasing seconds saved per unit of error, the last one in part.
    ``options[k]``: tensor k's [(error, time)] by increasing error and decreasing time."""

    def __init__(self, options: Sequence[Sequence[Tuple[float, float]]]):
        T = len(options)
        segs: List[List[Tuple[float, float, float]]] = []    # per tensor (rate, de, dt)
        for o in options:
            hull = [o[0]]
            for pt in o[1:]:
                while len(hull) >= 2 and _rate(hull[-2], hull[-1]) <= _rate(hull[-2], pt):
                    hull.pop()
                hull.append(pt)
            segs.append([(_rate(a, b), b[0] - a[0], a[1] - b[1])
                         for a, b in zip(hull, hull[1:])])
        self.base = [0.0] * (T + 1)
        self.cum: List[Tuple[List[float], List[float], List[Tuple[float, float]]]] = []
        for k in range(T - 1, -1, -1):
            self.base[k] = self.base[k + 1] + options[k][0][1]
        for k in range(T + 1):
            pool = sorted((x for t in segs[k:] for x in t), key=lambda x: -x[0])
            ce, ct = [0.0], [0.0]
            for _, de, dt in pool:
                ce.append(ce[-1] + de)
                ct.append(ct[-1] + dt)
            self.cum.append((ce, ct, [(de, dt) for _, de, dt in pool]))

    def __call__(self, k: int, allowance: float) -> float:
        ce, ct, pool = self.cum[k]
        p = bisect.bisect_right(ce, allowance) - 1       # whole segments that fit
        saved = ct[p]
        if p < len(pool):
            de, dt = pool[p]
            saved += dt * (allowance - ce[p]) / de
        return self.base[k] - saved


def _rate(a: Tuple[float, float], b: Tuple[float, float]) -> float:
    """Seconds saved per unit of error added from option a to option b (error, time)."""
    return (a[1] - b[1]) / (b[0] - a[0])


@dataclass
class Choice:
    """One tensor's entry of the plan: ``spec`` of its compressor, ``path`` ("allreduce",
    "allgather", "reduce_scatter" or "rounds"), predicted ``bytes`` sent per rank and
    ``seconds``, measured squared ``error`` of the ranks' average (:func:`measure_errors`'s
    estimate)."""
    spec: str
    path: str
    bytes: float
    seconds: float
    error: float


class LayerPlanner:
    """The per-layer plan of one exchange (module docstring).

    auto: the :class:`hvdcomp.Auto` built with ``per_layer=True`` (its compressor,
    ``fallbacks``, ``budget`` factor, ``bits`` / ``densities`` / ``ranks``, ``sample``, and
    ``link`` / ``codecs`` given instead of measured); shapes: {name: shape} of the tensors
    it plans; transport / allreduce / device: as :meth:`hvdcomp.Auto.make_plan`; seed: the
    exchange's shared seed (the errors' sampled coordinates and Philox streams:
    :func:`measure_errors`); scatter: the exchange may send the :func:`scatterable`
    candidates over the reduce-scatter too (its own fusion buckets, 2 or more ranks: the
    plan then holds both options of each); buckets: the exchange's fusion buckets (names;
    each collective a plan uses is charged its latency once per bucket: :func:`solve_paths`;
    default one bucket).  Construction measures the link (with
    ``scatter``, its all-to-all too) and every candidate's codec costs (and second stage's)
    (collective: every rank together, the slowest rank's values).  ``pending`` until
    :meth:`decide`; ``choices``: {name: :class:`Choice`} (``planned``: the solver's, the
    same unless a trial kept the user's compressor; ``trial``: its seconds, else {});
    ``budget``: the absolute budget (sum of squared errors of the ranks' average) once
    decided.
    """

    def __init__(self, auto: Auto, shapes: Dict[str, Tuple[int, ...]], transport,
                 allreduce=None, device=None, seed: int = 0, scatter: bool = False,
                 buckets: Sequence[Sequence[str]] = ()):
        self.auto, self.shapes = auto, dict(shapes)
        self.bucket_of = {n: b for b, names in enumerate(buckets) for n in names}
        self.seed = int(seed)
        self.size = transport.size
        self.cands = candidates(auto.compressor, auto.fallbacks, auto.bits, auto.densities,
                                auto.ranks)
        self.by_spec = {c.spec(): c for c in self.cands}
        self.carrier = allreduce is not None
        self.dtypes = tuple(allreduce.dtypes) if allreduce is not None else ()
        #: specs of the candidates the plan may send over the reduce-scatter
        self.scattered = ({c.spec() for c in self.cands if scatterable(c)}
                          if scatter and self.size > 1 else set())
        #: (candidate index, path) of every option a tensor may take
        self.options: List[Tuple[int, str]] = (
            [(k, self.path(c)) for k, c in enumerate(self.cands)]
            + [(k, "reduce_scatter") for k, c in enumerate(self.cands)
               if c.spec() in self.scattered])
        self.pending = True
        self.first: Dict[str, Optional[torch.Tensor]] = {}    # this rank's first gradients
        self.choices: Dict[str, Choice] = {}
        # the solver's choices and the trial's rival (decide); the trial's seconds
        self.planned: Dict[str, Choice] = {}
        self.uniform: Optional[Dict[str, Choice]] = None
        self.trial: Dict[str, float] = {}
        self.budget: Optional[float] = None
        self.reference: Optional[float] = None       # the user's compressor's total error
        self.proven = True
        numel = auto.calibrate_numel
        link = auto.link or measure_link(transport, allreduce, device=device, large=min(
            max(4 * sum(int(np.prod(s)) for s in shapes.values()), 1 << 20), 8 << 20),
            alltoall=bool(self.scattered))
        self.codecs = measure_candidates(self.cands, auto.codecs or {}, self.scattered,
                                         transport, numel, device)
        self.model = CostModel(link, self.codecs["fp16"], self.size, allreduce is not None)
        auto.model = self.model

    # --- prediction --------------------------------------------------------------------
    def path(self, comp: Compressor) -> str:
        """"rounds", "allreduce" (summed by the carrier) or "allgather" (messages)."""
        if isinstance(comp, SummedRounds):
            return "rounds"
        wire = getattr(comp, "wire_dtype", None) or torch.float32
        return "allreduce" if comp.summable and wire in self.dtypes else "allgather"

    def predict(self, comp: Compressor, shape, path: Optional[str] = None
                ) -> Tuple[float, float]:
        """(seconds, bytes sent per rank) of one exchange of a tensor of ``shape`` with
        ``comp`` in a fusion bucket (module docstring); ``path`` "reduce_scatter": over the
        reduce-scatter (:class:`hvdcomp.auto.CostModel`'s prediction with this candidate's
        costs and its second stage's), else its own :meth:`path`."""
        n = int(np.prod(shape))
        m = self.model
        L, N = m.link, self.size
        if comp.spec() in ("none", "fp16"):
            return m.seconds(n, fused=True)[comp.spec()], (4 if comp.spec() == "none" else 2) * n
        C = self.codecs[comp.spec()]
        if path == "reduce_scatter":
            C2 = self.codecs[STAGE2 + comp.spec()]
            t = CostModel(L, C, N, self.carrier, C2).seconds(n, fused=True)[path]
            return t, N * C.message(n / N) + C2.message(n / N)
        if isinstance(comp, SummedRounds):
            nbytes = comp.message_bytes(tuple(shape))
            per_byte = L.ar_per_byte if self.carrier else L.ag_per_byte
            return C.encode(n) + per_byte * nbytes, nbytes
        nbytes = C.message(n)
        return C.encode(n) + L.ag_per_byte * nbytes + N * C.decode(n), nbytes

    # --- the decision ------------------------------------------------------------------
    def decide(self, grads: Dict[str, Optional[torch.Tensor]], transport) -> Dict[str, Choice]:
        """Measure every candidate's error on ``grads`` ({name: this rank's first gradient,
        of the parameter's shape, or None}; errors of the ranks' average, in the gradient's
        units squared: :func:`measure_errors`), solve,
        and record the plan (collective; every rank gets the same plan, logged on rank 0).
        A tensor no rank had a finite gradient for keeps the user's compressor (outside the
        budget).  ConfigError when the budget cannot be met (every rank alike);
        :class:`~hvdcomp.errors.Mismatch` if the ranks' plans differ (a digest check)."""
        tables = fitted_levels(self.cands, grads, transport)
        raw, ratios = measure_errors(self.cands, grads, self.shapes, transport,
                                     sample=self.auto.sample, seed=self.seed, with_ratios=True,
                                     tables=tables)
        which = [k for k, c in enumerate(self.cands) if c.spec() in self.scattered]
        second = (second_stage_errors(self.cands, which, grads, self.shapes, transport,
                                      sample=self.auto.sample, seed=self.seed, tables=tables)
                  if which else {})
        names = sorted(self.shapes)
        errs = {}
        for n in names:
            one = [effective_error(c, e, q) for c, e, q in zip(self.cands, raw[n], ratios[n])]
            errs[n] = [one[k] + (second[n][k] if path == "reduce_scatter" else 0.0)
                       for k, path in self.options]
        # the reference: the user's compressor over its own path (the allgather), the error
        # of the compressor at its settings; over the reduce-scatter it adds its second stage
        user = next(j for j, (k, _) in enumerate(self.options)
                    if self.cands[k] is self.auto.compressor)
        known = [n for n in names if not any(math.isnan(e) for e in errs[n])]
        pred = {n: [self.predict(self.cands[k], self.shapes[n], path)
                    for k, path in self.options] for n in names}
        self.reference = sum(errs[n][user] for n in known)
        self.budget = float(self.auto.budget) * self.reference
        keys, latency = collectives(self.options, self.cands, self.model.link, self.carrier)
        pick, self.proven = solve_paths([[p[0] for p in pred[n]] for n in known],
                                        [errs[n] for n in known], self.budget, keys, latency,
                                        [self.bucket_of.get(n, 0) for n in known],
                                        self.auto.max_nodes)
        chosen = dict(zip(known, pick))

        def choice(n: str, j: int) -> Choice:
            k, path = self.options[j]
            e = float(errs[n][j])
            return Choice(self.cands[k].spec(), path, float(pred[n][j][1]),
                          float(pred[n][j][0]), math.nan if math.isnan(e) else e)

        self.planned = {n: choice(n, chosen.get(n, user)) for n in names}
        self.choose(self.planned)
        # the user's compressor on every tensor: the plan's rival in a trial, where the
        # budget allows it (plan_trial.rivals)
        self.uniform = ({n: choice(n, user) for n in names}
                        if self.reference <= self.budget * (1 + SLACK) else None)
        self.pending = False
        # every rank computed it from the same numbers; the digest guards that promise
        agree(transport, json.dumps({n: asdict(c) for n, c in self.choices.items()},
                                    sort_keys=True), "the per-layer plan")
        if transport.rank == 0:
            self.log()
        return self.choices

    def choose(self, choices: Dict[str, Choice]) -> None:
        """Make ``choices`` the plan (then :meth:`adopt` it), recorded in the Auto's
        ``plan`` ({name: compressor name, "rs+" in front over the reduce-scatter})."""
        self.choices = dict(choices)
        for n, c in self.choices.items():
            self.auto.plan[n] = (("rs+" if c.path == "reduce_scatter" else "")
                                 + self.by_spec[c.spec].name)

    def record(self, grads: Optional[Dict[str, Optional[torch.Tensor]]],
               copy: bool = False) -> None:
        """Keep this rank's gradients of the planned tensors among ``grads`` ({name: tensor
        or None}; None: none, e.g. joined) for :meth:`settle`; ``copy``: clone them."""
        for n, g in (grads or {}).items():      # (a sparse gradient is not measured)
            if n in self.shapes and g is not None and not g.is_sparse:
                self.first[n] = g.detach().clone() if copy else g.detach()

    def settle(self, plan, transport) -> Dict[str, torch.Tensor]:
        """While pending: :meth:`decide` on the recorded gradients, then :meth:`adopt`
        (collective, between steps: every rank together); returns the recorded gradients
        ({} afterwards: nothing is done)."""
        if not self.pending:
            return {}
        got, self.first = self.first, {}
        self.decide(got, transport)
        self.adopt(plan)
        return got

    def adopt(self, plan, choices: Optional[Dict[str, Choice]] = None,
              instances: Optional[Dict[str, Compressor]] = None) -> None:
        """Send every planned tensor of ``plan`` (:class:`~.plan.Plan`) with its choice (the
        exchange then matches its collective to the tensors marked for the reduce-scatter:
        :func:`hvdcomp.exchange.core.rebuild_flat`).  ``choices`` / ``instances`` ({spec:
        compressor}): other choices, with other compressor instances (a trial's); default:
        the plan's, with the planner's own instances."""
        for name, c in (self.choices if choices is None else choices).items():
            comp = self.compressor(name) if instances is None else instances[c.spec]
            plan.assign(name, comp, scatter=c.path == "reduce_scatter")

    def compressor(self, name: str) -> Compressor:
        """The compressor instance ``name`` travels with (one instance per candidate)."""
        return self.by_spec[self.choices[name].spec]

    def log(self) -> None:
        """The plan, one line per tensor (INFO, :mod:`hvdcomp.log`)."""
        tot = self.totals()
        logger.info("Auto per layer: budget %.6g (x%.3g of %s's %.6g), plan error %.6g, "
                    "predicted %.6g s, %d bytes per rank%s", self.budget, self.auto.budget,
                    self.auto.compressor.spec(), self.reference, tot["error"],
                    tot["seconds"], tot["bytes"], "" if self.proven else " (not proven optimal)")
        for n, c in self.choices.items():
            logger.info("  %s: %s via %s, %d bytes, %.3g s, error %.4g", n, c.spec, c.path,
                        c.bytes, c.seconds, c.error)

    def totals(self) -> Dict[str, float]:
        """Sums over the plan's tensors of ``error`` (of those whose error was measured:
        a tensor no rank had a finite gradient for has none), ``seconds`` and ``bytes``."""
        cs = self.choices.values()
        return {"error": sum(c.error for c in cs if not math.isnan(c.error)), "seconds": sum(c.seconds for c in cs),
                "bytes": sum(c.bytes for c in cs)}

    # --- checkpoint --------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """``budget``, ``reference``, ``plan`` ({name: Choice as a dict}, {} while pending)
        and ``states`` ({candidate spec: its compressor's state_dict})."""
        return {"budget": self.budget, "reference": self.reference,
                "plan": {n: asdict(c) for n, c in self.choices.items()},
                "states": {s: c.state_dict() for s, c in self.by_spec.items()
                           if c is not self.auto.compressor}}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Adopt a :meth:`state_dict`'s plan and states.  ValueError when its tensors or
        candidates are not this planner's.  A tensor the plan sends over the reduce-scatter
        where this exchange offers none (one rank, collective="allgather", the DDP hook)
        travels over the allgather with the same compressor instead (no more error: the
        second stage's is gone), with a warning."""
        plan = state["plan"]
        if plan and set(plan) != set(self.shapes):
            raise ValueError(f"per-layer plan of tensors {sorted(plan)}, this exchange plans "
                             f"{sorted(self.shapes)}")
        bad = sorted({c["spec"] for c in plan.values()} - set(self.by_spec)
                     | set(state["states"]) - set(self.by_spec))
        if bad:
            raise ValueError(f"per-layer plan uses candidates {bad} that this Auto does not "
                             f"offer ({sorted(self.by_spec)})")
        for s, st in state["states"].items():
            self.by_spec[s].load_state_dict(st)
        self.budget, self.reference = state["budget"], state["reference"]
        got = {n: Choice(**c) for n, c in plan.items()}
        moved = sorted(n for n, c in got.items()
                       if c.path == "reduce_scatter" and c.spec not in self.scattered)
        self.choose({n: replace(c, path=self.path(self.by_spec[c.spec])) if n in moved else c
                     for n, c in got.items()})
        self.planned = self.choices              # (the checkpoint keeps the plan adopted)
        if moved:
            warn_limited(f"hvdcomp: the per-layer plan loaded sends {moved} over the "
                         f"reduce-scatter, which this exchange does not offer (it needs 2 or "
                         f"more ranks, collective='auto' and the exchange's own fusion "
                         f"buckets: the drop-in optimizer, not the DDP hook); they travel over "
                         f"the allgather with the same compressors")
        self.pending = not plan


def measure_candidates(cands: Sequence[Compressor], given: Dict[str, CodecCost],
                       scattered, transport, numel: int, device=None) -> Dict[str, CodecCost]:
    """{spec: CodecCost} of every candidate among ``cands`` not in ``given`` (and, prefixed
    :data:`STAGE2`, the second stage of each spec in ``scattered``), measured on every rank
    together on ``numel`` elements (the slowest rank's; :data:`CALIBRATE_REPS` timed
    repetitions, the least kept), with ``given`` and "fp16"; each logged at DEBUG."""
    codecs = dict(given)
    by_spec = {c.spec(): c for c in cands}
    rounds = [c for c in cands if isinstance(c, SummedRounds) and c.spec() not in codecs]
    if rounds:               # untimed: a process's first large allocations page-fault
        _measure_rounds(rounds[0], transport, numel)
    for c in cands:
        if c.spec() in codecs or c.spec() in ("none", "fp16"):
            continue
        if isinstance(c, SummedRounds):
            codecs[c.spec()] = _measure_rounds(c, transport, numel, CALIBRATE_REPS)
        else:
            codecs[c.spec()] = measure_codec(c, transport, numel, device=device,
                                             reps=CALIBRATE_REPS)
    monotone_in_rank(rounds, codecs)
    for spec in sorted(scattered):
        if STAGE2 + spec not in codecs:
            codecs[STAGE2 + spec] = measure_codec(by_spec[spec], transport, numel,
                                                  device=device, second_stage=stage_two)
    if "fp16" not in codecs:
        some = next((v for k, v in codecs.items() if v.fp16_per_elem > 0), None)
        codecs["fp16"] = some or CodecCost(0, 0, 0, 0, 0, 2, 0.0)
    for spec, c in sorted(codecs.items()):
        logger.debug("Auto per layer: candidate %s: encode %.3g s + %.3g ns/element, "
                     "decode %.3g s + %.3g ns/element, %.4g bytes/element", spec,
                     c.encode_fixed, 1e9 * c.encode_per_elem, c.decode_fixed,
                     1e9 * c.decode_per_elem, c.bytes_per_elem)
    return codecs


def monotone_in_rank(cands: Sequence[Compressor], codecs: Dict[str, CodecCost]) -> None:
    """Measured costs of low-rank candidates made non-decreasing in their ``rank``, in
    place: a candidate's seconds per element become the least measured at its rank or any
    higher rank of the same compressor with the same other settings (rank r's products and orthogonalization are a part of
    rank r' > r's work, and its elementwise passes are the same).  Timings on a shared
    machine are noisy, and the first measured also pays the process's first page faults
    (rank 1 at 8.3 ns per element first, 2.0 after, in one process here); a plan that
    trusted them chose PowerSGD rank 2 over rank 1 under a budget rank 1 met
    (bench/results/scaling.md, resnet50 8 x 1 Gbit/s)."""
    def others(c):           # the spec but its rank: the settings that must agree
        name, _, rest = c.spec().partition(":")
        return name, tuple(kv for kv in rest.split(",") if not kv.startswith("rank="))

    ranked = [c for c in cands if getattr(c, "rank", None) is not None and c.spec() in codecs]
    for c in ranked:
        low = min(codecs[d.spec()].encode_per_elem for d in ranked
                  if others(d) == others(c) and d.rank >= c.rank)
        if low < codecs[c.spec()].encode_per_elem:
            codecs[c.spec()] = replace(codecs[c.spec()], encode_per_elem=low)


#: Timed repetitions per candidate (the least is kept; measure_codec's default is 2): the
#: plan compares candidates with each other, and with 2 the plans of 8 ranks on 2 cores
#: changed from run to run (PowerSGD rank 1, rank 2, top-k; bench/results/scaling.md).
CALIBRATE_REPS = 4


def _measure_rounds(comp: Compressor, transport, numel: int,
                    reps: int = CALIBRATE_REPS) -> CodecCost:
    """A compressor summed in rounds, timed as one rank's rounds (:func:`simulate`, a
    fresh copy each repetition) on a 1024-row matrix of about ``numel`` elements: seconds
    per element as ``encode``; its bytes come from ``message_bytes`` (slowest rank)."""
    rows = 1024
    cols = max(numel // rows, 8)
    gen = torch.Generator().manual_seed(12345 + transport.rank)
    x = torch.randn(rows, cols, generator=gen) * 1e-3     # (simulate runs on the host)
    key = TensorKey("hvdcomp.auto.calibration.rounds", 0, 0, 0, 1, 0, shape=(rows, cols),
                    dtype=torch.float32)
    best = math.inf
    for rep in range(reps + 1):                  # the first warms up
        fresh = get(comp.spec())
        t0 = time.perf_counter()
        simulate([fresh], [x], [key])
        if rep:
            best = min(best, time.perf_counter() - t0)
    (t,) = slowest_over_ranks(transport, [best])
    return CodecCost(0.0, t / (rows * cols), 0.0, 0.0, 0.0, 0.0)


def planner(plan, hierarchy: str, transport, allreduce=None, seed: int = 0,
            scatter: bool = False, buckets: Sequence[Sequence[str]] = ()
            ) -> Tuple[Optional[LayerPlanner], str]:
    """``(LayerPlanner or None, hierarchy)`` of an exchange's :class:`~.plan.Plan` (a
    planner where a per-layer Auto plans some tensors: built now, measuring the costs on
    every rank together; ``seed``: the exchange's; ``scatter``: the exchange may use the
    reduce-scatter, ``buckets``: its fusion buckets (names), :class:`LayerPlanner`) and
    the hierarchy it runs with: "flat"
    with a planner (module docstring; ConfigError for "host"), else ``hierarchy``
    unchanged."""
    if not plan.layer_shapes:
        return None, hierarchy
    if hierarchy == "host":
        raise ConfigError("Auto(per_layer=True) plans the flat exchange; use hierarchy="
                          "'flat' or 'auto' (flat with it)")
    dev = plan.entries[next(iter(plan.layer_shapes))].param.device
    return (LayerPlanner(plan.auto, plan.layer_shapes, transport, allreduce, device=dev,
                         seed=seed, scatter=scatter, buckets=buckets), "flat")
