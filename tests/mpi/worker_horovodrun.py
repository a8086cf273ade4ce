"""The exchange's bit-exactness check (worker_exchange.py) under whatever launched it:
mpirun, or horovodrun with its MPI controller or with Gloo.  First the transport chosen by
default: "mpi" where MPI's world is Horovod's, "horovod" under Gloo (no MPI world), and an
explicit "mpi" under Gloo raises on every rank at construction.  Under Gloo the checks of
worker_exchange.py that name the "mpi" transport run on Horovod's allgather instead."""
import horovod.torch as hvd

import common
import worker_exchange  # noqa: F401  (declares the cases run below)
from cases import registered
from common import say
from hvdcomp.transport import make, select


def main():
    hvd.init()
    gloo = hvd.gloo_enabled() and not hvd.mpi_enabled()
    tp = select(None, hvd)
    want = "horovod" if gloo else "mpi"
    assert tp.name == want and (tp.rank, tp.size) == (hvd.rank(), hvd.size()), \
        (tp.name, want, tp.rank, tp.size)
    if gloo:
        try:
            select("mpi", hvd)
            raise AssertionError("transport='mpi' was accepted under Gloo")
        except RuntimeError as e:
            assert "needs MPI's world to be Horovod's" in str(e), e
        common.make = lambda name, **kw: make("horovod", **kw)     # make_exchange's
    say(hvd.rank(), f"chose {tp.name}")       # overwritten by the marker below
    for _, fn, values in registered("worker_exchange"):    # every case; the first to fail
        fn(*values)                                         # raises
    say(hvd.rank(), "exchange OK")


if __name__ == "__main__":
    main()
