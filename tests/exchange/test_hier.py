"""The hierarchical exchange (hvdcomp/exchange/hier.py) with ranks as threads
(tests/exchange/world.py), hosts given by $HVDCOMP_TEST_HOSTS: the averages against the
single-process reference of tests/mpi/hier_reference.py on 2 hosts x 2 ranks and 2 x 3,
the topology's arithmetic, and when the exchange is flat or refused."""
import os
import sys

import pytest
import torch

import hvdcomp
from hvdcomp.compressors import examples, registry
from hvdcomp.errors import ConfigError, Mismatch
from hvdcomp.exchange.shards import refusal
from hvdcomp.exchange import Exchange
from hvdcomp.transport.topology import Topology

from world import run_ranks

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "mpi"))
from hier_reference import HierReference  # noqa: E402

SHAPES = {"a.weight": (30, 41), "b.weight": (7, 3, 5, 5), "b.bias": (7,), "c.weight": (3, 3)}


def grad(name, rank, step):
    g = torch.Generator().manual_seed(1000 * step + 37 * rank + sum(map(ord, name)))
    return torch.randn(SHAPES[name], generator=g) * (1 + rank)


def params():
    return [(n, torch.nn.Parameter(torch.zeros(s))) for n, s in SHAPES.items()]


def build(tp, spec, **kw):
    return Exchange(params(), hvdcomp.get(spec), tp, fusion_bytes=4000, min_compress_numel=16,
                    seed=5, **kw)


def step(ex, rank, k):
    for n, e in ex.entries.items():
        e.param.grad = grad(n, rank, k)
    ex.begin(k)
    for n in ex.entries:
        ex.ready(n)
    res, stats = ex.finish()
    return {n: t.clone() for n, t in res.items()}, stats


#: every hvdcomp compressor that can be cut into pieces, by its example spec
#: (hvdcomp.compressors.examples: settings under which its state matters within 3 steps)
EVERY = [spec for name, spec in examples().items()
         if registry()[name].__module__.startswith("hvdcomp.")
         and refusal(hvdcomp.get(spec)) is None]


def test_every_cuttable_compressor_is_covered():
    names = {s.split(":")[0] for s in EVERY}
    assert {"none", "fp16", "alq", "dgc", "topk", "qsgd", "terngrad", "psq"} <= names, names


@pytest.mark.parametrize("hosts", ["0,0,1,1", "0,0,0,1,1,1"])
@pytest.mark.parametrize("spec", EVERY)
def test_average_equals_reference(monkeypatch, hosts, spec):
    monkeypatch.setenv("HVDCOMP_TEST_HOSTS", hosts)
    n = len(hosts.split(","))
    H, L = 2, n // 2

    def body(rank, tp):
        ex = build(tp, spec, hierarchy="host")
        hier = sorted(x for x, e in ex.entries.items() if e.hier)
        assert hier == ["a.weight", "b.weight"]
        ref = HierReference(spec, H, L, 5, {x: SHAPES[x] for x in hier},
                            {x: ex.entries[x].tensor_id for x in hier}, len(ex.entries))
        flat = build(tp, spec, hierarchy="flat")
        for x in (ex, flat, ref):
            x.set_momentum({y: 0.9 for y in SHAPES})
        for k in (0, 1, 2):
            res, stats = step(ex, rank, k)
            want = ref.step([{x: grad(x, r, k) for x in SHAPES} for r in range(n)], k)
            for x in hier:
                assert torch.equal(res[x], want[x]), (x, k)
            fres, _ = step(flat, rank, k)
            for x in set(SHAPES) - set(hier):
                assert torch.equal(res[x], fres[x]), x
        ex.close()
        flat.close()
        return res

    out = run_ranks(n, body)
    for r in out:
        assert isinstance(r, dict), r
    for x in SHAPES:
        assert all(torch.equal(out[0][x], o[x]) for o in out)


def test_topology_arithmetic():
    t = Topology.from_keys(["x", "x", "y", "y", "x", "y"], 4)
    assert t.hosts == (0, 0, 1, 1, 0, 1) and t.counts == [3, 3] and t.equal
    assert (t.host, t.local_rank, t.local_size) == (0, 2, 3)
    assert t.ranks_of(1) == [2, 3, 5] and t.local_rank_of(5) == 2
    u = Topology.from_keys(["x", "x", "y"], 2)
    assert not u.equal and u.counts == [2, 1] and "unequal" in u.describe()


def _outcome(hosts, hierarchy, spec="qsgd:bits=4", n=None, monkeypatch=None, **kw):
    monkeypatch.setenv("HVDCOMP_TEST_HOSTS", hosts)
    n = n or len(hosts.split(","))

    def body(rank, tp):
        h = hierarchy(rank) if callable(hierarchy) else hierarchy
        ex = build(tp, spec, hierarchy=h, **kw)
        paths = set(ex.plan.paths().values())
        ex.close()
        return paths
    return run_ranks(n, body)


def test_flat_or_refused(monkeypatch):
    kw = dict(monkeypatch=monkeypatch)
    # unequal hosts: flat with auto, ConfigError on every rank with host
    assert all("hierarchical" not in p for p in _outcome("0,0,1", "auto", **kw))
    got = _outcome("0,0,1", "host", **kw)
    assert all(isinstance(e, ConfigError) and "[2, 1]" in str(e) for e in got), got
    # one rank per host: flat, also when forced; one host: flat with auto
    assert all("hierarchical" not in p for p in _outcome("0,1,2", "host", **kw))
    assert all("hierarchical" not in p for p in _outcome("0,0,0", "auto", **kw))
    # 2 x 2: auto is hierarchical
    assert all("hierarchical" in p for p in _outcome("0,0,1,1", "auto", **kw))
    # a compressor that cannot be cut: flat with auto, refused with host
    assert all("hierarchical" not in p for p in _outcome("0,0,1,1", "auto", "laq", **kw))
    got = _outcome("0,0,1,1", "host", "laq", **kw)
    assert all(isinstance(e, ConfigError) and "laq" in str(e) for e in got), got
    # ranks that disagree on the setting: refused at the handshake, on every rank
    got = _outcome("0,0,1,1", lambda r: "host" if r == 0 else "auto", **kw)
    assert all(isinstance(e, Mismatch) and "hierarchy" in str(e) for e in got), got
    got = _outcome("0,0,1,1", "hosts", **kw)
    assert all(isinstance(e, ConfigError) for e in got), got


@pytest.mark.parametrize("hosts", ["0,0,1,1", "0,0,0,1,1,1"])
@pytest.mark.parametrize("spec", ["alq:bits=3,bucket_size=128", "dgc:density=0.05",
                                  "topk:density=0.1", "topk:density=0.1,values=int4",
                                  "psq:bits=4"])
def test_reduce_scatter_across_hosts(monkeypatch, hosts, spec):
    """collective="reduce_scatter": the host means of each local rank's pieces go through
    the reduce-scatter among the hosts; the averages equal tests/mpi/scatter_reference.py's
    computation on the host means (H simulated ranks), bit for bit, on every rank."""
    from scatter_reference import Reference
    monkeypatch.setenv("HVDCOMP_TEST_HOSTS", hosts)
    n = len(hosts.split(","))
    H, L = 2, n // 2

    def body(rank, tp):
        ex = build(tp, spec, hierarchy="host", collective="reduce_scatter")
        ex.set_momentum({y: 0.9 for y in SHAPES})
        col = ex.collective
        hier = sorted(x for x, e in ex.entries.items() if e.hier)
        assert hier == ["a.weight", "b.weight"]
        lay = col.inner.layout
        ref = Reference(spec, H, seed=5)
        ref.set_momentum({p.label: 0.9 for b in lay for m in b for p in m})
        mine = {v.name: (x, col.pieces[x][col.local]) for x, v in col.virtual.items()}
        for k in (0, 1, 2):
            res, stats = step(ex, rank, k)
            g = [{x: grad(x, r, k) for x in SHAPES} for r in range(n)]
            means = [{lab: sum_local(g, h, L, x, p) for lab, (x, p) in mine.items()}
                     for h in range(H)]
            want = ref.step(lay, {lab: p.shape for lab, (x, p) in mine.items()}, means, k)
            for lab, (x, p) in mine.items():
                got = res[x][p.lo:p.hi]
                assert torch.equal(got, want[lab]), (x, k, (got - want[lab]).abs().max())
        assert ex.second_stages() == col.inner.second_stages()
        ex.close()
        return res

    out = run_ranks(n, body)
    for r in out:
        assert isinstance(r, dict), r
    for x in SHAPES:
        assert all(torch.equal(out[0][x], o[x]) for o in out)


def sum_local(g, h, L, name, p):
    """Host h's mean of piece p of ``name``: float32 sum in local-rank order, / L."""
    s = torch.zeros(p.numel, dtype=torch.float32)
    for j in range(L):
        s.add_(g[h * L + j][name].reshape(-1).to(torch.float32)[p.lo:p.hi])
    return (s / L).view(p.shape)


def test_model_scope_step_through_the_hierarchy(monkeypatch):
    """uniformef with step_scope "model" (one step for every tensor, from the previous step's
    mean square over all the tensors a compressor encoded): the reference of
    test_average_equals_reference with one compressor per host shared by the tensors (as
    the exchange has), over three steps so that the model's step is used."""
    monkeypatch.setenv("HVDCOMP_TEST_HOSTS", "0,0,1,1")
    spec = "uniformef:bits=6,bucket_size=256,variance_target=0.03,step_scope=model"

    def body(rank, tp):
        ex = build(tp, spec, hierarchy="host")
        hier = sorted(x for x, e in ex.entries.items() if e.hier)
        ref = HierReference(spec, 2, 2, 5, {x: SHAPES[x] for x in hier},
                            {x: ex.entries[x].tensor_id for x in hier}, len(ex.entries))
        # in the exchange, the rank of local rank l on host h encodes the pieces l of every
        # tensor with its one compressor: so does the reference here
        owner = {label: l for x in hier for l, *_, label in ref.pieces(x)}
        comps = {(h, l): hvdcomp.get(spec) for h in range(2) for l in range(2)}

        class PerOwner:
            def __init__(self, h):
                self.h = h

            def encode(self, x, key):
                return comps[self.h, owner[key.name]].encode(x, key)

            def __getattr__(self, attr):        # decode, finalize, shard_unit: stateless
                return getattr(comps[self.h, 0], attr)

        for h in range(2):
            ref.comps[h] = {x: PerOwner(h) for x in hier}
        shared = comps[0, 0]
        used = []
        for k in (0, 1, 2):
            res, _ = step(ex, rank, k)
            want = ref.step([{x: grad(x, r, k) for x in SHAPES} for r in range(4)], k)
            for x in hier:
                assert torch.equal(res[x], want[x]), (x, k)
            used.append(shared.state_dict().get("mean_square"))
        ex.close()
        assert used[0] and used[1] != used[0]          # the statistic moved with the steps
        return res

    out = run_ranks(4, body)
    for r in out:
        assert isinstance(r, dict), r
    for x in SHAPES:
        assert all(torch.equal(out[0][x], o[x]) for o in out)
