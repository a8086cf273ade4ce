"""Auto's flat-or-hierarchical choice (hvdcomp/exchange/hier_choice.py): the decision follows
the cost model on hand-made costs, both ways (the predicted seconds recomputed here from
the formulas of the module docstring), and with ranks as threads on pretended hosts
($HVDCOMP_TEST_HOSTS) every rank measures, decides alike and runs the chosen path."""
import pytest
import torch

import hvdcomp
from hvdcomp.auto import CodecCost, CostModel, LinkCost
from hvdcomp.exchange import Exchange
from hvdcomp.exchange.hier_choice import decide

from world import run_ranks

SIZES = {"conv": 2_000_000, "fc": 500_000}
H, L = 4, 2
N = H * L
#: 1 Gbit/s-like flat link (per byte each rank contributes), 8 ranks
FLAT = LinkCost(ar_latency=1e-3, ar_per_byte=16e-9, ag_latency=1e-3, ag_per_byte=7 * 8e-9,
                aa_latency=1e-3, aa_per_byte=8e-9)
#: ALQ-like: 2 bits per element, encode 3 ns, decode 1 ns per element
CODEC = CodecCost(encode_fixed=1e-5, encode_per_elem=3e-9, decode_fixed=1e-5,
                  decode_per_elem=1e-9, bytes_fixed=64, bytes_per_elem=2 / 8,
                  fp16_per_elem=1e-9)
#: across hosts: 4 ranks of one local rank, 2 such groups sharing each NIC
CROSS = LinkCost(ar_latency=0, ar_per_byte=0, ag_latency=1e-3, ag_per_byte=2 * 3 * 8e-9,
                 aa_latency=1e-3, aa_per_byte=2 * 8e-9)
ALLOWED = ["none", "fp16", "allgather"]


def model():
    return CostModel(FLAT, CODEC, N, allreduce=True)


def by_hand(host, cross=CROSS, codec=CODEC):
    """(T_flat, T_hier, {tensor: hierarchical path?}) from the formulas, written out."""
    def enc(n):
        return codec.encode_fixed + codec.encode_per_elem * n

    def dec(n):
        return codec.decode_fixed + codec.decode_per_elem * n

    def msg(n):
        return codec.bytes_fixed + codec.bytes_per_elem * n

    t_flat = t_hier = 0.0
    used_flat, used_hier, hier = set(), set(), {}
    for name, n in SIZES.items():
        fp32 = FLAT.ar_per_byte * 4 * n
        fp16 = FLAT.ar_per_byte * 2 * n + codec.fp16_per_elem * n
        ag = enc(n) + FLAT.ag_per_byte * msg(n) + N * dec(n)
        f = min(fp32, fp16, ag)
        used_flat.add("ar" if f in (fp32, fp16) else "ag")
        t_flat += f
        s = n / L
        h = (host.aa_per_byte * 4 * n + enc(s) + cross.ag_per_byte * msg(s) + H * dec(s)
             + host.ag_per_byte * 4 * s)
        hier[name] = h < min(fp32, fp16)
        used_hier.add("hier" if hier[name] else "ar")
        t_hier += h if hier[name] else min(fp32, fp16)
    lat = {"ar": FLAT.ar_latency, "ag": FLAT.ag_latency,
           "hier": host.aa_latency + host.ag_latency + cross.ag_latency}
    t_flat += sum(lat[u] for u in used_flat)
    t_hier += sum(lat[u] for u in used_hier)
    return t_flat, t_hier, hier


def test_fast_host_link_goes_hierarchical():
    host = LinkCost(0, 0, 1e-5, 1e-10, 1e-5, 1e-10)     # shared memory: ~10 GB/s
    t_flat, t_hier, hier = by_hand(host)
    assert t_hier < t_flat and all(hier.values())        # the hand-made case is what we meant
    got = decide(SIZES, model(), ALLOWED, host, CROSS, H, L)
    assert got.hierarchical and "hierarchical" in got.reason
    assert got.flat_s == pytest.approx(t_flat, rel=1e-12)
    assert got.hier_s == pytest.approx(t_hier, rel=1e-12)
    assert got.paths == {"conv": "hierarchical", "fc": "hierarchical"}
    assert got.names == ["conv", "fc"] and (got.hosts, got.ranks_per_host) == (H, L)


def test_slow_host_link_stays_flat():
    host = LinkCost(0, 0, 1e-3, 50e-9, 1e-3, 50e-9)     # slower than the network
    t_flat, t_hier, hier = by_hand(host)
    assert t_hier > t_flat and not any(hier.values())
    got = decide(SIZES, model(), ALLOWED, host, CROSS, H, L)
    assert not got.hierarchical and got.paths == {} and got.names == []
    assert got.reason.startswith("flat") and "hierarchical" in got.reason
    assert got.flat_s == pytest.approx(t_flat, rel=1e-12)
    assert got.hier_s == pytest.approx(t_hier, rel=1e-12)


def test_a_slow_codec_keeps_every_tensor_uncompressed():
    """A codec slower than sending fp16: neither exchange compresses, and it stays flat."""
    slow = CodecCost(1e-5, 1e-6, 1e-5, 1e-6, 64, 3 / 8, 1e-9)
    host = LinkCost(0, 0, 1e-5, 1e-10, 1e-5, 1e-10)
    t_flat, t_hier, hier = by_hand(host, codec=slow)
    assert not any(hier.values())
    got = decide(SIZES, CostModel(FLAT, slow, N), ALLOWED, host, CROSS, H, L)
    assert not got.hierarchical and "fp32/fp16 beats" in got.reason
    assert got.flat_s == pytest.approx(t_flat, rel=1e-12)


def test_latency_counted_per_bucket():
    host = LinkCost(0, 0, 1e-5, 1e-10, 1e-5, 1e-10)
    one = decide(SIZES, model(), ALLOWED, host, CROSS, H, L, buckets=1)
    three = decide(SIZES, model(), ALLOWED, host, CROSS, H, L, buckets=3)
    # flat uses the allgather only (ALQ beats fp16 on this link), hierarchical its three
    assert three.flat_s - one.flat_s == pytest.approx(2 * FLAT.ag_latency, rel=1e-9)
    assert three.hier_s - one.hier_s == pytest.approx(
        2 * (host.aa_latency + host.ag_latency + CROSS.ag_latency), rel=1e-9)


SHAPES = {"a.weight": (300, 410), "b.weight": (70, 30, 5, 5), "b.bias": (70,)}


def params():
    return [(n, torch.nn.Parameter(torch.zeros(s))) for n, s in SHAPES.items()]


def grad(name, rank, step):
    g = torch.Generator().manual_seed(1000 * step + 37 * rank + sum(map(ord, name)))
    return torch.randn(SHAPES[name], generator=g)


@pytest.mark.parametrize("hosts", ["0,0,1,1"])
def test_auto_decides_alike_on_every_rank_and_runs(monkeypatch, hosts, caplog):
    """Threads as ranks on 2 pretended hosts x 2: every rank gets the same HierChoice, the
    decision is decide()'s on the recorded costs, the paths follow it, and a step gives the
    same average on every rank.  The decision is logged once, at INFO (rank 0), its
    numbers at DEBUG (newcomer trial item 5)."""
    monkeypatch.setenv("HVDCOMP_TEST_HOSTS", hosts)
    caplog.set_level("DEBUG", logger="hvdcomp")
    n = len(hosts.split(","))

    def body(rank, tp):
        auto = hvdcomp.Auto("alq:bits=3", calibrate_numel=1 << 15)
        ex = Exchange(params(), auto, tp, fusion_bytes=1 << 20, min_compress_numel=16,
                      seed=5, hierarchy="auto")
        c = ex.hierarchy_choice
        assert c is not None and (c.hosts, c.ranks_per_host) == (2, 2)
        sizes = {x: torch.Size(SHAPES[x]).numel() for x in ("a.weight", "b.weight")}
        again = decide(sizes, auto.model, ["none", "fp16", "allgather", "reduce_scatter"],
                       c.host, c.cross, 2, 2, len(ex.buckets))
        assert again.as_dict() == c.as_dict()
        paths = ex.plan.paths()
        assert (ex.hierarchy is not None) == c.hierarchical
        for x in sizes:
            assert (paths[x] == "hierarchical") == (c.paths.get(x) == "hierarchical")
        for x, e in ex.entries.items():
            e.param.grad = grad(x, rank, 0)
        ex.begin(0)
        for x in ex.entries:
            ex.ready(x)
        res, _ = ex.finish()
        ex.close()
        return c.as_dict(), {x: t.clone() for x, t in res.items()}

    out = run_ranks(n, body)
    for r in out:
        assert isinstance(r, tuple), r
    assert all(o[0] == out[0][0] for o in out)
    for x in SHAPES:
        assert all(torch.equal(out[0][1][x], o[1][x]) for o in out)
    info = [r.getMessage() for r in caplog.records
            if r.name == "hvdcomp" and r.levelname == "INFO" and "hierarch" in r.getMessage()]
    assert info == [f"exchange: {out[0][0]['reason']} (hierarchy='auto', Auto's cost model)"]
    debug = [r.getMessage() for r in caplog.records
             if r.name == "hvdcomp" and r.levelname == "DEBUG"]
    assert f"Auto's hierarchy: {out[0][0]}" in debug
