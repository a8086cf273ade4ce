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
    b_i   = 1 if u_i < r_i else 0                 u_i = hvdcomp.random.uniform(seed, step,
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
    section 1: codes, 2 bits per coordinate packed LSB-first (hvdcomp.codecs.bitpack):
               code = sign << 1 | b, sign = 1 iff c_i < 0 (the family's convention: ``bits``
               counts the sign; a coordinate that rounds to 0 keeps its sign bit)
    payload bytes = 4 * nb + ceil(2 * numel / 8)    (:meth:`TernGrad.message_bytes`)
"""
from __future__ import annotations

import math
from typing import Dict

import numpy as np
import torch

from ..backends import k_ternary, kernel_backend
from ..codecs import pack_bits, packed_size, unpack_bits
from ..codecs.sections import read_codes
from ..errors import WireFormatError
from ..random import uniform
from ..wire import CODECS, FLAG_ENTROPY, Message
from .base import TensorKey, register
from .bucketing import TensorBuckets
from ..ops.quantize import dequantize_reference, quantize_reference
from .quantizers import BucketQuantizer
from .state import finite

__all__ = ["TernGrad", "clip_threshold", "clip_gradient"]

_BITS = 2                     # 1 sign bit + 1 index bit (levels {0, 1})
_LEVELS = (0.0, 1.0)


def clip_threshold(x: torch.Tensor, clip: float) -> float:
    """The clipping threshold ``T = float32(clip * sigma)`` of one gradient, as a Python float.

    x: any shape, floating dtype (its float32 values are used); sigma is the population
    standard deviation of the elements, ``sqrt(mean((x - mean x)^2))``, in float64.
    Returns ``inf`` (no clipping) when clip == 0, the tensor is empty, or T == 0.
    """
    x32 = x.detach().reshape(-1).to(torch.float32)
    if clip == 0 or x32.numel() == 0:
        return math.inf
    xd = x32.to(torch.float64)
    sigma = float(torch.sqrt(((xd - xd.mean()) ** 2).mean()))
    t = float(torch.tensor(clip * sigma, dtype=torch.float64).to(torch.float32))
    return t if t > 0 else math.inf


def clip_gradient(x: torch.Tensor, clip: float) -> torch.Tensor:
    """The clipped gradient ``min(max(x, -T), T)`` as a flat float32 tensor (a new tensor).

    T from :func:`clip_threshold`; ``x`` is read, never modified.
    """
    x32 = x.detach().reshape(-1).to(torch.float32)
    t = clip_threshold(x32, clip)
    if math.isinf(t):
        return x32.clone()
    return x32.clamp(-t, t)


@register("terngrad")
class TernGrad(TensorBuckets, BucketQuantizer):
    """TernGrad (Wen et al., NeurIPS 2017, arXiv 1705.07878, Sec. 3.1 and 3.3): gradient
    clipping at ``clip`` standard deviations, then stochastic ternarization to
    ``{-s, 0, +s}`` per bucket, ``s`` the bucket's L-inf norm.  Unbiased for the CLIPPED
    gradient; ``Var[Q(c_i)] = |c_i| (s - |c_i|)`` (see the module docstring).

    Args:
      clip: clipping factor c (float >= 0, finite); 0 disables clipping.  Default 2.5 (paper).
      bucket_size: coordinates per scale (int, 0..2**31); 0 (default) = one scale per tensor,
        the paper's layer-wise ternarizing.  Smaller buckets lower the variance at 4 bytes
        per bucket.
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
    codec = CODECS["terngrad"]
    norm = "linf"
    code_bits = _BITS

    def __init__(self, clip: float = 2.5, bucket_size: int = 0, entropy: bool = False):
        if isinstance(clip, bool) or not isinstance(clip, (int, float)):
            raise ValueError(f"clip must be a number >= 0 (0 disables clipping), got {clip!r}")
        if not math.isfinite(clip) or clip < 0:
            raise ValueError(f"clip must be finite and >= 0 (0 disables clipping), got {clip}")
        if (isinstance(bucket_size, bool) or not isinstance(bucket_size, int)
                or not 0 <= bucket_size <= 2**31):
            raise ValueError(f"bucket_size must be an integer in 0..2**31 (0: one bucket per "
                             f"tensor), got {bucket_size!r}")
        self.clip = float(clip)
        self.bucket_size = int(bucket_size)
        self.bits = _BITS
        self.entropy = bool(entropy)
        self.levels = torch.tensor(_LEVELS, dtype=torch.float32)
        self.level_version = 0

    def initial_levels(self) -> np.ndarray:
        return np.array(_LEVELS, dtype=np.float64)

    # --- encode / decode -----------------------------------------------------------------
    def clipped(self, grad: torch.Tensor) -> torch.Tensor:
        """The clipped gradient that encode quantizes (flat float32); ``E[decode] ==``
        this, reshaped to ``grad.shape``."""
        return clip_gradient(grad, self.clip)

    def _encode(self, grad: torch.Tensor, key: TensorKey) -> Message:
        if not grad.is_floating_point():
            raise TypeError(f"terngrad quantizes floating-point gradients only, got {grad.dtype}")
        x = grad.detach().reshape(-1).to(torch.float32)
        be = kernel_backend(x.device) if x.numel() else None
        if be is not None:
            return self._encode_kernels(be.backend, grad, x, key)
        if x.numel() and not bool(torch.isfinite(x).all()):
            return self._nonfinite(grad, key)        # a float64 value beyond float32's range
        c = clip_gradient(x, self.clip)
        n = c.numel()
        u = uniform(n, seed=key.seed, step=key.step, rank=key.rank, tensor_id=key.tensor_id,
                    device=c.device)
        norms, codes = quantize_reference(c, self.levels.to(c.device), self._bs(n), "linf", u)
        return self._message(grad, key, norms, pack_bits(codes, _BITS))   # or rANS

    def _decode(self, msg: Message, key: TensorKey, out: torch.Tensor) -> None:
        n = msg.numel
        nb = self.num_buckets(n)
        msg.expect(nsections=2)
        msg.section_size_check(0, 4 * nb, "scales")
        norms = torch.from_numpy(np.array(msg.sections[0]).view(np.float32))
        if not bool(torch.isfinite(norms).all()) or bool((norms < 0).any()):
            raise WireFormatError("terngrad: bucket scales must be finite and >= 0")
        be = kernel_backend(out.device)
        if (be is not None and not msg.flags & FLAG_ENTROPY and out.dtype == torch.float32
                and out.dim() == 1 and out.is_contiguous()):
            # kernels/ternary.cu: out += the decoded values, bit for bit as below
            msg.section_size_check(1, packed_size(n, _BITS), "codes")
            dev = out.device
            packed = torch.from_numpy(np.array(msg.sections[1], dtype=np.uint8)).to(dev)
            k_ternary.terngrad_decode_add(be.backend, packed, n, norms.to(dev), self._bs(n),
                                          out)
            return
        codes = unpack_bits(read_codes(msg, 1, n, _BITS), n, _BITS)   # or rANS-decoded
        v = dequantize_reference(norms, codes, self.levels, self._bs(n), _BITS - 1)
        out.add_(v.to(out.device))

    def _encode_kernels(self, be, grad: torch.Tensor, x: torch.Tensor,
                        key: TensorKey) -> Message:
        """_encode on kernels/ternary.cu (``be``: a kernel backend's launch object): the same
        message bytes as the reference path above, for a non-empty flat float32 ``x``.

        One pass gives the bucket maxima of |x| (and the sums of the clipping statistics);
        the threshold T is the reference's (certified from the kernels' sums, else computed
        by clip_threshold itself, see k_ternary.terngrad_clip_threshold); the scales are
        min(max |x|, T) = max |clamp(x, -T, T)| exactly; a second pass clips, ternarizes and
        packs."""
        n = x.numel()
        bs = self._bs(n)
        maxima, sums = k_ternary.terngrad_bucket_max(be, x, bs)
        if not finite(maxima):                   # a NaN/Inf in x (NaN propagates in max)
            return self._nonfinite(grad, key)
        t = k_ternary.terngrad_clip_threshold(be, x, self.clip, sums)
        if t is None:                            # not certified: the reference's own value
            t = clip_threshold(x, self.clip)
        scales = maxima if math.isinf(t) else maxima.clamp(max=t)
        packed = k_ternary.terngrad_pack(be, x, scales, bs, t, seed=key.seed, rank=key.rank,
                                         tensor_id=key.tensor_id, step=key.step)
        return self._message(grad, key, scales, packed)   # packed, or rANS

    # --- statistics -----------------------------------------------------------------------
    def variance(self, grad: torch.Tensor) -> float:
        """``E||Q(c) - c||^2 = sum_i |c_i| (s_b(i) - |c_i|)`` (float64) for the clipped
        gradient ``c`` of ``grad`` and the float32 bucket scales ``s_b`` that encode sends."""
        c = self.clipped(grad)
        n = c.numel()
        if n == 0:
            return 0.0
        bs = self._bs(n)
        nb = (n + bs - 1) // bs
        cp = torch.zeros(nb * bs, dtype=torch.float32)
        cp[:n] = c.cpu()
        s = cp.view(nb, bs).abs().amax(dim=1).to(torch.float64)
        a = c.cpu().abs().to(torch.float64)
        return float((a * (s.repeat_interleave(bs)[:n] - a)).sum())

    # --- state (none) -------------------------------------------------------------------
    def state_dict(self) -> Dict:
        return {}

    def load_state_dict(self, state) -> None:
        if state:
            raise ValueError(f"terngrad has no state, got keys {sorted(state)}")
