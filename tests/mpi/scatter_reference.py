"""A single-process computation of the reduce-scatter collective: every rank's pieces
encoded with that rank's compressor and key, serialized and parsed, decoded in rank order
with plain ``decode`` calls, averaged, re-encoded by the owner, decoded into the result.
Written from the algorithm's description, independently of hvdcomp.exchange.scatter; it
takes the layout (which piece where) from the collective under test."""
from __future__ import annotations

import math
from typing import Dict, List

import torch

import hvdcomp
from hvdcomp.compressors.protocols import MomentumCorrection
from hvdcomp.exchange.shards import second_stage


def _keep_range(comp, dtype):
    """fp16 sends a bfloat16 tensor as bf16 (bfloat16's range; docs/semantics.md, casts)."""
    return hvdcomp.get("bf16") if isinstance(comp, hvdcomp.FP16) and dtype == torch.bfloat16 \
        else comp


class Reference:
    """``size`` simulated ranks of compressor ``spec`` (one instance per rank: residuals and
    momentum are per rank), and each owner's second stage."""

    def __init__(self, spec: str, size: int, seed: int):
        self.size, self.seed = size, seed
        self.comps = [hvdcomp.get(spec) for _ in range(size)]
        self.stage2 = [second_stage(c) for c in self.comps]

    def set_momentum(self, factors: Dict[str, float]) -> None:
        for c in self.comps:
            if isinstance(c, MomentumCorrection):
                c.set_momentum(factors)

    def step(self, layout, shapes: Dict[str, tuple], grads: List[Dict[str, torch.Tensor]],
             step: int) -> Dict[str, torch.Tensor]:
        """{name: flat float32 average} of the scattered tensors (``shapes``: their shapes;
        ``grads[r]``: rank r's gradients; ``layout[k][owner]``: pieces)."""
        out = {n: torch.zeros(math.prod(s), dtype=torch.float32) for n, s in shapes.items()}
        finite = {n: True for n in shapes}
        for bucket in layout:
            for owner, pieces in enumerate(bucket):
                for p in pieces:
                    name = f"{p.name}[{p.lo}:{p.hi}]"
                    acc = torch.zeros(p.hi - p.lo, dtype=torch.float32)
                    ok = True
                    dt = grads[0][p.name].dtype
                    first = [_keep_range(c, dt) for c in self.comps]
                    second = _keep_range(self.stage2[owner], dt)
                    for r in range(self.size):
                        key = hvdcomp.TensorKey(name, p.tensor_id, step, r, self.size, self.seed)
                        x = grads[r][p.name].reshape(-1)[p.lo:p.hi].reshape(p.shape)
                        msg = hvdcomp.Message.from_bytes(
                            first[r].encode(x, key).to_bytes())
                        ok &= first[owner].decode(msg, key, acc)
                    if ok and not first[owner].prescaled:
                        acc = acc / self.size
                    y = acc.reshape(p.shape) if ok else torch.full(p.shape, math.nan)
                    key2 = hvdcomp.TensorKey(name + "/avg", p.tensor_id + 1, step, owner, 1,
                                             self.seed)
                    msg2 = hvdcomp.Message.from_bytes(
                        second.encode(y, key2).to_bytes())
                    finite[p.name] &= second.decode(msg2, key2,
                                                                out[p.name][p.lo:p.hi])
        for n in shapes:
            if not finite[n] or not bool(torch.isfinite(out[n]).all()):
                out[n] = torch.full_like(out[n], math.nan)
        return out
