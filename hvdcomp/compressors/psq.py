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

Arithmetic
----------
PSQ rounds each row stochastically to a grid of ``2**bits`` points over the row's own
``[min, max]`` with Philox uniforms keyed by the TensorKey (seed, rank, tensor_id, step),
coordinates taken row-major in wire row order; BHQ first groups the rows into blocks by their
ranges and applies a scaled Householder reflection per block, and falls back to singletons
where that would not lower the exact variance.  The specification of both (the rounding,
the grouping steps 1-4, the Householder arithmetic) is the module docstring of
:mod:`hvdcomp.ops.psq`, whose ops run kernels/psq.cu where a kernel backend serves the
device: the message bytes and the decoded sums are the same bit for bit either way.

Wire sections
-------------
psq (codec 17; header bits = bits, bucket_size = 0):
    0: per row float32 (lo, hi), 8 R bytes
    1: codes, ``bits`` per coordinate packed LSB-first (hvdcomp.ops.bitpack), row-major
  payload = 8 R + ceil(R D bits / 8) bytes.
bhq (codec 18; header bits = bits, bucket_size = block_size):
    0: per wire row float32 (lo, hi) of the transformed rows, 8 R bytes
    1: codes of the transformed rows in wire row order, ceil(R D bits / 8) bytes
    2: perm, uint32 R: wire row p holds original row perm[p]
    3: block sizes, uint32 G (1 <= size <= block_size, sum R): consecutive wire rows
    4: block scales, float32 G (finite, > 0; exactly 1 for a block of one row)
  payload = 12 R + 8 G + ceil(R D bits / 8) bytes.
With ``entropy`` the codes section is their rANS coding instead (flag ENTROPY;
hvdcomp.codecs.sections).
Malformed sections (sizes, non-finite or inverted ranges, a perm that is not a permutation,
invalid block sizes or scales) raise :class:`hvdcomp.WireFormatError`.
"""
from __future__ import annotations

import math
from typing import Dict, Optional, Tuple

import numpy as np
import torch

from ..ops.bitpack import packed_size
from ..codecs.sections import read_codes, write_codes
from ..errors import WireFormatError
from ..ops.psq import (bhq_dequantize_add, bhq_plan, decode_bounds, dequantize_add,
                       quantize_rows, row_variance)
from ..wire import Message
from . import settings
from .base import Compressor, TensorKey, numel_of, register

__all__ = ["PSQ", "BHQ", "rows_of"]

_F32_MAX = float(np.finfo(np.float32).max)


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


def _np_bytes(t: torch.Tensor) -> np.ndarray:
    return t.detach().contiguous().cpu().numpy().reshape(-1).view(np.uint8)


def _section(msg: Message, i: int, dtype) -> np.ndarray:
    return np.array(msg.sections[i]).view(dtype)


class _RowQuantizer(Compressor):
    """What PSQ and BHQ share: the row view, the rows' ranges and codes (sections 0, 1)."""
    bits: int
    entropy: bool

    def shard_unit(self, shape) -> int:
        """A row of the row view (``rows_of``): each piece of the reduce-scatter is a matrix
        of whole rows, its row ranges (and BHQ's blocks) the rows' own."""
        return max(rows_of(shape)[1], 1)

    def shard_shape(self, shape, lo: int, hi: int) -> Tuple[int, ...]:
        """Whole rows ``((hi - lo) / D, D)`` of a tensor of 2 or more dimensions; a tensor
        of fewer (one row, never cut) keeps its own shape."""
        if len(shape) >= 2:
            d = max(rows_of(shape)[1], 1)
            return ((hi - lo) // d, d)
        return tuple(shape) if lo == 0 and hi == numel_of(shape) else (hi - lo,)

    def _rows(self, grad: torch.Tensor):
        """float32 (R, D) view of ``grad`` or None if its float32 copy is not finite."""
        if not grad.is_floating_point():
            raise TypeError(f"{self.name} quantizes floating-point gradients only, "
                            f"got {grad.dtype}")
        R, D = rows_of(grad.shape)
        x = grad.detach().reshape(R, D).to(torch.float32)
        if x.numel() and not bool(torch.isfinite(x).all()):
            return None
        return x

    def _quantize(self, y: torch.Tensor, key: TensorKey):
        """(sections 0 and 1, flags) for the rows ``y`` (R, D) in wire order."""
        lohi, packed = quantize_rows(y, self.bits, seed=key.seed, rank=key.rank,
                                     tensor_id=key.tensor_id, step=key.step)
        codes, flags = write_codes(packed, y.numel(), self.bits, self.entropy)
        return (_np_bytes(lohi), codes), flags

    def _read_rows(self, msg: Message, R: int, D: int, device):
        """(lohi float32 (R, 2) on the CPU, packed codes uint8 on ``device``) of sections 0
        and 1.  Raises WireFormatError for wrong sizes, non-finite or inverted ranges."""
        msg.section_size_check(0, 8 * R, "row ranges")
        packed = read_codes(msg, 1, R * D, self.bits, device=device)
        lohi = torch.from_numpy(_section(msg, 0, np.float32).copy()).view(R, 2)
        if not bool(torch.isfinite(lohi).all()):
            raise WireFormatError(f"{self.name}: row ranges must be finite")
        if bool((lohi[:, 1] < lohi[:, 0]).any()):
            raise WireFormatError(f"{self.name}: a row range has max < min")
        return lohi, packed


@register("psq", codec=17)
class PSQ(_RowQuantizer):
    """PSQ, the per-sample quantizer (Chen et al., NeurIPS 2020, Sec. 4; module docstring).

    Each row of the gradient (rows: first dimension; a 1-D tensor is one row) gets its own
    ``[min, max]`` range and a uniform grid of ``2**bits`` points; every coordinate is rounded
    stochastically to a neighbouring grid point with Philox uniforms, so E[Q(x)] = x and
    Var = sum over coordinates of (g_{f+1} - x)(x - g_f).  Rows of equal values decode exactly.

    Args:
      bits: code width per coordinate, 1..8 (grid index only, no sign bit).
      entropy: rANS-code the codes (hvdcomp.codecs.sections).
    grad: any shape and layout, float16/bfloat16/float32/float64, CPU or CUDA.
    Wire: 8 R + ceil(numel * bits / 8) payload bytes (R rows; module docstring).
    Raises ValueError for bits outside 1..8 (TypeError for a non-integer), TypeError for
    non-floating gradients, WireFormatError for malformed messages.

    Example::

        c = hvdcomp.get("psq:bits=4")
        msg = c.encode(grad, key)                  # ~numel/2 + 8 * rows bytes
        c.decode(Message.from_bytes(msg.to_bytes()), key, acc)
    """
    example = "psq:bits=4"

    def __init__(self, bits: int = 4, entropy: bool = False):
        self.bits = settings.integer("bits", bits, 1, 8)
        self.entropy = settings.boolean("entropy", entropy)

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
        sections, flags = self._quantize(x, key)
        return self._new_message(grad, key, sections, flags)

    def _decode(self, msg, key, out):
        R, D = rows_of(msg.shape)
        msg.expect(nsections=2)
        lohi, packed = self._read_rows(msg, R, D, out.device)
        if R * D:
            dequantize_add(packed, R, D, lohi.to(out.device), self.bits, out)

    def variance(self, grad: torch.Tensor) -> float:
        """Exact expected squared error sum_i E|Q(x_i) - x_i|^2 of encoding ``grad``."""
        x = self._rows(grad)
        return float(row_variance(x, self.bits).sum()) if x is not None else math.inf


@register("bhq", codec=18)
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
      block_size: rows per block, 1..2**31 (1: PSQ with a row permutation).
      entropy: rANS-code the codes (hvdcomp.codecs.sections).
    grad: any shape and layout, float16/bfloat16/float32/float64, CPU or CUDA.
    Wire: 12 R + 8 G + ceil(numel * bits / 8) payload bytes (G blocks; module docstring).
    Raises ValueError for bits outside 1..8 or block_size < 1 (TypeError for a non-integer),
    TypeError for non-floating gradients, WireFormatError for malformed messages.

    Example::

        c = hvdcomp.get("bhq:bits=4,block_size=8")
        msg = c.encode(grad, key)
        c.decode(Message.from_bytes(msg.to_bytes()), key, acc)
    """
    example = "bhq:bits=4"
    device_identical = False   # its blocks: rows ranked by torch's sums / maxima per device

    def __init__(self, bits: int = 4, block_size: int = 8, entropy: bool = False):
        self.bits = settings.integer("bits", bits, 1, 8)
        self.block_size = settings.integer("block_size", block_size, 1, 2**31)
        self.entropy = settings.boolean("entropy", entropy)

    def _header_fields(self) -> Dict[str, int]:
        return {"bits": self.bits, "bucket_size": self.block_size, "level_version": 0}

    def message_bytes(self, shape, nblocks: Optional[int] = None) -> Optional[int]:
        """Payload bytes (header excluded) for a tensor of ``shape`` sent in ``nblocks``
        blocks (the number of entries of section 3); None without ``nblocks`` (the
        grouping depends on the values)."""
        if nblocks is None:
            return None
        R, D = rows_of(shape)
        return 12 * R + 8 * nblocks + packed_size(R * D, self.bits)

    def _encode(self, grad, key):
        x = self._rows(grad)
        if x is None:
            return self._nonfinite(grad, key)
        perm, sizes, scales, y, _ = bhq_plan(x, self.bits, self.block_size)
        sections, flags = self._quantize(y, key)
        sections += (perm.numpy().astype("<u4").view(np.uint8),
                     sizes.numpy().astype("<u4").view(np.uint8),
                     scales.numpy().astype("<f4").view(np.uint8))
        return self._new_message(grad, key, sections, flags)

    def read_blocks(self, msg: Message, lohi: torch.Tensor):
        """Validate sections 2-4 of ``msg`` with its row ranges ``lohi`` (float32 (R, 2),
        validated); returns (perm int64 (R,), sizes int64 (G,), scales float32 (G,)).
        Raises WireFormatError, also for a block whose values could decode beyond the
        float32 range (hvdcomp.ops.psq.decode_bounds; an encoder sends such a block as
        singletons)."""
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
        if not np.all(np.isfinite(scales)) or not np.all(scales >= np.finfo(np.float32).tiny):
            raise WireFormatError("bhq: block scales must be finite and > 0 (and normal: "
                                  "an encoder never writes one below 2**-126)")
        if np.any(scales[sizes == 1] != 1):
            raise WireFormatError("bhq: a block of one row must have scale 1")
        perm, sizes, scales = torch.from_numpy(perm), torch.from_numpy(sizes), \
            torch.from_numpy(scales)
        bound = decode_bounds(lohi.abs().amax(dim=1), sizes, scales)
        if bool((bound > _F32_MAX).any()):
            g = int(torch.nonzero(bound > _F32_MAX)[0])
            raise WireFormatError(f"bhq: block {g} (scale {float(scales[g]):.7g}) would decode "
                                  f"beyond the float32 range")
        return perm, sizes, scales

    def _decode(self, msg, key, out):
        R, D = rows_of(msg.shape)
        msg.expect(nsections=5)
        lohi, packed = self._read_rows(msg, R, D, out.device)
        perm, sizes, scales = self.read_blocks(msg, lohi)
        if R * D:
            dev = out.device
            bhq_dequantize_add(packed, R, D, lohi.to(dev), self.bits, perm.to(dev),
                               sizes.to(dev), scales.to(dev), out)

    def variance(self, grad: torch.Tensor) -> float:
        """Exact expected squared error sum_i E|Q(x_i) - x_i|^2 of encoding ``grad``
        (hvdcomp.ops.psq, BHQ step 3), up to float rounding."""
        x = self._rows(grad)
        return bhq_plan(x, self.bits, self.block_size)[4] if x is not None else math.inf
