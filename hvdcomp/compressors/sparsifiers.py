"""Sparsification: top-k, random-k and Deep Gradient Compression (DGC).

Source: Lin, Han, Mao, Wang, Dally, "Deep Gradient Compression: Reducing the Communication
Bandwidth for Distributed Training", ICLR 2018 (arXiv 1712.01887): Sec. 3.1 (gradient
sparsification with local accumulation, Algorithm 1), Sec. 3.2 (momentum correction: the
per-worker update u = m u + g, v = v + u, send sparse(v); local gradient clipping),
Sec. 3.3 (momentum factor masking; warm-up training), and the system analysis (Sec. 5:
threshold from a 0.1 %-1 % sample, exact re-selection when too many pass).  Random-k and
top-k with error feedback: Stich, Cordonnier, Jaggi, "Sparsified SGD with Memory", NeurIPS
2018 (arXiv 1809.07599).

Common to the three (``n`` = numel, everything float32 unless stated):

* The number of coordinates sent is ``k = max(1, ceil(density * n))`` (the product rounded
  to 6 decimals first, so 0.07 * 100 gives 7), capped at n, and 0 for an empty tensor:
  a tensor smaller than 1 / density still sends one coordinate.  DGC's density follows its
  warm-up schedule (:meth:`DGC.density_at`).
* Selection by magnitude (top-k, DGC) is EXACT top-k of ``|x|`` among the NONZERO
  coordinates, ties broken by the lower index (hvdcomp.ops.sparsify.topk_indices): an
  all-zero tensor, or one with fewer than k nonzeros, sends fewer (possibly 0) coordinates.
* Error feedback (Stich et al., Algorithm 1; DGC's local accumulation): the sender keeps,
  per parameter name (``TensorKey.name``), the part of ``p = g + e`` it did not send:
  ``e <- p - decoded`` (0 at sent coordinates with fp32 values; the rounding error with
  fp16, int8 and int4 values).  Nothing is lost, only delayed:
  ``sum_t decoded_t = sum_t g_t - e_T``.
* Values are sent as float32, float16 (``values="fp16"``: clamped to +-65504 then rounded)
  or quantized to 8 or 4 bits (``values="int8"`` / ``"int4"``: per block of 256 values a
  float32 scale, each value rounded to nearest on a uniform grid of 255 or 15 levels,
  hvdcomp.codecs.sparse_vectors); the rounding error stays in the residual.  The average of
  the ranks' decoded sparse vectors is formed in float32 (duplicate indices across ranks
  add up; ranks decode in rank order).
* NaN policy (docs/design.md): a gradient holding NaN/Inf, or a ``p`` (or DGC ``u``/``v``)
  that overflows float32, is sent as a payload-free NONFINITE message and the state of that
  name stays UNCHANGED.
* One instance per rank (the drop-in optimizer owns one); ``encode`` updates the state, so
  call it once per tensor per step.  ``state_dict()`` holds CPU copies; ``load_state_dict``
  checks names, dtypes (float32), finiteness and shapes against the state held.

Computation (hvdcomp.ops.sparsify; the index section: hvdcomp.ops.rice): per tensor one
``select`` (random-k: ``update``) computes u and v (or p = g + e) and their finiteness,
selects the coordinates and masks them, on kernels/dgc.cu where a kernel backend serves the
tensor's device and in PyTorch otherwise: the same message bytes and the same state, bit
for bit.  State is double-buffered per name: the new u / v / residual go into a spare
buffer that becomes live only if finite, so u and v take twice their size in memory and no
step allocates gradient-sized tensors.  The clipping norm is summed in float64 in a fixed
order by the kernels, in torch's by the reference: the two agree to float64 rounding, so
the float32 factor T / ||g|| is the same except in the rare case of a float64 sum
straddling a float32 rounding boundary.

Wire (hvdcomp.wire.Message; header ``bits`` = value width 32, 16, 8 or 4, bucket size 0
(256, the values per scale, for 8 and 4 bits), level version 0; the index and value
encodings are hvdcomp.codecs.sparse_vectors's):

    topk, dgc:  section 0  indices: Golomb-Rice coded gaps (hvdcomp.codecs.sparse_vectors)
                section 1  values: m float32/float16, little-endian, in index order (8 and
                           4 bits: ceil(m / 256) float32 scales, then the packed codes)
                payload  ~ m * (bits + log2(n / m) + 1.5) / 8 bytes, plus 5 (or 9) bytes
                (8 and 4 bits: plus 4 bytes per 256 values)
    randk:      section 0  values only: k values in the order of the indices
                (ascending), or EMPTY when all k values are zero.  No indices: every
                receiver regenerates them from the sender's key
                (hvdcomp.ops.sparsify.random_indices).
                payload = k * bits / 8 bytes (8 and 4 bits: rounded up, plus 4 bytes
                per 256 values), or 0
    NONFINITE:  no sections.

Whole-message cost: 52 + 8 * (ndim + nsections) header bytes (84 for a matrix with two
sections) plus the payload; e.g. the real gradient of the 300 x 784 first layer of
FC-300-100 at density 0.1 % (236 values, 11.9 bits per index): 1,383 bytes with fp32 values
(680x), 911 with fp16 (1,033x), as measured in tests/codecs/test_sparse_vectors.py.
"""
from __future__ import annotations

import math
from typing import Any, Dict, Optional, Tuple

import numpy as np
import torch

from ..codecs.sparse_vectors import (VALUE_BLOCK, decode_indices, decode_values,
                                     encode_indices, encode_values)
from ..errors import WireFormatError
from ..ops import sparsify
from ..wire import FLAG_NONFINITE, Message
from . import settings
from .base import Compressor, TensorKey, get, register
from .protocols import MomentumCorrection
from .state import load_tensors

__all__ = ["TopK", "RandK", "DGC", "num_selected", "warmup_density"]

_VALUE_BITS = {"fp32": 32, "fp16": 16, "int8": 8, "int4": 4}


def num_selected(density: float, n: int) -> int:
    """``k = max(1, ceil(round(density * n, 6)))`` capped at ``n``; 0 for ``n = 0``."""
    if n <= 0:
        return 0
    return int(min(n, max(1, math.ceil(round(float(density) * n, 6)))))


def warmup_density(step: int, density: float, warmup_epochs: int, steps_per_epoch: int,
                   warmup_steps: int, coeff: float) -> float:
    """DGC's warm-up schedule (Sec. 3.3): in warm-up stage s = 0 .. warmup_epochs - 1 the
    density is ``max(density, coeff ** (s + 1))``, afterwards ``density``.  The stage of a
    step is ``step // steps_per_epoch`` (by epoch), or, with ``warmup_steps`` instead,
    ``step * warmup_epochs // warmup_steps`` (warm-up of warmup_steps steps, in
    warmup_epochs equal stages).  The paper's 75 %, 93.75 %, 98.4375 %, 99.6 % sparsity
    over 4 epochs, then 99.9 %, is density 0.001, warmup_epochs 4, coeff 0.25."""
    if warmup_epochs <= 0 or (steps_per_epoch <= 0 and warmup_steps <= 0):
        return density
    stage = (step // steps_per_epoch if steps_per_epoch > 0
             else step * warmup_epochs // warmup_steps)
    if stage >= warmup_epochs:
        return density
    return max(density, coeff ** (stage + 1))


def _key4(key: TensorKey) -> Tuple[int, int, int, int]:
    return key.seed, key.rank, key.tensor_id, key.step


def _flat(grad: torch.Tensor, what: str) -> torch.Tensor:
    """grad as flat contiguous float32, without a copy when it already is one (read only).
    TypeError for non-floating tensors."""
    if not grad.is_floating_point():
        raise TypeError(f"{what} sparsifies floating-point gradients only, got {grad.dtype}")
    g = grad.detach().reshape(-1)
    if g.dtype != torch.float32:
        g = g.to(torch.float32)
    return g.contiguous()


class _State:
    """One kind of per-name float32 state (residuals, momentum u, accumulation v),
    double-buffered: an encode writes the next value into the name's spare buffer, which
    becomes live only once the encode succeeded (the NaN policy leaves the state unchanged),
    and the previous live tensor becomes the spare.  No step allocates gradient-sized
    tensors after a name's first."""

    def __init__(self, owner: str, kind: str):
        self.owner, self.kind = owner, kind
        self.live: Dict[str, torch.Tensor] = {}
        self._spare: Dict[str, torch.Tensor] = {}

    def old(self, name: str, grad: torch.Tensor) -> Optional[torch.Tensor]:
        """The live tensor of ``name``, flat and contiguous on grad's device, or None.
        ValueError if it is not float32 of grad's shape."""
        t = self.live.get(name)
        if t is None:
            return None
        if tuple(t.shape) != tuple(grad.shape) or t.dtype != torch.float32:
            raise ValueError(f"{self.owner}: the {self.kind} stored for {name!r} has shape "
                             f"{tuple(t.shape)} and dtype {t.dtype}, but its gradient has "
                             f"shape {tuple(grad.shape)} (the state is float32 of the "
                             f"gradient's shape; was a checkpoint of another model loaded?)")
        return t.detach().reshape(-1).to(grad.device).contiguous()

    def spare(self, name: str, n: int, device) -> torch.Tensor:
        """The spare float32 buffer (n,) of ``name``, allocated if missing or unfit."""
        b = self._spare.get(name)
        if (b is None or b.numel() != n or b.device != torch.device(device)
                or b.dtype != torch.float32 or not b.is_contiguous()):
            b = self._spare[name] = torch.empty(n, dtype=torch.float32, device=device)
        return b.view(-1)

    def commit(self, name: str, new: torch.Tensor, shape) -> None:
        """``new`` (the spare, just written) becomes the live state of ``name``; the previous
        live tensor becomes the spare.  At a name's first step a zeroed spare is made now
        (its pages are mapped in this step rather than in the next)."""
        old = self.live.get(name)
        self.live[name] = new.view(shape)
        if old is not None and old.data_ptr() != new.data_ptr() and old.is_contiguous():
            self._spare[name] = old.detach().reshape(-1)
        else:
            self._spare[name] = torch.zeros_like(new)

    def drop(self, name: str) -> None:
        self.live.pop(name, None)

    def copy(self, name: str) -> Optional[torch.Tensor]:
        """A copy of the live tensor of ``name`` (its gradient's shape), or None."""
        t = self.live.get(name)
        return None if t is None else t.detach().clone()

    def state_dict(self) -> Dict[str, torch.Tensor]:
        return {k: t.detach().cpu().clone() for k, t in self.live.items()}

    def validated(self, tensors: Any) -> Dict[str, torch.Tensor]:
        """``tensors`` checked against the live state (hvdcomp.compressors.state)."""
        return load_tensors(self.owner, self.kind, tensors, self.live)

    def replace(self, tensors: Dict[str, torch.Tensor]) -> None:
        self.live, self._spare = tensors, {}


def _check_state_keys(owner: str, state: Any, keys) -> None:
    if not isinstance(state, dict):
        raise ValueError(f"{owner}: state must be a dict, got {type(state).__name__}")
    extra = sorted(set(state) - set(keys))
    if extra:
        raise ValueError(f"{owner}: unknown state keys {extra}; expected "
                         f"{' and '.join(repr(k) for k in keys)}")


# --- the compressors --------------------------------------------------------------------------

class _Sparse(Compressor):
    """What top-k, random-k and DGC share: the value width, the header, the messages of
    indices and values, the receiver."""

    @property
    def value_bits(self) -> int:
        return _VALUE_BITS[self.values]

    def _header_fields(self) -> Dict[str, int]:
        bits = self.value_bits
        return {"bits": bits, "bucket_size": VALUE_BLOCK if bits < 16 else 0,
                "level_version": 0}

    def shard_unit(self, shape) -> int:
        """Any cut will do (one element): each piece of the reduce-scatter selects
        ``density`` of its own elements."""
        return 1

    def encode(self, grad, key):
        # The finiteness check is part of the state update (ops.sparsify: one pass over g,
        # the state and their sum), so the base class's separate pass over g is skipped.
        return self._encode(grad, key)

    def _send(self, grad, key, n: int, idx: torch.Tensor, vals: torch.Tensor
              ) -> Tuple[Message, torch.Tensor]:
        """The message of indices ``idx`` and values ``vals`` of an n-element gradient, and
        the values the receivers will decode."""
        vsec, dec = encode_values(vals, self.value_bits)
        isec = encode_indices(idx.cpu(), n)
        return self._new_message(grad, key, (isec, vsec)), dec

    def _decode(self, msg: Message, key: TensorKey, out: torch.Tensor) -> None:
        if msg.flags & ~FLAG_NONFINITE:
            raise WireFormatError(f"{self.name}: unexpected flags 0x{msg.flags:02x}")
        idx, vals = self.decode_sparse(msg)
        _scatter_add(out, torch.from_numpy(idx), vals, 1.0)

    def decode_sparse(self, msg: Message) -> Tuple[np.ndarray, torch.Tensor]:
        """(indices int64, float32 values) of a validated top-k / DGC message."""
        msg.expect(nsections=2)
        idx = decode_indices(msg.sections[0], msg.numel)
        return idx, decode_values(msg.sections[1], idx.size, self.value_bits)


def _scatter_add(out: torch.Tensor, idx: torch.Tensor, vals: torch.Tensor, s: float) -> None:
    """out[idx] += vals * s for one message's distinct indices (ops.sparsify.scatter_add)."""
    if idx.numel():
        sparsify.scatter_add(idx.to(out.device), vals.to(out.device), out, s)


class _Residuals(_Sparse):
    """Per-name error-feedback residuals (top-k, random-k)."""

    @property
    def keeps_state(self) -> bool:
        """The residuals are state (with error feedback)."""
        return self.error_feedback

    def _init_state(self):
        self._residuals = _State(self.name, "residual")

    def _p(self, grad, key):
        """(g, e, p_out): the gradient as flat float32, the residual (None without error
        feedback or before the first step) and the buffer that receives p = g + e (None
        without error feedback: p is g itself)."""
        g = _flat(grad, self.name)
        if not self.error_feedback:
            return g, None, None
        return (g, self._residuals.old(key.name, grad),
                self._residuals.spare(key.name, g.numel(), g.device))

    def _keep(self, grad, key, p_out, idx, dec, masked: bool) -> None:
        """``e <- p - decoded``: p[idx] -= dec (unless ``masked``: already done), then p
        becomes the residual."""
        if p_out is None:
            return
        if not masked:
            sparsify.mask(idx, v=p_out, dec=dec)
        self._residuals.commit(key.name, p_out, grad.shape)

    def residual(self, name: str) -> Optional[torch.Tensor]:
        """A copy of the residual of parameter ``name`` (float32, its gradient's shape), or
        None before its first finite encode (or without error feedback)."""
        return self._residuals.copy(name)

    def state_dict(self) -> Dict[str, Any]:
        """``{"residuals": {name: float32 CPU tensor}}`` (copies)."""
        return {"residuals": self._residuals.state_dict()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Replace all residuals with those of ``state`` (as ``state_dict`` makes them).
        Raises ValueError, changing nothing, for unknown keys, non-float32 or non-finite
        tensors, or a shape that differs from the residual held for that name."""
        _check_state_keys(self.name, state, ("residuals",))
        self._residuals.replace(self._residuals.validated(state.get("residuals", {})))


@register("topk", codec=22)
class TopK(_Residuals):
    """Top-k sparsification with error feedback (Stich et al., NeurIPS 2018, Algorithm 1 with
    top_k; the sparsification step of Lin et al., ICLR 2018, Sec. 3.1 without DGC's extras).

    Per tensor: ``p = g + e``; send the exact top-k of |p| among nonzero coordinates (ties:
    lower index), ``k = max(1, ceil(density * n))``; ``e <- p - decoded``.

    Args:
      density: fraction of coordinates sent, in (0, 1] (default 0.001).
      values: "fp32" (default), "fp16", "int8" or "int4" (8 or 4 bits a
        value, the nearest of 255 / 15 levels between -s and s, s the largest
        magnitude of its block of 256; with error feedback the rounding error
        stays in e).
      error_feedback: keep the residual e per parameter name (default True); False sends
        the top-k of g and drops the rest.
    Raises ValueError for invalid settings.

    encode(grad, key): any shape, float16/bfloat16/float32/float64 (sparsified from its
      float32 values); returns a 2-section Message of about ``m (bits + log2(n/m) + 1.5) / 8
      + 5`` payload bytes (m <= k selected).  TypeError for non-floating tensors;
      ValueError if the stored residual has another shape.  NaN/Inf: NONFINITE, e unchanged.
    decode(msg, key, out): ``out[idx] += values``; WireFormatError for malformed sections.

    Example::

        c = hvdcomp.get("topk:density=0.01,values=fp16")
        msg = c.encode(grad, hvdcomp.TensorKey("fc.weight", 0, step, rank, size))
    """
    example = "topk:density=0.05"
    biased = True

    def __init__(self, density: float = 0.001, values: str = "fp32",
                 error_feedback: bool = True):
        self.density = settings.real("density", density, 0.0, 1.0, lo_open=True)
        self.values = settings.choice("values", values, _VALUE_BITS)
        self.error_feedback = settings.boolean("error_feedback", error_feedback)
        self._init_state()

    def _encode(self, grad, key):
        g, e, p_out = self._p(grad, key)
        n = g.numel()
        fp32 = self.value_bits == 32
        sel = sparsify.select(g, num_selected(self.density, n), v_old=e, v_out=p_out,
                              key4=_key4(key), mask_x=fp32 and p_out is not None)
        if sel.nonfinite:
            return self._nonfinite(grad, key)                  # residual unchanged
        msg, dec = self._send(grad, key, n, sel.idx, sel.vals)
        self._keep(grad, key, p_out, sel.idx, dec, masked=fp32)
        return msg


@register("randk", codec=23)
class RandK(_Residuals):
    """Random-k sparsification with error feedback (Stich et al., NeurIPS 2018,
    Algorithm 1 with rand_k).  The k indices come from Philox keyed by the TensorKey
    (hvdcomp.ops.sparsify.random_indices), so only the values travel: every receiver regenerates the
    sender's indices from the message header's seed, rank, tensor id and step.

    Per tensor: ``p = g + e``; ``idx = random_indices(n, k, key)``; send p[idx];
    decoded = value * s with ``s = float32(n / k)`` if ``unbiased`` else 1 (then
    E[decoded] = p: unbiased, variance (n/k - 1) |p|^2 per tensor);  ``e <- p - decoded``.

    Args:
      density: fraction of coordinates sent, in (0, 1] (default 0.01).
      values: "fp32" (default), "fp16", "int8" or "int4" (8 or 4 bits a
        value, the nearest of 255 / 15 levels between -s and s, s the largest
        magnitude of its block of 256).
      error_feedback: keep the residual per parameter name (default True).
      unbiased: scale by n / k on decoding (default False).  With error feedback the
        residual then absorbs the scaling error too (it can be large: (n/k - 1) p).
    Raises ValueError for invalid settings.

    encode: as topk; the Message has one section of ``k * bits / 8`` bytes (8 and 4 bits:
      plus a float32 scale per 256 values), or 0 bytes when all k values are zero (an
      all-zero gradient sends a header-only message).
    decode: WireFormatError if the section is neither k values nor empty.
    """
    example = "randk:density=0.05"

    def __init__(self, density: float = 0.01, values: str = "fp32",
                 error_feedback: bool = True, unbiased: bool = False):
        self.density = settings.real("density", density, 0.0, 1.0, lo_open=True)
        self.values = settings.choice("values", values, _VALUE_BITS)
        self.error_feedback = settings.boolean("error_feedback", error_feedback)
        self.unbiased = settings.boolean("unbiased", unbiased)
        self._init_state()

    @property
    def biased(self) -> bool:
        """Biased unless scaled by n / k on decoding (Declarations.biased)."""
        return not self.unbiased

    def scale(self, n: int) -> float:
        """The float32 factor applied on decoding: n / k if unbiased, else 1."""
        k = num_selected(self.density, n)
        return float(np.float32(n / k)) if self.unbiased and k else 1.0

    def _encode(self, grad, key):
        g, e, p_out = self._p(grad, key)
        if not sparsify.update(g, v_old=e, v_out=p_out):
            return self._nonfinite(grad, key)                  # residual unchanged
        p = g if p_out is None else p_out
        n = p.numel()
        idx = sparsify.random_indices(n, num_selected(self.density, n), _key4(key),
                                      device=p.device)
        vsec, dec = encode_values(p[idx], self.value_bits)
        if not bool((dec != 0).any()):
            vsec = np.zeros(0, dtype=np.uint8)                # all zero: header-only message
        s = self.scale(n)
        if s != 1.0:
            dec = dec * torch.tensor(s, dtype=torch.float32, device=dec.device)
        msg = self._new_message(grad, key, (vsec,))
        self._keep(grad, key, p_out, idx, dec, masked=False)
        return msg

    def _decode(self, msg, key, out):
        if msg.flags & ~FLAG_NONFINITE:
            raise WireFormatError(f"randk: unexpected flags 0x{msg.flags:02x}")
        msg.expect(nsections=1)
        n = msg.numel
        k = num_selected(self.density, n)
        if len(msg.sections[0]) == 0:
            return                                             # all k values were zero
        vals = decode_values(msg.sections[0], k, self.value_bits)
        _scatter_add(out, sparsify.random_indices(n, k, _key4(key)), vals, self.scale(n))


@register("dgc", codec=21)
class DGC(MomentumCorrection, _Sparse):
    """Deep Gradient Compression (Lin et al., ICLR 2018, arXiv 1712.01887), its four
    techniques each switchable.  Per tensor of a rank, with ``m`` its momentum factor
    (given by the drop-in optimizer through :meth:`set_momentum`), state ``u`` (momentum)
    and ``v`` (accumulation), N = world size:

      1. clipping (Sec. 3.2, "local gradient clipping"), if ``clip_norm > 0``:
         ``g <- g * float32(T / ||g||_2)`` when ``||g||_2 > T = clip_norm / sqrt(N)``
         (per tensor; the norm in float64);
      2. momentum correction (Sec. 3.2), if on and m > 0:
         ``u <- m u + g;  v <- v + u``;  otherwise ``v <- v + g`` (local accumulation,
         Algorithm 1; with ``accumulate=False``: v is just u or g);
      3. sparsify (Sec. 3.1; sampling, Sec. 5): k from the density of this
         step (warm-up, Sec. 3.3); threshold t = the k_s-th largest |v| of a Philox sample
         of s = ceil(sample_ratio n) positions, k_s = ceil(s k / n); candidates |v| >= t;
         if more than k pass, exact top-k among them (hierarchical re-selection).  With
         ``exact_k`` (default), too few passing lowers t to the sample's 2 k_s-th,
         4 k_s-th ... value, then falls back to an exact top-k: the selection is then
         exactly hvdcomp.ops.sparsify.topk_indices (|v|, k), sampling only makes it cheap;
      4. send v[idx]; ``v[idx] <- v[idx] - decoded`` (0 for fp32 values);  momentum factor
         masking (Sec. 3.3), if on: ``u[idx] <- 0``.
    Warm-up (Sec. 3.3): :func:`warmup_density`.  With masking, its dense stages clear the
    momentum of most coordinates at every step (at density 1 DGC is SGD without
    momentum), so they train slower than momentum SGD: on a 3-epoch task this cost about a
    point of final accuracy (bench/results/real_task.md); ``masking=False`` avoids it.

    The optimizer's own momentum must not apply to these tensors: with SGD, the drop-in
    optimizer (``handles_momentum``) keeps their gradients from the wrapped SGD, hands
    DGC each group's momentum, folds the group's weight decay into the local gradient
    before encoding (``g + wd * p``, as the reference code does) and applies the averaged
    sparse vectors as plain SGD steps (``p -= lr * average``); the param groups stay as
    they are.

    Args:
      density: final fraction of coordinates sent, in (0, 1] (default 0.001, the paper's).
      values: "fp32" (default), "fp16", "int8" or "int4" (8 or 4 bits a
        value, the nearest of 255 / 15 levels between -s and s, s the largest
        magnitude of its block of 256; with accumulation the rounding error
        stays in v).
      sample_ratio: fraction of coordinates sampled for the threshold, in [0, 1] (paper:
        0.001-0.01; default 0.01); 0: exact top-k without sampling.
      exact_k: guarantee exactly min(k, nonzeros) coordinates (default True); False: one
        sampled threshold as in the paper (fewer than k may be sent).
      accumulate: local accumulation of what was not sent (default True).
      momentum_correction: apply momentum here, Sec. 3.2 (default True); False leaves the
        momentum to the wrapped optimizer (vanilla momentum on the averaged gradient).
      masking: momentum factor masking, Sec. 3.3 (default True).
      momentum: factor for names not given through set_momentum (default 0.0; the drop-in
        optimizer gives every compressed tensor its SGD momentum).
      clip_norm: local gradient clipping threshold before the N^-1/2 scaling (0 = off).
      warmup_epochs, steps_per_epoch, warmup_steps, warmup_coeff: the warm-up schedule
        (:func:`warmup_density`; default off; paper: warmup_epochs=4, coeff 0.25).
    Raises ValueError for invalid settings (both steps_per_epoch and warmup_steps, or
    warm-up epochs without either).

    encode(grad, key): any shape, float16/bfloat16/float32/float64; returns a 2-section
      Message as topk's (about m (bits + log2(n/m) + 1.5) / 8 + 5 payload bytes).
      TypeError for non-floating tensors, ValueError for state of another shape.
      NaN/Inf in g (or overflow of u, v): NONFINITE, state unchanged.
    decode(msg, key, out): ``out[idx] += values``; WireFormatError for malformed sections.

    Example::

        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1,
                                                       momentum=0.9),
                                       named_parameters=model.named_parameters(),
                                       compression="dgc:density=0.001,clip_norm=5,"
                                                   "warmup_epochs=4,steps_per_epoch=390")
    """
    example = "dgc:density=0.05"
    keeps_state = True          # u, v and the warm-up's step
    biased = True

    def __init__(self, density: float = 0.001, values: str = "fp32",
                 sample_ratio: float = 0.01, exact_k: bool = True, accumulate: bool = True,
                 momentum_correction: bool = True, masking: bool = True,
                 momentum: float = 0.0, clip_norm: float = 0.0, warmup_epochs: int = 0,
                 steps_per_epoch: int = 0, warmup_steps: int = 0, warmup_coeff: float = 0.25):
        self.density = settings.real("density", density, 0.0, 1.0, lo_open=True)
        self.values = settings.choice("values", values, _VALUE_BITS)
        self.sample_ratio = settings.real("sample_ratio", sample_ratio, 0.0, 1.0)
        self.exact_k = settings.boolean("exact_k", exact_k)
        self.accumulate = settings.boolean("accumulate", accumulate)
        self.momentum_correction = settings.boolean("momentum_correction",
                                                    momentum_correction)
        self.masking = settings.boolean("masking", masking)
        self.momentum = settings.real("momentum", momentum, 0.0, 1.0, hi_open=True)
        self.clip_norm = settings.real("clip_norm", clip_norm, 0.0)
        self.warmup_epochs = settings.integer("warmup_epochs", warmup_epochs, 0)
        self.steps_per_epoch = settings.integer("steps_per_epoch", steps_per_epoch, 0)
        self.warmup_steps = settings.integer("warmup_steps", warmup_steps, 0)
        self.warmup_coeff = settings.real("warmup_coeff", warmup_coeff, 0.0, 1.0,
                                          lo_open=True, hi_open=True)
        if self.steps_per_epoch and self.warmup_steps:
            raise ValueError("give the warm-up by epoch (steps_per_epoch) or by step "
                             "(warmup_steps), not both")
        if self.warmup_epochs and not (self.steps_per_epoch or self.warmup_steps):
            raise ValueError("warmup_epochs needs steps_per_epoch (stage = one epoch) or "
                             "warmup_steps (the whole warm-up length in steps)")
        # the drop-in optimizer reads this: momentum stays with it if correction is off
        self.handles_momentum = self.momentum_correction
        self._factors: Dict[str, float] = {}
        self._u = _State("dgc", "momentum u")
        self._v = _State("dgc", "accumulation v")

    def second_stage(self) -> Compressor:
        """The reduce-scatter's re-encoder of averages: momentum correction, masking and
        clipping act on a rank's raw gradient only, so a separate instance without them:
        top-k of the average with its residual (error feedback), at the same density
        schedule."""
        return get(self.spec(), momentum_correction=False, masking=False, momentum=0.0,
                   clip_norm=0.0)

    def steady_state(self) -> Compressor:
        """Without the warm-up (a new instance at ``density`` from its first step; this one
        where ``warmup_epochs`` is 0)."""
        return get(self.spec(), warmup_epochs=0) if self.warmup_epochs else self

    # --- schedule and momentum --------------------------------------------------------
    def density_at(self, step: int) -> float:
        """The density used at optimizer step ``step`` (warm-up, Sec. 3.3)."""
        return warmup_density(step, self.density, self.warmup_epochs, self.steps_per_epoch,
                              self.warmup_steps, self.warmup_coeff)

    def set_momentum(self, factors: Dict[str, float]) -> None:
        """Momentum factors by parameter name (the drop-in optimizer's SGD momentum of each
        compressed tensor).  Raises ValueError for factors outside [0, 1)."""
        checked = {n: settings.real(f"momentum of {n!r}", m, 0.0, 1.0, hi_open=True)
                   for n, m in factors.items()}
        self._factors.update(checked)

    def momentum_of(self, name: str) -> float:
        """The momentum factor applied to parameter ``name``."""
        return self._factors.get(name, self.momentum)

    # --- selection --------------------------------------------------------------------
    def sample_size(self, n: int) -> int:
        """Coordinates sampled for the threshold of an n-element tensor:
        ``min(n, max(1, ceil(sample_ratio n)))``, 0 when sample_ratio is 0 (exact top-k)."""
        if self.sample_ratio == 0.0:
            return 0
        return min(n, max(1, math.ceil(self.sample_ratio * n)))

    def select(self, mag: torch.Tensor, k: int, key: TensorKey) -> torch.Tensor:
        """Indices (int64, ascending) that DGC sends for magnitudes ``mag`` (flat, >= 0):
        sampled threshold, hierarchical re-selection (class docstring, step 3;
        hvdcomp.ops.sparsify.threshold_select)."""
        return sparsify.threshold_select(mag, k, self.sample_size(mag.numel()), _key4(key),
                                         self.exact_k)

    def clip_scale(self, g: torch.Tensor, world_size: int) -> Optional[float]:
        """Local gradient clipping (Sec. 3.2) of flat float32 ``g``: the float32 factor
        ``T / ||g||_2`` when ``||g||_2 > T = clip_norm / sqrt(N)``, else None (also when
        clipping is off)."""
        if self.clip_norm <= 0:
            return None
        norm = math.sqrt(sparsify.sumsq(g))
        thr = self.clip_norm / math.sqrt(world_size)
        return float(np.float32(thr / norm)) if norm > thr else None

    # --- the compressor ---------------------------------------------------------------
    def _encode(self, grad, key):
        name = key.name
        g = _flat(grad, "dgc")
        n, dev = g.numel(), g.device
        u_old, v_old = self._u.old(name, grad), self._v.old(name, grad)
        m = self.momentum_of(name) if self.momentum_correction else 0.0
        mom = m > 0
        u_out = self._u.spare(name, n, dev) if mom else None
        v_out = self._v.spare(name, n, dev) if self.accumulate else None
        fp32 = self.value_bits == 32
        sel = sparsify.select(g, num_selected(self.density_at(key.step), n),
                              u_old=u_old if mom else None,
                              v_old=v_old if self.accumulate else None,
                              u_out=u_out, v_out=v_out, scale=self.clip_scale(g, key.world_size),
                              momentum=m, sample_size=self.sample_size(n), key4=_key4(key),
                              exact=self.exact_k, mask_x=fp32 and self.accumulate,
                              mask_u=mom and self.masking)
        if sel.nonfinite:
            return self._nonfinite(grad, key)                  # state unchanged
        msg, dec = self._send(grad, key, n, sel.idx, sel.vals)
        if self.accumulate:                                    # v[idx] -= decoded
            if not fp32:
                sparsify.mask(sel.idx, v=v_out, dec=dec)
            self._v.commit(name, v_out, grad.shape)
        if mom:
            self._u.commit(name, u_out, grad.shape)
        else:
            self._u.drop(name)
        return msg

    # --- state --------------------------------------------------------------------------
    def momentum_buffer(self, name: str) -> Optional[torch.Tensor]:
        """A copy of u for ``name`` (float32, its gradient's shape), or None."""
        return self._u.copy(name)

    def accumulation(self, name: str) -> Optional[torch.Tensor]:
        """A copy of v for ``name`` (float32, its gradient's shape), or None."""
        return self._v.copy(name)

    def state_dict(self) -> Dict[str, Any]:
        """``{"u": {name: float32 CPU tensor}, "v": {...}}`` (copies)."""
        return {"u": self._u.state_dict(), "v": self._v.state_dict()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Replace u and v with those of ``state``.  Raises ValueError, changing nothing,
        for unknown keys, non-float32 or non-finite tensors, or shapes that differ from
        the state held (or between u and v of one name)."""
        _check_state_keys("dgc", state, ("u", "v"))
        u = self._u.validated(state.get("u", {}))
        v = self._v.validated(state.get("v", {}))
        for name in set(u) & set(v):
            if u[name].shape != v[name].shape:
                raise ValueError(f"dgc: u and v of {name!r} differ in shape: "
                                 f"{tuple(u[name].shape)} vs {tuple(v[name].shape)}")
        self._u.replace(u)
        self._v.replace(v)
