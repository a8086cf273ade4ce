"""bench/scaling_model.py: the byte accounting against the collectives' formulas, and the fit
recovering known parameters from times its own cost formula produced."""
import math
import os
import sys

import pytest

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "bench")
sys.path.insert(0, BENCH)

import scaling_model as M  # noqa: E402
import shapes as S  # noqa: E402

RESNET = sum(math.prod(s) for _, s in S.resnet50())


@pytest.mark.parametrize("n", [2, 4, 8, 1024])
def test_allreduce_bytes_are_the_ring_formula(n):
    a = M.account("resnet50", "none", n)
    assert a["ar_bytes"] == pytest.approx(2 * (n - 1) / n * 4 * RESNET, rel=1e-12)
    assert a["bytes"] == 0 and a["enc"] == 0
    h = M.account("resnet50", "fp16", n)
    assert h["ar_bytes"] == pytest.approx(a["ar_bytes"] / 2, rel=1e-12)
    assert h["cast"] == 2 * RESNET


def test_reduce_scatter_bytes_stay_flat_and_the_allgather_grows():
    rs = [M.account("resnet50", "rs+alq:bits=3", n)["bytes"] for n in (4, 8, 16)]
    ag = [M.account("resnet50", "ag+alq:bits=3", n)["bytes"] for n in (4, 8, 16)]
    # allgather: (N-1)/N of N equal frames = (N-1) frames; the frames do not depend on N
    frame = ag[0] / 3
    assert ag[1] == pytest.approx(7 * frame) and ag[2] == pytest.approx(15 * frame)
    # reduce-scatter: two rings of about one compressed gradient each, (N-1)/N of it
    assert rs[2] / rs[1] < 1.1 and rs[1] / rs[0] < 1.2
    assert rs[0] < 2 * frame


def test_fit_recovers_the_parameters_that_made_the_times():
    truth = dict(alpha=1.5e-4, beta_ar_1gbit=3e-9, beta_ar_10gbit=3e-10, gamma=1.5e-9,
                 e_alq=2.5e-9, d_alq=2e-10, e_dgc=2e-9, d_dgc=1e-9, e0=6e-4, d0=2.5e-4,
                 c16=1e-9)
    background, cores = 1.5, 2
    rows = []
    for model, n, rate in [("resnet50", n, r) for n in (2, 4, 8, 16) for r in ("1gbit", "10gbit")]:
        for m in M.FIXED:
            kap = M.contention(n, cores, background)
            pr = M.predict(truth, model, m, n, rate, kap)
            # the replay: the wire terms alone
            rows.append(dict(model=model, method=m, hosts=n, rate=rate,
                             median_s=pr["total"], replay_s=pr["wire"]))
    p = M.fit_rows(rows, cores)
    assert p["background"] == background
    for k, v in truth.items():
        assert p[k] == pytest.approx(v, rel=1e-6), k
