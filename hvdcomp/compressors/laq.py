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

All squared norms are float64 sums of float32 values squared, summed in the fixed order of
:func:`fixed_sum` (a tree order that does not depend on the device or the thread count,
and that the kernels of kernels/laq.cu reproduce bit for bit).  ``>=`` follows the authors' code and
seeds.md; the paper's criterion skips on equality, which only matters for an all-zero innovation
with no parameter history (e.g. an all-zero gradient at the first step: sent here).

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

from ..backends import k_laq, kernel_backend
from .protocols import ParamDeltas, ReportsEvents
from ..codecs import pack_bits, packed_size, unpack_bits
from ..codecs.sections import read_codes, write_codes
from ..errors import WireFormatError
from ..wire import CODECS, FLAG_ENTROPY, Message, dtype_code
from .base import Compressor, TensorKey, register

__all__ = ["LAQ", "quantize_innovation", "dequantize_innovation", "fixed_sum"]

_SPLITS = ("numel", "full")
_RECORD_KEYS = {"numel", "qprev", "aggregate", "eps_hat_sq", "silent", "uploads", "skips"}


FIXED_SUM_CHUNK = 2048          # 256 groups of 8: the block of kernels/laq.cu


def fixed_sum(t: torch.Tensor) -> float:
    """The sum of the float64 values of flat ``t`` in a fixed order (kernels/laq.cu's):
    pad with zeros to a multiple of 2048; per chunk of 2048, each group of 8 (t0..t7) as
    ((t0 + t1) + (t2 + t3)) + ((t4 + t5) + (t6 + t7)), then the 256 group sums folded in
    halves (s[j] = s[j] + s[j + w] for w = 128, 64, ..., 1); repeat on the chunk sums until
    one value is left.  Elementwise float64 additions only, so the result is the same on
    every device and for every thread count (torch.sum's order is neither).  0.0 if empty.
    Padding adds +0.0: exact for the non-negative terms LAQ sums."""
    t = t.reshape(-1).to(torch.float64)
    if t.numel() == 0:
        return 0.0
    while True:
        n = t.numel()
        c = (n + FIXED_SUM_CHUNK - 1) // FIXED_SUM_CHUNK
        if c * FIXED_SUM_CHUNK != n:
            t = torch.cat([t, t.new_zeros(c * FIXED_SUM_CHUNK - n)])
        g = t.view(c, FIXED_SUM_CHUNK // 8, 8)
        s = ((g[..., 0] + g[..., 1]) + (g[..., 2] + g[..., 3])) \
            + ((g[..., 4] + g[..., 5]) + (g[..., 6] + g[..., 7]))
        w = s.shape[1] // 2
        while w >= 1:
            s = s[:, :w] + s[:, w:2 * w]
            w //= 2
        t = s[:, 0]
        if c == 1:
            return float(t[0])


def quantize_innovation(v: torch.Tensor, bits: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """The paper's deterministic quantizer of a flat float32 innovation ``v``.

    Returns ``(R, codes)``: R = max|v_i| as a float32 0-d tensor and int64 codes in
    [0, 2**bits - 1] (see the module docstring for the grid and the rounding).
    """
    n = v.numel()
    R = v.abs().max() if n else torch.zeros((), dtype=torch.float32, device=v.device)
    L = (1 << bits) - 1
    if n == 0 or float(R) == 0.0:
        return R, torch.zeros(n, dtype=torch.int64, device=v.device)
    r = R.double()
    u = (v.double() + r) * L / (2.0 * r)
    return R, torch.floor(u + 0.5).clamp_(0, L).to(torch.int64)


def dequantize_innovation(R: torch.Tensor, codes: torch.Tensor, bits: int) -> torch.Tensor:
    """float32 ``R * (2 c - L) / L`` (float64 arithmetic, rounded once): the grid point of
    each code.  The sender adds exactly this to its Qprev, every receiver to its aggregate."""
    L = (1 << bits) - 1
    return (R.double() * (2 * codes - L).double() / L).to(torch.float32)


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


@register("laq")
class LAQ(ParamDeltas, ReportsEvents, Compressor):
    """LAQ / SLAQ (Sun, Chen, Giannakis, Yang, NeurIPS 2019, arXiv 1909.07588): quantize the
    innovation ``grad - Qprev`` on a uniform ``bits``-bit grid over ``[-R, R]``, upload it only
    when it is large compared with the recent parameter changes and the quantization errors,
    and let every rank keep the running aggregate of the uploaded innovations.  See the
    module docstring for the exact grid, rule, units and wire format.

    Args:
      bits: bits per coordinate (1..8): 2**bits grid points, 2**bits - 1 intervals.
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
    records ``||theta_{k+1} - theta_k||^2`` (the drop-in calls it: ``wants_param_deltas``).

    Example::

        import hvdcomp.torch as hvd
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.2),
                                       named_parameters=model.named_parameters(),
                                       compression="laq:bits=4,alpha=0.2")
    """
    codec = CODECS["laq"]
    wants_param_deltas = True

    def __init__(self, bits: int = 4, alpha: float = 0.1, xi: float = 0.8, history: int = 10,
                 t_max: int = 100, stochastic: bool = False, slaq_err: float = 0.5,
                 slaq_const: float = 0.2, split: str = "numel", entropy: bool = False):
        self.entropy = bool(entropy)
        def integer(name, v, lo, hi):
            if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
                raise ValueError(f"{name} must be an integer in {lo}..{hi}, got {v!r}")
            return int(v)

        def real(name, v, positive):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
                    or v < 0 or (positive and v == 0):
                raise ValueError(f"{name} must be a finite number {'> 0' if positive else '>= 0'}"
                                 f", got {v!r}")
            return float(v)

        self.bits = integer("bits", bits, 1, 8)
        self.alpha = real("alpha", alpha, True)
        self.xi = real("xi", xi, False)
        self.history = integer("history", history, 0, 2**20)
        self.t_max = integer("t_max", t_max, 0, 2**62)
        if not isinstance(stochastic, bool):
            raise ValueError(f"stochastic must be True or False, got {stochastic!r}")
        self.stochastic = stochastic
        self.slaq_err = real("slaq_err", slaq_err, False)
        self.slaq_const = real("slaq_const", slaq_const, False)
        if split not in _SPLITS:
            raise ValueError(f"split must be one of {_SPLITS}, got {split!r}")
        self.split = split
        self._hist: List[float] = []            # newest first, at most `history` entries
        self._rec: Dict[str, _Record] = {}
        self._events: List[str] = []

    def _header_fields(self) -> Dict[str, int]:
        return {"bits": self.bits, "bucket_size": 0, "level_version": 0}

    def message_bytes(self, numel: int) -> int:
        """Payload bytes of an upload of ``numel`` coordinates: ``4 + ceil(numel*bits/8)``."""
        return 4 + packed_size(numel, self.bits)

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
        rec = self._rec[name]
        w = self.share(name)
        err, const = (self.slaq_err, self.slaq_const) if self.stochastic else (1.0, 0.0)
        return w * self.param_term() + 3.0 * err * (eps_sq + rec.eps_hat_sq) + w * const

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
        rec = self._rec.get(key.name)
        if rec is None:
            rec = self._rec[key.name] = _Record(numel=n)
        elif rec.numel != n or (rec.qprev is not None
                                and tuple(rec.qprev.shape) != tuple(grad.shape)):
            have = tuple(rec.qprev.shape) if rec.qprev is not None else f"{rec.numel} elements"
            raise ValueError(f"laq: the state held for {key.name!r} is for a tensor of shape "
                             f"{have}, but its gradient has shape {tuple(grad.shape)} (was a "
                             f"checkpoint of another model loaded?)")
        x = grad.detach().reshape(-1).to(torch.float32)
        be = kernel_backend(x.device)
        codes = packed = None
        if be is not None:      # kernels/laq.cu: the same codes, Qnew and sums as below
            q = rec.qprev.to(x.device).reshape(-1) if rec.qprev is not None else None
            inn = k_laq.encode(be.backend, x, q, self.bits)
            if inn is None:
                return self._nonfinite(grad, key)           # state unchanged
            R, packed, qnew, eps_sq, delta_sq = inn
        else:
            q = (rec.qprev.to(x.device).reshape(-1) if rec.qprev is not None
                 else torch.zeros_like(x))
            v = x - q
            if n and not bool(torch.isfinite(v).all()):
                return self._nonfinite(grad, key)           # state unchanged
            R, codes = quantize_innovation(v, self.bits)
            delta = dequantize_innovation(R, codes, self.bits)
            qnew = q + delta
            eps_sq = fixed_sum((qnew - x).double().pow(2))
            delta_sq = fixed_sum(delta.double().pow(2))
        upload = (delta_sq >= self.threshold(key.name, eps_sq)
                  or rec.silent >= self.t_max)
        if not upload:
            rec.silent += 1
            rec.skips += 1
            return None
        rec.qprev = qnew.view(grad.shape)
        rec.eps_hat_sq = eps_sq
        rec.silent = 0
        rec.uploads += 1
        if packed is None:
            packed = pack_bits(codes, self.bits)
        sec, flags = write_codes(packed, n, self.bits, self.entropy)
        return Message(codec=self.codec, dtype=dtype_code(grad.dtype), shape=tuple(grad.shape),
                       sections=(R.reshape(1).cpu().numpy().view(np.uint8), sec), flags=flags,
                       tensor_id=key.tensor_id, rank=key.rank, seed=key.seed, step=key.step,
                       **self._header_fields())

    # --- decode -----------------------------------------------------------------------
    def _decode(self, msg: Message, key: TensorKey, out: torch.Tensor) -> None:
        n = msg.numel
        msg.expect(nsections=2)
        msg.section_size_check(0, 4, "radius R")
        R = torch.from_numpy(np.array(msg.sections[0]).view(np.float32).copy()).reshape(())
        if not bool(torch.isfinite(R)) or float(R) < 0:
            raise WireFormatError(f"laq: radius R must be finite and >= 0, got {float(R)}")
        be = kernel_backend(out.device)
        if (be is not None and not msg.flags & FLAG_ENTROPY and out.dtype == torch.float32
                and out.dim() == 1 and out.is_contiguous()):
            # kernels/laq.cu: out += the decoded innovation, bit for bit as below
            msg.section_size_check(1, packed_size(n, self.bits), "codes")
            packed = torch.from_numpy(np.array(msg.sections[1], dtype=np.uint8))
            k_laq.dequantize_add(be.backend, packed.to(out.device), n, float(R), self.bits,
                                 out)
            return
        codes = unpack_bits(read_codes(msg, 1, n, self.bits), n, self.bits)
        out.add_(dequantize_innovation(R, codes, self.bits).to(out.device))

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
        def bad(msg):
            return ValueError(f"laq: {msg}")

        if not isinstance(state, dict):
            raise bad(f"state must be a dict, got {type(state).__name__}")
        extra = sorted(set(state) - {"history", "tensors"})
        if extra:
            raise bad(f"unknown state keys {extra}; expected 'history' and 'tensors'")
        hist = state.get("history", [])
        if not isinstance(hist, (list, tuple)):
            raise bad(f"'history' must be a list of floats, got {type(hist).__name__}")
        new_hist = []
        for h in hist:
            if isinstance(h, bool) or not isinstance(h, (int, float)) or not math.isfinite(h) \
                    or h < 0:
                raise bad(f"history entries must be finite numbers >= 0, got {h!r}")
            new_hist.append(float(h))
        tens = state.get("tensors", {})
        if not isinstance(tens, dict):
            raise bad(f"'tensors' must map parameter names to records, got "
                      f"{type(tens).__name__}")
        new: Dict[str, _Record] = {}
        for name, r in tens.items():
            if not isinstance(name, str):
                raise bad(f"parameter names must be strings, got {name!r}")
            if not isinstance(r, dict) or set(r) != _RECORD_KEYS:
                got = sorted(r) if isinstance(r, dict) else type(r).__name__
                raise bad(f"record of {name!r} must have the keys {sorted(_RECORD_KEYS)}, "
                          f"got {got}")
            numel = r["numel"]
            if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
                raise bad(f"numel of {name!r} must be an integer >= 0, got {numel!r}")
            rec = _Record(numel=numel)
            for field in ("qprev", "aggregate"):
                t = r[field]
                if t is None:
                    continue
                if not isinstance(t, torch.Tensor) or t.dtype != torch.float32:
                    raise bad(f"{field} of {name!r} must be a float32 torch.Tensor or None, "
                              f"got {getattr(t, 'dtype', type(t).__name__)}")
                if t.numel() != numel:
                    raise bad(f"{field} of {name!r} has {t.numel()} elements, the record "
                              f"says {numel}")
                if field == "aggregate" and t.dim() != 1:
                    raise bad(f"aggregate of {name!r} must be flat, got shape "
                              f"{tuple(t.shape)}")
                if t.numel() and not bool(torch.isfinite(t).all()):
                    raise bad(f"{field} of {name!r} holds NaN or Inf")
                cur = self._rec.get(name)
                if field == "qprev" and cur is not None and cur.qprev is not None \
                        and tuple(cur.qprev.shape) != tuple(t.shape):
                    raise bad(f"qprev of {name!r} has shape {tuple(t.shape)}, the one held "
                              f"for it has shape {tuple(cur.qprev.shape)}")
                dev = (getattr(cur, field).device if cur is not None
                       and getattr(cur, field) is not None else "cpu")
                setattr(rec, field, t.detach().to(dev).clone())
            e = r["eps_hat_sq"]
            if isinstance(e, bool) or not isinstance(e, (int, float)) or not math.isfinite(e) \
                    or e < 0:
                raise bad(f"eps_hat_sq of {name!r} must be a finite number >= 0, got {e!r}")
            rec.eps_hat_sq = float(e)
            for field in ("silent", "uploads", "skips"):
                v = r[field]
                if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                    raise bad(f"{field} of {name!r} must be an integer >= 0, got {v!r}")
                setattr(rec, field, int(v))
            new[name] = rec
        self._hist = new_hist[:self.history]
        self._rec = new
