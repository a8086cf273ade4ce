"""Statistics of normalized gradient magnitudes for fitting ALQ / AMQ level tables
(kernels/stats.cu).

Source: Faghri et al., "Adaptive Gradient Quantization for Data-Parallel SGD", NeurIPS 2020
(arXiv 2010.12460), Sec. 3: the expected variance of a level table is a function of the
distribution of the normalized coordinates ``v_i = x_i / ||bucket||`` weighted by
``w = ||bucket||^2``; these ops compute summable statistics of it (hvdcomp.levels fits the
tables from their sums across tensors and ranks).

    histogram_stats(x, bucket_size, norm) -> float64 (768,)  binned: the "hist" model
    bucket_stats(x, bucket_size, norm)    -> float64 (3,)    the paper's normal model
    bucket_norms64(x, bucket_size, norm)  -> float64 (nb,)   the norms both use
    hist_bins(r)                          -> int32 (n,)      the bin of each magnitude r

Results are float64 tensors on the input's device.  ``norm`` is "l2" or "linf".

What the kernels give against the references (the specification): every per-element value
(the normalized magnitude r, its bin, the weights w r^p) is the reference's, float64 op for
float64 op; L-inf norms and bins are bit-identical; the SUMS (the L2 norms' sums of squares,
the binned sums, the bucket sums) are in the kernels' own fixed order, described in
kernels/stats.cu, where the references use torch.norm / torch.bincount / torch.sum (whose
order belongs to PyTorch, depends on its thread count, and on a GPU is not deterministic).
So the results agree with the references to within a few float64 ulps of each sum (all
binned terms are >= 0: a small relative error), and are bit-identical between the host
build and the GPU and for any thread count.  A bin assignment differs from the reference's
only if some r lies within a float64 ulp or two of a bin edge (L2 norms only): then that
element's mass moves to the neighbouring bin.  The statistics only feed rank 0's fit, whose
table is broadcast, so message bytes never depend on this.  tests/kernels/test_stats.py
asserts these bounds.

The kernels raise TypeError for a non-tensor or a wrong dtype, ValueError for a wrong device
or shape, ``bucket_size`` outside 1..2**62 or ``norm`` not "l2"/"linf"
(hvdcomp.backends._common.check_tensor / check_int).
"""
from __future__ import annotations

from typing import Dict

import numpy as np
import torch

from ..backends._common import MAX_GRID, check_int, check_tensor, grid_for, reduce_block
from . import op, padded_buckets

__all__ = ["histogram_stats", "bucket_stats", "bucket_norms64", "hist_bins", "HIST_EDGES",
           "HIST_BINS", "HIST_CHUNK", "REDUCE_GROUP"]

# 256 bins of normalized magnitude: [0, 1e-8), then log-spaced up to 1 (ratio 1.075).
HIST_EDGES = np.concatenate([[0.0], np.logspace(-8, 0, 256)])
HIST_BINS = len(HIST_EDGES) - 1            # 256
HIST_COLS = 3 * HIST_BINS

HIST_CHUNK = 8192        # elements per partial histogram: part of the kernels' summation order
REDUCE_GROUP = 256       # rows summed per output row by hvd_stats_reduce: likewise
CHUNK_BLOCK = 64         # threads per block of the chunk kernel (any value gives the same)


# ---- references -------------------------------------------------------------------------------

def _buckets64(x: torch.Tensor, bucket_size: int) -> torch.Tensor:
    """The float64 values of flat ``x``, zero-padded to whole buckets (ops.padded_buckets)."""
    return padded_buckets(x.detach().reshape(-1).to(torch.float64), bucket_size)


@op
def bucket_norms64(x: torch.Tensor, bucket_size: int, norm: str = "l2") -> torch.Tensor:
    """Float64 norms (ceil(n / bucket_size),) of the buckets of ``x`` (n,): "l2" the float64
    Euclidean norm, "linf" max |x|.  NaN propagates."""
    b = _buckets64(x, bucket_size)
    return b.norm(dim=1) if norm == "l2" else b.abs().amax(dim=1)


@op
def hist_bins(r: torch.Tensor) -> torch.Tensor:
    """int32 (n,): the bin of :data:`HIST_EDGES` holding each float64 magnitude ``r`` in
    [0, 1] (NaN: the last bin)."""
    edges = torch.from_numpy(HIST_EDGES).to(r.device)
    return (torch.searchsorted(edges, r, right=True) - 1).clamp(0, HIST_BINS - 1).to(torch.int32)


@op
def histogram_stats(x: torch.Tensor, bucket_size: int, norm: str = "l2") -> torch.Tensor:
    """For each of the 256 bins of :data:`HIST_EDGES`, [sum w, sum w r, sum w r^2] of the
    normalized magnitudes ``r = |x_i| / ||bucket||`` that fall in it, each weighted by
    ``w = ||bucket||^2``: float64 (768,), bin-major.

    Sums across tensors and ranks are exact.  With every bin's mass placed at its mean, the
    expected variance of any level table is an exact function of these numbers
    (hvdcomp.levels.HistogramModel).
    """
    n = x.numel()
    b = _buckets64(x, bucket_size)
    if n == 0:
        return torch.zeros(HIST_COLS, dtype=torch.float64, device=b.device)
    nrm = bucket_norms64.reference(x, bucket_size, norm)
    w = (nrm * nrm).unsqueeze(1).expand_as(b).reshape(-1)[:n]
    safe = torch.where(nrm > 0, nrm, torch.ones_like(nrm))
    r = (b.abs() / safe.unsqueeze(1)).reshape(-1)[:n].clamp(0.0, 1.0)
    k = hist_bins.reference(r).long()
    out = torch.stack([torch.bincount(k, weights=w * r ** p, minlength=HIST_BINS)
                       for p in (0, 1, 2)], dim=1)
    return out.reshape(-1)


@op
def bucket_stats(x: torch.Tensor, bucket_size: int, norm: str = "l2") -> torch.Tensor:
    """The sufficient statistics of the paper's normal model: [sum w, sum w v, sum w v^2]
    (float64 (3,)) of the signed normalized coordinates ``v = x_i / ||bucket||``, each
    weighted by ``w = ||bucket||^2``.  Sums across tensors and ranks are exact."""
    n = x.numel()
    b = _buckets64(x, bucket_size)
    if n == 0:
        return torch.zeros(3, dtype=torch.float64, device=b.device)
    nb = b.shape[0]
    nrm = bucket_norms64.reference(x, bucket_size, norm)
    w = nrm * nrm
    safe = torch.where(nrm > 0, nrm, torch.ones_like(nrm))
    v = b / safe.unsqueeze(1)
    counts = torch.full((nb,), float(bucket_size), dtype=torch.float64, device=b.device)
    counts[-1] = n - (nb - 1) * bucket_size
    return torch.stack([(w * counts).sum(), (w * v.sum(dim=1)).sum(),
                        (w * (v * v).sum(dim=1)).sum()])


# ---- kernels (kernels/stats.cu) ----------------------------------------------------------------

_edges: Dict[torch.device, torch.Tensor] = {}


def _edges_on(device: torch.device) -> torch.Tensor:
    e = _edges.get(device)
    if e is None:
        e = torch.tensor(HIST_EDGES, dtype=torch.float64).to(device)
        _edges[device] = e
    return e


def _args(be, x, bucket_size, norm):
    x = check_tensor(be, x, "x", torch.float32)
    bs = check_int(bucket_size, "bucket_size", 1, 2**62)
    if norm not in ("l2", "linf"):
        raise ValueError(f"norm must be 'l2' or 'linf', got {norm!r}")
    return x, bs, 1 if norm == "linf" else 0


def _reduce_rows(be, t: torch.Tensor, nrows: int, ncols: int) -> torch.Tensor:
    """Sum the rows of the row-major float64 (nrows, ncols) ``t``: groups of REDUCE_GROUP
    consecutive rows in row order, repeated until one row is left.  Returns (ncols,)."""
    while nrows > 1:
        ng = (nrows + REDUCE_GROUP - 1) // REDUCE_GROUP
        out = torch.empty(ng * ncols, dtype=torch.float64, device=t.device)
        items = ng * ((ncols + 7) // 8)
        be.launch("hvd_stats_reduce", grid_for(items), 256, (t, nrows, ncols, REDUCE_GROUP, out))
        t, nrows = out, ng
    return t[:ncols]


@bucket_norms64.kernel
def _(be, x, bucket_size, norm="l2"):
    # x: float32; "l2" sums the float64 squares in the kernel's order
    x, bs, linf = _args(be, x, bucket_size, norm)
    n = x.numel()
    nb = (n + bs - 1) // bs
    out = torch.empty(nb, dtype=torch.float64, device=x.device)
    if nb:
        be.launch("hvd_stats_norms", min(nb, MAX_GRID), reduce_block(bs), (x, n, bs, linf, out))
    return out


@hist_bins.kernel
def _(be, r):
    r = check_tensor(be, r, "r", torch.float64)
    n = r.numel()
    out = torch.empty(n, dtype=torch.int32, device=r.device)
    if n:
        be.launch("hvd_stats_hist_bins", grid_for(n), 256, (r, n, _edges_on(r.device), out))
    return out


@histogram_stats.kernel
def _(be, x, bucket_size, norm="l2"):
    # x: float32.  Three launches and a few small reduction launches.
    x, bs, linf = _args(be, x, bucket_size, norm)
    n = x.numel()
    if n == 0:
        return torch.zeros(HIST_COLS, dtype=torch.float64, device=x.device)
    nrm = bucket_norms64.kernels(be, x, bs, norm)
    nc = (n + HIST_CHUNK - 1) // HIST_CHUNK
    partials = torch.empty(nc * HIST_COLS, dtype=torch.float64, device=x.device)
    be.launch("hvd_stats_hist_partial", grid_for(nc, CHUNK_BLOCK), CHUNK_BLOCK,
              (x, n, nrm, bs, _edges_on(x.device), HIST_CHUNK, partials))
    return _reduce_rows(be, partials, nc, HIST_COLS)


@bucket_stats.kernel
def _(be, x, bucket_size, norm="l2"):
    # x: float32
    x, bs, linf = _args(be, x, bucket_size, norm)
    n = x.numel()
    if n == 0:
        return torch.zeros(3, dtype=torch.float64, device=x.device)
    nb = (n + bs - 1) // bs
    partials = torch.empty(3 * nb, dtype=torch.float64, device=x.device)
    be.launch("hvd_stats_normal_buckets", min(nb, MAX_GRID), reduce_block(bs),
              (x, n, bs, linf, partials))
    return _reduce_rows(be, partials, nb, 3)
