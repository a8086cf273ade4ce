"""Fusion buckets in a fixed order, and the handshake that makes every rank agree on them.

Every rank must issue the same collectives in the same order, whatever order its backward
hooks fire in: the buckets are filled in reverse registration order (the order backward
produces gradients) up to ``fusion_bytes`` of gradient each, and always communicated in
bucket order.  Parameters that do not require gradients when the exchange is built
(frozen) fill buckets of their own, after the others: they usually have no gradient, and a
bucket goes only once all its gradients are ready or the step ends.  Before the first step, every rank allgathers a digest of the model, the
routing and the settings; ranks that disagree would otherwise issue mismatched collectives
or decode garbage, so every rank raises instead.
"""
from __future__ import annotations

import hashlib
import json
from typing import Dict, List, Sequence, Tuple

import numpy as np
import torch

from ..transport import Transport

__all__ = ["fuse", "agree", "handshake"]


def fuse(named_params: Sequence[Tuple[str, torch.Tensor]], fusion_bytes: int) -> List[List[str]]:
    """Parameter names in buckets: reverse registration order, a bucket closed once it
    holds ``fusion_bytes`` or more of gradient; the parameters that require gradients
    first, then the others.  Raises ValueError if fusion_bytes < 1."""
    if fusion_bytes < 1:
        raise ValueError("fusion_bytes must be >= 1")
    buckets: List[List[str]] = []
    order = list(reversed(list(named_params)))
    for trainable in (True, False):
        cur, cur_bytes = [], 0
        for name, p in order:
            if bool(p.requires_grad) != trainable:
                continue
            cur.append(name)
            cur_bytes += p.numel() * p.element_size()
            if cur_bytes >= fusion_bytes:
                buckets.append(cur)
                cur, cur_bytes = [], 0
        if cur:
            buckets.append(cur)
    return buckets


def agree(transport: Transport, desc: str, what: str) -> None:
    """Allgather a SHA-256 digest of ``desc``; every rank raises RuntimeError (naming the
    ranks that differ from it and quoting its own ``desc``) if any rank's differs."""
    digest = np.frombuffer(hashlib.sha256(desc.encode()).digest(), dtype=np.uint8)
    got = transport.allgather(digest)
    bad = [r for r, d in enumerate(got) if not np.array_equal(d, digest)]
    if bad:
        raise RuntimeError(
            f"hvdcomp: ranks {bad} disagree with rank {transport.rank} on {what}; every rank "
            f"must build the same model and optimizer. This rank has: {desc[:2000]}")


def handshake(transport: Transport, settings: list, buckets: List[List[str]],
              entries: Dict) -> None:
    """Refuse to start (RuntimeError on every rank) unless all ranks agree on ``settings``
    (a JSON-able list), the buckets and every entry's name, shape, dtype, compressor spec
    and path (``entries``: name -> :class:`~hvdcomp.exchange.plan.Entry`)."""
    desc = json.dumps([*settings, buckets,
                       [(e.name, list(e.param.shape), str(e.param.dtype), e.compressor.spec(),
                         e.allreduce) for e in entries.values()]])
    agree(transport, desc, "the parameters (names, shapes, dtypes), the compressor settings "
                           "or the seed")
