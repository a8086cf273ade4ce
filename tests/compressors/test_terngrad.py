"""TernGrad (hvdcomp.compressors.terngrad): clipping, unbiasedness for the clipped gradient,
the variance formula, bit-exact codes and wire format, bad input, malformed messages.

Every expected value is computed here, independently of hvdcomp, from the specification
(Wen et al., NeurIPS 2017, arXiv 1705.07878, Sec. 3.1 and 3.3, and the module docstring):

    sigma = sqrt(mean((x - mean x)^2)) (float64), T = float32(clip * sigma),
    c = clip(x, -T, T) (no clipping if clip == 0 or T == 0),
    per bucket s = max |c|, r = float32(|c| / s), b = (u < r), Q(c) = sign(c) s b,
    code = (c < 0) << 1 | b, 2 bits per code packed LSB-first;
    E[Q(c_i)] = c_i, Var[Q(c_i)] = |c_i| (s - |c_i|).

The NumPy reference below (np_clip, np_ternarize) is written from that text; the uniforms come
from hvdcomp.philox.uniform (the one shared source of randomness, pinned by its own
known-answer tests).  Monte-Carlo checks use Bernstein bounds at a failure probability of
1e-9 per check, on fixed inputs and a fixed Philox stream, so a pass or fail is
reproducible, not luck.
"""
import io
import math
import struct

import numpy as np
import pytest
import torch

import hvdcomp
from hvdcomp import ConfigError, WireFormatError
from hvdcomp.compressors.terngrad import TernGrad
from hvdcomp.ops.ternary import clip_threshold
from hvdcomp.philox import uniform
from hvdcomp.wire import FLAG_NONFINITE, Message

F32 = np.float32
KEY = hvdcomp.TensorKey(name="fc1.weight", tensor_id=3, step=7, rank=2, world_size=4, seed=11)
K_MC = 1000                    # Monte-Carlo steps
DELTA = 1e-9                   # failure probability of each statistical check
CODEC_TERNGRAD = 15            # hvdcomp.wire.CODECS["terngrad"], fixed by the wire format


def key_with(**kw):
    d = dict(name=KEY.name, tensor_id=KEY.tensor_id, step=KEY.step, rank=KEY.rank,
             world_size=KEY.world_size, seed=KEY.seed)
    d.update(kw)
    return hvdcomp.TensorKey(**d)


# --------------------------------------------------------------------------------------------
# independent NumPy reference
# --------------------------------------------------------------------------------------------

def np_clip(x, clip):
    """(clipped float32 flat array, threshold T or inf)."""
    x32 = np.asarray(x, dtype=F32).reshape(-1)
    if clip == 0 or x32.size == 0:
        return x32.copy(), math.inf
    xd = x32.astype(np.float64)
    sigma = np.sqrt(np.mean((xd - xd.mean()) ** 2))
    t = F32(clip * sigma)
    if t == 0:
        return x32.copy(), math.inf
    return np.clip(x32, -t, t).astype(F32), float(t)


def np_ternarize(c32, bs, u32):
    """(scales float32 (nb,), codes int64 (n,), decoded float32 (n,))."""
    c32 = np.asarray(c32, dtype=F32).reshape(-1)
    n = c32.size
    b = bs if bs else max(n, 1)
    nb = -(-n // b)
    a = np.zeros(nb * b, dtype=F32)
    a[:n] = np.abs(c32)
    a = a.reshape(nb, b)
    s = a.max(axis=1) if nb else np.zeros(0, F32)
    safe = np.where(s > 0, s, F32(1)).astype(F32)
    r = np.minimum((a / safe[:, None]).astype(F32).reshape(-1)[:n], F32(1))
    bit = (np.asarray(u32, dtype=F32) < r).astype(np.int64)
    neg = (c32 < 0).astype(np.int64)
    codes = neg << 1 | bit
    srep = np.repeat(s, b)[:n]
    dec = np.where(neg == 1, -srep, srep).astype(F32) * bit.astype(F32)
    return s.astype(F32), codes, (np.zeros(n, F32) + dec).astype(F32)


def np_pack(codes, bits):
    """Bit k of code i is bit i*bits + k of an LSB-first stream."""
    codes = np.asarray(codes, dtype=np.int64).reshape(-1)
    stream = ((codes[:, None] >> np.arange(bits)) & 1).astype(np.uint8).reshape(-1)
    return np.packbits(stream, bitorder="little")


def bernstein(var, bound, delta):
    """Half-width t with P(|S| >= t) <= delta for a sum S of independent zero-mean terms of
    total variance ``var``, each bounded by ``bound``: 2 exp(-t^2 / 2 / (var + bound t / 3))."""
    L = math.log(2.0 / delta)
    a = bound * L / 3.0
    return a + math.sqrt(a * a + 2.0 * L * var)


def philox_u(n, key):
    return uniform(n, seed=key.seed, step=key.step, rank=key.rank,
                   tensor_id=key.tensor_id).numpy()


def sec(msg, i):
    return np.frombuffer(bytes(np.asarray(msg.sections[i], dtype=np.uint8)), dtype=np.uint8)


def decoded(c, msg, key=KEY):
    out = torch.zeros(msg.numel)
    assert c.decode(msg, key, out) is True
    return out.numpy()


def rebuild(msg, sections=None, **fields):
    """``msg`` with other sections / header fields, serialized (valid framing) and parsed."""
    d = dict(codec=msg.codec, dtype=msg.dtype, shape=msg.shape, sections=msg.sections,
             flags=msg.flags, bits=msg.bits, bucket_size=msg.bucket_size,
             level_version=msg.level_version, tensor_id=msg.tensor_id, rank=msg.rank,
             seed=msg.seed, step=msg.step)
    if sections is not None:
        d["sections"] = tuple(sections)
    d.update(fields)
    return Message.from_bytes(Message(**d).to_bytes())


@pytest.fixture(scope="module")
def rows(real_grad):
    """(2, 784) float32: two rows of the real MNIST gradient (heavy tails, many exact 0)."""
    x = real_grad[:2].clone().contiguous()
    assert int((x != 0).sum()) > 784
    return x


# --------------------------------------------------------------------------------------------
# clipping
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("clip", [2.5, 1.0, 0.3])
def test_clipping_matches_numpy(real_grad, clip):
    want, t = np_clip(real_grad.numpy(), clip)
    assert clip_threshold(real_grad, clip) == t
    got = TernGrad(clip=clip).clipped(real_grad)
    assert got.dtype == torch.float32 and got.shape == (real_grad.numel(),)
    assert np.array_equal(got.numpy(), want)
    # the check has teeth: the real gradient has coordinates beyond c sigma
    assert int(np.sum(np.abs(real_grad.numpy().reshape(-1)) > t)) > 10


def test_clipping_hand_worked():
    # x = [2, -2, 2, -2]: mean 0, sigma 2; clip 0.5 -> T = 1
    assert np.array_equal(TernGrad(clip=0.5).clipped(torch.tensor([2., -2., 2., -2.])).numpy(),
                          [1., -1., 1., -1.])
    # x = [4, 0, 0, 0]: mean 1, variance (9 + 1 + 1 + 1) / 4 = 3; clip 1 -> T = f32(sqrt 3)
    t = float(F32(math.sqrt(3.0)))
    assert clip_threshold(torch.tensor([4., 0., 0., 0.]), 1.0) == t
    assert TernGrad(clip=1.0).clipped(torch.tensor([4., 0., 0., 0.])).tolist() == [t, 0, 0, 0]
    # clipping is symmetric around 0, not around the mean: x = [3, 1, 1, 1] has sigma sqrt 0.75
    t2 = float(F32(2.0 * math.sqrt(0.75)))
    assert TernGrad(clip=2.0).clipped(torch.tensor([3., 1., 1., 1.])).tolist() == [t2, 1, 1, 1]


def test_clip_zero_disables_and_constant_tensors_are_not_clipped(rows):
    x = rows.reshape(-1)
    assert torch.equal(TernGrad(clip=0).clipped(x), x)
    assert clip_threshold(x, 0.0) == math.inf
    # sigma = 0 (all elements equal, a 1-element tensor): T would be 0 and erase the tensor;
    # no clipping instead, and then r = 1 everywhere: the encoding is exact.
    for g in (torch.full((6,), -0.75), torch.tensor([3.5]), torch.tensor(-2.0)):
        c = TernGrad()
        assert clip_threshold(g, 2.5) == math.inf
        assert np.array_equal(decoded(c, c.encode(g, KEY)), g.reshape(-1).numpy())


# --------------------------------------------------------------------------------------------
# Monte Carlo: unbiased for the CLIPPED gradient, variance formula
# --------------------------------------------------------------------------------------------
_MC = {}


def monte_carlo(bs, x, clip=2.5):
    """K_MC encodes/decodes at steps 1000.. (fresh Philox streams): (mean decoded (n,) f64,
    squared error against the clipped gradient per step (K,))."""
    k = (bs, clip)
    if k not in _MC:
        c = TernGrad(clip=clip, bucket_size=bs)
        cl = np_clip(x.numpy(), clip)[0].astype(np.float64)
        acc = np.zeros(cl.size)
        sq = np.zeros(K_MC)
        out = torch.zeros(cl.size)
        for t in range(K_MC):
            key = key_with(step=1000 + t)
            msg = c.encode(x, key)
            out.zero_()
            assert c.decode(msg, key, out) is True
            d = out.numpy().astype(np.float64)
            acc += d
            sq[t] = np.sum((d - cl) ** 2)
        _MC[k] = (acc / K_MC, sq)
    return _MC[k]


def terms(x, bs, clip=2.5):
    """(|c| float64, bucket scale s per coordinate float64, clipped c float64)."""
    cl, _ = np_clip(x, clip)
    s, _, _ = np_ternarize(cl, bs, np.zeros(cl.size, F32))
    b = bs if bs else max(cl.size, 1)
    return np.abs(cl).astype(np.float64), np.repeat(s, b)[:cl.size].astype(np.float64), \
        cl.astype(np.float64)


@pytest.mark.parametrize("bs", [0, 300])
def test_unbiased_for_the_clipped_gradient(bs, rows):
    mean, _ = monte_carlo(bs, rows)
    a, s, cl = terms(rows.numpy(), bs)
    var = a * (s - a)                                  # Var[Q(c_i)]
    err = mean - cl
    slack = 1e-6 * s                                   # P(u < r) = ceil(r 2^24) / 2^24
    tol = np.array([bernstein(v / K_MC, b / K_MC, DELTA) for v, b in zip(var, s)]) + slack
    worst = int(np.argmax(np.abs(err) / tol))
    assert np.all(np.abs(err) <= tol), (worst, cl[worst], mean[worst], tol[worst])
    # all coordinates together, signed by c: detects a systematic pull towards 0 or away
    sg = np.sign(cl)
    tol_sum = bernstein(float(var.sum()) / K_MC, float(s.max()) / K_MC, DELTA) + slack.sum()
    assert abs(float(np.sum(sg * err))) <= tol_sum
    assert tol_sum < 0.05 * float(np.sum(a))           # the bound has power
    # ... and it is NOT unbiased for the raw gradient: the clipped mass is missing
    x = rows.numpy().reshape(-1).astype(np.float64)
    raw = float(np.sum(np.sign(x) * (mean - x)))
    assert raw < -3 * tol_sum
    assert raw == pytest.approx(float(np.sum(a - np.abs(x))), abs=tol_sum)


@pytest.mark.parametrize("bs", [0, 300])
def test_variance_formula_monte_carlo(bs, rows):
    _, sq = monte_carlo(bs, rows)
    a, s, _ = terms(rows.numpy(), bs)
    V = float(np.sum(a * (s - a)))
    # (Q - c)^2 = (s - |c|)^2 w.p. p = |c| / s, else c^2
    p = np.divide(a, s, out=np.zeros_like(a), where=s > 0)
    var_step = float(np.sum(p * (1 - p) * ((s - a) ** 2 - a ** 2) ** 2))
    tol = bernstein(var_step / K_MC, float(s.max() ** 2) / K_MC, DELTA) + 1e-6 * V
    assert V > 0
    assert abs(sq.mean() - V) <= tol, (sq.mean(), V, tol)
    assert tol < 0.10 * V


@pytest.mark.parametrize("bs", [0, 1, 7, 300, 5000])
@pytest.mark.parametrize("clip", [2.5, 0.0])
def test_variance_method(bs, clip, rows):
    a, s, _ = terms(rows.numpy(), bs, clip)
    want = float(np.sum(a * (s - a)))
    assert (want > 0) == (bs != 1)
    assert TernGrad(clip=clip, bucket_size=bs).variance(rows) == pytest.approx(want, rel=1e-9)


def test_variance_hand_worked():
    # no clipping, one bucket: s = 1; |c|(s - |c|) = 0 + .25 + .1875 + 0
    assert TernGrad(clip=0).variance(torch.tensor([1.0, 0.5, -0.25, 0.0])) == 0.4375
    # buckets of 2: [1, .5] -> s 1: .25; [-.25, 0] -> s .25: 0
    assert TernGrad(clip=0, bucket_size=2).variance(torch.tensor([1.0, 0.5, -0.25, 0.0])) == 0.25
    assert TernGrad().variance(torch.zeros(0)) == 0.0


# --------------------------------------------------------------------------------------------
# bit-exact codes, packed bytes, round trips, sizes
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("bs", [0, 1, 7, 300, 784, 10**6])
@pytest.mark.parametrize("clip", [2.5, 0.0])
def test_codes_bit_exact(bs, clip, rows):
    x = rows.clone()
    x.view(-1)[3] = -0.0
    x.view(-1)[14:21] = 0.0
    c = TernGrad(clip=clip, bucket_size=bs)
    msg = c.encode(x, KEY)
    cl, _ = np_clip(x.numpy(), clip)
    s, codes, dec = np_ternarize(cl, bs, philox_u(cl.size, KEY))
    assert msg.codec == CODEC_TERNGRAD and msg.bits == 2 and msg.bucket_size == bs
    assert msg.shape == (2, 784) and msg.flags == 0 and len(msg.sections) == 2
    assert np.array_equal(sec(msg, 0), s.view(np.uint8))
    assert np.array_equal(sec(msg, 1), np_pack(codes, 2))
    assert np.array_equal(decoded(c, msg), dec)
    # every code occurs (the test is not vacuous); buckets of 1 have r = 1: never code 2
    assert set(np.unique(codes)) == ({0, 1, 3} if bs == 1 else {0, 1, 2, 3})


def test_packed_bytes_by_hand():
    # clip 0, one bucket: s = 2, r in {0, 1}, so the codes do not depend on the uniforms.
    x = torch.tensor([2.0, -2.0, 0.0, 2.0, -2.0, 0.0, -0.0, 2.0, -2.0])
    msg = TernGrad(clip=0).encode(x, KEY)
    # codes (sign << 1 | b): 1, 3, 0, 1, 3, 0, 0, 1, 3 (-0.0 is not negative)
    # byte 0 = 1 | 3<<2 | 0<<4 | 1<<6 = 0x4D; byte 1 = 3 | 0 | 0 | 1<<6 = 0x43; byte 2 = 3
    assert bytes(sec(msg, 1)) == b"\x4d\x43\x03"
    assert bytes(sec(msg, 0)) == struct.pack("<f", 2.0) == b"\x00\x00\x00\x40"
    assert decoded(TernGrad(clip=0), msg).tolist() == [2, -2, 0, 2, -2, 0, 0, 2, -2]


def test_codes_by_hand_with_the_uniforms():
    # x = [0.5, -0.25, 1.0], clip 0: s = 1, r = [0.5, 0.25, 1]; b_i = u_i < r_i
    u = philox_u(3, KEY)
    b = [int(u[0] < 0.5), int(u[1] < 0.25), 1]
    codes = [b[0], 2 | b[1], b[2]]
    msg = TernGrad(clip=0).encode(torch.tensor([0.5, -0.25, 1.0]), KEY)
    assert bytes(sec(msg, 1)) == bytes([codes[0] | codes[1] << 2 | codes[2] << 4])
    assert decoded(TernGrad(clip=0), msg).tolist() == [b[0] * 1.0, -b[1] * 1.0, 1.0]


def test_randomness_is_keyed_by_the_tensor_key(rows):
    c = TernGrad()
    base = bytes(sec(c.encode(rows, KEY), 1))
    assert bytes(sec(c.encode(rows, KEY), 1)) == base          # deterministic
    for kw in (dict(step=8), dict(rank=1), dict(tensor_id=4), dict(seed=12)):
        assert bytes(sec(c.encode(rows, key_with(**kw)), 1)) != base, kw
    # the name is not part of the Philox key
    assert bytes(sec(c.encode(rows, key_with(name="other")), 1)) == base


@pytest.mark.parametrize("shape", [(2, 784), (784, 2), (4, 7, 56)])
def test_round_trip_through_bytes(rows, shape):
    x = rows.reshape(shape)
    c = TernGrad(bucket_size=100)
    msg = c.encode(x, KEY)
    back = Message.from_bytes(msg.to_bytes())
    assert back.shape == shape and back.codec == CODEC_TERNGRAD and back.bits == 2
    assert back.bucket_size == 100 and back.dtype == 1
    assert np.array_equal(decoded(c, back), decoded(c, msg))
    # ... and through torch.save of the bytes (what a checkpoint of messages would hold)
    buf = io.BytesIO()
    torch.save(msg.to_bytes(), buf)
    buf.seek(0)
    assert Message.from_bytes(torch.load(buf)).to_bytes() == msg.to_bytes()


@pytest.mark.parametrize("shape,bs", [((2, 784), 0), ((2, 784), 300), ((5,), 0), ((5,), 2),
                                      ((0, 3), 0), ((0, 3), 4), ((), 0), ((3, 1, 2), 1),
                                      ((1, 1), 7)])
def test_message_size_formula(shape, bs):
    n = int(np.prod(shape, dtype=np.int64)) if shape else 1
    x = torch.randn(shape) if n else torch.zeros(shape)
    b = bs if bs else max(n, 1)
    nb = -(-n // b)
    payload = 4 * nb + -(-2 * n // 8)
    c = TernGrad(bucket_size=bs)
    assert c.message_bytes(n) == payload
    # header 48 + 8 ndim + 8 * 2 sections + payload + CRC 4
    assert len(c.encode(x, KEY).to_bytes()) == 48 + 8 * len(shape) + 16 + payload + 4


def test_compression_ratio_per_tensor(real_grad):
    n = real_grad.numel()
    got = len(TernGrad().encode(real_grad, KEY).to_bytes())
    assert got == 48 + 16 + 16 + 4 + n // 4 + 4          # 235,200 coordinates, one scale
    assert 4 * n / got > 15.9


# --------------------------------------------------------------------------------------------
# shapes, layouts, dtypes, special tensors
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_other_dtypes_encode_their_float32_values(rows, dtype):
    x = rows.to(dtype)
    c = TernGrad(bucket_size=300)
    msg = c.encode(x, KEY)
    ref = c.encode(x.to(torch.float32), KEY)
    assert msg.dtype == {torch.float16: 2, torch.bfloat16: 3, torch.float64: 4}[dtype]
    assert msg.sections[0].tobytes() == ref.sections[0].tobytes()
    assert msg.sections[1].tobytes() == ref.sections[1].tobytes()
    cl, _ = np_clip(x.to(torch.float32).numpy(), 2.5)
    s, codes, dec = np_ternarize(cl, 300, philox_u(cl.size, KEY))
    assert np.array_equal(decoded(c, msg), dec)


def test_non_contiguous_layout(rows):
    x = rows.t()                                   # (784, 2), strided
    assert not x.is_contiguous()
    c = TernGrad(bucket_size=64)
    a, b = c.encode(x, KEY), c.encode(x.contiguous(), KEY)
    assert a.shape == (784, 2) and a.to_bytes() == b.to_bytes()
    cl, _ = np_clip(x.contiguous().numpy(), 2.5)
    assert np.array_equal(decoded(c, a), np_ternarize(cl, 64, philox_u(cl.size, KEY))[2])


@pytest.mark.parametrize("bs", [0, 3])
def test_empty_tensor(bs):
    c = TernGrad(bucket_size=bs)
    msg = c.encode(torch.zeros(0, 5), KEY)
    assert msg.shape == (0, 5) and [len(s) for s in msg.sections] == [0, 0]
    back = Message.from_bytes(msg.to_bytes())
    out = torch.zeros(0)
    assert c.decode(back, KEY, out) is True and out.numel() == 0


@pytest.mark.parametrize("g", [torch.tensor(1.5), torch.tensor([-0.125]),
                               torch.tensor([[7.0]], dtype=torch.float64)])
def test_scalar_and_one_element_are_exact(g):
    c = TernGrad()
    msg = c.encode(g, KEY)
    assert msg.shape == tuple(g.shape)
    assert bytes(sec(msg, 0)) == struct.pack("<f", abs(float(g)))
    assert decoded(c, Message.from_bytes(msg.to_bytes())).tolist() == [float(g)]


@pytest.mark.parametrize("bs", [0, 5])
def test_all_zero_tensor(bs):
    c = TernGrad(bucket_size=bs)
    msg = c.encode(torch.zeros(4, 6), KEY)
    assert not np.any(sec(msg, 0)) and not np.any(sec(msg, 1))
    d = decoded(c, Message.from_bytes(msg.to_bytes()))
    assert np.array_equal(d, np.zeros(24, F32)) and not np.any(np.signbit(d))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nonfinite_gradient_sends_nonfinite(rows, bad):
    x = rows.clone()
    x[1, 5] = bad
    c = TernGrad()
    msg = c.encode(x, KEY)
    assert msg.flags == FLAG_NONFINITE and msg.sections == ()
    out = torch.zeros(x.numel())
    assert c.decode(Message.from_bytes(msg.to_bytes()), KEY, out) is False
    assert not out.any()


def test_float64_beyond_float32_range_is_nonfinite():
    msg = TernGrad().encode(torch.tensor([1e300, 1.0], dtype=torch.float64), KEY)
    assert msg.flags == FLAG_NONFINITE and msg.dtype == 4


# --------------------------------------------------------------------------------------------
# registry, settings, bad input
# --------------------------------------------------------------------------------------------

def test_registry_and_spec():
    c = hvdcomp.get("terngrad")
    assert type(c) is TernGrad and c.name == "terngrad" and "terngrad" in hvdcomp.available()
    assert c.settings() == {"clip": 2.5, "bucket_size": 0, "entropy": False}
    d = hvdcomp.get("terngrad:clip=1.5,bucket_size=512,entropy=False")
    assert (d.clip, d.bucket_size) == (1.5, 512)
    assert hvdcomp.get(d.spec()).settings() == d.settings()
    assert d.spec() == "terngrad:clip=1.5,bucket_size=512,entropy=False"
    assert hvdcomp.get("terngrad", clip=0).clip == 0.0
    assert isinstance(c, hvdcomp.compressors.BucketQuantizer)
    assert c.state_dict() == {}
    c.load_state_dict({})
    with pytest.raises(ValueError):
        c.load_state_dict({"levels": [0.0, 1.0]})


@pytest.mark.parametrize("kw", [dict(clip=-0.1), dict(clip=float("nan")), dict(clip=float("inf")),
                                dict(clip="2"), dict(clip=True), dict(bucket_size=-1),
                                dict(bucket_size=2**31 + 1), dict(bucket_size=2.0),
                                dict(bucket_size=True)])
def test_bad_settings(kw):
    with pytest.raises(ValueError):
        TernGrad(**kw)


@pytest.mark.parametrize("spec", ["terngrad:clip=-1", "terngrad:clip=nan", "terngrad:clip=x",
                                  "terngrad:bucket_size=-5", "terngrad:bits=3"])
def test_bad_specs(spec):
    with pytest.raises(ConfigError):
        hvdcomp.get(spec)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.uint8, torch.int8,
                                   torch.bool])
def test_integer_tensors_raise_type_error(dtype):
    with pytest.raises(TypeError):
        TernGrad().encode(torch.ones(4, 3, dtype=dtype), KEY)


# --------------------------------------------------------------------------------------------
# malformed messages
# --------------------------------------------------------------------------------------------

@pytest.fixture
def good():
    x = torch.tensor([[1.0, -0.5, 0.25], [0.0, 2.0, -3.0], [0.5, 0.5, -1.0]])
    return TernGrad(clip=0, bucket_size=4).encode(x, KEY)     # 9 coords: 3 scales, 3 bytes


def _decode(msg):
    TernGrad(clip=0, bucket_size=4).decode(msg, KEY, torch.zeros(9))


def test_good_message_decodes(good):
    _decode(rebuild(good))


@pytest.mark.parametrize("secs", [
    lambda s: (s[0][:-4], s[1]),                    # one scale short
    lambda s: (np.concatenate([s[0], s[0][:4]]), s[1]),   # one scale too many
    lambda s: (s[0][:-1], s[1]),                    # not a multiple of 4
    lambda s: (s[0], s[1][:-1]),                    # codes short
    lambda s: (s[0], np.concatenate([s[1], s[1][:1]])),   # codes long
    lambda s: (s[0],),                              # one section
    lambda s: (s[0], s[1], s[1]),                   # three sections
    lambda s: (),                                   # none, without the NONFINITE flag
])
def test_wrong_sections_raise(good, secs):
    with pytest.raises(WireFormatError):
        _decode(rebuild(good, secs(good.sections)))


@pytest.mark.parametrize("val", [-1.0, -1e-30, float("nan"), float("inf"), -float("inf")])
def test_bad_scales_raise(good, val):
    s = np.array(good.sections[0]).view(F32).copy()
    s[1] = val
    with pytest.raises(WireFormatError, match="finite"):
        _decode(rebuild(good, (s.view(np.uint8), good.sections[1])))


@pytest.mark.parametrize("fields", [dict(bits=3), dict(bits=1), dict(bucket_size=5),
                                    dict(bucket_size=0), dict(codec=10), dict(level_version=1),
                                    dict(step=8), dict(rank=0), dict(tensor_id=2), dict(seed=1),
                                    dict(shape=(3, 4)), dict(flags=0x02)])
def test_header_mismatch_raises(good, fields):
    m = dict(good.__dict__)
    m.update(fields)
    msg = Message(**m)           # decode checks the header itself (no from_bytes needed)
    with pytest.raises(WireFormatError):
        _decode(msg)


def test_corrupted_bytes_raise(good):
    b = bytearray(good.to_bytes())
    b[-6] ^= 0x10
    with pytest.raises(WireFormatError):
        Message.from_bytes(bytes(b))
    with pytest.raises(WireFormatError):
        Message.from_bytes(good.to_bytes()[:-3])
