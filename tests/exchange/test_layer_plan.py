"""Auto per layer (hvdcomp.exchange.layer_plan): the solver against brute force, the error
of the ranks' average (exact, sampled, and its 1/N effect), the budget on measured errors,
two ranks with one plan and identical averages, the plan in the checkpoint."""
import itertools
import json
import math
import os
import random
import sys
import time

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import hvdcomp  # noqa: E402
from hvdcomp.auto import LinkCost, from_spec  # noqa: E402
from hvdcomp.compressors import TensorKey  # noqa: E402
from hvdcomp.compressors.protocols import AdaptiveLevels  # noqa: E402
from hvdcomp.errors import ConfigError  # noqa: E402
from hvdcomp.exchange import Exchange  # noqa: E402
from hvdcomp.exchange.driver import Driver, Settings  # noqa: E402
from hvdcomp.auto import CodecCost  # noqa: E402
from hvdcomp.exchange.layer_plan import (STAGE2, candidates,  # noqa: E402
                                         effective_error, measure_errors, measure_key,
                                         sample_index, scatterable, second_stage_errors,
                                         solve, solve_paths, stage2_buckets,
                                         collectives)
from hvdcomp.exchange.collective import Allgather  # noqa: E402
from hvdcomp.exchange.scatter import ReduceScatter  # noqa: E402
from world import run_ranks  # noqa: E402

# a slow link (10 MB/s), so that compressing pays and the choice is not trivial
SLOW = LinkCost(ar_latency=1e-4, ar_per_byte=1e-7, ag_latency=1e-4, ag_per_byte=1e-7,
                aa_latency=1e-4, aa_per_byte=1e-7)


def _codecs(spec, **kw):
    """Hand-made codec costs of every candidate (1 ns per element to encode and decode: the
    machine's load cannot change the plan), the bytes from a real message of 2^16 elements."""
    out = {}
    for c in candidates(hvdcomp.get(spec), **kw):
        if c.spec() in ("none", "fp16") or c.name == "powersgd":
            out[c.spec()] = CodecCost(0, 1e-9, 0, 0, 0, 0, 1e-10)
            continue
        key = TensorKey("c", 0, 0, 0, 1, 0, shape=(256, 256), dtype=torch.float32)
        x = torch.randn(256, 256, generator=torch.Generator().manual_seed(0))
        nbytes = len(c.encode(x, key).to_bytes())
        out[c.spec()] = CodecCost(0, 1e-9, 0, 1e-9, 0, nbytes / 2**16, 1e-10)
        if scatterable(c):                         # its second stage, for the reduce-scatter
            nbytes = len(c.second_stage().encode(x, key).to_bytes())
            out[STAGE2 + c.spec()] = CodecCost(0, 1e-9, 0, 1e-9, 0, nbytes / 2**16, 1e-10)
    return out


def _optimum(times, errors, budget):
    """Every combination tried: the least total time within the budget (ties: less error)."""
    best = None
    for combo in itertools.product(*[range(len(t)) for t in times]):
        e = sum(errors[i][j] for i, j in enumerate(combo))
        t = sum(times[i][j] for i, j in enumerate(combo))
        if e <= budget and (best is None or (t, e) < best[0]):
            best = ((t, e), combo)
    return best


def test_solver_equals_brute_force_on_small_cases():
    rnd = random.Random(3)
    for case in range(150):
        T, K = rnd.randint(1, 6), rnd.randint(1, 6)
        times = [[rnd.uniform(0, 10) for _ in range(K)] for _ in range(T)]
        errors = [[rnd.choice([0.0, rnd.uniform(0, 5)]) for _ in range(K)] for _ in range(T)]
        least = sum(min(e) for e in errors)
        budget = least + rnd.uniform(0, 8)
        pick, proven = solve(times, errors, budget)
        (t_best, e_best), _ = _optimum(times, errors, budget)
        assert proven
        assert sum(errors[i][j] for i, j in enumerate(pick)) <= budget + 1e-9
        assert sum(times[i][j] for i, j in enumerate(pick)) == pytest.approx(t_best, abs=1e-12)
        # cut short, the search still returns a plan within the budget (the greedy one)
        cut, proven = solve(times, errors, budget, max_nodes=1)
        assert sum(errors[i][j] for i, j in enumerate(cut)) <= budget + 1e-9


def test_solver_hand_case_and_infeasible_budget():
    # two tensors; options (time, error): A: (10, 0) (4, 3) (1, 9); B: (8, 0) (2, 4)
    times, errors = [[10, 4, 1], [8, 2]], [[0, 3, 9], [0, 4]]
    # budget 7: A=4/3 with B=2/4 (time 6) beats A=1/9 (over) and A=10 + B=2 (12)
    assert solve(times, errors, 7)[0] == [1, 1]
    assert solve(times, errors, 3.5)[0] == [1, 0]        # 4 + 8 = 12 < 10 + 2 with e 4 > 3.5
    assert solve(times, errors, 0)[0] == [0, 0]
    with pytest.raises(ConfigError, match=r"budget 0.5 cannot be met.*least total error .* 1"):
        solve([[1, 2]], [[1, 3]], 0.5)


def test_collective_latency_hand_case():
    """Options A (allgather) and B (rounds), both without error.  Tensor 1: A 1.0 s, B 0.8;
    tensor 2: A 1.0, B 1.1.  Without latencies the mix (B, A) is fastest (1.8 s); with 0.5 s
    per collective it pays both (2.8) and all-B (1.9 + 0.5) wins; in two fusion buckets
    every plan pays two collectives and the mix wins again (2.8 against 2.9 and 3.0)."""
    times, errors = [[1.0, 0.8], [1.0, 1.1]], [[0.0, 0.0], [0.0, 0.0]]
    keys = [("allgather",), ("rounds",)]
    assert solve_paths(times, errors, 0.0, keys, {"allgather": 0, "rounds": 0})[0] == [1, 0]
    lat = {"allgather": 0.5, "rounds": 0.5}
    assert solve_paths(times, errors, 0.0, keys, lat)[0] == [1, 1]
    assert solve_paths(times, errors, 0.0, keys, lat, buckets=[0, 1])[0] == [1, 0]
    # a free option (no collective of its own) costs no latency; an infeasible budget is
    # solve's ConfigError
    assert solve_paths(times, errors, 0.0, [(), ("rounds",)], lat)[0] == [0, 0]
    assert solve_paths(times, errors, 0.0, keys, lat)[1]
    with pytest.raises(ConfigError, match="cannot be met"):
        solve_paths([[1.0]], [[2.0]], 1.0, [("allgather",)], lat)


def test_collectives_of_each_option_and_their_latencies():
    cands = [hvdcomp.get(s) for s in ("none", "fp16", "qsgd:bits=3", "powersgd:rank=2")]
    options = [(0, "allreduce"), (1, "allreduce"), (2, "allgather"), (3, "rounds"),
               (2, "reduce_scatter"), (1, "allgather")]
    keys, lat = collectives(options, cands, CHEAP_ALLTOALL, carrier=True)
    # the reduce-scatter runs an all-to-all and an allgather of its own (the averaged
    # shards), besides the allgather of the messages of the bucket's other tensors
    assert keys == [(), ("allreduce fp16",), ("allgather",), ("rounds",),
                    ("all-to-all", "shard allgather"), ("allgather",)]
    L = CHEAP_ALLTOALL
    assert lat == {"allgather": L.ag_latency, "all-to-all": L.aa_latency,
                   "shard allgather": L.ag_latency, "allreduce fp16": L.ar_latency,
                   "rounds": 2 * L.ar_latency}
    # without a carrier fp32 travels in the allgather, which is then free; PowerSGD's
    # rounds are two allgathers of their own
    _, lat = collectives(options, cands, L, carrier=False)
    assert lat["allgather"] == 0.0 and lat["rounds"] == 2 * L.ag_latency


def test_collective_latency_equals_brute_force_in_one_bucket():
    rnd = random.Random(5)
    names = ["allgather", "rounds", "allreduce fp16"]
    cut = 0
    for case in range(120):
        T, K = rnd.randint(1, 4), rnd.randint(1, 4)
        times = [[rnd.uniform(0, 10) for _ in range(K)] for _ in range(T)]
        errors = [[rnd.choice([0.0, rnd.uniform(0, 5)]) for _ in range(K)] for _ in range(T)]
        keys = [tuple(rnd.sample(names, rnd.randint(0, 2))) for _ in range(K)]
        lat = {k: rnd.uniform(0, 6) for k in names}
        budget = sum(min(e) for e in errors) + rnd.uniform(0, 8)

        def cost(plan):
            return (sum(times[i][j] for i, j in enumerate(plan))
                    + sum(lat[k] for k in {k for j in plan for k in keys[j]}))
        best = min(cost(p) for p in itertools.product(range(K), repeat=T)
                   if sum(errors[i][j] for i, j in enumerate(p)) <= budget + 1e-9)
        pick, proven = solve_paths(times, errors, budget, keys, lat)
        assert proven and sum(errors[i][j] for i, j in enumerate(pick)) <= budget + 1e-9
        assert cost(pick) == pytest.approx(best, abs=1e-9), case
        # a search cut short (here: the one with every collective allowed) is not proven
        if not solve(times, errors, budget, max_nodes=1)[1]:
            cut += 1
            assert not solve_paths(times, errors, budget, keys, lat, max_nodes=1)[1], case
    assert cut > 0


def _table(spec, gs):
    """The level table the planner measures an ALQ/AMQ candidate with: fitted to the summed
    statistics of the gradients ``gs`` (every tensor of every rank); None for another
    compressor."""
    c = hvdcomp.get(spec)
    if not isinstance(c, AdaptiveLevels):
        return None
    return c.update(sum(c.statistics(g) for g in gs), 1)


def _decoded(spec, g, name, rank, seed=0, levels=None):
    """C(g) by the compressor's own encode and decode (as a world of one, with the key the
    planner documents for ``rank``: measure_key), flat float64; an ALQ/AMQ with the table
    ``levels`` (default: fitted to g alone)."""
    c = hvdcomp.get(spec)
    k = measure_key(name, rank, seed)
    key = TensorKey(name, 0, 0, 0, 1, k.seed, shape=tuple(g.shape), dtype=g.dtype)
    if isinstance(c, AdaptiveLevels):
        c.adopt(_table(spec, [g]) if levels is None else levels)
    out = torch.zeros(g.numel())
    c.decode(c.encode(g, key), key, out)
    return out.double()


def _error(spec, g, name="w", rank=0, seed=0, levels=None):
    """||C(g) - g||^2 of one rank (a world of one)."""
    return float((_decoded(spec, g, name, rank, seed, levels) - g.reshape(-1).double())
                 .pow(2).sum())


def _error_of_average(spec, gs, name, levels=None):
    """||mean_r C(g_r) - mean_r g_r||^2 over the ranks' gradients ``gs`` (by rank)."""
    dec = torch.stack([_decoded(spec, g, name, r, levels=levels)
                       for r, g in enumerate(gs)]).mean(0)
    ref = torch.stack([g.reshape(-1).double() for g in gs]).mean(0)
    return float((dec - ref).pow(2).sum())


def _ratio(spec, gs, name):
    """The ranks' mean of ||C(g_r) - g_r||^2 / ||g_r||^2 (``gs`` by rank)."""
    return sum(_error(spec, g, name, r) / float(g.double().pow(2).sum())
               for r, g in enumerate(gs)) / len(gs)


def _charged(spec, e, ratio):
    """What the plan charges: e, or e / (1 - ratio) for a biased compressor."""
    return e / (1 - ratio) if hvdcomp.get(spec).biased else e


ERROR_SPECS = ("qsgd:bits=3", "alq:bits=2", "topk:density=0.01", "fp16", "none")


def test_error_of_the_average_exact_when_every_coordinate_is_sampled():
    """S >= numel: the estimate is ||mean_r C(g_r) - mean_r g_r||^2 computed here from each
    rank's own decode; a rank without a gradient (None) is left out of the mean."""
    cands = [hvdcomp.get(s) for s in ERROR_SPECS]
    shapes = {"a": (48, 40), "b": (300,), "c": (20, 30)}

    def grads(rank):
        g = torch.Generator().manual_seed(50 + rank)
        out = {n: torch.randn(s, generator=g) * (1 + rank) for n, s in shapes.items()}
        if rank == 2:
            out["c"] = None                             # rank 2 has no gradient of c
        return out

    def body(rank, tp):
        return measure_errors(cands, grads(rank), shapes, tp, sample=2000)

    got = run_ranks(3, body)
    assert got[0] == got[1] == got[2]                   # every rank the same numbers
    every = [g for r in range(3) for g in grads(r).values() if g is not None]
    for n in shapes:
        gs = [grads(r)[n] for r in range(3) if grads(r)[n] is not None]
        # ALQ: one table, fitted to every tensor of every rank (what its refit would do)
        want = [_error_of_average(s, gs, n, _table(s, every)) for s in ERROR_SPECS]
        assert got[0][n] == pytest.approx(want, rel=1e-6, abs=1e-12), n
    assert got[0]["a"][-1] == 0.0 and got[0]["a"][0] > 0

    def with_ratios(rank, tp):
        return measure_errors(cands, grads(rank), shapes, tp, sample=2000, with_ratios=True)

    (errs, ratios), = set((json.dumps(e, sort_keys=True), json.dumps(m, sort_keys=True))
                          for e, m in run_ranks(3, with_ratios))
    assert json.loads(errs) == got[0]                   # the same errors, and the ratios:
    for n in shapes:                                    # mean_r ||d_r||^2 / ||g_r||^2
        gs = [grads(r)[n] for r in range(3) if grads(r)[n] is not None]
        want = [sum(_error(s, g, n, r, levels=_table(s, every)) / float(g.double().pow(2).sum())
                    for r, g in enumerate(gs)) / len(gs) for s in ERROR_SPECS]
        assert json.loads(ratios)[n] == pytest.approx(want, rel=1e-5, abs=1e-12), n

    def wrong(rank, tp):                                # rank 1's gradient of b is short
        g = {"b": torch.ones(300 if rank == 0 else 299)}
        return measure_errors(cands, g, {"b": (300,)}, tp)

    errs = run_ranks(2, wrong)                          # every rank raises, none hangs
    assert all(isinstance(e, ValueError) and "rank 1's gradient of b" in str(e)
               for e in errs), errs


def _one_rank_transport():
    from world import ThreadTransport, World
    return ThreadTransport(World(1), 0)


def test_sampled_error_is_unbiased():
    """S < numel: averaged over seeds (each a different subset), the estimate approaches
    the exact error, within 5 standard errors of the mean of the seeds' estimates (the
    standard error from the without-replacement variance of the subset's sum); and a
    hand-worked case of 5 elements, 2 sampled."""
    n, S, seeds = 4096, 64, 300
    g = torch.randn(n, generator=torch.Generator().manual_seed(7)) ** 3   # heavy tails
    tp = _one_rank_transport()
    for spec in ("topk:density=0.01", "fp16"):         # deterministic: one exact value
        d2 = (_decoded(spec, g, "w", 0) - g.double()).pow(2)
        exact = float(d2.sum())
        ests = [measure_errors([hvdcomp.get(spec)], {"w": g}, {"w": (n,)}, tp, sample=S,
                               seed=s)["w"][0] for s in range(seeds)]
        var = n * n / S * float(d2.var(unbiased=False)) * (n - S) / (n - 1)
        mean = sum(ests) / seeds
        assert abs(mean - exact) <= 5 * math.sqrt(var / seeds), (spec, mean, exact)
        assert len(set(ests)) > seeds // 2               # the subsets differ with the seed
    # hand-worked: residual of "none" is 0; of a sign-like g through fp16 on 5 elements
    x = torch.tensor([1.0, 2.0 ** -30, 3.0, 1.0 + 2.0 ** -20, 5.0])
    d = (x.half().float() - x).double()                 # fp16 rounding, world of one
    idx = sample_index("h", 5, 2, seed=3)
    assert len(idx) == 2 and len(set(idx.tolist())) == 2
    want = 5 / 2 * float(d[idx[0]] ** 2 + d[idx[1]] ** 2)
    got = measure_errors([hvdcomp.get("fp16")], {"h": x}, {"h": (5,)}, tp, sample=2, seed=3)
    assert got["h"][0] == pytest.approx(want, rel=1e-12)
    assert sample_index("h", 5, 5) is None and sample_index("h", 5, 9) is None
    assert (sample_index("h", 5000, 7, seed=1) == sample_index("h", 5000, 7, seed=1)).all()
    with pytest.raises(ValueError, match="sample"):
        measure_errors([hvdcomp.get("fp16")], {"h": x}, {"h": (5,)}, tp, sample=0)


def test_average_over_ranks_shrinks_an_unbiased_quantizers_error_not_top_ks():
    """Four ranks with similar gradients (a common part and 30 % of i.i.d. noise), sampled
    estimates: the unbiased stochastic quantizer's error of the average is about a quarter
    of one rank's (independent roundings), top-k's about one rank's (aligned errors)."""
    N, shape = 4, (256, 256)
    common = torch.randn(shape, generator=torch.Generator().manual_seed(1))

    def grad(rank):
        return common + 0.3 * torch.randn(shape, generator=torch.Generator().manual_seed(
            100 + rank))

    specs = ("qsgd:bits=3", "alq:bits=3", "topk:density=0.01")

    def body(rank, tp):
        return measure_errors([hvdcomp.get(s) for s in specs], {"w": grad(rank)},
                              {"w": shape}, tp)

    got = run_ranks(N, body)
    assert got[0] == got[3]
    for j, spec in enumerate(specs):
        table = _table(spec, [grad(r) for r in range(N)])        # ALQ: one table, all ranks
        per_rank = sum(_error(spec, grad(r), "w", r, levels=table) for r in range(N)) / N
        ratio = got[0]["w"][j] / per_rank
        if spec.startswith("topk"):
            assert 0.8 < ratio < 1.05, (spec, ratio)
        else:
            assert 0.15 < ratio < 0.4, (spec, ratio)


def test_fitted_levels_and_biased_compressors_charged_their_unbiased_equivalent():
    """ALQ is measured with levels fitted to the gradient: on a heavy-tailed gradient its
    error is the fitted table's (the test's own decode with a table fitted here), well
    below the initial table's; a biased compressor is charged e / (1 - e / ||g||^2), an
    unbiased one e (hand-worked values)."""
    g = torch.randn(64, 512, generator=torch.Generator().manual_seed(4)) ** 3
    tp = _one_rank_transport()
    got, ratios = measure_errors([hvdcomp.get("alq:bits=3")], {"w": g}, {"w": g.shape}, tp,
                                 sample=1 << 20, with_ratios=True)
    assert got["w"][0] == pytest.approx(_error("alq:bits=3", g, "w"), rel=1e-6)
    c = hvdcomp.get("alq:bits=3")                       # the initial (NUQSGD) table's error
    key = TensorKey("w", 0, 0, 0, 1, measure_key("w", 0).seed, shape=tuple(g.shape),
                    dtype=g.dtype)
    out = torch.zeros(g.numel())
    c.decode(c.encode(g, key), key, out)
    initial = float((out.double() - g.reshape(-1).double()).pow(2).sum())
    assert got["w"][0] < 0.5 * initial, (got["w"][0], initial)
    assert ratios["w"][0] == pytest.approx(got["w"][0] / float(g.double().pow(2).sum()),
                                           rel=1e-5)
    # the contraction is measured on the whole tensor: top-k at 0.1 % keeps about one of
    # 1024 sampled coordinates, and its ratio must not depend on the sample
    top = [hvdcomp.get("topk:density=0.001")]
    want = _error("topk:density=0.001", g, "w") / float(g.double().pow(2).sum())
    for sample in (16, 1024, 1 << 20):
        _, r = measure_errors(top, {"w": g}, {"w": g.shape}, tp, sample=sample,
                              with_ratios=True)
        assert r["w"][0] == pytest.approx(want, rel=1e-6), sample
    # hand-worked: ratio 0.9 (contraction 0.1): e = 1.8 is charged 18; ratio >= 1: the
    # least contraction, 1e-6; unbiased (and fp16) charged e itself
    top, rk = hvdcomp.get("topk:density=0.01"), hvdcomp.get("randk:unbiased=1")
    assert effective_error(top, 1.8, 0.9) == pytest.approx(18.0, rel=1e-12)
    assert effective_error(top, 3.0, 1.5) == pytest.approx(3.0 / 1e-6, rel=1e-12)
    assert effective_error(top, 0.0, 0.0) == 0.0
    for comp in (hvdcomp.get("alq:bits=3"), hvdcomp.get("fp16"), rk):
        assert effective_error(comp, 1.8, 0.9) == 1.8
    assert [hvdcomp.get(s).biased for s in ("topk", "dgc", "signef", "powersgd", "randk",
                                             "qsgd", "alq", "terngrad", "none")] == [
        True, True, True, True, True, False, False, False, False]


def _model():
    """The same parameters on every rank (from a generator of their own: the ranks are
    threads sharing torch's global one)."""
    m = torch.nn.Sequential(torch.nn.Linear(256, 384), torch.nn.ReLU(),
                               torch.nn.Linear(384, 256), torch.nn.ReLU(),
                               torch.nn.Linear(256, 128))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return m


def _grads(named, rank, step):
    """Gradients with a low-rank layer (PowerSGD's case), a heavy-tailed one (top-k's) and a
    dense Gaussian one."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    out = {}
    for i, (n, p) in enumerate(named):
        x = torch.randn(p.shape, generator=g) * 1e-3
        if p.dim() == 2 and i == 0:
            u, v = torch.randn(p.shape[0], 1, generator=g), torch.randn(1, p.shape[1], generator=g)
            x = u @ v * 1e-2 + x * 1e-3
        elif p.dim() == 2 and i == 2:
            x = x * (torch.rand(p.shape, generator=g) < 0.005) * 100 + x * 1e-3
        out[n] = x
    return out


def _step(ex, named, rank, step):
    for n, p in named:
        p.grad = _grads(named, rank, step)[n].clone()
    ex.begin(step)
    for n, _ in named:
        ex.ready(n)
    res, _ = ex.finish()
    return {n: v.clone() for n, v in res.items()}


def test_budget_is_respected_and_defaults_to_the_compressors_error():
    for factor in (1.0, 0.3):
        def body(rank, tp):
            named = list(_model().named_parameters())
            auto = hvdcomp.Auto("qsgd:bits=3", per_layer=True, budget=factor, ranks=(),
                                link=SLOW, calibrate_numel=1 << 14, sample=1 << 20)
            ex = Exchange(named, auto, tp, min_compress_numel=16)
            _step(ex, named, rank, 0)
            ex.close()
            return ex.layer, _grads(named, rank, 0)

        (layer, grads), = run_ranks(1, body)
        weights = sorted(n for n in grads if grads[n].dim() == 2)
        assert sorted(layer.choices) == weights
        # (one rank: the error of the average is its own; rel 1e-6: the planner's
        # residuals are float32, these float64)
        reference = sum(_error("qsgd:bits=3", grads[n], n) for n in weights)
        assert layer.reference == pytest.approx(reference, rel=1e-6)
        assert layer.budget == pytest.approx(factor * layer.reference, rel=1e-12)
        # the plan's own numbers: each choice charged its error, a biased one (top-k,
        # PowerSGD) e / (1 - e / ||g||^2) (one rank: the average is its own gradient)
        want = [_charged(layer.choices[n].spec, _error(layer.choices[n].spec, grads[n], n),
                         _ratio(layer.choices[n].spec, [grads[n]], n)) for n in weights]
        assert [layer.choices[n].error for n in weights] == pytest.approx(want, rel=1e-5)
        assert sum(want) <= layer.budget * (1 + 1e-5)
        if factor == 1.0:                       # the user's compressor alone is feasible
            assert layer.totals()["seconds"] <= sum(
                layer.predict(hvdcomp.get("qsgd:bits=3"), grads[n].shape)[0]
                for n in weights) + 1e-15


def test_budget_no_plan_can_meet_is_a_clear_error():
    def body(rank, tp):
        named = list(_model().named_parameters())
        auto = hvdcomp.Auto("qsgd:bits=3", fallbacks=(), per_layer=True, budget=0.0,
                            ranks=(), link=SLOW, calibrate_numel=1 << 14)
        ex = Exchange(named, auto, tp, min_compress_numel=16)
        try:
            _step(ex, named, rank, 0)
        finally:
            ex.close()

    err, = run_ranks(1, body)
    assert isinstance(err, ConfigError) and "error budget 0 cannot be met" in str(err)


def test_two_ranks_one_plan_identical_averages_mixed_kinds():
    def body(rank, tp):
        named = list(_model().named_parameters())
        auto = hvdcomp.Auto("alq:bits=3", per_layer=True, link=SLOW,
                                    codecs=_codecs("alq:bits=3"))
        ex = Exchange(named, auto, tp, min_compress_numel=16)
        out = [_step(ex, named, rank, s) for s in range(3)]
        ex.close()
        return ex.layer.state_dict()["plan"], ex.plan.paths(), out

    (plan0, paths0, out0), (plan1, paths1, out1) = run_ranks(2, body)
    assert plan0 == plan1 and paths0 == paths1
    for s in range(3):
        assert out0[s].keys() == out1[s].keys()
        assert all(torch.equal(out0[s][n], out1[s][n]) for n in out0[s])
    kinds = {c["spec"].split(":")[0] for c in plan0.values()}
    assert len(kinds) >= 2, plan0                       # several compressors in one exchange
    assert "powersgd" in kinds and paths0["0.weight"] == "rounds", plan0


def _saved_after_two_steps(driver, rank):
    """``driver(0)`` after steps 0 and 1 (the plan decided after step 0): the driver, its
    [(name, parameter)] and its state_dict."""
    d = driver(0)
    named = [(e.name, e.param) for e in d.exchange.entries.values()]
    for s in range(2):
        _step(d.exchange, named, rank, s)
        d.step += 1
    return d, named, d.state_dict()


def _parameters_of(driver, named):
    """``driver``'s [(name, parameter)], their values set to those of ``named``."""
    out = [(x.name, x.param) for x in driver.exchange.entries.values()]
    for (_, p), (_, q) in zip(named, out):
        q.data.copy_(p.data)
    return out


def test_checkpoint_keeps_the_plan():
    def body(rank, tp):
        def driver(ident):
            auto = hvdcomp.Auto("alq:bits=3", per_layer=True, link=SLOW,
                                codecs=_codecs("alq:bits=3"))
            return Driver(list(_model().named_parameters()), Settings(
                compression=auto, min_compress_numel=16, seed=5), tp, ident=ident)

        d, named, sd = _saved_after_two_steps(driver, rank)
        e = driver(1)
        assert e.exchange.layer.pending
        e.load_state_dict(sd)
        named_e = _parameters_of(e, named)
        a = _step(d.exchange, named, rank, 2)
        b = _step(e.exchange, named_e, rank, 2)
        d.exchange.close()
        e.exchange.close()
        # the loaded plan is also the Auto's record of it, and the planner's own
        layer = e.exchange.layer
        noted = e.exchange.auto.plan == {n: d.exchange.auto.plan[n] for n in layer.choices}
        return (sd["layer_plan"], e.state_dict()["layer_plan"]["plan"], d.exchange.plan.paths(),
                e.exchange.plan.paths(), all(torch.equal(a[n], b[n]) for n in a),
                noted and layer.planned == layer.choices)

    for saved, plan, pd, pe, same, noted in run_ranks(2, body):
        assert saved["plan"] and plan == saved["plan"] and pd == pe and same and noted
        assert saved["budget"] == pytest.approx(saved["reference"])


def test_spec_strings_and_bad_settings():
    auto, coll = from_spec("auto+layer+alq:bits=3")
    assert isinstance(auto, hvdcomp.Auto) and auto.per_layer and coll is None
    assert auto.compressor.spec() == hvdcomp.get("alq:bits=3").spec()
    assert not from_spec("auto+alq:bits=3")[0].per_layer
    assert from_spec("auto+layer+ag+qsgd:bits=4")[1] == "allgather"
    with pytest.raises(ValueError, match="budget"):
        hvdcomp.Auto("alq:bits=3", per_layer=True, budget=-1)
    for bad in (-1, True, 1.5):
        with pytest.raises(ValueError, match="trial"):
            hvdcomp.Auto("alq:bits=3", per_layer=True, trial=bad)
    # the trial by default, none where the link's costs are given; ranks agree on it (spec)
    assert auto.trial == 2 and hvdcomp.Auto("qsgd", per_layer=True, link=SLOW).trial == 0
    assert "trial=3" in hvdcomp.Auto("qsgd", per_layer=True, trial=3).spec()

    def body(rank, tp):
        named = list(_model().named_parameters())
        Exchange(named, hvdcomp.Auto("qsgd", per_layer=True, link=SLOW), tp,
                 collective="reduce_scatter")

    err, _ = run_ranks(2, body)
    assert isinstance(err, ConfigError) and "per_layer" in str(err)


def test_nonfinite_first_gradients_and_the_log(caplog):
    """A NaN gradient is left out of the errors (the other rank's alone count); a tensor no
    rank had a finite gradient for keeps the user's compressor; rank 0 logs every tensor's
    choice with its predicted bytes, seconds and error."""
    def body(rank, tp):
        named = list(_model().named_parameters())
        auto = hvdcomp.Auto("qsgd:bits=3", per_layer=True, ranks=(), link=SLOW,
                            codecs=_codecs("qsgd:bits=3", ranks=()), sample=1 << 20)
        ex = Exchange(named, auto, tp, min_compress_numel=16)
        grads = _grads(named, rank, 0)
        if rank == 1:
            grads["2.weight"][3, 5] = float("nan")
        grads["4.weight"][0, 0] = float("inf")
        for n, p in named:
            p.grad = grads[n].clone()
        ex.begin(0)
        for n, _ in named:
            ex.ready(n)
        ex.finish()
        ex.close()
        return ex.layer

    caplog.set_level("INFO", logger="hvdcomp")
    layer, other = run_ranks(2, body)
    assert layer.state_dict()["plan"] == other.state_dict()["plan"]
    c = layer.choices["2.weight"]
    g0 = _grads(list(_model().named_parameters()), 0, 0)["2.weight"]
    want = _charged(c.spec, _error(c.spec, g0, "2.weight"), _ratio(c.spec, [g0], "2.weight"))
    assert c.error == pytest.approx(want, rel=1e-5)     # rank 0's alone
    assert layer.choices["4.weight"].spec == hvdcomp.get("qsgd:bits=3").spec()
    w0 = _grads(list(_model().named_parameters()), 0, 0)["0.weight"]
    w1 = _grads(list(_model().named_parameters()), 1, 0)["0.weight"]
    spec = layer.choices["0.weight"].spec
    want = _charged(spec, _error_of_average(spec, [w0, w1], "0.weight"),
                    _ratio(spec, [w0, w1], "0.weight"))
    assert layer.choices["0.weight"].error == pytest.approx(want, rel=1e-5)  # of the average
    lines = [r.getMessage() for r in caplog.records if r.name == "hvdcomp"]
    assert sum("Auto per layer: budget" in x for x in lines) == 1     # rank 0 only
    for n, ch in layer.choices.items():
        assert any(x.startswith(f"  {n}: {ch.spec} via {ch.path}, {int(ch.bytes)} bytes")
                   for x in lines), (n, lines)


def test_powersgd_as_the_compressor_plans_its_ranks():
    """PowerSGD (summed in rounds) may be the user's compressor: its ranks are candidates,
    and the budget is its own error at its rank."""
    def body(rank, tp):
        named = list(_model().named_parameters())
        auto = hvdcomp.Auto("powersgd:rank=2", per_layer=True, link=SLOW,
                            codecs=_codecs("powersgd:rank=2"))
        ex = Exchange(named, auto, tp, min_compress_numel=16)
        out = [_step(ex, named, rank, s) for s in range(2)]
        ex.close()
        return ex.layer, out

    (layer, a), (_, b) = run_ranks(2, body)
    specs = [c.spec() for c in layer.cands]
    assert specs[0] == hvdcomp.get("powersgd:rank=2").spec()
    assert {s for s in specs if s.startswith("powersgd")} == {
        hvdcomp.get(f"powersgd:rank={r}").spec() for r in (1, 2, 4)}
    assert layer.totals()["error"] <= layer.budget * (1 + 1e-9)
    assert all(torch.equal(a[1][n], b[1][n]) for n in a[1])


def test_low_rank_costs_made_monotone_in_rank():
    """A measured rank-1 PowerSGD slower than rank 2 (noise, or the process's first page
    faults) is credited rank 2's cost; costs already in order, and other candidates, are
    left as measured.  (Hand-made costs: seconds per element.)"""
    from hvdcomp.exchange.layer_plan import monotone_in_rank
    cands = [hvdcomp.get(s) for s in ("powersgd:rank=1", "powersgd:rank=2",
                                      "powersgd:rank=4", "topk:density=0.01")]
    per = {"powersgd:rank=1": 8.3e-9, "powersgd:rank=2": 3.6e-9, "powersgd:rank=4": 4.0e-9,
           "topk:density=0.01": 1e-9}
    codecs = {hvdcomp.get(k).spec(): CodecCost(0.0, v, 0.0, 0.0, 7.0, 0.5) for k, v in per.items()}
    monotone_in_rank(cands, codecs)
    got = {k: codecs[hvdcomp.get(k).spec()] for k in per}
    assert got["powersgd:rank=1"].encode_per_elem == 3.6e-9           # min(8.3, 3.6, 4.0)
    assert got["powersgd:rank=2"].encode_per_elem == 3.6e-9
    assert got["powersgd:rank=4"].encode_per_elem == 4.0e-9
    assert got["topk:density=0.01"].encode_per_elem == 1e-9
    assert got["powersgd:rank=1"].bytes_fixed == 7.0                  # only the time changes
    ordered = dict(codecs)
    monotone_in_rank(cands, ordered)                                  # idempotent
    assert ordered == codecs
    # other settings differ (warm start off): not compared
    cold = hvdcomp.get("powersgd:rank=1,warm_start=false")
    more = dict(codecs, **{cold.spec(): CodecCost(0.0, 9e-9, 0.0, 0.0, 7.0, 0.5)})
    monotone_in_rank(cands + [cold], more)
    assert more[cold.spec()].encode_per_elem == 9e-9


def test_checkpoint_refused_where_the_plan_cannot_be_kept():
    """A per-layer plan loaded by an exchange without a per-layer Auto, or by one that does
    not offer the plan's candidates: ValueError, nothing changed."""
    def body(rank, tp):
        named = list(_model().named_parameters())

        def driver(auto, ident):
            return Driver(named, Settings(compression=auto, min_compress_numel=16), tp,
                          ident=ident)

        d = driver(hvdcomp.Auto("alq:bits=3", per_layer=True, link=SLOW,
                                codecs=_codecs("alq:bits=3")), 0)
        _step(d.exchange, named, rank, 0)
        sd = d.state_dict()
        errors = []
        for other in (hvdcomp.Auto("alq:bits=3", link=SLOW, codec=CodecCost(0, 1e-9, 0, 1e-9,
                                                                            0, 0.5)),
                      hvdcomp.Auto("alq:bits=3", per_layer=True, link=SLOW, bits=(3,),
                                   densities=(), ranks=(), codecs=_codecs("alq:bits=3"))):
            e = driver(other, 1)
            before = e.exchange.plan.compressor_names()
            try:
                e.load_state_dict(sd)
            except ValueError as exc:
                errors.append(str(exc))
            assert e.exchange.plan.compressor_names() == before
            e.exchange.close()
        d.exchange.close()
        return sd["layer_plan"]["plan"], errors

    for plan, errors in run_ranks(2, body):
        used = {c["spec"] for c in plan.values()} - {hvdcomp.get("alq:bits=3").spec(),
                                                     "none", "fp16"}
        assert used and len(errors) == 2, (plan, errors)     # (top-k, PowerSGD: see above)
        assert "per-layer Auto" in errors[0] and "does not offer" in errors[1]


# --- the reduce-scatter in a per-layer plan -------------------------------------------------

def _qsgd_variance(g, bits, bucket):
    """E||Q(g) - g||^2 of QSGD at ``bits`` (uniform magnitudes {0, 1/s, .., 1}, s = 2^(bits-1)
    - 1, of each bucket's L2 norm; stochastic rounding between the two nearest levels: a
    coordinate at r between levels a < b has variance norm^2 (r - a)(b - r)), by hand."""
    x = g.reshape(-1).double()
    s = 2 ** (bits - 1) - 1
    total = 0.0
    for lo in range(0, x.numel(), bucket):
        v = x[lo:lo + bucket]
        norm = float(v.norm())
        if norm == 0:
            continue
        r = (v.abs() / norm) * s
        a = r.floor()
        total += float(((r - a) * (a + 1 - r)).sum()) * (norm / s) ** 2
    return total


def test_second_stage_error_against_a_hand_computed_variance():
    """The reduce-scatter's second stage (QSGD 3 bits: QSGD at 5 bits) re-encodes the
    average of the ranks' decoded messages: its variance there, by hand, on 1 and 2 ranks;
    with fewer buckets kept, theirs times (buckets / kept)."""
    shapes = {"a": (40, 50), "b": (7, 300)}
    gen = torch.Generator().manual_seed(4)
    grads = [{n: torch.randn(s, generator=gen) * (1 + r) for n, s in shapes.items()}
             for r in range(2)]
    spec = "qsgd:bits=3,bucket_size=256"
    cands = [hvdcomp.get(spec), hvdcomp.get("fp16")]
    assert scatterable(cands[0]) and not scatterable(cands[1])
    assert not scatterable(hvdcomp.get("powersgd:rank=1"))
    assert not scatterable(hvdcomp.get("topk:density=0.01"))   # a second stage with state

    def average(world, n):
        return sum(_decoded(spec, grads[r][n], n, r) for r in range(world)) / world

    for world in (1, 2):
        for sample in (1 << 20, 16):          # every bucket; 2 of them
            got = run_ranks(world, lambda rank, tp: second_stage_errors(
                cands, [0], grads[rank], shapes, tp, sample=sample))
            assert got[0] == got[-1]                            # one estimate everywhere
            for n, shape in shapes.items():
                numel = shape[0] * shape[1]
                kept = stage2_buckets(n, numel, 256, sample)
                assert len(kept) == (-(-numel // 256) if sample > 16 else 2)
                b = average(world, n)
                want = sum(_qsgd_variance(b[i * 256:(i + 1) * 256], 5, 256) for i in kept)
                want *= -(-numel // 256) / len(kept)
                assert got[0][n][0] == pytest.approx(want, rel=1e-5), (world, sample, n)
    # a tensor no rank had a finite gradient for: NaN
    bad = {"a": torch.full((40, 50), math.nan), "b": grads[0]["b"]}
    (got,) = run_ranks(1, lambda rank, tp: second_stage_errors(cands, [0], bad, shapes, tp))
    assert math.isnan(got["a"][0]) and not math.isnan(got["b"][0])


# an all-to-all 100x cheaper than the allgather: the reduce-scatter pays
CHEAP_ALLTOALL = LinkCost(ar_latency=1e-4, ar_per_byte=1e-7, ag_latency=1e-4, ag_per_byte=1e-6,
                          aa_latency=1e-4, aa_per_byte=1e-8)


def _qsgd_only(budget=1.5, bits=(), **kw):
    return hvdcomp.Auto("qsgd:bits=3", fallbacks=(), bits=bits, densities=(), ranks=(),
                        per_layer=True, budget=budget, link=CHEAP_ALLTOALL, sample=1 << 20,
                        codecs=_codecs("qsgd:bits=3", bits=bits, densities=(), ranks=()), **kw)


def test_plan_takes_the_reduce_scatter_and_averages_as_a_fixed_one():
    """Where the all-to-all is cheap and the budget (1.5 x QSGD 3 bits' error over the
    allgather) lets it, the plan sends the compressed tensors over the reduce-scatter: the
    exchange rebuilds its collective after the first step, and from then on its averages
    equal, bit for bit, those of an exchange built with that compressor over the
    reduce-scatter; its error is charged the second stage's.  With budget 1 it cannot (the
    second stage adds error); with collective="allgather" it keeps the allgather."""
    def body(rank, tp):
        named = list(_model().named_parameters())
        ex = Exchange(named, _qsgd_only(), tp, min_compress_numel=16)
        assert isinstance(ex.collective, Allgather)
        out = [_step(ex, named, rank, s) for s in range(3)]
        kind = type(ex.collective)
        fixed = Exchange(named, hvdcomp.get("qsgd:bits=3"), tp, min_compress_numel=16,
                         collective="reduce_scatter", ident=1)
        ref = [_step(fixed, named, rank, s) for s in range(3)]
        ag = Exchange(named, _qsgd_only(), tp, min_compress_numel=16, collective="allgather",
                      ident=2)
        [_step(ag, named, rank, s) for s in range(2)]
        one = Exchange(named, _qsgd_only(budget=1.0), tp, min_compress_numel=16, ident=3)
        [_step(one, named, rank, s) for s in range(2)]
        for e in (ex, fixed, ag, one):
            e.close()
        return (ex.layer, ex.plan.paths(), kind, out, ref, ag.layer, type(ag.collective),
                one.layer, type(one.collective))

    got = run_ranks(2, body)
    for layer, paths, kind, out, ref, ag_layer, ag_kind, one_layer, one_kind in got:
        weights = sorted(layer.choices)
        assert weights == ["0.weight", "2.weight", "4.weight"]
        assert all(layer.choices[n].path == "reduce_scatter" for n in weights), layer.choices
        assert all(paths[n] == "reduce_scatter" for n in weights) and kind is ReduceScatter
        for s in (1, 2):
            assert out[s].keys() == ref[s].keys()
            assert all(torch.equal(out[s][n], ref[s][n]) for n in out[s]), s
        # the budget: the user's compressor over the reduce-scatter, first stage + second
        first = second = 0.0
        g = [_grads(list(_model().named_parameters()), r, 0) for r in range(2)]
        for n in weights:
            first += _error_of_average("qsgd:bits=3", [g[0][n], g[1][n]], n)
            b = sum(_decoded("qsgd:bits=3", g[r][n], n, r) for r in range(2)) / 2
            second += _qsgd_variance(b, 5, 8192)
        # (every coordinate and bucket sampled: exact, but for the float32 residuals)
        assert 0.02 * first < second < first
        assert layer.reference == pytest.approx(first, rel=1e-5)
        assert layer.budget == pytest.approx(1.5 * first, rel=1e-5)
        total = sum(c.error for c in layer.choices.values())
        assert total == pytest.approx(first + second, rel=1e-5) and total <= layer.budget
        for other, other_kind in ((ag_layer, ag_kind), (one_layer, one_kind)):
            assert all(c.path == "allgather" for c in other.choices.values())
            assert other_kind is Allgather
    assert got[0][0].state_dict()["plan"] == got[1][0].state_dict()["plan"]


def test_checkpoint_with_the_reduce_scatter_and_where_it_cannot_be_kept(caplog):
    """A plan with the reduce-scatter, loaded into a fresh exchange, rebuilds its collective
    and gives the same next step; an exchange that cannot take it (collective="allgather")
    sends those tensors over the allgather with the same compressors, with a warning naming
    them; loading a plan of the same tensors with other compressors rebuilds the
    reduce-scatter for them; load_shared (an elastic reset) takes the root's plan."""
    def body(rank, tp):
        def driver(ident, **kw):
            return Driver(list(_model().named_parameters()), Settings(
                compression=_qsgd_only(bits=(3, 4)), min_compress_numel=16, seed=5, **kw),
                tp, ident=ident)

        d, named, sd = _saved_after_two_steps(driver, rank)
        e = driver(1)
        e.load_state_dict(sd)
        kind = type(e.exchange.collective)
        named_e = _parameters_of(e, named)
        a = _step(d.exchange, named, rank, 2)
        b = _step(e.exchange, named_e, rank, 2)
        f = driver(2, collective="allgather")
        f.load_state_dict(sd)
        named_f = _parameters_of(f, named)
        c = _step(f.exchange, named_f, rank, 2)
        f_paths, f_kind = f.exchange.plan.paths(), type(f.exchange.collective)
        # the same tensors, another compressor: the reduce-scatter is built anew
        other = json.loads(json.dumps(sd))
        for ch in other["layer_plan"]["plan"].values():
            ch["spec"] = hvdcomp.get("qsgd:bits=4").spec()
        before = e.exchange.collective
        e.load_state_dict(other)
        rebuilt = e.exchange.collective is not before
        _step(e.exchange, named_e, rank, 3)
        # an elastic reset: a new rank takes the plan from the root's state (load_shared)
        h = driver(3)
        h.load_shared(sd)
        shared = (h.exchange.layer.state_dict()["plan"] == sd["layer_plan"]["plan"]
                  and type(h.exchange.collective) is ReduceScatter)
        for x in (d, e, f, h):
            x.exchange.close()
        return (sd["layer_plan"]["plan"], kind, all(torch.equal(a[n], b[n]) for n in a),
                f_paths, f_kind, sorted(c), rebuilt and shared)

    with caplog.at_level("WARNING", logger="hvdcomp"):
        got = run_ranks(2, body)
    for plan, kind, same, f_paths, f_kind, f_out, rebuilt in got:
        assert {(c["spec"].split(",")[0], c["path"]) for c in plan.values()} == {
            ("qsgd:bits=3", "reduce_scatter")}
        assert rebuilt
        assert kind is ReduceScatter and same
        assert f_kind is Allgather and {f_paths[n] for n in plan} == {"allgather"}
        assert set(plan) <= set(f_out)
    assert any("reduce-scatter" in r.message and "0.weight" in r.message for r in caplog.records)


@pytest.mark.parametrize("setting", ["fusion_bytes", "min_compress_numel", "seed"])
def test_ranks_that_disagree_before_the_planner_are_refused_not_hung(setting):
    """A direct Exchange (no door's handshake before it) whose ranks disagree on a setting
    the per-layer planner's measurements depend on (whether the reduce-scatter is offered:
    fusion_bytes; which tensors are planned: min_compress_numel; the sampled buckets: seed)
    raises Mismatch naming that setting on every rank before any measurement, instead of
    leaving the ranks in different collectives."""
    values = {"fusion_bytes": (25 * 2**20, None), "min_compress_numel": (16, 4096),
              "seed": (0, 1)}[setting]

    def body(rank, tp):
        named = list(_model().named_parameters())
        kw = {"min_compress_numel": 16, setting: values[rank]}
        # the link measured at construction (no link= given): with fusion_bytes that
        # differ, one rank would time the all-to-all that the other never joins
        auto = hvdcomp.Auto("qsgd:bits=3", fallbacks=(), bits=(), densities=(), ranks=(),
                            per_layer=True, budget=1.5, sample=1 << 20)
        return Exchange(named, auto, tp, **kw)

    got = run_ranks(2, body)
    assert all(isinstance(e, hvdcomp.errors.Mismatch) and setting in str(e) for e in got), got


# --- the trial (hvdcomp.exchange.plan_trial) ------------------------------------------
ALQ3 = "alq:bits=3"


def _alq_only(**kw):
    """The user's compressor (ALQ 3 bits) as the only candidate: its plan is the trial's
    "uniform" rival, with no trial (nothing to compare)."""
    return hvdcomp.Auto(ALQ3, per_layer=True, fallbacks=(), bits=(), densities=(), ranks=(),
                        link=SLOW, codecs=_codecs(ALQ3, bits=(), densities=(), ranks=()), **kw)


def _slowed(monkeypatch, cls, method, seconds=0.3, only=lambda c: True):
    """``cls.method`` made ``seconds`` slower per call on the instances ``only`` accepts
    (every rank: they are threads)."""
    inner = getattr(cls, method)

    def slow(self, *a, **kw):
        if only(self):
            time.sleep(seconds)
        return inner(self, *a, **kw)
    monkeypatch.setattr(cls, method, slow)


def _in_trial(monkeypatch, change):
    """``change(comp)`` applied to each of the trial's own compressors (``get`` in
    plan_trial): the planner's and the reference exchanges' instances are left alone."""
    from hvdcomp.exchange import plan_trial
    inner = plan_trial.get

    def get(spec):
        comp = inner(spec)
        change(comp)
        return comp
    monkeypatch.setattr(plan_trial, "get", get)


def _slowed_in_trial(monkeypatch, name, method, seconds=0.3, only=lambda c: True):
    """The trial's own compressors named ``name`` that ``only`` accepts: ``method`` made
    ``seconds`` slower per call."""
    def change(comp):
        if comp.name == name and only(comp):
            fn = getattr(comp, method)

            def slow(*a, **kw):
                time.sleep(seconds)
                return fn(*a, **kw)
            setattr(comp, method, slow)
    _in_trial(monkeypatch, change)


@pytest.mark.parametrize("slow", ["plan", "uniform"])
def test_trial_keeps_the_faster_as_measured_and_leaves_no_state(monkeypatch, slow):
    """The cost model (hand-made costs) plans PowerSGD rank 1 and top-k; the trial times that
    plan against ALQ 3 bits on every tensor on the first step's gradients and keeps the
    faster: with the trial's PowerSGD made 0.3 s slower per tensor, ALQ everywhere; with its
    ALQ made slower (3 bits), the plan.  Either way the first step's averages are what the caller was given
    (exact fp32), and the next steps' equal, bit for bit, those of an exchange that planned
    the kept choice with no trial: the trial's compressors leave no state behind."""
    if slow == "plan":
        _slowed_in_trial(monkeypatch, "powersgd", "first_round")
    else:
        _slowed_in_trial(monkeypatch, "alq", "encode", only=lambda c: c.bits == 3)

    def body(rank, tp):
        named = list(_model().named_parameters())
        auto = hvdcomp.Auto(ALQ3, per_layer=True, link=SLOW, codecs=_codecs(ALQ3), trial=2)
        ex = Exchange(named, auto, tp, min_compress_numel=16)
        out = [_step(ex, named, rank, s) for s in range(3)]
        ref_auto = (_alq_only() if slow == "plan" else
                    hvdcomp.Auto(ALQ3, per_layer=True, link=SLOW, codecs=_codecs(ALQ3), trial=0))
        ref = Exchange(named, ref_auto, tp, min_compress_numel=16, ident=1)
        want = [_step(ref, named, rank, s) for s in range(3)]
        for e in (ex, ref):
            e.close()
        return ex.layer, ex.plan.compressor_specs(), dict(auto.plan), ref.layer, out, want

    got = run_ranks(2, body)
    for layer, specs, auto_plan, ref_layer, out, want in got:
        assert not isinstance(layer, BaseException), layer
        t = layer.trial
        assert set(t) == {"plan", "uniform"}
        kept = min(t, key=t.get)
        assert kept == ("uniform" if slow == "plan" else "plan"), t
        assert abs(t["plan"] - t["uniform"]) > 0.1, t         # 0.3 s per call at least
        assert layer.choices == (layer.uniform if kept == "uniform" else ref_layer.choices)
        assert ref_layer.trial == {} and ref_layer.choices == layer.choices
        for n, c in layer.choices.items():
            assert specs[n] == c.spec
            assert auto_plan[n] == hvdcomp.get(c.spec).name
        assert {c.spec.split(":")[0] for c in layer.choices.values()} == (
            {"alq"} if kept == "uniform" else {"powersgd", "topk"})
        for s in range(3):
            assert out[s].keys() == want[s].keys()
            assert all(torch.equal(out[s][n], want[s][n]) for n in out[s]), s
    g = [_grads(list(_model().named_parameters()), r, 0) for r in range(2)]
    for n, v in got[0][4][0].items():                     # step 0: the exact fp32 average
        assert torch.equal(v.view(-1), ((g[0][n] + g[1][n]) / 2).view(-1)), n
    assert got[0][0].trial == got[1][0].trial           # every rank decided on the same numbers


@pytest.mark.parametrize("slow", [None, "plan"])
def test_trial_between_the_reduce_scatter_and_the_allgather(monkeypatch, slow):
    """A plan over the reduce-scatter tried against the user's compressor over the
    allgather: the exchange builds its collective for each rival (a ReduceScatter, an
    Allgather, in the rivals' order) and for the one kept, whose averages then equal, bit
    for bit, those of an exchange built with that compressor over that collective.  With
    the plan's second stage (the owners' re-encoding, hvdcomp's Finer) made 0.3 s slower,
    the allgather is kept; without, whichever this machine measured faster."""
    from hvdcomp.compressors.quantizers import Finer
    from hvdcomp.exchange import core
    if slow:
        _slowed(monkeypatch, Finer, "encode")
    built = []
    inner = core.rebuild_flat

    def rebuild(ex):
        inner(ex)
        built.append((ex.rank, type(ex.collective).__name__))
    monkeypatch.setattr(core, "rebuild_flat", rebuild)

    def body(rank, tp):
        named = list(_model().named_parameters())
        ex = Exchange(named, _qsgd_only(trial=2), tp, min_compress_numel=16)
        out = [_step(ex, named, rank, s) for s in range(3)]
        kept = {c.path for c in ex.layer.choices.values()}
        fixed = Exchange(named, hvdcomp.get("qsgd:bits=3"), tp, min_compress_numel=16,
                         collective=kept.pop(), ident=1)
        ref = [_step(fixed, named, rank, s) for s in range(3)]
        for e in (ex, fixed):
            e.close()
        return ex.layer, type(ex.collective), type(fixed.collective), out, ref

    got = run_ranks(2, body)
    for layer, kind, fixed_kind, out, ref in got:
        assert not isinstance(layer, BaseException), layer
        assert set(layer.trial) == {"plan", "uniform"} and kind is fixed_kind
        assert {c.path for c in layer.planned.values()} == {"reduce_scatter"}
        assert {c.path for c in layer.uniform.values()} == {"allgather"}
        if slow:
            assert layer.choices == layer.uniform and kind is Allgather, layer.trial
        for s in (1, 2):
            assert all(torch.equal(out[s][n], ref[s][n]) for n in out[s]), s
    assert got[0][0].choices == got[1][0].choices
    # per rank: the plan decided, each rival (its own, then the plan's back), the one kept
    rs, ag = "ReduceScatter", "Allgather"
    want = [rs, rs, rs, ag, rs, ag if got[0][1] is Allgather else rs]
    assert [k for r, k in built if r == 0] == [k for r, k in built if r == 1] == want, built


def _failing_trial(monkeypatch, which):
    """The trial's fresh compressors of the kinds in ``which`` raise when they encode
    (top-k, ALQ) or start their rounds (PowerSGD): the planner's own instances, used to
    decide and to train, do not."""
    def boom(*a, **kw):
        raise RuntimeError("boom in the trial")

    def change(comp):
        if comp.name in which:
            comp.encode = comp.first_round = boom
    _in_trial(monkeypatch, change)


@pytest.mark.parametrize("which", [("powersgd", "topk"), ("powersgd", "topk", "alq")])
def test_a_rival_that_raises_in_the_trial(monkeypatch, caplog, which):
    """A rival whose exchange raises (on every rank) counts as infinitely slow and the other
    is kept, with a warning; the next steps equal an untried exchange's bit for bit.  If
    both raise, the first step's finish() raises the plan's error on every rank, and the
    tensors travel with the planner's own compressors afterwards (a step runs, the ranks'
    averages agree)."""
    _failing_trial(monkeypatch, which)
    both = "alq" in which

    def body(rank, tp):
        named = list(_model().named_parameters())
        auto = hvdcomp.Auto(ALQ3, per_layer=True, link=SLOW, codecs=_codecs(ALQ3), trial=1)
        ex = Exchange(named, auto, tp, min_compress_numel=16)
        raised, out = None, []
        try:
            out.append(_step(ex, named, rank, 0))
        except Exception as e:               # noqa: BLE001 - the test reads it
            raised = e
        out += [_step(ex, named, rank, s) for s in (1, 2)]
        own = all(ex.entries[n].compressor is ex.layer.compressor(n) for n in ex.layer.choices)
        ref = Exchange(named, _alq_only(), tp, min_compress_numel=16, ident=1)
        want = [_step(ref, named, rank, s) for s in range(3)]
        for e in (ex, ref):
            e.close()
        return raised, own, ex.layer, out, want

    got = run_ranks(2, body)
    for raised, own, layer, out, want in got:
        assert own
        if both:
            assert isinstance(raised, RuntimeError), raised
            assert layer.choices == layer.planned and layer.trial == {}
        else:
            assert raised is None, raised
            assert layer.trial["plan"] == math.inf and layer.trial["uniform"] < math.inf
            assert layer.choices == layer.uniform
            for s in range(3):
                assert all(torch.equal(out[s][n], want[s][n]) for n in out[s]), s
    assert all(torch.equal(got[0][3][-1][n], got[1][3][-1][n]) for n in got[0][3][-1])
    if not both:
        assert any("the plan rival raised RuntimeError: boom in the trial" in r.getMessage()
                   for r in caplog.records), caplog.records


def test_steady_state_declaration():
    """What the trial times in place of a compressor (Compressor.steady_state): itself where
    there is no warm-up; a new instance without PowerSGD's start_iter or DGC's warm-up (its
    density from step 0), its other settings the same."""
    plain = hvdcomp.get(ALQ3)
    assert plain.steady_state() is plain
    for spec, setting in (("powersgd:rank=2,start_iter=10", "start_iter"),
                          ("dgc:density=0.001,warmup_epochs=4,warmup_steps=100",
                           "warmup_epochs")):
        c = hvdcomp.get(spec)
        s = c.steady_state()
        assert s is not c and getattr(s, setting) == 0 and getattr(c, setting) > 0
        assert s.settings() == dict(c.settings(), **{setting: 0})
    dgc = hvdcomp.get("dgc:density=0.001,warmup_epochs=4,warmup_steps=100")
    assert dgc.density_at(0) > 0.001 and dgc.steady_state().density_at(0) == 0.001
