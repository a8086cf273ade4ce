"""The hierarchy's bad input under mpirun on 3 ranks, hosts "0,0,1" ($HVDCOMP_TEST_HOSTS,
set by test_mpi_hier.py): unequal hosts are flat with hierarchy="auto" (the same numbers as
"flat") and a ConfigError on every rank with "host"; one rank per host is flat; ranks
that disagree on the setting are refused at the handshake; Horovod's transport and an
unknown value are refused."""
import os

import torch

from cases import case, run
from common import SPECS, golden_grad, params

import horovod.torch as horovod
import hvdcomp
from hvdcomp.errors import ConfigError, Mismatch
from hvdcomp.exchange import Exchange
from hvdcomp.transport import make

SPEC = "alq:bits=3,bucket_size=512"


def build(transport="mpi", **kw):
    kw = dict(dict(fusion_bytes=20000, min_compress_numel=16, seed=3), **kw)
    return Exchange(params(), hvdcomp.get(SPEC), make(transport), **kw)


def results(ex, step=0):
    rank = horovod.rank()
    for name, e in ex.entries.items():
        e.param.grad = golden_grad(name, rank)
    ex.begin(step)
    for name in ex.entries:
        ex.ready(name)
    res, _ = ex.finish()
    return {n: torch.nan_to_num(t, nan=7.5).clone() for n, t in res.items()}


def raises(kind, fn, *words):
    try:
        fn()
    except kind as e:
        for w in words:
            assert w in str(e), (w, str(e))
        return
    raise AssertionError(f"no {kind.__name__}")


def flat_like(ex):
    """ex is flat and gives the flat exchange's numbers."""
    assert "hierarchical" not in ex.plan.paths().values(), ex.plan.paths()
    assert ex.hierarchy is None
    ref = build(hierarchy="flat")
    a, b = results(ex), results(ref)
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    ex.close()
    ref.close()


@case
def unequal_auto_is_flat():
    flat_like(build(hierarchy="auto"))


@case
def unequal_host_raises():
    raises(ConfigError, lambda: build(hierarchy="host"), "unequal", "[2, 1]")


@case
def one_rank_per_host_is_flat():
    old = os.environ["HVDCOMP_TEST_HOSTS"]
    os.environ["HVDCOMP_TEST_HOSTS"] = "a,b,c"
    try:
        flat_like(build(hierarchy="host"))
        flat_like(build(hierarchy="auto"))
    finally:
        os.environ["HVDCOMP_TEST_HOSTS"] = old


@case
def disagreeing_ranks_refused():
    mine = "host" if horovod.rank() == 0 else "auto"
    raises(Mismatch, lambda: build(hierarchy=mine), "hierarchy")


@case
def horovod_transport():
    raises(ConfigError, lambda: build("horovod", hierarchy="host"), "transport='mpi'")
    flat_like(build("horovod", hierarchy="auto"))


@case
def unknown_value():
    raises(ConfigError, lambda: build(hierarchy="hosts"), "auto, flat, host")


@case
def bad_override():
    old = os.environ["HVDCOMP_TEST_HOSTS"]
    os.environ["HVDCOMP_TEST_HOSTS"] = "0,1"
    try:
        raises(ConfigError, lambda: build(hierarchy="auto"), "one host label per rank")
    finally:
        os.environ["HVDCOMP_TEST_HOSTS"] = old


if __name__ == "__main__":
    run()
