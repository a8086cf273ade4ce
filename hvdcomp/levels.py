"""Level tables for bucketed stochastic quantization, and ALQ / AMQ level fitting.

Pure math (float64 NumPy), no I/O.  A level table is an increasing float array
``0 = l_0 < l_1 < ... < l_s = 1`` of normalized magnitudes.

Bit convention (the same for every quantizer in hvdcomp): ``bits`` counts the whole code of
one coordinate, sign included: 1 sign bit + (bits - 1) bits of level index, so a table has
``2**(bits-1)`` levels and there are ``2**bits`` signed code points.  3 bits: 4 magnitudes
{0, l1, l2, 1} x 2 signs = 8 signed levels, as in the ALQ authors' code.

Variance (Faghri et al., NeurIPS 2020, Eq. 2 and Sec. 3): stochastic rounding of a normalized
magnitude r in [l_j, l_{j+1}] has variance (l_{j+1} - r)(r - l_j); a bucket's error variance
is its norm squared times the sum of that over its coordinates.

The distribution of normalized magnitudes comes from cheap statistics of the gradients,
computed by the ops of hvdcomp.ops.level_stats (``bucket_stats``, ``histogram_stats``) and
summed across tensors and ranks; the fits here take those sums.  ``model="normal"`` is the
paper's: the signed normalized coordinates v_i / ||v|| are N(mu, sigma^2) (magnitudes: a
folded normal truncated to [0, 1]), from three sums weighted by the bucket norm squared.
``model="hist"`` (default) keeps, per bin of a fixed 256-bin log-spaced histogram of
magnitudes, the same three weighted sums; real gradients have heavy tails that the normal
model misses (measured in bench/results/quantizers.md), and the binned sums make the
expected variance of a level table exact up to within-bin spread.  ALQ minimizes the
model's expected variance by coordinate descent: given its neighbours a < b, the optimal
interior level x solves
    F(x) = (b F(b) - a F(a) - (M1(b) - M1(a))) / (b - a)
(F: model CDF, M1: partial first moment), i.e. it is a quantile of the model; this is the
closed-form coordinate update of ALQ (Sec. 3.1).  AMQ restricts the table to
{0, p^(s-1), ..., p, 1} and minimizes over the single multiplier p (Sec. 3.2); we minimize
the same objective by a bounded one-dimensional search instead of the authors' gradient
descent, which finds the same optimum without a learning rate.
"""
from __future__ import annotations

import math

import numpy as np

__all__ = ["uniform_levels", "exponential_levels", "num_levels", "expected_variance",
           "empirical_variance", "FoldedNormal", "HistogramModel", "fit_alq", "fit_amq",
           "model_from_stats", "refine"]


def num_levels(bits: int) -> int:
    """Number of magnitude levels for a ``bits``-bit code (sign included): 2**(bits-1)."""
    if not 2 <= bits <= 8:
        raise ValueError(f"bits must be in 2..8 (1 sign bit + at least 1 index bit), got {bits}")
    return 1 << (bits - 1)


def uniform_levels(bits: int) -> np.ndarray:
    """QSGD's uniform table {0, 1/s, ..., 1}."""
    s = num_levels(bits) - 1
    return np.arange(s + 1, dtype=np.float64) / s


def exponential_levels(bits: int, p: float = 0.5) -> np.ndarray:
    """NUQSGD's exponential table {0, p^(s-1), ..., p, 1}."""
    s = num_levels(bits) - 1
    if not 0.0 < p < 1.0:
        raise ValueError(f"p must be in (0, 1), got {p}")
    return np.concatenate([[0.0], p ** np.arange(s - 1, -1, -1, dtype=np.float64)])


def empirical_variance(r: np.ndarray, weights: np.ndarray, levels: np.ndarray) -> float:
    """Exact expected squared error sum_i w_i (l_{j+1} - r_i)(r_i - l_j) for magnitudes r in
    [0, 1] (w_i = the bucket norm squared of coordinate i)."""
    levels = np.asarray(levels, dtype=np.float64)
    r = np.clip(np.asarray(r, dtype=np.float64), 0.0, 1.0)
    j = np.clip(np.searchsorted(levels, r, side="right") - 1, 0, len(levels) - 2)
    lo, hi = levels[j], levels[j + 1]
    return float(np.sum(np.asarray(weights, dtype=np.float64) * (hi - r) * (r - lo)))


def refine(levels, bits: int) -> np.ndarray:
    """A finer table of ``num_levels(bits)`` levels that holds every level of ``levels``
    (increasing, from 0 to 1, at most that many levels): each of its m intervals is cut
    into equal parts, ``num_levels(bits) - 1`` parts in all, ``P // m`` per interval and one
    more in each of the ``P % m`` lowest (where normalized gradient magnitudes crowd).  So
    3 bits -> 5: each of the 3 intervals of {0, l1, l2, 1} in 5 parts, 16 levels (QSGD's
    uniform 3-bit table becomes the uniform 5-bit one).  float32 (ready for the kernels),
    strictly increasing: a cut that rounds onto a neighbour in float32 (an interval only a
    few float32 values wide) moves by one float32 step, so every level is distinct.

    Every coordinate's variance (Eq. 2) under the finer table is at most the one under
    ``levels`` (its bracketing levels are no farther apart on either side), and an interval
    of width d cut in k parts has worst case d^2 / (4 k^2) in place of d^2 / 4: between k
    (magnitudes close to a level of ``levels``) and k^2 (magnitudes spread over the
    interval) times smaller.  Raises ValueError for a table that is not increasing from 0
    to 1 or has more levels than ``bits`` allows."""
    lv = np.asarray(levels, dtype=np.float64).reshape(-1)
    total = num_levels(bits) - 1
    m = lv.size - 1
    if m < 1 or m > total or lv[0] != 0.0 or lv[-1] != 1.0 or not np.all(np.diff(lv) > 0):
        raise ValueError(f"refine: need an increasing table from 0 to 1 of 2..{total + 1} "
                         f"levels, got {lv.tolist()}")
    parts = np.full(m, total // m)
    parts[:total % m] += 1
    out = [lv[0]]
    for j in range(m):
        a, b, k = lv[j], lv[j + 1], int(parts[j])
        out.extend(a + (b - a) * np.arange(1, k) / k)
        out.append(b)
    f = np.asarray(out, dtype=np.float32)
    f[0], f[-1] = 0.0, 1.0
    for j in range(1, f.size - 1):                  # distinct in float32, 1 stays on top
        f[j] = max(f[j], np.nextafter(f[j - 1], np.float32(2)))
    for j in range(f.size - 2, 0, -1):
        f[j] = min(f[j], np.nextafter(f[j + 1], np.float32(0)))
    return f


_SQRT2 = math.sqrt(2.0)


class FoldedNormal:
    """|V| for V ~ N(mu, sigma^2), restricted to [0, 1] (unnormalized: the constant does not
    change the minimizer).  cdf(x) and m1(x), m2(x) are the mass and partial moments on [0, x].
    """

    def __init__(self, mu: float, sigma: float):
        self.mu = float(mu)
        self.sigma = max(float(sigma), 1e-12)

    @classmethod
    def from_stats(cls, stats) -> "FoldedNormal":
        s0, s1, s2 = (float(v) for v in stats)
        if s0 <= 0:
            return cls(0.0, 0.5)
        mu = s1 / s0
        var = max(s2 / s0 - mu * mu, 1e-24)
        return cls(mu, math.sqrt(var))

    def _parts(self, x, m):
        # For Y ~ N(m, s): P(Y<=x), E[Y 1{Y<=x}], E[Y^2 1{Y<=x}]
        s = self.sigma
        z = (x - m) / s
        Phi = 0.5 * (1.0 + _erf(z / _SQRT2))
        phi = np.exp(-0.5 * z * z) / math.sqrt(2 * math.pi)
        return Phi, m * Phi - s * phi, (m * m + s * s) * Phi - s * (x + m) * phi

    def _cum(self, x):
        # mass and moments on [0, x] of the folded density f(r; mu) + f(r; -mu)
        x = np.asarray(x, dtype=np.float64)
        out = []
        for m in (self.mu, -self.mu):
            a = self._parts(x, m)
            z = self._parts(np.zeros_like(x), m)
            out.append([a[k] - z[k] for k in range(3)])
        return [out[0][k] + out[1][k] for k in range(3)]

    def cdf(self, x):
        return self._cum(x)[0]

    def moments(self, x):
        return self._cum(x)

    def expected_variance(self, levels) -> float:
        levels = np.asarray(levels, dtype=np.float64)
        F, M1, M2 = self._cum(levels)
        dF, dM1, dM2 = np.diff(F), np.diff(M1), np.diff(M2)
        lo, hi = levels[:-1], levels[1:]
        # integral over [lo, hi] of (hi - r)(r - lo) p(r) dr
        return float(np.sum(-lo * hi * dF + (lo + hi) * dM1 - dM2))

    def optimal_level(self, a: float, b: float) -> float:
        Fa, M1a, _ = (float(v) for v in self._cum(a))
        Fb, M1b, _ = (float(v) for v in self._cum(b))
        target = (b * Fb - a * Fa - (M1b - M1a)) / (b - a)
        lo, hi = a, b
        for _ in range(60):               # F is increasing: bisection to float64 precision
            mid = 0.5 * (lo + hi)
            if float(self.cdf(mid)) < target:
                lo = mid
            else:
                hi = mid
        return 0.5 * (lo + hi)

    def quantile_levels(self, s: int) -> np.ndarray:
        total = float(self.cdf(1.0))
        lv = [0.0]
        for j in range(1, s):
            t = total * j / s
            lo, hi = 0.0, 1.0
            for _ in range(60):
                mid = 0.5 * (lo + hi)
                if float(self.cdf(mid)) < t:
                    lo = mid
                else:
                    hi = mid
            lv.append(0.5 * (lo + hi))
        lv.append(1.0)
        return np.array(lv)


def _erf(x):
    x = np.asarray(x, dtype=np.float64)
    return np.vectorize(math.erf, otypes=[np.float64])(x) if x.ndim else np.float64(math.erf(x))


def _strictly_increasing(levels: np.ndarray) -> np.ndarray:
    # Keep the table usable in float32: distinct, increasing, endpoints exactly 0 and 1.
    lv = np.clip(levels.astype(np.float64), 0.0, 1.0)
    lv[0], lv[-1] = 0.0, 1.0
    eps = 1e-7
    for j in range(1, len(lv)):
        lv[j] = max(lv[j], lv[j - 1] + eps)
    lv[-1] = 1.0
    for j in range(len(lv) - 2, 0, -1):
        lv[j] = min(lv[j], lv[j + 1] - eps)
    return lv


class HistogramModel:
    """The distribution of normalized magnitudes as point masses at the bin means of
    :func:`hvdcomp.ops.level_stats.histogram_stats` (no parametric assumption: heavy tails are
    kept)."""

    def __init__(self, stats):
        st = np.asarray(stats, dtype=np.float64).reshape(-1, 3)
        keep = st[:, 0] > 0
        self.m, self.s1, self.s2 = st[keep, 0], st[keep, 1], st[keep, 2]
        self.r = self.s1 / self.m if keep.any() else np.zeros(0)
        # cumulative sums for O(1) interval sums
        self.cm = np.concatenate([[0.0], np.cumsum(self.m)])
        self.c1 = np.concatenate([[0.0], np.cumsum(self.s1)])

    def expected_variance(self, levels) -> float:
        levels = np.asarray(levels, dtype=np.float64)
        j = np.clip(np.searchsorted(levels, self.r, side="right") - 1, 0, len(levels) - 2)
        lo, hi = levels[j], levels[j + 1]
        return float(np.sum(-lo * hi * self.m + (lo + hi) * self.s1 - self.s2))

    def optimal_level(self, a: float, b: float) -> float:
        """argmin over x in [a, b] of the variance of the masses in [a, b] with levels a, x, b.
        d/dx = sum_{r<=x} (s1 - a m) - sum_{r>x} (b m - s1) is increasing in x: the optimum
        is the first bin mean where it turns non-negative (the discrete form of Eq. 9)."""
        i0 = np.searchsorted(self.r, a, side="left")
        i1 = np.searchsorted(self.r, b, side="right")
        if i1 - i0 == 0:
            return 0.5 * (a + b)
        m, s1 = self.m[i0:i1], self.s1[i0:i1]
        left = np.cumsum(s1 - a * m)
        right_total = np.sum(b * m - s1)
        right = right_total - np.cumsum(b * m - s1)
        d = left - right
        k = int(np.argmax(d >= 0)) if (d >= 0).any() else len(d) - 1
        return float(self.r[i0 + k])

    def quantile_levels(self, s: int) -> np.ndarray:
        if len(self.m) == 0:
            return np.linspace(0, 1, s + 1)
        cdf = np.cumsum(self.m) / self.m.sum()
        qs = [float(self.r[min(np.searchsorted(cdf, j / s), len(self.r) - 1)])
              for j in range(1, s)]
        return np.array([0.0] + qs + [1.0])


def model_from_stats(stats):
    """FoldedNormal for 3 statistics (the paper's model), HistogramModel for binned ones."""
    stats = np.asarray(stats, dtype=np.float64).reshape(-1)
    return FoldedNormal.from_stats(stats) if stats.size == 3 else HistogramModel(stats)


def fit_alq(stats, bits: int, sweeps: int = 30) -> np.ndarray:
    """ALQ levels for the model of ``stats`` (hvdcomp.ops.level_stats: ``bucket_stats``, the
    paper's truncated normal; ``histogram_stats``, binned, no parametric assumption).

    Coordinate descent from three starts (model quantiles, uniform, exponential), keeping the
    table of lowest model variance.  Deterministic given ``stats``.
    """
    model = model_from_stats(stats)
    s = num_levels(bits) - 1
    starts = [model.quantile_levels(s), uniform_levels(bits), exponential_levels(bits)]
    best, best_v = None, math.inf
    for lv in starts:
        lv = lv.astype(np.float64).copy()
        for _ in range(sweeps):
            for j in range(1, s):
                lv[j] = model.optimal_level(lv[j - 1], lv[j + 1])
        lv = _strictly_increasing(lv)
        v = model.expected_variance(lv)
        if v < best_v:
            best, best_v = lv, v
    return best


def fit_amq(stats, bits: int) -> np.ndarray:
    """AMQ levels {0, p^(s-1), ..., p, 1} with p minimizing the fitted model's variance."""
    model = model_from_stats(stats)
    f = lambda p: model.expected_variance(exponential_levels(bits, p))  # noqa: E731
    grid = np.linspace(0.01, 0.99, 99)
    vals = [f(p) for p in grid]
    k = int(np.argmin(vals))
    lo, hi = grid[max(k - 1, 0)], grid[min(k + 1, len(grid) - 1)]
    g = (math.sqrt(5) - 1) / 2
    for _ in range(50):                     # golden-section refinement
        c, d = hi - g * (hi - lo), lo + g * (hi - lo)
        if f(c) < f(d):
            hi = d
        else:
            lo = c
    return _strictly_increasing(exponential_levels(bits, 0.5 * (lo + hi)))


def expected_variance(stats, levels) -> float:
    """Model expected variance of ``levels`` under the model of ``stats``."""
    return model_from_stats(stats).expected_variance(levels)
