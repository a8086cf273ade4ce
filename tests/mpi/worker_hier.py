"""The hierarchical exchange (hvdcomp/exchange/hier.py) under mpirun, with the hosts given
by $HVDCOMP_TEST_HOSTS (2 hosts x 2 ranks, 2 hosts x 3 ranks: test_mpi_hier.py sets it): every
compressor's average equals, bit for bit on every rank, the single-process computation of
tests/mpi/hier_reference.py; the other tensors as the flat exchange gives them; absent and
joined ranks; a state_dict round trip; an encoder error on one rank raises on every rank."""
import os

import torch

from cases import case, run
from common import SPECS, golden_grad, params
from hier_reference import HierReference

import horovod.torch as horovod
import hvdcomp
from hvdcomp.exchange import Exchange
from hvdcomp.transport import make
from hvdcomp.transport.topology import Topology, discover

COMPRESSORS = ["none", "fp16", "alq:bits=3,bucket_size=512", "dgc:density=0.05,clip_norm=5",
               "topk:density=0.05", "qsgd:bits=4,bucket_size=512", "terngrad",
               "psq:bits=4"]


def layout():
    hosts = [h for h in os.environ["HVDCOMP_TEST_HOSTS"].split(",")]
    H = len(set(hosts))
    return H, len(hosts) // H


def build(spec, **kw):
    kw = dict(dict(fusion_bytes=20000, min_compress_numel=16, seed=3, hierarchy="host"), **kw)
    return Exchange(params(), hvdcomp.get(spec), make("mpi"), **kw)


def run_step(ex, rank, step, grad=golden_grad, absent=()):
    for name, e in ex.entries.items():
        e.param.grad = None if name in absent else grad(name, rank)
    ex.begin(step)
    names = [n for n in ex.entries if n not in absent]
    for name in (names if rank % 2 == 0 else names[::-1]):
        ex.ready(name)
    for name in absent:
        ex.ready(name)
    res, stats = ex.finish()
    return {n: t.clone() for n, t in res.items()}, stats


def same(a, b):
    return a.shape == b.shape and torch.equal(torch.nan_to_num(a, nan=7.5),
                                              torch.nan_to_num(b, nan=7.5))


def same_everywhere(res):
    mine = {n: torch.nan_to_num(t, nan=7.5).tolist() for n, t in sorted(res.items())}
    got = horovod.allgather_object(mine)
    return all(g == got[0] for g in got)


def reference(ex, spec):
    H, L = layout()
    hier = sorted(n for n, e in ex.entries.items() if e.hier)
    return HierReference({n: ex.entries[n].compressor.spec() for n in hier}, H, L, 3,
                         {n: tuple(SPECS[n][0]) for n in hier},
                         {n: ex.entries[n].tensor_id for n in hier}, len(ex.entries))


@case
def topology():
    """discover() reads $HVDCOMP_TEST_HOSTS: host numbers, local ranks, equal counts."""
    rank, size = horovod.rank(), horovod.size()
    H, L = layout()
    topo = discover(make("mpi"))
    assert topo.hosts == tuple(r // L for r in range(size)), topo
    assert (topo.host, topo.local_rank, topo.local_size, topo.equal) == (rank // L, rank % L,
                                                                         L, True)
    assert Topology.from_keys(["a", "b", "a"], 2).counts == [2, 1]


@case.each(COMPRESSORS)
def average(spec):
    """Every rank's averages: the reference's for the hierarchical tensors (two steps: the
    compressors' state), bit-identical on every rank; the others equal to a flat exchange's."""
    rank, size = horovod.rank(), horovod.size()
    ex = build(spec)
    flat = build(spec, hierarchy="flat")
    ex.set_momentum({n: 0.9 for n in SPECS})
    flat.set_momentum({n: 0.9 for n in SPECS})
    hier = {n for n, e in ex.entries.items() if e.hier}
    assert hier == {n for n, (s, _) in SPECS.items()
                    if len(s) > 1 and torch.Size(s).numel() >= 16}, hier
    assert all(ex.plan.paths()[n] == "hierarchical" for n in hier)
    ref = reference(ex, spec)
    ref.set_momentum({n: 0.9 for n in SPECS})
    for step in (0, 5):
        res, stats = run_step(ex, rank, step)
        want = ref.step([{n: golden_grad(n, r) for n in SPECS} for r in range(size)], step)
        for n in hier:
            assert same(res[n], want[n]), (spec, step, n, (res[n] - want[n]).abs().max())
        fres, fstats = run_step(flat, rank, step)
        # the in-host stages count apart; across hosts each rank sends its pieces only
        assert stats.host_bytes > 0 and fstats.host_bytes == 0
        assert stats.bytes_sent < fstats.bytes_sent, (stats.bytes_sent, fstats.bytes_sent)
        for n in set(SPECS) - hier:
            assert (n in res) == (n in fres), n
            if n in res:
                assert same(res[n], fres[n]), (spec, n)
        assert stats.nonfinite == ["nan.weight"], stats.nonfinite
        assert same_everywhere(res)
    ex.close()
    flat.close()


@case
def absent_and_joined():
    """A tensor absent on some ranks counts zeros from them; one absent everywhere has no
    average; a joined rank contributes nothing and the average divides by the others."""
    rank, size = horovod.rank(), horovod.size()
    spec = "none"
    ex = build(spec)
    ref = reference(ex, spec)
    grads = [{n: golden_grad(n, r) for n in SPECS} for r in range(size)]
    # conv.weight absent on rank 1 (zeros there), fc1.weight absent everywhere
    res, _ = run_step(ex, rank, 0,
                      absent=("fc1.weight",) + (("conv.weight",) if rank == 1 else ()))
    grads_z = [dict(g) for g in grads]
    grads_z[1]["conv.weight"] = torch.zeros_like(grads[1]["conv.weight"])
    want = ref.step(grads_z, 0)
    assert "fc1.weight" not in res
    assert same(res["conv.weight"], want["conv.weight"])
    # rank size-1 joined: the others' mean (the sum of theirs over size - 1)
    for name, e in ex.entries.items():
        e.param.grad = golden_grad(name, rank)
    ex.begin(1, joined=rank == size - 1)
    for name in ex.entries:
        ex.ready(name)
    res, stats = ex.finish()
    assert stats.joined == 1, stats.joined
    grads_j = [dict(g) for g in grads]
    grads_j[size - 1] = {n: torch.zeros_like(t) for n, t in grads[size - 1].items()}
    want = ref.step(grads_j, 1)
    w = want["zero.weight"].mul(size / (size - 1))     # the sum over size ranks, rescaled
    assert same(res["zero.weight"], w)
    w = want["conv.weight"].mul(size / (size - 1))
    assert same(res["conv.weight"], w), (res["conv.weight"] - w).abs().max()
    ex.close()


@case
def checkpoint():
    """DGC's residuals live on the pieces' owners: a state_dict after two steps loaded
    into a new exchange gives the third step the same bits as the exchange that went on."""
    rank = horovod.rank()
    spec = "dgc:density=0.05"
    a = build(spec)
    a.set_momentum({n: 0.9 for n in SPECS})
    for step in (0, 1):
        run_step(a, rank, step)
    saved = a.compression.state_dict()
    assert saved, "DGC keeps residuals"
    b = build(spec)
    b.set_momentum({n: 0.9 for n in SPECS})
    b.compression.load_state_dict(saved)
    ra, _ = run_step(a, rank, 2)
    rb, _ = run_step(b, rank, 2)
    for n in ra:
        assert same(ra[n], rb[n]), n
    a.close()
    b.close()
    fresh = build(spec)
    fresh.set_momentum({n: 0.9 for n in SPECS})
    for step in (0, 1):
        run_step(fresh, rank, step, grad=lambda n, r: golden_grad(n, r, seed=11))
    rf, _ = run_step(fresh, rank, 2)
    assert not same(rf["fc1.weight"], ra["fc1.weight"])      # the state mattered
    fresh.close()


def model_fn():
    torch.manual_seed(11)
    return torch.nn.Sequential(torch.nn.Linear(40, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))


def train(spec, steps, rank, model=None, opt_state=None, first=0, **kw):
    import torch.nn.functional as F
    import hvdcomp.torch as hvd
    model = model or model_fn()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters(),
                                   compression=spec, min_compress_numel=16, **kw)
    if opt_state is not None:
        opt.load_state_dict(opt_state)
    for step in range(first, first + steps):
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(16, 40, generator=g), torch.randint(0, 4, (16,), generator=g)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return model, opt


@case.each(["dgc:density=0.05", "alq:bits=3,bucket_size=512,refit_steps=1/2",
            "rs+dgc:density=0.05"])
def optimizer(spec):
    """The drop-in optimizer with hierarchy="host": DGC's momentum by piece label on the
    owners, ALQ's refit (tables identical on every rank), parameters identical on every
    rank, and a state_dict after 2 steps resuming the third step bit-exactly."""
    import copy
    rank = horovod.rank()
    H, L = layout()
    model, opt = train(spec, 2, rank, hierarchy="host")
    assert opt.paths["0.weight"] == "hierarchical" and opt.paths["0.bias"] == "allreduce"
    sd = copy.deepcopy(opt.state_dict())
    assert sd["hvdcomp"]["hierarchy"] == [H, L, rank % L], sd["hvdcomp"]["hierarchy"]
    saved_params = copy.deepcopy(model.state_dict())
    labels = list(opt._driver.exchange.collective.labels())
    if "dgc" in spec:
        assert labels and all(opt.compression.momentum_of(lb) == 0.9 for lb in labels)
        assert any(opt.compression.momentum_buffer(lb) is not None for lb in labels)
        # across hosts over the reduce-scatter: its second stage's residuals checkpoint
        assert len(sd["hvdcomp"]["second_stage_state"]) == (1 if spec.startswith("rs+")
                                                             else 0)
    else:
        assert opt.compression.level_version >= 1
        assert same_everywhere({"levels": opt.compression.levels})
    # the third step, continued and resumed
    import torch.nn.functional as F
    g = torch.Generator().manual_seed(200 + rank)
    x, y = torch.randn(16, 40, generator=g), torch.randint(0, 4, (16,), generator=g)
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()
    assert same_everywhere({n: p.detach() for n, p in model.named_parameters()})
    opt.close()
    model2 = model_fn()
    model2.load_state_dict(saved_params)
    _, opt2 = train(spec, 1, rank, model=model2, opt_state=sd, first=2, hierarchy="host")
    for (n, a), b in zip(model.named_parameters(), model2.parameters()):
        assert torch.equal(a, b), (spec, n)
    # a flat optimizer refuses the hierarchical checkpoint (its state is per piece)
    opt2.close()
    _, flat = train(spec, 0, rank, hierarchy="flat")
    try:
        flat.load_state_dict(sd)
        raise AssertionError("a hierarchical checkpoint loaded into a flat optimizer")
    except ValueError as e:
        assert "hosts" in str(e), e
    flat.close()


@case
def encoder_error():
    """One rank's encoder raises: every rank of every host raises, none waits."""
    rank, size = horovod.rank(), horovod.size()
    ex = build("alq:bits=3,bucket_size=512")
    bad = size - 1
    if rank == bad:
        def broken(e, grads):
            raise ValueError("broken on purpose")
        ex.collective._gradient = broken
    try:
        run_step(ex, rank, 0)
    except Exception as e:                   # noqa: BLE001
        text = str(e)
    else:
        raise AssertionError("no error")
    if rank != bad:
        assert f"rank {bad}" in text or "failed" in text, text
    ex.close()


if __name__ == "__main__":
    run()
