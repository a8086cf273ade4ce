"""bench/bits_variance.py's plain references: PowerSGD's power-iteration step (Vogels et al.
2019, Alg. 1) and CGX's stochastic max-min variance, against hand-worked cases."""

import pytest
import torch

from benchmod import import_bench

B = import_bench("bits_variance")


def test_powersgd_recovers_a_rank_r_matrix_exactly():
    g = torch.Generator().manual_seed(3)
    a = torch.randn(50, 3, generator=g, dtype=torch.float64)
    b = torch.randn(30, 3, generator=g, dtype=torch.float64)
    m = a @ b.t()                                    # rank 3
    q = torch.randn(30, 3, generator=g, dtype=torch.float64)
    est, q_new, floats = B.powersgd_step(m, q)
    assert float((est - m).norm() / m.norm()) < 1e-12
    assert q_new.shape == (30, 3) and floats == (50 + 30) * 3
    # rank 2 of a rank-3 matrix is not exact
    est2, _, _ = B.powersgd_step(m, q[:, :2])
    assert float((est2 - m).norm() / m.norm()) > 1e-3


def test_powersgd_hand_worked_rank_1():
    # M = diag(3, 1), Q = (1, 1)^T: P = (3, 1), P_hat = (3, 1)/sqrt(10),
    # Q' = M^T P_hat = (9, 1)/sqrt(10), estimate = [[27, 3], [9, 1]] / 10
    m = torch.tensor([[3.0, 0.0], [0.0, 1.0]], dtype=torch.float64)
    est, q_new, floats = B.powersgd_step(m, torch.ones(2, 1, dtype=torch.float64))
    assert torch.allclose(est, torch.tensor([[2.7, 0.3], [0.9, 0.1]], dtype=torch.float64),
                          atol=1e-12)
    assert torch.allclose(q_new.abs().squeeze(), torch.tensor([9.0, 1.0],
                                                              dtype=torch.float64) / 10 ** .5)
    assert float((m - est).pow(2).sum() / m.pow(2).sum()) == pytest.approx(0.18, abs=1e-12)
    assert floats == 4


def test_powersgd_fp16_rounds_what_travels():
    m = torch.tensor([[3.0, 0.0], [0.0, 1.0]], dtype=torch.float64)
    est, _, _ = B.powersgd_step(m, torch.ones(2, 1, dtype=torch.float64), fp16=True)
    p = (torch.tensor([3.0, 1.0], dtype=torch.float64) / 10 ** .5).half().double()
    q = (torch.tensor([9.0, 1.0], dtype=torch.float64) / 10 ** .5).half().double()
    assert torch.allclose(est.abs(), torch.outer(p, q), atol=0)


def test_hvdcomp_powersgd_points_exact_on_low_rank_and_uncompressed_where_it_does_not_pay():
    """The bench's rows of hvdcomp's PowerSGD itself: one power iteration from any generic
    Q recovers a rank-2 matrix at rank 2 (P = M Q spans M's columns); a 10 x 12 tensor at
    rank 4 is sent uncompressed ((10 + 12) 4 x 2 >= 120: PyTorch's rule), exactly, 32 bits
    a coordinate; the bits are the float32 elements of the two sums, (64 + 100) x 2."""
    g = torch.Generator().manual_seed(0)
    low = torch.randn(64, 2, generator=g) @ torch.randn(2, 100, generator=g)
    small = torch.randn(10, 12, generator=g)
    r = B.hvdcomp_powersgd_points([], {"a": low}, 2, 0)
    assert r["nerr"] < 1e-10 and r["nerr_ef"] < 1e-10
    assert r["bits"] == 32 * (64 + 100) * 2 / 6400 and r["bytes"] == 4 * (64 + 100) * 2
    r = B.hvdcomp_powersgd_points([], {"b": small}, 4, 0)
    assert r["nerr"] == 0 and r["bits"] == 32


def test_hvdcomp_powersgd_points_steady_state_error_is_on_gradient_plus_residual():
    """After error feedback on the preceding gradients, the steady-state error is that of
    compressing p = g + e: checked against the exchange's own one-process driver of the
    rounds (hvdcomp.exchange.rounds.simulate, one rank), the residual e kept by hand as
    the sum of what the averages did not carry (Alg. 2)."""
    import hvdcomp
    from hvdcomp.exchange.rounds import simulate
    gen = torch.Generator().manual_seed(1)
    hist = [torch.randn(40, 30, generator=gen) for _ in range(3)]
    cur = torch.randn(40, 30, generator=gen)
    r = B.hvdcomp_powersgd_points([{"w": h} for h in hist], {"w": cur}, 1, 3)
    comp = hvdcomp.get("powersgd:rank=1")
    res = torch.zeros(40, 30, dtype=torch.float64)
    for step, g in enumerate(hist + [cur]):
        key = hvdcomp.TensorKey("w", 0, step, 0, 1, shape=(40, 30), dtype=torch.float32)
        (avg,) = simulate([comp], [g], [key])
        p = g.double() + res
        res = p - avg.double().view(40, 30)
    want = float(res.pow(2).sum() / p.pow(2).sum())
    assert r["nerr_ef"] == pytest.approx(want, rel=1e-6)
    assert r["bits"] == 32 * (40 + 30) / 1200 and 0 < r["nerr"] < 1


def test_fp16_reference_counts_the_columns_that_travel():
    """At a first step Q has ``rank`` columns, but P's reduced QR has min(rank, n): a 2 x 10
    matrix at rank 4 sends (2 + 10) x 2 floats, not x 4."""
    m = torch.randn(2, 10, dtype=torch.float64)
    _, q_new, floats = B.powersgd_step(m, torch.randn(10, 4, dtype=torch.float64))
    assert floats == 24 and q_new.shape == (10, 2)


def test_maxmin_variance_hand_worked():
    x = torch.tensor([0.0, 0.25, 1.0])
    # 1 bit: grid {0, 1}; 0.25 rounds up with p = 1/4: variance 1/4 * 3/4
    assert B.maxmin_variance(x, 1, 1024) == pytest.approx(0.1875, abs=1e-15)
    # 2 bits: unit 1/3; 0.25 = 0.75 units: variance (1/3)^2 * 0.75 * 0.25
    assert B.maxmin_variance(x, 2, 1024) == pytest.approx(0.75 * 0.25 / 9, abs=1e-15)
    # buckets of 2: [0, 0.25] has both values on its grid, [1] is constant
    assert B.maxmin_variance(x, 1, 2) == 0.0


def test_maxmin_bits_are_cgx_4_06():
    assert B.maxmin_bits(2048, 4, 1024) == 4.0625
    assert B.maxmin_bits(1025, 4, 1024) == pytest.approx(4 + 128 / 1025)


def test_steady_state_verdict_reads_the_steady_states_bits():
    """A method under 2 bits at its first step but over 2 in the steady state counts under
    2 bits only at the first step; its fewest bits at the reference error are the steady
    state's (hand-made rows)."""
    base = dict(model="FC-300-100", step=100, biased=True, entropy=True, numel=10,
                zero_fraction=0.0, nerr_sem=0.0, bytes=0)
    rows = [dict(base, method="cgx-maxmin", setting="bits=4,bucket_size=1024", nerr=0.05,
                 bits=4.06, biased=False),
            dict(base, method="qsgd", setting="qsgd:bits=4,bucket_size=1024", nerr=1.0,
                 bits=4.04, biased=False, entropy=False),
            dict(base, method="uniformef", setting="uniformef:variance_target=0.01", nerr=0.01,
                 bits=1.5, nerr_ef=0.02, bits_ef=2.5)]
    v = B.verdict(rows)[0]["methods"]["uniformef"]
    assert v["best_under_2bits"]["nerr"]["bits"] == 1.5
    assert "nerr_ef" not in v["best_under_2bits"]
    assert B.bits_of(v["fewest_bits"]["cgx_ef"], "nerr_ef") == 2.5
    assert B.bits_of(rows[1], "nerr_ef") == 4.04             # no steady state: its bits
    # a biased row measured at a first step only (the oracle rows) has no steady state
    rows.append(dict(base, method="oracle", setting="uniformef:step_scope=model", nerr=0.001,
                     bits=0.5))
    o = B.verdict(rows)[0]["methods"]["oracle"]
    assert set(o["best_under_2bits"]) == {"nerr"} and set(o["fewest_bits"]) == {"qsgd", "cgx"}
