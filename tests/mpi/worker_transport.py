"""Both transports deliver every rank's bytes exactly: variable lengths, zero lengths,
messages split into rounds (small max_chunk), the all-to-all, allreduce and broadcast."""
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


def part_of(src, dst, trial):
    """What rank src sends rank dst: empty for some pairs, sizes around the rounds' limits."""
    rng = np.random.default_rng(1000 * trial + 10 * src + dst)
    n = 0 if (src + 2 * dst + trial) % 4 == 0 else int(rng.integers(1, 3000))
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
def alltoall(tname, chunk):
    """Part r of every rank arrives on rank r, whole (some parts empty); a list of another
    length than the world size is a ValueError."""
    rank, size = hvd.rank(), hvd.size()
    tp = transport(tname, chunk)
    for trial in range(4):
        got = tp.alltoall([part_of(rank, r, trial) for r in range(size)])
        assert len(got) == size
        for s in range(size):
            want = part_of(s, rank, trial)
            assert got[s].dtype == np.uint8 and np.array_equal(got[s], want), \
                (tname, chunk, trial, s, len(got[s]), len(want))
    try:
        tp.alltoall([np.zeros(1, np.uint8)] * (size + 1))
        raise AssertionError("alltoall took size + 1 parts")
    except ValueError as e:
        assert "one part per rank" in str(e)


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
