"""Independent NumPy references for the quantizer tests, written from the specification in
the brief and the module docstrings (not from hvdcomp's code):

  per bucket of ``bs`` coordinates (last bucket zero-padded):
    norm  = float32(sqrt(float64 sum x^2))   (L2)   or   max |x|   (Linf)
    r     = float32(|x| / norm), clamped to 1    (norm 0 -> divide by 1)
    j     = the interval [l_j, l_{j+1}] holding r (searchsorted), p = (r - l_j)/(l_{j+1} - l_j)
            in float32, index = j + (u < p)
    code  = sign << (bits - 1) | index,  sign = 1 iff x < 0
  packing: code i occupies bits [i*bits, (i+1)*bits) of the LSB-first bit stream.
  decode: sign * float32(level[index] * norm)
  Var[Q(x_i)] = norm^2 (l_{j+1} - r)(r - l_j).
"""
import math

import numpy as np

F32 = np.float32
HEADER = 48
CRC = 4


def uniform_table(bits):
    s = 2 ** (bits - 1) - 1
    return np.array([j / s for j in range(s + 1)], dtype=np.float64)


def exponential_table(bits, p=0.5):
    s = 2 ** (bits - 1) - 1
    return np.array([0.0] + [p ** (s - j) for j in range(1, s + 1)], dtype=np.float64)


def nbuckets(n, bs):
    return -(-n // bs)


def buckets(x, bs, dtype):
    """Zero-padded (nb, bs) view of flat ``x`` in ``dtype``."""
    n = x.size
    nb = nbuckets(n, bs)
    xp = np.zeros(nb * bs, dtype=dtype)
    xp[:n] = x
    return xp.reshape(nb, bs)


def norms_np(x32, bs, norm):
    b = buckets(x32, bs, np.float32)
    if norm == "l2":
        return np.sqrt(np.sum(b.astype(np.float64) ** 2, axis=1)).astype(F32)
    if b.shape[0] == 0:
        return np.zeros(0, F32)
    return np.max(np.abs(b), axis=1).astype(F32)


def rounding_p(x32, levels32, bs, norm):
    """(j, p): the interval index of each coordinate and its round-up probability, float32."""
    x32 = np.asarray(x32, dtype=F32).reshape(-1)
    levels32 = np.asarray(levels32, dtype=F32)
    n = x32.size
    norms = norms_np(x32, bs, norm)
    safe = np.where(norms > 0, norms, F32(1)).astype(F32)
    r = (buckets(np.abs(x32), bs, np.float32) / safe[:, None]).astype(F32).reshape(-1)[:n]
    r = np.minimum(r, F32(1.0))
    s = levels32.size - 1
    j = np.clip(np.searchsorted(levels32, r, side="right") - 1, 0, s - 1)
    lo, hi = levels32[j], levels32[j + 1]
    return j.astype(np.int64), ((r - lo) / (hi - lo)).astype(F32)


def quantize_np(x32, levels32, bs, norm, u32, bits):
    """(norms float32 (nb,), codes int64 (n,)) -- the stochastic rounding of the spec."""
    x32 = np.asarray(x32, dtype=F32).reshape(-1)
    u32 = np.asarray(u32, dtype=F32)
    norms = norms_np(x32, bs, norm)
    j, p = rounding_p(x32, levels32, bs, norm)
    idx = j + (u32 < p).astype(np.int64)
    sign = (x32 < 0).astype(np.int64)
    return norms, (sign << (bits - 1)) | idx


def dequantize_np(norms32, codes, levels32, bs, bits):
    """What decode adds into a zero float32 accumulator (0 + v, so -0.0 becomes +0.0)."""
    n = codes.size
    levels32 = np.asarray(levels32, dtype=F32)
    idx = codes & ((1 << (bits - 1)) - 1)
    neg = (codes >> (bits - 1)) != 0
    scale = np.repeat(np.asarray(norms32, dtype=F32), bs)[:n]
    v = (levels32[idx] * scale).astype(F32)
    v = np.where(neg, -v, v).astype(F32)
    return (np.zeros(n, dtype=F32) + v).astype(F32)


def pack_np(codes, bits):
    """LSB-first bit packing by hand: bit k of code i is bit i*bits + k of the stream."""
    codes = np.asarray(codes, dtype=np.int64).reshape(-1)
    stream = ((codes[:, None] >> np.arange(bits, dtype=np.int64)) & 1).astype(np.uint8)
    return np.packbits(stream.reshape(-1), bitorder="little")


def message_len(ndim, n, bs, bits):
    """48 + 8*ndim + 8*2 + 4*nb + ceil(n*bits/8) + 4."""
    return HEADER + 8 * ndim + 8 * 2 + 4 * nbuckets(n, bs) + -(-n * bits // 8) + CRC


def rounding_terms(x32, bs, norm, levels):
    """Per coordinate, in float64: (norm of its bucket, r, lo, hi) with r = |x| / norm clipped
    to [0, 1] and [lo, hi] the level interval holding r; norm is the float32 value sent."""
    x32 = np.asarray(x32, dtype=F32).reshape(-1)
    levels = np.asarray(levels, dtype=np.float64)
    n = x32.size
    nrm = norms_np(x32, bs, norm).astype(np.float64)
    safe = np.where(nrm > 0, nrm, 1.0)
    r = (buckets(np.abs(x32).astype(np.float64), bs, np.float64) / safe[:, None]).reshape(-1)[:n]
    r = np.clip(r, 0.0, 1.0)
    j = np.clip(np.searchsorted(levels, r, side="right") - 1, 0, levels.size - 2)
    nb_of = np.repeat(nrm, bs)[:n]
    return nb_of, r, levels[j], levels[j + 1]


def variance_np(x32, bs, norm, levels):
    """sum_b norm_b^2 sum_i (hi - r_i)(r_i - lo_i)."""
    nrm, r, lo, hi = rounding_terms(x32, bs, norm, levels)
    return float(np.sum(nrm ** 2 * (hi - r) * (r - lo)))


def bernstein(var, bound, delta):
    """Half-width t with P(|S| >= t) <= delta for a sum S of independent zero-mean terms with
    total variance ``var``, each bounded in absolute value by ``bound`` (Bernstein):
    P(|S| >= t) <= 2 exp(-t^2/2 / (var + bound*t/3))."""
    L = math.log(2.0 / delta)
    a = bound * L / 3.0
    return a + math.sqrt(a * a + 2.0 * L * var)
