"""TernGrad: stochastic ternary gradients with gradient clipping.

Source: Wen, Xu, Yan, Wu, Wang, Chen, Li, "TernGrad: Ternary Gradients to Reduce Communication
in Distributed Deep Learning", NeurIPS 2017 (arXiv 1705.07878): Sec. 3.1 (ternarization
``g~ = s * sign(g) o b`` with ``s = ||g||_inf`` and ``P(b_k = 1) = |g_k| / s``, unbiased),
Sec. 3.3 (layer-wise ternarizing, and clipping every gradient to ``[-c sigma, c sigma]`` with
``c = 2.5``).  In the family of Faghri et al., NeurIPS 2020 (arXiv 2010.12460, Sec. 2) it is
the member with the level table ``{0, 1}`` and the L-inf bucket norm.

Per tensor (the whole flattened gradient ``x``, in float32):

    sigma = sqrt(mean((x - mean(x))^2))          population std, accumulated in float64
    T     = float32(clip * sigma)                 (the authors' TensorFlow code does the same)
    c_i   = min(max(x_i, -T), T)                  the CLIPPED gradient; no clipping when
                                                  clip == 0 or T == 0 (all elements equal:
                                                  clipping at 0 would erase the tensor)

then per bucket of ``bucket_size`` coordinates of ``c`` (0: one bucket = the whole tensor,
the paper's layer-wise scalar):

    s     = max_i |c_i|                           float32, sent
    r_i   = float32(|c_i| / s)                    (s = 0: r_i = 0)
    b_i   = 1 if u_i < r_i else 0                 u_i = hvdcomp.philox.uniform(seed, step,
                                                  rank, tensor_id, index i)
    Q(c_i) = sign(c_i) * s * b_i                  in {-s, 0, +s}

Statistics (for the clipped gradient ``c``, not for the raw gradient ``x``):

    E[Q(c_i)]   = c_i                              unbiased w.r.t. the CLIPPED gradient
    Var[Q(c_i)] = |c_i| (s - |c_i|)  = s^2 r_i (1 - r_i)
    E||Q(c) - c||^2 = sum_i |c_i| (s_b(i) - |c_i|)   (:meth:`TernGrad.variance`)

Clipping makes the estimator biased w.r.t. the raw gradient (that is its purpose: it bounds
``s`` and so the variance).  Unlike the authors' code, the scale ``s`` is the bucket's own
L-inf norm after clipping (not the threshold ``T``; ``s <= T``, so the variance is never
larger), and there is no "scaler sharing" across workers (the max of the scales over workers,
Sec. 3.1), which would need one more collective per tensor; every rank's scale travels in
its own message instead.

Wire (codec ``terngrad`` = 15; header bits = 2, bucket size = the setting, 0 = per tensor):
    section 0: bucket scales ``s``, float32 little-endian, ``nb`` values where
               nb = ceil(numel / bucket_size) (bucket_size = 0: nb = 1, or 0 if numel = 0)
    section 1: codes, 2 bits per coordinate packed LSB-first (hvdcomp.ops.bitpack):
               code = sign << 1 | b, sign = 1 iff c_i < 0 (the family's convention: ``bits``
               counts the sign; a coordinate that rounds to 0 keeps its sign bit)
    payload bytes = 4 * nb + ceil(2 * numel / 8)    (:meth:`TernGrad.message_bytes`)

The computations are the ops of hvdcomp.ops.ternary (``clip_threshold``, ``terngrad_scales``,
``terngrad_pack``, ``terngrad_decode_add``: the PyTorch references and kernels/ternary.cu).
"""
from __future__ import annotations

import math
from typing import Dict

import numpy as np
import torch

from ..codecs.sections import read_codes, write_codes
from ..ops import ternary
from ..wire import Message
from . import settings
from .base import Compressor, TensorKey, register
from .bucketing import TensorBuckets
from .quantizers import BucketQuantizer

__all__ = ["TernGrad"]

_BITS = 2                     # 1 sign bit + 1 index bit (levels {0, 1})
_LEVELS = (0.0, 1.0)


@register("terngrad", codec=15)
class TernGrad(TensorBuckets, BucketQuantizer):
    """TernGrad (Wen et al., NeurIPS 2017, arXiv 1705.07878, Sec. 3.1 and 3.3): gradient
    clipping at ``clip`` standard deviations, then stochastic ternarization to
    ``{-s, 0, +s}`` per bucket, ``s`` the bucket's L-inf norm.  Unbiased for the CLIPPED
    gradient; ``Var[Q(c_i)] = |c_i| (s - |c_i|)`` (see the module docstring).

    Args:
      clip: clipping factor c (a Python int or float >= 0, finite); 0 disables clipping.
        Default 2.5 (paper).
      bucket_size: coordinates per scale (a Python int in 0..2**31); 0 (default) = one scale
        per tensor, the paper's layer-wise ternarizing.  Smaller buckets lower the variance
        at 4 bytes per bucket.
      entropy: rANS-code the 2-bit codes (hvdcomp.codecs.sections, flag ENTROPY).
    Raises ValueError for other values.

    encode(grad, key): grad of any shape and layout, float16 / bfloat16 / float32 / float64
      (quantized from its float32 values); returns a Message of
      ``4 * nb + ceil(numel / 4)`` payload bytes (see :meth:`message_bytes`).  Raises
      TypeError for integer, bool or complex tensors.  A gradient holding NaN/Inf (or a
      float64 one that overflows float32) is sent as a NONFINITE message.
    decode(msg, key, out): adds ``sign * s * b`` (float32) into ``out``.  Raises
      WireFormatError for a wrong header, wrong section sizes, unknown flags, or scales that
      are negative or not finite.
    Stateless: ``state_dict()`` is ``{}``.
    """
    example = "terngrad"
    norm = "linf"
    code_bits = _BITS

    def __init__(self, clip: float = 2.5, bucket_size: int = 0, entropy: bool = False):
        self.clip = settings.real("clip", clip, 0.0)
        self.bucket_size = settings.integer("bucket_size", bucket_size, 0, 2**31)
        self.entropy = settings.boolean("entropy", entropy)
        self.bits = _BITS
        self.levels = torch.tensor(_LEVELS, dtype=torch.float32)
        self.level_version = 0

    def initial_levels(self) -> np.ndarray:
        return np.array(_LEVELS, dtype=np.float64)

    def second_stage(self) -> Compressor:
        """The reduce-scatter re-encodes averages with this same instance (its two levels
        have no finer table)."""
        return self

    # --- encode / decode -----------------------------------------------------------------
    def clipped(self, grad: torch.Tensor) -> torch.Tensor:
        """The clipped gradient that encode quantizes (flat float32); ``E[decode] ==``
        this, reshaped to ``grad.shape``."""
        return ternary.clip_gradient(grad, self.clip)

    def _encode(self, grad: torch.Tensor, key: TensorKey) -> Message:
        # finite values only: Compressor.encode sends a NONFINITE message for anything else
        if not grad.is_floating_point():
            raise TypeError(f"terngrad quantizes floating-point gradients only, got {grad.dtype}")
        x = grad.detach().reshape(-1).to(torch.float32)
        n = x.numel()
        bs = self._bs(n)
        scales, t = ternary.terngrad_scales(x, self.clip, bs)
        packed = ternary.terngrad_pack(x, scales, bs, t, seed=key.seed, rank=key.rank,
                                       tensor_id=key.tensor_id, step=key.step)
        codes, flags = write_codes(packed, n, _BITS, self.entropy)
        return self._new_message(grad, key, (scales.cpu().numpy().view(np.uint8), codes),
                                 flags)

    def _decode(self, msg: Message, key: TensorKey, out: torch.Tensor) -> None:
        n = msg.numel
        scales = self._read_scales(msg)
        dev = out.device
        packed = read_codes(msg, 1, n, _BITS, device=dev)
        ternary.terngrad_decode_add(packed, n, scales.to(dev), self._bs(n), out)

    # --- statistics -----------------------------------------------------------------------
    def variance(self, grad: torch.Tensor) -> float:
        """``E||Q(c) - c||^2 = sum_i |c_i| (s_b(i) - |c_i|)`` (float64) for the clipped
        gradient ``c`` of ``grad`` and the float32 bucket scales ``s_b`` that encode sends."""
        x = grad.detach().reshape(-1).to(torch.float32).cpu()
        n = x.numel()
        if n == 0:
            return 0.0
        bs = self._bs(n)
        s, t = ternary.terngrad_scales(x, self.clip, bs)
        a = (x if math.isinf(t) else x.clamp(-t, t)).abs().to(torch.float64)
        return float((a * (s.to(torch.float64).repeat_interleave(bs)[:n] - a)).sum())

    # --- state (none) -------------------------------------------------------------------
    def state_dict(self) -> Dict:
        return {}

    def load_state_dict(self, state) -> None:
        if state:
            raise ValueError(f"terngrad has no state, got keys {sorted(state)}")
