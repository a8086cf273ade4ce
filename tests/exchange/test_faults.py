"""Issue 15 items 5-7 on N ranks as threads of this process: a rank that stops (its error
marks make every other rank raise a RankFailure naming it, mid-step or between steps),
ranks out of step (OutOfStep on every rank, on both paths: frames and summed buffers),
parameters that differ across ranks at the first step, and settings that differ."""
import time

import numpy as np
import pytest
import torch

import hvdcomp
from hvdcomp.exchange import Exchange
from hvdcomp.exchange.buckets import agree_settings, param_digests
from hvdcomp.exchange.sums import slot_code

from test_loops import Sums, Threads, World, on_ranks  # noqa: F401 - the thread ranks

NAMES = ["a", "b", "c", "d"]


def _exchange(rank, tp, ar, spec, summable, params=None, **kw):
    params = params or [(n, torch.nn.Parameter(torch.zeros(8, 8))) for n in NAMES]
    # fusion_bytes 256: one tensor (8 x 8 float32) per bucket, so a step has 4 collectives
    ex = Exchange(params, hvdcomp.get(spec), tp, allreduce=ar if summable else None,
                  min_compress_numel=16, fusion_bytes=256, **kw)
    for i, (_, p) in enumerate(params):
        p.grad = torch.full((8, 8), float(rank + i))
    return ex


PATHS = [("qsgd:bits=4,bucket_size=16", False), ("none", True)]


@pytest.mark.parametrize("spec,summable", PATHS)
@pytest.mark.parametrize("where", ["mid-step", "between steps"])
def test_a_stopping_rank_makes_every_other_rank_raise_naming_it(spec, summable, where):
    n, text = 3, "rank 1 is stopping after ValueError: boom"

    def fn(rank, tp, ar):
        ex = _exchange(rank, tp, ar, spec, summable)
        ex.begin(0)
        ex.finish()                                   # a good step first
        if rank == 1:
            if where == "mid-step":                   # two of four gradients handed over
                ex.begin(1)
                ex.ready("d")
                ex.ready("c")
            t0 = time.monotonic()
            ok = ex.pipeline.stop_after_error(text, time.monotonic() + 20)
            return ok, ex.pipeline.failure_seen, time.monotonic() - t0
        ex.begin(1)
        for name in reversed(NAMES):
            ex.ready(name)
        try:
            ex.finish()
        except BaseException as e:                  # noqa: BLE001 - the test looks at it
            # the next step is clean again, and nobody waits for the stopped rank
            return e, ex.pipeline.failure_seen
        return None, ex.pipeline.failure_seen

    got = on_ranks(n, fn)
    ok, seen, took = got[1]
    assert ok and seen and took < 10, got[1]
    for r in (0, 2):
        err, seen = got[r]
        assert isinstance(err, hvdcomp.RankFailure) and err.rank == 1, (r, err)
        assert seen, r
        if not summable:                              # frames carry the text
            assert text in str(err) and "rank 1 stopped during bucket" in str(err), err
        else:
            assert "rank 1 stopped" in str(err), err


@pytest.mark.parametrize("spec,summable", PATHS)
@pytest.mark.parametrize("case", ["skipped step()", "step() started by synchronize"])
def test_ranks_out_of_step_raise_on_every_rank(spec, summable, case):
    """Rank 1 did not call step() (its counter is behind) or its step was started by
    synchronize() while the others' came from backward: every rank raises OutOfStep at
    the first collective, naming the other side; the exchange still completes."""
    n = 3

    def fn(rank, tp, ar):
        ex = _exchange(rank, tp, ar, spec, summable)
        ex.begin(0)
        ex.finish()
        if case == "skipped step()":
            ex.begin(0 if rank == 1 else 1)
        else:
            ex.begin(1, sync=(rank == 1))
        try:
            ex.finish()
        except BaseException as e:                  # noqa: BLE001
            return e
        return None

    got = on_ranks(n, fn)
    for r in range(n):
        err = got[r]
        assert isinstance(err, hvdcomp.OutOfStep), (r, err)
        assert err.ranks == ([0, 2] if r == 1 else [1]), (r, err.ranks)
        if case == "skipped step()":
            assert f"is in step {0 if r == 1 else 1}" in str(err), err
            assert f"rank {1 if r != 1 else 0}: step {1 if r == 1 else 0}" in str(err), err
        else:
            assert "synchronize()" in str(err), err


def test_slot_codes_are_exact_in_half_precision_and_distinct():
    codes = {(s, sync, joined): slot_code(s, sync, joined)
             for s in range(85) for sync in (False, True) for joined in (False, True)
             if not (sync and joined)}
    assert min(codes.values()) == 1 and max(codes.values()) == 255
    assert len(set(codes.values())) == len(codes)          # distinct within 85 steps
    for dt in (torch.float16, torch.bfloat16):
        vals = torch.tensor(sorted(set(codes.values())), dtype=torch.float64)
        assert torch.equal(vals.to(dt).to(torch.float64), vals), dt
    assert slot_code(85 + 3, False, False) == slot_code(3, False, False)


@pytest.mark.parametrize("differ", [False, True])
def test_parameters_that_differ_across_ranks_raise_at_the_first_step(differ):
    n = 3

    def fn(rank, tp, ar):
        g = torch.Generator().manual_seed(5 if not differ or rank != 2 else 6)
        params = [(nm, torch.nn.Parameter(torch.randn(8, 8, generator=g))) for nm in NAMES]
        ex = _exchange(rank, tp, ar, "none", False, params=params)
        try:
            ex.begin(0)
        except BaseException as e:                  # noqa: BLE001
            return e
        ex.finish()
        return None

    got = on_ranks(n, fn)
    for r in range(n):
        if not differ:
            assert got[r] is None, got[r]
            continue
        assert isinstance(got[r], hvdcomp.Mismatch), got[r]
        msg = str(got[r])
        assert "ranks 2 hold other values than rank 0 in 4 of 4" in msg, msg
        assert "hvd.broadcast_parameters" in msg and "a, b, c, d" in msg, msg


def test_check_replicas_false_lets_different_values_train():
    def fn(rank, tp, ar):
        params = [(nm, torch.nn.Parameter(torch.full((8, 8), float(rank)))) for nm in NAMES]
        ex = _exchange(rank, tp, ar, "none", False, params=params, check_replicas=False)
        ex.begin(0)
        return ex.finish()[0]["a"].clone()

    got = on_ranks(2, fn)
    assert torch.equal(got[0], got[1]) and torch.equal(got[0], torch.full((64,), 0.5))


def test_param_digests_see_every_bit_and_the_dtype():
    x = torch.randn(5, 7)
    y = x.clone()
    y.view(-1)[11] = torch.nextafter(y.view(-1)[11], torch.tensor(10.0))
    d = param_digests([x, y, x.double(), x.reshape(7, 5), torch.zeros(0, 3)])
    assert d.shape == (5, 8) and len({bytes(r) for r in d}) == 5
    assert np.array_equal(param_digests([x.clone()]), d[:1])


def test_settings_that_differ_are_each_named():
    def fn(rank, tp, ar):
        settings = {"transport": "horovod" if rank == 2 else "mpi", "seed": 0,
                    "backward_passes_per_step": 1 + (rank == 1), "op": "Average"}
        try:
            agree_settings(tp, settings, "the optimizer settings")
        except BaseException as e:                  # noqa: BLE001
            return e
        return None

    got = on_ranks(3, fn)
    for r in range(3):
        assert isinstance(got[r], hvdcomp.Mismatch), got[r]
        msg = str(got[r])
        assert '  transport: "mpi" on ranks 0, 1; "horovod" on rank 2' in msg, msg
        assert "  backward_passes_per_step: 1 on ranks 0, 2; 2 on rank 1" in msg, msg
        assert "seed" not in msg and "  op" not in msg, msg
