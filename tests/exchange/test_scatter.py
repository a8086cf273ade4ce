"""The reduce-scatter collective on 2, 3 and 4 ranks (threads of one process, the exchange's
own pipeline threads included): the cut into shards (hand-worked), every compressor equal
bit for bit to a single-process computation of the same messages, the variance of the
two-stage estimate against its formula, ALQ's refit as before, and bad input.  The same
collective under MPI and Horovod: tests/mpi/worker_scatter.py."""
import math
import os
import sys
import time

import numpy as np
import pytest
import torch

import hvdcomp
from hvdcomp.exchange import Exchange, ReduceScatter
from hvdcomp.exchange.shards import REFUSED, boundaries, layout, refusal, second_stage, unit

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "mpi"))
from common import SPECS, golden_grad, params  # noqa: E402
from scatter_reference import Reference  # noqa: E402
from world import run_ranks  # noqa: E402

SCATTERED = ["qsgd:bits=4,bucket_size=512", "qsgdinf:bits=3,bucket_size=100",
             "nuqsgd:bits=2,bucket_size=1000", "alq:bits=3,bucket_size=512",
             "amq:bits=3,bucket_size=512", "alq:bits=4,bucket_size=8192,entropy=1",
             "terngrad", "terngrad:bucket_size=256", "signef", "signef:bucket_size=300",
             "psq:bits=4", "bhq:bits=4,block_size=4", "dqsg:bits=4,bucket_size=512",
             "dqsg:bits=6,bucket_size=256,entropy=True,variance_target=0.03",
             "uniformef:bits=6,bucket_size=256,variance_target=0.03",
             "uniformef:bits=6,bucket_size=256,variance_target=0.03,step_scope=model",
             "topk:density=0.05", "randk:density=0.1", "dgc:density=0.05,clip_norm=5",
             "none", "fp16", "bf16"]


# --- the cut -----------------------------------------------------------------------------

def test_boundaries_hand_worked():
    # 30300 elements in 4 shards: targets 7575, 15150, 22725; units 4096, 1, 8192
    # 7575 -> nearest multiple of 4096 in tensor 0: 8192; 15150 is 4850 into tensor 2
    # (starts at 10300): nearest multiple of 8192 -> 8192, i.e. 18492; 22725 -> 12425 in
    # tensor 2 -> 16384 -> 26684
    assert boundaries([10000, 300, 20000], [4096, 1, 8192], 4) == [0, 8192, 18492, 26684,
                                                                    30300]
    # one bucket among 4 ranks: one owner gets it, the other shards are empty
    assert boundaries([8192], [8192], 4) == [0, 0, 8192, 8192, 8192]
    # a shard smaller than a bucket is never cut out: 1000 elements in 8192-buckets
    assert boundaries([1000], [8192], 3) == [0, 0, 1000, 1000]
    assert boundaries([100], [1], 3) == [0, 33, 67, 100]
    assert boundaries([0, 0], [1, 1], 2) == [0, 0, 0]
    assert boundaries([], [], 3) == [0, 0, 0, 0]


class _E:
    def __init__(self, name, shape, comp):
        self.name, self.param, self.compressor, self.scatter = name, torch.zeros(shape), comp, True


def test_layout_pieces_cover_every_tensor_once_along_units():
    q = hvdcomp.get("qsgd:bits=4,bucket_size=512")
    psq = hvdcomp.get("psq:bits=4")
    es = {"a": _E("a", (7, 3, 5, 5), q), "b": _E("b", (300, 41), psq),
          "c": _E("c", (0, 5), q), "d": _E("d", (40,), psq)}
    lay = layout([["a", "b"], ["c", "d"]], es, 3, first_id=10)
    ids = [p.tensor_id for b in lay for mine in b for p in mine]
    assert ids == list(range(10, 10 + 2 * len(ids), 2))      # two ids per piece
    for name, e in es.items():
        ps = sorted((p for b in lay for mine in b for p in mine if p.name == name),
                    key=lambda p: p.lo)
        n = e.param.numel()
        assert sum(p.numel for p in ps) == n                  # once, no gaps, no overlap
        assert all(a.hi == b.lo for a, b in zip(ps, ps[1:]))
        u = unit(e.compressor, tuple(e.param.shape))
        assert all(p.lo % u == 0 and (p.hi % u == 0 or p.hi == n) for p in ps)
        assert all(math.prod(p.shape) == p.numel for p in ps)
    # PSQ: whole rows of 41; a 1-D tensor is one row, never cut
    assert all(p.shape[1] == 41 for b in lay for m in b for p in m if p.name == "b")
    assert [p.shape for b in lay for m in b for p in m if p.name == "d"] == [(40,)]
    assert unit(psq, (300, 41)) == 41 and unit(q, (9,)) == 512
    assert unit(hvdcomp.get("terngrad"), (9,)) == 1                # bucket_size 0: per piece
    assert unit(hvdcomp.get("signef:bucket_size=64"), (9,)) == 64


def test_refused_compressors_name_the_reason():
    assert refusal(hvdcomp.get("ndqsg")) == REFUSED["ndqsg"] and "side information" in \
        REFUSED["ndqsg"]
    assert refusal(hvdcomp.get("laq")) == REFUSED["laq"] and "skip" in REFUSED["laq"]
    assert all(refusal(hvdcomp.get(s)) is None for s in SCATTERED)

    def build(spec, coll):
        def fn(rank, tp):
            return Exchange(params(), hvdcomp.get(spec), tp, min_compress_numel=16,
                            collective=coll)
        return fn
    for spec in ("ndqsg:bits=4", "laq:bits=4"):
        got = run_ranks(2, build(spec, "reduce_scatter"))
        assert all(isinstance(g, hvdcomp.ConfigError) and "reduce-scatter" in str(g)
                   and REFUSED[spec.split(":")[0]][:30] in str(g) for g in got), got
        # "auto" never picks it for them: everything over the allgather, nothing measured
        got = run_ranks(2, build(spec, "auto"))
        assert all(isinstance(g, Exchange) and g.auto is None
                   and "reduce_scatter" not in g.plan.paths().values() for g in got), got


# --- equal to a single-process computation of the same messages --------------------------

SHAPES = {n: s for n, (s, _) in SPECS.items()}


def _rs_run(spec, size, steps=(0, 5), compress_1d=False, fusion_bytes=20000):
    """Every rank's results of ``steps`` over the reduce-scatter, the layout, the plan."""
    def fn(rank, tp):
        ex = Exchange(params(), hvdcomp.get(spec), tp, fusion_bytes=fusion_bytes,
                      min_compress_numel=0, compress_1d=compress_1d, seed=3,
                      collective="reduce_scatter")
        ex.set_momentum({n: 0.9 for n in SPECS})
        res = []
        for step in steps:
            for name, e in ex.entries.items():
                e.param.grad = golden_grad(name, rank)
            ex.begin(step)
            names = list(ex.entries)
            for name in (names if rank % 2 == 0 else names[::-1]):
                ex.ready(name)
            r, st = ex.finish()
            res.append(({n: t.clone() for n, t in r.items()}, st))
        ex.close()
        return res, ex.collective.layout, ex.plan.paths()
    got = run_ranks(size, fn)
    for g in got:
        if isinstance(g, BaseException):
            raise g
    return got


@pytest.mark.parametrize("size", [2, 3, 4])
@pytest.mark.parametrize("spec", SCATTERED)
def test_equal_to_single_process(spec, size):
    got = _rs_run(spec, size, compress_1d=(size == 3))
    lay, paths = got[0][1], got[0][2]
    scattered = {n for n, p in paths.items() if p == "reduce_scatter"}
    # everything floating goes over the reduce-scatter here (min_compress_numel=0)
    assert scattered == set(SPECS) - ({"fc1.bias"} if size != 3 else set())
    ref = Reference(spec, size, seed=3)
    ref.set_momentum({p.label: 0.9 for b in lay for m in b for p in m})
    for i, step in enumerate((0, 5)):
        grads = [{n: golden_grad(n, r) for n in SPECS} for r in range(size)]
        want = ref.step(lay, {n: SHAPES[n] for n in scattered}, grads, step)
        for rank in range(size):
            res, st = got[rank][0][i]
            for n in SPECS:          # every rank holds the same bits, all tensors
                assert torch.equal(torch.nan_to_num(res[n], nan=7.5),
                                   torch.nan_to_num(got[0][0][i][0][n], nan=7.5)), (n, rank)
            for n in scattered:
                assert torch.equal(torch.nan_to_num(res[n], nan=7.5),
                                   torch.nan_to_num(want[n], nan=7.5)), \
                    (spec, size, step, n, (res[n] - want[n]).abs().max())
            assert st.nonfinite == ["nan.weight"]
            assert res["empty.weight"].numel() == 0
            assert st.bytes_sent > 0 and st.recv_bytes > 0


def test_unbiased_casts_and_shards_smaller_than_a_bucket():
    # 'none' over the reduce-scatter is exact: fp32 sums of the ranks' values, averaged once
    got = _rs_run("none", 4, steps=(0,))
    res = got[2][0][0][0]
    for n in ("fc1.weight", "conv.weight", "double.weight"):
        want = torch.stack([golden_grad(n, r).float() for r in range(4)]).sum(0) / 4
        assert torch.equal(res[n], want.reshape(-1)), n
    # buckets of 8192 > every tensor: each tensor is one piece, on some owner, whole
    got = _rs_run("qsgd:bits=4,bucket_size=8192", 4, steps=(0,))
    lay = got[0][1]
    sizes = [sum(p.numel for p in mine) for b in lay for mine in b]
    assert 0 in sizes                                         # empty shards
    assert all(p.lo == 0 for b in lay for m in b for p in m
               if math.prod(SHAPES[p.name]) <= 8192)


# --- the variance of the two-stage estimate ----------------------------------------------

@pytest.mark.parametrize("spec", ["qsgd:bits=3,bucket_size=64", "terngrad:clip=0,bucket_size=64"])
def test_two_stage_variance_matches_the_formula(spec):
    """y = Q2(a), a = (1/N) sum_r Q_r(g_r): E y = mean g and
    E||y - mean g||^2 = sum_r Var Q(g_r) / N^2 + E Var Q2(a)   (independent Philox streams),
    Q2 the second stage: QSGD at 5 bits (its uniform 5-bit table holds the 3-bit one),
    TernGrad itself.  The variance with Q2 = Q (the second stage before #11 item 5) is
    rejected where they differ."""
    size, steps, n = 3, 300, 1000
    gs = [torch.randn(n, generator=torch.Generator().manual_seed(40 + r)) * (1 + r)
          for r in range(size)]

    def fn(rank, tp):
        p = torch.nn.Parameter(torch.zeros(n))
        ex = Exchange([("w", p)], hvdcomp.get(spec), tp, min_compress_numel=0,
                      compress_1d=True, seed=11, collective="reduce_scatter")
        p.grad = gs[rank].clone()
        ys = []
        for step in range(steps):
            ex.begin(step)
            ex.ready("w")
            ys.append(ex.finish()[0]["w"].clone())
        lay = ex.collective.layout
        ex.close()
        return torch.stack(ys), lay
    got = run_ranks(size, fn)
    ys, lay = got[0]
    assert all(torch.equal(g[0], ys) for g in got)
    comp = hvdcomp.get(spec)
    q2 = second_stage(comp)
    finer = spec.split(":")[0] != "terngrad"
    assert (q2 is not comp and q2.bits == 5 and q2.levels.numel() == 16) if finer else q2 is comp
    mean = torch.stack(gs).mean(0)
    pieces = [p for b in lay for m in b for p in m]
    # the first stage's average a of every step, from the same messages (stage 1 only)
    var_a, var_a_same = [], []
    for step in range(steps):
        a = torch.zeros(n)
        for p in pieces:
            acc = torch.zeros(p.numel)
            for r in range(size):
                key = p.key(step, r, size, 11)
                comp.decode(comp.encode(gs[r][p.lo:p.hi], key), key, acc)
            a[p.lo:p.hi] = acc / size
        var_a.append(sum(q2.variance(a[p.lo:p.hi]) for p in pieces))
        var_a_same.append(sum(comp.variance(a[p.lo:p.hi]) for p in pieces))
    first = sum(comp.variance(gs[r][p.lo:p.hi]) for r in range(size) for p in pieces) / size ** 2
    formula = first + float(np.mean(var_a))
    err = ((ys.double() - mean.double()) ** 2).sum(1)
    measured = float(err.mean())
    se = float(err.std()) / math.sqrt(steps)
    assert abs(measured - formula) < 4 * se, (measured, formula, se)
    # both stages count: leaving either out is many standard errors off
    assert first > 10 * se and formula - first > 10 * se, (first, formula, se)
    if finer:       # the finer stage: every coordinate's variance at most the 3-bit one's
        assert all(x <= y * (1 + 1e-6) for x, y in zip(var_a, var_a_same))
        same = first + float(np.mean(var_a_same))
        assert measured < same - 10 * se, (measured, same, se)
    # unbiased: the mean over steps is within 4.5 standard errors of mean g everywhere
    z = (ys.double().mean(0) - mean.double()) / (ys.double().std(0) / math.sqrt(steps))
    assert float(z.abs().max()) < 4.5


# --- ALQ / AMQ: statistics, tables and versions as with the allgather ---------------------

@pytest.mark.parametrize("spec", ["alq:bits=3,bucket_size=512,refit_steps=1/2",
                                  "amq:bits=3,bucket_size=512,refit_steps=1/2"])
def test_adaptive_levels_refit_as_before(spec):
    def fn(rank, tp, coll):
        ex = Exchange(params(), hvdcomp.get(spec), tp, fusion_bytes=20000,
                      min_compress_numel=16, seed=3, collective=coll)
        tables = []
        for step in range(3):
            for name, e in ex.entries.items():
                e.param.grad = golden_grad(name, rank, seed=step)
            ex.begin(step)
            for name in ex.entries:
                ex.ready(name)
            ex.finish()
            ex.after_step(step)
            tables.append((ex.compression.levels.clone(), ex.compression.level_version))
        ex.close()
        return tables
    rs = run_ranks(3, lambda r, tp: fn(r, tp, "reduce_scatter"))
    ag = run_ranks(3, lambda r, tp: fn(r, tp, "allgather"))
    for r in range(3):
        assert [v for _, v in rs[r]] == [1, 2, 2]             # refits before steps 1 and 2
        for (lv, v), (lw, w) in zip(rs[r], ag[r]):
            assert v == w and torch.allclose(lv, lw, atol=1e-6), (lv, lw)
        assert all(torch.equal(a, b) for (a, _), (b, _) in zip(rs[r], rs[0]))


# --- bad input -----------------------------------------------------------------------------

def test_world_of_one_rank_is_refused_and_auto_takes_the_allgather():
    got = run_ranks(1, lambda r, tp: Exchange(params(), hvdcomp.get("qsgd"), tp,
                                              collective="reduce_scatter"))
    assert isinstance(got[0], hvdcomp.ConfigError) and "2 or more ranks" in str(got[0])
    got = run_ranks(1, lambda r, tp: Exchange(params(), hvdcomp.get("qsgd"), tp,
                                              min_compress_numel=16, collective="auto"))
    assert isinstance(got[0], Exchange) and set(got[0].plan.paths().values()) == {"allgather"}
    got = run_ranks(1, lambda r, tp: Exchange(params(), hvdcomp.get("qsgd"), tp,
                                              collective="ring"))
    assert isinstance(got[0], hvdcomp.ConfigError) and "collective must be one of" in str(got[0])


def test_ranks_disagreeing_on_the_collective_are_refused_at_the_handshake():
    got = run_ranks(3, lambda r, tp: Exchange(
        params(), hvdcomp.get("qsgd"), tp, min_compress_numel=16,
        collective="allgather" if r == 1 else "reduce_scatter"))
    # every rank raises Mismatch, naming each rank's value, before anything else runs
    assert all(isinstance(g, hvdcomp.Mismatch) for g in got), got
    for r, g in enumerate(got):
        assert f"rank {r} reporting" in str(g)
        assert 'collective: "reduce_scatter" on ranks 0, 2; "allgather" on rank 1' in str(g)


class _Flaky(hvdcomp.QSGD):
    """Rank 1 sends rank 0 a malformed shard (``mode``) once."""
    mode = None

    def encode(self, grad, key):
        if key.rank == 1 and "/avg" not in key.name and _Flaky.mode is not None:
            if _Flaky.mode == "raise":
                raise ValueError("boom on rank 1")
            if _Flaky.mode == "empty":                    # a shard of 0 elements
                return super().encode(grad.reshape(-1)[:0], key)
            if _Flaky.mode == "corrupt":
                msg = super().encode(grad, key)
                b = bytearray(msg.to_bytes())
                b[-1] ^= 0xFF                                # the CRC no longer matches
                return _Raw(bytes(b))
        return super().encode(grad, key)


class _Raw:
    def __init__(self, b):
        self.b = b

    def to_bytes(self):
        return self.b


@pytest.mark.parametrize("mode,own,other", [
    ("raise", ValueError, "rank 1 failed to encode bucket"),
    ("empty", hvdcomp.WireFormatError, "failed to encode the averaged shards"),
    ("corrupt", hvdcomp.WireFormatError, "failed to encode the averaged shards")])
def test_a_malformed_shard_makes_every_rank_raise(mode, own, other):
    def fn(rank, tp):
        ex = Exchange(params(), _Flaky(bits=4, bucket_size=512), tp, fusion_bytes=20000,
                      min_compress_numel=16, seed=3, collective="reduce_scatter")
        out = []
        for step in range(2):
            for name, e in ex.entries.items():
                e.param.grad = golden_grad(name, rank)
            ex.begin(step)
            for name in ex.entries:
                ex.ready(name)
            try:
                out.append(ex.finish()[0]["fc1.weight"].clone())
            except Exception as e:                          # noqa: BLE001
                out.append(e)
            _Flaky.mode = None                              # the next step is clean
        ex.close()
        return out
    _Flaky.mode = mode
    try:
        got = run_ranks(3, fn)
    finally:
        _Flaky.mode = None
    errs = [g[0] for g in got]
    if mode == "raise":                     # the failing rank its own error, others name it
        assert isinstance(errs[1], own) and "boom" in str(errs[1])
        assert all(isinstance(e, RuntimeError) and other in str(e) and "boom" in str(e)
                   for e in (errs[0], errs[2])), errs
    else:                                   # the owners that got it raise it, others name one
        owners = [r for r, e in enumerate(errs) if isinstance(e, own)]
        assert owners and all(isinstance(e, (own, RuntimeError)) for e in errs), errs
        assert all(other in str(e) for e in errs if not isinstance(e, own))
    for g in got:                           # and the exchange works on the next step
        assert torch.equal(g[1], got[0][1])


# --- training-loop semantics (issue 14) over the reduce-scatter ------------------------------

def _g(name, rank, shape=(12, 10), dtype=torch.float32):
    g = torch.Generator().manual_seed(rank * 131 + sum(map(ord, name)))
    return torch.randn(shape, generator=g).to(dtype)


def _rs_exchange(tp, spec, names, shape=(12, 10), dtype=torch.float32, **kw):
    ps = [(n, torch.nn.Parameter(torch.zeros(shape, dtype=dtype))) for n in names]
    ex = Exchange(ps, hvdcomp.get(spec), tp, min_compress_numel=16, seed=5,
                  collective="reduce_scatter", **kw)
    return ex, dict(ps)


def _one_step(ex, step=0, joined=False):
    ex.begin(step, joined=joined)
    res, stats = ex.finish()
    return {k: v.clone() for k, v in res.items()}, stats


@pytest.mark.parametrize("spec", ["none", "qsgd:bits=4,bucket_size=16"])
def test_absent_everywhere_has_no_average_and_absent_somewhere_counts_zeros_rs(spec):
    n = 3

    def fn(rank, tp):
        ex, p = _rs_exchange(tp, spec, ["a", "b", "c"])
        assert set(ex.plan.paths().values()) == {"reduce_scatter"}
        p["a"].grad = _g("a", rank)                             # everywhere
        p["b"].grad = _g("b", rank) if rank == 1 else None      # rank 1 only
        out = _one_step(ex)                                     # c: nowhere
        lay = ex.collective.layout
        ex.close()
        return out, lay

    got = run_ranks(n, fn)
    for g in got:
        assert not isinstance(g, BaseException), g
    lay = got[0][1]
    for r in range(n):
        res, stats = got[r][0]
        assert sorted(res) == ["a", "b"]
        assert torch.equal(res["b"], got[0][0][0]["b"]) and torch.equal(res["a"],
                                                                        got[0][0][0]["a"])
    res = got[0][0][0]
    if spec == "none":                      # exact: float32 sums in rank order, one division
        want_b = (torch.zeros(120) + _g("b", 1).reshape(-1)) / n
        want_a = (torch.zeros(120) + sum(_g("a", q).reshape(-1) for q in range(n))) / n
        assert torch.equal(res["b"], want_b) and torch.equal(res["a"], want_a)
    else:       # rank 1's pieces alone, averaged over n, re-encoded with 2 more bits
        comp = hvdcomp.get(spec)
        comp2 = hvdcomp.get("qsgd:bits=6,bucket_size=16")      # QSGD's 6-bit table
        want = torch.zeros(120)
        for p in (p for b in lay for m in b for p in m if p.name == "b"):
            acc = torch.zeros(p.numel)
            key = p.key(0, 1, n, 5)
            comp.decode(comp.encode(_g("b", 1).reshape(-1)[p.lo:p.hi], key), key, acc)
            acc /= n
            k2 = p.key2(0, 5)
            comp2.decode(comp2.encode(acc, k2), k2, want[p.lo:p.hi])
        assert torch.equal(res["b"], want)


def test_joined_ranks_are_left_out_and_still_own_their_shards():
    n = 4

    def fn(rank, tp):
        ex, p = _rs_exchange(tp, "none", ["a"])
        p["a"].grad = _g("a", rank)
        out = _one_step(ex, joined=rank in (0, 2))
        owners = [r for r, mine in enumerate(ex.collective.layout[0]) if mine]
        ex.close()
        return out, owners

    got = run_ranks(n, fn)
    want = (torch.zeros(120) + _g("a", 1).reshape(-1) + _g("a", 3).reshape(-1)) / 2
    for g in got:
        assert not isinstance(g, BaseException), g
        (res, stats), owners = g
        assert stats.joined == 2 and torch.equal(res["a"], want)
        assert 0 in owners and 2 in owners           # the joined ranks averaged shards too


def test_all_joined_is_seen_by_every_rank_rs():
    def fn(rank, tp):
        ex, p = _rs_exchange(tp, "qsgd:bits=4,bucket_size=16", ["a"])
        out = _one_step(ex, step=5, joined=True)
        ex.close()
        return out[0], out[1].joined

    for got in run_ranks(3, fn):
        assert got == ({}, 3)


def test_a_sparse_gradient_is_refused_on_every_rank_and_sparse_as_dense_works():
    def fn(rank, tp, dense):
        ex, p = _rs_exchange(tp, "none", ["emb"], shape=(10, 4), sparse_as_dense=dense)
        p["emb"].grad = torch.ones(10, 4).to_sparse() * (rank + 1)
        try:
            return _one_step(ex)[0]["emb"]
        finally:
            ex.close()

    errs = run_ranks(2, lambda r, tp: fn(r, tp, False))
    assert all(isinstance(e, (ValueError, RuntimeError)) and "sparse_as_dense=True" in str(e)
               and "emb" in str(e) for e in errs), errs
    assert isinstance(errs[0], ValueError) or isinstance(errs[1], ValueError)
    for avg in run_ranks(2, lambda r, tp: fn(r, tp, True)):
        assert not avg.is_sparse and torch.equal(avg, torch.full((40,), 1.5))


@pytest.mark.parametrize("spec,big", [
    ("fp16", [1e6, -4e5]),          # beyond fp16 in both stages: sent as float32 values
    ("none", [3e38, -3e38]),        # the float32 sum overflows: each divided by N first
    ("bf16", [3.4e38, 1.0]),        # rounds to Inf in bf16
])
def test_casts_keep_their_range_rs(spec, big):
    n = 2
    grads = []
    for r in range(n):
        x = _g("w", r)
        x.view(-1)[:2] = torch.tensor(big)
        x.view(-1)[70:72] = torch.tensor(big)          # in the other rank's shard too
        grads.append(x)

    def fn(rank, tp):
        ex, p = _rs_exchange(tp, spec, ["w"])
        p["w"].grad = grads[rank]
        res, stats = _one_step(ex)
        ex.close()
        return res["w"], stats.nonfinite, ex.entries["w"].path

    want = (sum(g.double() for g in grads) / n).reshape(-1)
    for g in run_ranks(n, fn):
        assert not isinstance(g, BaseException), g
        avg, nonfinite, path = g
        assert path == "reduce_scatter"
        assert torch.isfinite(avg).all() and nonfinite == []
        assert torch.allclose(avg.double(), want, rtol=8e-3, atol=1e-2)


def test_a_non_finite_gradient_gives_nan_on_every_rank_rs():
    def fn(rank, tp):
        ex, p = _rs_exchange(tp, "qsgd:bits=4,bucket_size=16", ["w", "v"])
        p["w"].grad = _g("w", rank)
        p["v"].grad = _g("v", rank)
        if rank == 1:
            p["w"].grad[0, 0] = float("inf")
        res, stats = _one_step(ex)
        ex.close()
        return res, stats.nonfinite

    for res, nonfinite in run_ranks(3, fn):
        assert torch.isnan(res["w"]).all() and nonfinite == ["w"]
        assert torch.isfinite(res["v"]).all()


# --- faults (#15) over the reduce-scatter: stamps in both stages, stop marks -------------------

_NAMES = ["a", "b", "c", "d"]


def _fault_exchange(rank, tp):
    ps = [(n, torch.nn.Parameter(torch.zeros(8, 8))) for n in _NAMES]
    # fusion_bytes 256: one tensor (8 x 8 float32) per bucket, so a step has 4 buckets
    ex = Exchange(ps, hvdcomp.get("qsgd:bits=4,bucket_size=16"), tp, min_compress_numel=16,
                  fusion_bytes=256, collective="reduce_scatter")
    assert set(ex.plan.paths().values()) == {"reduce_scatter"}
    for i, (_, p) in enumerate(ps):
        p.grad = torch.full((8, 8), float(rank + i))
    return ex


def _step(ex, step, sync=False):
    ex.begin(step, sync=sync)
    for name in reversed(_NAMES):
        ex.ready(name)
    try:
        ex.finish()
    except BaseException as e:                      # noqa: BLE001 - the test looks at it
        return e
    return None


@pytest.mark.parametrize("case", ["skipped step()", "step() started by synchronize"])
def test_ranks_out_of_step_raise_on_every_rank_over_the_reduce_scatter(case):
    """Stage 1: rank 1's shards carry step 0 (it skipped step()) or the SYNC flag while the
    others' come from backward: every owner sees every rank's stamp, so every rank raises
    OutOfStep naming the other side."""
    def fn(rank, tp):
        ex = _fault_exchange(rank, tp)
        assert _step(ex, 0) is None
        if case == "skipped step()":
            err = _step(ex, 0 if rank == 1 else 1)
        else:
            err = _step(ex, 1, sync=(rank == 1))
        ex.close()
        return err

    got = run_ranks(3, fn)
    for r, err in enumerate(got):
        assert isinstance(err, hvdcomp.OutOfStep), (r, err)
        assert err.ranks == ([0, 2] if r == 1 else [1]), (r, err.ranks)
        assert "(shards)" in str(err), err            # caught in stage 1
        if case == "skipped step()":
            assert f"is in step {0 if r == 1 else 1}" in str(err), err
            assert f"rank {1 if r != 1 else 0}: step {1 if r == 1 else 0}" in str(err), err
        else:
            assert "synchronize()" in str(err), err


def test_stage_two_stamps_are_checked():
    """Rank 1's averaged pieces (stage 2) carry another step than its stage-1 frames: every
    rank raises OutOfStep in the allgather of the averaged shards (rank 1 naming the
    others); the next step is clean."""
    from hvdcomp.transport import Outgoing, Stamp

    def fn(rank, tp):
        ex = _fault_exchange(rank, tp)
        if rank == 1:
            owner = ex.collective.owner
            real = owner.reduce

            def forged(mine, incoming, step, stamp, events):
                out, joined = real(mine, incoming, step, stamp, events)
                msgs = [_Raw(bytes(p)) if len(p) else None for p in _parts(out)]
                return Outgoing(msgs, _present(out), stamp=Stamp(stamp.step + 7,
                                                                 stamp.ident)), joined
            owner.reduce = forged
            err = _step(ex, 0)
            owner.reduce = real
        else:
            err = _step(ex, 0)
        nxt = _step(ex, 1)
        ex.close()
        return err, nxt

    got = run_ranks(3, fn)
    for r, (err, nxt) in enumerate(got):
        assert isinstance(err, hvdcomp.OutOfStep), (r, err)
        # rank 1's own frame claims step 7: it names the others, they name it
        assert err.ranks == ([0, 2] if r == 1 else [1]), (r, err.ranks)
        assert "averaged shards" in str(err), err
        assert ("is in step 7" if r == 1 else "rank 1: step 7") in str(err), err
        assert nxt is None, (r, nxt)


def _parts(out):
    from hvdcomp.transport.framing import split_frames
    return split_frames(out.data, out.count)[0]


def _present(out):
    from hvdcomp.transport.framing import split_frames
    return split_frames(out.data, out.count)[1]


@pytest.mark.parametrize("where", ["mid-step", "between steps"])
def test_a_stopping_rank_makes_every_rank_raise_over_the_reduce_scatter(where):
    """Rank 1 stops after an error (its pipeline's stop_after_error: error marks from then
    on, in both stages): the others raise a RankFailure naming rank 1 and quoting its text,
    within the step, and nobody waits."""
    text = "rank 1 is stopping after ValueError: boom"

    def fn(rank, tp):
        ex = _fault_exchange(rank, tp)
        assert _step(ex, 0) is None
        if rank == 1:
            if where == "mid-step":                   # two of four gradients handed over
                ex.begin(1)
                ex.ready("d")
                ex.ready("c")
            t0 = time.monotonic()
            ok = ex.pipeline.stop_after_error(text, time.monotonic() + 20)
            return ok, ex.pipeline.failure_seen, time.monotonic() - t0
        err = _step(ex, 1)
        seen = ex.pipeline.failure_seen
        ex.close()
        return err, seen

    got = run_ranks(3, fn)
    ok, seen, took = got[1]
    assert ok and seen and took < 10, got[1]
    for r in (0, 2):
        err, seen = got[r]
        assert isinstance(err, hvdcomp.RankFailure) and err.rank == 1, (r, err)
        assert text in str(err) and "rank 1 stopped during bucket" in str(err), err
        assert seen, r
