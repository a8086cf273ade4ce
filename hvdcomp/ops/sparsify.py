"""Sparsification: DGC's state update, sampled-threshold selection and masking, and the
receiver's scatter-add (kernels/dgc.cu).

Sources: Lin, Han, Mao, Wang, Dally, "Deep Gradient Compression", ICLR 2018 (arXiv
1712.01887): Sec. 3.1 (sparsification with local accumulation, Algorithm 1), Sec. 3.2
(momentum correction, local gradient clipping), Sec. 3.3 (momentum factor masking) and Sec. 5
(the threshold from a sample, re-selection when too many pass); Stich, Cordonnier, Jaggi,
"Sparsified SGD with Memory", NeurIPS 2018 (top-k and random-k with error feedback).

The element-wise step, per coordinate, in float32 (two roundings, no FMA):

    g <- g * scale                       clipping (scale = float32(T / ||g||), or none)
    u <- u_old * m + g   (u <- g without u_old)       momentum correction, if m > 0
    v <- v_old + a       (v <- a without v_old)       a = u if m > 0 else g

Top-k's and random-k's error feedback ``p = g + e`` is the same step with ``v_old = e``.

Operations (:class:`~hvdcomp.ops.Op`: a PyTorch reference, the specification, and the
kernel implementation):

    sumsq(x) -> float                        ||x||^2 in float64 (the clipping norm)
    update(g, ...) -> bool                   the step; whether every v is finite
    select(g, k, ...) -> Selection           the step, then the coordinates to send, then
                                             the masking of what was sent
    mask(idx, v=, u=, dec=)                  v[idx] -= dec; u[idx] = 0 (after sending)
    scatter_add(idx, vals, out, scale=1.0)   out[idx] += vals * scale (the receiver)

The selection rules (references; plain functions): :func:`topk_indices` (exact top-k among
nonzeros, ties by the lower index), :func:`sample_positions` and :func:`threshold_select`
(DGC's sampled threshold), :func:`random_indices` (random-k).

The kernel path of ``select``: one pass samples |v| at the reference's Philox positions and
places two thresholds; one pass computes u, v, their finiteness and per-chunk counts of the
candidates above both thresholds; one pass writes the candidates in index order (per-chunk
counts, prefix sum, each chunk writing its own outputs), masking them where they are final;
otherwise the exact top-k among the few candidates (:func:`exact_topk`) and a masking launch
follow.  The launchers (``launch_*``: the backend's launch object ``be`` first, one kernel
each, arguments checked) are the kernel implementations' steps.  Tensors are flat (1-D),
float32 unless stated; ``key4`` is ``(seed, rank, tensor_id, step)``.
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional, Tuple

import torch

from ..backends._common import BLOCK, MAX_GRID, check_int, check_tensor, grid_for, u32
from ..philox import random_words
from . import finite, op

__all__ = ["sumsq", "update", "select", "mask", "scatter_add", "Selection", "topk_indices",
           "sample_positions", "threshold_select", "random_indices", "exact_topk",
           "launch_sample", "launch_accumulate", "launch_select", "launch_scatter_add"]

# flags of hvd_dgc_accumulate / hvd_dgc_sample (kernels/dgc.cu)
CLIP, MOM, HAS_U, HAS_V, WRITE_V = 1, 2, 4, 8, 16
NORM_CHUNK = 65536          # HVD_DGC_NORM_CHUNK: coordinates per float64 partial sum
NORM_BLOCK = 256            # HVD_DGC_NORM_BLOCK
HOST_CHUNK = 4096           # coordinates per selection chunk on the CPU (one OS thread's run)
CUDA_CHUNK = 64             # ... on a GPU (one thread's run; small for memory parallelism)
SAMPLE_GROUP = 16           # draws per thread of hvd_dgc_sample
MAX_CHUNK = 2**30           # HVD_DGC_MAX_CHUNK
HOST_BLOCK = 8              # threads per block on the host (blocks are what runs in parallel)
PLACING_SAMPLE = 0.01       # sample ratio that places the kernels' thresholds for exact top-k

_F32 = torch.float32
_I64 = torch.int64
Key4 = Tuple[int, int, int, int]


# --- selection rules (the specification) --------------------------------------------------------

def topk_indices(mag: torch.Tensor, k: int) -> torch.Tensor:
    """Exact top-k of a flat non-negative float tensor among its NONZERO entries, ties broken
    by the lower index.  Returns the selected indices, int64, ascending, on mag's device
    (min(k, number of nonzeros) of them)."""
    n = mag.numel()
    if k <= 0 or n == 0:
        return torch.zeros(0, dtype=_I64, device=mag.device)
    if k >= n:
        return torch.nonzero(mag > 0).reshape(-1)
    t = torch.topk(mag, k, sorted=False).values.min()        # the k-th largest magnitude
    if not bool(t > 0):                                       # fewer than k nonzeros
        return torch.nonzero(mag > 0).reshape(-1)
    above = torch.nonzero(mag > t).reshape(-1)
    at = torch.nonzero(mag == t).reshape(-1)[:k - above.numel()]   # ties: lowest indices
    return torch.sort(torch.cat([above, at])).values


def _u63(count: int, key4: Key4, offset: int, device) -> torch.Tensor:
    """``count`` non-negative 63-bit integers from Philox words ``offset + 2j, 2j + 1``."""
    seed, rank, tensor_id, step = key4
    w = random_words(2 * count, seed=seed, step=step, rank=rank, tensor_id=tensor_id,
                     offset=offset, device=device).view(-1, 2)
    return ((w[:, 0] >> 1) << 32) | w[:, 1]


def sample_positions(s: int, n: int, key4: Key4, device=None) -> torch.Tensor:
    """DGC's random sample (Sec. 5): ``s`` positions in [0, n) (with replacement), int64,
    position j being ``u63_j mod n`` with u63_j built from the Philox words 2j and 2j+1 of
    the key (``((w_2j >> 1) << 32) | w_2j+1``).  The modulo bias is below n / 2**63."""
    if s <= 0 or n <= 0:
        return torch.zeros(0, dtype=_I64, device=device)
    return _u63(s, key4, 0, device) % n


def threshold_select(mag: torch.Tensor, k: int, sample_size: int, key4: Key4,
                     exact: bool = True) -> torch.Tensor:
    """DGC's selection (Sec. 3.1, Sec. 5) for magnitudes ``mag`` (flat, >= 0): indices,
    int64, ascending.  The threshold t is the r-th largest of the sample
    ``mag[sample_positions(s, n, key4)]``, s = min(n, sample_size), r = min(s, ceil(s k / n));
    candidates are |v| >= t (every nonzero for t = 0); more than k candidates: the exact
    top-k among them (hierarchical re-selection).  With ``exact``, too few lowers t to the
    sample's 2r-th, 4r-th ... value and finally takes the exact top-k: the result is then
    :func:`topk_indices` (mag, k) whatever the sample, which only makes it cheap; without,
    one threshold as in the paper (fewer than k may pass).  ``sample_size`` 0 or k >= n:
    :func:`topk_indices`."""
    n = mag.numel()
    if k >= n or sample_size <= 0:
        return topk_indices(mag, k)
    s = min(n, int(sample_size))
    smp = torch.sort(mag[sample_positions(s, n, key4, mag.device)], descending=True).values
    r = min(s, max(1, math.ceil(s * k / n)))
    while True:
        t = smp[r - 1]
        cand = torch.nonzero(mag >= t if bool(t > 0) else mag > 0).reshape(-1)
        if cand.numel() >= k:
            return cand[topk_indices(mag[cand], k)]
        if not bool(t > 0) or not exact:
            return cand                      # every nonzero, or the paper's one pass
        if r == s:
            return topk_indices(mag, k)      # the sample is used up: exact
        r = min(s, 2 * r)


def random_indices(n: int, k: int, key4: Key4, device=None) -> torch.Tensor:
    """Random-k (Stich et al.): ``k`` distinct indices in [0, n), int64 ascending, a function
    of ``key4`` alone, so every receiver regenerates the sender's.

    * ``k >= n``: all indices.
    * ``4 k <= n``: the first k DISTINCT values of the stream ``u63_j mod n`` (j = 0, 1, ...;
      u63 as in :func:`sample_positions`): a uniformly random k-subset.  Drawn in batches;
      the result does not depend on the batch size.
    * otherwise: the k indices with the smallest Philox word (word i for index i), ties by
      the lower index: also a uniformly random k-subset (up to the ties' negligible bias),
      at the cost of n words instead of about k.
    """
    if k >= n:
        return torch.arange(max(n, 0), dtype=_I64, device=device)
    if k <= 0:
        return torch.zeros(0, dtype=_I64, device=device)
    if 4 * k > n:
        seed, rank, tensor_id, step = key4
        w = random_words(n, seed=seed, step=step, rank=rank, tensor_id=tensor_id,
                         device=device)
        order = torch.sort(w, stable=True).indices           # stable: ties by lower index
        return torch.sort(order[:k]).values
    draws = torch.zeros(0, dtype=_I64, device=device)
    batch = k + k // 4 + 32
    while True:
        more = _u63(batch, key4, 2 * draws.numel(), device) % n
        draws = torch.cat([draws, more])
        uniq, inv = torch.unique(draws, return_inverse=True)
        if uniq.numel() >= k:
            first = torch.full((uniq.numel(),), draws.numel(), dtype=_I64, device=device)
            first.scatter_reduce_(0, inv, torch.arange(draws.numel(), device=device),
                                  reduce="amin")
            pick = torch.sort(first).indices[:k]             # earliest first occurrences
            return torch.sort(uniq[pick]).values
        batch = 2 * (k - uniq.numel()) + 32


# --- the element-wise step (reference) ------------------------------------------------------

def _check_scalars(scale, momentum) -> None:
    if scale is not None and not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
    if not isinstance(momentum, (int, float)) or not 0 <= momentum < 1:
        raise ValueError(f"momentum must be in [0, 1), got {momentum!r}")


def _check_step(scale, momentum, v_old, u_out, v_out, mask_x=False, mask_u=False) -> None:
    """The rules of the step's arguments, the same for the reference and the kernels."""
    _check_scalars(scale, momentum)
    if momentum > 0 and u_out is None:
        raise ValueError("momentum > 0 needs u_out")
    if mask_x and v_out is None and v_old is None and not momentum > 0 and scale is None:
        raise ValueError("mask_x needs x to be v_out or u_out")      # x would be g
    if mask_u and not momentum > 0:
        raise ValueError("mask_u needs momentum > 0")


def _step(g, u_old, v_old, u_out, v_out, scale, momentum) -> torch.Tensor:
    """The element-wise step (module docstring) in PyTorch: u into u_out (momentum > 0), v
    into v_out when given; returns v (v_out, u_out, g, or a new tensor g * scale)."""
    dev = g.device
    if scale is not None:
        g = g * torch.tensor(scale, dtype=_F32, device=dev)
    a = g
    if momentum > 0:
        if u_old is None:
            u_out.copy_(g)
        else:
            torch.mul(u_old, torch.tensor(momentum, dtype=_F32, device=dev), out=u_out)
            u_out.add_(g)
        a = u_out
    if v_old is not None:
        return torch.add(v_old, a, out=v_out) if v_out is not None else v_old + a
    return v_out.copy_(a) if v_out is not None else a


def _f32(x: float) -> float:
    """x rounded to float32 (what torch.tensor(x, dtype=float32) holds), as a Python float."""
    return float(torch.tensor(x, dtype=_F32)) if x == x else x


def _kernel_momentum(momentum: float) -> Optional[float]:
    """The float32 factor the kernels apply, or None where it rounds to 0 although m > 0
    (the reference keeps u = u_old * 0 + g then; the kernels would drop u)."""
    m = _f32(float(momentum)) if momentum > 0 else 0.0
    return None if momentum > 0 and m == 0.0 else m


# --- operations ---------------------------------------------------------------------------------

@op
def sumsq(x: torch.Tensor) -> float:
    """Sum of x[i]^2 over float32 ``x`` (n,), in float64: the square of the clipping norm
    (Sec. 3.2).  Reference: ``torch.sum``'s order; kernels: partial sums of 65536-coordinate
    chunks (256 threads, 4 interleaved sums each, a fixed tree), then their sum in a fixed
    order that depends on n alone (the same on every device).  The two agree to float64
    rounding (a few ulp), not necessarily bit for bit."""
    return float(x.double().pow(2).sum())


@sumsq.kernel
def _(be, x: torch.Tensor) -> float:
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


@op
def update(g: torch.Tensor, *, u_old=None, v_old=None, u_out=None, v_out=None,
           scale: Optional[float] = None, momentum: float = 0.0) -> bool:
    """The element-wise step (module docstring) of float32 ``g`` (n,): u written into
    ``u_out`` when ``momentum > 0`` (required then), v into ``v_out`` when given.  Returns
    whether every v is finite (random-k's p = g + e: ``v_old=e, v_out=p``).  ``scale``: the
    float32 clipping factor or None; ``momentum`` in [0, 1).  u_old, v_old, u_out, v_out:
    float32 (n,) on g's device; outputs must not alias inputs.  TypeError / ValueError for
    arguments of the wrong type, dtype, device or size."""
    _check_step(scale, momentum, v_old, u_out, v_out)
    return finite(_step(g, u_old, v_old, u_out, v_out, scale, momentum))


@update.kernel
def _(be, g, *, u_old=None, v_old=None, u_out=None, v_out=None, scale=None, momentum=0.0):
    m = _kernel_momentum(momentum)
    if m is None:
        return NotImplemented
    _check_step(scale, momentum, v_old, u_out, v_out)
    g, u_old, v_old, u_out, v_out = _check_tensors(be, g, u_old, v_old, u_out, v_out, m)
    counts = _accumulate(be, g, u_old, v_old, scale, m, u_out, v_out, math.inf, math.inf,
                         _chunk(be))
    return int(counts[2].sum()) == 0


class Selection(NamedTuple):
    """What :func:`select` returns.

    nonfinite: some v is NaN/Inf (then idx and vals are None, and what the outputs hold is
    not the state: the caller keeps its old one).
    idx, vals: the selected indices (int64, ascending) and x[idx] before masking (float32),
    on g's device."""
    nonfinite: bool
    idx: Optional[torch.Tensor]
    vals: Optional[torch.Tensor]


@op
def select(g: torch.Tensor, k: int, *, u_old=None, v_old=None, u_out=None, v_out=None,
           scale: Optional[float] = None, momentum: float = 0.0, sample_size: int = 0,
           key4: Key4 = (0, 0, 0, 0), exact: bool = True, mask_x: bool = False,
           mask_u: bool = False) -> Selection:
    """DGC's step and selection (Sec. 3): the element-wise step as :func:`update` (u into
    u_out, v into v_out when given), then the coordinates of v chosen by
    :func:`threshold_select` (|v|, k, sample_size, key4, exact), then the masking of what
    is sent: v[idx] = 0 with ``mask_x`` (error feedback with fp32 values; v must not be g
    itself), u[idx] = 0 with ``mask_u`` (momentum factor masking, Sec. 3.3).

    g, u_old, v_old, u_out, v_out: float32 (n,) on one device; outputs must not alias
    inputs.  k >= 0 coordinates (k >= n: every nonzero).  ``sample_size`` 0: the exact
    top-k (the kernels still sample PLACING_SAMPLE of the coordinates to place their
    thresholds; the result is the same).  Raises TypeError / ValueError for arguments of
    the wrong type, dtype, device or size.
    """
    _check_step(scale, momentum, v_old, u_out, v_out, mask_x, mask_u)
    x = _step(g, u_old, v_old, u_out, v_out, scale, momentum)
    if not finite(x):
        return Selection(True, None, None)
    idx = threshold_select(x.abs(), k, sample_size, key4, exact)
    vals = x[idx]
    if mask_x:
        x[idx] = 0.0
    if mask_u:
        u_out[idx] = 0.0
    return Selection(False, idx, vals)


@select.kernel
def _(be, g, k, *, u_old=None, v_old=None, u_out=None, v_out=None, scale=None, momentum=0.0,
      sample_size=0, key4=(0, 0, 0, 0), exact=True, mask_x=False, mask_u=False):
    m = _kernel_momentum(momentum)
    if m is None or k == 0:
        return NotImplemented                  # k = 0 (an empty tensor): nothing to launch
    _check_step(scale, momentum, v_old, u_out, v_out, mask_x, mask_u)
    g, u_old, v_old, u_out, v_out = _check_tensors(be, g, u_old, v_old, u_out, v_out, m)
    n, dev = g.numel(), g.device
    if n == 0:
        raise ValueError("select needs a non-empty tensor")
    k = check_int(k, "k", 1, 2**62)
    chunk = _chunk(be)
    if v_out is None and (v_old is not None or (m == 0.0 and scale is not None)):
        v_out = torch.empty(n, dtype=_F32, device=dev)      # v is neither u nor g: not kept
    x = v_out if v_out is not None else (u_out if u_out is not None else g)
    if x is u_out and mask_u:                   # masking u is masking x
        mask_x, mask_u = True, False
    if sample_size <= 0:
        sample_size, exact = min(n, max(1, math.ceil(PLACING_SAMPLE * n))), True

    # 1. thresholds from the sample
    if k >= n:
        t1 = t2 = 0.0
    else:
        s = min(n, int(sample_size))
        smp = _sample(be, g, u_old, v_old, scale, m, s, key4)
        r = min(s, max(1, math.ceil(s * k / n)))
        r2 = min(s, 2 * r)
        top = torch.topk(smp, r2).values          # descending: the reference's sort, cut
        if r2 > r:
            t1, t2 = top[[r - 1, r2 - 1]].tolist()
        else:
            t1 = float(top[r - 1])
            t2 = 0.0                               # the sample is used up: every nonzero
    # 2. the update and the counts
    counts = _accumulate(be, g, u_old, v_old, scale, m, u_out, v_out, t1, t2, chunk)
    ends = torch.cumsum(counts, dim=1)
    c1, c2, bad = ends[:, -1].tolist()
    if bad:
        return Selection(True, None, None)
    # 3. the threshold, as threshold_select walks it
    if c1 >= k or not exact or not t1 > 0:
        t, c, ends = t1, c1, ends[0]
    elif c2 >= k or not t2 > 0:
        t, c, ends = t2, c2, ends[1]
    else:
        t, c, ends = _walk(be, x, smp, r2, k, chunk)
    # 4. the candidates in index order, masked where they are final; 5. else the exact
    # top-k among them, then the masking
    final = c <= k
    idx, vals = _select(be, x, t, chunk, ends, c, final and mask_x,
                        u_out if (final and mask_u) else None)
    if not final:
        idx, vals = exact_topk(idx, vals, k)
        _mask(be, idx, x if mask_x else None, u_out if mask_u else None, vals, n)
    return Selection(False, idx, vals)


def _walk(be, x, smp, r, k, chunk):
    """select's kernels when the sample's r-th and 2r-th values both let fewer than k
    through: threshold_select's walk down the sorted sample continues (r doubling, two
    thresholds per counting pass over x), then takes every nonzero once the sample is used
    up.  Only reached with ``exact``, whose result does not depend on the walk: it only
    keeps the candidates few.  Returns (threshold, count, inclusive prefix sum of the
    per-chunk counts)."""
    s = smp.numel()
    srt = torch.sort(smp, descending=True).values
    while True:
        ra = min(s, 2 * r)
        rb = min(s, 2 * ra)
        ta = float(srt[ra - 1]) if r < s else 0.0
        tb = float(srt[rb - 1]) if rb > ra else 0.0
        ends = torch.cumsum(_accumulate(be, x, None, None, None, 0.0, None, None, ta, tb,
                                        chunk), dim=1)
        ca, cb = ends[:2, -1].tolist()
        if ca >= k or not ta > 0:
            return ta, ca, ends[0]
        if cb >= k or not tb > 0:
            return tb, cb, ends[1]
        r = rb


@op
def mask(idx: torch.Tensor, v: Optional[torch.Tensor] = None,
         u: Optional[torch.Tensor] = None, dec: Optional[torch.Tensor] = None) -> None:
    """In place, for the distinct indices ``idx`` (int64 (m,)): ``v[idx] = v[idx] - dec``
    (when v is given; dec float32 (m,)) and ``u[idx] = 0`` (when u is given): the state
    after sending (error feedback, momentum factor masking).  v and u: float32 (n,),
    different tensors.  An index outside [0, n) raises (IndexError from the reference,
    RuntimeError from the kernels)."""
    if v is not None:
        v[idx] = v[idx] - dec
    if u is not None:
        u[idx] = 0.0


@mask.kernel
def _(be, idx, v=None, u=None, dec=None):
    if v is None and u is None:
        return None
    ref = check_tensor(be, v if v is not None else u, "v" if v is not None else "u", _F32,
                       output=True)
    n, dev = ref.numel(), ref.device
    idx = check_tensor(be, idx, "idx", _I64, device=dev)
    if v is not None:
        dec = check_tensor(be, dec, "dec", _F32, idx.numel(), device=dev)
    if u is not None:
        u = check_tensor(be, u, "u", _F32, n, output=True, device=dev)
        if v is not None and u.data_ptr() == v.data_ptr():
            raise ValueError("u and v must be different tensors")
    _mask(be, idx, v, u, dec, n)
    return None


@op
def scatter_add(idx: torch.Tensor, vals: torch.Tensor, out: torch.Tensor,
                scale: float = 1.0) -> torch.Tensor:
    """``out[idx] += vals * scale`` in place for DISTINCT indices in [0, n) (one message's;
    ``vals * float32(scale)`` in float32, plain ``vals`` for scale 1), as
    ``out.index_add_``; returns out.  idx int64 (m,), vals float32 (m,), on out's device.
    An index outside [0, n) raises (IndexError from the reference, RuntimeError from the
    kernels).  The kernel serves flat contiguous float32 ``out`` on a GPU; on the CPU
    index_add_ costs about 1 us for a message, a launch from Python about 10, so the
    reference runs there (:func:`launch_scatter_add` runs the kernel on any backend)."""
    if scale != 1.0:
        vals = vals * torch.tensor(scale, dtype=_F32, device=vals.device)
    return out.index_add_(0, idx, vals)


@scatter_add.kernel
def _(be, idx, vals, out, scale=1.0):
    if (be.device_type == "cpu" or out.dtype != _F32 or out.dim() != 1
            or not out.is_contiguous() or out.requires_grad):
        return NotImplemented
    return launch_scatter_add(be, idx, vals, out, scale)


# --- launchers (the kernel implementations' steps) ----------------------------------------------

def _chunk(be) -> int:
    """Coordinates per selection chunk for backend ``be`` (any value gives the same
    results; it only sets the work per thread and the length of the counts)."""
    return HOST_CHUNK if be.device_type == "cpu" else CUDA_CHUNK


def _block(be) -> int:
    return HOST_BLOCK if be.device_type == "cpu" else BLOCK


def _check_tensors(be, g, u_old, v_old, u_out, v_out, momentum):
    """The step's tensors checked for ``be``; u_old and u_out are dropped (None) without
    momentum, as the step ignores them then."""
    g = check_tensor(be, g, "g", _F32)
    n, dev = g.numel(), g.device
    if not momentum > 0:
        u_old = u_out = None
    if u_old is not None:
        u_old = check_tensor(be, u_old, "u_old", _F32, n, device=dev)
    if v_old is not None:
        v_old = check_tensor(be, v_old, "v_old", _F32, n, device=dev)
    if u_out is not None:
        u_out = check_tensor(be, u_out, "u_out", _F32, n, output=True, device=dev)
    if v_out is not None:
        v_out = check_tensor(be, v_out, "v_out", _F32, n, output=True, device=dev)
    return g, u_old, v_old, u_out, v_out


def _flags(u_old, v_old, scale, momentum, write_v: bool) -> int:
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


def launch_sample(be, g: torch.Tensor, s: int, key4: Key4, *,
                  u_old: Optional[torch.Tensor] = None, v_old: Optional[torch.Tensor] = None,
                  scale: Optional[float] = None, momentum: float = 0.0) -> torch.Tensor:
    """hvd_dgc_sample: float32 (s,), |v| at ``sample_positions(s, n, key4)`` where v is the
    step of (g, u_old, v_old) -- the reference's ``mag[sample_positions(...)]``, bit for
    bit, without writing v.  ``momentum``: the float32 factor (0 = off).  s >= 0; n >= 1
    when s > 0."""
    _check_scalars(scale, momentum)
    g, u_old, v_old, _, _ = _check_tensors(be, g, u_old, v_old, None, None, momentum)
    s = check_int(s, "s", 0, 2**62)
    if s and g.numel() == 0:
        raise ValueError("cannot sample an empty tensor")
    return _sample(be, g, u_old, v_old, scale, momentum, s, key4)


def _sample(be, g, u_old, v_old, scale, momentum, s, key4):
    out = torch.empty(s, dtype=_F32, device=g.device)
    if s:
        seed, rank, tid, step = key4
        be.launch("hvd_dgc_sample", grid_for((s + SAMPLE_GROUP - 1) // SAMPLE_GROUP,
                                             _block(be)), _block(be),
                  (g, u_old if u_old is not None else g, v_old if v_old is not None else g,
                   g.numel(), 1.0 if scale is None else float(scale), float(momentum),
                   _flags(u_old, v_old, scale, momentum, False), s, u32(seed, "seed"),
                   u32(rank, "rank"), u32(tid, "tensor_id"), u32(step, "step"), out))
    return out


def launch_accumulate(be, g: torch.Tensor, *, u_old=None, v_old=None, scale=None,
                      momentum=0.0, u_out=None, v_out=None, t1: float = math.inf,
                      t2: float = math.inf, chunk: Optional[int] = None) -> torch.Tensor:
    """hvd_dgc_accumulate: the step in one pass, u into ``u_out`` (momentum > 0: the float32
    factor; u_out required), v into ``v_out`` when given.  Returns int64 counts
    (3, ceil(n / chunk)): per chunk of ``chunk`` coordinates, how many |v| pass t1 (row 0)
    and t2 (row 1) (|v| >= t and |v| > 0), and how many v are NaN/Inf (row 2).  u and v
    equal the reference's bit for bit.  Outputs must not alias the inputs."""
    _check_step(scale, momentum, v_old, u_out, v_out)
    g, u_old, v_old, u_out, v_out = _check_tensors(be, g, u_old, v_old, u_out, v_out, momentum)
    chunk = check_int(_chunk(be) if chunk is None else chunk, "chunk", 1, MAX_CHUNK)
    return _accumulate(be, g, u_old, v_old, scale, momentum, u_out, v_out, float(t1),
                       float(t2), chunk)


def _accumulate(be, g, u_old, v_old, scale, momentum, u_out, v_out, t1, t2, chunk):
    n = g.numel()
    nc = (n + chunk - 1) // chunk
    counts = torch.empty((3, nc), dtype=_I64, device=g.device)
    if nc:
        blk = _block(be)
        be.launch("hvd_dgc_accumulate", grid_for(nc, blk), blk,
                  (g, u_old if u_old is not None else g, v_old if v_old is not None else g, n,
                   1.0 if scale is None else float(scale), float(momentum),
                   _flags(u_old, v_old, scale, momentum, v_out is not None), t1, t2,
                   chunk, u_out if u_out is not None else g,
                   v_out if v_out is not None else g, counts.view(-1)))
    return counts


def launch_select(be, x: torch.Tensor, t: float, chunk: int, ends: torch.Tensor, count: int,
                  *, mask_x: bool = False, u: Optional[torch.Tensor] = None
                  ) -> Tuple[torch.Tensor, torch.Tensor]:
    """hvd_dgc_select: the coordinates of ``x`` whose |x| passes ``t`` (|x| >= t and
    |x| > 0), ascending: (int64 indices (count,), float32 values x[idx]) -- the reference's
    ``torch.nonzero(mag >= t if t > 0 else mag > 0)`` and ``x[idx]``.  ``ends``: int64
    (ceil(n / chunk),), the inclusive prefix sum of that threshold's per-chunk counts (a row
    of :func:`launch_accumulate`'s counts, cumsum'ed); ``count`` = ends[-1].  mask_x:
    x[idx] = 0 afterwards; u: u[idx] = 0 afterwards (u must not be x)."""
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


def _mask(be, idx, v, u, dec, n):
    m = idx.numel()
    if not m or (v is None and u is None):
        return
    ref = v if v is not None else u
    flags = (1 if v is not None else 0) | (2 if u is not None else 0)
    be.launch("hvd_dgc_mask", grid_for(m, _block(be)), _block(be),
              (idx, m, n, dec if dec is not None else ref, ref, u if u is not None else ref,
               flags))


def launch_scatter_add(be, idx: torch.Tensor, vals: torch.Tensor, out: torch.Tensor,
                       scale: float = 1.0) -> torch.Tensor:
    """hvd_dgc_scatter_add: :func:`scatter_add` on any backend, the CPU's included (the
    op runs it on GPUs only).  Bit for bit ``out.index_add_(0, idx, vals * scale)``.
    Returns out.  RuntimeError for an index outside [0, n) (nothing is promised about out
    then)."""
    out = check_tensor(be, out, "out", _F32, output=True)
    idx = check_tensor(be, idx, "idx", _I64, device=out.device)
    vals = check_tensor(be, vals, "vals", _F32, idx.numel(), device=out.device)
    m = idx.numel()
    if m:
        be.launch("hvd_dgc_scatter_add", grid_for(m, _block(be)), _block(be),
                  (idx, m, vals, _f32(float(scale)), out.numel(), out))
    return out


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
