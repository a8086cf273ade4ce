"""EF-SignSGD: 1-bit scaled-sign compression with error feedback.

Source: Karimireddy, Rebjock, Stich, Jaggi, "Error Feedback Fixes SignSGD and other Gradient
Compression Schemes", ICML 2019 (arXiv 1901.09847), Algorithm 1 (EF-SIGNSGD) with the scaled
sign compressor ``C(v) = (||v||_1 / d) sign(v)``:

    p_t     = g_t + e_t             error correction (e_0 = 0)
    Delta_t = C(p_t)                what is sent, and what every receiver decodes
    e_{t+1} = p_t - Delta_t         the new residual, kept by the sender

Algorithm 1 compresses ``gamma g_t + e_t``; here the learning rate is applied by the wrapped
optimizer after averaging, so the residual is kept in gradient units (``p = g + e``).  The
two agree for a constant learning rate (the residual is ``e / gamma``).  With several
workers every rank keeps its own residual for each parameter and the decoded messages are
averaged.

Per tensor, with ``g`` the gradient's float32 values and ``e`` the residual of this parameter
(float32, same shape, zero before the first step), ``p = g + e`` (float32), cut into buckets
of ``bucket_size`` coordinates (0: one bucket = the whole tensor, the paper's ``d``):

    scale_b   = float32(sum_{i in b} |p_i| / len(b))     L1 sum in float64; len(b) is the
                                                          bucket's real length (the last
                                                          one may be short)
    bit_i     = 1 if p_i < 0 else 0                       SIGN OF ZERO: p_i = 0 (also -0.0)
                                                          is sent as +, bit 0
    Delta_i   = -scale_b if bit_i else +scale_b           float32, exact
    e_i      <- p_i - Delta_i                             float32

An all-zero bucket has scale 0 and decodes to exact zeros.  Per bucket the new residual obeys
``||e_new||^2 = ||p||^2 - ||p||_1^2 / len(b)`` (exact in real arithmetic, with this sign of
zero too), i.e. C is a delta-approximate compressor with
``delta = ||p||_1^2 / (len(b) ||p||_2^2)`` (the paper's Sec. 3).

Bias: the scaled sign is BIASED (``E[Delta] != g``; there is no randomness at all).  Error
feedback makes the bias vanish in the sum over steps: ``sum_t Delta_t = sum_t g_t - e_T``
(exactly, up to float32 rounding), so no gradient mass is lost, only delayed.

State: one residual per parameter name (``TensorKey.name``), float32, on the gradient's device.
``state_dict()`` is ``{"residuals": {name: float32 CPU tensor}}``; ``load_state_dict``
validates and replaces all residuals.  One instance per rank (the drop-in optimizer owns
one); ``encode`` updates the residual, so call it exactly once per tensor per step.

NaN policy: a gradient holding NaN/Inf (or ``p`` overflowing float32) is sent as a
payload-free NONFINITE message and the residual stays UNCHANGED (as if the step had not
happened for this tensor on this rank); every receiver sets the averaged tensor to NaN.

Wire (codec ``signef`` = 16; header bits = 1, bucket size = the setting, 0 = per tensor):
    section 0: scales, float32 little-endian, ``nb`` values, nb = ceil(numel / bucket_size)
               (bucket_size = 0: nb = 1, or 0 for an empty tensor)
    section 1: sign bits, 1 bit per coordinate packed LSB-first (hvdcomp.ops.bitpack):
               coordinate i is bit i % 8 of byte i // 8; unused high bits of the last byte 0
    payload bytes = 4 * nb + ceil(numel / 8)           (:meth:`SignEF.message_bytes`)

The computations are the ops of hvdcomp.ops.ternary (``signef_scales``, ``signef_pack``,
``signef_decode_add``: the PyTorch references and kernels/ternary.cu).
"""
from __future__ import annotations

from typing import Dict

import numpy as np
import torch

from ..codecs.sections import read_codes, write_codes
from ..ops import ternary
from ..wire import Message
from . import settings
from .base import Compressor, TensorKey, register
from .bucketing import TensorBuckets
from .state import Residuals, finite

__all__ = ["SignEF"]

_BITS = 1


@register("signef", codec=16)
class SignEF(Residuals, TensorBuckets, Compressor):
    """EF-SignSGD (Karimireddy et al., ICML 2019, arXiv 1901.09847, Algorithm 1): the scaled
    sign ``(||p||_1 / d) sign(p)`` of ``p = g + e`` per bucket, 1 bit per coordinate, with
    the residual ``e = p - decoded`` kept per parameter name.  Biased; error feedback
    carries the error into the next step (see the module docstring).

    Args:
      bucket_size: coordinates per float32 scale (a Python int in 0..2**31); 0 (default) =
        one scale per tensor, as in Algorithm 1 applied layer-wise.
      entropy: rANS-code the sign bits (hvdcomp.codecs.sections, flag ENTROPY).
    Raises ValueError for other values.

    encode(grad, key): grad of any shape and layout, float16 / bfloat16 / float32 / float64
      (its float32 values are used); returns a Message of ``4 * nb + ceil(numel / 8)``
      payload bytes.  Updates the residual of ``key.name``.  Raises TypeError for integer,
      bool or complex tensors; ValueError if the stored residual of ``key.name`` does not
      have ``grad``'s shape (it is never broadcast).  NaN/Inf: NONFINITE message, residual
      unchanged.
    decode(msg, key, out): adds ``+-scale`` (float32) into ``out``; stateless.  Raises
      WireFormatError for a wrong header, wrong section sizes, unknown flags, or scales that
      are negative or not finite.
    """
    example = "signef"
    keeps_state = True          # the residuals
    biased = True
    code_bits = _BITS

    def __init__(self, bucket_size: int = 0, entropy: bool = False):
        self.bucket_size = settings.integer("bucket_size", bucket_size, 0, 2**31)
        self.entropy = settings.boolean("entropy", entropy)
        self._residuals: Dict[str, torch.Tensor] = {}

    def _header_fields(self) -> Dict[str, int]:
        return {"bits": _BITS, "bucket_size": self.bucket_size, "level_version": 0}

    # --- the compressor -----------------------------------------------------------------
    def _encode(self, grad: torch.Tensor, key: TensorKey) -> Message:
        if not grad.is_floating_point():
            raise TypeError(f"signef compresses floating-point gradients only, got {grad.dtype}")
        g = grad.detach().reshape(-1).to(torch.float32)
        e = self._residuals.get(key.name)
        if e is not None:
            if tuple(e.shape) != tuple(grad.shape) or e.dtype != torch.float32:
                raise ValueError(
                    f"signef: the residual stored for {key.name!r} has shape "
                    f"{tuple(e.shape)} and dtype {e.dtype}, but its gradient has shape "
                    f"{tuple(grad.shape)} (residuals are float32 of the gradient's shape; "
                    f"was a checkpoint of another model loaded?)")
            e = e.to(g.device).reshape(-1)
        n = g.numel()
        bs = self._bs(n)
        s = ternary.signef_scales(g, e, bs)
        if not finite(s):                        # p = g + e holds NaN/Inf: residual unchanged
            return self._nonfinite(grad, key)
        bits, e_new = ternary.signef_pack(g, e, s, bs, e_out=e)   # the residual, in place
        self._residuals[key.name] = e_new.view(grad.shape)
        codes, flags = write_codes(bits, n, _BITS, self.entropy)
        return self._new_message(grad, key, (s.cpu().numpy().view(np.uint8), codes), flags)

    def _decode(self, msg: Message, key: TensorKey, out: torch.Tensor) -> None:
        n = msg.numel
        s = self._read_scales(msg)
        dev = out.device
        bits = read_codes(msg, 1, n, _BITS, device=dev, what="sign bits")
        ternary.signef_decode_add(bits, n, s.to(dev), self._bs(n), out)
