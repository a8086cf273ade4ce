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
"""
from __future__ import annotations

from typing import Any, Dict, Optional

import numpy as np
import torch

from ..backends import k_ternary, kernel_backend
from ..codecs import pack_bits, packed_size, unpack_bits
from ..codecs.sections import read_codes, write_codes
from ..errors import WireFormatError
from ..wire import CODECS, FLAG_ENTROPY, Message, dtype_code
from .base import Compressor, TensorKey, register
from .bucketing import TensorBuckets
from .state import finite, load_tensors

__all__ = ["SignEF"]

_BITS = 1


@register("signef")
class SignEF(TensorBuckets, Compressor):
    """EF-SignSGD (Karimireddy et al., ICML 2019, arXiv 1901.09847, Algorithm 1): the scaled
    sign ``(||p||_1 / d) sign(p)`` of ``p = g + e`` per bucket, 1 bit per coordinate, with
    the residual ``e = p - decoded`` kept per parameter name.  Biased; error feedback
    carries the error into the next step (see the module docstring).

    Args:
      bucket_size: coordinates per float32 scale (int, 0..2**31); 0 (default) = one scale
        per tensor, as in Algorithm 1 applied layer-wise.  Raises ValueError otherwise.

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
    codec = CODECS["signef"]
    code_bits = _BITS

    def __init__(self, bucket_size: int = 0, entropy: bool = False):
        self.entropy = bool(entropy)
        if (isinstance(bucket_size, bool) or not isinstance(bucket_size, int)
                or not 0 <= bucket_size <= 2**31):
            raise ValueError(f"bucket_size must be an integer in 0..2**31 (0: one bucket per "
                             f"tensor), got {bucket_size!r}")
        self.bucket_size = int(bucket_size)
        self._residuals: Dict[str, torch.Tensor] = {}

    def _header_fields(self) -> Dict[str, int]:
        return {"bits": _BITS, "bucket_size": self.bucket_size, "level_version": 0}

    # --- the compressor -----------------------------------------------------------------
    def scales(self, p: torch.Tensor) -> torch.Tensor:
        """float32 ``||p_b||_1 / len(b)`` per bucket of the flat float32 tensor ``p``."""
        n = p.numel()
        bs = self._bs(n)
        nb = (n + bs - 1) // bs
        a = torch.zeros(nb * bs, dtype=torch.float64, device=p.device)
        a[:n] = p.abs().to(torch.float64)
        counts = torch.full((nb,), float(bs), dtype=torch.float64, device=p.device)
        if nb:
            counts[-1] = n - (nb - 1) * bs
        return (a.view(nb, bs).sum(dim=1) / counts).to(torch.float32)

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
        be = kernel_backend(g.device) if g.numel() else None
        if be is not None:
            return self._encode_kernels(be.backend, grad, g, e, key)
        if e is not None:
            p = g + e.to(g.device).reshape(-1)
        else:
            p = g.clone()
        n = p.numel()
        if n and not bool(torch.isfinite(p).all()):
            return self._nonfinite(grad, key)        # residual unchanged
        bs = self._bs(n)
        s = self.scales(p)
        neg = p < 0                                  # sign of zero: + (bit 0)
        sf = s.repeat_interleave(bs)[:n] if n else s[:0]
        decoded = torch.where(neg, -sf, sf)
        self._residuals[key.name] = (p - decoded).view(grad.shape)
        sec, flags = write_codes(pack_bits(neg, _BITS), n, _BITS, self.entropy)
        return self._message(grad, key, s, sec, flags)

    def _message(self, grad: torch.Tensor, key: TensorKey, s: torch.Tensor, sec,
                 flags: int) -> Message:
        return Message(codec=self.codec, dtype=dtype_code(grad.dtype), shape=tuple(grad.shape),
                       sections=(s.cpu().numpy().view(np.uint8), sec), flags=flags,
                       tensor_id=key.tensor_id, rank=key.rank, seed=key.seed, step=key.step,
                       **self._header_fields())

    def _encode_kernels(self, be, grad: torch.Tensor, g: torch.Tensor,
                        e: Optional[torch.Tensor], key: TensorKey) -> Message:
        """_encode on kernels/ternary.cu (``be``: a kernel backend's launch object): the same
        message bytes and the same new residual as the reference path, for a non-empty flat
        float32 ``g`` and the (already checked) residual ``e`` or None.

        Pass 1: the bucket scales of p = g + e (a scale is used only where it is certified
        equal to the reference's, else the reference's own scales are computed, see
        k_ternary.signef_scales); pass 2: sign bits, and the residual p - decoded written
        over the old one (which this compressor owns)."""
        n = g.numel()
        bs = self._bs(n)
        ef = None if e is None else e.to(g.device).reshape(-1)
        s, uncertain = k_ternary.signef_scales(be, g, ef, bs)
        if not finite(s):                        # NaN/Inf in p: residual unchanged
            return self._nonfinite(grad, key)
        if bool(uncertain.any()):
            s = self.scales(g + ef if ef is not None else g)
        bits, e_new = k_ternary.signef_pack(be, g, ef, s, bs, e_out=ef)
        self._residuals[key.name] = e_new.view(grad.shape)
        sec, flags = write_codes(bits, n, _BITS, self.entropy)
        return self._message(grad, key, s, sec, flags)

    def _decode(self, msg: Message, key: TensorKey, out: torch.Tensor) -> None:
        n = msg.numel
        nb = self.num_buckets(n)
        msg.expect(nsections=2)
        msg.section_size_check(0, 4 * nb, "scales")
        s = torch.from_numpy(np.array(msg.sections[0]).view(np.float32))
        if not bool(torch.isfinite(s).all()) or bool((s < 0).any()):
            raise WireFormatError("signef: bucket scales must be finite and >= 0")
        be = kernel_backend(out.device)
        if (be is not None and not msg.flags & FLAG_ENTROPY and out.dtype == torch.float32
                and out.dim() == 1 and out.is_contiguous()):
            # kernels/ternary.cu: out += the decoded values, bit for bit as below
            msg.section_size_check(1, packed_size(n, _BITS), "sign bits")
            dev = out.device
            packed = torch.from_numpy(np.array(msg.sections[1], dtype=np.uint8)).to(dev)
            k_ternary.signef_decode_add(be.backend, packed, n, s.to(dev), self._bs(n), out)
            return
        bits = unpack_bits(read_codes(msg, 1, n, _BITS, what="sign bits"), n, _BITS)
        sf = s.repeat_interleave(self._bs(n))[:n] if n else s[:0]
        out.add_(torch.where(bits != 0, -sf, sf).to(out.device))

    # --- state --------------------------------------------------------------------------
    def residual(self, name: str) -> Optional[torch.Tensor]:
        """A copy of the residual kept for parameter ``name`` (float32, its gradient's
        shape), or None before its first finite encode."""
        e = self._residuals.get(name)
        return None if e is None else e.detach().clone()

    def state_dict(self) -> Dict[str, Any]:
        """``{"residuals": {name: float32 CPU tensor}}`` (copies)."""
        return {"residuals": {k: v.detach().cpu().clone() for k, v in self._residuals.items()}}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Replace every residual with those of ``state`` (as produced by ``state_dict``).

        Raises ValueError (and changes nothing) for unknown keys, a residual that is not a
        finite float32 torch tensor, or one whose shape differs from the residual this
        compressor already holds for that name.  A residual for a name not yet seen is
        checked against the gradient's shape when that name is encoded next.
        """
        if not isinstance(state, dict):
            raise ValueError(f"signef: state must be a dict, got {type(state).__name__}")
        extra = sorted(set(state) - {"residuals"})
        if extra:
            raise ValueError(f"signef: unknown state keys {extra}; expected 'residuals'")
        new = load_tensors("signef", "residual", state.get("residuals", {}), self._residuals)
        self._residuals = new
