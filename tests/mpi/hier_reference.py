"""The single-process reference of the hierarchical exchange (hvdcomp/exchange/hier.py),
shared by the MPI and DDP workers: from every rank's gradients, per host the float32 sum of
its ranks' pieces in local-rank order divided by L, each host's mean encoded by its own
compressor with key (piece, host number, H), decoded in host order, finalized over H, and
the pieces laid back end to end.  Built from hvdcomp's compressors and the cut points of
``hvdcomp.exchange.shards.boundaries`` only, not from the collective."""
from __future__ import annotations

import math
from typing import Dict, List, Sequence, Tuple

import torch

import hvdcomp
from hvdcomp.compressors import TensorKey
from hvdcomp.exchange.shards import boundaries


class HierReference:
    """spec: the compressor, or {name: spec} (a bfloat16 tensor's fp16 is bf16: the plan's
    ``keep_range``); hosts, local: H and L (host h holds ranks h L ... h L + L - 1);
    seed; shapes: {name: shape} of the hierarchical tensors; ids: {name: tensor id};
    first_id: the first piece id (the number of tensors)."""

    def __init__(self, spec: str, hosts: int, local: int, seed: int,
                 shapes: Dict[str, Tuple[int, ...]], ids: Dict[str, int], first_id: int):
        self.spec, self.H, self.L, self.seed = spec, hosts, local, seed
        self.shapes, self.ids, self.first_id = shapes, ids, first_id
        specs = spec if isinstance(spec, dict) else {n: spec for n in shapes}
        # one compressor per host and tensor (the piece owners' states)
        self.comps = [{n: hvdcomp.get(specs[n]) for n in shapes} for _ in range(hosts)]

    def pieces(self, name: str) -> List[Tuple[int, int, int, Tuple[int, ...], str]]:
        """(owner, lo, hi, shape, label) of each non-empty piece of ``name``."""
        shape = self.shapes[name]
        comp = self.comps[0][name]
        c = boundaries([math.prod(shape)], [comp.shard_unit(shape)], self.L)
        return [(l, c[l], c[l + 1], tuple(comp.shard_shape(shape, c[l], c[l + 1])),
                 f"{name}[{c[l]}:{c[l + 1]}]") for l in range(self.L) if c[l + 1] > c[l]]

    def set_momentum(self, factors: Dict[str, float]) -> None:
        for name in self.shapes:
            if name in factors:
                more = {label: factors[name] for *_, label in self.pieces(name)}
                for comps in self.comps:
                    if hasattr(comps[name], "set_momentum"):
                        comps[name].set_momentum(more)

    def step(self, grads: Sequence[Dict[str, torch.Tensor]], step: int
             ) -> Dict[str, torch.Tensor]:
        """{name: the average, flat float32} from ``grads[r][name]`` (rank r's gradient)."""
        H, L = self.H, self.L
        out = {}
        for name, shape in self.shapes.items():
            numel = math.prod(shape)
            res = torch.zeros(numel, dtype=torch.float32)
            nan = False
            for l, lo, hi, pshape, label in self.pieces(name):
                tid = self.first_id + 3 * (self.ids[name] * L + l) + 1
                keys = [TensorKey(label, tid, step, h, H, self.seed, shape=pshape,
                                  dtype=torch.float32) for h in range(H)]
                msgs = []
                for h in range(H):
                    s = torch.zeros(hi - lo, dtype=torch.float32)
                    for j in range(L):
                        s.add_(grads[h * L + j][name].reshape(-1).to(torch.float32)[lo:hi])
                    x = (s / L).view(pshape)
                    msgs.append(self.comps[h][name].encode(x, keys[h]))
                acc = torch.zeros(hi - lo, dtype=torch.float32)
                finite = True
                for h in range(H):
                    finite &= self.comps[0][name].decode(msgs[h], keys[h], acc)
                self.comps[0][name].finalize(acc, keys[0])
                nan |= not finite
                res[lo:hi] = acc
            out[name] = torch.full_like(res, float("nan")) if nan else res
        return out
