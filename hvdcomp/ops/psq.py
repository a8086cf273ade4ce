"""Row quantization (PSQ) and the block Householder transform (BHQ): the arithmetic of
Chen, Gai, Yao, Mahoney, Gonzalez, "A Statistical Framework for Low-bitwidth Training of
Deep Neural Networks", NeurIPS 2020 (arXiv 2010.14298), Sec. 4, with kernels/psq.cu.

The gradient is a float32 matrix of R rows and D columns (hvdcomp.compressors.psq: the row
view and the wire format).  ``bits`` (1..8) is the code width: the grid of a row is
``2**bits`` equally spaced points over its own ``[min, max]`` (no sign bit), L = 2**bits - 1
intervals (the paper's B).

PSQ: stochastic rounding of one row
-----------------------------------
For row ``x`` (float32) with ``lo = min x``, ``hi = max x`` (float32, sent), in float64:
    span = hi - lo;  r = (x - lo) / span * L   (r = 0 where span == 0), clamped to [0, L]
    f = floor(r);  index = f + (u < r - f)
where ``u`` is the float32 uniform :func:`hvdcomp.philox.uniform` of the coordinate's flat
index (row-major) keyed by (seed, rank, tensor_id, step).
Decoded value (float64, rounded once to float32): ``lo + index * step``, step = span / L.
    E[decoded] = x;   Var = (g_{f+1} - x)(x - g_f) = step^2 (r - f)(1 - (r - f))
up to float32 rounding of the decoded value; a row whose values are all equal (an all-zero
row in particular) has span 0 and decodes exactly.

BHQ: block Householder transform
--------------------------------
The sender groups rows into blocks by a fixed, deterministic rule (:class:`BhqBlocks`):
  1. magnitude m_i = hi_i - lo_i (the row's range, float64).  Rows with m_i = 0 are constant;
     they become singleton blocks at the end (exact, like PSQ).  The other R' rows are
     sorted by decreasing m (stable: ties keep row order).
  2. G = ceil(R' / block_size) blocks.  The G largest rows are the blocks' leading ("big")
     rows; the remaining rows are taken in increasing magnitude (the sorted list reversed) and
     dealt out in chunks of block_size - 1: block g = [big g] + small[g*(k-1):(g+1)*(k-1)].
     So the largest row shares its block with the smallest rows; all blocks but the last
     have exactly block_size rows.
  3. For a block of k >= 2 rows with big-row range l1 and RMS range l2 of the others, the
     leading row is scaled by
         s = float32((l2 * sqrt(k) / ((k - 1) * l1)) ** (1/3))
     and the block is reflected by
         H = I - 2 n n^T / ||n||^2,   n = e_1 - 1/sqrt(k),   so  H e_1 = 1/sqrt(k)
     (H maps the big row onto the normalized all-ones direction: its magnitude is spread
     evenly over the block).  y = H diag(s, 1, ..., 1) x is computed in float64 and rounded
     to float32, then every row of y is quantized as PSQ.  Because H is orthogonal with
     (H e_1)_j^2 = 1/k, the block's exact error variance is
         (1 + (1/s^2 - 1) / k) * sum_rows PSQ-variance(y_row).
     The scale minimizes the paper's variance model: each row of y has a range of about
     s l1 / sqrt(k) + l2, so the block variance is about (s c + l2)^2 (1/s^2 + k - 1) with
     c = l1 / sqrt(k), minimal at s c = (l2 c^2 / (k - 1))^(1/3); for l1 >> l2 that is
     k (l1^(2/3) k^(-2/3) + l2^(2/3))^3 ~ l1^2 / k instead of PSQ's l1^2 + (k - 1) l2^2.
     (With s = 1 the model gives k (c + l2)^2 >= l1^2: H alone does not beat PSQ.)
  4. If that is not strictly smaller than the PSQ variance of the block's own rows (or is not
     finite), or if the block's decode bound (:func:`decode_bounds`: the receiver's values
     could leave the float32 range) exceeds the float32 maximum, the block is sent as k
     singleton blocks instead (scale 1, no transform).  So BHQ's exact variance never
     exceeds PSQ's, every message decodes to finite values, and each choice depends only on
     the data, never on the random draws, so the estimator stays unbiased.
The receiver dequantizes y (float64), applies H again (H is its own inverse), divides the
leading row by s, rounds to float32 and puts wire row p back at row ``perm[p]``.

Householder arithmetic (both sides, float64, per block of k rows Y[0..k-1], t = 1/sqrt(k)):
    acc = Y[0] + Y[1] + ... + Y[k-1] (in that order);  w = Y[0] - t * acc   (= n^T Y)
    c = 2 / (2 - 2 t);   Y[0] -= (c * (1 - t)) * w;   Y[j] -= (c * -t) * w  (j >= 1)
(the coefficients are Python floats); the sender scales Y[0] by s before, the receiver
divides Y[0] by s after.

Ops and kernels
---------------
The ops (:func:`quantize_rows`, :func:`dequantize_add`, :func:`row_variance`,
:func:`householder_forward`, :func:`bhq_dequantize_add`) run kernels/psq.cu where a kernel
backend serves the device and their PyTorch references otherwise, with the same results bit
for bit on the same device.  What stays torch code on both paths: the per-row min and max
(:func:`lohi_of`: which of -0.0 and +0.0 ``amin``/``amax`` return is PyTorch's choice, and
it is on the wire), the per-row grid step (:func:`steps_of`: a division by a Python scalar,
a true division on the CPU and a multiplication by the reciprocal on CUDA), BHQ's grouping
and choice on R row ranges and G blocks (:class:`BhqBlocks`) and the row sums of the
variance terms (``torch.sum``).  :func:`bhq_plan` composes them.
"""
from __future__ import annotations

import math
from typing import Tuple

import torch

from ..backends._common import BLOCK, check_int, check_tensor, grid_for, packed_size, u32
from .bitpack import pack_bits, unpack_bits
from ..philox import uniform
from . import op

__all__ = ["lohi_of", "steps_of", "round_rows", "dequantize_rows", "householder_blocks",
           "decode_bounds", "check_blocks", "BhqBlocks", "quantize_rows", "dequantize_add",
           "row_variance", "householder_forward", "bhq_dequantize_add", "bhq_plan"]


# --- the specification: plain PyTorch ----------------------------------------------------

def lohi_of(x: torch.Tensor) -> torch.Tensor:
    """Per-row (min, max) of float32 ``x`` (R, D): float32 (R, 2)."""
    return torch.stack([x.amin(dim=1), x.amax(dim=1)], dim=1)


def steps_of(lohi: torch.Tensor, bits: int) -> torch.Tensor:
    """float64 (R,) grid steps (hi - lo) / (2**bits - 1) of float32 ``lohi`` (R, 2)."""
    lo = lohi[:, 0].to(torch.float64)
    return (lohi[:, 1].to(torch.float64) - lo) / ((1 << bits) - 1)


def _grid_positions(x: torch.Tensor, lohi: torch.Tensor, bits: int):
    """(r, span) of the rows of float32 ``x`` (R, D) with (min, max) ``lohi`` (R, 2), in
    float64: r = (x - lo) / span * L clamped to [0, L] (r = 0 where span == 0) (R, D), and
    span = hi - lo (R, 1)."""
    L = (1 << bits) - 1
    lo64 = lohi[:, :1].to(torch.float64)
    span = lohi[:, 1:].to(torch.float64) - lo64
    safe = torch.where(span > 0, span, torch.ones_like(span))
    return ((x.to(torch.float64) - lo64) / safe * L).clamp_(0.0, float(L)), span


def round_rows(x: torch.Tensor, bits: int, u: torch.Tensor
               ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Stochastic rounding of each row of ``x`` to its own ``2**bits``-point grid (module
    docstring, PSQ).

    x: float32 (R, D), finite; u: float32 (R*D,) uniforms in [0, 1).
    Returns (lohi float32 (R, 2) = per-row (min, max), codes int64 (R*D,) in 0..2**bits-1).
    """
    R, D = x.shape
    if R * D == 0:
        return (torch.zeros(R, 2, dtype=torch.float32, device=x.device),
                torch.zeros(0, dtype=torch.int64, device=x.device))
    lohi = lohi_of(x)
    r, _ = _grid_positions(x, lohi, bits)
    f = torch.floor(r)
    idx = f.to(torch.int64) + (u.reshape(R, D).to(torch.float64) < (r - f)).to(torch.int64)
    return lohi, idx.reshape(-1)


def dequantize_rows(lohi: torch.Tensor, codes: torch.Tensor, bits: int) -> torch.Tensor:
    """float64 (R, D) values ``lo + index * step`` for lohi float32 (R, 2), codes (R*D,)."""
    R = lohi.shape[0]
    D = codes.numel() // R if R else 0
    lo = lohi[:, 0].to(torch.float64).unsqueeze(1)
    return lo + codes.reshape(R, D).to(torch.float64) * steps_of(lohi, bits).unsqueeze(1)


def _starts(sizes: torch.Tensor) -> torch.Tensor:
    """First row of each block, for consecutive blocks of ``sizes`` rows."""
    return torch.cumsum(sizes, 0) - sizes


def _reflect(Y: torch.Tensor) -> torch.Tensor:
    """H Y for a dense float64 stack of blocks Y (Gk, k, D), k >= 2 (module docstring)."""
    k = Y.shape[1]
    t = 1.0 / math.sqrt(k)
    c = 2.0 / (2.0 - 2.0 * t)
    acc = Y[:, 0].clone()
    for j in range(1, k):              # fixed summation order: reproducible bit for bit
        acc = acc + Y[:, j]
    w = Y[:, 0] - t * acc
    coef = torch.full((k,), c * -t, dtype=torch.float64, device=Y.device)
    coef[0] = c * (1.0 - t)
    return Y - coef.view(1, k, 1) * w.unsqueeze(1)


def householder_blocks(Y: torch.Tensor, sizes: torch.Tensor, scales: torch.Tensor,
                       inverse: bool) -> torch.Tensor:
    """Apply the block transform to float64 rows ``Y`` (R, D) in wire order.

    sizes: int64 (G,) consecutive block sizes summing to R; scales: (G,) scale of each
    block's leading row.  Forward (sender): ``H diag(s) Y`` per block; inverse (receiver):
    ``diag(1/s) H Y``.  Returns a new float64 (R, D) tensor.
    """
    R, D = Y.shape
    out = Y.clone()
    if R == 0:
        return out
    sizes = sizes.to(torch.int64).cpu()
    starts = _starts(sizes)
    s64 = scales.to(torch.float64).to(Y.device)
    st_dev = starts.to(Y.device)
    if not inverse:
        out[st_dev] = out[st_dev] * s64.unsqueeze(1)
    for k in torch.unique(sizes).tolist():
        if k < 2:
            continue
        sel = (sizes == k).nonzero().squeeze(1)
        idx = (starts[sel].unsqueeze(1) + torch.arange(k)).to(Y.device)      # (Gk, k)
        out[idx] = _reflect(out[idx])
    if inverse:
        out[st_dev] = out[st_dev] / s64.unsqueeze(1)
    return out


_F32_MAX = float(torch.finfo(torch.float32).max)


def decode_bounds(absmax: torch.Tensor, sizes: torch.Tensor, scales: torch.Tensor
                  ) -> torch.Tensor:
    """Per block, a bound on the magnitude of the receiver's decoded values: float64 (G,),
    CPU; a block decodes to finite float32 values if its bound is <= the float32 maximum.

    absmax: (R,) max |y| of each wire row's values (max(|lo|, |hi|) of its range: every
    dequantized value lies in it); sizes: int64 (G,) consecutive blocks summing to R;
    scales: (G,).  With A = the block's sum of absmax and t = 1/sqrt(k): the leading row
    decodes to t * (sum of the block's rows) / s, every other row to a component of the
    orthogonal H y (at most ||y||_2 <= A), so |x_hat| <= A * max(1, t / s); for k >= 2 the
    bound is raised by 2**-20 of itself to cover the float64 rounding of the transform (a
    singleton decodes to its own values exactly)."""
    sizes = sizes.to(torch.int64).cpu()
    bid = torch.repeat_interleave(torch.arange(sizes.numel()), sizes)
    A = torch.zeros(sizes.numel(), dtype=torch.float64).index_add_(
        0, bid, absmax.cpu().to(torch.float64))
    k = sizes.to(torch.float64)
    gain = torch.clamp(k.rsqrt() / scales.cpu().to(torch.float64), min=1.0)
    return A * gain * torch.where(sizes >= 2, 1.0 + 2.0 ** -20, 1.0)


def check_blocks(R0: int, perm: torch.Tensor, sizes: torch.Tensor, scales: torch.Tensor,
                 permutation: bool) -> None:
    """The ops' precondition on BHQ's blocks (what keeps every index in bounds): ``perm``
    (R,) rows in 0..R0-1 (with ``permutation``: R = R0 and each row once), ``sizes`` (G,)
    >= 1 summing to R, ``scales`` (G,).  Raises ValueError (hvdcomp.compressors.psq
    validates messages first and raises WireFormatError)."""
    R = perm.numel()
    if scales.numel() != sizes.numel() or (permutation and R != R0):
        raise ValueError(f"perm must have {R0} entries and scales one per block, got "
                         f"{R} and {scales.numel()} for {sizes.numel()} blocks")
    if sizes.numel() == 0 or R == 0:
        if sizes.numel() or R:
            raise ValueError(f"block sizes must be >= 1 and sum to {R}")
        return
    lo_size, total, lo_row, hi_row = torch.stack(
        [sizes.min(), sizes.sum(), perm.min(), perm.max()]).tolist()   # one device sync
    if lo_size < 1 or total != R:
        raise ValueError(f"block sizes must be >= 1 and sum to {R}")
    if lo_row < 0 or hi_row >= R0 or (
            permutation and int(torch.bincount(perm, minlength=R0).max()) != 1):
        raise ValueError(f"perm must be {'a permutation of' if permutation else 'rows in'} "
                         f"0..{R0 - 1}")


class BhqBlocks:
    """BHQ's grouping of R rows by their ranges ``mag`` (float64 (R,), CPU), steps 1-3 of the
    module docstring, and the choice of step 4 (:meth:`choose`).

    order: rows by decreasing range; nvar: rows of nonzero range (the constant ones sort to
    the end); G blocks of ``sizes`` (int64 (G,)) starting at ``starts`` in wire order; bid:
    block of each wire row; lead: wire rows that lead a block; perm: wire row -> row;
    kf: sizes as float64; a32: each block's candidate scale (float32); weight: the
    transform's variance factor per block (float64).
    """

    def __init__(self, mag: torch.Tensor, block_size: int):
        self.order = torch.sort(mag, descending=True, stable=True).indices
        self.nvar = nvar = int((mag > 0).sum())          # constant rows sort to the end
        k = block_size
        self.G = G = -(-nvar // k)
        # Step 2: block g = [big g] + small[g*(k-1):(g+1)*(k-1)], small in increasing
        # magnitude.
        sizes = torch.full((G,), k, dtype=torch.int64)
        if G:
            sizes[-1] = nvar - (G - 1) * k
        self.sizes = sizes
        self.starts = starts = _starts(sizes)
        self.bid = bid = torch.repeat_interleave(torch.arange(G), sizes)
        self.lead = lead = torch.zeros(nvar, dtype=torch.bool)
        lead[starts] = True
        self.perm = perm = torch.empty(nvar, dtype=torch.int64)
        perm[starts] = self.order[:G]
        perm[~lead] = self.order[G:nvar].flip(0)
        # Step 3: scale of the leading row and the candidate transform.
        self.kf = kf = sizes.to(torch.float64)
        l1 = mag[perm[starts]]
        sq = torch.zeros(G, dtype=torch.float64).index_add_(0, bid[~lead], mag[perm[~lead]] ** 2)
        l2 = (sq / (kf - 1).clamp(min=1)).sqrt()
        a = (l2 * kf.sqrt() / ((kf - 1).clamp(min=1) * l1)) ** (1.0 / 3.0)
        self.a32 = torch.where(sizes >= 2, a, torch.ones_like(a)).to(torch.float32)
        a64 = self.a32.to(torch.float64)
        self.weight = 1.0 + (1.0 / (a64 * a64) - 1.0) / kf

    def per_block(self, v: torch.Tensor, dtype=torch.float64) -> torch.Tensor:
        """Sum of per-wire-row values over each block (CPU, ``dtype``)."""
        return torch.zeros(self.G, dtype=dtype).index_add_(0, self.bid, v.cpu().to(dtype))

    def choose(self, var_rows_t: torch.Tensor, var_rows_x: torch.Tensor, yc: torch.Tensor):
        """Step 4: keep the transform only where it strictly lowers the exact variance.
        var_rows_t / var_rows_x: per-wire-row variances of the transformed rows ``yc`` and of
        the plain rows.  Returns (use_row bool (nvar,), wire sizes, wire scales, total
        variance float)."""
        vt = self.weight * self.per_block(var_rows_t)
        vi = self.per_block(var_rows_x)
        fin = self.per_block(~torch.isfinite(yc).all(dim=1), torch.int64) == 0
        bound = decode_bounds(yc.abs().amax(dim=1), self.sizes, self.a32)
        use = ((self.sizes >= 2) & fin & (self.a32 > 0) & torch.isfinite(vt) & (vt < vi)
               & (bound <= _F32_MAX))
        use_row = use[self.bid]
        keep = ~use_row | self.lead                 # rows that start a block on the wire
        out_sizes = torch.where(use_row, self.sizes[self.bid], torch.ones_like(self.bid))[keep]
        out_scales = torch.where(use_row, self.a32[self.bid], torch.ones(self.nvar))[keep]
        return use_row, out_sizes, out_scales, float(torch.where(use, vt, vi).sum())

    def with_constant_rows(self, out_sizes, out_scales):
        """(perm, sizes, scales) of the whole wire order: the constant rows follow as
        singletons of scale 1 (exact)."""
        const = self.order[self.nvar:]
        nc = const.numel()
        return (torch.cat([self.perm, const]),
                torch.cat([out_sizes, torch.ones(nc, dtype=torch.int64)]),
                torch.cat([out_scales, torch.ones(nc)]))


# --- ops ---------------------------------------------------------------------------------

def _bits(bits) -> int:
    return check_int(bits, "bits", 1, 8)


def _key(seed, rank, tensor_id, step):
    return (u32(seed, "seed"), u32(rank, "rank"), u32(tensor_id, "tensor_id"),
            u32(step, "step"))


def _accumulates(out: torch.Tensor) -> bool:
    """Whether the decode kernels can add into ``out``: contiguous float32 (numel,)."""
    return out.dtype == torch.float32 and out.dim() == 1 and out.is_contiguous()


@op
def quantize_rows(x: torch.Tensor, bits: int, *, seed: int, rank: int, tensor_id: int,
                  step: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """PSQ's encoder: :func:`round_rows` with the uniforms of the key, codes packed.

    x: float32 (R, D), finite, any layout; bits: 1..8.
    Returns (lohi float32 (R, 2) per-row (min, max), packed uint8 (ceil(R*D*bits/8),) =
    ``pack_bits(codes, bits)``), both on x's device.
    Kernel: raises TypeError / ValueError for arguments of the wrong type, dtype or shape.
    """
    u = uniform(x.numel(), seed=seed, step=step, rank=rank, tensor_id=tensor_id,
                device=x.device)
    lohi, codes = round_rows(x, bits, u)
    return lohi, pack_bits(codes, bits)


@quantize_rows.kernel
def _(be, x, bits, *, seed, rank, tensor_id, step):
    b = _bits(bits)
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError("x must be a 2-D tensor (R, D)")
    R, D = x.shape
    n = R * D
    xf = check_tensor(be, x.reshape(-1), "x", torch.float32)
    if n == 0:
        return (torch.zeros(R, 2, dtype=torch.float32, device=x.device),
                torch.empty(0, dtype=torch.uint8, device=x.device))
    lohi = lohi_of(x)
    out = torch.empty(packed_size(n, b), dtype=torch.uint8, device=x.device)
    be.launch("hvd_psq_quantize_pack", grid_for((n + 7) // 8), BLOCK,
              (xf, n, D, lohi.reshape(-1), b, *_key(seed, rank, tensor_id, step), out))
    return lohi, out


@op
def dequantize_add(packed: torch.Tensor, R: int, D: int, lohi: torch.Tensor, bits: int,
                   out: torch.Tensor) -> torch.Tensor:
    """PSQ's decoder: ``out += dequantize_rows(lohi, unpack_bits(packed, R*D, bits), bits)``
    rounded to float32, flattened (row-major).

    packed: uint8 (ceil(R*D*bits/8),); lohi: float32 (R, 2); out: float32 with R*D elements,
    updated in place and returned; all on one device.  The kernel serves contiguous float32
    (R*D,) accumulators; raises TypeError / ValueError for arguments of the wrong type,
    dtype, device or size.
    """
    v = dequantize_rows(lohi, unpack_bits(packed, R * D, bits), bits)
    return out.add_(v.to(torch.float32).reshape(-1))


@dequantize_add.kernel
def _(be, packed, R, D, lohi, bits, out):
    if not _accumulates(out):
        return NotImplemented
    b = _bits(bits)
    R = check_int(R, "R", 0, 2**62)
    D = check_int(D, "D", 0, 2**62)
    n = R * D
    out = check_tensor(be, out, "out", torch.float32, n, output=True)
    dev = out.device
    packed = check_tensor(be, packed, "packed", torch.uint8, packed_size(n, b), device=dev)
    lohi = check_tensor(be, lohi.reshape(-1), "lohi", torch.float32, 2 * R, device=dev)
    if n:
        steps = steps_of(lohi.view(R, 2), b).contiguous()
        be.launch("hvd_psq_dequantize_add", grid_for((n + 7) // 8), BLOCK,
                  (packed, n, D, lohi, steps, b, out))
    return out


@op
def row_variance(x: torch.Tensor, bits: int, rows=None, lohi=None) -> torch.Tensor:
    """Exact expected squared error of PSQ per row of ``x[rows]``, float64 (len(rows),):
    sum over the row of (g_{f+1} - x)(x - g_f) = step^2 p (1 - p), p = r - floor(r).

    x: float32 (R0, D); rows: int64 row indices in 0..R0-1 on x's device (default: all rows);
    lohi: float32 (len(rows), 2), the rows' (min, max) as :func:`lohi_of` gives them
    (default: computed).  Kernel: the per-coordinate terms in kernels/psq.cu, the row sums
    and the scaling as here (torch.sum), so the same bits.
    """
    xr = x if rows is None else x[rows]
    R, D = xr.shape
    if R * D == 0:
        return torch.zeros(R, dtype=torch.float64, device=x.device)
    r, span = _grid_positions(xr, lohi_of(xr) if lohi is None else lohi, bits)
    p = r - torch.floor(r)
    return (p * (1 - p)).sum(dim=1) * (span.squeeze(1) / ((1 << bits) - 1)) ** 2


@row_variance.kernel
def _(be, x, bits, rows=None, lohi=None):
    b = _bits(bits)
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError("x must be a 2-D tensor (R0, D)")
    D = x.shape[1]
    xf = check_tensor(be, x.reshape(-1), "x", torch.float32)
    whole = rows is None
    if whole:
        rows = torch.arange(x.shape[0], device=x.device)
    rows = check_tensor(be, rows, "rows", torch.int64, device=xf.device)
    R = rows.numel()
    if R and (int(rows.min()) < 0 or int(rows.max()) >= x.shape[0]):
        raise ValueError(f"rows must be in 0..{x.shape[0] - 1}")
    if R * D == 0:
        return torch.zeros(R, dtype=torch.float64, device=x.device)
    if lohi is None:
        lohi = lohi_of(x if whole else x[rows])
    lohi_f = check_tensor(be, lohi.reshape(-1), "lohi", torch.float32, 2 * R, device=xf.device)
    terms = torch.empty(R, D, dtype=torch.float64, device=xf.device)
    be.launch("hvd_psq_row_terms", grid_for((R * D + 7) // 8), BLOCK,
              (xf, rows, R, D, lohi_f, b, terms))
    span = lohi[:, 1].to(torch.float64) - lohi[:, 0].to(torch.float64)
    return terms.sum(dim=1) * (span / ((1 << b) - 1)) ** 2


@op
def householder_forward(x: torch.Tensor, perm: torch.Tensor, sizes: torch.Tensor,
                        scales: torch.Tensor) -> torch.Tensor:
    """BHQ's sender transform of the rows ``x[perm]``: float32 (len(perm), D) =
    ``householder_blocks(x[perm] in float64, sizes, scales, inverse=False)`` rounded to
    float32.

    x: float32 (R0, D); perm: int64 (R,) rows of x; sizes: int64 (G,) >= 1 summing to R;
    scales: float32 (G,); all on x's device (ValueError otherwise: :func:`check_blocks`).
    A block of one row with scale 1 copies its row exactly.
    """
    check_blocks(x.shape[0], perm, sizes, scales, permutation=False)
    return householder_blocks(x[perm].to(torch.float64), sizes, scales,
                              inverse=False).to(torch.float32)


@householder_forward.kernel
def _(be, x, perm, sizes, scales):
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError("x must be a 2-D tensor (R0, D)")
    D = x.shape[1]
    xf = check_tensor(be, x.reshape(-1), "x", torch.float32)
    dev = xf.device
    perm = check_tensor(be, perm, "perm", torch.int64, device=dev)
    sizes = check_tensor(be, sizes, "sizes", torch.int64, device=dev)
    G = sizes.numel()
    scales = check_tensor(be, scales, "scales", torch.float32, G, device=dev)
    check_blocks(x.shape[0], perm, sizes, scales, permutation=False)
    y = torch.empty(perm.numel(), D, dtype=torch.float32, device=dev)
    if G * D:
        be.launch("hvd_bhq_forward", grid_for(G * D), BLOCK,
                  (xf, D, perm, _starts(sizes).contiguous(), sizes, scales, G, y))
    return y


@op
def bhq_dequantize_add(packed: torch.Tensor, R: int, D: int, lohi: torch.Tensor, bits: int,
                       perm: torch.Tensor, sizes: torch.Tensor, scales: torch.Tensor,
                       out: torch.Tensor) -> torch.Tensor:
    """BHQ's decoder: with yhat = dequantize_rows(lohi, unpack_bits(packed, R*D, bits), bits)
    and xhat = householder_blocks(yhat, sizes, scales, inverse=True) rounded to float32,
    ``out.view(R, D)[perm] += xhat``.

    packed: uint8 (ceil(R*D*bits/8),); lohi: float32 (R, 2); perm: int64 (R,), a permutation;
    sizes: int64 (G,) >= 1 summing to R; scales: float32 (G,) (ValueError otherwise:
    :func:`check_blocks`);
    out: float32 with R*D elements, updated in place and returned; all on one device.  The
    kernel serves contiguous float32 (R*D,) accumulators; raises TypeError / ValueError for
    arguments of the wrong type, dtype, device or size.
    """
    check_blocks(R, perm, sizes, scales, permutation=True)
    yhat = dequantize_rows(lohi, unpack_bits(packed, R * D, bits), bits)
    xhat = householder_blocks(yhat, sizes, scales, inverse=True).to(torch.float32)
    full = torch.empty_like(xhat)
    full[perm] = xhat
    return out.add_(full.reshape(-1))


@bhq_dequantize_add.kernel
def _(be, packed, R, D, lohi, bits, perm, sizes, scales, out):
    if not _accumulates(out):
        return NotImplemented
    b = _bits(bits)
    R = check_int(R, "R", 0, 2**62)
    D = check_int(D, "D", 0, 2**62)
    n = R * D
    out = check_tensor(be, out, "out", torch.float32, n, output=True)
    dev = out.device
    packed = check_tensor(be, packed, "packed", torch.uint8, packed_size(n, b), device=dev)
    lohi = check_tensor(be, lohi.reshape(-1), "lohi", torch.float32, 2 * R, device=dev)
    perm = check_tensor(be, perm, "perm", torch.int64, R, device=dev)
    sizes = check_tensor(be, sizes, "sizes", torch.int64, device=dev)
    G = sizes.numel()
    scales = check_tensor(be, scales, "scales", torch.float32, G, device=dev)
    check_blocks(R, perm, sizes, scales, permutation=True)
    if n:
        steps = steps_of(lohi.view(R, 2), b).contiguous()
        be.launch("hvd_bhq_dequantize_add", grid_for(G * D), BLOCK,
                  (packed, n, D, lohi, steps, perm, _starts(sizes).contiguous(), sizes,
                   scales, G, b, out))
    return out


# --- composed --------------------------------------------------------------------------

def bhq_plan(x: torch.Tensor, bits: int, block_size: int):
    """The sender's deterministic grouping and transform (module docstring, steps 1-4).

    x: float32 (R, D), finite.  Returns (perm int64 (R,), sizes int64 (G,), scales float32
    (G,), y float32 (R, D) = the transformed rows in wire order, variance float = the exact
    expected squared error of the encoding).  perm, sizes and scales are CPU tensors, y is on
    x's device.  The candidate transform and the variance terms are ops (kernels where
    served); y is the transform of the chosen blocks, recomputed: a block that keeps the
    transform gives the candidate's bits again, a singleton of scale 1 its row exactly.
    """
    R, D = x.shape
    if R * D == 0:
        return (torch.arange(R, dtype=torch.int64), torch.ones(R, dtype=torch.int64),
                torch.ones(R, dtype=torch.float32), x, 0.0)
    dev = x.device
    x = x.contiguous()
    lohi = lohi_of(x)
    b = BhqBlocks((lohi[:, 1].to(torch.float64) - lohi[:, 0].to(torch.float64)).cpu(),
                  block_size)
    perm = b.perm.to(dev)
    yc = householder_forward(x, perm, b.sizes.to(dev), b.a32.to(dev))
    _, sizes, scales, total = b.choose(row_variance(yc, bits),
                                       row_variance(x, bits, perm, lohi[perm]), yc)
    perm_all, sizes_all, scales_all = b.with_constant_rows(sizes, scales)
    y = householder_forward(x, perm_all.to(dev), sizes_all.to(dev), scales_all.to(dev))
    return perm_all, sizes_all, scales_all, y, total
