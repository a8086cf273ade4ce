"""The torch.distributed carriers: bytes over an all-gather into one tensor (counts first,
then every rank's bytes padded to the longest, since Gloo's all-gather needs equal sizes),
sums over ``all_reduce``.

Each carrier runs on a process group of its own (:func:`private_group`, as
:class:`~hvdcomp.transport.MPITransport` duplicates its communicator): the exchange calls
the bytes carrier from its communicate thread and starts sums from its encode thread, and
torch.distributed matches collectives of one group by the order in which they are issued,
so two threads must never share a group, nor hvdcomp share one with DDP's own collectives
(its buffer broadcasts, the unused-parameter map).

Gloo carries CPU tensors; NCCL carries CUDA tensors only: with NCCL the bytes are staged
through a buffer on the current CUDA device.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist

from .base import Allreduce, Transport, packed

__all__ = ["TorchDistTransport", "TorchDistAllreduce", "private_group", "group_device"]


# all_gather_single: PyTorch 2.13's name (all_gather_into_tensor warns there)
_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def private_group(group=None):
    """A new process group with the ranks and backend of ``group`` (default: the default
    group).  Collective: every rank of the default group must call it, in the same order."""
    group = group or dist.group.WORLD
    return dist.new_group(ranks=dist.get_process_group_ranks(group),
                          backend=dist.get_backend(group))


def group_device(group) -> torch.device:
    """Where ``group``'s collectives take their tensors: the current CUDA device for NCCL,
    the CPU otherwise."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class TorchDistTransport(Transport):
    """Framed messages over ``group`` (a process group used by nothing else: see the module
    docstring), with torch.distributed initialized.  ``max_chunk`` as in
    :class:`~hvdcomp.transport.Transport`."""
    name = "torch"

    def __init__(self, group, max_chunk: int = 0):
        super().__init__(max_chunk)
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.device = group_device(group)

    def _gather(self, t: torch.Tensor) -> np.ndarray:
        """Every rank's ``t`` (1-D, the same size on every rank), back to back in rank order,
        as one host array (gathered into one tensor: no list of per-rank outputs)."""
        out = torch.empty(self.size * t.numel(), dtype=t.dtype, device=self.device)
        _gather_into(out, t, group=self.group)
        return out.cpu().numpy()

    def _allgather_counts(self, n: int) -> List[int]:
        got = self._gather(torch.tensor([n], dtype=torch.int64, device=self.device))
        return [int(c) for c in got]

    def _allgatherv(self, data: np.ndarray, counts: Sequence[int]) -> List[np.ndarray]:
        longest = max(counts)
        if longest == 0:                      # nothing from anyone: no collective needed
            return [np.empty(0, np.uint8) for _ in counts]
        buf = np.empty(longest, dtype=np.uint8)
        buf[:len(data)] = data
        buf[len(data):] = 0
        got = self._gather(torch.from_numpy(buf).to(self.device))
        return [got[r * longest:r * longest + c] for r, c in enumerate(counts)]

    def _count_matrix(self, send):
        got = self._gather(torch.tensor(list(send), dtype=torch.int64, device=self.device))
        return np.asarray(got, dtype=np.int64).reshape(self.size, self.size)

    def _alltoallv(self, parts, recv):
        """One ``all_to_all_single`` with uneven splits (Gloo, NCCL and MPI carry them):
        ``parts[r]`` to rank r, ``recv[s]`` bytes from rank s."""
        sizes = [len(p) for p in parts]
        flat = packed(parts)
        if not flat.flags.writeable:
            flat = flat.copy()
        out = torch.empty(int(sum(recv)), dtype=torch.uint8, device=self.device)
        dist.all_to_all_single(out, torch.from_numpy(flat).to(self.device),
                               output_split_sizes=[int(c) for c in recv],
                               input_split_sizes=sizes, group=self.group)
        got = out.cpu().numpy()
        offsets = np.concatenate([[0], np.cumsum(recv)]).astype(np.int64)
        return [got[offsets[s]:offsets[s + 1]] for s in range(self.size)]

    split_refusal = None

    def host_key(self):
        """torchrun's ``GROUP_RANK`` (the node's number) when set, else the host name."""
        import os
        import socket
        node = os.environ.get("GROUP_RANK")
        return f"node:{node}" if node is not None else f"host:{socket.gethostname()}"

    def split(self, colors):
        """A TorchDistTransport over a new process group of the ranks of this rank's color
        (every color's group is made, in color order, on every rank: ``new_group`` is
        collective over the default group)."""
        ranks = dist.get_process_group_ranks(self.group)
        backend = dist.get_backend(self.group)
        mine = None
        for c in sorted(set(int(x) for x in colors)):
            members = [ranks[r] for r, x in enumerate(colors) if int(x) == c]
            g = dist.new_group(ranks=members, backend=backend)
            if c == int(colors[self.rank]):
                mine = g
        return TorchDistTransport(mine, self._max_chunk)

    def allreduce_sum(self, arr):
        t = torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float64).copy()).to(self.device)
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)
        return t.cpu().numpy()

    def broadcast(self, arr, root=0):
        t = torch.from_numpy(np.ascontiguousarray(arr).copy()).to(self.device)
        dist.broadcast(t, src=dist.get_global_rank(self.group, root), group=self.group)
        return t.cpu().numpy()

    def free(self) -> None:
        """Destroy this carrier's process group (for the door that made it private)."""
        self.close()
        dist.destroy_process_group(self.group)


class TorchDistAllreduce(Allreduce):
    """Asynchronous ``all_reduce`` (SUM) of summable buffers over ``group`` (its own group:
    see the module docstring); float32, float64, float16 and bfloat16 buffers on the
    group's device.  Sums are in the backend's order (Gloo's ring, NCCL's), not rank order:
    equal on every rank, but not bit-equal to another carrier's."""
    dtypes = (torch.float32, torch.float64, torch.float16, torch.bfloat16)

    def __init__(self, group):
        self.group = group

    def start(self, buf, name):
        return dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=self.group, async_op=True)

    def wait(self, handle: Optional[dist.Work]):
        handle.wait()

    def free(self) -> None:
        """Destroy this carrier's process group (for the door that made it private)."""
        dist.destroy_process_group(self.group)
