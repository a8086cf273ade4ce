"""LAQ: lazily aggregated quantized gradients (and SLAQ, its stochastic variant).

Source: Sun, Chen, Giannakis, Yang, "Communication-Efficient Distributed Learning via Lazily
Aggregated Quantized Gradients", NeurIPS 2019 (arXiv 1909.07588), Sec. 2 (the quantizer and
the lazy upload criterion) and the authors' code (github.com/sunjunaimer/LAQ, ``LAQ.py``/``SLAQ.py``),
which fixes the constants the paper leaves open (``D``, ``xi_d``, ``t_max``, SLAQ's rule).

Per parameter name every rank m keeps ``Qprev`` (float32, the gradient's shape): the sum of
the innovations it has uploaded, i.e. its last quantized gradient ``Q_m(theta_hat_m)``.
At each step, with ``x`` the float32 values of the gradient:

    v     = x - Qprev                                       float32
    R     = max_i |v_i|                                      float32, sent (4 bytes)
    L     = 2**bits - 1                                      number of grid INTERVALS
    grid  = {-R + j * 2R/L : j = 0..L}                      2**bits points, both ends +-R
    c_i   = clamp(floor((v_i + R) * L / (2R) + 1/2), 0, L)  float64 arithmetic; nearest
                                                             point, a tie goes UP (the
                                                             paper's floor(. + 1/2))
    delta_i = float32(R * (2 c_i - L) / L)                   float64 arithmetic, rounded
                                                             once; c = 0 -> -R, c = L -> +R
    R = 0 (v = 0): every c_i = 0 and delta = 0.

This is the paper's quantizer (tau = 1/(2^b - 1), ``[q]_i = floor((v_i + R)/(2 tau R) + 1/2)``,
``delta = 2 tau R q - R``): deterministic, ``|delta_i - v_i| <= tau R``.  With an even number
of points 0 itself is not on the grid, so a zero innovation coordinate is sent as +tau R.

Lazy rule (the paper's criterion and its t_max clock, in the units the compressor sees, see
"Units" below).
With ``Qnew = Qprev + delta``, ``eps = Qnew - x`` (this step's quantization error),
``eps_hat`` the error stored at this rank's last upload of the tensor (0 before the first),
``h_d = ||theta^{k+1-d} - theta^{k-d}||^2`` the parameter changes reported by the optimizer
(``after_step``; h_1 is the latest), n = min(number of recorded h, history):

    S     = sum_{d=1..n} xi_d h_d          with xi_d = xi / n (equal weights; see below)
    thr   = w * S / alpha^2 + 3 * (||eps||^2 + ||eps_hat||^2)
    UPLOAD iff ||delta||^2 >= thr, or the tensor has been silent for t_max rounds in a row;
    on upload: Qprev = Qnew, eps_hat = eps, silent = 0;  on a skip: nothing changes but the
    silent counter, and ``encode`` returns None (a zero-length message, the empty upload).
    A tensor silent for min(t_max, 10) rounds whose innovation is at least a quarter of
    the gradient's squared norm yet below the eps terms alone is reported (an event,
    logged as a WARNING): such a tensor (its largest coordinate tens of times its typical
    one, at 4 bits) can only go out every t_max rounds, and the optimizer applies its
    stale aggregate in between.

The quantizer and the sums are the ops of hvdcomp.ops.laq (PyTorch references, and the
kernels of kernels/laq.cu, equal bit for bit).  All squared norms are float64 sums of float32
values squared, summed in the fixed order of ``hvdcomp.ops.laq.fixed_sum`` (a tree order that
does not depend on the device or the thread count).  ``>=`` follows the authors' code; the
paper's criterion skips on equality, which only matters for an all-zero innovation with no
parameter history (e.g. an all-zero gradient at the first step: sent here).

Choices (the paper leaves them to its code):
  * ``xi_d``: the authors' code (LAQ.py) weights the last ``min(k, D)`` squared parameter
    changes equally, ``xi_d = 0.8 / min(k, D)`` (``ksi = ck / i`` with ck = 0.8, D = 10): the
    threshold is 0.8 times the MEAN of the recent squared changes.  The weights decay only
    with the number of changes available (1/k during the first D steps), not with d.
    Defaults: ``xi = 0.8``, ``history = 10``, ``t_max = 100`` (``C = 100`` there).
  * ``w`` (per-tensor share): the paper decides once per worker for the whole vector theta;
    the drop-in encodes tensor by tensor as their gradients become ready, so the decision is
    made per tensor.  ``split="numel"`` (default) gives tensor t the share
    ``w_t = numel_t / sum of numel over every tensor this compressor has seen``; the shares
    sum to 1, so when every tensor skips the paper's whole-vector condition holds, and the
    staleness error the analysis bounds never exceeds the paper's.  With one LAQ tensor,
    w = 1: exactly the paper.  ``split="full"`` compares every tensor with the whole
    threshold (w = 1 always; skips more, without the paper's guarantee).  The eps terms are
    the tensor's own (they sum over tensors to the whole-vector terms).

Units.  The paper minimises ``f = sum_m f_m`` with ``theta^{k+1} = theta^k - alpha_p *
nabla^k``, ``nabla^k = sum_m Q_m`` and the rule ``||dQ_m||^2 <= (1/(alpha_p^2 M^2)) S +
3(...)``.  The drop-in averages (op=Average): with ``SGD(lr=alpha)`` it applies
``theta - alpha * (1/M) sum_m Q_m(grad L_m)`` where ``L_m`` is rank m's own loss.  Read with
``f_m = L_m / M`` (the paper's f is then the MEAN loss, what data-parallel training
minimises) this is exactly the paper's iteration with ``alpha_p = alpha``: the quantizer is
positively homogeneous (``Q(g/M) = Q(g)/M``), so the ranks' messages are M times the paper's
and ``nabla^k = aggregate / M``.  Multiplying the paper's rule by M^2 to express it in rank
units gives ``||delta||^2 >= S / alpha^2 + 3(||eps||^2 + ||eps_hat||^2)``: the M^2 cancels.
(Read with ``f_m = L_m`` instead, it is the paper with ``alpha_p = alpha / M``: the same rule.)
So set ``alpha`` to the wrapped optimizer's learning rate.  ``finalize`` returns
``aggregate / M``.

Aggregation: every rank keeps, per name, the running aggregate
``nabla^k = nabla^{k-1} + sum over uploading ranks of delta_m`` (float32; the deltas decoded in
rank order 0..M-1 are summed first, then added).  ``combine`` returns it (the sum over ranks
of their current contributions ``Qprev_m``) and ``finalize`` divides by M.  The aggregate is
updated in ``combine`` and not in ``finalize``: when some rank's gradient is not finite the
drop-in skips ``finalize``, but the finite ranks have already moved their ``Qprev``, and the
aggregate must follow them to stay equal to ``sum_m Qprev_m``.

SLAQ (``stochastic=True``, minibatch gradients): the rule of the authors' SLAQ.py,
``thr = w * S / alpha^2 + slaq_err * 3 (||eps||^2 + ||eps_hat||^2) + w * slaq_const``
(their ec = 0.5 and ade = 0.2, in squared-gradient units of the rank's loss): the additive
constant lets workers skip innovations that are mostly minibatch noise.  The quantizer,
messages and aggregation are those of LAQ.

The skip decision is per rank and per tensor and never changes the collectives: the drop-in
allgathers every bucket on every rank; a skip is a legal zero-length entry (``msgs[r] is
None`` in ``combine``).

Wire (codec ``laq`` = 24; header bits = ``bits``, bucket size 0, level-table version 0):
    section 0: R, float32 little-endian (4 bytes)
    section 1: codes c_i, ``bits`` per coordinate packed LSB-first (hvdcomp.ops.bitpack);
               every b-bit value is a valid grid index
    payload bytes = 4 + ceil(numel * bits / 8)           (:meth:`LAQ.message_bytes`)
    a skipped upload: no message at all (zero bytes in the allgather)

NaN policy: a gradient holding NaN/Inf (or an innovation overflowing float32) is sent as a
payload-free NONFINITE message; the sender's state (Qprev, eps_hat, silent counter) is
unchanged; every receiver still adds the finite ranks' deltas into the aggregate, and the
drop-in sets the averaged tensor to NaN.  A non-finite parameter change passed to
``after_step`` is not recorded.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch

from ..ops.bitpack import packed_size
from ..codecs.sections import read_codes, write_codes
from ..errors import WireFormatError
from ..ops import laq as ops
from ..wire import Message, dtype_code
from . import settings
from .base import ABSENT_LAST, Compressor, TensorKey, numel_of, register
from .protocols import ParamDeltas, ReportsEvents

__all__ = ["LAQ"]

_SPLITS = ("numel", "full")
_RECORD_KEYS = {"numel", "qprev", "aggregate", "eps_hat_sq", "silent", "uploads", "skips"}


@dataclass
class _Record:
    """What one rank remembers about one parameter name."""
    numel: int
    qprev: Optional[torch.Tensor] = None       # float32, gradient's shape; None before upload
    aggregate: Optional[torch.Tensor] = None   # float32, flat; None before the first combine
    eps_hat_sq: float = 0.0                    # ||eps||^2 at this rank's last upload
    silent: int = 0                            # skipped rounds since the last upload
    uploads: int = 0
    skips: int = 0


@register("laq", codec=24)
class LAQ(ParamDeltas, ReportsEvents, Compressor):
    """LAQ / SLAQ (Sun, Chen, Giannakis, Yang, NeurIPS 2019, arXiv 1909.07588): quantize the
    innovation ``grad - Qprev`` on a uniform ``bits``-bit grid over ``[-R, R]``, upload it only
    when it is large compared with the recent parameter changes and the quantization errors,
    and let every rank keep the running aggregate of the uploaded innovations.  See the
    module docstring for the exact grid, rule, units and wire format.

    Args:
      bits: bits per coordinate (1..8): 2**bits grid points, 2**bits - 1 intervals.  The
        grid's own error enters the rule, so at 4 bits a tensor whose innovation's largest
        coordinate is tens of times its typical one (a large fully connected layer) goes
        out only every t_max steps (reported after 10 silent rounds; Fashion-MNIST's CNN diverged,
        bench/results/real_task.md); at 8 bits that CNN uploaded every tensor every step.
      alpha: the step size the rule assumes: the learning rate of the wrapped optimizer,
        applied to the AVERAGED gradient (> 0).
      xi: total weight of the parameter-change term (the authors' 0.8), >= 0.
      history: D, how many recent parameter changes enter the rule (the authors' 10), >= 0.
      t_max: a tensor silent for t_max rounds in a row uploads at the next one (>= 0;
        0: upload every step, i.e. quantized GD with the same quantizer).
      stochastic: SLAQ's rule (for minibatch gradients).
      slaq_err, slaq_const: SLAQ's weight of the error term and additive constant (the
        authors' 0.5 and 0.2); used only when ``stochastic``.
      split: "numel" (default) or "full": how the whole-model parameter term is shared among
        tensors.
    Raises ValueError for invalid settings.

    ``encode`` returns a Message, or None for a skipped upload; it updates this rank's state
    for ``key.name``, so call it exactly once per tensor per step.  ``after_step(step, sq)``
    records ``||theta_{k+1} - theta_k||^2`` (the exchange core calls it: the ParamDeltas protocol).

    Used through the drop-in optimizer, with ``alpha`` its learning rate:
    ``hvdcomp.torch.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.2),
    named_parameters=model.named_parameters(), compression="laq:bits=4,alpha=0.2")``.
    """
    keeps_state = True          # Qprev, aggregates, history of parameter changes
    biased = True
    example = "laq:bits=4"
    absent_rank = ABSENT_LAST   # receivers keep each rank's last upload (its Qprev)

    def __init__(self, bits: int = 4, alpha: float = 0.1, xi: float = 0.8, history: int = 10,
                 t_max: int = 100, stochastic: bool = False, slaq_err: float = 0.5,
                 slaq_const: float = 0.2, split: str = "numel", entropy: bool = False):
        self.bits = settings.integer("bits", bits, 1, 8)
        self.alpha = settings.real("alpha", alpha, 0.0, lo_open=True)
        self.xi = settings.real("xi", xi, 0.0)
        self.history = settings.integer("history", history, 0, 2**20)
        self.t_max = settings.integer("t_max", t_max, 0, 2**62)
        self.stochastic = settings.boolean("stochastic", stochastic)
        self.slaq_err = settings.real("slaq_err", slaq_err, 0.0)
        self.slaq_const = settings.real("slaq_const", slaq_const, 0.0)
        self.split = settings.choice("split", split, _SPLITS)
        self.entropy = settings.boolean("entropy", entropy)
        self._hist: List[float] = []            # newest first, at most `history` entries
        self._rec: Dict[str, _Record] = {}
        self._events: List[str] = []

    def _header_fields(self) -> Dict[str, int]:
        return {"bits": self.bits, "bucket_size": 0, "level_version": 0}

    def message_bytes(self, shape) -> int:
        """Payload bytes of an upload of a tensor of ``shape`` (or ``numel`` coordinates):
        ``4 + ceil(numel*bits/8)``."""
        return 4 + packed_size(numel_of(shape), self.bits)

    def shard_unit(self, shape) -> int:
        """Refused (TypeError): the owner of a shard would re-encode an average of stale
        and fresh uploads every step (Sun et al. 2019), so no rank could ever skip."""
        raise TypeError(
            "LAQ's ranks skip uploads lazily and every receiver reuses each rank's last "
            "upload (Sun et al. 2019): the owner of a shard would re-encode an average of "
            "stale and fresh contributions every step, so no rank could ever skip and the "
            "lazy rule's bound would not hold")

    # --- the rule ---------------------------------------------------------------------
    def param_term(self) -> float:
        """``S / alpha^2`` with ``S = sum_d xi_d h_d`` over the recorded parameter changes."""
        n = min(len(self._hist), self.history)
        if n == 0:
            return 0.0
        wgt = self.xi / n
        s = 0.0
        for h in self._hist[:n]:
            s += wgt * h
        return s / (self.alpha * self.alpha)

    def share(self, name: str) -> float:
        """The tensor's share w of the whole-model terms (see ``split``)."""
        if self.split == "full":
            return 1.0
        total = sum(r.numel for r in self._rec.values())
        return self._rec[name].numel / total if total else 1.0

    def threshold(self, name: str, eps_sq: float) -> float:
        """The right-hand side of the rule for tensor ``name`` with this step's ``||eps||^2``."""
        w = self.share(name)
        const = self.slaq_const if self.stochastic else 0.0
        return w * self.param_term() + self.error_term(name, eps_sq) + w * const

    def error_term(self, name: str, eps_sq: float) -> float:
        """The rule's quantization-error term for tensor ``name``: ``3 (||eps||^2 +
        ||eps_hat||^2)``, times ``slaq_err`` under SLAQ."""
        err = self.slaq_err if self.stochastic else 1.0
        return 3.0 * err * (eps_sq + self._rec[name].eps_hat_sq)

    def after_step(self, step: int, param_delta_sq: float) -> None:
        """Record ``||theta_{k+1} - theta_k||^2`` (summed over all parameters) of step ``step``."""
        sq = float(param_delta_sq)
        if not math.isfinite(sq) or sq < 0:
            self._events.append(f"laq: parameter change {sq!r} at step {step} not recorded")
            return
        if self.history:
            self._hist.insert(0, sq)
            del self._hist[self.history:]

    # --- encode -----------------------------------------------------------------------
    def encode(self, grad: torch.Tensor, key: TensorKey) -> Optional[Message]:
        """Quantize the innovation of ``grad`` and apply the lazy rule.

        grad: any shape and layout, float16 / bfloat16 / float32 / float64 (its float32 values
        are used); read, not modified.  Returns the Message of an upload
        (``message_bytes(numel)`` payload bytes), None for a skipped upload, or a NONFINITE
        message (state unchanged).  Raises TypeError for integer, bool or complex tensors and
        ValueError if the Qprev stored for ``key.name`` has another shape.
        """
        if not grad.is_floating_point():
            raise TypeError(f"laq quantizes floating-point gradients only, got {grad.dtype}")
        dtype_code(grad.dtype)
        n = grad.numel()
        rec = self._record(key.name, grad)
        x = grad.detach().reshape(-1).to(torch.float32)
        q = rec.qprev.to(x.device).reshape(-1) if rec.qprev is not None else None
        inn = ops.encode_innovation(x, q, self.bits)
        if inn is None:
            return self._nonfinite(grad, key)               # state unchanged
        if not (inn.delta_sq >= self.threshold(key.name, inn.eps_sq)
                or rec.silent >= self.t_max):
            rec.silent += 1
            rec.skips += 1
            if rec.silent == min(self.t_max, STALE_REPORT):
                self._events += _stale_event(self, key.name, rec.silent, inn.delta_sq,
                                             self.error_term(key.name, inn.eps_sq), x, q)
            return None
        rec.qprev = inn.qnew.view(grad.shape)
        rec.eps_hat_sq = inn.eps_sq
        rec.silent = 0
        rec.uploads += 1
        codes, flags = write_codes(inn.packed, n, self.bits, self.entropy)
        return self._new_message(grad, key,
                                 (inn.R.reshape(1).cpu().numpy().view(np.uint8), codes), flags)

    def _record(self, name: str, grad: torch.Tensor) -> _Record:
        """The record of ``name`` (a new one for ``grad``'s size); ValueError if the one held
        is for a tensor of another shape."""
        rec = self._rec.get(name)
        if rec is None:
            rec = self._rec[name] = _Record(numel=grad.numel())
        elif rec.numel != grad.numel() or (rec.qprev is not None
                                           and tuple(rec.qprev.shape) != tuple(grad.shape)):
            have = tuple(rec.qprev.shape) if rec.qprev is not None else f"{rec.numel} elements"
            raise ValueError(f"laq: the state held for {name!r} is for a tensor of shape "
                             f"{have}, but its gradient has shape {tuple(grad.shape)} (was a "
                             f"checkpoint of another model loaded?)")
        return rec

    # --- decode -----------------------------------------------------------------------
    def _decode(self, msg: Message, key: TensorKey, out: torch.Tensor) -> None:
        n = msg.numel
        msg.expect(nsections=2)
        msg.section_size_check(0, 4, "radius R")
        R = torch.from_numpy(np.array(msg.sections[0]).view(np.float32).copy()).reshape(())
        if not bool(torch.isfinite(R)) or float(R) < 0:
            raise WireFormatError(f"laq: radius R must be finite and >= 0, got {float(R)}")
        packed = read_codes(msg, 1, n, self.bits, device=out.device)
        ops.dequantize_add(packed, n, R, self.bits, out)

    def combine(self, msgs: List[Optional[Message]], keys: List[TensorKey],
                out: torch.Tensor) -> bool:
        """Decode the uploading ranks' innovations (``msgs[r] is None``: rank r skipped), add
        their sum (float32, rank order) to this rank's running aggregate of ``keys[0].name``
        and add the aggregate into ``out``.  Every message is validated before any state
        changes (WireFormatError).  Returns False if some rank's message was NONFINITE (the
        finite ranks' innovations still enter the aggregate)."""
        if not keys:
            raise ValueError("laq.combine needs one key per rank")
        name = keys[0].name
        n = out.numel()
        s = torch.zeros(n, dtype=torch.float32, device=out.device)
        finite = True
        for msg, key in zip(msgs, keys):
            if msg is not None:
                finite &= self.decode(msg, key, s)
        rec = self._rec.get(name)
        if rec is None:
            rec = self._rec[name] = _Record(numel=n)
        if rec.numel != n:
            raise ValueError(f"laq: the state held for {name!r} has {rec.numel} elements, the "
                             f"tensor has {n}")
        agg = rec.aggregate
        agg = s if agg is None else agg.to(out.device) + s
        rec.aggregate = agg
        out.add_(agg)
        return finite

    # finalize: the base class divides the aggregate by the world size (op=Average).

    # --- introspection ----------------------------------------------------------------
    def counts(self) -> Dict[str, Tuple[int, int]]:
        """{name: (uploads, skipped uploads)} of this rank since construction (or the
        checkpoint)."""
        return {k: (r.uploads, r.skips) for k, r in self._rec.items()}

    def qprev(self, name: str) -> Optional[torch.Tensor]:
        """A copy of this rank's last quantized gradient of ``name`` (None before an upload)."""
        r = self._rec.get(name)
        return None if r is None or r.qprev is None else r.qprev.detach().clone()

    def aggregate(self, name: str) -> Optional[torch.Tensor]:
        """A copy of the running aggregate (sum over ranks of Qprev) of ``name``, flat."""
        r = self._rec.get(name)
        return None if r is None or r.aggregate is None else r.aggregate.detach().clone()

    # --- state ------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """``{"history": [h_1, h_2, ...] (newest first), "tensors": {name: {"numel",
        "qprev" (float32, gradient's shape, or None), "aggregate" (float32, flat, or None),
        "eps_hat_sq", "silent", "uploads", "skips"}}}``; tensors are CPU copies."""
        def cp(t):
            return None if t is None else t.detach().cpu().clone()
        return {"history": list(self._hist),
                "tensors": {k: {"numel": r.numel, "qprev": cp(r.qprev),
                                "aggregate": cp(r.aggregate), "eps_hat_sq": r.eps_hat_sq,
                                "silent": r.silent, "uploads": r.uploads, "skips": r.skips}
                            for k, r in self._rec.items()}}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Replace all state with ``state`` (as produced by ``state_dict``).

        Raises ValueError (and changes nothing) for unknown keys, wrong types, non-finite or
        negative values, tensors that are not float32, a Qprev or aggregate whose size does
        not match the record's numel, or a Qprev whose shape differs from the one this
        compressor already holds for that name.  A history longer than ``history`` keeps its
        newest entries.
        """
        hist, self._rec = _load_state(state, self._rec)
        self._hist = hist[:self.history]


STALE_REPORT = 10     # silent rounds after which a tensor the rule cannot send is reported


def _stale_event(c: "LAQ", name: str, silent: int, delta_sq: float, err: float,
                 x: torch.Tensor, q: Optional[torch.Tensor]) -> List[str]:
    """[an event] when a tensor has been silent for ``silent`` (= min(t_max, STALE_REPORT))
    rounds although its innovation ``x - q`` (gradient minus last upload) is a sizeable
    part of the gradient (``>= ||x||^2 / 4``) and the quantizer's own error term ``err``
    alone outweighs the quantized innovation (``delta_sq``): the rule cannot send such a
    tensor (its largest innovation coordinate is tens of times its typical one at 4
    bits), so it goes out only when t_max forces it and the optimizer applies a stale
    aggregate in between (on a 3.2M-element FC layer at 4 bits this diverged within 50
    steps: bench/results/real_task.md); else [].  A small innovation held back by the
    previous upload's error (a gradient that did not change), or a zero gradient, is the
    rule working: no event."""
    grad_sq = float(x.double().pow(2).sum())
    inn_sq = float((x if q is None else x - q).double().pow(2).sum())
    if not (delta_sq < err and grad_sq > 0 and inn_sq >= 0.25 * grad_sq):
        return []
    return [f"laq: {name} has been silent for {silent} rounds although its innovation is "
            f"{inn_sq / grad_sq:.0%} of its gradient's squared norm: its {c.bits}-bit grid's "
            f"own error term ({err:.3g}) outweighs the quantized innovation "
            f"({delta_sq:.3g}), so the lazy rule cannot send it; it goes out only every "
            f"t_max={c.t_max} rounds and the optimizer applies a stale gradient in between: "
            f"use more bits or a smaller t_max"]


def _load_state(state: Any, held: Dict[str, _Record]
                ) -> Tuple[List[float], Dict[str, _Record]]:
    """(history, records) of a state dict, validated (ValueError, LAQ.load_state_dict)
    against the records ``held``."""
    if not isinstance(state, dict):
        raise _bad(f"state must be a dict, got {type(state).__name__}")
    extra = sorted(set(state) - {"history", "tensors"})
    if extra:
        raise _bad(f"unknown state keys {extra}; expected 'history' and 'tensors'")
    hist = state.get("history", [])
    if not isinstance(hist, (list, tuple)):
        raise _bad(f"'history' must be a list of floats, got {type(hist).__name__}")
    new_hist = [_nonneg(h, "history entries must be finite numbers >= 0") for h in hist]
    tens = state.get("tensors", {})
    if not isinstance(tens, dict):
        raise _bad(f"'tensors' must map parameter names to records, got "
                   f"{type(tens).__name__}")
    return new_hist, {name: _load_record(name, r, held.get(name)) for name, r in tens.items()}


def _load_record(name: Any, r: Any, cur: Optional[_Record]) -> _Record:
    """One record of a state dict, validated (ValueError) against the one held (``cur``)."""
    if not isinstance(name, str):
        raise _bad(f"parameter names must be strings, got {name!r}")
    if not isinstance(r, dict) or set(r) != _RECORD_KEYS:
        got = sorted(r) if isinstance(r, dict) else type(r).__name__
        raise _bad(f"record of {name!r} must have the keys {sorted(_RECORD_KEYS)}, "
                   f"got {got}")
    numel = r["numel"]
    if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
        raise _bad(f"numel of {name!r} must be an integer >= 0, got {numel!r}")
    rec = _Record(numel=numel)
    for field in ("qprev", "aggregate"):
        t = r[field]
        if t is None:
            continue
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32:
            raise _bad(f"{field} of {name!r} must be a float32 torch.Tensor or None, "
                       f"got {getattr(t, 'dtype', type(t).__name__)}")
        if t.numel() != numel:
            raise _bad(f"{field} of {name!r} has {t.numel()} elements, the record "
                       f"says {numel}")
        if field == "aggregate" and t.dim() != 1:
            raise _bad(f"aggregate of {name!r} must be flat, got shape {tuple(t.shape)}")
        if t.numel() and not bool(torch.isfinite(t).all()):
            raise _bad(f"{field} of {name!r} holds NaN or Inf")
        held = getattr(cur, field) if cur is not None else None
        if field == "qprev" and held is not None and tuple(held.shape) != tuple(t.shape):
            raise _bad(f"qprev of {name!r} has shape {tuple(t.shape)}, the one held "
                       f"for it has shape {tuple(held.shape)}")
        setattr(rec, field, t.detach().to(held.device if held is not None else "cpu")
                .clone())
    rec.eps_hat_sq = _nonneg(r["eps_hat_sq"],
                             f"eps_hat_sq of {name!r} must be a finite number >= 0")
    for field in ("silent", "uploads", "skips"):
        v = r[field]
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise _bad(f"{field} of {name!r} must be an integer >= 0, got {v!r}")
        setattr(rec, field, int(v))
    return rec


def _bad(msg: str) -> ValueError:
    return ValueError(f"laq: {msg}")


def _nonneg(v: Any, what: str) -> float:
    """``v`` as a float if it is a finite number >= 0 (not a bool), else ValueError."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        raise _bad(f"{what}, got {v!r}")
    return float(v)
