"""PowerSGD: low-rank gradient compression by one step of power iteration per step, with
error feedback and warm start.

Source: Vogels, Karimireddy, Jaggi, "PowerSGD: Practical Low-Rank Gradient Compression for
Distributed Optimization", NeurIPS 2019 (arXiv 1905.13727), Algorithm 1 (rank-r compression:
P = M Q, summed over the workers, orthogonalized; Q = M^T P, summed; the update P Q^T) and
Algorithm 2 (error feedback: each worker keeps what the update did not carry), Sec. 3
(warm start: the next step's power iteration starts from this step's Q).

Per tensor of shape (n, ...) and rank r, each step on each rank (W ranks):

    M = gradient viewed as n x m (the first dimension by the rest) + residual
    Q = this tensor's Q of the last step (warm start), or Philox normals at the first step
    P = M orth(Q)                                      round 0: sum over ranks (n r floats)
    P = orth(sum P);  Q = M^T P                         round 1: sum over ranks (m r floats)
    average = P (sum Q)^T / W;  residual = M - average; Q = sum Q / W (the next warm start)

with r = min(rank, n, m).  Sent uncompressed (summed in float32, numel floats, no residual):
every tensor before step ``start_iter``, 1-D tensors, empty tensors, and tensors where
compression does not pay, ``(n + m) r * min_compression_rate >= n m`` (the rule of PyTorch's
powerSGD_hook).  The sums are allreduces, not wire messages: the compressor declares
:class:`~hvdcomp.compressors.protocols.SummedRounds` and the exchange core runs the rounds
(:mod:`hvdcomp.exchange.rounds`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

import torch

from .. import philox
from ..ops import divide_
from . import settings
from .base import Compressor, TensorKey, get, numel_of, register
from .protocols import SummedRounds
from .state import finite, load_tensors

__all__ = ["PowerSGD", "orthogonalize", "skinny_product"]

ORTHOGONALIZATIONS = ("auto", "gram_schmidt", "qr")


def orthogonalize(a: torch.Tensor, method: str = "auto") -> torch.Tensor:
    """Orthonormalize the columns of ``a`` (k x r, floating, k >= r) in place and return it.

    "gram_schmidt": modified Gram-Schmidt, column by column; a column left with norm 0 (a
    vanishing gradient) becomes zeros rather than NaN.  "qr": the Q factor of
    ``torch.linalg.qr``.  "auto": Gram-Schmidt for r <= 2, QR otherwise (as PyTorch's hook
    chooses).  Both span the same column space, so P P^T M is the same either way."""
    r = a.shape[1]
    if method == "qr" or (method == "auto" and r > 2):
        a.copy_(torch.linalg.qr(a, mode="reduced").Q)
        return a
    for i in range(r):
        col = a[:, i]
        norm = torch.linalg.vector_norm(col)
        if norm > 0:
            col.div_(norm)
        else:
            col.zero_()
        if i + 1 < r:
            rest = a[:, i + 1:]
            rest.sub_(torch.outer(col, col @ rest))
    return a


def skinny_product(x: torch.Tensor, y: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out`` (k x r, float32) = ``x`` (k x l) @ ``y`` (l x r), for the few columns r of
    PowerSGD's P and Q; returns ``out``.  For r >= 2 computed as (y^T x^T)^T: the BLAS
    behind PyTorch's CPU build runs a product with a k x r output 4-7x slower than the same
    product with an r x k output (the real task's CNN at rank 4, both products: 4.9 ms
    against 1.2 ms on one core; bench/results/powersgd_products.md); the sums are the same up to
    float32 rounding.  r = 1 (a matrix-vector product, as fast either way) stays x @ y."""
    if y.shape[1] == 1:
        return torch.mm(x, y, out=out)
    return out.copy_(torch.mm(y.t().contiguous(), x.t()).t())


# This rank's products with M (M Q, M^T P: its own contributions, summed across ranks) run
# in float32 into the round buffers (at rank >= 2 through an r x k temporary:
# skinny_product), as PyTorch's powerSGD_hook computes them, up to float32 rounding.
# What every rank computes from the shared sums (the orthogonalization of P, the average
# P Q^T) runs in float64 and is rounded once to float32: a float32 BLAS result can depend
# on the calling thread's number of threads (MKL) or on the device, a float64 one rounded
# to float32 practically never does, so every rank, and a resumed run, get the same average.
# P Q^T is computed in row blocks of at most BLOCK float64 elements (a cache-sized scratch,
# not a gradient-sized temporary); at rank 1 it is one float32 product per element, the
# same rounding everywhere.  M = gradient + residual is held in a float32 buffer
# kept from step to step, which becomes the residual when the step commits (the old
# residual's buffer then serves the next step's M): no gradient-sized allocation per step.
ORTH = torch.float64
BLOCK = 1 << 16


@dataclass
class _Pending:
    """One tensor's step in progress on this rank (between ``first_round`` and
    ``finalize``)."""
    n: int
    m: int
    r: int
    M: Optional[torch.Tensor]          # flat n m float32 (gradient + residual), None: absent
    P: Optional[torch.Tensor] = None   # n x r float64: the orthogonalized sum of P (round 1)
    Qsum: Optional[torch.Tensor] = None   # m x r float32: the sum of Q (round 2)


@register("powersgd", codec=26)
class PowerSGD(SummedRounds, Compressor):
    """PowerSGD (Vogels et al., NeurIPS 2019, Algorithms 1 and 2; module docstring).

    rank: the rank r of the approximation (int >= 1; min(rank, n, m) is used).
    start_iter: the steps before it send every tensor uncompressed (int >= 0; PyTorch's
      ``start_powerSGD_iter``).
    min_compression_rate: a tensor is compressed only when n m > (n + m) r times this
      (float >= 0; PyTorch's default 2).
    warm_start: start each step's power iteration from the last step's Q (True), or from
      fresh Philox normals every step (False).
    orthogonalization: "auto" (Gram-Schmidt for r <= 2, QR above, as PyTorch's hook),
      "gram_schmidt" or "qr".

    Computes this rank's products with M (M Q, M^T P) in float32 (as PyTorch's
    powerSGD_hook), the orthogonalizations and the average P Q^T in float64 rounded to
    float32 (the same on every rank); sends and keeps float32.  Memory per compressed
    tensor and rank: the residual and one work buffer for M, float32.
    Sends per compressed n x m tensor 4 (n + m) r bytes in two float32 allreduces (P, then
    Q), uncompressed ones 4 numel bytes.  The initial Q of a tensor is Philox normals (Box-
    Muller on :func:`hvdcomp.philox.uniform`, key (seed, 0), counter (tensor id, step)), the
    same on every rank.  State (``state_dict``): ``q`` {name: m x r float32} (the warm
    start, identical on every rank) and ``residual`` {name: flat float32} (per rank).
    Raises ValueError for a rank that is not an int >= 1 and other invalid settings.  Only
    through the exchange (the drop-in optimizer, the DDP hook, ``hvdcomp.exchange``):
    ``encode`` raises TypeError, as does the reduce-scatter.
    """
    keeps_state = True
    shared_state = ("q",)   # Q is the ranks' summed product, the same on every rank
    biased = True
    device_identical = False   # its matrix products: cuBLAS vs the CPU's BLAS
    example = "powersgd:rank=2,min_compression_rate=1.0"

    def __init__(self, rank: int = 4, start_iter: int = 0, min_compression_rate: float = 2.0,
                 warm_start: bool = True, orthogonalization: str = "auto"):
        self.rank = settings.integer("rank", rank, 1, 2**31 - 1)
        self.start_iter = settings.integer("start_iter", start_iter, 0)
        self.min_compression_rate = settings.real("min_compression_rate",
                                                  min_compression_rate, 0.0)
        self.warm_start = settings.boolean("warm_start", warm_start)
        self.orthogonalization = settings.choice("orthogonalization", orthogonalization,
                                                 ORTHOGONALIZATIONS)
        self._q: Dict[str, torch.Tensor] = {}
        self._residual: Dict[str, torch.Tensor] = {}
        self._work: Dict[str, torch.Tensor] = {}       # M's buffer (scratch, not state)
        self._pending: Dict[str, Optional[_Pending]] = {}

    # --- which tensors are compressed ------------------------------------------------
    def matrix(self, shape, step: Optional[int] = None) -> Optional[Tuple[int, int, int]]:
        """(n, m, r) of a tensor of ``shape`` compressed at ``step`` (default: once
        compression has started), or None where it travels uncompressed (module
        docstring)."""
        shape = (shape,) if isinstance(shape, int) else tuple(int(d) for d in shape)
        numel = numel_of(shape)
        if (step is not None and step < self.start_iter) or len(shape) < 2 or numel == 0:
            return None
        n = shape[0]
        m = numel // n
        r = min(n, m, self.rank)
        if (n + m) * r * self.min_compression_rate >= numel:
            return None
        return n, m, r

    def steady_state(self) -> "PowerSGD":
        """Without ``start_iter`` (a new instance; this one where it is 0)."""
        return get(self.spec(), start_iter=0) if self.start_iter else self

    def message_bytes(self, shape) -> int:
        """Bytes this rank sends for a tensor of ``shape`` once compression has started:
        4 (n + m) r (float32 P and Q), or 4 numel for a tensor sent uncompressed."""
        mat = self.matrix(shape)
        if mat is None:
            return 4 * numel_of(shape)
        n, m, r = mat
        return 4 * (n + m) * r

    def shard_unit(self, shape):
        raise TypeError("powersgd sums P and Q across ranks by allreduces (rounds with an "
                        "orthogonalization between them): it has no per-rank messages to "
                        "cut into shards")

    # --- no wire messages --------------------------------------------------------------
    def encode(self, grad, key):
        raise TypeError("powersgd has no per-rank wire message: its P and Q are summed by "
                        "allreduces in rounds (hvdcomp.compressors.protocols.SummedRounds). "
                        "Use it through hvdcomp.torch.DistributedOptimizer, hvdcomp.ddp or "
                        "hvdcomp.exchange.Exchange")

    def combine(self, msgs, keys, out):
        raise TypeError("powersgd has no wire messages to combine (see encode)")

    # --- the rounds (SummedRounds) ------------------------------------------------------
    def round_sizes(self, shape, step):
        mat = self.matrix(shape, step)
        if mat is None:
            return (numel_of(shape),)
        n, m, r = mat
        return (n * r, m * r)

    def sizes_vary(self, shape) -> bool:
        """True where the tensor is compressed from ``start_iter`` > 0 on (uncompressed
        before: one round of numel floats, then two of n r and m r)."""
        return self.start_iter > 0 and self.matrix(shape) is not None

    def first_round(self, grad, key: TensorKey, out):
        shape = key.shape if key.shape is not None else tuple(grad.shape)
        mat = self.matrix(shape, key.step)
        if mat is None:                                 # uncompressed: the gradient itself
            self._pending[key.name] = None
            if grad is not None:
                out.copy_(grad.reshape(-1))
            return
        n, m, r = mat
        M = None
        if grad is not None:
            M = self._work_buffer(key.name, n * m, out.device)
            g = grad.reshape(-1)
            if g.dtype != torch.float32 or g.device != out.device:
                g = g.to(out.device, torch.float32)
            res = self._residual.get(key.name)
            if res is not None:
                torch.add(g, res.to(out.device), out=M)
            else:
                M.copy_(g)
        q = self._q.get(key.name) if self.warm_start else None
        if q is None or tuple(q.shape) != (m, r):
            q = self._initial_q(key, m, r)
        q = orthogonalize(q.to(out.device, ORTH, copy=True),
                          self.orthogonalization).to(torch.float32)
        self._pending[key.name] = _Pending(n, m, r, M)
        if M is not None:
            skinny_product(M.view(n, m), q, out.view(n, r))

    def next_round(self, i, summed, key, out):
        pend = self._pending[key.name]
        pend.P = orthogonalize(summed.reshape(pend.n, pend.r).to(ORTH, copy=True),
                               self.orthogonalization)
        if pend.M is not None:
            skinny_product(pend.M.view(pend.n, pend.m).t(), pend.P.to(torch.float32),
                           out.view(pend.m, pend.r))

    def last_round(self, summed, key, acc):
        pend = self._pending.get(key.name)
        if pend is None:
            acc.copy_(summed)
            return
        pend.Qsum = summed.reshape(pend.m, pend.r).clone()
        n, m = pend.n, pend.m
        out = acc.view(n, m)
        if pend.r == 1:            # one product per element: exact float32 rounding
            torch.mul(pend.P.to(torch.float32), pend.Qsum.view(1, m), out=out)
            return
        qt = pend.Qsum.t().to(ORTH)
        rows = max(1, BLOCK // m)
        scratch = torch.empty(min(n, rows) * m, dtype=ORTH, device=acc.device)
        for i in range(0, n, rows):
            j = min(n, i + rows)
            block = scratch[:(j - i) * m].view(j - i, m)
            torch.mm(pend.P[i:j], qt, out=block)
            out[i:j].copy_(block)

    def finalize(self, acc, key):
        """The average (``acc`` / world size); a compressed tensor's finite average also
        commits the step: Q (the sum of Q / world size) for the warm start, and this rank's
        residual M - average where finite (a rank without a gradient keeps its residual)."""
        divide_(acc, key.world_size)
        pend = self._pending.pop(key.name, None)
        if pend is None or pend.Qsum is None or not self._finite_average(pend, acc):
            return acc
        self._q[key.name] = divide_(pend.Qsum, key.world_size)
        if pend.M is not None:
            res = pend.M.sub_(acc)
            if finite(res):          # the new residual; the old one's buffer is next M's
                old = self._residual.get(key.name)
                self._residual[key.name] = res
                if old is not None and old.shape == res.shape and old.device == res.device:
                    self._work[key.name] = old
                else:
                    self._work.pop(key.name, None)
        return acc

    @staticmethod
    def _finite_average(pend: _Pending, acc: torch.Tensor) -> bool:
        """Whether the average P Q^T / W is finite: from P and the sum of Q alone where
        they bound it (P's columns are orthonormal or zero, so every element is at most
        r max|Q| in magnitude), else by reading ``acc``."""
        if finite(pend.P) and finite(pend.Qsum):
            if pend.Qsum.numel() == 0 or float(pend.Qsum.abs().max()) * pend.r < 2.0 ** 120:
                return True
        return finite(acc)

    def _work_buffer(self, name: str, numel: int, device) -> torch.Tensor:
        """This rank's float32 buffer for M of tensor ``name`` (kept from step to step;
        never the residual itself, so a step that does not commit leaves it intact)."""
        buf = self._work.get(name)
        if buf is None or buf.numel() != numel or buf.device != torch.device(device):
            buf = torch.empty(numel, dtype=torch.float32, device=device)
            self._work[name] = buf
        return buf

    def _initial_q(self, key: TensorKey, m: int, r: int) -> torch.Tensor:
        """m x r standard normals from Philox (Box-Muller), keyed by (seed, 0, tensor id,
        step): the same on every rank, computed on the CPU."""
        k = m * r
        u = philox.uniform(2 * k, seed=key.seed, step=key.step, rank=0,
                           tensor_id=key.tensor_id).to(torch.float64)
        z = torch.sqrt(-2.0 * torch.log1p(-u[:k])) * torch.cos(2.0 * math.pi * u[k:])
        return z.to(torch.float32).view(m, r)

    # --- state ------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        return {"q": {n: t.clone() for n, t in self._q.items()},
                "residual": {n: t.clone() for n, t in self._residual.items()}}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        if not isinstance(state, dict) or set(state) - {"q", "residual"}:
            raise ValueError(f"powersgd: state must be a dict with 'q' and 'residual', got "
                             f"{sorted(state) if isinstance(state, dict) else state!r}")
        q = load_tensors(self.name, "q", state.get("q", {}), self._q)
        res = load_tensors(self.name, "residual", state.get("residual", {}), self._residual)
        for name, t in q.items():
            if t.dim() != 2:
                raise ValueError(f"powersgd: q of {name!r} must be a matrix (m x r), got "
                                 f"shape {tuple(t.shape)}")
        self._q, self._residual = q, {n: t.reshape(-1) for n, t in res.items()}
        self._pending, self._work = {}, {}
