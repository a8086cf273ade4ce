"""Per-sample (PSQ) and block Householder (BHQ) quantizers.

Source: Chen, Gai, Yao, Mahoney, Gonzalez, "A Statistical Framework for Low-bitwidth Training
of Deep Neural Networks", NeurIPS 2020 (arXiv 2010.14298), Sec. 4 (gradient quantizers as
unbiased estimators; their variance): PTQ uses one range per tensor, PSQ one range per row
(sample), BHQ a block Householder transform ``S = H diag(s)`` before per-row quantization,
``Q(X) = S^-1 SR(S X)``.  (Subsection and equation numbers are not cited here: they were not
checked against the paper's text.)

Rows
----
The gradient is viewed as a 2-D float32 matrix of ``R`` rows and ``D`` columns:
    ndim >= 2:  R = shape[0], D = numel / shape[0]   (a conv weight (O, I, kh, kw): O rows)
    ndim == 1:  one row (R = 1, D = numel)           (one range, not numel 1-element rows)
    ndim == 0:  R = D = 1
    numel == 0: R = D = 0 (no payload at all)
In the paper the rows are samples (the per-sample gradient of an activation); for a
parameter gradient they are output units.  Half precision and float64 are quantized from
their float32 values; a tensor whose float32 copy is not finite (a float64 beyond float32's
range) is sent as NONFINITE, as NaN/Inf are (docs/design.md, "NaN").

Bits
----
``bits`` (1..8) is the code width per coordinate on the wire, as everywhere in hvdcomp, but
there is NO sign bit: the grid is affine, ``2**bits`` equally spaced points spanning the row's
own ``[min, max]``, so a code is just the grid index 0 .. 2**bits - 1.  (QSGD and friends
spend one of their bits on the sign and quantize magnitudes; here the sign is part of the
range.)  With ``L = 2**bits - 1`` intervals, bits = 1 is unbiased stochastic binarization
between min and max; the paper's ``B`` (number of bins) is this ``L``.

PSQ: stochastic rounding of one row
-----------------------------------
For row ``x`` (float32) with ``lo = min x``, ``hi = max x`` (float32, sent), in float64:
    span = hi - lo;  r = (x - lo) / span * L   (r = 0 where span == 0), clamped to [0, L]
    f = floor(r);  index = f + (u < r - f)
where ``u`` is the float32 uniform :func:`hvdcomp.random.uniform` of the coordinate's flat
index (row-major, in wire row order) keyed by the TensorKey (seed, rank, tensor_id, step).
Decoded value (float64, rounded once to float32): ``lo + index * (span / L)``.
    E[decoded] = x;   Var = (g_{f+1} - x)(x - g_f) = (span / L)^2 (r - f)(1 - (r - f))
up to float32 rounding of the decoded value; a row whose values are all equal (an all-zero
row in particular) has span 0 and decodes exactly.

BHQ: block Householder transform
--------------------------------
The sender groups rows into blocks by a fixed, deterministic rule and sends the grouping:
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
     finite), the block is sent as k singleton blocks instead (scale 1, no transform).  So
     BHQ's exact variance never exceeds PSQ's, and each choice depends only on the data,
     never on the random draws, so the estimator stays unbiased.
The receiver dequantizes y (float64), applies H again (H is its own inverse), divides the
leading row by s, rounds to float32 and puts row p back at row ``perm[p]``.

Householder arithmetic (both sides, float64, per block of k rows Y[0..k-1], t = 1/sqrt(k)):
    acc = Y[0] + Y[1] + ... + Y[k-1] (in that order);  w = Y[0] - t * acc   (= n^T Y)
    c = 2 / (2 - 2 t);   Y[0] -= (c * (1 - t)) * w;   Y[j] -= (c * -t) * w  (j >= 1)
(the coefficients are Python floats); the sender scales Y[0] by s before, the receiver
divides Y[0] by s after.

Wire sections
-------------
psq (codec 17; header bits = bits, bucket_size = 0):
    0: per row float32 (lo, hi), 8 R bytes
    1: codes, ``bits`` per coordinate packed LSB-first (hvdcomp.codecs.bitpack), row-major
  payload = 8 R + ceil(R D bits / 8) bytes.
bhq (codec 18; header bits = bits, bucket_size = block_size):
    0: per wire row float32 (lo, hi) of the transformed rows, 8 R bytes
    1: codes of the transformed rows in wire row order, ceil(R D bits / 8) bytes
    2: perm, uint32 R: wire row p holds original row perm[p]
    3: block sizes, uint32 G (1 <= size <= block_size, sum R): consecutive wire rows
    4: block scales, float32 G (finite, > 0; exactly 1 for a block of one row)
  payload = 12 R + 8 G + ceil(R D bits / 8) bytes.
Malformed sections (sizes, non-finite or inverted ranges, a perm that is not a permutation,
invalid block sizes or scales) raise :class:`hvdcomp.WireFormatError`.

Kernels
-------
Where ``hvdcomp.backends.kernel_backend(device)`` returns a backend (host build on the CPU,
CuPy on CUDA), encode and decode run kernels/psq.cu through hvdcomp/backends/k_psq.py: the
stochastic rounding with its Philox uniforms, the packing, the unpacking and dequantization
(BHQ: with the inverse transform and the row permutation, added straight into the
accumulator), BHQ's Householder transform and the per-coordinate variance terms of its plan.
The functions above stay the specification: the message bytes and the decoded sums are the
same bit for bit either way (HVDCOMP_BACKEND=reference runs them).  Entropy-coded messages,
and accumulators that are not contiguous float32 (numel,), decode on the reference path.
"""
from __future__ import annotations

import math
from typing import Dict, Tuple

import numpy as np
import torch

from ..backends import k_psq, kernel_backend
from ..codecs import decode_symbols, encode_symbols, pack_bits, packed_size, unpack_bits
from ..errors import WireFormatError
from ..random import uniform
from ..wire import CODECS, FLAG_ENTROPY, Message, dtype_code
from .base import Compressor, TensorKey, register

__all__ = ["PSQ", "BHQ", "rows_of", "quantize_rows", "dequantize_rows", "row_variance",
           "householder_blocks", "bhq_plan"]


# --- the row view -----------------------------------------------------------------------

def rows_of(shape) -> Tuple[int, int]:
    """(R, D) of the row view of a tensor of ``shape`` (see the module docstring)."""
    numel = 1
    for s in shape:
        numel *= int(s)
    if numel == 0:
        return 0, 0
    if len(shape) <= 1:
        return 1, numel
    return int(shape[0]), numel // int(shape[0])


def _check_bits(bits) -> int:
    if isinstance(bits, bool) or not isinstance(bits, (int, np.integer)) or not 1 <= bits <= 8:
        raise ValueError(f"bits must be an integer in 1..8 (grid of 2**bits points over each "
                         f"row's [min, max], no sign bit), got {bits!r}")
    return int(bits)


# --- PSQ core (the specification, PyTorch ops) ------------------------------------------

def quantize_rows(x: torch.Tensor, bits: int, u: torch.Tensor
                  ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Stochastic rounding of each row of ``x`` to its own ``2**bits``-point grid.

    x: float32 (R, D), finite; u: float32 (R*D,) uniforms in [0, 1).
    Returns (lohi float32 (R, 2) = per-row (min, max), codes int64 (R*D,) in 0..2**bits-1).
    """
    R, D = x.shape
    if R * D == 0:
        return (torch.zeros(R, 2, dtype=torch.float32, device=x.device),
                torch.zeros(0, dtype=torch.int64, device=x.device))
    L = (1 << bits) - 1
    lo = x.amin(dim=1)
    hi = x.amax(dim=1)
    lo64 = lo.to(torch.float64).unsqueeze(1)
    span = hi.to(torch.float64).unsqueeze(1) - lo64
    safe = torch.where(span > 0, span, torch.ones_like(span))
    r = ((x.to(torch.float64) - lo64) / safe * L).clamp_(0.0, float(L))
    f = torch.floor(r)
    idx = f.to(torch.int64) + (u.reshape(R, D).to(torch.float64) < (r - f)).to(torch.int64)
    return torch.stack([lo, hi], dim=1), idx.reshape(-1)


def dequantize_rows(lohi: torch.Tensor, codes: torch.Tensor, bits: int) -> torch.Tensor:
    """float64 (R, D) values ``lo + index * ((hi - lo) / L)`` for lohi (R, 2), codes (R*D,)."""
    R = lohi.shape[0]
    D = codes.numel() // R if R else 0
    lo = lohi[:, 0].to(torch.float64).unsqueeze(1)
    step = (lohi[:, 1].to(torch.float64).unsqueeze(1) - lo) / ((1 << bits) - 1)
    return lo + codes.reshape(R, D).to(torch.float64) * step


def row_variance(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Exact expected squared error of :func:`quantize_rows` per row, float64 (R,):
    sum over the row of (g_{f+1} - x)(x - g_f) = (span / L)^2 p (1 - p), p = r - floor(r)."""
    R, D = x.shape
    if R * D == 0:
        return torch.zeros(R, dtype=torch.float64, device=x.device)
    L = (1 << bits) - 1
    lo64 = x.amin(dim=1).to(torch.float64).unsqueeze(1)
    span = x.amax(dim=1).to(torch.float64).unsqueeze(1) - lo64
    safe = torch.where(span > 0, span, torch.ones_like(span))
    r = ((x.to(torch.float64) - lo64) / safe * L).clamp_(0.0, float(L))
    p = r - torch.floor(r)
    return (p * (1 - p)).sum(dim=1) * (span.squeeze(1) / L) ** 2


# --- Householder blocks --------------------------------------------------------------------

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
    starts = torch.cumsum(sizes, 0) - sizes
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


class BhqBlocks:
    """BHQ's grouping of R rows by their ranges ``mag`` (float64 (R,), CPU), steps 1-3 of the
    module docstring: shared by the reference (bhq_plan) and the kernel path
    (hvdcomp/backends/k_psq.bhq_plan), so both group identically.

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
        self.starts = starts = torch.cumsum(sizes, 0) - sizes
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
        use = (self.sizes >= 2) & fin & (self.a32 > 0) & torch.isfinite(vt) & (vt < vi)
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


def bhq_plan(x: torch.Tensor, bits: int, block_size: int):
    """The sender's deterministic grouping (module docstring, steps 1-4).

    x: float32 (R, D), finite.  Returns (perm int64 (R,), sizes int64 (G,), scales float32
    (G,), y float32 (R, D) = the transformed rows in wire order, variance float = the exact
    expected squared error of the encoding).  perm, sizes and scales are CPU tensors.
    """
    R, D = x.shape
    if R * D == 0:
        return (torch.arange(R, dtype=torch.int64), torch.ones(R, dtype=torch.int64),
                torch.ones(R, dtype=torch.float32), x, 0.0)
    dev = x.device
    mag = (x.amax(dim=1).to(torch.float64) - x.amin(dim=1).to(torch.float64)).cpu()
    b = BhqBlocks(mag, block_size)
    xb = x[b.perm.to(dev)]
    yc = householder_blocks(xb.to(torch.float64), b.sizes, b.a32,
                            inverse=False).to(torch.float32)
    use_row, out_sizes, out_scales, total = b.choose(row_variance(yc, bits),
                                                     row_variance(xb, bits), yc)
    y = torch.where(use_row.to(dev).unsqueeze(1), yc, xb)
    perm_all, sizes_all, scales_all = b.with_constant_rows(out_sizes, out_scales)
    return perm_all, sizes_all, scales_all, torch.cat([y, x[b.order[b.nvar:].to(dev)]]), total


# --- the compressors ------------------------------------------------------------------------

def _check_float(grad: torch.Tensor, name: str) -> None:
    if not grad.is_floating_point():
        raise TypeError(f"{name} quantizes floating-point gradients only, got {grad.dtype}")


def _np_bytes(t: torch.Tensor) -> np.ndarray:
    return t.detach().contiguous().cpu().numpy().reshape(-1).view(np.uint8)


def _section(msg: Message, i: int, dtype) -> np.ndarray:
    return np.array(msg.sections[i]).view(dtype)


class _RowQuantizer(Compressor):
    bits: int

    def _rows(self, grad: torch.Tensor):
        """float32 (R, D) view of ``grad`` or None if its float32 copy is not finite."""
        _check_float(grad, self.name)
        R, D = rows_of(grad.shape)
        x = grad.detach().reshape(R, D).to(torch.float32)
        if x.numel() and not bool(torch.isfinite(x).all()):
            return None
        return x

    def _uniforms(self, n: int, key: TensorKey, device) -> torch.Tensor:
        return uniform(n, seed=key.seed, step=key.step, rank=key.rank, tensor_id=key.tensor_id,
                       device=device)

    def _lohi(self, msg: Message, R: int) -> torch.Tensor:
        lohi = torch.from_numpy(_section(msg, 0, np.float32).copy()).view(R, 2)
        if not bool(torch.isfinite(lohi).all()):
            raise WireFormatError(f"{self.name}: row ranges must be finite")
        if bool((lohi[:, 1] < lohi[:, 0]).any()):
            raise WireFormatError(f"{self.name}: a row range has max < min")
        return lohi

    def _pack(self, codes: torch.Tensor) -> np.ndarray:
        """The code section: packed, or rANS-coded with ``entropy`` (flag ENTROPY)."""
        if self.entropy:
            return encode_symbols(codes, 1 << self.bits)
        return _np_bytes(pack_bits(codes, self.bits))

    def _pack_packed(self, packed: torch.Tensor, n: int) -> np.ndarray:
        """The code section from kernel-packed codes (the same bytes as :meth:`_pack`)."""
        if self.entropy:
            return encode_symbols(unpack_bits(packed, n, self.bits).cpu().numpy(),
                                  1 << self.bits)
        return _np_bytes(packed)

    def _quantize(self, y: torch.Tensor, key: TensorKey):
        """(lohi float32 (R, 2), code section) of the rows y (R, D): kernels/psq.cu where a
        kernel backend is there, else quantize_rows; the same bytes either way."""
        be = kernel_backend(y.device)
        if be is not None:
            lohi, packed = k_psq.quantize_rows(be.backend, y, self.bits, seed=key.seed,
                                               rank=key.rank, tensor_id=key.tensor_id,
                                               step=key.step)
            return lohi, self._pack_packed(packed, y.numel())
        u = self._uniforms(y.numel(), key, y.device)
        lohi, codes = quantize_rows(y, self.bits, u)
        return lohi, self._pack(codes)

    def _kernel_decode(self, msg: Message, out: torch.Tensor):
        """The kernel backend for decoding ``msg`` into ``out``, or None (reference path):
        packed codes (no entropy coding) into a contiguous float32 (numel,) accumulator."""
        if (msg.flags & FLAG_ENTROPY or out.dtype != torch.float32 or out.dim() != 1
                or not out.is_contiguous()):
            return None
        return kernel_backend(out.device)

    def _packed_codes(self, msg: Message, device) -> torch.Tensor:
        return torch.from_numpy(np.array(msg.sections[1], dtype=np.uint8)).to(device)

    def _flags(self) -> int:
        return FLAG_ENTROPY if self.entropy else 0

    def _check_codes(self, msg: Message, n: int) -> None:
        if not msg.flags & FLAG_ENTROPY:
            msg.section_size_check(1, packed_size(n, self.bits), "codes")

    def _codes(self, msg: Message, n: int) -> torch.Tensor:
        if msg.flags & FLAG_ENTROPY:
            return torch.from_numpy(decode_symbols(msg.sections[1], n, 1 << self.bits))
        return unpack_bits(torch.from_numpy(np.array(msg.sections[1])), n, self.bits)


@register("psq")
class PSQ(_RowQuantizer):
    """PSQ, the per-sample quantizer (Chen et al., NeurIPS 2020, Sec. 4; module docstring).

    Each row of the gradient (rows: first dimension; a 1-D tensor is one row) gets its own
    ``[min, max]`` range and a uniform grid of ``2**bits`` points; every coordinate is rounded
    stochastically to a neighbouring grid point with Philox uniforms, so E[Q(x)] = x and
    Var = sum over coordinates of (g_{f+1} - x)(x - g_f).  Rows of equal values decode exactly.

    Args:
      bits: code width per coordinate, 1..8 (grid index only, no sign bit).
    grad: any shape and layout, float16/bfloat16/float32/float64, CPU or CUDA.
    Wire: 8 R + ceil(numel * bits / 8) payload bytes (R rows; module docstring).
    Raises ValueError for bits outside 1..8, TypeError for non-floating gradients,
    WireFormatError for malformed messages.

    Example::

        c = hvdcomp.get("psq:bits=4")
        msg = c.encode(grad, key)                  # ~numel/2 + 8 * rows bytes
        c.decode(Message.from_bytes(msg.to_bytes()), key, acc)
    """
    codec = CODECS["psq"]

    def __init__(self, bits: int = 4, entropy: bool = False):
        self.bits = _check_bits(bits)
        self.entropy = bool(entropy)

    def _header_fields(self) -> Dict[str, int]:
        return {"bits": self.bits, "bucket_size": 0, "level_version": 0}

    def message_bytes(self, shape) -> int:
        """Payload bytes (header excluded) of a message for a tensor of ``shape``."""
        R, D = rows_of(shape)
        return 8 * R + packed_size(R * D, self.bits)

    def _encode(self, grad, key):
        x = self._rows(grad)
        if x is None:
            return self._nonfinite(grad, key)
        lohi, codes = self._quantize(x, key)
        return Message(codec=self.codec, dtype=dtype_code(grad.dtype), shape=tuple(grad.shape),
                       sections=(_np_bytes(lohi), codes), flags=self._flags(),
                       tensor_id=key.tensor_id, rank=key.rank, seed=key.seed, step=key.step,
                       **self._header_fields())

    def _decode(self, msg, key, out):
        R, D = rows_of(msg.shape)
        msg.expect(nsections=2)
        msg.section_size_check(0, 8 * R, "row ranges")
        self._check_codes(msg, R * D)
        if R * D == 0:
            return
        lohi = self._lohi(msg, R)
        be = self._kernel_decode(msg, out)
        if be is not None:      # kernels/psq.cu: out += the decoded values, bit for bit
            k_psq.dequantize_add(be.backend, self._packed_codes(msg, out.device), R, D,
                                 lohi.to(out.device), self.bits, out)
            return
        v = dequantize_rows(lohi, self._codes(msg, R * D), self.bits)
        out.add_(v.to(torch.float32).reshape(-1).to(out.device))

    def variance(self, grad: torch.Tensor) -> float:
        """Exact expected squared error sum_i E|Q(x_i) - x_i|^2 of encoding ``grad``."""
        x = self._rows(grad)
        return float(row_variance(x, self.bits).sum()) if x is not None else math.inf


@register("bhq")
class BHQ(_RowQuantizer):
    """BHQ, the block Householder quantizer (Chen et al., NeurIPS 2020, Sec. 4; module docstring).

    Rows are sorted by range and grouped into blocks of ``block_size`` (each block: one large
    row and the smallest rows); within a block the large row is scaled and reflected by
    ``H = I - 2 n n^T / ||n||^2`` (H e_1 = the normalized all-ones vector), which spreads it
    over the block; the transformed rows are quantized as PSQ.  The receiver applies H again
    (H = H^-1) and undoes the scale.  The grouping, the scales and the permutation travel on
    the wire; a block whose transform would not reduce the exact variance is sent as
    singletons, so Var[BHQ] <= Var[PSQ] for every input.  Unbiased: the transform is linear
    and a deterministic function of the data.

    Args:
      bits: code width per coordinate, 1..8 (grid index only, no sign bit).
      block_size: rows per block, >= 1 (1: PSQ with a row permutation).
    grad: any shape and layout, float16/bfloat16/float32/float64, CPU or CUDA.
    Wire: 12 R + 8 G + ceil(numel * bits / 8) payload bytes (G blocks; module docstring).
    Raises ValueError for bits outside 1..8 or block_size < 1, TypeError for non-floating
    gradients, WireFormatError for malformed messages.

    Example::

        c = hvdcomp.get("bhq:bits=4,block_size=8")
        msg = c.encode(grad, key)
        c.decode(Message.from_bytes(msg.to_bytes()), key, acc)
    """
    codec = CODECS["bhq"]

    def __init__(self, bits: int = 4, block_size: int = 8, entropy: bool = False):
        self.bits = _check_bits(bits)
        self.entropy = bool(entropy)
        if (isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer))
                or not 1 <= block_size <= 2**31):
            raise ValueError(f"block_size must be an integer in 1..2**31, got {block_size!r}")
        self.block_size = int(block_size)

    def _header_fields(self) -> Dict[str, int]:
        return {"bits": self.bits, "bucket_size": self.block_size, "level_version": 0}

    def message_bytes(self, shape, nblocks: int) -> int:
        """Payload bytes (header excluded) for a tensor of ``shape`` sent in ``nblocks``
        blocks (the number of entries of section 3)."""
        R, D = rows_of(shape)
        return 12 * R + 8 * nblocks + packed_size(R * D, self.bits)

    def _encode(self, grad, key):
        x = self._rows(grad)
        if x is None:
            return self._nonfinite(grad, key)
        be = kernel_backend(x.device)
        if be is not None:      # kernels/psq.cu: the same plan, bit for bit
            perm, sizes, scales, y, _ = k_psq.bhq_plan(be.backend, x, self.bits,
                                                       self.block_size)
        else:
            perm, sizes, scales, y, _ = bhq_plan(x, self.bits, self.block_size)
        lohi, codes = self._quantize(y, key)
        secs = (_np_bytes(lohi), codes,
                perm.to(torch.int64).numpy().astype("<u4").view(np.uint8),
                sizes.numpy().astype("<u4").view(np.uint8),
                scales.numpy().astype("<f4").view(np.uint8))
        return Message(codec=self.codec, dtype=dtype_code(grad.dtype), shape=tuple(grad.shape),
                       sections=secs, flags=self._flags(), tensor_id=key.tensor_id,
                       rank=key.rank, seed=key.seed, step=key.step, **self._header_fields())

    def read_blocks(self, msg: Message):
        """Validate sections 2-4 of ``msg``; returns (perm int64 (R,), sizes int64 (G,),
        scales float32 (G,)).  Raises WireFormatError."""
        R, _ = rows_of(msg.shape)
        msg.section_size_check(2, 4 * R, "row permutation")
        nb = len(msg.sections[3])
        if nb % 4 or nb != len(msg.sections[4]):
            raise WireFormatError(f"bhq: block sizes ({nb} bytes) and block scales "
                                  f"({len(msg.sections[4])} bytes) must hold the same number "
                                  f"of 4-byte entries")
        perm = _section(msg, 2, "<u4").astype(np.int64)
        sizes = _section(msg, 3, "<u4").astype(np.int64)
        scales = _section(msg, 4, "<f4").astype(np.float32)
        if R and np.bincount(np.minimum(perm, R), minlength=R + 1)[:R].min(initial=1) != 1:
            raise WireFormatError(f"bhq: the row permutation is not a permutation of 0..{R - 1}")
        if sizes.size > R or (sizes.size and (sizes.min() < 1 or sizes.max() > self.block_size)):
            raise WireFormatError(f"bhq: block sizes must be in 1..{self.block_size}")
        if int(sizes.sum()) != R:
            raise WireFormatError(f"bhq: block sizes sum to {int(sizes.sum())}, expected {R} rows")
        if not np.all(np.isfinite(scales)) or not np.all(scales > 0):
            raise WireFormatError("bhq: block scales must be finite and > 0")
        if np.any(scales[sizes == 1] != 1):
            raise WireFormatError("bhq: a block of one row must have scale 1")
        return (torch.from_numpy(perm), torch.from_numpy(sizes), torch.from_numpy(scales))

    def _decode(self, msg, key, out):
        R, D = rows_of(msg.shape)
        msg.expect(nsections=5)
        msg.section_size_check(0, 8 * R, "row ranges")
        self._check_codes(msg, R * D)
        perm, sizes, scales = self.read_blocks(msg)
        if R * D == 0:
            return
        lohi = self._lohi(msg, R)
        be = self._kernel_decode(msg, out)
        if be is not None:      # kernels/psq.cu: out[perm] += the decoded rows, bit for bit
            dev = out.device
            k_psq.bhq_dequantize_add(be.backend, self._packed_codes(msg, dev), R, D,
                                     lohi.to(dev), self.bits, perm.to(dev), sizes.to(dev),
                                     scales.to(dev), out)
            return
        yhat = dequantize_rows(lohi, self._codes(msg, R * D), self.bits)
        xhat = householder_blocks(yhat, sizes, scales, inverse=True).to(torch.float32)
        full = torch.empty_like(xhat)
        full[perm] = xhat
        out.add_(full.reshape(-1).to(out.device))

    def variance(self, grad: torch.Tensor) -> float:
        """Exact expected squared error sum_i E|Q(x_i) - x_i|^2 of encoding ``grad``
        (module docstring, step 3), up to float rounding."""
        x = self._rows(grad)
        return bhq_plan(x, self.bits, self.block_size)[4] if x is not None else math.inf
