"""Uniform quantization with error feedback: nearest rounding on a step set by a variance
target, the codes rANS-coded.

Sources: the error-feedback algorithm for a general compressor of Karimireddy, Rebjock,
Stich, Jaggi, "Error Feedback Fixes SignSGD and other Gradient Compression Schemes", ICML
2019 (arXiv 1901.09847, Algorithm 2, EF-SGD), with a uniform scalar quantizer whose codes are
entropy-coded (uniform steps with entropy coding: Gish & Pierce, "Asymptotically efficient
quantizing", IEEE Trans. Inf. Theory 14(5), 1968):

    p_t     = g_t + e_t             error correction (e_0 = 0)
    Delta_t = Q(p_t)                what is sent, and what every receiver decodes
    e_{t+1} = p_t - Delta_t         the new residual, kept by the sender

As for EF-SignSGD (hvdcomp.compressors.signef) the learning rate is applied by the wrapped
optimizer after averaging, so the residual is kept in gradient units.

Per tensor, with ``g`` the gradient's float32 values and ``e`` the residual of this parameter
(float32, zero before the first step), ``p = g + e`` (float32), per bucket b of
``bucket_size`` coordinates (the last one may be short), M = 2**(bits-1) - 1:

    step_scope "bucket" (the default), each bucket's own step:
    Delta_b = hvdcomp.ops.dithered.variance_steps(p, bits, bucket_size, variance_target)_b
            = max(float32(||p_b||) * float32(sqrt(12 v / n_b)), float32(max|p_b| / M)),
              0 for an all-zero bucket          (float32; the same step DQSG's
                                                variance_target sets)

    step_scope "model", one step for every tensor, from the mean square of the previous step:
    Delta_b = hvdcomp.ops.dithered.floor_steps(p, bits, bucket_size, s_t)_b
            = max(s_t, float32(max|p_b| / M)), 0 for an all-zero bucket
    s_t     = float32(sqrt(12 v m_{t-1})),  m_{t-1} = sum ||p_b||^2 / sum n_b over every bucket of
              every tensor this compressor encoded at the previous step (``TensorKey.step``)
              with a finite p and norms: ||p_b|| the float32 bucket norms of variance_steps,
              squared and summed in float64, tensors in name order.  The reduce-scatter's
              re-encoded averages (names ending "/avg", hvdcomp.exchange.shards) keep an m
              of their own, over the pieces this rank owns (a slice of the model, so closer
              to a per-shard step).  Each rank's m is its own (its p).  Before a first such
              step (and after a step whose every p was zero, or was not finite) the
              "bucket" steps are used.
    With one step for the whole model each coordinate errs by about the same amount, which
    minimizes the model's total squared error at a given entropy of the codes (for
    entropy-coded uniform steps, equal distortion per coordinate is the optimal allocation:
    Gish & Pierce 1968); per-bucket steps give each bucket the same relative error instead,
    which spends bits on the layers of small gradients.  Streaming needs a step before the
    model's last gradient exists, hence the previous step's mean square (gradients' scale
    moves slowly; a bucket whose maximum outgrows the step still gets max / M).  Under
    dynamic loss scaling the scale jumps: the step after the scale halves uses a step twice
    too coarse (m four times too large), once; error feedback keeps what it did not send.
    With Auto per layer (hvdcomp.exchange.layer_plan) a candidate is measured at a first
    step, i.e. with the "bucket" steps, and in training its m covers the tensors planned
    to it only.
    q_i     = clamp(floor(float32(p_i / Delta_b) + 1/2), -M, M)    (0 where Delta_b = 0)
    x_hat_i = float32(Delta_b * q_i)            what receivers add
    e_i    <- float32(p_i - x_hat_i)

|p_i| <= M Delta_b, so the clamp acts only where float32 rounding lands on M + 1/2, and
|p_i - x_hat_i| <= min(|p_i|, Delta_b / 2): Q is a delta-approximate compressor (the paper's
Assumption A) with ||Q(p) - p||^2 <= min(||p||^2, 3 v ||p||^2) per bucket whose step v sets.
Unlike DQSG's dithered step (an unbiased error of variance Delta**2 / 12 on every
coordinate), rounding sends a coordinate below Delta / 2 as 0 at no error beyond itself, so
at the same step the codes are fewer bits and the one-step error smaller; the price is bias,
which error feedback carries into the next step instead of averaging it away.

Bias: BIASED.  ``sum_t x_hat_t = sum_t g_t - e_T`` (up to float32 rounding): no gradient
mass is lost, only delayed.

State: one residual per parameter name (``TensorKey.name``), float32 of the gradient's shape,
on its device; ``state_dict()`` is ``{"residuals": {name: float32 CPU tensor}}``, and with
step_scope "model" also ``"mean_square"``: the m that the next step's s is set from,
``{"gradients": m, "averages": m}`` (each a float >= 0; absent before a first step).  The
"bucket" scope loads a state that has one and ignores it (the residuals are the same).  ``encode`` updates the residual: call it once per tensor
per step.

NaN policy: a gradient holding NaN/Inf (or ``p`` overflowing float32) is sent as a
payload-free NONFINITE message, the residual stays unchanged and the tensor does not count in
the mean square.

Wire (codec ``uniformef`` = 27; header bits = ``bits``, bucket size = the setting):
    section 0: Delta_b, float32 little-endian, nb = ceil(numel / bucket_size) values, each
               in [0, hvdcomp.ops.dithered.max_step(bits)]
    section 1: codes q_i + M, ``bits`` each packed LSB-first (hvdcomp.ops.bitpack), or with
               ``entropy`` (the default) their rANS section, alphabet 2**bits, flag ENTROPY;
               the code 2**bits - 1 is invalid, and a bucket with Delta = 0 holds only M
    payload bytes without entropy: 4 * nb + ceil(numel * bits / 8)
"""
from __future__ import annotations

import math
from typing import Any, Dict, Optional, Tuple

import numpy as np
import torch

from ..codecs.sections import write_codes
from ..ops import dithered
from ..ops.quantize import bucket_norms
from ..ops.bitpack import packed_size
from ..wire import Message
from . import settings
from .base import AVERAGE_SUFFIX, Compressor, TensorKey, numel_of, register
from .dithered import parse_steps_and_codes
from .state import Residuals, finite

__all__ = ["UniformEF"]


#: The groups that keep a mean square of their own with step_scope "model": the gradients,
#: and the reduce-scatter's re-encoded averages (names ending AVERAGE_SUFFIX, "/avg":
#: hvdcomp.exchange.shards).
GROUPS = ("gradients", "averages")


def _group(name: str) -> str:
    return "averages" if name.endswith(AVERAGE_SUFFIX) else "gradients"


def _closed(sums: Dict[str, Tuple[float, int]], before: Dict[str, float]) -> Dict[str, float]:
    """The mean squares after a step whose per-tensor ``sums`` (name: (sum ||p_b||^2,
    coordinates)) are given: per group, the fsum over names in sorted order / the count, a
    group without coordinates keeping its m of ``before``.  A new dict."""
    out = dict(before)
    for group in GROUPS:
        names = sorted(k for k in sums if _group(k) == group)
        count = sum(sums[k][1] for k in names)
        if count:
            out[group] = math.fsum(sums[k][0] for k in names) / count
    return out


@register("uniformef", codec=27)
class UniformEF(Residuals, Compressor):
    """Uniform quantization with error feedback (Karimireddy et al., ICML 2019, Algorithm 2
    with a uniform quantizer; entropy-coded uniform steps: Gish & Pierce 1968): each bucket
    of ``p = g + e`` rounded to the nearest multiple of a step set by ``variance_target``,
    the codes rANS-coded, the residual ``e = p - decoded`` kept per parameter name.  Biased;
    error feedback carries the error into the next step (see the module docstring).

    Args:
      bits: code width (2..8), sign included: q in [-M, M], M = 2**(bits-1) - 1.  The step
            is never below max|p_b| / M, so more bits let the variance target set it in
            buckets with heavier tails (and cost 2**(bits+1) bytes of rANS model per message).
      bucket_size: coordinates per step (1..2**31).
      variance_target: v > 0 (at most 1000): the step Delta_b = ||p_b|| sqrt(12 v / n_b),
            with which an unbiased dither would err by v ||p_b||^2 (hvdcomp.ops.dithered
            .variance_steps); rounding errs by at most 3 v ||p_b||^2 and, on peaked
            gradients, by much less.
      entropy: rANS-code the codes (default) instead of packing them at ``bits``.
      step_scope: "bucket" (default): each bucket's step from its own norm, the same
            relative error v in every bucket; "model": one step for every tensor,
            sqrt(12 v m) with m the mean square of the previous step's p over all the tensors
            this compressor encoded (module docstring), so that v is the error relative to
            the whole model's ||p||^2.  Receivers need nothing of it (the steps travel).
    Settings are validated by hvdcomp.compressors.settings: ValueError out of range,
    TypeError for a value of the wrong type (hvdcomp.get: ConfigError).

    encode(grad, key): grad of any shape and layout, float16 / bfloat16 / float32 / float64
      (its float32 values are used); returns a Message (sections: steps, codes; see the
      module docstring).  Updates the residual of ``key.name``.  TypeError for non-floating
      tensors; ValueError if the stored residual of ``key.name`` does not have ``grad``'s
      shape.  NaN/Inf: NONFINITE message, residual unchanged.
    decode(msg, key, out): adds x_hat (float32, numel) into ``out``; stateless.
      WireFormatError for header mismatches, wrong section sizes, steps outside
      [0, max_step(bits)], the invalid code, or a non-zero code in a bucket with step 0.
    Measured (bench/results/bits_variance.md): at the error of CGX's 4-bit quantizer (4.06
    bits per coordinate) it sent 0.50-1.74 bits per coordinate on 10 of the bench's 12 real
    gradients at the first step (2.27 and 2.65 at step 0 of the two CNNs); in error
    feedback's steady state 0.49-1.82 bits with step_scope "model" on all 8 after step 0,
    where "bucket" needs 0.73-2.00.
    """
    example = "uniformef:bits=6,bucket_size=256,variance_target=0.03"
    keeps_state = True          # the residuals
    biased = True

    def __init__(self, bits: int = 6, bucket_size: int = 65536, variance_target: float = 0.03,
                 entropy: bool = True, step_scope: str = "bucket"):
        self.bits = settings.integer("bits", bits, 2, 8)
        self.bucket_size = settings.integer("bucket_size", bucket_size, 1, 2**31)
        self.variance_target = settings.real("variance_target", variance_target, 0.0, 1e3,
                                             lo_open=True)
        self.entropy = settings.boolean("entropy", entropy)
        self.step_scope = settings.choice("step_scope", step_scope, ("bucket", "model"))
        self._residuals: Dict[str, torch.Tensor] = {}
        self._mean_square: Dict[str, float] = {}        # m_{t-1} per group ("model" scope)
        self._sums: Dict[str, Tuple[float, int]] = {}   # this step's sum ||p_b||^2, count
        self._sums_step: Optional[int] = None

    @property
    def M(self) -> int:
        """Number of positive levels, 2**(bits-1) - 1."""
        return (1 << (self.bits - 1)) - 1

    def _header_fields(self) -> Dict[str, int]:
        return {"bits": self.bits, "bucket_size": self.bucket_size, "level_version": 0}

    def shard_unit(self, shape) -> int:
        """A bucket (its step is the bucket's own, or the one model-wide step: either way
        whole buckets keep their step when cut, hvdcomp.exchange.shards)."""
        return self.bucket_size

    def message_bytes(self, shape) -> Optional[int]:
        """Payload bytes without entropy coding, ``4 * nb + ceil(numel * bits / 8)``; None
        with it (the size depends on the values)."""
        if self.entropy:
            return None
        numel = numel_of(shape)
        return 4 * (-(-numel // self.bucket_size)) + packed_size(numel, self.bits)

    # --- the compressor -----------------------------------------------------------------
    def _encode(self, grad: torch.Tensor, key: TensorKey) -> Message:
        if not grad.is_floating_point():
            raise TypeError(f"uniformef compresses floating-point gradients only, got "
                            f"{grad.dtype}")
        g = grad.detach().reshape(-1).to(torch.float32)
        e = self._residuals.get(key.name)
        if e is not None:
            if tuple(e.shape) != tuple(grad.shape):
                raise ValueError(
                    f"uniformef: the residual stored for {key.name!r} has shape "
                    f"{tuple(e.shape)}, but its gradient has shape {tuple(grad.shape)} "
                    f"(was a checkpoint of another model loaded?)")
            p = g + e.to(g.device).reshape(-1)
        else:
            p = g.clone()
        if not finite(p):                        # p = g + e overflows: residual unchanged
            return self._nonfinite(grad, key)
        n = p.numel()
        delta = self._steps(p, key)
        # q = clamp(floor(p / Delta + 1/2), -M, M), e = p - Delta q (module docstring)
        packed, residual = dithered.uniform_encode(p, delta, self.bits, self.bucket_size)
        self._residuals[key.name] = residual.view(grad.shape)
        codes, flag = write_codes(packed, n, self.bits, self.entropy)
        return self._new_message(grad, key,
                                 (delta.cpu().numpy().astype("<f4").view(np.uint8), codes), flag)

    def _steps(self, p: torch.Tensor, key: TensorKey) -> torch.Tensor:
        """The bucket steps of finite flat float32 ``p`` (module docstring)."""
        if self.step_scope == "bucket":
            return dithered.variance_steps(p, self.bits, self.bucket_size, self.variance_target)
        # The exchange encodes a step's tensors before the next step's first one (both
        # doors' pipelines finish a step, second stage included, before the next begins),
        # so a new TensorKey.step closes the last step exactly once.
        if key.step != self._sums_step:                     # a new step: m from the last one
            self._mean_square = _closed(self._sums, self._mean_square)
            self._sums, self._sums_step = {}, key.step
        norms = bucket_norms(p, self.bucket_size, "l2").cpu().numpy().astype(np.float64)
        if np.all(np.isfinite(norms)):           # a norm beyond float32 does not count
            self._sums[key.name] = (float(np.sum(norms * norms)), p.numel())
        m = self._mean_square.get(_group(key.name))
        if not m:                                # before a first step, or all of it zero
            return dithered.variance_steps(p, self.bits, self.bucket_size, self.variance_target)
        s = min(math.sqrt(12.0 * self.variance_target * m), dithered.max_step(self.bits))
        return dithered.floor_steps(p, self.bits, self.bucket_size, float(np.float32(s)))

    def state_dict(self) -> Dict[str, Any]:
        """``{"residuals": {name: float32 CPU tensor}}`` (copies); with step_scope "model"
        also ``"mean_square"``: ``{group: m}``, the m the next step's step is set from."""
        state = super().state_dict()
        if self.step_scope == "model":           # the step just ended counts
            state["mean_square"] = _closed(self._sums, self._mean_square)
        return state

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Replace the residuals (and with step_scope "model" the mean square) with those of
        ``state``.  ValueError, and nothing changed, for unknown keys, a residual that is not a
        finite float32 tensor or whose shape differs from the one held, or a mean square that
        is not a dict of finite floats >= 0 keyed by "gradients" / "averages".  The "bucket"
        scope ignores a valid mean square (a checkpoint of step_scope "model")."""
        if not isinstance(state, dict):
            raise ValueError(f"{self.name}: state must be a dict, got {type(state).__name__}")
        rest = dict(state)
        m = rest.pop("mean_square", {})
        if not isinstance(m, dict) or set(m) - set(GROUPS):
            raise ValueError(f"{self.name}: mean_square must map 'gradients' / 'averages' to "
                             f"finite floats >= 0, got {m!r}")
        m = {k: settings.real(f"{self.name}: mean_square[{k!r}]", x, 0.0) for k, x in m.items()}
        super().load_state_dict(rest)
        self._mean_square = m if self.step_scope == "model" else {}
        self._sums, self._sums_step = {}, None

    def _decode(self, msg: Message, key: TensorKey, out: torch.Tensor) -> None:
        n = msg.numel
        delta, packed = parse_steps_and_codes(self.name, msg, self.bits, self.bucket_size,
                                              out.device)
        dithered.uniform_decode_add(packed, n, delta, self.bits, self.bucket_size, out)
