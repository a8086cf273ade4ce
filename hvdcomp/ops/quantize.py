"""Bucketed stochastic quantization with a level table: the operations of QSGD, QSGDinf,
NUQSGD, ALQ and AMQ (kernels/quantize.cu).

Source: Faghri et al., "Adaptive Gradient Quantization for Data-Parallel SGD", NeurIPS 2020
(arXiv 2010.12460), Sec. 2, Eq. 1-2; QSGD: Alistarh et al., NeurIPS 2017.

Per bucket of ``bucket_size`` coordinates of a flat float32 vector v (the last bucket may be
short; it is padded with zeros):

    norm  = ||v||_2 ("l2") or ||v||_inf ("linf"), float32
    r_i   = min(|v_i| / norm, 1)  (norm 0: r_i = 0)
    p_i   = (r_i - l_j) / (l_{j+1} - l_j) for r_i in [l_j, l_{j+1}]
    index = j + (u_i < p_i), u_i the Philox uniform of element i (hvdcomp.philox.uniform
            with the message's seed, step, rank and tensor id)
    code  = sign << (bits - 1) | index,  sign = 1 for v_i < 0
    decoded value = sign * norm * l_index;  E = v_i, Var = norm^2 (l_{j+1} - r_i)(r_i - l_j)

``levels``: float32 (2**(bits-1),), increasing from 0 to 1.  Codes travel packed
(hvdcomp.ops.bitpack: code i at bit ``i * bits``, LSB first).

The ops and what their kernels guarantee against the references (the specification):

    bucket_norms(x, bucket_size, norm)                       -> norms float32 (nb,)
    quantize_pack(x, norms, levels, bits, bucket_size, *, seed, rank, tensor_id, step)
                                                             -> packed uint8
    quantize(x, levels, bits, bucket_size, norm, *, seed, rank, tensor_id, step)
                                                             -> (norms, packed)
    dequantize_add(packed, n, norms, levels, bits, bucket_size, out)         -> out
    dequantize_add_many(packed_list, n, norms_list, levels, bits, bucket_size, out) -> out
    quantize_pack_pieces(x, norms, levels, bits, bucket_size, spans, tensor_ids, *, seed,
                         rank, step)                         -> packed uint8 (all pieces)
    dequantize_add_pieces(packed, norms, levels, bits, bucket_size, spans, out)  -> out

The ``_pieces`` ops do several *pieces* of one tensor in one call (the reduce-scatter's
pieces, one per destination rank: hvdcomp.exchange.shards), each exactly as a call of its
own would (its own Philox tensor id, its own packed stream starting on a byte), so that
the cost of a piece is its coordinates', not a call's.  ``spans``: the pieces' ranges
``(lo, hi)`` of flat elements, increasing and disjoint (``lo`` at or after the previous
``hi``); their streams lie end to end in piece order (:func:`piece_offsets`).

* L-inf norms, packed codes given the same norms, and decoded sums: bit-identical.
* L2 norms: the kernel sums the float64 squares in a fixed order set by ``bucket_size``
  alone (``_common.reduce_block``), the same on CPU and GPU; ``torch.sum``'s order differs,
  so a norm can differ by one float32 ulp where a rounding boundary falls between the two
  float64 sums (never seen in the tests).  ``quantize``'s codes follow its own norms.

The kernels raise TypeError (type, dtype) or ValueError (device, shape, ranges) for bad
arguments (hvdcomp.backends._common.check_tensor / check_int); ``dequantize_add`` and
``dequantize_add_many`` leave an accumulator that is not a contiguous 1-D float32 tensor to
the reference.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch

from ..backends._common import (BLOCK, MAX_GRID, check_int, check_tensor, grid_for,
                                packed_size, reduce_block, u32)
from .bitpack import pack_bits, unpack_bits
from ..philox import uniform
from . import op, padded_buckets

__all__ = ["bucket_norms", "quantize_pack", "quantize", "dequantize_add",
           "dequantize_add_many", "quantize_pack_pieces", "dequantize_add_pieces",
           "piece_offsets", "quantize_reference", "dequantize_reference"]

NORMS = ("l2", "linf")


# ---- references -------------------------------------------------------------------------------

def _padded(x: torch.Tensor, bucket_size: int) -> torch.Tensor:
    """The float32 values of flat ``x``, zero-padded to whole buckets (ops.padded_buckets)."""
    return padded_buckets(x.reshape(-1).to(torch.float32), bucket_size)


def _codes(x: torch.Tensor, norms: torch.Tensor, levels: torch.Tensor, bucket_size: int,
           u: torch.Tensor) -> torch.Tensor:
    """int64 codes (n,) of flat float32 ``x`` against the bucket ``norms`` (Eq. 1)."""
    n = x.numel()
    safe = torch.where(norms > 0, norms, torch.ones_like(norms))
    r = (_padded(x, bucket_size).abs() / safe.unsqueeze(1)).reshape(-1)[:n]
    r = r.clamp_(max=1.0)            # |v_i| / ||v|| can round to just above 1
    s = levels.numel() - 1
    j = (torch.searchsorted(levels, r, right=True) - 1).clamp_(0, s - 1)
    lo, hi = levels[j], levels[j + 1]
    p = (r - lo) / (hi - lo)
    idx = j + (u < p).to(torch.int64)
    sign = (x < 0).to(torch.int64)
    return (sign << max(int(s).bit_length(), 1)) | idx


def quantize_reference(x: torch.Tensor, levels: torch.Tensor, bucket_size: int, norm: str,
                       u: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """The quantizer with explicit uniforms: (norms float32 (nb,), codes int64 (n,)).

    x: flat float32 (n,); levels: float32 (s+1,) increasing from 0 to 1; u: float32 (n,) in
    [0, 1).  code = sign << index_bits | level index, index_bits = max(bit_length(s), 1).
    """
    norms = bucket_norms.reference(x, bucket_size, norm)
    return norms, _codes(x, norms, levels, bucket_size, u)


def dequantize_reference(norms: torch.Tensor, codes: torch.Tensor, levels: torch.Tensor,
                         bucket_size: int, index_bits: int) -> torch.Tensor:
    """Inverse map of int64 ``codes`` (n,): float32 (n,) values sign * norm * levels[index]."""
    n = codes.numel()
    idx = codes & ((1 << index_bits) - 1)
    neg = (codes >> index_bits) != 0
    scale = norms.repeat_interleave(bucket_size)[:n] if n else norms[:0]
    v = levels[idx] * scale
    return torch.where(neg, -v, v)


# ---- ops ----------------------------------------------------------------------------------------

@op
def bucket_norms(x: torch.Tensor, bucket_size: int, norm: str) -> torch.Tensor:
    """Norms of the buckets of flat float32 ``x`` (n,): float32 (ceil(n / bucket_size),).

    "l2": the float64 sum of squares, square-rooted and rounded once to float32 (so the
    summation order matters only within float64 precision); "linf": max |x|.  NaN
    propagates; an L2 norm beyond float32's range is +inf.
    """
    b = _padded(x, bucket_size)
    if norm == "l2":
        return b.to(torch.float64).pow(2).sum(dim=1).sqrt().to(torch.float32)
    return b.abs().amax(dim=1)


@op
def quantize_pack(x: torch.Tensor, norms: torch.Tensor, levels: torch.Tensor, bits: int,
                  bucket_size: int, *, seed: int, rank: int, tensor_id: int,
                  step: int) -> torch.Tensor:
    """Stochastic quantization of flat float32 ``x`` (n,) against the given bucket ``norms``
    (float32 (nb,)), packed: uint8 (ceil(n * bits / 8),).  The uniforms are
    ``hvdcomp.philox.uniform(n, seed=seed, step=step, rank=rank, tensor_id=tensor_id)``.
    """
    u = uniform(x.numel(), seed=seed, step=step, rank=rank, tensor_id=tensor_id,
                device=x.device)
    return pack_bits(_codes(x, norms, levels, bucket_size, u), bits)


@op
def quantize(x: torch.Tensor, levels: torch.Tensor, bits: int, bucket_size: int, norm: str,
             *, seed: int, rank: int, tensor_id: int,
             step: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(norms, packed): :func:`bucket_norms` then :func:`quantize_pack` of flat float32 ``x``.
    """
    norms = bucket_norms.reference(x, bucket_size, norm)
    return norms, quantize_pack.reference(x, norms, levels, bits, bucket_size, seed=seed,
                                          rank=rank, tensor_id=tensor_id, step=step)


@op
def dequantize_add(packed: torch.Tensor, n: int, norms: torch.Tensor, levels: torch.Tensor,
                   bits: int, bucket_size: int, out: torch.Tensor) -> torch.Tensor:
    """``out += `` the decoded values of ``n`` codes packed at ``bits`` (uint8
    (ceil(n * bits / 8),)) with bucket ``norms`` (float32 (nb,)); out: (n,), on the
    device of the other tensors, updated in place and returned."""
    codes = unpack_bits(packed, n, bits)
    return out.add_(dequantize_reference(norms, codes, levels, bucket_size, bits - 1))


@op
def dequantize_add_many(packed: Sequence[torch.Tensor], n: int, norms: Sequence[torch.Tensor],
                        levels: torch.Tensor, bits: int, bucket_size: int,
                        out: torch.Tensor) -> torch.Tensor:
    """:func:`dequantize_add` of several messages of one tensor (``packed[m]``,
    ``norms[m]``), added into ``out`` in list order (the kernel: in one pass over ``out``,
    the same additions in the same order).  Raises ValueError for lists of different
    lengths."""
    if len(packed) != len(norms):
        raise ValueError(f"{len(packed)} packed streams but {len(norms)} norm vectors")
    for p, m in zip(packed, norms):
        dequantize_add.reference(p, n, m, levels, bits, bucket_size, out)
    return out


def _spans(spans, n: Optional[int] = None) -> List[Tuple[int, int]]:
    """``spans`` as a list of (lo, hi) ints, checked: 0 <= lo <= hi, each lo at or after the
    previous hi, and hi <= n where ``n`` is given.  Raises TypeError / ValueError."""
    out, end = [], 0
    for k, sp in enumerate(spans):
        try:
            lo, hi = sp
        except (TypeError, ValueError):
            raise TypeError(f"spans[{k}] must be a pair (lo, hi), got {sp!r}") from None
        lo = check_int(lo, f"spans[{k}] lo", end, 2**62)
        hi = check_int(hi, f"spans[{k}] hi", lo, 2**62 if n is None else n)
        out.append((lo, hi))
        end = hi
    return out


def piece_offsets(spans: Sequence[Tuple[int, int]], bits: int,
                  bucket_size: int) -> Tuple[List[int], List[int]]:
    """(bytes, buckets): the offsets (``len(spans) + 1`` each, from 0) of each piece's packed
    stream (``packed_size(hi - lo, bits)`` bytes) and of its bucket norms
    (``ceil((hi - lo) / bucket_size)`` values) when the pieces' streams and norms lie end to
    end in piece order."""
    nbytes, nbuckets = [0], [0]
    for lo, hi in spans:
        nbytes.append(nbytes[-1] + ((hi - lo) * bits + 7) // 8)
        nbuckets.append(nbuckets[-1] + (hi - lo + bucket_size - 1) // bucket_size)
    return nbytes, nbuckets


def _aligned(spans, bucket_size: int) -> None:
    """Raise ValueError unless every non-empty span starts on a bucket boundary of x."""
    for k, (lo, hi) in enumerate(spans):
        if hi > lo and lo % bucket_size:
            raise ValueError(f"piece {k} starts at {lo}, not a multiple of the bucket size "
                             f"{bucket_size}: its buckets would not be x's")


@op
def quantize_pack_pieces(x: torch.Tensor, norms: torch.Tensor, levels: torch.Tensor,
                         bits: int, bucket_size: int, spans: Sequence[Tuple[int, int]],
                         tensor_ids: Sequence[int], *, seed: int, rank: int,
                         step: int) -> torch.Tensor:
    """:func:`quantize_pack` of each piece ``x[lo:hi]`` of flat float32 ``x`` (n,), piece k
    with Philox tensor id ``tensor_ids[k]``, against ``norms``, the bucket norms of the
    whole ``x`` (float32 (ceil(n / bucket_size),): every non-empty piece starts on a bucket
    boundary of x, so its buckets are x's).  Returns uint8: the pieces' packed streams end
    to end (piece k at ``piece_offsets(spans, bits, bucket_size)[0][k]``).  Raises
    ValueError for spans out of order or out of x, a piece off a bucket boundary, or
    ``len(tensor_ids) != len(spans)``."""
    spans = _spans(spans, x.numel())
    _aligned(spans, bucket_size)
    if len(tensor_ids) != len(spans):
        raise ValueError(f"{len(spans)} pieces but {len(tensor_ids)} tensor ids")
    parts = [quantize_pack.reference(x[lo:hi], norms[lo // bucket_size:
                                                     (hi + bucket_size - 1) // bucket_size],
                                     levels, bits, bucket_size, seed=seed, rank=rank,
                                     tensor_id=t, step=step)
             for (lo, hi), t in zip(spans, tensor_ids)]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8, device=x.device)


@op
def dequantize_add_pieces(packed: torch.Tensor, norms: torch.Tensor, levels: torch.Tensor,
                          bits: int, bucket_size: int, spans: Sequence[Tuple[int, int]],
                          out: torch.Tensor) -> torch.Tensor:
    """:func:`dequantize_add` of each piece into ``out[lo:hi]``: piece k's packed stream and
    bucket norms are those at ``piece_offsets(spans, bits, bucket_size)`` of ``packed``
    (uint8, the streams end to end) and ``norms`` (float32, the pieces' norms end to end).
    out: float32 (m,) with every hi <= m, updated in place and returned.  Raises ValueError
    for spans out of order or out of ``out`` and for ``packed`` / ``norms`` of the wrong
    size."""
    spans = _spans(spans, out.numel())
    nbytes, nbuckets = piece_offsets(spans, bits, bucket_size)
    if packed.numel() != nbytes[-1] or norms.numel() != nbuckets[-1]:
        raise ValueError(f"the pieces need {nbytes[-1]} packed bytes and {nbuckets[-1]} "
                         f"norms, got {packed.numel()} and {norms.numel()}")
    for k, (lo, hi) in enumerate(spans):
        dequantize_add.reference(packed[nbytes[k]:nbytes[k + 1]], hi - lo,
                                 norms[nbuckets[k]:nbuckets[k + 1]], levels, bits,
                                 bucket_size, out[lo:hi])
    return out


# ---- kernels (kernels/quantize.cu) -------------------------------------------------------------

def _bits(bits) -> int:
    return check_int(bits, "bits", 2, 8)


def _bucket(bucket_size) -> int:
    return check_int(bucket_size, "bucket_size", 1, 2**62)


def _levels(be, levels, bits: int, device) -> torch.Tensor:
    return check_tensor(be, levels, "levels", torch.float32, 1 << (bits - 1), device=device)


def _served(out) -> bool:
    """Whether the kernels can accumulate into ``out`` (else the reference does)."""
    return not isinstance(out, torch.Tensor) or (
        out.dtype == torch.float32 and out.dim() == 1 and out.is_contiguous())


@bucket_norms.kernel
def _(be, x, bucket_size, norm):
    x = check_tensor(be, x, "x", torch.float32)
    bs = _bucket(bucket_size)
    if norm not in NORMS:
        raise ValueError(f"norm must be 'l2' or 'linf', got {norm!r}")
    n = x.numel()
    nb = (n + bs - 1) // bs
    out = torch.empty(nb, dtype=torch.float32, device=x.device)
    if nb:
        be.launch("hvd_bucket_norms_" + norm, min(nb, MAX_GRID), reduce_block(bs),
                  (x, n, bs, out))
    return out


@quantize_pack.kernel
def _(be, x, norms, levels, bits, bucket_size, *, seed, rank, tensor_id, step):
    # levels are increasing (not checked here: no device sync)
    b = _bits(bits)
    x = check_tensor(be, x, "x", torch.float32)
    bs = _bucket(bucket_size)
    n = x.numel()
    norms = check_tensor(be, norms, "norms", torch.float32, (n + bs - 1) // bs, device=x.device)
    levels = _levels(be, levels, b, x.device)
    out = torch.empty(packed_size(n, b), dtype=torch.uint8, device=x.device)
    if n:
        be.launch("hvd_quantize_pack", grid_for((n + 7) // 8), BLOCK,
                  (x, n, norms, bs, levels, b, u32(seed, "seed"), u32(rank, "rank"),
                   u32(tensor_id, "tensor_id"), u32(step, "step"), out))
    return out


@quantize.kernel
def _(be, x, levels, bits, bucket_size, norm, *, seed, rank, tensor_id, step):
    norms = bucket_norms.kernels(be, x, bucket_size, norm)
    return norms, quantize_pack.kernels(be, x, norms, levels, bits, bucket_size, seed=seed,
                                        rank=rank, tensor_id=tensor_id, step=step)


@dequantize_add.kernel
def _(be, packed, n, norms, levels, bits, bucket_size, out):
    if not _served(out):
        return NotImplemented
    b = _bits(bits)
    n = check_int(n, "n", 0, 2**62)
    bs = _bucket(bucket_size)
    out = check_tensor(be, out, "out", torch.float32, n, output=True)
    dev = out.device
    packed = check_tensor(be, packed, "packed", torch.uint8, packed_size(n, b), device=dev)
    norms = check_tensor(be, norms, "norms", torch.float32, (n + bs - 1) // bs, device=dev)
    levels = _levels(be, levels, b, dev)
    if n:
        be.launch("hvd_dequantize_add", grid_for((n + 7) // 8), BLOCK,
                  (packed, n, norms, bs, levels, b, out))
    return out


@dequantize_add_many.kernel
def _(be, packed, n, norms, levels, bits, bucket_size, out):
    if not _served(out):
        return NotImplemented
    b = _bits(bits)
    n = check_int(n, "n", 0, 2**62)
    bs = _bucket(bucket_size)
    out = check_tensor(be, out, "out", torch.float32, n, output=True)
    dev = out.device
    if len(packed) != len(norms):
        raise ValueError(f"{len(packed)} packed streams but {len(norms)} norm vectors")
    if len(packed) > 2**31 - 1:
        raise ValueError("too many messages")
    packed = [check_tensor(be, p, "packed", torch.uint8, packed_size(n, b), device=dev)
              for p in packed]
    norms = [check_tensor(be, m, "norms", torch.float32, (n + bs - 1) // bs, device=dev)
             for m in norms]
    levels = _levels(be, levels, b, dev)
    if n and packed:
        pp = torch.tensor([p.data_ptr() for p in packed], dtype=torch.int64).to(dev)
        npp = torch.tensor([m.data_ptr() for m in norms], dtype=torch.int64).to(dev)
        # packed / norms stay referenced (these lists) until the launch has been issued;
        # on a GPU the launch is ordered on the current stream before any later free
        be.launch("hvd_dequantize_add_many", grid_for((n + 7) // 8), BLOCK,
                  (pp, npp, len(packed), n, bs, levels, b, out))
    return out


PIECE_FIELDS = 6    # kernels/hvdcomp.cuh, section 4b: lo, n, byte, bucket, tensor id, group


def _piece_table(spans, nbytes, nbuckets, tensor_ids, device) -> Tuple[torch.Tensor, int]:
    """(table, groups): the kernels' piece table (int64, PIECE_FIELDS per piece) on
    ``device`` and the total number of groups of 8 coordinates."""
    rows, groups = [], 0
    for k, (lo, hi) in enumerate(spans):
        rows += (lo, hi - lo, nbytes[k], nbuckets[k], tensor_ids[k], groups)
        groups += (hi - lo + 7) // 8
    return torch.tensor(rows, dtype=torch.int64).to(device), groups


@quantize_pack_pieces.kernel
def _(be, x, norms, levels, bits, bucket_size, spans, tensor_ids, *, seed, rank, step):
    b = _bits(bits)
    x = check_tensor(be, x, "x", torch.float32)
    bs = _bucket(bucket_size)
    n = x.numel()
    norms = check_tensor(be, norms, "norms", torch.float32, (n + bs - 1) // bs, device=x.device)
    levels = _levels(be, levels, b, x.device)
    spans = _spans(spans, n)
    _aligned(spans, bs)
    if len(tensor_ids) != len(spans):
        raise ValueError(f"{len(spans)} pieces but {len(tensor_ids)} tensor ids")
    if len(spans) > 2**31 - 1:
        raise ValueError("too many pieces")
    ids = [u32(t, "tensor_id") for t in tensor_ids]
    nbytes, _ = piece_offsets(spans, b, bs)
    out = torch.empty(nbytes[-1], dtype=torch.uint8, device=x.device)
    # piece k's norms start at x's bucket lo / bs (it starts on a bucket boundary of x)
    table, groups = _piece_table(spans, nbytes, [lo // bs for lo, _ in spans], ids, x.device)
    if groups:
        be.launch("hvd_quantize_pack_pieces", grid_for(groups), BLOCK,
                  (x, norms, bs, levels, b, u32(seed, "seed"), u32(rank, "rank"),
                   u32(step, "step"), table, len(spans), groups, out))
    return out


@dequantize_add_pieces.kernel
def _(be, packed, norms, levels, bits, bucket_size, spans, out):
    if not _served(out):
        return NotImplemented
    b = _bits(bits)
    bs = _bucket(bucket_size)
    out = check_tensor(be, out, "out", torch.float32, output=True)
    dev = out.device
    spans = _spans(spans, out.numel())
    if len(spans) > 2**31 - 1:
        raise ValueError("too many pieces")
    nbytes, nbuckets = piece_offsets(spans, b, bs)
    packed = check_tensor(be, packed, "packed", torch.uint8, nbytes[-1], device=dev)
    norms = check_tensor(be, norms, "norms", torch.float32, nbuckets[-1], device=dev)
    levels = _levels(be, levels, b, dev)
    table, groups = _piece_table(spans, nbytes, nbuckets, [0] * len(spans), dev)
    if groups:
        be.launch("hvd_dequantize_add_pieces", grid_for(groups), BLOCK,
                  (packed, norms, bs, levels, b, table, len(spans), groups, out))
    return out
