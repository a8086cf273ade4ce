"""hvdcomp.levels: level tables, ALQ / AMQ fitting, the folded-normal model, the statistics
(hvdcomp.ops.level_stats: bucket_stats, histogram_stats), and the adaptive compressors' table
life cycle (state_dict, adopt, level_version).

The variance claims are checked on the real MNIST gradient of conftest.real_grad with an exact
empirical variance computed here in NumPy; the model's closed forms are checked against
numerical integration of the folded normal density written here.
"""
import json
import math

import numpy as np
import pytest
import torch

import hvdcomp
from hvdcomp import WireFormatError
from hvdcomp import levels as L
from hvdcomp.ops import level_stats as S
from hvdcomp.wire import Message

from . import npref as R

# the statistics' references (the specification; tests/kernels/test_stats.py checks the kernels)
histogram_stats, bucket_stats = S.histogram_stats.reference, S.bucket_stats.reference

BUCKET = 8192


def exact_variance(x, levels, bs=BUCKET):
    """sum over buckets of ||b||^2 sum_i (hi - r_i)(r_i - lo_i), r_i = |x_i| / ||b||, all in
    float64 (the exact expected squared error of quantizing x with this table)."""
    x = np.asarray(x, dtype=np.float64).reshape(-1)
    lv = np.asarray(levels, dtype=np.float64)
    total = 0.0
    for start in range(0, x.size, bs):
        b = x[start:start + bs]
        nrm = math.sqrt(float(np.dot(b, b)))
        if nrm == 0.0:
            continue
        r = np.minimum(np.abs(b) / nrm, 1.0)
        j = np.clip(np.searchsorted(lv, r, side="right") - 1, 0, lv.size - 2)
        total += nrm * nrm * float(np.sum((lv[j + 1] - r) * (r - lv[j])))
    return total


def folded_pdf(r, mu, sigma):
    """Density of |V|, V ~ N(mu, sigma^2), at r >= 0 (not renormalized to [0, 1])."""
    z1, z2 = (r - mu) / sigma, (r + mu) / sigma
    return (np.exp(-0.5 * z1 * z1) + np.exp(-0.5 * z2 * z2)) / (sigma * math.sqrt(2 * math.pi))


def integrate(f, a, b, points=40001):
    r = np.linspace(a, b, points)
    return float(np.trapezoid(f(r), r))


def f32_table(t):
    return np.asarray(t, dtype=np.float32).astype(np.float64)


def is_valid_table(t, bits):
    t = np.asarray(t, dtype=np.float64)
    return (t.shape == (2 ** (bits - 1),) and t[0] == 0.0 and t[-1] == 1.0
            and bool(np.all(np.diff(t) > 0)))


KEY = hvdcomp.TensorKey(name="fc1.weight", tensor_id=0, step=100, rank=0, world_size=2, seed=5)


# --------------------------------------------------------------------------------------------
# The real gradient
# --------------------------------------------------------------------------------------------
def test_real_grad_is_a_real_first_layer_gradient(real_grad):
    g = real_grad
    assert g.shape == (300, 784) and g.dtype == torch.float32
    assert bool(torch.isfinite(g).all()) and float(g.norm()) > 0
    # MNIST border pixels are always 0, so whole input columns of the gradient vanish
    zero_cols = int((g.abs().sum(0) == 0).sum())
    assert zero_cols > 20
    assert float(g.max()) > 0 > float(g.min())


# --------------------------------------------------------------------------------------------
# The paper's claim: fitted levels have lower variance than QSGD's and NUQSGD's
# --------------------------------------------------------------------------------------------
ALQ4_VS_NUQSGD = pytest.mark.xfail(
    strict=True,
    reason="Paper claim does not hold here for the paper's normal model (a model limitation, "
           "not a coding error): fitted from bucket_stats, ALQ's folded normal has "
           "sigma ~ 1/sqrt(bucket) ~ 0.011, so at 4 bits its top interior level is ~0.044 and "
           "the heavier-tailed coordinates of the real gradient (r up to ~0.13) are rounded "
           "across [0.044, 1]; the table is optimal for its model (see the optimality tests) "
           "but has several times NUQSGD's exact variance.  The binned model (model='hist', "
           "the default) does beat NUQSGD: test_hist_fitted_levels_beat_fixed_levels.")


CLAIM_CASES = [
    pytest.param(m, b, bits, id=f"{m}-vs-{b}-{bits}bits",
                 marks=ALQ4_VS_NUQSGD if (m, b, bits) == ("alq", "nuqsgd", 4) else ())
    for m in ("alq", "amq") for b in ("qsgd", "nuqsgd") for bits in (3, 4)]


@pytest.mark.parametrize("method,baseline,bits", CLAIM_CASES)
def test_fitted_levels_beat_fixed_levels(method, baseline, bits, real_grad, fitted_tables):
    x = real_grad.reshape(-1).numpy()
    fitted = f32_table(fitted_tables[method, bits])
    base = R.uniform_table(bits) if baseline == "qsgd" else R.exponential_table(bits, 0.5)
    v_fit, v_base = exact_variance(x, fitted), exact_variance(x, base)
    assert v_fit < v_base, f"{method} {v_fit!r} vs {baseline} {v_base!r}"


@pytest.mark.parametrize("bits", [3, 4])
def test_fitted_levels_are_best_under_the_model(bits, real_stats, fitted_tables):
    """Under the fitted model: ALQ (any table) <= AMQ (exponential tables) <= p = 1/2."""
    model = L.FoldedNormal.from_stats(real_stats)
    v = {k: model.expected_variance(t) for k, t in (
        ("alq", fitted_tables["alq", bits]), ("amq", fitted_tables["amq", bits]),
        ("nuqsgd", R.exponential_table(bits)), ("qsgd", R.uniform_table(bits)))}
    assert v["alq"] <= v["amq"] * (1 + 1e-9)
    assert v["amq"] <= v["nuqsgd"] * (1 + 1e-9)
    assert v["alq"] < v["qsgd"]


def test_model_moments_match_the_real_gradient(real_grad, real_stats):
    """from_stats: mu and sigma^2 are the norm^2-weighted mean and variance of the signed
    normalized coordinates (computed here bucket by bucket)."""
    x = real_grad.reshape(-1).double().numpy()
    s0 = s1 = s2 = 0.0
    for start in range(0, x.size, BUCKET):
        b = x[start:start + BUCKET]
        w = float(np.dot(b, b))
        v = b / math.sqrt(w)
        s0 += w * b.size
        s1 += w * float(v.sum())
        s2 += w * float(np.dot(v, v))
    model = L.FoldedNormal.from_stats(real_stats)
    assert model.mu == pytest.approx(s1 / s0, rel=1e-9)
    assert model.sigma == pytest.approx(math.sqrt(s2 / s0 - (s1 / s0) ** 2), rel=1e-9)


# --------------------------------------------------------------------------------------------
# The binned-histogram model (model="hist", the default of ALQ / AMQ)
# --------------------------------------------------------------------------------------------
def hist_stats_np(x, bs, norm, edges):
    """Per bin [e_k, e_{k+1}) of normalized magnitude (r = 1 in the last bin): the sums of
    w, w r, w r^2 with w = ||bucket||^2, bucket by bucket in float64."""
    x = np.asarray(x, dtype=np.float64).reshape(-1)
    nbins = edges.size - 1
    out = np.zeros((nbins, 3))
    for start in range(0, x.size, bs):
        b = x[start:start + bs]
        nrm = math.sqrt(float(np.dot(b, b))) if norm == "l2" else float(np.max(np.abs(b)))
        r = np.minimum(np.abs(b) / (nrm if nrm > 0 else 1.0), 1.0)
        k = np.clip(np.searchsorted(edges, r, side="right") - 1, 0, nbins - 1)
        w = nrm * nrm
        for p in range(3):
            np.add.at(out[:, p], k, w * r ** p)
    return out.reshape(-1)


def test_hist_edges():
    e = S.HIST_EDGES
    assert e.size == 257 and e[0] == 0.0 and e[1] == pytest.approx(1e-8) and e[-1] == 1.0
    ratio = e[2:] / e[1:-1]
    np.testing.assert_allclose(ratio, 10 ** (8 / 255), rtol=1e-12)


@pytest.mark.parametrize("norm", ["l2", "linf"])
@pytest.mark.parametrize("bs", [7, 1000, BUCKET])
def test_histogram_stats_match_numpy(bs, norm, real_grad):
    x = real_grad.reshape(-1)[: 5 * bs + 3]
    got = histogram_stats(x, bs, norm)
    want = hist_stats_np(x.numpy(), bs, norm, S.HIST_EDGES)
    assert got.shape == (768,)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-300)


def test_histogram_stats_additive(real_grad):
    flat = real_grad.reshape(-1)
    a, b = flat[:3 * BUCKET], flat[3 * BUCKET:8 * BUCKET]
    np.testing.assert_allclose(histogram_stats(torch.cat([a, b]), BUCKET),
                               histogram_stats(a, BUCKET) + histogram_stats(b, BUCKET),
                               rtol=1e-12, atol=1e-300)


@pytest.mark.parametrize("ks", [(), (120,), (150, 200), (100, 160, 200, 230, 240, 250)])
def test_histogram_model_exact_for_tables_on_bin_edges(ks, real_grad):
    """When every level is a bin edge, no bin straddles a level, so the binned sums give the
    variance exactly: sum over a bin of w (hi - r)(r - lo) = -lo hi S0 + (lo + hi) S1 - S2."""
    x = real_grad.reshape(-1).numpy()
    levels = np.array([0.0] + [S.HIST_EDGES[k] for k in ks] + [1.0])
    model = L.HistogramModel(histogram_stats(real_grad.reshape(-1), BUCKET))
    assert model.expected_variance(levels) == pytest.approx(exact_variance(x, levels),
                                                            rel=1e-9)


@pytest.fixture(scope="module")
def hist_tables(real_grad):
    st = histogram_stats(real_grad.reshape(-1), BUCKET, "l2")
    return {(m, bits): (L.fit_alq(st, bits) if m == "alq" else L.fit_amq(st, bits))
            for m in ("alq", "amq") for bits in (2, 3, 4)}


@pytest.mark.parametrize("bits", [3, 4])
@pytest.mark.parametrize("baseline", ["qsgd", "nuqsgd"])
@pytest.mark.parametrize("method", ["alq", "amq"])
def test_hist_fitted_levels_beat_fixed_levels(method, baseline, bits, real_grad, hist_tables):
    x = real_grad.reshape(-1).numpy()
    t = hist_tables[method, bits]
    assert is_valid_table(t, bits)
    base = R.uniform_table(bits) if baseline == "qsgd" else R.exponential_table(bits, 0.5)
    assert exact_variance(x, f32_table(t)) < exact_variance(x, base)


@pytest.mark.parametrize("bits", [3, 4])
def test_hist_model_beats_normal_model_on_real_gradient(bits, real_grad, hist_tables,
                                                        fitted_tables):
    """The reason for the binned model: the real gradient's tails are heavier than normal."""
    x = real_grad.reshape(-1).numpy()
    assert exact_variance(x, f32_table(hist_tables["alq", bits])) < \
        exact_variance(x, f32_table(fitted_tables["alq", bits]))


@pytest.mark.parametrize("cls", [hvdcomp.ALQ, hvdcomp.AMQ])
@pytest.mark.parametrize("bits", [3, 4])
def test_compressor_refit_lowers_variance(cls, bits, real_grad):
    """The compressor's own path (default settings): observe -> pending_stats -> update ->
    adopt gives a table with lower exact variance than its initial NUQSGD table."""
    c = cls(bits=bits, bucket_size=BUCKET)
    x = real_grad.reshape(-1).numpy()
    v0 = exact_variance(x, f32_table(c.levels.numpy()))
    assert c.pending_stats() is None
    c.observe(real_grad)
    st = c.pending_stats()
    assert c.pending_stats() is None                          # consumed
    np.testing.assert_allclose(st, c.statistics(real_grad), rtol=0, atol=0)
    c.adopt(c.update(st, 100))
    assert c.level_version == 1 and is_valid_table(c.levels.numpy(), bits)
    assert exact_variance(x, f32_table(c.levels.numpy())) < v0
    assert c.variance(real_grad) == pytest.approx(
        exact_variance(x, f32_table(c.levels.numpy())), rel=1e-5)


# --------------------------------------------------------------------------------------------
# ALQ's coordinate descent
# --------------------------------------------------------------------------------------------
def optimality_residuals(model, t):
    """F(x_j) - (b F(b) - a F(a) - (M1(b) - M1(a))) / (b - a) for each interior level x_j
    with neighbours a = x_{j-1}, b = x_{j+1} (the stationarity condition of ALQ)."""
    t = np.asarray(t, dtype=np.float64)
    F, M1, _ = model.moments(t)
    F, M1 = np.asarray(F), np.asarray(M1)
    res = []
    for j in range(1, t.size - 1):
        a, b = t[j - 1], t[j + 1]
        res.append(float(F[j] - (b * F[j + 1] - a * F[j - 1] - (M1[j + 1] - M1[j - 1]))
                         / (b - a)))
    return np.array(res)


def test_alq_optimality_condition_3_bits(real_stats, fitted_tables):
    model = L.FoldedNormal.from_stats(real_stats)
    res = optimality_residuals(model, fitted_tables["alq", 3])
    assert res.size == 2 and np.all(np.abs(res) <= 1e-6), res


def test_alq_optimality_condition_4_bits(real_stats, fitted_tables):
    """With enough sweeps the 4-bit table is stationary to 1e-6.  The default 30 sweeps stop
    short of that (residuals ~4e-5 here; coordinate descent converges slowly on 6 coupled
    levels) but already within 1e-5 of the stationary table's model variance."""
    model = L.FoldedNormal.from_stats(real_stats)
    converged = L.fit_alq(real_stats, 4, sweeps=100)
    res = optimality_residuals(model, converged)
    assert res.size == 6 and np.all(np.abs(res) <= 1e-6), res
    v_conv = model.expected_variance(converged)
    v_default = model.expected_variance(fitted_tables["alq", 4])
    assert v_conv <= v_default <= v_conv * (1 + 1e-5)


@pytest.mark.parametrize("bits", [3, 4])
def test_alq_local_optimality(bits, real_stats, fitted_tables):
    model = L.FoldedNormal.from_stats(real_stats)
    t = np.asarray(fitted_tables["alq", bits], dtype=np.float64)
    base = model.expected_variance(t)
    for j in range(1, t.size - 1):
        for d in (1e-3, -1e-3):
            moved = t.copy()
            moved[j] += d
            assert moved[j - 1] < moved[j] < moved[j + 1]
            assert model.expected_variance(moved) >= base * (1 - 1e-12), (j, d)


def test_fit_alq_two_bits_is_trivial(real_stats):
    assert np.array_equal(L.fit_alq(real_stats, 2), [0.0, 1.0])
    assert np.array_equal(L.fit_amq(real_stats, 2), [0.0, 1.0])


def test_amq_table_is_exponential(fitted_tables):
    """AMQ's table is {0, p^(s-1), ..., p, 1} for one p in (0, 1)."""
    for bits in (3, 4):
        t = np.asarray(fitted_tables["amq", bits])
        s = t.size - 1
        p = t[s - 1]
        assert 0 < p < 1
        want = np.array([0.0] + [p ** (s - j) for j in range(1, s + 1)])
        np.testing.assert_allclose(t, want, rtol=1e-12, atol=0)


# --------------------------------------------------------------------------------------------
# The folded-normal model against numerical integration
# --------------------------------------------------------------------------------------------
MODELS = [(0.0, 0.3), (0.25, 0.1), (-0.4, 0.5), (0.9, 0.2), (-5.4e-4, 0.011)]
TABLES = {"uniform3": R.uniform_table(3), "exp4": R.exponential_table(4, 0.5),
          "irregular": np.array([0.0, 0.013, 0.05, 0.2, 0.21, 0.7, 1.0])}


@pytest.mark.parametrize("table", sorted(TABLES))
@pytest.mark.parametrize("mu,sigma", MODELS)
def test_expected_variance_matches_integration(mu, sigma, table):
    t = TABLES[table]
    model = L.FoldedNormal(mu, sigma)
    want = 0.0
    for lo, hi in zip(t[:-1], t[1:]):
        want += integrate(lambda r: (hi - r) * (r - lo) * folded_pdf(r, mu, sigma), lo, hi)
    assert model.expected_variance(t) == pytest.approx(want, rel=1e-6)


@pytest.mark.parametrize("mu,sigma", MODELS)
def test_cdf_and_moments_match_integration(mu, sigma):
    model = L.FoldedNormal(mu, sigma)
    for x in (0.005, 0.03, 0.3, 1.0):
        F, M1, M2 = (float(np.asarray(v)) for v in model.moments(np.array(x)))
        grid = np.concatenate([np.linspace(0, min(x, 0.05), 20001),
                               np.linspace(min(x, 0.05), x, 40001)[1:]])
        p = folded_pdf(grid, mu, sigma)
        for got, k in ((F, 0), (M1, 1), (M2, 2)):
            want = float(np.trapezoid(p * grid ** k, grid))
            assert got == pytest.approx(want, rel=1e-6, abs=1e-15), (x, k)
        assert float(model.cdf(x)) == pytest.approx(F, rel=1e-12)


# --------------------------------------------------------------------------------------------
# Tables
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bits", range(2, 9))
def test_fixed_tables(bits):
    s = 2 ** (bits - 1) - 1
    u = L.uniform_levels(bits)
    assert is_valid_table(u, bits)
    np.testing.assert_allclose(u, [j / s for j in range(s + 1)], rtol=0, atol=1e-15)
    for p in (0.5, 0.3, 0.8):
        e = L.exponential_levels(bits, p)
        assert is_valid_table(e, bits)
        np.testing.assert_allclose(e, [0.0] + [p ** (s - j) for j in range(1, s + 1)],
                                   rtol=1e-14, atol=0)
    for name in ("qsgd", "qsgdinf", "nuqsgd", "alq", "amq"):
        c = hvdcomp.get(name, bits=bits)
        assert c.levels.dtype == torch.float32 and is_valid_table(c.levels.numpy(), bits)


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_fitted_tables_are_valid(bits, fitted_tables):
    for name in ("alq", "amq"):
        t = fitted_tables[name, bits]
        assert is_valid_table(t, bits)
        assert is_valid_table(np.asarray(t, dtype=np.float32), bits)    # distinct in float32


@pytest.mark.parametrize("bits", [0, 1, 9, 16])
def test_bits_out_of_range(bits):
    with pytest.raises(ValueError):
        L.num_levels(bits)
    with pytest.raises(ValueError):
        hvdcomp.QSGD(bits=bits)


def test_initial_adaptive_tables_are_nuqsgd():
    for cls in (hvdcomp.ALQ, hvdcomp.AMQ):
        for bits in (2, 3, 4):
            c = cls(bits=bits)
            assert torch.equal(c.levels, torch.tensor(R.exponential_table(bits),
                                                      dtype=torch.float32))
            assert c.level_version == 0


# --------------------------------------------------------------------------------------------
# bucket_stats
# --------------------------------------------------------------------------------------------
def stats_np(x, bs, norm):
    x = np.asarray(x, dtype=np.float64).reshape(-1)
    out = np.zeros(3)
    for start in range(0, x.size, bs):
        b = x[start:start + bs]
        nrm = math.sqrt(float(np.dot(b, b))) if norm == "l2" else float(np.max(np.abs(b)))
        v = b / nrm if nrm > 0 else b
        w = nrm * nrm
        out += [w * b.size, w * float(v.sum()), w * float(np.dot(v, v))]
    return out


@pytest.mark.parametrize("norm", ["l2", "linf"])
@pytest.mark.parametrize("bs", [1000, BUCKET])
def test_bucket_stats_additive(bs, norm, real_grad):
    flat = real_grad.reshape(-1)
    a, b = flat[:3 * bs], flat[3 * bs:8 * bs]
    both = torch.cat([a, b])
    got = bucket_stats(both, bs, norm)
    np.testing.assert_allclose(got, bucket_stats(a, bs, norm) + bucket_stats(b, bs, norm),
                               rtol=1e-12, atol=0)
    np.testing.assert_allclose(got, stats_np(both.numpy(), bs, norm), rtol=1e-12, atol=0)


@pytest.mark.parametrize("norm", ["l2", "linf"])
@pytest.mark.parametrize("bs", [7, 1000, BUCKET])
def test_bucket_stats_partial_last_bucket(bs, norm, real_grad):
    x = real_grad.reshape(-1)[: 5 * bs + 3]
    np.testing.assert_allclose(bucket_stats(x, bs, norm), stats_np(x.numpy(), bs, norm),
                               rtol=1e-12, atol=0)


def test_bucket_stats_zero_and_empty():
    assert np.array_equal(bucket_stats(torch.zeros(0), 8), np.zeros(3))
    assert np.array_equal(bucket_stats(torch.zeros(20), 8), np.zeros(3))


# --------------------------------------------------------------------------------------------
# The adaptive compressors' table life cycle
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["alq", "amq"])
@pytest.mark.parametrize("bits", [3, 4])
def test_state_dict_round_trip(name, bits, fitted_tables):
    c = hvdcomp.get(name, bits=bits, bucket_size=BUCKET)
    c.adopt(fitted_tables[name, bits])
    c.adopt(fitted_tables[name, bits])                    # the same table again: version 2
    state = json.loads(json.dumps(c.state_dict()))        # what a checkpoint file holds
    d = hvdcomp.get(name, bits=bits, bucket_size=BUCKET)
    d.load_state_dict(state)
    assert torch.equal(d.levels, c.levels) and d.levels.dtype == torch.float32
    assert torch.equal(d.levels, torch.tensor(fitted_tables[name, bits], dtype=torch.float32))
    assert d.level_version == c.level_version == 2
    # the restored compressor decodes the original's messages bit for bit
    x = torch.linspace(-1, 1, 1000)
    m = Message.from_bytes(c.encode(x, KEY).to_bytes())
    out_c, out_d = torch.zeros(1000), torch.zeros(1000)
    c.decode(m, KEY, out_c)
    d.decode(m, KEY, out_d)
    assert torch.equal(out_c, out_d)


@pytest.mark.parametrize("n_levels", [2, 3, 5, 8])
@pytest.mark.parametrize("name", ["alq", "amq"])
def test_load_state_dict_wrong_number_of_levels(name, n_levels):
    c = hvdcomp.get(name, bits=3)                           # 4 levels
    with pytest.raises(ValueError):
        c.load_state_dict({"levels": list(np.linspace(0, 1, n_levels)), "level_version": 3})
    assert c.level_version == 0 and c.levels.numel() == 4


@pytest.mark.parametrize("name", ["alq", "amq"])
def test_adopt_bumps_version_and_old_messages_fail(name, fitted_tables):
    c = hvdcomp.get(name, bits=3, bucket_size=256)
    x = torch.linspace(-0.5, 1.0, 700)
    before = Message.from_bytes(c.encode(x, KEY).to_bytes())
    assert before.level_version == 0
    c.adopt(fitted_tables[name, 3])
    assert c.level_version == 1
    assert torch.equal(c.levels, torch.tensor(fitted_tables[name, 3], dtype=torch.float32))
    with pytest.raises(WireFormatError, match="level-table version"):
        c.decode(before, KEY, torch.zeros(700))
    after = Message.from_bytes(c.encode(x, KEY).to_bytes())
    assert after.level_version == 1
    assert c.decode(after, KEY, torch.zeros(700)) is True
    c.adopt(fitted_tables[name, 3])
    assert c.level_version == 2
    with pytest.raises(WireFormatError, match="level-table version"):
        c.decode(after, KEY, torch.zeros(700))


@pytest.mark.parametrize("bad", [[0.0, 0.5, 1.0], [0.0, 0.3, 0.2, 1.0], [0.0, 0.3, 0.3, 1.0],
                                 [0.0, 0.1, 0.5, 1.0, 1.5]])
def test_adopt_rejects_invalid_tables(bad):
    c = hvdcomp.ALQ(bits=3)
    with pytest.raises(ValueError):
        c.adopt(bad)
    assert c.level_version == 0
