"""PowerSGD (issue #22 item 1) in one process: the rounds against an independent float64
reference written with loops (tests/compressors/powersgd_reference.py), the whole exchange on
W ranks as threads (with and without an Allreduce carrier) against the same reference and
bit for bit against hvdcomp.exchange.rounds.simulate, the bytes it sends, checkpoints
(a restored run continues bit-identically) and bad input."""
import os
import sys
import threading

import numpy as np
import pytest
import torch

import hvdcomp
from hvdcomp.errors import ConfigError, Mismatch
from hvdcomp.exchange import Exchange
from hvdcomp.exchange.rounds import simulate
from hvdcomp.compressors.powersgd import orthogonalize, skinny_product
from hvdcomp.transport import Allreduce

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "exchange"))
from world import ThreadTransport, World, run_ranks  # noqa: E402

from .powersgd_reference import Reference  # noqa: E402

SEED = 7
# name: shape (tensor ids follow the name order: a, b, c, d, e)
SHAPES = {"a.conv": (16, 3, 3, 3), "b.fc": (64, 32), "c.bias": (64,), "d.head": (10, 100),
          "e.wide": (5, 400)}


def grads_of(step, rank, shapes=SHAPES, scale=1.0):
    g = torch.Generator().manual_seed(1000 * step + 17 * rank + 3)
    return {n: torch.randn(s, generator=g) * scale * (1 + rank) for n, s in shapes.items()}


def key(name, shape, step, rank, world, tid):
    return hvdcomp.TensorKey(name, tid, step, rank, world, SEED, shape=tuple(shape),
                             dtype=torch.float32)


def close(a, b, rtol=1e-3, atol=1e-4):
    torch.testing.assert_close(a.double().reshape(-1), b.double().reshape(-1), rtol=rtol,
                               atol=atol)


# --- the rounds alone ---------------------------------------------------------------------
@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("spec", ["powersgd:rank=1", "powersgd:rank=2,start_iter=2",
                                  "powersgd:rank=4,orthogonalization=qr",
                                  "powersgd:rank=3,warm_start=False",
                                  "powersgd:rank=8,min_compression_rate=1.0"])
def test_rounds_equal_the_reference(world, spec):
    comps = [hvdcomp.get(spec) for _ in range(world)]
    c = comps[0]
    for tid, (name, shape) in enumerate(sorted(SHAPES.items())):
        ref = Reference(shape, world, c.rank, c.start_iter, c.min_compression_rate,
                        c.warm_start, SEED, tid)
        for step in range(5):
            gs = [grads_of(step, r)[name] for r in range(world)]
            keys = [key(name, shape, step, r, world, tid) for r in range(world)]
            got = simulate(comps, gs, keys)
            want = ref.step(gs, step)
            for r in range(world):
                close(got[r], want)
                assert torch.equal(got[r], got[0])          # every rank the same average


def test_what_is_compressed_and_the_bytes():
    c = hvdcomp.get("powersgd:rank=4")
    assert c.matrix((64, 32)) == (64, 32, 4) and c.message_bytes((64, 32)) == 4 * 96 * 4
    assert c.matrix((16, 3, 3, 3)) == (16, 27, 4)
    assert c.matrix((10, 100)) == (10, 100, 4)              # 110 * 4 * 2 = 880 < 1000
    assert c.matrix((10, 50)) == (10, 50, 4)                # 60 * 4 * 2 = 480 < 500
    assert c.matrix((10, 40)) is None                       # 50 * 4 * 2 = 400 >= 400
    assert c.message_bytes((10, 40)) == 4 * 400
    assert c.matrix((64,)) is None and c.message_bytes(64) == 256
    assert c.matrix((0, 5)) is None and c.message_bytes((0, 5)) == 0
    assert c.matrix((3, 2)) is None                         # r = 2: 5 * 2 * 2 >= 6
    assert hvdcomp.get("powersgd:rank=1,min_compression_rate=0").matrix((3, 2)) == (3, 2, 1)
    assert c.round_sizes((64, 32), 0) == (256, 128)
    assert hvdcomp.get("powersgd:start_iter=3").round_sizes((64, 32), 2) == (2048,)


@pytest.mark.parametrize("r", [1, 2, 4, 7])
def test_skinny_product_is_the_matrix_product(r):
    """out = x @ y for a k x l x (contiguous, or the transposed view M^T of round 1) and an
    l x r y, against the float64 product (float32 rounding); r = 1 is torch.mm itself."""
    gen = torch.Generator().manual_seed(r)
    m = torch.randn(37, 53, generator=gen)
    for x in (m, m.t()):
        y = torch.randn(x.shape[1], r, generator=gen)
        out = torch.full((x.shape[0], r), float("nan"))
        assert skinny_product(x, y, out) is out
        want = x.double() @ y.double()
        assert torch.allclose(out.double(), want, rtol=1e-5, atol=1e-5), r
        if r == 1:
            assert torch.equal(out, torch.mm(x, y))


def test_orthogonalize_both_methods():
    a = torch.randn(50, 4, dtype=torch.float32)
    for method in ("gram_schmidt", "qr"):
        q = orthogonalize(a.clone(), method)
        torch.testing.assert_close(q.t() @ q, torch.eye(4), atol=1e-5, rtol=0)
        # the same column space as a: projecting a onto it gives a back
        torch.testing.assert_close(q @ (q.t() @ a), a, atol=1e-4, rtol=1e-4)
    z = torch.zeros(10, 2)
    assert torch.equal(orthogonalize(z, "gram_schmidt"), torch.zeros(10, 2))   # no NaN


# --- the exchange on W thread ranks ------------------------------------------------------
class RankOrderSums(Allreduce):
    """An Allreduce carrier over the thread world: in-place float32 sums in rank order."""
    dtypes = (torch.float32, torch.float16)
    prefix = "t"

    def __init__(self, world, rank):
        self.world, self.rank = world, rank
        self.names = []

    def start(self, buf, name):
        self.names.append(name)
        got = self.world.gather(self.rank, buf.clone())
        total = torch.zeros_like(buf)
        for g in got:
            total += g
        buf.copy_(total)

    def wait(self, handle):
        pass


def params_of(shapes=SHAPES):
    return [(n, torch.nn.Parameter(torch.zeros(s))) for n, s in shapes.items()]


def run_exchange(world, spec, steps, carrier, state=None, first=0, grads=grads_of,
                 shapes=SHAPES, keep=False, min_compress_numel=16, **kw):
    """Every rank's results {step: {name: average}}, stats and (keep) the state_dict at the
    end, with the exchange built on each thread rank."""
    def fn(rank, tp):
        ar = RankOrderSums(tp.world, rank) if carrier else None
        params = params_of(shapes)
        ex = Exchange(params, hvdcomp.get(spec), tp, allreduce=ar, fusion_bytes=30000,
                      min_compress_numel=min_compress_numel, seed=SEED, **kw)
        if state is not None:
            ex.compression.load_state_dict(state[rank])
        out, stats = {}, {}
        try:
            for step in range(first, first + steps):
                g = grads(step, rank)
                for n, p in params:
                    p.grad = g.get(n)
                ex.begin(step)
                for n, _ in reversed(params):
                    ex.ready(n)
                res, st = ex.finish()
                out[step] = {n: v.clone() for n, v in res.items()}
                stats[step] = st
        finally:
            ex.close()
        return out, stats, (ex.compression.state_dict() if keep else None), ex
    got = run_ranks(world, fn)
    for r, x in enumerate(got):
        if isinstance(x, BaseException):
            raise x
    return got


@pytest.mark.parametrize("carrier", [False, True])
@pytest.mark.parametrize("world", [1, 2, 4])
def test_exchange_equals_simulation_and_reference(world, carrier):
    spec = "powersgd:rank=2,start_iter=1"
    got = run_exchange(world, spec, 4, carrier)
    comps = [hvdcomp.get(spec) for _ in range(world)]
    refs = {n: Reference(s, world, 2, 1, 2.0, True, SEED, tid)
            for tid, (n, s) in enumerate(sorted(SHAPES.items()))}
    for step in range(4):
        gs = [grads_of(step, r) for r in range(world)]
        for tid, (n, s) in enumerate(sorted(SHAPES.items())):
            want = refs[n].step([g[n] for g in gs], step)
            if n == "c.bias":             # 1-D: routed to `none` by the plan
                sim = [sum(g[n] for g in gs).reshape(-1) / world]
            else:
                sim = simulate(comps, [g[n] for g in gs],
                               [key(n, s, step, r, world, tid) for r in range(world)])
            for r in range(world):
                res = got[r][0][step][n]
                close(res, want)
                if n != "c.bias":
                    assert torch.equal(res, sim[r]), (step, n, r)   # the same float32 order
        for r in range(world):
            assert got[r][3].plan.paths()["b.fc"] == "rounds"
            assert got[r][3].plan.paths()["c.bias"] == ("allreduce" if carrier else "allgather")


@pytest.mark.parametrize("carrier", [False, True])
def test_bytes_sent_count_p_and_q(carrier):
    world, spec = 2, "powersgd:rank=4"
    got = run_exchange(world, spec, 2, carrier, shapes={"b.fc": (64, 32), "d.head": (10, 100),
                                                          "e.wide": (5, 400)},
                       grads=lambda s, r: grads_of(s, r, {"b.fc": (64, 32),
                                                          "d.head": (10, 100),
                                                          "e.wide": (5, 400)}))
    c = hvdcomp.get(spec)
    payload = sum(c.message_bytes(s) for s in [(64, 32), (10, 100), (5, 400)])
    # b.fc 4 * 96 * 4, d.head 4 * 110 * 4; e.wide uncompressed: (5 + 400) * 4 * 2 >= 2000
    assert payload == 4 * (96 * 4 + 110 * 4 + 2000)
    tensors = 3
    # round 0: P's and e.wide, three counts per tensor and the joined count, one slot per
    # rank; round 1: Q's and the slots
    overhead = 4 * (3 * tensors + 1 + world) + 4 * world
    for r in range(world):
        st = got[r][1][1]
        assert st.bytes_sent == payload + overhead
        assert st.fp32_bytes == 4 * (2048 + 1000 + 2000)
        assert st.ratio == pytest.approx(st.fp32_bytes / (payload + overhead))


def test_start_iter_sends_everything_uncompressed():
    shapes = {"b.fc": (64, 32)}
    got = run_exchange(2, "powersgd:rank=4,start_iter=2", 3, True, shapes=shapes,
                       grads=lambda s, r: grads_of(s, r, shapes))
    # with the carrier, every step's rounds are preceded by the 2 ranks' step codes (the
    # rounds' sizes change at start_iter: ranks out of step must not reach the carrier)
    for step in (0, 1):
        st = got[0][1][step]
        assert st.bytes_sent == 4 * 2048 + 4 * (3 + 1 + 2) + 4 * 2
        want = (grads_of(step, 0, shapes)["b.fc"] + grads_of(step, 1, shapes)["b.fc"]) / 2
        close(got[0][0][step]["b.fc"], want, rtol=1e-6, atol=1e-7)
    assert got[0][1][2].bytes_sent == 4 * 96 * 4 + 4 * (3 + 1 + 2) + 4 * 2 + 4 * 2


# --- checkpoints ----------------------------------------------------------------------------
@pytest.mark.parametrize("carrier", [False, True])
def test_state_dict_round_trip_continues_bit_identically(carrier):
    world, spec = 2, "powersgd:rank=2,start_iter=1"
    whole = run_exchange(world, spec, 6, carrier)
    head = run_exchange(world, spec, 3, carrier, keep=True)
    saved = [torch.load(_roundtrip(head[r][2]), weights_only=True) for r in range(world)]
    assert set(saved[0]) == {"q", "residual"} and "b.fc" in saved[0]["residual"]
    assert torch.equal(saved[0]["q"]["b.fc"], saved[1]["q"]["b.fc"])     # Q is shared
    assert not torch.equal(saved[0]["residual"]["b.fc"], saved[1]["residual"]["b.fc"])
    tail = run_exchange(world, spec, 3, carrier, state=saved, first=3)
    for r in range(world):
        for step in range(3, 6):
            for n in whole[r][0][step]:
                assert torch.equal(whole[r][0][step][n], tail[r][0][step][n]), (r, step, n)
    # without the state the run differs (the residuals and the warm start matter)
    cold = run_exchange(world, spec, 1, carrier, first=3)
    assert not torch.equal(cold[0][0][3]["b.fc"], whole[0][0][3]["b.fc"])


def _roundtrip(state):
    import io
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return buf


def test_load_state_dict_refuses_bad_state():
    c = hvdcomp.get("powersgd")
    with pytest.raises(ValueError, match="residual"):
        c.load_state_dict({"residual": {"w": torch.tensor([float("nan")])}})
    with pytest.raises(ValueError, match="float32"):
        c.load_state_dict({"q": {"w": torch.zeros(3, 2, dtype=torch.float64)}})
    with pytest.raises(ValueError, match="matrix"):
        c.load_state_dict({"q": {"w": torch.zeros(3)}})
    with pytest.raises(ValueError, match="'q' and 'residual'"):
        c.load_state_dict({"levels": {}})


# --- bad input --------------------------------------------------------------------------
def test_world_of_one_is_the_approximation_with_error_feedback():
    """One rank: the average is its own gradient's rank-r approximation (residual kept),
    the reference with W = 1; over steps the error feedback makes the sum of the averages
    track the sum of the gradients (the residual is what is still owed)."""
    shapes = {"b.fc": (64, 32)}
    got = run_exchange(1, "powersgd:rank=1", 5, True, shapes=shapes, keep=True,
                       grads=lambda s, r: grads_of(s, r, shapes))
    ref = Reference((64, 32), 1, 1, seed=SEED)
    total_avg = torch.zeros(2048)
    total_g = torch.zeros(2048)
    for step in range(5):
        g = grads_of(step, 0, shapes)["b.fc"]
        close(got[0][0][step]["b.fc"], ref.step([g], step))
        total_avg += got[0][0][step]["b.fc"]
        total_g += g.reshape(-1)
    close(total_g - total_avg, got[0][2]["residual"]["b.fc"], rtol=1e-4, atol=1e-4)


def test_zero_dimension_tensor_travels_uncompressed():
    shapes = {"b.fc": (64, 32), "z.empty": (0, 16)}
    got = run_exchange(2, "powersgd:rank=2", 2, True, shapes=shapes, min_compress_numel=0,
                       grads=lambda s, r: grads_of(s, r, shapes))
    for r in range(2):
        assert got[r][0][1]["z.empty"].numel() == 0
        assert got[r][3].plan.paths()["z.empty"] == "rounds"


@pytest.mark.parametrize("carrier", [False, True])
def test_nonfinite_gradient_is_nan_everywhere_and_the_state_stays(carrier):
    shapes = {"b.fc": (64, 32), "d.head": (10, 100)}

    def grads(step, rank):
        g = grads_of(step, rank, shapes)
        if step == 2 and rank == 1:
            g["b.fc"][3, 4] = float("inf")
        return g
    got = run_exchange(2, "powersgd:rank=2", 4, carrier, shapes=shapes, grads=grads)
    clean = run_exchange(2, "powersgd:rank=2", 2, carrier, shapes=shapes, keep=True,
                         grads=lambda s, r: grads_of(s, r, shapes))
    for r in range(2):
        assert torch.isnan(got[r][0][2]["b.fc"]).all()
        assert got[r][1][2].nonfinite == ["b.fc"]
        assert torch.isfinite(got[r][0][2]["d.head"]).all()
        assert torch.isfinite(got[r][0][3]["b.fc"]).all()
    # step 2 of b.fc never happened: step 3 continues from the state after step 1
    after = run_exchange(2, "powersgd:rank=2", 1, carrier, shapes=shapes, first=3,
                         state=[clean[r][2] for r in range(2)], grads=grads)
    for r in range(2):
        assert torch.equal(after[r][0][3]["b.fc"], got[r][0][3]["b.fc"])


@pytest.mark.parametrize("carrier", [False, True])
def test_gradient_absent_on_one_rank_counts_zeros(carrier):
    """Rank 1 has no gradient for b.fc at step 1: it contributes zeros to P and Q, keeps its
    residual, and takes the shared Q like the others (simulate with None for it)."""
    shapes = {"b.fc": (64, 32)}

    def grads(step, rank):
        return {} if (step == 1 and rank == 1) else grads_of(step, rank, shapes)
    world, spec = 3, "powersgd:rank=2"
    got = run_exchange(world, spec, 3, carrier, shapes=shapes, grads=grads, keep=True)
    comps = [hvdcomp.get(spec) for _ in range(world)]
    for step in range(3):
        gs = [grads(step, r).get("b.fc") for r in range(world)]
        sim = simulate(comps, gs, [key("b.fc", (64, 32), step, r, world, 0)
                                   for r in range(world)])
        for r in range(world):
            assert torch.equal(got[r][0][step]["b.fc"], sim[r]), (step, r)
    for r in range(world):
        assert torch.equal(got[r][2]["q"]["b.fc"], comps[r].state_dict()["q"]["b.fc"])
        assert torch.equal(got[r][2]["residual"]["b.fc"],
                           comps[r].state_dict()["residual"]["b.fc"])


@pytest.mark.parametrize("carrier", [False, True])
def test_sparse_gradient_raises_on_every_rank(carrier):
    """A sparse gradient on rank 0 only: rank 0 raises the TypeError naming
    sparse_as_dense, the other ranks a RankFailure naming rank 0; none waits forever."""
    from hvdcomp.errors import RankFailure
    shapes = {"b.fc": (64, 32)}

    def grads(step, rank):
        g = grads_of(step, rank, shapes)
        return {"b.fc": g["b.fc"].to_sparse()} if rank == 0 else g

    def fn(rank, tp):
        ar = RankOrderSums(tp.world, rank) if carrier else None
        params = params_of(shapes)
        ex = Exchange(params, hvdcomp.get("powersgd"), tp, allreduce=ar,
                      min_compress_numel=16)
        params[0][1].grad = grads(0, rank)["b.fc"]
        ex.begin(0)
        ex.ready("b.fc")
        try:
            ex.finish()
        finally:
            ex.close()
    got = run_ranks(2, fn)
    assert isinstance(got[0], TypeError) and "sparse_as_dense" in str(got[0])
    assert isinstance(got[1], RankFailure) and got[1].rank == 0


def test_ranks_that_disagree_on_the_rank_are_refused():
    def fn(rank, tp):
        return Exchange(params_of(), hvdcomp.get(f"powersgd:rank={2 + rank}"), tp,
                        min_compress_numel=16)
    got = run_ranks(2, fn)
    for r in range(2):
        assert isinstance(got[r], Mismatch), got[r]
        assert "powersgd" in str(got[r])


@pytest.mark.parametrize("bad", [0, -1, 2.5, "4", True])
def test_bad_rank_is_a_value_error(bad):
    with pytest.raises(ValueError, match="rank"):
        hvdcomp.PowerSGD(rank=bad)
    with pytest.raises(ValueError):
        hvdcomp.get("powersgd", rank=bad)


def test_bad_settings_and_what_it_cannot_do():
    with pytest.raises(ConfigError, match="rank"):
        hvdcomp.get("powersgd:rank=0")
    with pytest.raises(ConfigError):
        hvdcomp.get("powersgd:orthogonalization=svd")
    with pytest.raises(ConfigError):
        hvdcomp.get("powersgd:start_iter=-1")
    c = hvdcomp.get("powersgd")
    with pytest.raises(TypeError, match="allreduces in rounds"):
        c.encode(torch.zeros(4, 4), key("w", (4, 4), 0, 0, 1, 0))

    def rs(rank, tp):
        return Exchange(params_of(), hvdcomp.get("powersgd"), tp, collective="reduce_scatter")
    for e in run_ranks(2, rs):
        assert isinstance(e, ConfigError) and "shards" in str(e)

    def auto(rank, tp):
        return Exchange(params_of(), hvdcomp.Auto(hvdcomp.get("powersgd")), tp)
    for e in run_ranks(2, auto):
        assert isinstance(e, ConfigError) and "Auto" in str(e)


@pytest.mark.parametrize("carrier", [False, True])
@pytest.mark.parametrize("steps", [(1, 2), (0, 3), (2, 1), (3, 4)])
def test_ranks_out_of_step_across_start_iter_raise_out_of_step(carrier, steps):
    """start_iter=2: rank 0 in step steps[0], rank 1 in steps[1].  Across start_iter the
    rounds' buffers of the two ranks differ in size (the gradient against P): OutOfStep on
    both ranks, naming the other rank, as for ranks out of step on the same side (3, 4)."""
    from hvdcomp.errors import OutOfStep
    shapes = {"b.fc": (64, 32), "c.bias": (64,)}

    def fn(rank, tp):
        ar = RankOrderSums(tp.world, rank) if carrier else None
        params = params_of(shapes)
        ex = Exchange(params, hvdcomp.get("powersgd:rank=2,start_iter=2"), tp, allreduce=ar,
                      min_compress_numel=16, seed=SEED)
        step = steps[rank]
        g = grads_of(step, rank, shapes)
        for n, p in params:
            p.grad = g[n]
        ex.begin(step)
        for n, _ in reversed(params):
            ex.ready(n)
        try:
            ex.finish()
        finally:
            ex.close()
    got = run_ranks(2, fn)
    for r in range(2):
        assert isinstance(got[r], OutOfStep), (r, got[r])
        assert got[r].ranks == [1 - r]
        assert f"step {steps[r]}" in str(got[r]) and f"step {steps[1 - r]}" in str(got[r])


@pytest.mark.parametrize("carrier", [False, True])
@pytest.mark.parametrize("spec", ["powersgd:rank=2", "powersgd:rank=4"])
def test_overflow_of_finite_gradients_is_nan_and_the_state_stays(carrier, spec):
    """Every rank's gradient of b.fc is finite at step 2 but so large (3e38) that M Q
    overflows float32: the average is NaN on every rank (the NaN policy), named in
    StepStats.nonfinite, and neither Q nor any residual takes the step (step 3 continues
    from the state after step 1, as without step 2)."""
    shapes = {"b.fc": (64, 32), "d.head": (10, 100)}

    def grads(step, rank):
        g = grads_of(step, rank, shapes)
        if step == 2:
            g["b.fc"] = torch.full((64, 32), 3e38)
        return g
    got = run_exchange(2, spec, 4, carrier, shapes=shapes, grads=grads)
    clean = run_exchange(2, spec, 2, carrier, shapes=shapes, keep=True,
                         grads=lambda s, r: grads_of(s, r, shapes))
    after = run_exchange(2, spec, 1, carrier, shapes=shapes, first=3,
                         state=[clean[r][2] for r in range(2)], grads=grads)
    for r in range(2):
        assert torch.isnan(got[r][0][2]["b.fc"]).all()
        assert got[r][1][2].nonfinite == ["b.fc"]
        assert torch.isfinite(got[r][0][2]["d.head"]).all()
        assert torch.equal(after[r][0][3]["b.fc"], got[r][0][3]["b.fc"])
