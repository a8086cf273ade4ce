"""The plan: which compressor each tensor travels with, and by which path.

Routing: non-float tensors, 1-D tensors (biases, norm layers; unless ``compress_1d``) and
tensors with fewer than ``min_compress_numel`` elements go uncompressed (``none``), as the
DGC and CGX reference codes do; the others use the compression.  A bfloat16 tensor that
would be cast to fp16 is sent as bf16 instead (the same bytes, and bfloat16's own range).  With an
:class:`hvdcomp.Auto`, the tensors that would be compressed get Auto's per-tensor choice
(fp32, fp16 or its compressor over a collective) from costs measured on every rank
together; with ``Auto(..., per_layer=True)`` they travel in fp32 at first (``layer_shapes``)
and get a compressor each after the first step (:mod:`.layer_plan`, :meth:`Plan.assign`).  A tensor whose compressor is summable (a dtype cast) travels through the
:class:`~hvdcomp.transport.Allreduce` carrier when there is one and it sums that dtype; all
others travel as wire messages: over the allgather, or, for the tensors that use the
compression, over the reduce-scatter (:mod:`hvdcomp.exchange.scatter`) when the collective
setting says so:

* "allgather": every wire message over the allgather;
* "reduce_scatter": the compressed tensors over the reduce-scatter (ConfigError on one rank,
  or for a compressor that refuses it: :func:`hvdcomp.exchange.shards.refusal`);
* "auto": per tensor, the one the cost model predicts faster (:mod:`hvdcomp.auto`; a plain
  compressor is planned as ``Auto(compressor, fallbacks=())``); the allgather alone on one
  rank or for a compressor that refuses the reduce-scatter.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ..auto import COLLECTIVES, Auto
from ..compressors import Compressor, TensorKey, get
from ..compressors.protocols import SummedRounds
from ..errors import ConfigError
from ..transport import Allreduce, Transport
from .buckets import agree
from .shards import refusal, second_stage

__all__ = ["Entry", "Plan", "qualifies", "route", "keep_range", "wire_dtype", "collectives"]


@dataclass
class Entry:
    """One tensor of the exchange.

    name: parameter name; param: the parameter (its ``grad`` is read); tensor_id: index in
    the name-sorted order (the wire header's tensor id); compressor: what it travels with;
    allreduce: summable and carried by the Allreduce carrier (else by wire messages);
    scatter: its messages go over the reduce-scatter (else over the allgather);
    rounds: its compressor sums it in rounds (:mod:`hvdcomp.exchange.rounds`: PowerSGD),
    by the Allreduce carrier when there is one, else by allgathers of float32 buffers;
    hier: it goes through the hierarchical exchange (:mod:`hvdcomp.exchange.hier`: summed
    inside the host, compressed only across hosts).
    """
    name: str
    param: torch.Tensor
    tensor_id: int
    compressor: Compressor
    allreduce: bool
    scatter: bool = False
    rounds: bool = False
    hier: bool = False

    @property
    def path(self) -> str:
        """"allreduce", "allgather", "reduce_scatter", "rounds" or "hierarchical"."""
        return ("allreduce" if self.allreduce else "rounds" if self.rounds else
                "hierarchical" if self.hier else
                "reduce_scatter" if self.scatter else "allgather")

    def key(self, step: int, rank: int, size: int, seed: int) -> TensorKey:
        """The tensor's key for ``rank``'s message of ``step``, with the parameter's shape
        and dtype (a gradient has them), so that decode checks the header's against them."""
        return TensorKey(self.name, self.tensor_id, step, rank, size, seed,
                         shape=tuple(self.param.shape), dtype=self.param.dtype)


def qualifies(p: torch.Tensor, min_numel: int, compress_1d: bool) -> bool:
    """Whether ``p``'s gradient uses the compression (module docstring: float, 2-D or more
    unless ``compress_1d``, at least ``min_numel`` elements)."""
    return (p.is_floating_point() and (p.dim() > 1 or compress_1d)
            and p.numel() >= min_numel)


def route(p: torch.Tensor, compression: Compressor, min_numel: int,
          compress_1d: bool) -> Compressor:
    """``compression`` for a tensor that qualifies, a NoneCompressor otherwise."""
    if not qualifies(p, min_numel, compress_1d):
        return get("none")
    return keep_range(compression, p)


def keep_range(comp: Compressor, p: torch.Tensor) -> Compressor:
    """What ``p``'s gradient travels with in place of ``comp`` (``Compressor.for_dtype``):
    ``comp``, except a bf16 for a bfloat16 tensor that ``comp`` would cast to fp16 (fp16
    cannot hold bfloat16's range; bf16 sends the gradient's own bytes)."""
    return comp.for_dtype(p.dtype)


def wire_dtype(comp: Compressor) -> torch.dtype:
    """The dtype a summable compressor's buffer is summed in: its ``wire_dtype``, float32
    for ``none`` (averages are float32 everywhere in hvdcomp)."""
    dt = getattr(comp, "wire_dtype", None)
    return torch.float32 if dt is None else dt


class Plan:
    """Every tensor's :class:`Entry` (``entries``, in registration order).

    named_params: [(name, parameter)]; names unique (ValueError otherwise).
    compression: a compressor, or an :class:`hvdcomp.Auto` (then ``auto`` is it and
      ``compression`` its compressor; its measurements are collectives: all ranks plan
      together, after agreeing on Auto's settings, RuntimeError if they do not).
    allreduce: the carrier of summable tensors, or None (everything as wire messages).
    collective: "allgather", "reduce_scatter" or "auto" (module docstring).  Raises
      ConfigError for "reduce_scatter" on one rank or with a compressor that refuses it.
    """

    def __init__(self, named_params: Sequence[Tuple[str, torch.Tensor]], compression,
                 transport: Transport, allreduce: Optional[Allreduce], *,
                 min_compress_numel: int, compress_1d: bool, collective: str = "allgather"):
        names = [n for n, _ in named_params]
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})
            raise ValueError(f"parameter names must be unique, repeated: {dup}")
        self.auto: Optional[Auto] = None
        if isinstance(compression, Auto):
            self.auto, compression = compression, compression.compressor
            if isinstance(compression, SummedRounds) and not self.auto.per_layer:
                raise ConfigError(f"{compression.name} is summed by allreduces in rounds, "
                                  f"which Auto's cost model does not plan; pass it without "
                                  f"Auto")
        self.compression: Compressor = compression
        layer = self.auto is not None and self.auto.per_layer
        if layer and collective == "reduce_scatter":
            raise ConfigError("Auto(per_layer=True) plans the allgather exchange (its "
                              "reduce-scatter's shards are fixed before the errors are "
                              "measured: hvdcomp.exchange.layer_plan); use collective="
                              "'allgather' or 'auto'")
        allowed = ["allgather"] if layer else collectives(compression, collective,
                                                         transport.size)
        self.allreduce = allreduce
        #: {name: shape} of the tensors a per-layer Auto plans (:mod:`.layer_plan`), else {}
        self.layer_shapes: Dict[str, Tuple[int, ...]] = {}
        if self.auto is None and len(allowed) > 1:
            self.auto = Auto(compression, fallbacks=())     # only the collective to choose

        def routed(p):
            return route(p, compression, min_compress_numel, compress_1d)

        chosen: Dict[str, Tuple[Compressor, bool]] = {}
        if self.auto is not None:     # the cost model's choice for every tensor we would compress
            sizes = {n: p.numel() for n, p in named_params if routed(p) is compression}
            # agree on the settings before measuring: the measurements are collectives
            agree(transport, json.dumps([self.auto.settings(), allreduce is not None,
                                         allowed, sorted(sizes.items())]),
                  "the Auto settings")
            dev = next((p.device for n, p in named_params if n in sizes), None)
            if layer:       # fp32 until the first step's errors are measured (.layer_plan)
                self.layer_shapes = {n: tuple(p.shape) for n, p in named_params if n in sizes}
                chosen = {n: (get("none"), False) for n in sizes}
            else:
                chosen = self.auto.make_plan(sizes, transport, allreduce, device=dev,
                                             collectives=allowed, second_stage=second_stage)
        order = {n: i for i, n in enumerate(sorted(names))}
        self.entries: Dict[str, Entry] = {}
        for name, p in named_params:
            comp = routed(p)
            scatter = (allowed == ["reduce_scatter"]
                       and qualifies(p, min_compress_numel, compress_1d))
            if name in chosen:
                comp, scatter = chosen[name]
                comp = keep_range(comp, p)
            rounds = isinstance(comp, SummedRounds)
            summed = (not rounds and allreduce is not None and comp.summable
                      and wire_dtype(comp) in allreduce.dtypes)
            self.entries[name] = Entry(name, p, order[name], comp, summed,
                                       scatter and not summed and not rounds, rounds)

    def assign(self, name: str, comp: Compressor, scatter: bool = False) -> None:
        """From now on ``name`` travels with ``comp`` over the allgather, the allreduce
        carrier or in rounds, or with ``scatter`` over the reduce-scatter (a per-layer
        plan's choice: between steps, every rank alike; the exchange then matches its
        collective: :func:`hvdcomp.exchange.core.rebuild_flat`)."""
        e = self.entries[name]
        comp = keep_range(comp, e.param)
        e.rounds = isinstance(comp, SummedRounds)
        e.allreduce = (not e.rounds and self.allreduce is not None and comp.summable
                       and wire_dtype(comp) in self.allreduce.dtypes)
        e.scatter = bool(scatter) and not e.rounds and not e.allreduce
        e.compressor = comp

    def compressor_names(self) -> Dict[str, str]:
        """{parameter name: name of the compressor its gradient travels with}."""
        return {n: e.compressor.name for n, e in self.entries.items()}

    def compressor_specs(self) -> Dict[str, str]:
        """{parameter name: spec of the compressor its gradient travels with}."""
        return {n: e.compressor.spec() for n, e in self.entries.items()}

    def paths(self) -> Dict[str, str]:
        """{parameter name: "allreduce", "allgather", "reduce_scatter" or "rounds"}."""
        return {n: e.path for n, e in self.entries.items()}


def collectives(compression: Compressor, collective: str, size: int) -> List[str]:
    """The collectives the tensors that use ``compression`` may take, for the setting
    ``collective`` on ``size`` ranks (module docstring).  Raises ConfigError for an unknown
    setting, and for "reduce_scatter" on one rank or with a compressor that refuses it."""
    if collective not in COLLECTIVES:
        raise ConfigError(f"collective must be one of {', '.join(COLLECTIVES)}; "
                          f"got {collective!r}")
    why = refusal(compression)
    if collective == "reduce_scatter":
        if size < 2:
            raise ConfigError("collective='reduce_scatter' needs 2 or more ranks (this job "
                              "has 1); use 'allgather', or 'auto', which takes the "
                              "allgather on one rank")
        if why is not None:
            raise ConfigError(f"{compression.name} cannot travel over the reduce-scatter: "
                              f"{why}. Use collective='allgather' (or 'auto', which never "
                              f"picks the reduce-scatter for it)")
        return ["reduce_scatter"]
    if collective == "auto" and size > 1 and why is None:
        return ["allgather", "reduce_scatter"]
    return ["allgather"]
