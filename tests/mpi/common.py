"""What the multi-rank workers share: golden inputs, the exchange driven as the optimizer
drives it, and the single-process reference it must match.

Every rank can rebuild every other rank's gradients from the seed, so one process can
encode all ranks' messages itself, decode them in rank order and average: the exchange must
deliver exactly that on every rank (bit for bit: the same float operations in the same
order).  The workers read the exchange's per-tensor layout (``Exchange.entries``,
``Exchange.buckets``, ``rank``, ``size``, ``seed``, ``compression``) and the optimizer's
private state (its exchange, its step count) only here (:func:`entries`,
:func:`exchange_of`, :func:`step_of`).
"""
from __future__ import annotations

import copy
import math
import os
import sys
from typing import Callable, Dict, List, Optional

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import horovod.torch as hvd  # noqa: E402
import hvdcomp  # noqa: E402
from hvdcomp.compressors.protocols import ReportsEvents  # noqa: E402
from hvdcomp.exchange import Exchange  # noqa: E402
from hvdcomp.transport import HorovodAllreduce, make  # noqa: E402

# name -> (shape, dtype); odd shapes, odd sizes, half precision, a tensor that is NaN on one
# rank, an all-zero one, a 1-element one, an empty one.
SPECS = {
    "conv.weight": ((7, 3, 5, 5), torch.float32),      # 525: not a multiple of buckets
    "fc1.weight": ((300, 41), torch.float32),           # 12300
    "fc1.bias": ((300,), torch.float32),
    "half.weight": ((33, 40), torch.float16),
    "bhalf.weight": ((40, 33), torch.bfloat16),
    "double.weight": ((50, 30), torch.float64),
    "zero.weight": ((64, 64), torch.float32),
    "nan.weight": ((40, 40), torch.float32),
    "one.weight": ((1, 1), torch.float32),
    "empty.weight": ((0, 5), torch.float32),
}

Grad = Callable[[str, int], torch.Tensor]         # (tensor name, rank) -> that rank's gradient


def golden_grad(name: str, rank: int, seed: int = 7) -> torch.Tensor:
    shape, dtype = SPECS[name]
    g = torch.Generator().manual_seed(seed * 1000 + rank * 37 + sum(map(ord, name)))
    x = torch.randn(shape, generator=g) * (1 + rank)
    if name == "zero.weight":
        x.zero_()
    if name == "nan.weight" and rank == 1:
        x.view(-1)[5] = float("nan")
    return x.to(dtype)


def params():
    return [(n, torch.nn.Parameter(torch.zeros(shape, dtype=dtype)))
            for n, (shape, dtype) in SPECS.items()]


# --------------------------------------------------------------------------------------------
# comparisons
# --------------------------------------------------------------------------------------------

def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-identical float tensors (NaN where the other has NaN)."""
    return a.shape == b.shape and torch.equal(torch.nan_to_num(a, nan=7.5),
                                              torch.nan_to_num(b, nan=7.5))


def assert_bit_exact(res: Dict[str, torch.Tensor], want: Dict[str, torch.Tensor], names,
                     where) -> int:
    """Every tensor of ``names`` is float32 and equal to the reference bit for bit; returns
    how many were compared."""
    for name in names:
        a, b = res[name], want[name]
        assert a.dtype == torch.float32 and a.shape == b.shape, (where, name, a.dtype, a.shape)
        assert same(a, b), (where, name, (a - b).abs().max())
    return len(names)


# --------------------------------------------------------------------------------------------
# the exchange's layout: the one place the workers read it
# --------------------------------------------------------------------------------------------

def exchange_of(opt) -> Exchange:
    """The optimizer's exchange (it has no public accessor)."""
    return opt._driver.exchange


def step_of(opt) -> int:
    """The optimizer's step count: the step of its next exchange (no public accessor)."""
    return opt._driver.step


def buckets(ex: Exchange) -> List[List[str]]:
    """The fusion buckets' tensor names, in the order they go on the wire."""
    return ex.buckets


def entries(ex: Exchange, bucket_order: bool = False) -> list:
    """Per tensor: ``name``, ``param``, ``tensor_id``, ``compressor``, ``allreduce`` (summed by
    Horovod's allreduce instead of the allgather); in registration order, or in the order
    the buckets go on the wire."""
    if bucket_order:
        return [ex.entries[n] for b in buckets(ex) for n in b]
    return list(ex.entries.values())


def compressed(ex: Exchange) -> List[str]:
    """Names of the tensors that travel with the exchange's compressor, sorted."""
    return sorted(e.name for e in entries(ex) if e.compressor is ex.compression)


# --------------------------------------------------------------------------------------------
# the exchange and its single-process reference
# --------------------------------------------------------------------------------------------

def make_exchange(comp, transport, named_params=None, **kw) -> Exchange:
    """The workers' exchange (over SPECS unless ``named_params``) on ``transport`` (a
    transport or its name): 20 kB fusion buckets (several of them), tensors of 16 elements
    and more compressed, seed 3, and everything through the allgather
    (allreduce_summable=False: none/fp16 too, so every tensor is compared bit for bit)."""
    kw = dict(dict(fusion_bytes=20000, min_compress_numel=16, seed=3,
                   allreduce_summable=False), **kw)
    tp = make(transport) if isinstance(transport, str) else transport
    summable = kw.pop("allreduce_summable")
    return Exchange(named_params or params(), comp, tp,
                    allreduce=HorovodAllreduce(hvd) if summable else None, **kw)


def exchange_step(ex: Exchange, step: int, grad: Grad):
    """One step as the optimizer drives it, with this rank's gradients ``grad(name, rank)``
    and the hooks in an order that differs per rank (the bucket order must still agree).
    Returns ``(results, stats)`` of ``Exchange.finish``."""
    names = [e.name for e in entries(ex)]
    for e in entries(ex):
        e.param.grad = grad(e.name, ex.rank)
    ex.begin(step)
    for name in (names if ex.rank % 2 == 0 else names[::-1]):
        ex.ready(name)
    return ex.finish()


def twins_of(comp, twins: list) -> Callable:
    """compressor_for: rank r's own compressor ``twins[r]`` for the tensors that travel with
    ``comp`` (stateful compressors keep state per rank), the tensor's compressor for the
    rest."""
    return lambda e, r: twins[r] if e.compressor is comp else e.compressor


def reference(ex: Exchange, step: int, grad: Grad, *, compressor_for: Callable = None,
              combine: bool = False, on_message: Callable = None):
    """What the exchange must deliver on this rank, computed in this one process.

    For every tensor, in bucket order: rank r's gradient ``grad(name, r)`` encoded by
    ``compressor_for(entry, r)`` (default: the tensor's compressor) with rank r's key, through
    bytes; decoded into a float32 accumulator in rank order (``combine``: by one combine()
    over all ranks' messages, as NDQSG needs); finalized with this rank's key.  NaN policy:
    a NONFINITE message or a non-finite average gives all-NaN.  ``on_message(name, r, msg,
    comp)`` sees every message.
    Returns ``({name: flat float32 average}, ["name: event", ...])``.
    """
    compressor_for = compressor_for or (lambda e, r: e.compressor)
    out, events = {}, []
    for e in entries(ex, bucket_order=True):
        comps = [compressor_for(e, r) for r in range(ex.size)]
        keys = [hvdcomp.TensorKey(e.name, e.tensor_id, step, r, ex.size, ex.seed)
                for r in range(ex.size)]
        msgs = []
        for r, (comp, key) in enumerate(zip(comps, keys)):
            msgs.append(hvdcomp.Message.from_bytes(comp.encode(grad(e.name, r), key)
                                                   .to_bytes()))
            if on_message is not None:
                on_message(e.name, r, msgs[-1], comp)
        acc = torch.zeros(e.param.numel(), dtype=torch.float32)
        mine = comps[ex.rank]
        if combine:
            finite = mine.combine(msgs, keys, acc)
        else:
            finite = True
            for comp, msg, key in zip(comps, msgs, keys):
                finite &= comp.decode(msg, key, acc)
        if isinstance(mine, ReportsEvents):
            events.extend(f"{e.name}: {ev}" for ev in mine.drain_events())
        if finite:
            mine.finalize(acc, keys[ex.rank])
            finite = bool(torch.isfinite(acc).all())
        out[e.name] = acc if finite else torch.full_like(acc, math.nan)
    return out, events


# --------------------------------------------------------------------------------------------
# the drop-in optimizer on a small model
# --------------------------------------------------------------------------------------------

LR = 0.1


def mlp():
    torch.manual_seed(11)
    return torch.nn.Sequential(torch.nn.Linear(20, 30), torch.nn.Tanh(), torch.nn.Linear(30, 4))


def local_grads(model, batches) -> Dict[str, torch.Tensor]:
    """The gradients one rank computes from ``batches`` [(x, y)] (summed over them)."""
    m = copy.deepcopy(model)
    m.zero_grad()
    for x, y in batches:
        F.cross_entropy(m(x), y).backward()
    return {n: p.grad.detach().clone() for n, p in m.named_parameters()}


def reference_grads(model, opt, step: int, grads: List[Dict[str, torch.Tensor]],
                    **kw) -> Dict[str, torch.Tensor]:
    """{name: the average over ranks that the optimizer's exchange must deliver}, from every
    rank's gradients ``grads[r]``; ``kw`` as for :func:`reference`."""
    avg, _ = reference(exchange_of(opt), step, lambda n, r: grads[r][n], **kw)
    return {n: avg[n].view(p.shape) for n, p in model.named_parameters()}


def sgd_reference(model, avg: Dict[str, torch.Tensor], lr: float = LR):
    """Plain SGD's step from the averaged gradients: p - lr * g."""
    return {n: p.detach().clone().add_(avg[n], alpha=-lr) for n, p in model.named_parameters()}


def sent_paths(opt) -> Dict[str, tuple]:
    """{name: (summed by Horovod's allreduce, compressor name)} of the drop-in's exchange
    now: taken before a step's backward, how that step sends each tensor (a per-layer Auto
    adopts its plan when its first exchange finishes, which may be inside backward)."""
    return {e.name: (e.allreduce, e.compressor.name) for e in entries(exchange_of(opt))}


def assert_params(model, opt, want: Dict[str, torch.Tensor], where, atol: float = 1e-7,
                  atol_fp16: float = 1e-4, sent: Optional[Dict[str, tuple]] = None) -> None:
    """The parameters after the drop-in's step equal ``want``: bit for bit where the exchange
    decoded in rank order; up to rtol 1e-6 and ``atol`` (``atol_fp16`` for fp16 sums) where
    Horovod's allreduce summed in MPI's order.  ``sent``: :func:`sent_paths` taken before
    the step (default: the exchange's paths now)."""
    sent = sent or sent_paths(opt)
    for e in entries(exchange_of(opt)):
        p = dict(model.named_parameters())[e.name].detach()
        allreduce, name = sent[e.name]
        if allreduce:
            tol = atol_fp16 if name == "fp16" else atol
            assert torch.allclose(p, want[e.name], rtol=1e-6, atol=tol), \
                (where, e.name, (p - want[e.name]).abs().max())
        else:
            assert torch.equal(p, want[e.name]), (where, e.name, (p - want[e.name]).abs().max())


# --------------------------------------------------------------------------------------------
# the scripts that are no assert scripts (worker_threads, worker_horovodrun, ...)
# --------------------------------------------------------------------------------------------

def say(rank, *a):
    """Report success: print, and leave a file per rank for the test that started the
    script to read (``$HVDCOMP_TEST_OUT/rank<r>.ok``)."""
    msg = " ".join(str(x) for x in a)
    print(f"[rank {rank}] {msg}", flush=True)
    out = os.environ.get("HVDCOMP_TEST_OUT")
    if out:
        with open(os.path.join(out, f"rank{rank}.ok"), "w") as f:
            f.write(msg)
