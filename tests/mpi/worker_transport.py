"""Both transports deliver every rank's bytes exactly: variable lengths, zero lengths,
messages split into rounds (small max_chunk), allreduce and broadcast."""
import sys

import numpy as np

from common import say

import horovod.torch as hvd
from hvdcomp.transport import make


def data_of(rank, trial):
    rng = np.random.default_rng(100 * trial + rank)
    n = 0 if (rank + trial) % 3 == 0 else int(rng.integers(1, 5000))
    return rng.integers(0, 256, n, dtype=np.uint8)


def main():
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    results = {}
    for tname in ("mpi", "horovod"):
        for chunk in (0, 7, 1000):
            tp = make(tname, max_chunk=chunk)
            assert (tp.rank, tp.size) == (rank, size)
            for trial in range(4):
                got = tp.allgather(data_of(rank, trial))
                assert len(got) == size
                for r in range(size):
                    want = data_of(r, trial)
                    assert got[r].dtype == np.uint8 and np.array_equal(got[r], want), \
                        (tname, chunk, trial, r, len(got[r]), len(want))
                results[(tname, chunk, trial)] = [g.tobytes() for g in got]
            s = tp.allreduce_sum(np.array([rank + 0.5, 2.0 * rank]))
            assert np.array_equal(s, np.array([sum(r + 0.5 for r in range(size)),
                                               sum(2.0 * r for r in range(size))]))
            b = tp.broadcast(np.array([rank + 10, rank + 20], dtype=np.float32), root=0)
            assert np.array_equal(b, np.array([10, 20], dtype=np.float32))
    say(rank, "transport OK")


if __name__ == "__main__":
    main()
