"""The summed buffers of the allgather's summable path (``Entry.allreduce``: ``none``,
``fp16``, ``bf16``): one per wire dtype and bucket, the gradients cast and flattened, then
counts that every rank reads the same (per tensor the ranks with a dense gradient, a sparse
one and a non-finite one; then the ranks that had joined), then one slot per rank where only
that rank writes a small code of its step (:func:`slot_code`; 0: the rank has failed and is
stopping).  Every rank checks the slots, so ranks out of step, or a rank that stops, raise on
every rank (:meth:`Sums.check`).  A tensor whose sum overflowed although no rank's gradient
was non-finite is summed again in float32, each rank's gradient divided by the world size
first (:meth:`Sums.again`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch

from ..compressors.state import finite as all_finite
from ..errors import OutOfStep, RankFailure
from ..ops import divide
from ..transport import Allreduce
from .averaging import Averaging
from .plan import Entry
from .step_stats import StepStats

__all__ = ["Sums", "Sum", "slot_code"]

# slot_code: 1 + 3 * (step mod 85) + origin, at most 255 (exact in float16 and bfloat16)
_SLOT_STEPS = 85
_ORIGIN_BACKWARD, _ORIGIN_SYNC, _ORIGIN_JOINED = 0, 1, 2


def slot_code(step: int, sync: bool, joined: bool) -> int:
    """A rank's code of its step in the summed buffers' per-rank slots: 1 + 3 (step mod 85)
    + origin (0: started by backward, 1: by synchronize()/step(), 2: joined), 1..255, so
    that a float16 or bfloat16 sum of one nonzero code and zeros is exact.  0 marks a rank
    that has failed and is stopping."""
    origin = _ORIGIN_JOINED if joined else _ORIGIN_SYNC if sync else _ORIGIN_BACKWARD
    return 1 + 3 * (int(step) % _SLOT_STEPS) + origin


def _near_step(code: int, step: int) -> int:
    """The step nearest to ``step`` whose slot code has ``code``'s step part."""
    d = ((code - 1) // 3 - step % _SLOT_STEPS + _SLOT_STEPS // 2) % _SLOT_STEPS
    return step + d - _SLOT_STEPS // 2


@dataclass
class Sum:
    """One summed buffer of a bucket: the gradients cast to ``dtype`` and flattened, then
    three counts per tensor (present, sparse, non-finite) and the joined count."""
    handle: Any
    flat: torch.Tensor
    groups: List[Tuple[Entry, int]]
    size: int
    fallback: Dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def counts(self) -> torch.Tensor:
        """3 counts per tensor, then the joined count."""
        end = self.flat.numel() - self.size
        return self.flat[end - 3 * len(self.groups) - 1:end].to(torch.float32)

    @property
    def slots(self) -> List[int]:
        """Every rank's :func:`slot_code`."""
        return [int(round(float(v))) for v in self.flat[self.flat.numel() - self.size:]]


class Sums:
    """The summed buffers of one exchange's buckets, through ``allreduce``; ``averaging``,
    ``rank``, ``size``, ``ident``: as the :class:`~hvdcomp.exchange.collective.Allgather`'s.
    ``job``: the allgather's per-bucket job (``step``, ``sync``, ``grads``, ``failure``)."""

    def __init__(self, allreduce: Optional[Allreduce], averaging: Averaging, rank: int,
                 size: int, ident: int):
        self.allreduce, self.averaging = allreduce, averaging
        self.rank, self.size, self.ident = rank, size, ident

    def start(self, k: int, dt: torch.dtype, es: List[Entry], job,
              failing: bool = False) -> Sum:
        """Flatten the gradients of ``es`` (``job.grads``, else each ``.grad``) cast to
        ``dt``, append the counts and the per-rank slots (this rank's :func:`slot_code`, 0
        when ``failing``: then the gradients are zeros), start the sum."""
        parts, groups, counts = [], [], []
        for e in es:
            g = None if failing else self.averaging.gradient(e, job.grads)
            n = e.param.numel()
            if g is None or g.is_sparse:
                parts.append(torch.zeros(n, dtype=dt, device=e.param.device))
                counts += [0.0, float(g is not None), 0.0]
            else:
                x = g.reshape(-1).to(torch.float32)
                bad = not all_finite(x)
                if e.compressor.prescaled:
                    x = divide(x, self.size)    # before the cast, so sums cannot overflow
                parts.append(x.to(dt))
                counts += [1.0, 0.0, float(bad)]
            groups.append((e, n))
        counts.append(float(self.averaging.joined))
        slots = [0.0] * self.size
        if not failing:
            slots[self.rank] = float(slot_code(job.step, job.sync, self.averaging.joined))
        parts.append(torch.tensor(counts + slots, dtype=dt, device=parts[0].device))
        flat = torch.cat(parts)
        return Sum(self.allreduce.start(flat, f"{k}.{str(dt)[6:]}"), flat, groups, self.size)

    def check(self, s: Sum, job) -> None:
        """Raise (every rank alike: every rank sees the same sums) RankFailure when some
        rank marked itself as failing, OutOfStep when some rank's step code differs."""
        codes = s.slots
        failed = [r for r, c in enumerate(codes) if c == 0]
        if failed:
            if job.failure is not None and codes[self.rank] == 0:
                raise job.failure               # this rank's own error, as with a frame
            r = failed[0]
            raise RankFailure(f"hvdcomp: rank {r} stopped in bucket {job.k} of step "
                              f"{job.step} (it raised an exception, was interrupted or exited "
                              f"during a step; its own output says why)", r)
        mine = codes[self.rank]
        joined = [(c - 1) % 3 == _ORIGIN_JOINED for c in codes]
        bad = [r for r, c in enumerate(codes)
               if (c - 1) // 3 != (mine - 1) // 3
               or (c != mine and not joined[r] and not joined[self.rank])]
        if bad:
            how = {_ORIGIN_BACKWARD: "started by backward", _ORIGIN_SYNC:
                   "started by synchronize()/step()", _ORIGIN_JOINED: "joined"}
            theirs = "; ".join(f"rank {r}: step {_near_step(codes[r], job.step)} "
                               f"({how[(codes[r] - 1) % 3]})" for r in bad[:8])
            raise OutOfStep(
                f"hvdcomp: ranks out of step in bucket {job.k} (summed tensors): this rank "
                f"(rank {self.rank}) is in step {job.step} of exchange {self.ident} "
                f"({how[(mine - 1) % 3]}), but {theirs} (steps modulo {_SLOT_STEPS}). Every "
                f"rank must run the same steps: the same number of backward passes and "
                f"step() calls of each optimizer (a rank that skipped an iteration or called "
                f"step() twice?)", bad)

    def again(self, k: int, i: int, s: Sum, stats: StepStats, grads=None) -> None:
        """Tensors whose sum is not finite although no rank's gradient was: sum them again
        in float32, each rank's gradient divided by the world size first (every rank sees
        the same sums, so every rank takes part)."""
        counts, redo, off = s.counts, [], 0
        for j, (e, n) in enumerate(s.groups):
            if counts[3 * j] > 0 and counts[3 * j + 2] == 0 and not all_finite(s.flat[off:off + n]):
                redo.append((e, n))
            off += n
        if not redo:
            return
        parts = []
        for e, n in redo:
            g = self.averaging.gradient(e, grads)
            parts.append(torch.zeros(n, device=e.param.device) if g is None or g.is_sparse
                         else divide(g.reshape(-1).to(torch.float32), self.size))
        flat = torch.cat(parts)
        self.allreduce.wait(self.allreduce.start(flat, f"{k}.{i}.again"))
        stats.bytes_sent += flat.numel() * 4
        stats.traffic_bytes += 2 * (self.size - 1) / self.size * flat.numel() * 4
        off = 0
        for e, n in redo:
            s.fallback[e.name] = flat[off:off + n]
            off += n
