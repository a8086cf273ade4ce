"""ALQ / AMQ statistics on the kernel backends (kernels/stats.cu).

Every function takes the backend's launch object first (``be``: ``hvdcomp.backends.host.backend``
or ``hvdcomp.backends.cuda.backend``) and works on that backend's device.

    histogram_stats(be, x, bucket_size, norm)  -> float64 (768,)  levels.histogram_stats
    bucket_stats(be, x, bucket_size, norm)     -> float64 (3,)    levels.bucket_stats
    bucket_norms64(be, x, bucket_size, norm)   -> float64 (nb,)   the norms both use
    hist_bins(be, r)                           -> int32 (n,)      the bin of each r

What equals the reference (hvdcomp/levels.py) and what does not: every per-element value
(the normalized magnitude r, its bin, the weights w r^p) is the reference's, float64 op for
float64 op; L-inf norms are bit-identical; the SUMS (the L2 norms' sums of squares, the
binned sums, the bucket sums) are in the kernels' own fixed order, described in
kernels/stats.cu, where the reference uses torch.norm / torch.bincount / torch.sum (whose order
belongs to PyTorch, depends on its thread count, and on a GPU is not deterministic).  So the
results agree with the reference to within a few float64 ulps of each sum (all binned terms
are >= 0: a small relative error), and are bit-identical between the host build and the GPU
and for any thread count.  A bin assignment differs from the reference's only if some r lies
within a float64 ulp or two of a bin edge (L2 norms only): then that element's mass moves to
the neighbouring bin.  tests/kernels/test_stats.py asserts these bounds.

Errors: TypeError for a non-tensor or a wrong dtype, ValueError for a wrong device, shape,
``bucket_size`` outside 1..2**62 or ``norm`` not "l2"/"linf" (_common.check_tensor).
"""
from __future__ import annotations

from typing import Dict

import torch

from .. import levels as L
from ._common import MAX_GRID, check_int, check_tensor, grid_for, reduce_block

__all__ = ["histogram_stats", "bucket_stats", "bucket_norms64", "hist_bins", "HIST_CHUNK",
           "REDUCE_GROUP"]

HIST_BINS = len(L.HIST_EDGES) - 1          # 256
HIST_COLS = 3 * HIST_BINS
HIST_CHUNK = 8192        # elements per partial histogram: part of the summation order
REDUCE_GROUP = 256       # rows summed per output row by hvd_stats_reduce: likewise
CHUNK_BLOCK = 64         # threads per block of the chunk kernel (any value gives the same)

_edges: Dict[torch.device, torch.Tensor] = {}


def _edges_on(device: torch.device) -> torch.Tensor:
    e = _edges.get(device)
    if e is None:
        e = torch.tensor(L.HIST_EDGES, dtype=torch.float64).to(device)
        _edges[device] = e
    return e


def _args(be, x, bucket_size, norm):
    x = check_tensor(be, x, "x", torch.float32)
    bs = check_int(bucket_size, "bucket_size", 1, 2**62)
    if norm not in ("l2", "linf"):
        raise ValueError(f"norm must be 'l2' or 'linf', got {norm!r}")
    return x, bs, 1 if norm == "linf" else 0


def bucket_norms64(be, x: torch.Tensor, bucket_size: int, norm: str = "l2") -> torch.Tensor:
    """Float64 norms (ceil(n / bucket_size),) of the buckets of float32 ``x`` (n,): "l2"
    sqrt of the float64 sum of squares (kernel order; within an ulp or two of levels.py's
    ``b.norm(dim=1)``), "linf" max |x| (bit-identical).  NaN propagates."""
    x, bs, linf = _args(be, x, bucket_size, norm)
    n = x.numel()
    nb = (n + bs - 1) // bs
    out = torch.empty(nb, dtype=torch.float64, device=x.device)
    if nb:
        be.launch("hvd_stats_norms", min(nb, MAX_GRID), reduce_block(bs), (x, n, bs, linf, out))
    return out


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


def histogram_stats(be, x: torch.Tensor, bucket_size: int, norm: str = "l2") -> torch.Tensor:
    """levels.histogram_stats of float32 ``x`` (n,): float64 (768,) on x's device, bin-major
    [sum w, sum w r, sum w r^2] per bin of levels.HIST_EDGES (see the module docstring for
    how it equals the reference).  Three launches and a few small reduction launches."""
    x, bs, linf = _args(be, x, bucket_size, norm)
    n = x.numel()
    if n == 0:
        return torch.zeros(HIST_COLS, dtype=torch.float64, device=x.device)
    nrm = bucket_norms64(be, x, bs, norm)
    nc = (n + HIST_CHUNK - 1) // HIST_CHUNK
    partials = torch.empty(nc * HIST_COLS, dtype=torch.float64, device=x.device)
    be.launch("hvd_stats_hist_partial", grid_for(nc, CHUNK_BLOCK), CHUNK_BLOCK,
              (x, n, nrm, bs, _edges_on(x.device), HIST_CHUNK, partials))
    return _reduce_rows(be, partials, nc, HIST_COLS)


def bucket_stats(be, x: torch.Tensor, bucket_size: int, norm: str = "l2") -> torch.Tensor:
    """levels.bucket_stats of float32 ``x`` (n,): float64 (3,) on x's device,
    [sum w, sum w v, sum w v^2] of the signed normalized coordinates (paper's normal model)."""
    x, bs, linf = _args(be, x, bucket_size, norm)
    n = x.numel()
    if n == 0:
        return torch.zeros(3, dtype=torch.float64, device=x.device)
    nb = (n + bs - 1) // bs
    partials = torch.empty(3 * nb, dtype=torch.float64, device=x.device)
    be.launch("hvd_stats_normal_buckets", min(nb, MAX_GRID), reduce_block(bs),
              (x, n, bs, linf, partials))
    return _reduce_rows(be, partials, nb, 3)


def hist_bins(be, r: torch.Tensor) -> torch.Tensor:
    """int32 (n,): the histogram bin of each float64 ``r`` in [0, 1] or NaN, i.e.
    ``(torch.searchsorted(edges, r, right=True) - 1).clamp(0, 255)``, bit for bit."""
    r = check_tensor(be, r, "r", torch.float64)
    n = r.numel()
    out = torch.empty(n, dtype=torch.int32, device=r.device)
    if n:
        be.launch("hvd_stats_hist_bins", grid_for(n), 256, (r, n, _edges_on(r.device), out))
    return out
