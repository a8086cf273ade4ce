"""Fusion buckets in a fixed order, and the handshake that makes every rank agree on them.

Every rank must issue the same collectives in the same order, whatever order its backward
hooks fire in: the buckets are filled in reverse registration order (the order backward
produces gradients) up to ``fusion_bytes`` of gradient each, and always communicated in
bucket order.  Parameters that do not require gradients when the exchange is built
(frozen) fill buckets of their own, after the others: they usually have no gradient, and a
bucket goes only once all its gradients are ready or the step ends.

Agreement: before the first step, every rank allgathers its settings and a digest of the
model (names, shapes, dtypes) and the routing; ranks that disagree would otherwise issue
mismatched collectives or decode garbage, so every rank raises instead, naming each setting
that differs and the ranks' values (:func:`agree_settings`).  At the first step, every
rank allgathers a digest of its parameters' values (:func:`check_replicas`): replicas that
start from different values would train on silently as different models.
"""
from __future__ import annotations

import hashlib
import json
from typing import Any, Dict, List, Sequence, Tuple

import numpy as np
import torch

from ..errors import Mismatch
from ..transport import Transport

__all__ = ["fuse", "agree", "agree_settings", "handshake", "check_replicas",
           "param_digests"]


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
        raise Mismatch(
            f"hvdcomp: ranks {bad} disagree with rank {transport.rank} on {what}; every rank "
            f"must build the same model and optimizer. This rank has: {desc[:2000]}")


def agree_settings(channel: Transport, settings: Dict[str, Any], what: str) -> None:
    """Allgather ``settings`` (a JSON-able dict) over ``channel``; every rank raises
    :class:`~hvdcomp.errors.Mismatch` naming every key whose value differs between ranks and
    each rank's value (``what`` names the whole, e.g. "the optimizer settings").  One
    collective of any size: ranks that differ in any setting still meet in it."""
    mine = json.dumps(settings, sort_keys=True, default=repr)
    got = channel.allgather(np.frombuffer(mine.encode(), dtype=np.uint8))
    texts = [bytes(g).decode("utf-8", "replace") for g in got]
    if all(t == mine for t in texts):
        return
    ranks = []
    for t in texts:
        try:
            d = json.loads(t)
            ranks.append(d if isinstance(d, dict) else {"?": d})
        except ValueError:
            ranks.append({"?": t[:200]})
    keys = sorted(set().union(*ranks), key=str)
    lines = []
    for k in keys:
        vals = [json.dumps(d.get(k, "<missing>"), sort_keys=True) for d in ranks]
        if len(set(vals)) > 1:
            by_val: Dict[str, List[int]] = {}
            for r, v in enumerate(vals):
                by_val.setdefault(v, []).append(r)
            lines.append(f"  {k}: " + "; ".join(
                f"{v[:300]} on rank{'s' if len(rs) > 1 else ''} {_ranks(rs)}"
                for v, rs in by_val.items()))
    raise Mismatch(f"hvdcomp: the ranks disagree on {what} (rank {channel.rank} reporting); "
                   f"every rank must build the same model and optimizer with the same "
                   f"settings:\n" + "\n".join(lines))


def _ranks(rs: List[int]) -> str:
    return ", ".join(map(str, rs[:16])) + (f" (+{len(rs) - 16} more)" if len(rs) > 16 else "")


def param_digests(tensors: Sequence[torch.Tensor]) -> np.ndarray:
    """An 8-byte BLAKE2b digest of each tensor's bytes (dtype, shape and values), as a
    (len(tensors), 8) uint8 array."""
    out = np.zeros((len(tensors), 8), dtype=np.uint8)
    for i, t in enumerate(tensors):
        h = hashlib.blake2b(digest_size=8)
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        x = t.detach()
        if x.numel():
            h.update(x.cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        out[i] = np.frombuffer(h.digest(), dtype=np.uint8)
    return out


def check_replicas(transport: Transport, named: Sequence[Tuple[str, torch.Tensor]]) -> None:
    """Allgather a digest of every parameter's values (:func:`param_digests`); every rank
    raises :class:`~hvdcomp.errors.Mismatch` if any rank's differ from rank 0's, naming the
    ranks and the first parameters that differ.  Call at the first step, on every rank."""
    mine = param_digests([p for _, p in named])
    got = [g.reshape(-1, 8) for g in transport.allgather(mine.reshape(-1))]
    ref = got[0]
    bad = [r for r, g in enumerate(got) if g.shape != ref.shape or not np.array_equal(g, ref)]
    if not bad:
        return
    names = [n for i, (n, _) in enumerate(named)
             if any(got[r].shape != ref.shape or not np.array_equal(got[r][i], ref[i])
                    for r in bad)]
    raise Mismatch(
        f"hvdcomp: the parameters differ across ranks at the first step: ranks "
        f"{_ranks(bad)} hold other values than rank 0 in {len(names)} of {len(named)} "
        f"tensors ({', '.join(names[:5])}{', ...' if len(names) > 5 else ''}). Data-parallel "
        f"replicas must start equal: broadcast them from one rank before training, "
        f"hvd.broadcast_parameters(model.state_dict(), root_rank=0) (and "
        f"hvd.broadcast_optimizer_state(optimizer, root_rank=0)); or pass "
        f"check_replicas=False if they differ on purpose.")


def handshake(transport: Transport, settings: Dict[str, Any], buckets: List[List[str]],
              entries: Dict) -> None:
    """Refuse to start (:class:`~hvdcomp.errors.Mismatch`, a RuntimeError, on every rank)
    unless all ranks agree on ``settings`` (a JSON-able dict: each differing key is named,
    :func:`agree_settings`), the buckets and every entry's name, shape, dtype, compressor
    spec and path (allreduce, allgather or reduce-scatter) (``entries``: name ->
    :class:`~hvdcomp.exchange.plan.Entry`)."""
    agree_settings(transport, settings, "the exchange settings")
    desc = json.dumps([buckets,
                       [(e.name, list(e.param.shape), str(e.param.dtype), e.compressor.spec(),
                         e.path) for e in entries.values()]])
    agree(transport, desc, "the parameters (names, shapes, dtypes) or the compressor "
                           "settings")
