"""Kernel operations of the sparsifiers (DGC, top-k, random-k): kernels/dgc.cu.

Every function takes the backend's launch object first (``be``: ``host.backend`` for CPU
tensors, ``cuda.backend`` for CUDA tensors; ``kernel_backend(device).backend``).  Tensors
are flat (1-D) and contiguous; float32 unless stated.  Scalars are typed to the kernels'
signatures here.  The specification is hvdcomp/compressors/sparse.py; each function says
which part of it it equals bit for bit.

Low-level (one launch each, arguments checked; TypeError for wrong types/dtypes, ValueError
for wrong devices, shapes, or values):

    sumsq(be, x) -> float                      sum of x[i]^2 in float64, fixed order
    sample(be, g, s, key4, ...) -> (s,)        |v| at the reference's sample positions
    accumulate(be, g, ...) -> counts (3, nc)   the u/v update + per-chunk counts
    select(be, x, t, chunk, ends, count, ...)  -> (idx int64, vals)
    mask(be, idx, v, u, dec)                   v[idx] -= dec; u[idx] = 0
    scatter_add(be, idx, vals, out, scale)     out[idx] += vals * scale

High-level (what the compressors call):

    sparsify(be, g, k, ...) -> Sparsified      DGC / top-k's whole selection step
    exact_topk(cidx, cvals, k)                 exact top-k of |cvals|, ties by lower index

``key4`` is ``(seed, rank, tensor_id, step)`` (hvdcomp.compressors.TensorKey's fields).
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional, Tuple

import torch

from ._common import BLOCK, MAX_GRID, check_int, check_tensor, grid_for, u32

__all__ = ["sumsq", "sample", "accumulate", "select", "mask", "scatter_add", "sparsify",
           "exact_topk", "Sparsified", "default_chunk", "CLIP", "MOM", "HAS_U", "HAS_V",
           "WRITE_V", "NORM_CHUNK"]

# flags of hvd_dgc_accumulate / hvd_dgc_sample (kernels/dgc.cu)
CLIP, MOM, HAS_U, HAS_V, WRITE_V = 1, 2, 4, 8, 16
NORM_CHUNK = 65536          # HVD_DGC_NORM_CHUNK: coordinates per float64 partial sum
NORM_BLOCK = 256            # HVD_DGC_NORM_BLOCK
HOST_CHUNK = 4096           # coordinates per selection chunk on the CPU (one OS thread's run)
CUDA_CHUNK = 64             # ... on a GPU (one thread's run; small for memory parallelism)
SAMPLE_GROUP = 16           # draws per thread of hvd_dgc_sample
MAX_CHUNK = 2**30           # HVD_DGC_MAX_CHUNK
HOST_BLOCK = 8              # threads per block on the host (blocks are what runs in parallel)

_F32 = torch.float32
_I64 = torch.int64


def default_chunk(be) -> int:
    """Coordinates per selection chunk for backend ``be`` (any value gives the same
    results; it only sets the work per thread and the length of the counts)."""
    return HOST_CHUNK if be.device_type == "cpu" else CUDA_CHUNK


def _block(be) -> int:
    return HOST_BLOCK if be.device_type == "cpu" else BLOCK


def _f32(x: float) -> float:
    """x rounded to float32 (what torch.tensor(x, dtype=float32) holds), as a Python float."""
    return float(torch.tensor(x, dtype=_F32)) if x == x else x


# ---- low level ------------------------------------------------------------------------------

def sumsq(be, x: torch.Tensor) -> float:
    """Sum of x[i]^2 over float32 ``x`` (n,), in float64: partial sums of 65536-coordinate
    chunks (256 threads, 4 interleaved sums each, a fixed tree), then their sum in a fixed
    order.  The order depends on n alone (the same on every device); the reference
    ``float(x.double().pow(2).sum())`` sums in torch's order, so the two agree to float64
    rounding (a few ulp), not necessarily bit for bit."""
    x = check_tensor(be, x, "x", _F32)
    n = x.numel()
    if n == 0:
        return 0.0
    nb = (n + NORM_CHUNK - 1) // NORM_CHUNK
    parts = torch.empty(nb, dtype=torch.float64, device=x.device)
    be.launch("hvd_dgc_sumsq", min(nb, MAX_GRID), NORM_BLOCK, (x, n, parts))
    if nb == 1:
        return float(parts[0])                   # = hvd_dgc_sum_f64 of one partial, exactly
    out = torch.empty(1, dtype=torch.float64, device=x.device)
    be.launch("hvd_dgc_sum_f64", 1, NORM_BLOCK, (parts, nb, out))
    return float(out[0])


def _flags(g, u_old, v_old, scale, momentum, write_v: bool):
    f = 0
    if scale is not None:
        f |= CLIP
    if momentum > 0:
        f |= MOM
        if u_old is not None:
            f |= HAS_U
    if v_old is not None:
        f |= HAS_V
    if write_v:
        f |= WRITE_V
    return f


def _check_inputs(be, g, u_old, v_old, scale, momentum):
    g = check_tensor(be, g, "g", _F32)
    n, dev = g.numel(), g.device
    if u_old is not None:
        u_old = check_tensor(be, u_old, "u_old", _F32, n, device=dev)
    if v_old is not None:
        v_old = check_tensor(be, v_old, "v_old", _F32, n, device=dev)
    if scale is not None and not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
    if not isinstance(momentum, (int, float)) or not 0 <= momentum < 1:
        raise ValueError(f"momentum must be in [0, 1), got {momentum!r}")
    return g, u_old, v_old


def sample(be, g: torch.Tensor, s: int, key4: Tuple[int, int, int, int], *,
           u_old: Optional[torch.Tensor] = None, v_old: Optional[torch.Tensor] = None,
           scale: Optional[float] = None, momentum: float = 0.0) -> torch.Tensor:
    """float32 (s,): |v| at ``sample_positions(s, n, key)`` where v is DGC's update of
    (g, u_old, v_old) (kernels/dgc.cu, top of file; top-k's p = g + e is v_old = e), i.e.
    ``mag[sample_positions(s, n, key, device)]`` of the reference, bit for bit.
    ``scale``: the clipping factor (float32 value) or None; ``momentum``: 0 = off.
    key4 = (seed, rank, tensor_id, step).  s >= 0; n >= 1 when s > 0."""
    g, u_old, v_old = _check_inputs(be, g, u_old, v_old, scale, momentum)
    s = check_int(s, "s", 0, 2**62)
    if s and g.numel() == 0:
        raise ValueError("cannot sample an empty tensor")
    return _sample(be, g, u_old, v_old, scale, momentum, s, key4)


def _sample(be, g, u_old, v_old, scale, momentum, s, key4):
    out = torch.empty(s, dtype=_F32, device=g.device)
    if s:
        flags = _flags(g, u_old, v_old, scale, momentum, False)
        seed, rank, tid, step = key4
        be.launch("hvd_dgc_sample", grid_for((s + SAMPLE_GROUP - 1) // SAMPLE_GROUP,
                                             _block(be)), _block(be),
                  (g, u_old if u_old is not None else g, v_old if v_old is not None else g,
                   g.numel(), 1.0 if scale is None else float(scale), float(momentum), flags,
                   s, u32(seed, "seed"), u32(rank, "rank"), u32(tid, "tensor_id"),
                   u32(step, "step"), out))
    return out


def accumulate(be, g: torch.Tensor, *, u_old=None, v_old=None, scale=None, momentum=0.0,
               u_out=None, v_out=None, t1: float = math.inf, t2: float = math.inf,
               chunk: Optional[int] = None) -> torch.Tensor:
    """DGC's element-wise step in one pass (kernels/dgc.cu, top of file): with
    ``momentum > 0`` writes u into ``u_out`` (required then); writes v into ``v_out`` when
    given.  Returns int64 counts (3, ceil(n / chunk)): per chunk of ``chunk`` coordinates,
    how many |v| pass t1 (row 0) and t2 (row 1) (|v| >= t and |v| > 0), and how many v are
    NaN/Inf (row 2).  u and v equal the reference's (``u_old * m + g``, ``v_old + u``)
    bit for bit.  Outputs must not alias the inputs."""
    g, u_old, v_old = _check_inputs(be, g, u_old, v_old, scale, momentum)
    n, dev = g.numel(), g.device
    if momentum > 0:
        if u_out is None:
            raise ValueError("momentum > 0 needs u_out")
        u_out = check_tensor(be, u_out, "u_out", _F32, n, output=True, device=dev)
    if v_out is not None:
        v_out = check_tensor(be, v_out, "v_out", _F32, n, output=True, device=dev)
    chunk = check_int(default_chunk(be) if chunk is None else chunk, "chunk", 1, MAX_CHUNK)
    return _accumulate(be, g, u_old, v_old, scale, momentum, u_out, v_out, float(t1),
                       float(t2), chunk)


def _accumulate(be, g, u_old, v_old, scale, momentum, u_out, v_out, t1, t2, chunk):
    n = g.numel()
    nc = (n + chunk - 1) // chunk
    counts = torch.empty((3, nc), dtype=_I64, device=g.device)
    if nc:
        flags = _flags(g, u_old, v_old, scale, momentum, v_out is not None)
        blk = _block(be)
        be.launch("hvd_dgc_accumulate", grid_for(nc, blk), blk,
                  (g, u_old if u_old is not None else g, v_old if v_old is not None else g, n,
                   1.0 if scale is None else float(scale), float(momentum), flags, t1, t2,
                   chunk, u_out if u_out is not None else g,
                   v_out if v_out is not None else g, counts.view(-1)))
    return counts


def select(be, x: torch.Tensor, t: float, chunk: int, ends: torch.Tensor, count: int, *,
           mask_x: bool = False, u: Optional[torch.Tensor] = None
           ) -> Tuple[torch.Tensor, torch.Tensor]:
    """The coordinates of ``x`` whose |x| passes ``t`` (|x| >= t and |x| > 0), ascending:
    (int64 indices (count,), float32 values x[idx]) -- the reference's
    ``torch.nonzero(mag >= t if t > 0 else mag > 0)`` and ``x[idx]``.  ``ends``: int64
    (ceil(n / chunk),), the inclusive prefix sum of that threshold's per-chunk counts (a row
    of ``accumulate``'s counts, cumsum'ed); ``count`` = ends[-1].  mask_x: x[idx] = 0
    afterwards; u: u[idx] = 0 afterwards (u must not be x)."""
    x = check_tensor(be, x, "x", _F32, output=mask_x)
    n = x.numel()
    chunk = check_int(chunk, "chunk", 1, MAX_CHUNK)
    ends = check_tensor(be, ends, "ends", _I64, (n + chunk - 1) // chunk, device=x.device)
    count = check_int(count, "count", 0, n)
    if u is not None:
        u = check_tensor(be, u, "u", _F32, n, output=True, device=x.device)
        if u.data_ptr() == x.data_ptr():
            raise ValueError("u must not be x (use mask_x)")
    return _select(be, x, float(t), chunk, ends, count, mask_x, u)


def _select(be, x, t, chunk, ends, count, mask_x, u):
    idx = torch.empty(count, dtype=_I64, device=x.device)
    vals = torch.empty(count, dtype=_F32, device=x.device)
    n = x.numel()
    if count:
        nc = (n + chunk - 1) // chunk
        blk = _block(be)
        flags = (1 if mask_x else 0) | (2 if u is not None else 0)
        be.launch("hvd_dgc_select", grid_for(nc, blk), blk,
                  (x, n, t, chunk, ends, idx, vals, flags, u if u is not None else x))
    return idx, vals


def mask(be, idx: torch.Tensor, v: Optional[torch.Tensor] = None,
         u: Optional[torch.Tensor] = None, dec: Optional[torch.Tensor] = None) -> None:
    """In place, for the distinct indices ``idx`` (int64 (m,)): ``v[idx] = v[idx] - dec``
    (when v is given; dec float32 (m,)) and ``u[idx] = 0`` (when u is given) -- the
    reference's state updates after sending (error feedback, momentum factor masking).
    v and u must be different tensors.  ValueError for an index outside [0, n)."""
    if v is None and u is None:
        return
    ref = v if v is not None else u
    ref = check_tensor(be, ref, "v" if v is not None else "u", _F32, output=True)
    n, dev = ref.numel(), ref.device
    idx = check_tensor(be, idx, "idx", _I64, device=dev)
    if v is not None:
        dec = check_tensor(be, dec, "dec", _F32, idx.numel(), device=dev)
    if u is not None:
        u = check_tensor(be, u, "u", _F32, n, output=True, device=dev)
        if v is not None and u.data_ptr() == v.data_ptr():
            raise ValueError("u and v must be different tensors")
    _mask(be, idx, v, u, dec, n)


def _mask(be, idx, v, u, dec, n):
    m = idx.numel()
    if not m:
        return
    ref = v if v is not None else u
    flags = (1 if v is not None else 0) | (2 if u is not None else 0)
    be.launch("hvd_dgc_mask", grid_for(m, _block(be)), _block(be),
              (idx, m, n, dec if dec is not None else ref, ref, u if u is not None else ref,
               flags))


def scatter_add(be, idx: torch.Tensor, vals: torch.Tensor, out: torch.Tensor,
                scale: float = 1.0) -> torch.Tensor:
    """``out[idx] += vals * scale`` in place for DISTINCT indices in [0, n) (one message's),
    float32: bit for bit ``out.index_add_(0, idx, vals * scale)`` (and, for scale 1,
    ``out.index_add_(0, idx, vals)``).  Returns out.  ValueError for an index outside
    [0, n) (nothing is promised about out then)."""
    out = check_tensor(be, out, "out", _F32, output=True)
    idx = check_tensor(be, idx, "idx", _I64, device=out.device)
    vals = check_tensor(be, vals, "vals", _F32, idx.numel(), device=out.device)
    m = idx.numel()
    if m:
        be.launch("hvd_dgc_scatter_add", grid_for(m, _block(be)), _block(be),
                  (idx, m, vals, _f32(float(scale)), out.numel(), out))
    return out


# ---- the selection step ------------------------------------------------------------------------

def exact_topk(idx: torch.Tensor, vals: torch.Tensor, k: int
               ) -> Tuple[torch.Tensor, torch.Tensor]:
    """The k entries of largest |vals| (all nonzero here), ties broken by the lower index,
    kept in their (ascending-index) order: ``topk_indices(vals.abs(), k)`` applied to the
    candidate list, as the reference's ``cand[topk_indices(mag[cand], k)]``."""
    c = vals.numel()
    if k >= c:
        return idx, vals
    mag = vals.abs()
    if k == 1:                                 # argmax: the first of the largest
        j = int(torch.argmax(mag))
        return idx[j:j + 1], vals[j:j + 1]
    t = torch.topk(mag, k, sorted=False).values.min()        # the k-th largest
    above = mag > t
    at = mag == t
    need = k - int(above.sum())
    keep = above | (at & (torch.cumsum(at, 0) <= need))       # ties: lowest indices first
    return idx[keep], vals[keep]


class Sparsified(NamedTuple):
    """What :func:`sparsify` returns.

    nonfinite: some v is NaN/Inf (nothing else is meaningful then; no state was touched).
    x: the tensor selected from (v_out, u_out, or g).
    idx, vals: the selected indices (int64, ascending) and x[idx] (float32), on g's device.
    masked: whether x[idx] = 0 (mask_x) and u[idx] = 0 (mask_u) were already applied."""
    nonfinite: bool
    x: Optional[torch.Tensor]
    idx: Optional[torch.Tensor]
    vals: Optional[torch.Tensor]
    masked: bool


def sparsify(be, g: torch.Tensor, k: int, *, u_old=None, v_old=None, u_out=None, v_out=None,
             scale: Optional[float] = None, momentum: float = 0.0, sample_size: int = 0,
             key4: Tuple[int, int, int, int] = (0, 0, 0, 0), exact: bool = True,
             mask_x: bool = False, mask_u: bool = False,
             chunk: Optional[int] = None) -> Sparsified:
    """DGC's update and selection (hvdcomp.compressors.sparse.DGC._encode up to the message,
    and DGC.select), in 3 or more launches (4 with a final mask):

    1. sample: |v| at the reference's ``sample_size`` Philox positions, computed from the
       inputs (the same float ops as step 2); the reference's thresholds t1 = the r-th and
       t2 = the min(s, 2r)-th largest sample value, r = min(s, max(1, ceil(s k / n)));
    2. accumulate: u, v written (u_out when momentum > 0; v_out when given, else v is u_out
       or g), per-chunk counts of |v| passing t1 and t2, and of non-finite v;
    3. choose the threshold as the reference does (t1 if >= k pass; else, with ``exact``,
       t2, then further down the sorted sample, counting again, then every nonzero);
    4. select the passing coordinates (ascending), masking x and u there when they are
       final and ``mask_x`` / ``mask_u``;
    5. more than k passing: :func:`exact_topk` among them (masking then left to the
       caller: ``masked`` False).

    Raises TypeError / ValueError for arguments of the wrong dtype, device or size.
    ``sample_size`` 0, or k >= n: no sample (every nonzero is a candidate).  ``exact``:
    the selection is :func:`topk_indices` (|v|, k) whatever the sample; False: the paper's
    one pass.  Result (idx, vals) identical to ``DGC.select(v.abs(), k, key)`` (with the
    sample size s = ``sample_size``), v and u identical to the reference's.  g, u_old,
    v_old: float32 (n,), n >= 1; outputs must not alias inputs; ``mask_x`` needs x to be a
    written output (v_out, or u_out when v_out is None).
    """
    g, u_old, v_old = _check_inputs(be, g, u_old, v_old, scale, momentum)
    n, dev = g.numel(), g.device
    if n == 0:
        raise ValueError("sparsify needs a non-empty tensor")
    k = check_int(k, "k", 1, 2**62)
    if momentum > 0:
        u_out = check_tensor(be, u_out, "u_out", _F32, n, output=True, device=dev)
    else:
        u_out = None
    if v_out is not None:
        v_out = check_tensor(be, v_out, "v_out", _F32, n, output=True, device=dev)
    chunk = check_int(default_chunk(be) if chunk is None else chunk, "chunk", 1, MAX_CHUNK)
    x = v_out if v_out is not None else (u_out if u_out is not None else g)
    if mask_x and x is g:
        raise ValueError("mask_x needs x to be v_out or u_out")
    if mask_u and u_out is None:
        raise ValueError("mask_u needs momentum > 0")
    if x is u_out and mask_u:                   # masking u is masking x
        mask_x, mask_u = True, False

    # 1. thresholds from the sample
    if k >= n or sample_size <= 0:
        t1 = t2 = 0.0
    else:
        s = min(n, int(sample_size))
        smp = _sample(be, g, u_old, v_old, scale, momentum, s, key4)
        ks = max(1, math.ceil(s * k / n))
        r = min(s, ks)
        r2 = min(s, 2 * r)
        top = torch.topk(smp, r2).values          # descending: the reference's sort, cut
        if r2 > r:
            t1, t2 = top[[r - 1, r2 - 1]].tolist()
        else:
            t1 = float(top[r - 1])
            t2 = 0.0                               # the sample is used up: every nonzero
    # 2. the update and the counts
    counts = _accumulate(be, g, u_old, v_old, scale, momentum, u_out, v_out, t1, t2, chunk)
    ends = torch.cumsum(counts, dim=1)
    c1, c2, bad = ends[:, -1].tolist()
    if bad:
        return Sparsified(True, None, None, None, False)
    # 3. the threshold, as DGC.select walks it
    row = 0
    if c1 >= k or not exact or not t1 > 0:
        t, c = t1, c1
    elif c2 >= k or not t2 > 0:
        t, c, row = t2, c2, 1
    else:
        # Both too high: continue the reference's walk down the sorted sample (r doubling,
        # two thresholds per counting pass), then every nonzero once the sample is used up.
        # Only reached with `exact`, whose result does not depend on the walk: it only
        # keeps the candidates few.
        srt = torch.sort(smp, descending=True).values
        r = r2
        while True:
            ra = min(s, 2 * r)
            rb = min(s, 2 * ra)
            ta = float(srt[ra - 1]) if r < s else 0.0
            tb = float(srt[rb - 1]) if rb > ra else 0.0
            ends = torch.cumsum(_accumulate(be, x, None, None, None, 0.0, None, None, ta, tb,
                                            chunk), dim=1)
            ca, cb = ends[:2, -1].tolist()
            if ca >= k or not ta > 0:
                t, c, row = ta, ca, 0
                break
            if cb >= k or not tb > 0:
                t, c, row = tb, cb, 1
                break
            r = rb
    final = c <= k
    fuse = final and (mask_x or mask_u)
    idx, vals = _select(be, x, t, chunk, ends[row], c, fuse and mask_x,
                        u_out if (fuse and mask_u) else None)
    if not final:
        idx, vals = exact_topk(idx, vals, k)
    return Sparsified(False, x, idx, vals, fuse)
