"""PSQ and BHQ (Chen et al., NeurIPS 2020, arXiv 2010.14298, Sec. 4): statistics, bit-exact
codes and wire format, the Householder transform, the paper's variance claim, bad input.

Every expected value is computed here, independently of hvdcomp's code, from the module
docstrings of hvdcomp/compressors/psq.py (row view, wire format) and hvdcomp/ops/psq.py (the
arithmetic: the specification) or by hand:

* ``ref_psq`` / ``ref_bhq``: NumPy re-implementations of the row view, the per-row grid, the
  stochastic rounding (fed with the same Philox uniforms, hvdcomp.philox.uniform), the BHQ
  grouping, scales and Householder arithmetic; the packed bytes are packed bit by bit here;
* variances: per coordinate (g_{f+1} - x)(x - g_f) with the grid built from the row's range,
  and for BHQ the explicit matrix M = P^T diag(1/s) H, Var[x_hat_i] = sum_p M_ip^2 v_p;
* PTQ (one range for the whole tensor) exists only here, as the baseline of the claim;
* Monte-Carlo checks use Bernstein bounds at a failure probability of 1e-9 per check, or
  5 standard errors of the sample mean; inputs and Philox streams are fixed, so a pass or
  fail is reproducible.
"""
import dataclasses
import math

import numpy as np
import pytest
import torch

import hvdcomp
from hvdcomp import ConfigError, Message, WireFormatError
from hvdcomp.compressors.psq import BHQ, PSQ
from hvdcomp.ops.psq import decode_bounds, householder_blocks
from hvdcomp.philox import uniform
from hvdcomp.wire import CODECS, DTYPES, FLAG_NONFINITE

F32, F64 = np.float32, np.float64
HEADER, CRC = 48, 4
DELTA = 1e-9
KEY = hvdcomp.TensorKey(name="fc.weight", tensor_id=5, step=9, rank=2, world_size=4, seed=13)


def key_at(step, base=KEY):
    return dataclasses.replace(base, step=step)


# --- independent NumPy references ----------------------------------------------------------

def rows_np(shape):
    """The docstring's row view: ndim >= 2 -> shape[0] rows; 1-D -> one row; 0-d -> 1x1;
    empty -> 0 x 0."""
    n = int(np.prod(shape)) if len(shape) else 1
    if n == 0:
        return 0, 0
    if len(shape) <= 1:
        return 1, n
    return shape[0], n // shape[0]


def u_np(n, key=KEY):
    return uniform(n, seed=key.seed, step=key.step, rank=key.rank,
                   tensor_id=key.tensor_id).numpy()


def pack_np(codes, bits):
    """LSB-first bit packing by hand: bit b of code i is bit i*bits + b of the stream."""
    codes = np.asarray(codes, dtype=np.int64).reshape(-1)
    stream = ((codes[:, None] >> np.arange(bits)) & 1).astype(np.uint8).reshape(-1)
    return np.packbits(stream, bitorder="little")


def ref_psq(x32, bits, u32):
    """(lohi float32 (R, 2), codes int64 (R*D,)): per row lo = min, hi = max,
    r = (x - lo) / span * L in float64 (0 if span == 0) clipped to [0, L],
    code = floor(r) + (u < r - floor(r))."""
    R, D = x32.shape
    if R * D == 0:
        return np.zeros((R, 2), F32), np.zeros(0, np.int64)
    L = 2 ** bits - 1
    lo, hi = x32.min(axis=1), x32.max(axis=1)
    lo64 = lo.astype(F64)[:, None]
    span = hi.astype(F64)[:, None] - lo64
    r = np.clip((x32.astype(F64) - lo64) / np.where(span > 0, span, 1.0) * L, 0, L)
    f = np.floor(r)
    idx = f.astype(np.int64) + (u32.reshape(R, D).astype(F64) < r - f)
    return np.stack([lo, hi], axis=1).astype(F32), idx.reshape(-1)


def ref_dequant(lohi, codes, bits):
    """float64 (R, D): lo + code * ((hi - lo) / L)."""
    R = lohi.shape[0]
    lo = lohi[:, 0].astype(F64)[:, None]
    step = (lohi[:, 1].astype(F64)[:, None] - lo) / (2 ** bits - 1)
    return lo + codes.reshape(R, -1).astype(F64) * step


def grid_var(x32, bits):
    """Per coordinate (g_{f+1} - x)(x - g_f) on the row's grid g_j = lo + j (hi - lo) / L,
    float64 (R, D).  A constant row has variance 0."""
    x = x32.astype(F64)
    L = 2 ** bits - 1
    lo = x.min(axis=1, keepdims=True)
    d = (x.max(axis=1, keepdims=True) - lo) / L
    safe = np.where(d > 0, d, 1.0)
    f = np.minimum(np.floor((x - lo) / safe), L - 1)
    v = (lo + (f + 1) * d - x) * (x - (lo + f * d))
    return np.where(d > 0, np.maximum(v, 0.0), 0.0)


def ptq_var(x32, bits):
    """PTQ, the baseline (Sec. 4 of the paper): ONE grid over the whole tensor's [min, max]."""
    return float(grid_var(x32.reshape(1, -1), bits).sum())


def householder_np(k):
    """Explicit H = I - 2 n n^T / ||n||^2 with n = e_1 - 1/sqrt(k) (identity for k = 1)."""
    if k == 1:
        return np.eye(1)
    n = -np.full(k, 1.0 / math.sqrt(k))
    n[0] += 1.0
    return np.eye(k) - 2.0 * np.outer(n, n) / (n @ n)


def reflect_arith(Y):
    """The docstring's Householder arithmetic on a float64 block Y (k, D), k >= 2."""
    k = Y.shape[0]
    t = 1.0 / math.sqrt(k)
    c = 2.0 / (2.0 - 2.0 * t)
    acc = Y[0].copy()
    for j in range(1, k):
        acc = acc + Y[j]
    w = Y[0] - t * acc
    out = Y.copy()
    out[0] = Y[0] - (c * (1.0 - t)) * w
    for j in range(1, k):
        out[j] = Y[j] - (c * -t) * w
    return out


def ref_bhq_plan(x32, bits, bs):
    """The docstring's grouping, written with Python lists.  Returns (perm, sizes, scales
    float32, y float32 (R, D) in wire order, exact variance)."""
    R, D = x32.shape
    mag = x32.max(axis=1).astype(F64) - x32.min(axis=1).astype(F64)
    order = np.argsort(-mag, kind="stable")
    nvar = int(np.count_nonzero(mag > 0))
    G = -(-nvar // bs)
    big, small = list(order[:G]), list(order[G:nvar][::-1])
    blocks = [[big[g]] + small[g * (bs - 1):(g + 1) * (bs - 1)] for g in range(G)]
    perm, sizes, scales, ys, total = [], [], [], [], 0.0
    for b in blocks:
        k = len(b)
        xb = x32[b]
        v_id = float(grid_var(xb, bits).sum())
        if k >= 2:
            l1 = mag[b[0]]
            l2 = math.sqrt(float(np.sum(mag[b[1:]] ** 2)) / (k - 1))
            s = F32((l2 * math.sqrt(k) / ((k - 1) * l1)) ** (1.0 / 3.0))
            Y = xb.astype(F64)
            Y[0] = Y[0] * F64(s)
            y = reflect_arith(Y).astype(F32)
            v_t = (1.0 + (1.0 / (F64(s) * F64(s)) - 1.0) / k) * float(grid_var(y, bits).sum())
            if np.isfinite(y).all() and v_t < v_id:
                perm += b
                sizes.append(k)
                scales.append(s)
                ys.append(y)
                total += v_t
                continue
        perm += b
        sizes += [1] * k
        scales += [F32(1)] * k
        ys.append(xb)
        total += v_id
    const = list(order[nvar:])
    perm += const
    sizes += [1] * len(const)
    scales += [F32(1)] * len(const)
    ys.append(x32[const])
    return (np.array(perm, np.int64), np.array(sizes, np.int64), np.array(scales, F32),
            np.concatenate(ys).astype(F32), total)


def transform_matrix(perm, sizes, scales):
    """M (R, R) with x_hat = M y_hat: wire row p -> original row perm[p], per block
    diag(1/s, 1, ..., 1) @ H_k."""
    R = len(perm)
    M = np.zeros((R, R))
    p = 0
    for k, s in zip(sizes, scales):
        B = householder_np(int(k))
        B[0] /= F64(s)
        M[np.ix_(perm[p:p + k], np.arange(p, p + k))] = B
        p += k
    return M


def msg_len(ndim, nsec, payload):
    return HEADER + 8 * ndim + 8 * nsec + payload + CRC


def bernstein(var, bound, delta=DELTA):
    """Half-width t with P(|S| >= t) <= delta for a sum S of independent zero-mean terms of
    total variance var, each bounded by ``bound`` in absolute value (Bernstein)."""
    lg = math.log(2.0 / delta)
    a = bound * lg / 3.0
    return a + math.sqrt(a * a + 2.0 * lg * var)


def decode(comp, x, key=KEY):
    """encode -> bytes -> decode into zeros; returns (received message, float32 flat)."""
    msg = Message.from_bytes(comp.encode(x, key).to_bytes())
    acc = torch.zeros(x.numel())
    assert comp.decode(msg, key, acc) is True
    return msg, acc


# --- inputs ------------------------------------------------------------------------------

def heavy_rows(rng, R, D, spread=1.5):
    """Rows of Gaussian noise with log-normal row magnitudes (like per-sample gradients)."""
    return (rng.standard_normal((R, D)) * np.exp(spread * rng.standard_normal((R, 1)))
            ).astype(F32)


def outlier_rows(rng, R=64, D=200, row=5, factor=100.0):
    x = rng.standard_normal((R, D)).astype(F32)
    x[row] *= F32(factor)
    return x


@pytest.fixture
def rng():
    return np.random.default_rng(2010_14298)


# --- settings, registry --------------------------------------------------------------------

def test_registry_codecs_and_specs():
    p, b = hvdcomp.get("psq:bits=3"), hvdcomp.get("bhq:bits=5,block_size=4")
    assert type(p) is PSQ and type(b) is BHQ
    assert (p.codec, b.codec) == (17, 18) == (CODECS["psq"], CODECS["bhq"])
    assert p.spec() == "psq:bits=3,entropy=False"
    assert b.spec() == "bhq:bits=5,block_size=4,entropy=False"
    assert hvdcomp.get(b.spec()).settings() == {"bits": 5, "block_size": 4, "entropy": False}
    assert PSQ().settings() == {"bits": 4, "entropy": False}
    assert BHQ().settings() == {"bits": 4, "block_size": 8, "entropy": False}


@pytest.mark.parametrize("bad", [0, 9, -1, 2.5, True, "4"])
def test_bad_bits_raise_value_error(bad):
    with pytest.raises(ValueError, match="bits"):
        PSQ(bits=bad)
    with pytest.raises(ValueError, match="bits"):
        BHQ(bits=bad)


@pytest.mark.parametrize("bad", [0, -3, 1.5, False])
def test_bad_block_size_raises_value_error(bad):
    with pytest.raises(ValueError, match="block_size"):
        BHQ(block_size=bad)


def test_settings_mean_the_same_as_in_a_spec():
    # one meaning of a setting: Python values of the setting's type, spec strings parsed once
    assert BHQ(bits=3, block_size=16, entropy=True).settings() == \
        hvdcomp.get("bhq:bits=3,block_size=16,entropy=yes").settings() == \
        {"bits": 3, "block_size": 16, "entropy": True}
    assert hvdcomp.get("psq:entropy=no").entropy is False
    with pytest.raises(ValueError, match="entropy"):
        PSQ(entropy="no")          # a string is not a flag: refused, never read as True


def test_bad_spec_raises_config_error():
    for spec in ("psq:bits=0", "bhq:block_size=0", "psq:block_size=4", "bhq:bits=x"):
        with pytest.raises(ConfigError):
            hvdcomp.get(spec)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.uint8, torch.bool])
def test_integer_tensors_raise_type_error(dtype):
    x = torch.ones(4, 5, dtype=dtype)
    for c in (PSQ(), BHQ()):
        with pytest.raises(TypeError, match="floating"):
            c.encode(x, KEY)


# --- PSQ: bit-exact codes, decode, sizes ------------------------------------------------------

SHAPES = [(37, 29), (3, 4, 5), (50,), (), (6, 1), (1, 40), (2, 3, 1, 7)]


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("shape", SHAPES)
def test_psq_bytes_and_values_bit_exact(shape, bits, rng):
    x = np.asarray(rng.standard_normal(shape) * 3, dtype=F32)
    R, D = rows_np(shape)
    x2 = x.reshape(R, D)
    lohi, codes = ref_psq(x2, bits, u_np(R * D))
    c = PSQ(bits=bits)
    sent = c.encode(torch.from_numpy(x), KEY)
    raw = sent.to_bytes()
    assert len(raw) == msg_len(len(shape), 2, 8 * R + -(-R * D * bits // 8))
    assert len(raw) - HEADER - 8 * len(shape) - 16 - CRC == c.message_bytes(shape)
    got = Message.from_bytes(raw)
    assert (got.codec, got.bits, got.bucket_size, got.shape) == (17, bits, 0, shape)
    assert bytes(got.sections[0]) == lohi.astype("<f4").tobytes()
    assert bytes(got.sections[1]) == pack_np(codes, bits).tobytes()
    acc = torch.zeros(x.size)
    assert c.decode(got, KEY, acc)
    want = ref_dequant(lohi, codes, bits).astype(F32).reshape(-1)
    np.testing.assert_array_equal(acc.numpy(), want)


def test_psq_row_view_convention(rng):
    # rows are the first dimension (a (7,3,5,5) conv weight has 7 rows of 75), a 1-D tensor
    # is ONE row, a 0-d tensor is 1x1: section 0 holds 8 bytes per row.
    for shape, rows in [((7, 3, 5, 5), 7), ((10,), 1), ((), 1), ((4, 9), 4), ((0, 5), 0),
                        ((5, 0), 0)]:
        msg = PSQ().encode(torch.randn(shape), KEY)
        assert len(msg.sections[0]) == 8 * rows, shape
    # a 1-D tensor has one range: its (lo, hi) are the tensor's min and max
    x = torch.tensor([3.0, -1.0, 7.5, 2.0])
    lohi = np.frombuffer(bytes(PSQ().encode(x, KEY).sections[0]), "<f4")
    assert lohi.tolist() == [-1.0, 7.5]


@pytest.mark.parametrize("comp", ["psq:bits=1", "psq:bits=4", "bhq:bits=3,block_size=4"])
def test_constant_and_zero_rows_decode_exactly(comp, rng):
    c = hvdcomp.get(comp)
    x = heavy_rows(rng, 12, 33)
    x[0] = 0.0                 # an all-zero row
    x[3] = F32(-2.75)          # a constant row
    x[7] = F32(1e-30)          # a tiny constant row
    x[11] = 0.0
    _, acc = decode(c, torch.from_numpy(x))
    out = acc.numpy().reshape(12, 33)
    for r in (0, 3, 7, 11):
        np.testing.assert_array_equal(out[r], x[r])
    # an all-zero and an all-constant tensor decode exactly
    for z in (np.zeros((9, 5), F32), np.full((4, 6), F32(0.3))):
        _, acc = decode(c, torch.from_numpy(z))
        np.testing.assert_array_equal(acc.numpy(), z.reshape(-1))


# --- PSQ: statistics ------------------------------------------------------------------------

def mc_decodes(comp, x, steps, key=KEY):
    """float64 (steps, numel): decoded values at steps 0..steps-1 (fresh Philox streams)."""
    xt = torch.from_numpy(x)
    out = np.empty((steps, x.size))
    for t in range(steps):
        k = key_at(t, key)
        acc = torch.zeros(x.size)
        comp.decode(Message.from_bytes(comp.encode(xt, k).to_bytes()), k, acc)
        out[t] = acc.numpy()
    return out


def check_unbiased(dec, x, var, bound, w, w_var, w_bound):
    """Bernstein checks of E[x_hat] = x, each at failure probability DELTA.

    Per coordinate i: |sum_t (x_hat_ti - x_i)| <= t(T var_i, bound_i), union over the coords.
    Weighted whole tensor: sum_{t,i} w_i (x_hat_ti - x_i) is a sum of T * (wire coordinates)
    independent rounding errors of total variance T * w_var, each bounded by w_bound; this
    catches a small coherent bias that the per-coordinate check is too coarse to see."""
    T, n = dec.shape
    err = dec - x.reshape(1, -1).astype(F64)
    fp = 1e-6 * T * np.abs(x.reshape(-1).astype(F64))           # float32 rounding slack
    per = err.sum(axis=0)
    for i in range(n):
        t = bernstein(T * var[i], bound[i], DELTA / n) + fp[i]
        assert abs(per[i]) <= t, (i, per[i], t)
    tot = float((err.sum(axis=0) * w).sum())
    t = bernstein(T * w_var, w_bound) + float((fp * np.abs(w)).sum())
    assert abs(tot) <= t, (tot, t)


def test_psq_unbiased_and_row_variance_monte_carlo(rng):
    bits, T = 3, 400
    x = heavy_rows(rng, 8, 60)
    x[2, :] = 0.5                                    # constant row: variance 0
    dec = mc_decodes(PSQ(bits=bits), x, T)
    var = grid_var(x, bits)                          # (R, D) per-coordinate formula
    d = (x.max(axis=1) - x.min(axis=1)).astype(F64) / (2 ** bits - 1)
    # weights 1/step: every coordinate counts alike in the whole-tensor check
    w = np.repeat(np.where(d > 0, 1 / np.where(d > 0, d, 1), 0), x.shape[1])
    check_unbiased(dec, x, var.reshape(-1), np.repeat(d, x.shape[1]), w,
                   float((w ** 2 * var.reshape(-1)).sum()), 1.0)
    # exact per-row variance vs the Monte-Carlo mean squared error, 5 standard errors
    sq = ((dec - x.reshape(1, -1).astype(F64)) ** 2).reshape(T, 8, 60).sum(axis=2)
    mean, se = sq.mean(axis=0), sq.std(axis=0, ddof=1) / math.sqrt(T)
    want = var.sum(axis=1)
    assert want[2] == 0 and np.all(sq[:, 2] == 0)
    np.testing.assert_array_less(np.abs(mean - want), 5 * se + 1e-9 * want.max())
    # and the compressor's own variance() equals the formula
    assert PSQ(bits=bits).variance(torch.from_numpy(x)) == pytest.approx(want.sum(), rel=1e-9)


# --- Householder ---------------------------------------------------------------------------

@pytest.mark.parametrize("k", [1, 2, 3, 5, 8, 16])
def test_householder_is_an_involution_and_spreads_e1(k):
    H = householder_np(k)
    np.testing.assert_allclose(H @ H, np.eye(k), atol=1e-13)
    np.testing.assert_allclose(H, H.T, atol=0)
    np.testing.assert_allclose(H[:, 0], np.full(k, 1 / math.sqrt(k)), atol=1e-15)


def test_householder_blocks_equal_explicit_matrix(rng):
    sizes = [3, 1, 5, 2, 8]
    R, D = sum(sizes), 11
    Y = rng.standard_normal((R, D))
    scales = np.array([0.25, 1.0, 0.5, 2.0, 0.125], F32)
    S = np.zeros((R, R))          # block-diagonal H_k diag(s, 1, ..., 1)
    p = 0
    for k, s in zip(sizes, scales):
        B = householder_np(k).copy()
        B[:, 0] *= F64(s)
        S[p:p + k, p:p + k] = B
        p += k
    fwd = householder_blocks(torch.from_numpy(Y), torch.tensor(sizes), torch.from_numpy(scales),
                             inverse=False).numpy()
    np.testing.assert_allclose(fwd, S @ Y, rtol=0, atol=1e-13)
    inv = householder_blocks(torch.from_numpy(fwd), torch.tensor(sizes),
                             torch.from_numpy(scales), inverse=True).numpy()
    np.testing.assert_allclose(inv, np.linalg.inv(S) @ fwd, rtol=0, atol=1e-13)
    np.testing.assert_allclose(inv, Y, rtol=0, atol=1e-13)


def test_receiver_undoes_the_transform(rng):
    # decode == perm^T diag(1/s) H applied to the dequantized wire rows, by explicit matrix
    bits = 4
    x = heavy_rows(rng, 21, 17)
    msg, acc = decode(BHQ(bits=bits, block_size=5), torch.from_numpy(x))
    perm = np.frombuffer(bytes(msg.sections[2]), "<u4").astype(np.int64)
    sizes = np.frombuffer(bytes(msg.sections[3]), "<u4").astype(np.int64)
    scales = np.frombuffer(bytes(msg.sections[4]), "<f4")
    assert (sizes > 1).any() and (scales != 1).any()      # some blocks are transformed
    lohi = np.frombuffer(bytes(msg.sections[0]), "<f4").reshape(-1, 2)
    codes = np.unpackbits(np.frombuffer(bytes(msg.sections[1]), np.uint8), bitorder="little")
    codes = codes[:21 * 17 * bits].reshape(-1, bits) @ (1 << np.arange(bits))
    yhat = ref_dequant(lohi, codes, bits)
    want = transform_matrix(perm, sizes, scales) @ yhat
    np.testing.assert_allclose(acc.numpy().reshape(21, 17), want, rtol=1e-6, atol=1e-6 *
                               np.abs(want).max())


# --- BHQ: bit-exact against the reference -------------------------------------------------------

@pytest.mark.parametrize("bits,bs", [(2, 3), (4, 8), (4, 1), (5, 64), (8, 2)])
def test_bhq_bytes_bit_exact(bits, bs, rng):
    x = heavy_rows(rng, 29, 23)
    x[4] = 0.0
    x[9] = x[10]                  # equal magnitudes: the stable tie order matters
    x[17] = F32(3.0)
    perm, sizes, scales, y, _ = ref_bhq_plan(x, bits, bs)
    lohi, codes = ref_psq(y, bits, u_np(y.size))
    c = BHQ(bits=bits, block_size=bs)
    raw = c.encode(torch.from_numpy(x), KEY).to_bytes()
    G = len(sizes)
    payload = 8 * 29 + -(-29 * 23 * bits // 8) + 4 * 29 + 8 * G
    assert len(raw) == msg_len(2, 5, payload) and c.message_bytes((29, 23), G) == payload
    got = Message.from_bytes(raw)
    assert (got.codec, got.bits, got.bucket_size) == (18, bits, bs)
    assert bytes(got.sections[2]) == perm.astype("<u4").tobytes()
    assert bytes(got.sections[3]) == sizes.astype("<u4").tobytes()
    assert bytes(got.sections[4]) == scales.astype("<f4").tobytes()
    assert bytes(got.sections[0]) == lohi.astype("<f4").tobytes()
    assert bytes(got.sections[1]) == pack_np(codes, bits).tobytes()
    if bs == 1:
        assert G == 29 and np.all(scales == 1)
    # the constant rows (4 and 17) are the last two wire rows, singletons, in row order
    assert perm[-2:].tolist() == [4, 17] and sizes[-2:].tolist() == [1, 1]


def test_bhq_grouping_by_hand():
    # 7 rows with ranges 6, 1, 0, 5, 2, 3, 4 (row 2 constant); block_size 3:
    # sorted by range: 0(6) 3(5) 6(4) 5(3) 4(2) 1(1); G = ceil(6/3) = 2 leading rows 0, 3;
    # the rest in increasing range 1, 4, 5, 6 dealt in chunks of 2: [0, 1, 4], [3, 5, 6].
    ranges = [6, 1, 0, 5, 2, 3, 4]
    x = np.zeros((7, 4), F32)
    for r, m in enumerate(ranges):
        x[r] = [0, m, m / 2, 0]
    x[3, 1:3] += [0.0, 1.0]       # not proportional to row 0, so a transform can help
    x[2] = 1.0
    perm, sizes, _, _, _ = ref_bhq_plan(x, 2, 3)
    msg = BHQ(bits=2, block_size=3).encode(torch.from_numpy(x), KEY)
    got_perm = np.frombuffer(bytes(msg.sections[2]), "<u4").tolist()
    got_sizes = np.frombuffer(bytes(msg.sections[3]), "<u4").tolist()
    assert got_perm == perm.tolist()
    assert got_perm[:6] == [0, 1, 4, 3, 5, 6] and got_perm[6] == 2
    assert got_sizes == sizes.tolist() and sum(got_sizes) == 7 and got_sizes[-1] == 1


def test_bhq_unbiased_and_variance_monte_carlo(rng):
    bits, bs, T = 3, 4, 300
    x = heavy_rows(rng, 10, 40)
    x[6] = 0.0
    c = BHQ(bits=bits, block_size=bs)
    perm, sizes, scales, y, total = ref_bhq_plan(x, bits, bs)
    assert (sizes >= 2).any()
    M = transform_matrix(perm, sizes, scales)
    v_wire = grid_var(y, bits)                                   # (R, D) in wire order
    var = (M ** 2) @ v_wire                                      # per original coordinate
    d = (y.max(axis=1) - y.min(axis=1)).astype(F64) / (2 ** bits - 1)
    bound = np.abs(M) @ np.repeat(d[:, None], 40, axis=1)
    dec = mc_decodes(c, x, T)
    # weighted whole-tensor error: sum_i w_i (x_hat_i - x_i) = sum_p c_p eps_p over the wire
    # coordinates p, with c = w M (w_i = 1 / bound_i: every coordinate counts alike; 0 for
    # the exact zero row)
    b = bound.reshape(-1)
    w = np.where(b > 0, 1 / np.where(b > 0, b, 1), 0.0)
    c_wire = (w.reshape(10, 40)[:, None, :] * M[:, :, None]).sum(axis=0)     # (R wire, D)
    check_unbiased(dec, x, var.reshape(-1), bound.reshape(-1), w,
                   float((c_wire ** 2 * v_wire).sum()), float((np.abs(c_wire) * d[:, None]).max()))
    assert var.sum() == pytest.approx(total, rel=1e-9)
    assert c.variance(torch.from_numpy(x)) == pytest.approx(total, rel=1e-9)
    sq = ((dec - x.reshape(1, -1).astype(F64)) ** 2).sum(axis=1)
    assert abs(sq.mean() - total) <= 5 * sq.std(ddof=1) / math.sqrt(T)
    assert np.all(dec[:, 6 * 40:7 * 40] == 0)                    # the zero row stays exact


def test_bhq_never_worse_than_psq(rng):
    # step 4 of the spec: a block is transformed only if that lowers its exact variance, so
    # Var[BHQ] <= Var[PSQ] for any input -- also for equal-magnitude Gaussian rows, where
    # the transform does not help.
    cases = [rng.standard_normal((40, 30)).astype(F32), heavy_rows(rng, 40, 30),
             outlier_rows(rng, 33, 12), np.abs(heavy_rows(rng, 25, 9))]
    for x in cases:
        for bits in (2, 4):
            psq = float(grid_var(x, bits).sum())
            bhq = ref_bhq_plan(x, bits, 8)[4]
            assert bhq <= psq * (1 + 1e-12)
            assert BHQ(bits=bits).variance(torch.from_numpy(x)) == pytest.approx(bhq, rel=1e-9)


# --- the paper's claim: Var[BHQ] < Var[PSQ] < Var[PTQ] -----------------------------------------

def measured_mse(comp, x, steps):
    dec = mc_decodes(comp, x, steps)
    return float(((dec - x.reshape(1, -1).astype(F64)) ** 2).sum(axis=1).mean())


def ptq_mse_mc(x32, bits, steps, seed=7):
    """Monte-Carlo PTQ in NumPy: one grid over [min, max] of the tensor, stochastic rounding."""
    x = x32.astype(F64).reshape(-1)
    lo, L = x.min(), 2 ** bits - 1
    d = (x.max() - lo) / L
    r = (x - lo) / d
    f = np.floor(r)
    g = np.random.default_rng(seed)
    tot = 0.0
    for _ in range(steps):
        q = lo + (f + (g.random(x.size) < r - f)) * d
        tot += float(((q - x) ** 2).sum())
    return tot / steps


def check_claim(x, bits, label, steps=60):
    ptq = ptq_var(x, bits)
    psq = float(grid_var(x, bits).sum())
    bhq = ref_bhq_plan(x, bits, 8)[4]
    m_ptq = ptq_mse_mc(x, bits, steps)
    m_psq = measured_mse(PSQ(bits=bits), x, steps)
    m_bhq = measured_mse(BHQ(bits=bits), x, steps)
    print(f"\n{label} bits={bits}: exact PTQ {ptq:.6g} PSQ {psq:.6g} BHQ {bhq:.6g}; "
          f"measured PTQ {m_ptq:.6g} PSQ {m_psq:.6g} BHQ {m_bhq:.6g}")
    assert bhq < psq < ptq
    assert m_bhq < m_psq < m_ptq
    for m, e in ((m_ptq, ptq), (m_psq, psq), (m_bhq, bhq)):
        assert m == pytest.approx(e, rel=0.1)
    return ptq, psq, bhq


@pytest.mark.parametrize("bits", [4, 5])
def test_claim_one_large_row(bits, rng):
    x = outlier_rows(rng)                  # 64 x 200, row 5 is 100x larger
    ptq, psq, bhq = check_claim(x, bits, "outlier row")
    # PTQ's range is set by the large row for every row; BHQ spreads that row over a block
    assert psq < ptq / 10 and bhq < psq / 3


@pytest.fixture(scope="module")
def per_sample_grads():
    """float32 (128, 1000): per-sample gradients of the last Linear (100 -> 10) weight of
    FC-300-100 after 100 SGD steps on MNIST digits; row i = sample i."""
    from mnist import FC300100, load_digits
    xs, ys, _, _ = load_digits(seed=0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = FC300100()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        gen = torch.Generator().manual_seed(1)
        for _ in range(100):
            idx = torch.randint(0, len(xs), (64,), generator=gen)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(xs[idx]), ys[idx]).backward()
            opt.step()
        rows = []
        for i in torch.randint(0, len(xs), (128,), generator=gen).tolist():
            model.zero_grad()
            torch.nn.functional.cross_entropy(model(xs[i:i + 1]), ys[i:i + 1]).backward()
            rows.append(model[4].weight.grad.reshape(-1).clone())
    return torch.stack(rows).numpy().astype(F32)


@pytest.mark.parametrize("bits", [4, 5])
def test_claim_per_sample_mnist_gradient(bits, per_sample_grads):
    g = per_sample_grads
    norms = np.linalg.norm(g, axis=1)
    assert norms.max() > 1.5 * np.median(norms)        # rows of unequal magnitude
    check_claim(g, bits, "MNIST per-sample last-layer gradient", steps=30)


# --- bad input, dtypes, layouts -----------------------------------------------------------------

@pytest.mark.parametrize("comp", ["psq", "bhq"])
def test_single_row_and_single_column(comp, rng):
    c = hvdcomp.get(comp + ":bits=4")
    # one row: one block of one row -- the same bytes as PSQ's for sections 0 and 1
    x = rng.standard_normal((1, 40)).astype(F32)
    msg, acc = decode(c, torch.from_numpy(x))
    lohi, codes = ref_psq(x, 4, u_np(40))
    assert bytes(msg.sections[0]) == lohi.tobytes()
    assert bytes(msg.sections[1]) == pack_np(codes, 4).tobytes()
    np.testing.assert_array_equal(acc.numpy(), ref_dequant(lohi, codes, 4).astype(F32)[0])
    # one column: every row is constant, so the decode is exact
    x = rng.standard_normal((30, 1)).astype(F32)
    _, acc = decode(c, torch.from_numpy(x))
    np.testing.assert_array_equal(acc.numpy(), x.reshape(-1))


def test_bhq_block_of_a_single_row(rng):
    # 9 non-constant rows, block_size 8: G = 2, the second block is [big 1] + no small rows
    x = outlier_rows(rng, 9, 50, row=0, factor=50.0)
    x[1] *= F32(40.0)
    perm, sizes, scales, _, _ = ref_bhq_plan(x, 4, 8)
    msg, acc = decode(BHQ(bits=4, block_size=8), torch.from_numpy(x))
    got = np.frombuffer(bytes(msg.sections[3]), "<u4")
    assert got.tolist() == sizes.tolist() == [8, 1]
    assert np.frombuffer(bytes(msg.sections[4]), "<f4")[1] == 1.0
    assert np.abs(acc.numpy() - x.reshape(-1)).max() < np.abs(x).max()   # finite, sane


@pytest.mark.parametrize("comp", ["psq:bits=2", "bhq:bits=2,block_size=4"])
@pytest.mark.parametrize("shape", [(0, 5), (5, 0), (0,), (2, 0, 3)])
def test_empty_tensors(comp, shape):
    c = hvdcomp.get(comp)
    x = torch.zeros(shape)
    raw = c.encode(x, KEY).to_bytes()
    nsec = 2 if comp.startswith("psq") else 5
    assert len(raw) == msg_len(len(shape), nsec, 0)
    acc = torch.zeros(0)
    assert c.decode(Message.from_bytes(raw), KEY, acc) is True and acc.numel() == 0


@pytest.mark.parametrize("comp", ["psq", "bhq"])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_nonfinite_is_sent_as_nonfinite(comp, bad, rng):
    c = hvdcomp.get(comp)
    x = torch.from_numpy(heavy_rows(rng, 6, 7))
    x[3, 2] = bad
    raw = c.encode(x, KEY).to_bytes()
    got = Message.from_bytes(raw)
    assert got.flags == FLAG_NONFINITE and got.sections == () and got.shape == (6, 7)
    assert len(raw) == msg_len(2, 0, 0)
    acc = torch.full((42,), 2.0)
    assert c.decode(got, KEY, acc) is False
    assert torch.equal(acc, torch.full((42,), 2.0))


@pytest.mark.parametrize("comp", ["psq", "bhq"])
def test_float64_beyond_float32_range_is_nonfinite(comp):
    x = torch.ones(3, 4, dtype=torch.float64)
    x[1, 1] = 1e300                        # finite in float64, inf in float32
    assert Message.from_bytes(hvdcomp.get(comp).encode(x, KEY).to_bytes()).flags == \
        FLAG_NONFINITE


@pytest.mark.parametrize("comp", ["psq:bits=3", "bhq:bits=3,block_size=4"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_half_and_double_quantize_their_float32_values(comp, dtype, rng):
    c = hvdcomp.get(comp)
    x = torch.from_numpy(heavy_rows(rng, 12, 10, spread=0.5)).to(dtype)
    x32 = x.to(torch.float32).numpy()      # the float32 values the spec quantizes
    got = Message.from_bytes(c.encode(x, KEY).to_bytes())
    assert got.dtype == DTYPES[dtype]
    if comp.startswith("psq"):
        y = x32
    else:
        perm, sizes, scales, y, _ = ref_bhq_plan(x32, 3, 4)
        assert bytes(got.sections[2]) == perm.astype("<u4").tobytes()
        assert bytes(got.sections[4]) == scales.tobytes()
    lohi, codes = ref_psq(y, 3, u_np(y.size))
    assert bytes(got.sections[0]) == lohi.tobytes()
    assert bytes(got.sections[1]) == pack_np(codes, 3).tobytes()
    acc = torch.zeros(x.numel())
    assert c.decode(got, KEY, acc)
    if comp.startswith("psq"):
        np.testing.assert_array_equal(acc.numpy(),
                                      ref_dequant(lohi, codes, 3).astype(F32).reshape(-1))


@pytest.mark.parametrize("comp", ["psq:bits=5", "bhq:bits=5,block_size=3"])
def test_non_contiguous_input_gives_identical_bytes(comp, rng):
    c = hvdcomp.get(comp)
    base = torch.from_numpy(heavy_rows(rng, 30, 24))
    for v in (base.t(), base[::2, 1::3], base.reshape(6, 5, 24).permute(2, 0, 1)):
        assert not v.is_contiguous()
        assert c.encode(v, KEY).to_bytes() == c.encode(v.contiguous(), KEY).to_bytes()


# --- malformed messages ---------------------------------------------------------------------

def _with(msg, i, data):
    secs = list(msg.sections)
    secs[i] = np.frombuffer(bytes(data), np.uint8)
    return Message.from_bytes(dataclasses.replace(msg, sections=tuple(secs)).to_bytes())


def _expect_wire_error(c, msg, match):
    with pytest.raises(WireFormatError, match=match):
        c.decode(msg, KEY, torch.zeros(msg.numel))


def test_psq_malformed_messages(rng):
    c = PSQ(bits=3)
    msg = c.encode(torch.from_numpy(heavy_rows(rng, 5, 6)), KEY)
    lohi = np.frombuffer(bytes(msg.sections[0]), "<f4").copy()
    _expect_wire_error(c, _with(msg, 0, bytes(msg.sections[0])[:-4]), "row ranges")
    _expect_wire_error(c, _with(msg, 1, bytes(msg.sections[1]) + b"\0"), "codes")
    for bad in (np.nan, np.inf):
        l2 = lohi.copy()
        l2[3] = bad
        _expect_wire_error(c, _with(msg, 0, l2.tobytes()), "finite")
    l2 = lohi.copy()
    l2[4], l2[5] = 1.0, -1.0                     # max < min
    _expect_wire_error(c, _with(msg, 0, l2.tobytes()), "max < min")
    short = Message.from_bytes(dataclasses.replace(msg, sections=msg.sections[:1]).to_bytes())
    _expect_wire_error(c, short, "sections")
    _expect_wire_error(PSQ(bits=4), Message.from_bytes(msg.to_bytes()), "bits")
    _expect_wire_error(BHQ(bits=3), Message.from_bytes(msg.to_bytes()), "codec")


def test_bhq_malformed_messages(rng):
    c = BHQ(bits=3, block_size=4)
    x = heavy_rows(rng, 10, 6)
    msg = c.encode(torch.from_numpy(x), KEY)
    perm = np.frombuffer(bytes(msg.sections[2]), "<u4").copy()
    sizes = np.frombuffer(bytes(msg.sections[3]), "<u4").copy()
    scales = np.frombuffer(bytes(msg.sections[4]), "<f4").copy()
    assert (sizes > 1).any() and (sizes == 1).any()
    first_big = int(np.argmax(sizes > 1))
    first_one = int(np.argmax(sizes == 1))
    u4 = lambda a: np.asarray(a, "<u4").tobytes()          # noqa: E731
    f4 = lambda a: np.asarray(a, "<f4").tobytes()          # noqa: E731
    _expect_wire_error(c, _with(msg, 0, bytes(msg.sections[0])[:-8]), "row ranges")
    _expect_wire_error(c, _with(msg, 1, bytes(msg.sections[1])[:-1]), "codes")
    _expect_wire_error(c, _with(msg, 2, u4(perm[:-1])), "permutation")
    p2 = perm.copy()
    p2[1] = p2[0]
    _expect_wire_error(c, _with(msg, 2, u4(p2)), "not a permutation")
    p2 = perm.copy()
    p2[0] = 10
    _expect_wire_error(c, _with(msg, 2, u4(p2)), "not a permutation")
    _expect_wire_error(c, _with(msg, 3, u4(sizes)[:-2]), "same number")
    _expect_wire_error(c, _with(msg, 4, f4(np.append(scales, 1))), "same number")
    s2 = sizes.copy()
    s2[first_one] += 1
    _expect_wire_error(c, _with(msg, 3, u4(s2)), "sum to")
    s2 = sizes.copy()
    s2[first_one] = 0
    _expect_wire_error(c, _with(msg, 3, u4(s2)), "block sizes")
    big = _with(_with(msg, 3, u4(list(sizes) + [0])), 4, f4(list(scales) + [1]))
    _expect_wire_error(c, big, "block sizes")
    _expect_wire_error(c, _with(_with(msg, 3, u4([5, 5])), 4, f4([1, 1])), r"1\.\.4")
    for bad in (0.0, -0.5, np.nan, np.inf):
        sc = scales.copy()
        sc[first_big] = bad
        _expect_wire_error(c, _with(msg, 4, f4(sc)), "finite and > 0")
    sc = scales.copy()
    sc[first_one] = 0.5
    _expect_wire_error(c, _with(msg, 4, f4(sc)), "scale 1")
    l2 = np.frombuffer(bytes(msg.sections[0]), "<f4").copy()
    l2[0] = np.nan
    _expect_wire_error(c, _with(msg, 0, l2.tobytes()), "finite")
    _expect_wire_error(BHQ(bits=3, block_size=5), Message.from_bytes(msg.to_bytes()),
                       "bucket size")
    short = Message.from_bytes(dataclasses.replace(msg, sections=msg.sections[:4]).to_bytes())
    _expect_wire_error(c, short, "sections")


# --- hostile messages (issue #15) -----------------------------------------------------------

def _transformed_block(msg):
    sizes = np.frombuffer(bytes(msg.sections[3]), "<u4")
    assert (sizes > 1).any()
    return int(np.argmax(sizes > 1))


@pytest.mark.parametrize("mode", ["reference", "auto"])
def test_bhq_absurd_block_scales_rejected(rng, mode):
    """A block scale of 1e-45 (subnormal: 15 of 105 outputs non-finite before) or a normal
    one too small for the block's values (the leading row divided by it leaves the float32
    range) is rejected; the message with its own scales decodes finite."""
    c = BHQ(bits=3, block_size=4)
    msg = c.encode(torch.from_numpy(heavy_rows(rng, 15, 7)), KEY)
    g = _transformed_block(msg)
    scales = np.frombuffer(bytes(msg.sections[4]), "<f4").copy()
    sizes = np.frombuffer(bytes(msg.sections[3]), "<u4")
    lead = int(sizes[:g].sum())                          # the block's first wire row
    lohi = np.frombuffer(bytes(msg.sections[0]), "<f4").copy()
    lohi[2 * lead:2 * lead + 2] = (-1e3, 1e3)            # a wide but valid range
    wide = _with(msg, 0, lohi.tobytes())
    with hvdcomp.backends.use(mode):
        for bad, match in ((1e-45, "normal"), (1e-40, "normal")):
            sc = scales.copy()
            sc[g] = bad
            _expect_wire_error(c, _with(msg, 4, sc.tobytes()), match)
        sc = scales.copy()
        sc[g] = 2e-38                                    # normal, but 1e3 / 2e-38 > 3.4e38
        _expect_wire_error(c, _with(wide, 4, sc.tobytes()), f"block {g} .* float32 range")
        acc = torch.zeros(msg.numel)
        assert c.decode(msg, KEY, acc) and torch.isfinite(acc).all()


@pytest.mark.parametrize("top", [3.0e38, 3.4e38, 3.4028e38])
def test_bhq_rows_near_the_float32_maximum_decode_finite(rng, top):
    """Every block an encoder transforms has a decode bound within the float32 range (step
    4 sends the others as singletons): honest messages decode to finite values, here with a
    leading row at the float32 maximum, over several steps (several roundings)."""
    x = rng.standard_normal((8, 6)).astype(F32)
    x[0] = np.linspace(0.97 * top, top, 6, dtype=F32)
    c = BHQ(bits=3, block_size=4)
    for step in range(4):
        msg = Message.from_bytes(c.encode(torch.from_numpy(x), key_at(step)).to_bytes())
        lohi = torch.from_numpy(np.frombuffer(bytes(msg.sections[0]), "<f4").copy())
        sizes = np.frombuffer(bytes(msg.sections[3]), "<u4").astype(np.int64)
        scales = np.frombuffer(bytes(msg.sections[4]), "<f4").copy()
        assert (sizes > 1).any()
        assert (decode_bounds(lohi.view(-1, 2).abs().amax(dim=1), torch.from_numpy(sizes),
                              torch.from_numpy(scales)) <= float(np.finfo(F32).max)).all()
        acc = torch.zeros(msg.numel)
        assert c.decode(msg, key_at(step), acc) and torch.isfinite(acc).all()
