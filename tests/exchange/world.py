"""N ranks as N threads of one process: a Transport whose collectives meet at a barrier, so
the exchange core (its pipeline threads included) runs as it does under MPI, in a test."""
from __future__ import annotations

import threading
from typing import Callable, List

import numpy as np

from hvdcomp.transport import Transport

TIMEOUT = 60.0          # a collective that some rank never joins fails the test, never hangs


class World:
    """The meeting point of ``size`` ThreadTransports."""

    def __init__(self, size: int):
        self.size = size
        self._barrier = threading.Barrier(size, timeout=TIMEOUT)
        self._slots: list = [None] * size
        self.calls = 0                  # collectives completed (counted by rank 0)
        self._subs: dict = {}
        self._lock = threading.Lock()

    def sub(self, key, size: int) -> "World":
        """The sub-world ``key`` of ``size`` ranks (made by the first rank that asks)."""
        with self._lock:
            return self._subs.setdefault(key, World(size))

    def gather(self, rank: int, value) -> list:
        """Every rank's ``value``, indexed by rank (a collective)."""
        self._slots[rank] = value
        self._barrier.wait()
        got = list(self._slots)
        self._barrier.wait()            # nobody overwrites a slot before all have read
        if rank == 0:
            self.calls += 1
        return got


class ThreadTransport(Transport):
    name = "threads"

    split_refusal = None

    def __init__(self, world: World, rank: int, max_chunk: int = 0):
        super().__init__(max_chunk)
        self.world, self.rank, self.size = world, rank, world.size
        self._splits = 0

    def host_key(self):
        return f"thread-rank:{self.rank}"          # every rank a host of its own

    def split(self, colors):
        """A ThreadTransport over the ranks of this rank's color (Transport.split)."""
        self._splits += 1
        members = [r for r, c in enumerate(colors) if c == colors[self.rank]]
        return ThreadTransport(self.world.sub((self._splits, colors[self.rank]), len(members)),
                               members.index(self.rank), self._max_chunk)

    def _allgather_counts(self, n):
        return self.world.gather(self.rank, n)

    def _allgatherv(self, data, counts):
        got = self.world.gather(self.rank, np.array(data, dtype=np.uint8, copy=True))
        assert [len(g) for g in got] == list(counts)
        return got

    def _count_matrix(self, send):
        return np.array(self.world.gather(self.rank, list(send)), dtype=np.int64)

    def _alltoallv(self, parts, recv):
        got = self.world.gather(self.rank, [np.array(p, dtype=np.uint8, copy=True)
                                            for p in parts])
        out = [g[self.rank] for g in got]
        assert [len(o) for o in out] == list(recv)
        return out

    def allreduce_sum(self, arr):
        got = self.world.gather(self.rank, np.asarray(arr, dtype=np.float64))
        return np.sum(np.stack(got), axis=0)

    def broadcast(self, arr, root=0):
        return np.array(self.world.gather(self.rank, np.array(arr, copy=True))[root],
                        copy=True)


def run_ranks(size: int, fn: Callable[[int, ThreadTransport], object],
              max_chunk: int = 0) -> List[object]:
    """``fn(rank, transport)`` on ``size`` threads; returns each rank's result or the
    exception it raised (indexed by rank)."""
    world = World(size)
    out: List[object] = [None] * size

    def body(r):
        try:
            out[r] = fn(r, ThreadTransport(world, r, max_chunk))
        except BaseException as e:      # noqa: BLE001 - handed to the test
            out[r] = e

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(4 * TIMEOUT)
        assert not t.is_alive(), "a rank hung"
    return out
