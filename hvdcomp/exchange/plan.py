"""The plan: which compressor each tensor travels with, and by which path.

Routing: non-float tensors, 1-D tensors (biases, norm layers; unless ``compress_1d``) and
tensors with fewer than ``min_compress_numel`` elements go uncompressed (``none``), as the
DGC and CGX reference codes do; the others use the compression.  A bfloat16 tensor that
would be cast to fp16 is sent as bf16 instead (the same bytes, and bfloat16's own range).  With an
:class:`hvdcomp.Auto`, the tensors that would be compressed get Auto's per-tensor choice
(fp32, fp16 or its compressor) from costs measured on every rank together.  A tensor whose
compressor is summable (a dtype cast) travels through the
:class:`~hvdcomp.transport.Allreduce` carrier when there is one and it sums that dtype; all
others travel as wire messages.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Dict, Optional, Sequence, Tuple

import torch

from ..auto import Auto
from ..compressors import BF16, FP16, Compressor, NoneCompressor, TensorKey
from ..transport import Allreduce, Transport
from .buckets import agree

__all__ = ["Entry", "Plan", "route", "keep_range", "wire_dtype"]


@dataclass
class Entry:
    """One tensor of the exchange.

    name: parameter name; param: the parameter (its ``grad`` is read); tensor_id: index in
    the name-sorted order (the wire header's tensor id); compressor: what it travels with;
    allreduce: summable and carried by the Allreduce carrier (else by wire messages).
    """
    name: str
    param: torch.Tensor
    tensor_id: int
    compressor: Compressor
    allreduce: bool

    def key(self, step: int, rank: int, size: int, seed: int) -> TensorKey:
        """The tensor's key for ``rank``'s message of ``step``, with the parameter's shape
        and dtype (a gradient has them), so that decode checks the header's against them."""
        return TensorKey(self.name, self.tensor_id, step, rank, size, seed,
                         shape=tuple(self.param.shape), dtype=self.param.dtype)


def route(p: torch.Tensor, compression: Compressor, min_numel: int,
          compress_1d: bool) -> Compressor:
    """``compression`` for a tensor that qualifies, a NoneCompressor otherwise."""
    if not p.is_floating_point():
        return NoneCompressor()
    if p.dim() <= 1 and not compress_1d:
        return NoneCompressor()
    if p.numel() < min_numel:
        return NoneCompressor()
    return keep_range(compression, p)


def keep_range(comp: Compressor, p: torch.Tensor) -> Compressor:
    """``comp``, except a BF16 for a bfloat16 tensor that ``comp`` would cast to fp16 (fp16
    cannot hold bfloat16's range; bf16 sends the gradient's own bytes)."""
    return BF16() if isinstance(comp, FP16) and p.dtype == torch.bfloat16 else comp


def wire_dtype(comp: Compressor) -> torch.dtype:
    """The dtype a summable compressor's buffer is summed in: its ``wire_dtype``, float32
    for ``none`` (averages are float32 everywhere in hvdcomp)."""
    return getattr(comp, "wire_dtype", torch.float32)


class Plan:
    """Every tensor's :class:`Entry` (``entries``, in registration order).

    named_params: [(name, parameter)]; names unique (ValueError otherwise).
    compression: a compressor, or an :class:`hvdcomp.Auto` (then ``auto`` is it and
      ``compression`` its compressor; its measurements are collectives: all ranks plan
      together, after agreeing on Auto's settings, RuntimeError if they do not).
    allreduce: the carrier of summable tensors, or None (everything as wire messages).
    """

    def __init__(self, named_params: Sequence[Tuple[str, torch.Tensor]], compression,
                 transport: Transport, allreduce: Optional[Allreduce], *,
                 min_compress_numel: int, compress_1d: bool):
        names = [n for n, _ in named_params]
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})
            raise ValueError(f"parameter names must be unique, repeated: {dup}")
        self.auto: Optional[Auto] = None
        if isinstance(compression, Auto):
            self.auto, compression = compression, compression.compressor
        self.compression: Compressor = compression

        def routed(p):
            return route(p, compression, min_compress_numel, compress_1d)

        chosen: Dict[str, Compressor] = {}
        if self.auto is not None:     # the cost model's choice for every tensor we would compress
            sizes = {n: p.numel() for n, p in named_params if routed(p) is compression}
            # agree on the settings before measuring: the measurements are collectives
            agree(transport, json.dumps([self.auto.settings(), allreduce is not None,
                                         sorted(sizes.items())]), "the Auto settings")
            dev = next((p.device for n, p in named_params if n in sizes), None)
            chosen = self.auto.make_plan(sizes, transport, allreduce, device=dev)
        order = {n: i for i, n in enumerate(sorted(names))}
        self.entries: Dict[str, Entry] = {}
        for name, p in named_params:
            comp = keep_range(chosen[name], p) if name in chosen else routed(p)
            summed = (allreduce is not None and comp.summable
                      and wire_dtype(comp) in allreduce.dtypes)
            self.entries[name] = Entry(name, p, order[name], comp, summed)

    def compressor_names(self) -> Dict[str, str]:
        """{parameter name: name of the compressor its gradient travels with}."""
        return {n: e.compressor.name for n, e in self.entries.items()}
