"""An independent, plain reference of PowerSGD (Vogels, Karimireddy, Jaggi, NeurIPS 2019,
Algorithms 1 and 2, warm start as in Sec. 3), written with explicit loops over ranks and
columns in float64: what W ranks' average of one tensor is, step by step.

Per step, with W ranks' gradients G_w (n x m after viewing the tensor as first dimension by
the rest) and the rank r = min(rank, n, m):

    M_w = G_w + e_w;  Q = orth(Q);  P = sum_w M_w Q;  P = orth(P);  S = sum_w M_w^T P
    average = P S^T / W;  e_w = M_w - average;  Q = S / W

before ``start_iter``, for 1-D or empty tensors and where (n + m) r * min_compression_rate
>= n m, the average is the plain mean (no residual).  orth is classical Gram-Schmidt in
float64.  The initial Q is the one hvdcomp documents: Box-Muller on Philox uniforms
(hvdcomp.philox.uniform with key (seed, 0), counter (tensor id, step)), drawn here by the
reference itself.
"""
import math
from typing import List, Optional, Sequence

import torch

from hvdcomp import philox


def gram_schmidt(a: torch.Tensor) -> torch.Tensor:
    """Classical Gram-Schmidt on the columns of a float64 matrix (a new matrix)."""
    a = a.clone()
    cols = []
    for i in range(a.shape[1]):
        v = a[:, i].clone()
        for u in cols:
            v = v - (u @ a[:, i]) * u
        norm = math.sqrt(float(v @ v))
        v = v / norm if norm > 0 else torch.zeros_like(v)
        cols.append(v)
    return torch.stack(cols, dim=1)


def initial_q(m: int, r: int, seed: int, tensor_id: int, step: int) -> torch.Tensor:
    k = m * r
    u = philox.uniform(2 * k, seed=seed, step=step, rank=0, tensor_id=tensor_id).double()
    z = [math.sqrt(-2.0 * math.log(1.0 - float(u[i]))) * math.cos(2.0 * math.pi * float(u[k + i]))
         for i in range(k)]
    return torch.tensor(z, dtype=torch.float64).view(m, r)


class Reference:
    """W ranks' PowerSGD of one tensor of ``shape`` (tensor id ``tensor_id``, ``seed``)."""

    def __init__(self, shape, world: int, rank: int, start_iter: int = 0,
                 min_compression_rate: float = 2.0, warm_start: bool = True, seed: int = 0,
                 tensor_id: int = 0):
        self.shape, self.world, self.rank = tuple(shape), world, rank
        self.start_iter, self.rate = start_iter, min_compression_rate
        self.warm_start, self.seed, self.tensor_id = warm_start, seed, tensor_id
        self.errors: List[Optional[torch.Tensor]] = [None] * world
        self.q: Optional[torch.Tensor] = None

    def matrix(self, step):
        numel = 1
        for d in self.shape:
            numel *= d
        if step < self.start_iter or len(self.shape) < 2 or numel == 0:
            return None
        n = self.shape[0]
        m = numel // n
        r = min(n, m, self.rank)
        return None if (n + m) * r * self.rate >= n * m else (n, m, r)

    def step(self, grads: Sequence[torch.Tensor], step: int) -> torch.Tensor:
        """The average (float64, the tensor's shape) of ``grads`` (one per rank)."""
        W = self.world
        mat = self.matrix(step)
        if mat is None:
            total = torch.zeros(self.shape, dtype=torch.float64)
            for g in grads:
                total += g.double()
            return total / W
        n, m, r = mat
        Ms = []
        for w in range(W):
            M = grads[w].double().reshape(n, m).clone()
            if self.errors[w] is not None:
                M += self.errors[w]
            Ms.append(M)
        q = self.q if (self.warm_start and self.q is not None) else initial_q(
            m, r, self.seed, self.tensor_id, step)
        q = gram_schmidt(q)
        P = torch.zeros(n, r, dtype=torch.float64)
        for w in range(W):
            P += Ms[w] @ q
        P = gram_schmidt(P)
        S = torch.zeros(m, r, dtype=torch.float64)
        for w in range(W):
            S += Ms[w].t() @ P
        avg = P @ S.t() / W
        for w in range(W):
            self.errors[w] = Ms[w] - avg
        self.q = S / W
        return avg.reshape(self.shape)
