"""Sparsification: top-k, random-k and Deep Gradient Compression (DGC).

Source: Lin, Han, Mao, Wang, Dally, "Deep Gradient Compression: Reducing the Communication
Bandwidth for Distributed Training", ICLR 2018 (arXiv 1712.01887): Sec. 3.1 (gradient
sparsification with local accumulation, Algorithm 1), Sec. 3.2 (momentum correction: the
per-worker update u = m u + g, v = v + u, send sparse(v); local gradient clipping),
Sec. 3.3 (momentum factor masking; warm-up training), and the system analysis (Sec. 5:
threshold from a 0.1 %-1 % sample, exact re-selection when too many pass).  Summary:
../shared/docs/seeds.md, section 3.  Random-k and top-k with error feedback: Stich,
Cordonnier, Jaggi, "Sparsified SGD with Memory", NeurIPS 2018 (arXiv 1809.07599).

Common to the three (``n`` = numel, everything float32 unless stated):

* The number of coordinates sent is ``k = max(1, ceil(density * n))`` (the product rounded
  to 6 decimals first, so 0.07 * 100 gives 7), capped at n, and 0 for an empty tensor:
  a tensor smaller than 1 / density still sends one coordinate.  DGC's density follows its
  warm-up schedule (:meth:`DGC.density_at`).
* Selection by magnitude (top-k, DGC) is EXACT top-k of ``|x|`` among the NONZERO
  coordinates, ties broken by the lower index (:func:`topk_indices`): an all-zero tensor,
  or one with fewer than k nonzeros, sends fewer (possibly 0) coordinates.
* Error feedback (Stich et al., Algorithm 1; DGC's local accumulation): the sender keeps,
  per parameter name (``TensorKey.name``), the part of ``p = g + e`` it did not send:
  ``e <- p - decoded`` (0 at sent coordinates with fp32 values; the float16 rounding error
  with fp16 values).  Nothing is lost, only delayed: ``sum_t decoded_t = sum_t g_t - e_T``.
* Values are sent as float32 or float16 (``values="fp16"``: clamped to +-65504 then rounded;
  the difference stays in the residual).  The average of the ranks' decoded sparse vectors
  is formed in float32 (duplicate indices across ranks add up; ranks decode in rank order).
* NaN policy (docs/design.md): a gradient holding NaN/Inf, or a ``p`` (or DGC ``u``/``v``)
  that overflows float32, is sent as a payload-free NONFINITE message and the state of that
  name stays UNCHANGED.
* One instance per rank (the drop-in optimizer owns one); ``encode`` updates the state, so
  call it once per tensor per step.  ``state_dict()`` holds CPU copies; ``load_state_dict``
  checks names, dtypes (float32), finiteness and shapes against the state held.

Kernel path (kernels/dgc.cu through hvdcomp/backends/k_dgc.py, used wherever
``hvdcomp.backends.kernel_backend`` gives a backend; the code below stays the
specification): the same message bytes and the same state, bit for bit.  Per tensor: one
pass computes u, v (or p = g + e), their finiteness and the number of candidates above two
thresholds taken from the reference's Philox sample (gathered from the inputs first); one
pass writes the candidates in index order (per-chunk counts, prefix sum, each chunk writing
its own outputs) and masks them when they are final; the exact top-k among the few
candidates and the masking of the rest follow.  State is double-buffered per name (the new
u / v / residual go into a spare buffer that becomes live only if finite), so u and v take
twice their size in memory and no step allocates gradient-sized tensors.  The clipping norm
is summed in float64 in a fixed order (kernels/dgc.cu), torch's order in the reference:
the two agree to float64 rounding, so the float32 factor T / ||g|| is the same except in
the rare case of a float64 sum straddling a float32 rounding boundary.

Wire (hvdcomp.wire.Message; header ``bits`` = value width 32 or 16, bucket size 0, level
version 0; the index and value encodings are hvdcomp.codecs.sparse's):

    topk, dgc:  section 0  indices: Golomb-Rice coded gaps (hvdcomp.codecs.sparse)
                section 1  values: m float32/float16, little-endian, in index order
                payload  ~ m * (bits + log2(n / m) + 1.5) / 8 bytes, plus 5 (or 9) bytes
    randk:      section 0  values only: k float32/float16 in the order of the indices
                (ascending), or EMPTY when all k values are zero.  No indices: every
                receiver regenerates them from the sender's key (:func:`random_indices`).
                payload = k * bits / 8 bytes (or 0)
    NONFINITE:  no sections.

Whole-message cost: 52 + 8 * (ndim + nsections) header bytes (84 for a matrix with two
sections) plus the payload; e.g. the real gradient of the 300 x 784 first layer of
FC-300-100 at density 0.1 % (236 values, 11.9 bits per index): 1,383 bytes with fp32 values
(680x), 911 with fp16 (1,033x), as measured in tests/unit/test_sparse_codec.py.
"""
from __future__ import annotations

import math
from typing import Any, Dict, Optional, Tuple

import numpy as np
import torch

from ..backends import k_dgc, kernel_backend
from .protocols import MomentumCorrection
from ..codecs.sparse import decode_indices, decode_values, encode_indices, encode_values
from ..errors import WireFormatError
from ..random import random_words
from ..wire import CODECS, FLAG_NONFINITE, Message, dtype_code
from .base import Compressor, TensorKey, register
from .state import finite as _finite, load_tensors as _load_tensors

__all__ = ["TopK", "RandK", "DGC", "num_selected", "topk_indices", "random_indices",
           "sample_positions", "warmup_density"]

_VALUE_BITS = {"fp32": 32, "fp16": 16}


# --- pure functions (the specification; the tests reimplement them independently) ----------

def num_selected(density: float, n: int) -> int:
    """``k = max(1, ceil(round(density * n, 6)))`` capped at ``n``; 0 for ``n = 0``."""
    if n <= 0:
        return 0
    return int(min(n, max(1, math.ceil(round(float(density) * n, 6)))))


def topk_indices(mag: torch.Tensor, k: int) -> torch.Tensor:
    """Exact top-k of a flat non-negative float tensor among its NONZERO entries, ties broken
    by the lower index.  Returns the selected indices, int64, ascending, on mag's device
    (min(k, number of nonzeros) of them)."""
    n = mag.numel()
    if k <= 0 or n == 0:
        return torch.zeros(0, dtype=torch.int64, device=mag.device)
    if k >= n:
        return torch.nonzero(mag > 0).reshape(-1)
    t = torch.topk(mag, k, sorted=False).values.min()        # the k-th largest magnitude
    if not bool(t > 0):                                       # fewer than k nonzeros
        return torch.nonzero(mag > 0).reshape(-1)
    above = torch.nonzero(mag > t).reshape(-1)
    at = torch.nonzero(mag == t).reshape(-1)[:k - above.numel()]   # ties: lowest indices
    return torch.sort(torch.cat([above, at])).values


def _u63(n_draws: int, key: TensorKey, offset: int, device) -> torch.Tensor:
    """``n_draws`` non-negative 63-bit integers from Philox words ``offset + 2j, 2j + 1``."""
    w = random_words(2 * n_draws, seed=key.seed, step=key.step, rank=key.rank,
                     tensor_id=key.tensor_id, offset=offset, device=device).view(-1, 2)
    return ((w[:, 0] >> 1) << 32) | w[:, 1]


def sample_positions(s: int, n: int, key: TensorKey, device=None) -> torch.Tensor:
    """DGC's random sample: ``s`` positions in [0, n) (with replacement), position j being
    ``u63_j mod n`` with u63_j built from the Philox words 2j and 2j+1 of the key
    (``((w_2j >> 1) << 32) | w_2j+1``).  The modulo bias is below n / 2**63."""
    if s <= 0 or n <= 0:
        return torch.zeros(0, dtype=torch.int64, device=device)
    return _u63(s, key, 0, device) % n


def random_indices(n: int, k: int, key: TensorKey, device=None) -> torch.Tensor:
    """Random-k: ``k`` distinct indices in [0, n), int64 ascending, a function of the
    TensorKey (seed, rank, tensor id, step) alone, so every receiver regenerates the sender's.

    * ``k >= n``: all indices.
    * ``4 k <= n``: the first k DISTINCT values of the stream ``u63_j mod n`` (j = 0, 1, ...;
      u63 as in :func:`sample_positions`): a uniformly random k-subset.  Drawn in batches;
      the result does not depend on the batch size.
    * otherwise: the k indices with the smallest Philox word (word i for index i), ties by
      the lower index: also a uniformly random k-subset (up to the ties' negligible bias),
      at the cost of n words instead of about k.
    """
    if k >= n:
        return torch.arange(max(n, 0), dtype=torch.int64, device=device)
    if k <= 0:
        return torch.zeros(0, dtype=torch.int64, device=device)
    if 4 * k > n:
        w = random_words(n, seed=key.seed, step=key.step, rank=key.rank,
                         tensor_id=key.tensor_id, device=device)
        order = torch.sort(w, stable=True).indices           # stable: ties by lower index
        return torch.sort(order[:k]).values
    draws = torch.zeros(0, dtype=torch.int64, device=device)
    batch = k + k // 4 + 32
    while True:
        more = _u63(batch, key, 2 * draws.numel(), device) % n
        draws = torch.cat([draws, more])
        uniq, inv = torch.unique(draws, return_inverse=True)
        if uniq.numel() >= k:
            first = torch.full((uniq.numel(),), draws.numel(), dtype=torch.int64,
                               device=device)
            first.scatter_reduce_(0, inv, torch.arange(draws.numel(), device=device),
                                  reduce="amin")
            pick = torch.sort(first).indices[:k]             # earliest first occurrences
            return torch.sort(uniq[pick]).values
        batch = 2 * (k - uniq.numel()) + 32


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


# --- validation helpers ------------------------------------------------------------------------

def _check_density(name: str, v) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < float(v) <= 1:
        raise ValueError(f"{name} must be a number in (0, 1], got {v!r}")
    return float(v)


def _check_values(v) -> str:
    if v not in _VALUE_BITS:
        raise ValueError(f"values must be 'fp32' or 'fp16', got {v!r}")
    return v


def _check_bool(name: str, v) -> bool:
    if not isinstance(v, (bool, np.bool_)):
        raise ValueError(f"{name} must be a bool, got {v!r}")
    return bool(v)


def _check_int(name: str, v, lo: int = 0) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo:
        raise ValueError(f"{name} must be an integer >= {lo}, got {v!r}")
    return int(v)


def _check_float(name: str, v, lo: float, hi: float, lo_open=False, hi_open=False) -> float:
    ok = (not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)
          and (v > lo if lo_open else v >= lo) and (v < hi if hi_open else v <= hi))
    if not ok:
        raise ValueError(f"{name} must be a finite number in {'(' if lo_open else '['}{lo}, "
                         f"{hi}{')' if hi_open else ']'}, got {v!r}")
    return float(v)


def _flat_f32(grad: torch.Tensor, what: str) -> torch.Tensor:
    if not grad.is_floating_point():
        raise TypeError(f"{what} sparsifies floating-point gradients only, got {grad.dtype}")
    return grad.detach().reshape(-1).to(torch.float32, copy=True)


def _check_state(owner: str, kind: str, t: Optional[torch.Tensor], grad: torch.Tensor,
                 name: str) -> None:
    if t is not None and (tuple(t.shape) != tuple(grad.shape) or t.dtype != torch.float32):
        raise ValueError(f"{owner}: the {kind} stored for {name!r} has shape "
                         f"{tuple(t.shape)} and dtype {t.dtype}, but its gradient has shape "
                         f"{tuple(grad.shape)} (the state is float32 of the gradient's "
                         f"shape; was a checkpoint of another model loaded?)")


# --- the kernel path (kernels/dgc.cu, hvdcomp/backends/k_dgc.py) ------------------------------
#
# Same bytes and state as the reference code of each compressor (which stays the
# specification and runs where kernel_backend() gives None).  The state is double-buffered
# per name: the kernels write the new u / v (or residual) into a spare buffer and the two
# swap only once the new values are known to be finite (the NaN policy leaves the state
# unchanged), so no step allocates (or page-faults) a tensor of the gradient's size.

_INTERNAL_SAMPLE = 0.01      # sample ratio for the thresholds of EXACT top-k selections


def _kernel_grad(grad: torch.Tensor):
    """The kernel backend for ``grad``, or None (reference path): floating, non-empty."""
    if not grad.is_floating_point() or grad.numel() == 0:
        return None
    return kernel_backend(grad.device)


def _flat_view(grad: torch.Tensor) -> torch.Tensor:
    """grad as flat contiguous float32, without a copy when it already is one (read only)."""
    g = grad.detach().reshape(-1)
    if g.dtype != torch.float32:
        g = g.to(torch.float32)
    return g.contiguous()


def _flat_state(t: Optional[torch.Tensor], device) -> Optional[torch.Tensor]:
    if t is None:
        return None
    return t.detach().reshape(-1).to(device).contiguous()


def _spare(store: Dict[str, torch.Tensor], name: str, n: int, device) -> torch.Tensor:
    """The spare float32 buffer of ``name`` (n,), allocated if missing or unfit."""
    b = store.get(name)
    if (b is None or b.numel() != n or b.device != device or b.dtype != torch.float32
            or not b.is_contiguous()):
        b = torch.empty(n, dtype=torch.float32, device=device)
        store[name] = b
    return b.view(-1)


def _retire(store: Dict[str, torch.Tensor], name: str, old: Optional[torch.Tensor],
            new: torch.Tensor) -> None:
    """After ``new`` became the live state of ``name``: the previous live tensor becomes
    the spare; at a name's first step a zeroed spare is made now (its pages are mapped in
    this step rather than in the next)."""
    if old is not None and old.data_ptr() != new.data_ptr():
        store[name] = old.detach().reshape(-1) if old.is_contiguous() else \
            torch.empty_like(new).zero_()
    else:
        store[name] = torch.zeros_like(new)


def _sample_size(ratio: float, n: int) -> int:
    return min(n, max(1, math.ceil(ratio * n)))


# --- the compressors --------------------------------------------------------------------------

class _Sparse(Compressor):
    """Shared wire handling of top-k and DGC (indices + values) and of random-k."""
    values: str = "fp32"

    @property
    def value_bits(self) -> int:
        return _VALUE_BITS[self.values]

    def _header_fields(self) -> Dict[str, int]:
        return {"bits": self.value_bits, "bucket_size": 0, "level_version": 0}

    def _message(self, grad, key, sections) -> Message:
        return Message(codec=self.codec, dtype=dtype_code(grad.dtype), shape=tuple(grad.shape),
                       sections=tuple(sections), tensor_id=key.tensor_id, rank=key.rank,
                       seed=key.seed, step=key.step, **self._header_fields())

    def _send(self, grad, key, x: torch.Tensor, idx: torch.Tensor
              ) -> Tuple[Message, torch.Tensor]:
        """Message for x[idx] (indices + values); returns it with the decoded values."""
        vsec, dec = encode_values(x[idx], self.value_bits)
        isec = encode_indices(idx.cpu().numpy(), x.numel())
        return self._message(grad, key, (isec, vsec)), dec

    def _decode(self, msg: Message, key: TensorKey, out: torch.Tensor) -> None:
        if msg.flags & ~FLAG_NONFINITE:
            raise WireFormatError(f"{self.name}: unexpected flags 0x{msg.flags:02x}")
        msg.expect(nsections=2)
        idx = decode_indices(msg.sections[0], msg.numel)
        vals = decode_values(msg.sections[1], idx.size, self.value_bits)
        if idx.size:
            _scatter_add(out, torch.from_numpy(idx), vals, 1.0)

    def decode_sparse(self, msg: Message) -> Tuple[np.ndarray, torch.Tensor]:
        """(indices int64, float32 values) of a validated top-k / DGC message."""
        msg.expect(nsections=2)
        idx = decode_indices(msg.sections[0], msg.numel)
        return idx, decode_values(msg.sections[1], idx.size, self.value_bits)


def _scatter_add(out: torch.Tensor, idx: torch.Tensor, vals: torch.Tensor, s: float) -> None:
    """out[idx] += vals * s (s = 1: += vals) for one message's distinct indices: the
    hvd_dgc_scatter_add kernel where a backend runs (flat contiguous float32 out), else
    index_add_; the same float32 result either way."""
    dev = out.device
    # On a CPU, index_add_ costs about 1 us for a message's indices, a kernel launch from
    # Python about 10: the kernel serves GPUs (no atomics), the CPU keeps index_add_.
    be = kernel_backend(dev) if dev.type != "cpu" else None
    if (be is not None and out.dtype == torch.float32 and out.dim() == 1
            and out.is_contiguous() and not out.requires_grad):
        k_dgc.scatter_add(be.backend, idx.to(dev), vals.to(dev), out, s)
        return
    if s != 1.0:
        vals = vals * torch.tensor(s, dtype=torch.float32)
    out.index_add_(0, idx.to(dev), vals.to(dev))


class _Residuals(_Sparse):
    """Per-name error-feedback residuals (top-k, random-k)."""

    def _init_state(self):
        self._residuals: Dict[str, torch.Tensor] = {}
        self._spares: Dict[str, torch.Tensor] = {}      # kernel path: the next residual

    def encode(self, grad, key):
        # kernel path: the non-finite check is part of the kernels' one pass over g
        be = _kernel_grad(grad)
        if be is None:
            return super().encode(grad, key)
        return self._encode_kernels(be.backend, grad, key)

    def _p_kernels(self, be, grad, key, t1=math.inf, t2=math.inf):
        """(g, e, p_out or None, counts): p = g + e written into the spare (error
        feedback), else p is g itself; counts as k_dgc.accumulate's."""
        g = _flat_view(grad)
        e = self._residuals.get(key.name) if self.error_feedback else None
        _check_state(self.name, "residual", e, grad, key.name)
        p_out = _spare(self._spares, key.name, g.numel(), g.device) \
            if self.error_feedback else None
        return g, _flat_state(e, g.device), p_out

    def _keep_kernels(self, be, grad, key, p_out, idx, dec, masked: bool) -> None:
        """The reference's _keep on the kernel path: p[idx] -= dec (unless done), then p
        becomes the residual."""
        if not self.error_feedback:
            return
        if not masked:
            k_dgc.mask(be, idx, v=p_out, dec=dec)
        old = self._residuals.get(key.name)
        self._residuals[key.name] = p_out.view(grad.shape)
        _retire(self._spares, key.name, old, p_out)

    def _p(self, grad, key) -> torch.Tensor:
        g = _flat_f32(grad, self.name)
        e = self._residuals.get(key.name) if self.error_feedback else None
        _check_state(self.name, "residual", e, grad, key.name)
        return g if e is None else g + e.to(g.device).reshape(-1)

    def _keep(self, grad, key, p: torch.Tensor, idx: torch.Tensor, dec: torch.Tensor):
        if self.error_feedback:
            p[idx] = p[idx] - dec            # p is this call's own tensor
            self._residuals[key.name] = p.view(grad.shape)

    def residual(self, name: str) -> Optional[torch.Tensor]:
        """A copy of the residual of parameter ``name`` (float32, its gradient's shape), or
        None before its first finite encode (or without error feedback)."""
        e = self._residuals.get(name)
        return None if e is None else e.detach().clone()

    def state_dict(self) -> Dict[str, Any]:
        """``{"residuals": {name: float32 CPU tensor}}`` (copies)."""
        return {"residuals": {k: v.detach().cpu().clone() for k, v in self._residuals.items()}}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Replace all residuals with those of ``state`` (as ``state_dict`` makes them).
        Raises ValueError, changing nothing, for unknown keys, non-float32 or non-finite
        tensors, or a shape that differs from the residual held for that name."""
        if not isinstance(state, dict):
            raise ValueError(f"{self.name}: state must be a dict, got {type(state).__name__}")
        extra = sorted(set(state) - {"residuals"})
        if extra:
            raise ValueError(f"{self.name}: unknown state keys {extra}; expected 'residuals'")
        self._residuals = _load_tensors(self.name, "residual", state.get("residuals", {}),
                                        self._residuals)
        self._spares = {}


@register("topk")
class TopK(_Residuals):
    """Top-k sparsification with error feedback (Stich et al., NeurIPS 2018, Algorithm 1 with
    top_k; the sparsification step of Lin et al., ICLR 2018, Sec. 3.1 without DGC's extras).

    Per tensor: ``p = g + e``; send the exact top-k of |p| among nonzero coordinates (ties:
    lower index), ``k = max(1, ceil(density * n))``; ``e <- p - decoded``.

    Args:
      density: fraction of coordinates sent, in (0, 1] (default 0.001).
      values: "fp32" (default) or "fp16" value width on the wire.
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
    codec = CODECS["topk"]

    def __init__(self, density: float = 0.001, values: str = "fp32",
                 error_feedback: bool = True):
        self.density = _check_density("density", density)
        self.values = _check_values(values)
        self.error_feedback = _check_bool("error_feedback", error_feedback)
        self._init_state()

    def _encode(self, grad, key):
        p = self._p(grad, key)
        if not _finite(p):
            return self._nonfinite(grad, key)                  # residual unchanged
        idx = topk_indices(p.abs(), num_selected(self.density, p.numel()))
        msg, dec = self._send(grad, key, p, idx)
        self._keep(grad, key, p, idx, dec)
        return msg

    def _encode_kernels(self, be, grad, key):
        """_encode on kernels/dgc.cu: p = g + e, finiteness and the candidates' counts in
        one pass; exact top-k (the sample only places the threshold)."""
        g, e, p_out = self._p_kernels(be, grad, key)
        n = g.numel()
        fp32 = self.value_bits == 32
        res = k_dgc.sparsify(be, g, num_selected(self.density, n), v_old=e, v_out=p_out,
                             sample_size=_sample_size(_INTERNAL_SAMPLE, n),
                             key4=(key.seed, key.rank, key.tensor_id, key.step), exact=True,
                             mask_x=fp32 and p_out is not None)
        if res.nonfinite:
            return self._nonfinite(grad, key)                  # residual unchanged
        vsec, dec = encode_values(res.vals, self.value_bits)
        isec = encode_indices(res.idx.cpu().numpy(), n)
        msg = self._message(grad, key, (isec, vsec))
        self._keep_kernels(be, grad, key, p_out, res.idx, dec, res.masked)
        return msg


@register("randk")
class RandK(_Residuals):
    """Random-k sparsification with error feedback (Stich et al., NeurIPS 2018,
    Algorithm 1 with rand_k).  The k indices come from Philox keyed by the TensorKey
    (:func:`random_indices`), so only the values travel: every receiver regenerates the
    sender's indices from the message header's seed, rank, tensor id and step.

    Per tensor: ``p = g + e``; ``idx = random_indices(n, k, key)``; send p[idx];
    decoded = value * s with ``s = float32(n / k)`` if ``unbiased`` else 1 (then
    E[decoded] = p: unbiased, variance (n/k - 1) |p|^2 per tensor);  ``e <- p - decoded``.

    Args:
      density: fraction of coordinates sent, in (0, 1] (default 0.01).
      values: "fp32" (default) or "fp16".
      error_feedback: keep the residual per parameter name (default True).
      unbiased: scale by n / k on decoding (default False).  With error feedback the
        residual then absorbs the scaling error too (it can be large: (n/k - 1) p).
    Raises ValueError for invalid settings.

    encode: as topk; the Message has one section of ``k * bits / 8`` bytes, or 0 bytes when
      all k values are zero (an all-zero gradient sends a header-only message).
    decode: WireFormatError if the section is neither k values nor empty.
    """
    codec = CODECS["randk"]

    def __init__(self, density: float = 0.01, values: str = "fp32",
                 error_feedback: bool = True, unbiased: bool = False):
        self.density = _check_density("density", density)
        self.values = _check_values(values)
        self.error_feedback = _check_bool("error_feedback", error_feedback)
        self.unbiased = _check_bool("unbiased", unbiased)
        self._init_state()

    def scale(self, n: int) -> float:
        """The float32 factor applied on decoding: n / k if unbiased, else 1."""
        k = num_selected(self.density, n)
        return float(np.float32(n / k)) if self.unbiased and k else 1.0

    def _encode(self, grad, key):
        p = self._p(grad, key)
        if not _finite(p):
            return self._nonfinite(grad, key)
        n = p.numel()
        idx = random_indices(n, num_selected(self.density, n), key, device=p.device)
        vsec, dec = encode_values(p[idx], self.value_bits)
        if not bool((dec != 0).any()):
            vsec = np.zeros(0, dtype=np.uint8)                # all zero: header-only message
        s = self.scale(n)
        if s != 1.0:
            dec = dec * torch.tensor(s, dtype=torch.float32, device=dec.device)
        self._keep(grad, key, p, idx, dec)
        return self._message(grad, key, (vsec,))

    def _encode_kernels(self, be, grad, key):
        """_encode on kernels/dgc.cu: p = g + e and its finiteness in one pass; the
        indices from random_indices (the reference's, a function of the key)."""
        g, e, p_out = self._p_kernels(be, grad, key)
        n = g.numel()
        counts = k_dgc.accumulate(be, g, v_old=e, v_out=p_out)
        if int(counts[2].sum()):
            return self._nonfinite(grad, key)                  # residual unchanged
        p = p_out if p_out is not None else g
        idx = random_indices(n, num_selected(self.density, n), key, device=p.device)
        vsec, dec = encode_values(p[idx], self.value_bits)
        if not bool((dec != 0).any()):
            vsec = np.zeros(0, dtype=np.uint8)                # all zero: header-only message
        s = self.scale(n)
        if s != 1.0:
            dec = dec * torch.tensor(s, dtype=torch.float32, device=dec.device)
        msg = self._message(grad, key, (vsec,))
        self._keep_kernels(be, grad, key, p_out, idx, dec, False)
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
        idx = random_indices(n, k, key)
        _scatter_add(out, idx, vals, self.scale(n))


@register("dgc")
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
         exactly :func:`topk_indices` (|v|, k), sampling only makes it cheap;
      4. send v[idx]; ``v[idx] <- v[idx] - decoded`` (0 for fp32 values);  momentum factor
         masking (Sec. 3.3), if on: ``u[idx] <- 0``.
    Warm-up (Sec. 3.3): :func:`warmup_density`.

    The optimizer's own momentum must be off for these tensors (the drop-in optimizer does
    it: ``handles_momentum``); the averaged sparse vectors are then applied as plain SGD
    steps.  Weight decay added by the wrapped optimizer after averaging bypasses the
    momentum correction (the reference code adds it before compression).

    Args:
      density: final fraction of coordinates sent, in (0, 1] (default 0.001, the paper's).
      values: "fp32" (default) or "fp16".
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
    codec = CODECS["dgc"]
    handles_momentum = True

    def __init__(self, density: float = 0.001, values: str = "fp32",
                 sample_ratio: float = 0.01, exact_k: bool = True, accumulate: bool = True,
                 momentum_correction: bool = True, masking: bool = True,
                 momentum: float = 0.0, clip_norm: float = 0.0, warmup_epochs: int = 0,
                 steps_per_epoch: int = 0, warmup_steps: int = 0, warmup_coeff: float = 0.25):
        self.density = _check_density("density", density)
        self.values = _check_values(values)
        self.sample_ratio = _check_float("sample_ratio", sample_ratio, 0.0, 1.0)
        self.exact_k = _check_bool("exact_k", exact_k)
        self.accumulate = _check_bool("accumulate", accumulate)
        self.momentum_correction = _check_bool("momentum_correction", momentum_correction)
        self.masking = _check_bool("masking", masking)
        self.momentum = _check_float("momentum", momentum, 0.0, 1.0, hi_open=True)
        self.clip_norm = _check_float("clip_norm", clip_norm, 0.0, math.inf, hi_open=True)
        self.warmup_epochs = _check_int("warmup_epochs", warmup_epochs)
        self.steps_per_epoch = _check_int("steps_per_epoch", steps_per_epoch)
        self.warmup_steps = _check_int("warmup_steps", warmup_steps)
        self.warmup_coeff = _check_float("warmup_coeff", warmup_coeff, 0.0, 1.0,
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
        self._u: Dict[str, torch.Tensor] = {}
        self._v: Dict[str, torch.Tensor] = {}
        self._spare_u: Dict[str, torch.Tensor] = {}     # kernel path: the next u / v
        self._spare_v: Dict[str, torch.Tensor] = {}

    # --- schedule and momentum --------------------------------------------------------
    def density_at(self, step: int) -> float:
        """The density used at optimizer step ``step`` (warm-up, Sec. 3.3)."""
        return warmup_density(step, self.density, self.warmup_epochs, self.steps_per_epoch,
                              self.warmup_steps, self.warmup_coeff)

    def set_momentum(self, factors: Dict[str, float]) -> None:
        """Momentum factors by parameter name (the drop-in optimizer's SGD momentum of each
        compressed tensor).  Raises ValueError for factors outside [0, 1)."""
        for name, m in factors.items():
            _check_float(f"momentum of {name!r}", m, 0.0, 1.0, hi_open=True)
        self._factors.update({n: float(m) for n, m in factors.items()})

    def momentum_of(self, name: str) -> float:
        """The momentum factor applied to parameter ``name``."""
        return self._factors.get(name, self.momentum)

    # --- selection --------------------------------------------------------------------
    def select(self, mag: torch.Tensor, k: int, key: TensorKey) -> torch.Tensor:
        """Indices (int64, ascending) that DGC sends for magnitudes ``mag`` (flat, >= 0):
        sampled threshold, hierarchical re-selection (class docstring, step 3)."""
        n = mag.numel()
        if k >= n or self.sample_ratio == 0.0:
            return topk_indices(mag, k)
        s = min(n, max(1, math.ceil(self.sample_ratio * n)))
        smp = torch.sort(mag[sample_positions(s, n, key, mag.device)], descending=True).values
        ks = max(1, math.ceil(s * k / n))
        r = min(s, ks)
        while True:
            t = smp[r - 1]
            cand = torch.nonzero(mag >= t if bool(t > 0) else mag > 0).reshape(-1)
            if cand.numel() >= k:
                return cand[topk_indices(mag[cand], k)]
            if not bool(t > 0) or not self.exact_k:
                return cand                      # every nonzero, or the paper's one pass
            if r == s:
                return topk_indices(mag, k)      # the sample is used up: exact
            r = min(s, 2 * r)

    # --- the compressor ---------------------------------------------------------------
    def _encode(self, grad, key):
        name = key.name
        g = _flat_f32(grad, "dgc")
        u_old, v_old = self._u.get(name), self._v.get(name)
        _check_state("dgc", "momentum u", u_old, grad, name)
        _check_state("dgc", "accumulation v", v_old, grad, name)
        if self.clip_norm > 0:
            norm = float(g.double().pow(2).sum().sqrt())
            thr = self.clip_norm / math.sqrt(key.world_size)
            if norm > thr:
                g = g * torch.tensor(thr / norm, dtype=torch.float32, device=g.device)
        m = self.momentum_of(name) if self.momentum_correction else 0.0
        if m > 0:
            u = g if u_old is None else u_old.reshape(-1).to(g.device) * \
                torch.tensor(m, dtype=torch.float32, device=g.device) + g
        else:
            u = None
        add = g if u is None else u
        v = add if (v_old is None or not self.accumulate) else v_old.reshape(-1).to(g.device) + add
        # a non-finite u makes v = v + u (or v = u) non-finite too: checking v suffices
        if not _finite(v):
            return self._nonfinite(grad, key)                  # state unchanged
        n = v.numel()
        idx = self.select(v.abs(), num_selected(self.density_at(key.step), n), key)
        msg, dec = self._send(grad, key, v, idx)
        # State.  g is this call's own copy and u, v are new tensors, except that v IS u
        # when v was just started (or is not accumulated): update v first, from a copy then.
        if self.accumulate:
            if v is u:
                v = v.clone()
            v[idx] = v[idx] - dec
            self._v[name] = v.view(grad.shape)
        if u is not None:
            if self.masking:
                u[idx] = 0.0
            self._u[name] = u.view(grad.shape)
        else:
            self._u.pop(name, None)
        return msg

    def encode(self, grad, key):
        # kernel path: the non-finite check is part of the kernels' one pass over g
        be = _kernel_grad(grad)
        if be is not None:
            m = self.momentum_of(key.name) if self.momentum_correction else 0.0
            if not (m > 0 and float(np.float32(m)) == 0.0):      # else: reference
                return self._encode_kernels(be.backend, grad, key, m)
        return super().encode(grad, key)

    def _encode_kernels(self, be, grad, key, m):
        """_encode on kernels/dgc.cu (k_dgc.sparsify): clipping norm (one read pass, if
        on), then u, v, their finiteness and the candidates' counts in one pass, the
        selection in another; the same message and state as _encode."""
        name = key.name
        g = _flat_view(grad)
        n, dev = g.numel(), g.device
        u_old, v_old = self._u.get(name), self._v.get(name)
        _check_state("dgc", "momentum u", u_old, grad, name)
        _check_state("dgc", "accumulation v", v_old, grad, name)
        scale = None
        if self.clip_norm > 0:
            norm = math.sqrt(k_dgc.sumsq(be, g))
            thr = self.clip_norm / math.sqrt(key.world_size)
            if norm > thr:
                scale = float(np.float32(thr / norm))
        mom = m > 0
        u_out = _spare(self._spare_u, name, n, dev) if mom else None
        if self.accumulate:
            v_out = _spare(self._spare_v, name, n, dev)
        elif not mom and scale is not None:
            v_out = torch.empty(n, dtype=torch.float32, device=dev)   # g * scale, not kept
        else:
            v_out = None                                 # v is u (or g itself)
        fp32 = self.value_bits == 32
        k = num_selected(self.density_at(key.step), n)
        if self.sample_ratio > 0:
            s, exact = _sample_size(self.sample_ratio, n), self.exact_k
        else:
            s, exact = _sample_size(_INTERNAL_SAMPLE, n), True   # exact top-k either way
        res = k_dgc.sparsify(be, g, k, u_old=_flat_state(u_old if mom else None, dev),
                             v_old=_flat_state(v_old if self.accumulate else None, dev),
                             u_out=u_out, v_out=v_out, scale=scale,
                             momentum=float(np.float32(m)) if mom else 0.0,
                             sample_size=s, key4=(key.seed, key.rank, key.tensor_id, key.step),
                             exact=exact, mask_x=fp32 and self.accumulate,
                             mask_u=mom and self.masking)
        if res.nonfinite:
            return self._nonfinite(grad, key)                  # state unchanged
        vsec, dec = encode_values(res.vals, self.value_bits)
        isec = encode_indices(res.idx.cpu().numpy(), n)
        msg = self._message(grad, key, (isec, vsec))
        # state: v[idx] -= dec, u[idx] = 0 (unless sparsify did it), then swap buffers
        need_v = self.accumulate and not (fp32 and res.masked)
        need_u = mom and self.masking and not res.masked
        if need_v or need_u:
            if not self.accumulate:                      # x is u: masking u only
                k_dgc.mask(be, res.idx, u=u_out)
            else:
                k_dgc.mask(be, res.idx, v=v_out if need_v else None,
                           u=u_out if need_u else None, dec=dec)
        if self.accumulate:
            self._v[name] = v_out.view(grad.shape)
            _retire(self._spare_v, name, v_old, v_out)
        if mom:
            self._u[name] = u_out.view(grad.shape)
            _retire(self._spare_u, name, u_old, u_out)
        else:
            self._u.pop(name, None)
        return msg

    # --- state --------------------------------------------------------------------------
    def momentum_buffer(self, name: str) -> Optional[torch.Tensor]:
        """A copy of u for ``name`` (float32, its gradient's shape), or None."""
        t = self._u.get(name)
        return None if t is None else t.detach().clone()

    def accumulation(self, name: str) -> Optional[torch.Tensor]:
        """A copy of v for ``name`` (float32, its gradient's shape), or None."""
        t = self._v.get(name)
        return None if t is None else t.detach().clone()

    def state_dict(self) -> Dict[str, Any]:
        """``{"u": {name: float32 CPU tensor}, "v": {...}}`` (copies)."""
        return {"u": {k: t.detach().cpu().clone() for k, t in self._u.items()},
                "v": {k: t.detach().cpu().clone() for k, t in self._v.items()}}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Replace u and v with those of ``state``.  Raises ValueError, changing nothing,
        for unknown keys, non-float32 or non-finite tensors, or shapes that differ from
        the state held (or between u and v of one name)."""
        if not isinstance(state, dict):
            raise ValueError(f"dgc: state must be a dict, got {type(state).__name__}")
        extra = sorted(set(state) - {"u", "v"})
        if extra:
            raise ValueError(f"dgc: unknown state keys {extra}; expected 'u' and 'v'")
        u = _load_tensors("dgc", "momentum u", state.get("u", {}), self._u)
        v = _load_tensors("dgc", "accumulation v", state.get("v", {}), self._v)
        for name in set(u) & set(v):
            if u[name].shape != v[name].shape:
                raise ValueError(f"dgc: u and v of {name!r} differ in shape: "
                                 f"{tuple(u[name].shape)} vs {tuple(v[name].shape)}")
        self._u, self._v = u, v
        self._spare_u, self._spare_v = {}, {}
