"""Both transports deliver every rank's bytes exactly: variable lengths, zero lengths,
messages split into rounds (small max_chunk), allreduce and broadcast."""
import functools

import numpy as np

import common  # noqa: F401  (the repository on sys.path)
from cases import case, run

import horovod.torch as hvd
from hvdcomp.transport import make

TRANSPORTS = ["mpi", "horovod"]
CHUNKS = [0, 7, 1000]


def data_of(rank, trial):
    rng = np.random.default_rng(100 * trial + rank)
    n = 0 if (rank + trial) % 3 == 0 else int(rng.integers(1, 5000))
    return rng.integers(0, 256, n, dtype=np.uint8)


@functools.lru_cache(maxsize=None)
def transport(tname, chunk):
    """One transport per setting, used by all three cases (allreduce and broadcast after
    the allgathers)."""
    return make(tname, max_chunk=chunk)


@case.each(TRANSPORTS, CHUNKS)
def allgather(tname, chunk):
    """Every rank's bytes (some empty) arrive on every rank, whole."""
    rank, size = hvd.rank(), hvd.size()
    tp = transport(tname, chunk)
    assert (tp.rank, tp.size) == (rank, size)
    for trial in range(4):
        got = tp.allgather(data_of(rank, trial))
        assert len(got) == size
        for r in range(size):
            want = data_of(r, trial)
            assert got[r].dtype == np.uint8 and np.array_equal(got[r], want), \
                (tname, chunk, trial, r, len(got[r]), len(want))


@case.each(TRANSPORTS, CHUNKS)
def allreduce_sum(tname, chunk):
    rank, size = hvd.rank(), hvd.size()
    s = transport(tname, chunk).allreduce_sum(np.array([rank + 0.5, 2.0 * rank]))
    assert np.array_equal(s, np.array([sum(r + 0.5 for r in range(size)),
                                       sum(2.0 * r for r in range(size))])), s


@case.each(TRANSPORTS, CHUNKS)
def broadcast(tname, chunk):
    rank = hvd.rank()
    b = transport(tname, chunk).broadcast(np.array([rank + 10, rank + 20], dtype=np.float32),
                                          root=0)
    assert np.array_equal(b, np.array([10, 20], dtype=np.float32)), b


if __name__ == "__main__":
    run()
