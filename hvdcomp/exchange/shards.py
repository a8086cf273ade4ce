"""Shards of the reduce-scatter collective: how a fusion bucket is cut among the ranks, which
compressors can be cut, and what re-encodes a shard's average.

A fusion bucket's scattered tensors, flattened and laid end to end in bucket order, are cut
into ``N`` shards of about equal numbers of elements (shard r: rank r's, its *owner*); each
cut is moved to the nearest *unit* boundary of the tensor it falls in, so a shard never
splits a unit.  The part of one tensor inside one shard is a :class:`Piece`: the compressor
encodes it as a tensor of its own (a message per piece; a tensor's pieces in one
``Compressor.encode_pieces`` call), and its stage-1 and stage-2 messages carry their own
tensor ids, so every piece draws its own Philox streams.

Units (:func:`unit`): what each compressor declares (``Compressor.shard_unit``, with the
shape of its pieces ``Compressor.shard_shape``): a quantization bucket (``bucket_size``:
QSGD, QSGDinf, NUQSGD, ALQ, AMQ, DQSG, and TernGrad and 1-bit EF with a bucket size), so
every bucket quantizes exactly the coordinates it would in the whole tensor; a row (PSQ,
BHQ: each piece is a matrix of whole rows, its row ranges and BHQ's blocks are the rows');
one element where the scale is the tensor's own (TernGrad and 1-bit EF with
``bucket_size=0``: each piece then has its own scale, and TernGrad its own clipping
threshold) and for the sparsifiers and the casts (top-k, random-k and DGC select
``density`` of each piece).  A compressor defined outside hvdcomp gets the reduce-scatter
by declaring its unit (tests/compressors/toy_sign.py); one that declares none is refused.

Stage 2 (:func:`second_stage`, ``Compressor.second_stage``): the owner re-encodes its
pieces' averages with keys of their own (world size 1: the average is one contribution).
The bucketed quantizers (QSGD, QSGDinf, NUQSGD, ALQ, AMQ) use ``FINER_BITS``
(hvdcomp.compressors.quantizers) more bits there (at most 8), with a table
that holds the first stage's (:class:`~hvdcomp.compressors.quantizers.Finer`: the family's
own table at those bits while the first stage has its initial one, the fitted table with
each interval cut into equal parts once fitted; same version).  Why: the second quantization
adds E Var Q2(a) to the first stage's sum_r Var Q(g_r) / N^2, and with Q2 = Q, Var Q(a) is
about one rank's quantization error of a gradient of the average's norm, not 1/N of it: on
real FC-300-100 gradients (bench/second_stage.py: ALQ 3 bits, batch 32 per rank) the
two-stage estimate had 2.7 to 7.0 times the allgather's variance at 4 ranks and 3.1 to 9.6
at 8, and the main job lost 2 points at 4 ranks (bench/results/train_rs.md).  With 2 more
bits: 1.08 to 1.11 times at 4 ranks, 1.10 to 1.16 at 8, and the main job meets its target.
Cost: the averaged shards are all of a rank's stage-2 traffic, so a rank sends
(N-1)/N m_b + m_(b+2)/N bytes of its own (b + 2/N bits a coordinate: 3.5 in place of 3 at
4 ranks, 3.25 at 8) and the ring carries (N-1)/N (m_b + m_(b+2)) in place of
2 (N-1)/N m_b (a third more at 3 bits).  Error feedback on the owner (a residual of what the
re-quantization lost, added to the next step's average) would make each step's estimate
biased and add state; the finer stage keeps the estimate unbiased and has none.
The other compressors re-encode with the same instance (same level table and version,
residuals kept by piece name, on the owner); DGC's momentum correction, masking and
clipping act on a rank's raw gradient only, so its second stage is a separate instance
without them: top-k of the average with its residual (error feedback), at the same density
schedule.

Refused (:func:`refusal`: the TypeError of ``shard_unit``): NDQSG and LAQ, for the reasons
their ``shard_unit`` gives (:data:`REFUSED` lists hvdcomp's own).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ..compressors import AVERAGE_SUFFIX, Compressor, TensorKey, registry

__all__ = ["Piece", "REFUSED", "refusal", "unit", "second_stage", "boundaries", "layout"]


def refusal(comp: Compressor) -> Optional[str]:
    """Why ``comp`` cannot travel over the reduce-scatter collective, or None if it can
    (the TypeError of its ``shard_unit``)."""
    try:
        comp.shard_unit((1,))
    except TypeError as e:
        return str(e)
    return None


# {name: reason} of hvdcomp's own compressors that refuse the reduce-scatter, at their
# default settings: for reference, as :func:`refusal` asks the compressor itself
REFUSED = {n: why for n, why in ((n, refusal(cls())) for n, cls in registry().items()
                                 if cls.__module__.startswith("hvdcomp."))
           if why is not None}


def unit(comp: Compressor, shape: Sequence[int]) -> int:
    """Elements per unit of a tensor of ``shape`` sent with ``comp`` (module docstring,
    ``Compressor.shard_unit``).  Raises TypeError for a compressor that cannot be cut into
    shards."""
    return comp.shard_unit(tuple(shape))


def second_stage(comp: Compressor) -> Compressor:
    """The compressor that re-encodes the owners' averages (module docstring,
    ``Compressor.second_stage``): QSGD, QSGDinf, NUQSGD, ALQ and AMQ below 8 bits: a
    ``Finer`` of ``comp`` at ``min(bits + FINER_BITS, 8)``; DGC: top-k of the average with
    residuals; the others: ``comp`` itself."""
    return comp.second_stage()


@dataclass(frozen=True)
class Piece:
    """The part ``[lo, hi)`` (flat elements) of tensor ``name`` in the shard of ``owner``.

    shape: what the compressor encodes (``Compressor.shard_shape``: ``(hi - lo,)``, or
    whole rows for PSQ/BHQ);
    tensor_id: the stage-1 messages' tensor id; ``tensor_id + 1``: the stage-2 message's.
    dtype: the parameter's dtype (the stage-1 messages' header dtype; the stage-2 messages
    carry float32 averages); None: not checked.
    """
    name: str
    lo: int
    hi: int
    shape: Tuple[int, ...]
    owner: int
    tensor_id: int
    dtype: Optional[torch.dtype] = None

    @property
    def numel(self) -> int:
        return self.hi - self.lo

    @property
    def label(self) -> str:
        """``name[lo:hi]``: the name under which compressors keep the piece's state (the
        second stage's: ``label + AVERAGE_SUFFIX``, "/avg")."""
        return f"{self.name}[{self.lo}:{self.hi}]"

    def key(self, step: int, rank: int, size: int, seed: int) -> TensorKey:
        """The key of ``rank``'s stage-1 message (its part of this piece's sum), with the
        piece's shape and the parameter's dtype, so that decode checks the header's."""
        return TensorKey(self.label, self.tensor_id, step, rank, size, seed,
                         shape=tuple(self.shape), dtype=self.dtype)

    def key2(self, step: int, seed: int) -> TensorKey:
        """The key of the owner's stage-2 message (the re-encoded average: float32, the
        piece's shape)."""
        return TensorKey(self.label + AVERAGE_SUFFIX, self.tensor_id + 1, step, self.owner, 1, seed,
                         shape=tuple(self.shape),
                         dtype=None if self.dtype is None else torch.float32)


def boundaries(numels: Sequence[int], units: Sequence[int], n: int) -> List[int]:
    """The ``n + 1`` cut points (offsets into the tensors laid end to end, non-decreasing,
    first 0, last the total) of ``n`` shards: cut j aims at ``round(j * total / n)`` and
    moves to the nearest multiple of its tensor's unit (counted from the tensor's start;
    the tensor's end counts as one; half-way: the later)."""
    total = sum(numels)
    starts = [0]
    for m in numels:
        starts.append(starts[-1] + m)
    cuts = [0]
    t = 0                                   # the tensor the current target falls in
    for j in range(1, n):
        target = (j * total + n // 2) // n
        while t < len(numels) and starts[t + 1] <= target:
            t += 1
        if t == len(numels):
            c = total
        else:
            x, u = target - starts[t], units[t]
            down = x // u * u
            up = min(down + u, numels[t])
            c = starts[t] + (up if up - x <= x - down else down)
        cuts.append(max(cuts[-1], c))
    cuts.append(total)
    return cuts


def layout(buckets: Sequence[Sequence[str]], entries: Dict, size: int,
           first_id: int) -> List[List[List[Piece]]]:
    """``out[k][r]``: the pieces of fusion bucket k owned by rank r (in bucket order), for
    the entries of ``entries`` (name -> :class:`~hvdcomp.exchange.plan.Entry`) marked
    ``scatter``.  Pieces are numbered in bucket, owner and tensor order; piece i has tensor
    ids ``first_id + 2 i`` and ``+ 1``.  A tensor of 0 elements is one empty piece of rank
    0's (its message says whether a rank had the gradient)."""
    out: List[List[List[Piece]]] = []
    count = 0
    for names in buckets:
        es = [entries[n] for n in names if entries[n].scatter]
        numels = [e.param.numel() for e in es]
        shapes = [tuple(e.param.shape) for e in es]
        cuts = boundaries(numels, [unit(e.compressor, s) for e, s in zip(es, shapes)], size)
        per_owner: List[List[Piece]] = []
        for r in range(size):
            mine, start = [], 0
            for e, m, shape in zip(es, numels, shapes):
                lo, hi = max(cuts[r], start) - start, min(cuts[r + 1], start + m) - start
                if m == 0 and r == 0:           # an empty tensor: one empty piece, rank 0's
                    lo = hi = 0
                if hi > lo or (m == 0 and r == 0):
                    mine.append(Piece(e.name, lo, hi, e.compressor.shard_shape(shape, lo, hi),
                                      r, first_id + 2 * count, e.param.dtype))
                    count += 1
                start += m
            per_owner.append(mine)
        out.append(per_owner)
    return out
