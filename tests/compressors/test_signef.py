"""EF-SignSGD (hvdcomp.compressors.signef): error feedback worked by hand, residual state and
checkpoints, the sign of zero, golden bytes, the NaN policy, bad input, malformed messages.

Expected values are worked out here from Algorithm 1 of Karimireddy et al., ICML 2019
(arXiv 1901.09847) and the module docstring, not taken from hvdcomp:

    p = g + e;  per bucket scale = ||p_b||_1 / len(b) (float32);  bit = (p < 0), so 0 -> +;
    decoded = -scale if bit else +scale;  e <- p - decoded;
    sign bits packed 1 per coordinate, LSB first; scales float32 little-endian.

The hand-worked cases use dyadic values, so every float32 operation is exact and the expected
numbers below are the exact results.
"""
import io
import math
import struct

import numpy as np
import pytest
import torch

import hvdcomp
from hvdcomp import ConfigError, WireFormatError
from hvdcomp.compressors.signef import SignEF
from hvdcomp.wire import FLAG_NONFINITE, Message

F32 = np.float32
CODEC_SIGNEF = 16              # hvdcomp.wire.CODECS["signef"], fixed by the wire format


def key(name="layer.weight", step=0, rank=0, tensor_id=2, seed=5, world_size=2):
    return hvdcomp.TensorKey(name=name, tensor_id=tensor_id, step=step, rank=rank,
                             world_size=world_size, seed=seed)


def sec(msg, i):
    return bytes(np.asarray(msg.sections[i], dtype=np.uint8))


def decoded(c, msg, k):
    out = torch.zeros(msg.numel)
    assert c.decode(Message.from_bytes(msg.to_bytes()), k, out) is True
    return out


def f32(*v):
    return struct.pack(f"<{len(v)}f", *v)


# --------------------------------------------------------------------------------------------
# independent NumPy reference (for the random-input checks)
# --------------------------------------------------------------------------------------------

def np_signef(g, e, bs):
    """One step: (scales f32, bits uint8, decoded f32, new residual f32), all flat."""
    p = (np.asarray(g, F32).reshape(-1) + np.asarray(e, F32).reshape(-1)).astype(F32)
    n = p.size
    b = bs if bs else max(n, 1)
    nb = -(-n // b)
    scales = np.array([np.sum(np.abs(p[i * b:(i + 1) * b]).astype(np.float64))
                       / len(p[i * b:(i + 1) * b]) for i in range(nb)]).astype(F32)
    bits = (p < 0).astype(np.uint8)
    srep = np.repeat(scales, b)[:n]
    dec = np.where(bits == 1, -srep, srep).astype(F32)
    return scales, bits, dec, (p - dec).astype(F32)


# --------------------------------------------------------------------------------------------
# Algorithm 1 by hand
# --------------------------------------------------------------------------------------------

def test_three_steps_by_hand():
    c = SignEF()
    k = key()
    g = [[[1.0, -2.0], [0.5, 0.0]],
         [[-1.0, 1.0], [0.25, 0.5]],
         [[0.5, 0.75], [-0.25, 1.0]]]
    # step 1: e = 0, p = [1, -2, .5, 0]; ||p||_1 = 3.5, scale 3.5 / 4 = .875;
    #   bits [0, 1, 0, 0] (0 -> +); decoded [.875, -.875, .875, .875];
    #   e = [.125, -1.125, -.375, -.875]
    # step 2: p = [-1, 1, .25, .5] + e = [-.875, -.125, -.125, -.375]; ||p||_1 = 1.5,
    #   scale .375; bits [1, 1, 1, 1]; decoded -.375 each; e = [-.5, .25, .25, 0]
    # step 3: p = [.5, .75, -.25, 1] + e = [0, 1, 0, 1]; ||p||_1 = 2, scale .5;
    #   bits [0, 0, 0, 0] (both zeros -> +); decoded .5 each; e = [-.5, .5, -.5, .5]
    want = [(0.875, 0x02, [0.875, -0.875, 0.875, 0.875], [0.125, -1.125, -0.375, -0.875]),
            (0.375, 0x0F, [-0.375] * 4, [-0.5, 0.25, 0.25, 0.0]),
            (0.5, 0x00, [0.5] * 4, [-0.5, 0.5, -0.5, 0.5])]
    total = torch.zeros(4)
    for t, (gt, (scale, byte, dec, res)) in enumerate(zip(g, want)):
        kt = key(step=t)
        msg = c.encode(torch.tensor(gt), kt)
        assert msg.shape == (2, 2) and msg.bits == 1 and msg.codec == CODEC_SIGNEF
        assert sec(msg, 0) == f32(scale)
        assert sec(msg, 1) == bytes([byte])
        d = decoded(c, msg, kt)
        assert d.tolist() == dec
        assert c.residual("layer.weight").shape == (2, 2)
        assert c.residual("layer.weight").reshape(-1).tolist() == res
        total += d
    # error feedback loses nothing: sum of decoded = sum of gradients - final residual
    assert total.tolist() == [1.0, -0.75, 1.0, 1.0]
    assert torch.equal(total, torch.tensor(g).sum(0).reshape(-1)
                       - c.residual("layer.weight").reshape(-1))


def test_buckets_by_hand():
    # bucket_size 3, n = 4: buckets [0:3] and [3:4] (the last one is short)
    # p = [1, -2, 0, .75]: scales [3 / 3, .75 / 1] = [1, .75]; bits [0, 1, 0, 0]
    # decoded [1, -1, 1, .75]; e = [0, -1, -1, 0]
    c = SignEF(bucket_size=3)
    msg = c.encode(torch.tensor([1.0, -2.0, 0.0, 0.75]), key())
    assert msg.bucket_size == 3
    assert sec(msg, 0) == f32(1.0, 0.75) and sec(msg, 1) == b"\x02"
    assert decoded(c, msg, key()).tolist() == [1.0, -1.0, 1.0, 0.75]
    assert c.residual("layer.weight").tolist() == [0.0, -1.0, -1.0, 0.0]


def test_sign_of_zero_is_plus():
    # p = [0, -0, 2, -2]: scale 1; 0 and -0.0 send bit 0 (+): bits [0, 0, 0, 1] -> 0x08
    c = SignEF()
    msg = c.encode(torch.tensor([0.0, -0.0, 2.0, -2.0]), key())
    assert sec(msg, 0) == f32(1.0) and sec(msg, 1) == b"\x08"
    assert decoded(c, msg, key()).tolist() == [1.0, 1.0, 1.0, -1.0]
    assert c.residual("layer.weight").tolist() == [-1.0, -1.0, 1.0, -1.0]


def test_golden_sign_bytes_two_bytes():
    # p = [-1, 1, 1, 1, 1, 1, 1, -1, -1, 1]: scale 1; bits 1 at 0, 7, 8
    # byte 0 = bit 0 | bit 7 = 0x81, byte 1 = bit 0 (coordinate 8) = 0x01 (high bits 0)
    x = torch.tensor([-1.0, 1, 1, 1, 1, 1, 1, -1, -1, 1])
    msg = SignEF().encode(x, key())
    assert sec(msg, 1) == b"\x81\x01" and sec(msg, 0) == f32(1.0)
    # the whole message: header per docs/wire-format.md, then sections, then the CRC
    import zlib
    head = struct.pack("<4sBBBBBBBBIIIIIQQ", b"HVDC", 1, CODEC_SIGNEF, 1, 0, 1, 1, 2, 0, 0, 0,
                       2, 0, 5, 0, 10)
    body = head + struct.pack("<Q", 10) + struct.pack("<QQ", 4, 2) + f32(1.0) + b"\x81\x01"
    assert msg.to_bytes() == body + struct.pack("<I", zlib.crc32(body))


def test_residual_energy_identity():
    # per bucket, ||p - C(p)||^2 = ||p||^2 - ||p||_1^2 / len (exact in real arithmetic)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1000, generator=g) * torch.rand(1000, generator=g) ** 3
    x[::7] = 0.0
    for bs in (0, 64, 300):
        c = SignEF(bucket_size=bs)
        c.encode(x, key())
        e = c.residual("layer.weight").double().numpy()
        p = x.double().numpy()
        b = bs or 1000
        for i in range(0, 1000, b):
            pb = p[i:i + b]
            want = float(np.sum(pb ** 2) - np.sum(np.abs(pb)) ** 2 / len(pb))
            assert float(np.sum(e[i:i + b] ** 2)) == pytest.approx(want, rel=1e-5)


@pytest.mark.parametrize("bs", [0, 1, 7, 300, 5000])
def test_matches_numpy_over_steps(bs):
    g = torch.Generator().manual_seed(11)
    c = SignEF(bucket_size=bs)
    e = np.zeros(1234, F32)
    for t in range(4):
        x = (torch.randn(2, 617, generator=g) * (t + 1)).float()
        x.view(-1)[t::50] = 0.0
        msg = c.encode(x, key(step=t))
        scales, bits, dec, e = np_signef(x.numpy(), e, bs)
        assert sec(msg, 0) == scales.tobytes()
        assert sec(msg, 1) == np.packbits(bits, bitorder="little").tobytes()
        assert np.array_equal(decoded(c, msg, key(step=t)).numpy(), dec)
        assert np.array_equal(c.residual("layer.weight").numpy().reshape(-1), e)
        assert c.residual("layer.weight").shape == (2, 617)


def test_biased_but_error_feedback_keeps_the_sum():
    # one step is biased (the scaled sign is not g) ...
    g = torch.tensor([3.0, 1.0, 0.0, 0.0])
    c = SignEF()
    d = decoded(c, c.encode(g, key()), key())
    assert d.tolist() == [1.0, 1.0, 1.0, 1.0] and not torch.equal(d, g)
    # ... but over T steps sum(decoded) = T g - e_T, and e_T stays bounded, so the average
    # of the decoded values converges to g.  Bound: ||e'||^2 = ||p||^2 - ||p||_1^2 / d
    # <= (1 - 1/d) ||p||^2 and ||p|| <= ||g|| + ||e||, so with q = sqrt(1 - 1/d):
    # ||e_t|| <= q ||g|| / (1 - q) for every t.
    q = math.sqrt(1 - 1 / 4)
    bound = q * float(g.norm()) / (1 - q)
    total = d.clone()
    T = 200
    for t in range(1, T):
        total += decoded(c, c.encode(g, key(step=t)), key(step=t))
        assert float(c.residual("layer.weight").norm()) <= bound
    e = c.residual("layer.weight")
    assert torch.allclose(total + e, T * g, rtol=0, atol=1e-3)
    assert float((total / T - g).abs().max()) <= bound / T + 1e-5


def test_residuals_are_kept_per_name():
    c = SignEF()
    c.encode(torch.tensor([1.0, -3.0]), key(name="a"))
    c.encode(torch.tensor([[2.0, 2.0, -4.0]]), key(name="b", tensor_id=3))
    assert c.residual("a").tolist() == [-1.0, -1.0]        # scale 2
    s = F32(8.0 / 3.0)                                       # scale of b: 8 / 3 in float32
    assert c.residual("b").tolist() == [[float(F32(2) - s), float(F32(2) - s),
                                         float(F32(-4) + s)]]
    assert c.residual("c") is None
    assert c.residual("b").dtype == torch.float32


# --------------------------------------------------------------------------------------------
# state_dict / load_state_dict
# --------------------------------------------------------------------------------------------

def _trained(steps=3):
    g = torch.Generator().manual_seed(5)
    c = SignEF(bucket_size=16)
    for t in range(steps):
        c.encode(torch.randn(5, 9, generator=g), key(name="w", step=t))
        c.encode(torch.randn(33, generator=g).to(torch.float16), key(name="h", step=t))
    return c


def test_state_dict_round_trip_is_bit_exact():
    c = _trained()
    sd = c.state_dict()
    assert set(sd) == {"residuals"} and set(sd["residuals"]) == {"w", "h"}
    assert sd["residuals"]["w"].shape == (5, 9) and sd["residuals"]["h"].dtype == torch.float32
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    c2 = SignEF(bucket_size=16)
    c2.load_state_dict(torch.load(buf))
    for n in ("w", "h"):
        a, b = c.residual(n), c2.residual(n)
        assert a.dtype == b.dtype == torch.float32
        assert np.array_equal(a.numpy().view(np.uint32), b.numpy().view(np.uint32))
    # and both continue identically
    x = torch.linspace(-1, 1, 45).reshape(5, 9)
    assert (c.encode(x, key(name="w", step=9)).to_bytes()
            == c2.encode(x, key(name="w", step=9)).to_bytes())
    assert torch.equal(c.residual("w"), c2.residual("w"))


def test_state_dict_holds_copies():
    c = _trained()
    sd = c.state_dict()
    before = c.residual("w")
    sd["residuals"]["w"].fill_(9.0)
    assert torch.equal(c.residual("w"), before)
    c.residual("w").fill_(7.0)
    assert torch.equal(c.residual("w"), before)


def test_load_replaces_all_residuals():
    c = _trained()
    c.load_state_dict({"residuals": {"w": torch.zeros(5, 9)}})
    assert c.residual("h") is None and not c.residual("w").any()
    c.load_state_dict({})
    assert c.residual("w") is None


def test_mismatched_shape_raises_at_next_encode():
    c = SignEF()
    c.load_state_dict({"residuals": {"w": torch.zeros(3)}})
    with pytest.raises(ValueError, match="'w'.*shape"):
        c.encode(torch.ones(2, 2), key(name="w"))
    # same number of elements, other shape: still an error, never a silent reshape
    c = SignEF()
    c.load_state_dict({"residuals": {"w": torch.zeros(4)}})
    with pytest.raises(ValueError, match="shape"):
        c.encode(torch.ones(2, 2), key(name="w"))
    # a one-element residual is not broadcast either
    c = SignEF()
    c.load_state_dict({"residuals": {"w": torch.zeros(1)}})
    with pytest.raises(ValueError):
        c.encode(torch.ones(2, 2), key(name="w"))
    assert torch.equal(c.residual("w"), torch.zeros(1))      # unchanged by the failure


def test_mismatched_shape_against_held_residual_raises_at_load():
    c = _trained()
    before = c.state_dict()
    with pytest.raises(ValueError, match="'w'"):
        c.load_state_dict({"residuals": {"h": torch.zeros(33), "w": torch.zeros(9, 5)}})
    after = c.state_dict()                                    # nothing was changed
    assert all(torch.equal(before["residuals"][n], after["residuals"][n]) for n in ("w", "h"))


@pytest.mark.parametrize("state", [
    {"residuals": {"w": torch.zeros(5, 9, dtype=torch.float64)}},
    {"residuals": {"w": torch.zeros(5, 9, dtype=torch.float16)}},
    {"residuals": {"w": np.zeros((5, 9), F32)}},
    {"residuals": {"w": torch.full((5, 9), float("nan"))}},
    {"residuals": {"w": torch.full((5, 9), float("inf"))}},
    {"residuals": {3: torch.zeros(5, 9)}},
    {"residuals": [torch.zeros(5, 9)]},
    {"levels": [0.0, 1.0]},
    [("w", torch.zeros(5, 9))],
])
def test_bad_state_raises_value_error(state):
    with pytest.raises(ValueError):
        SignEF().load_state_dict(state)


# --------------------------------------------------------------------------------------------
# NaN policy
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nonfinite_gradient_keeps_the_residual(bad):
    c = SignEF()
    c.encode(torch.tensor([1.0, -3.0, 0.5, 0.25]), key(step=0))
    before = c.residual("layer.weight")
    g = torch.tensor([1.0, bad, 2.0, 0.0])
    msg = c.encode(g, key(step=1))
    assert msg.flags == FLAG_NONFINITE and msg.sections == ()
    assert torch.equal(c.residual("layer.weight"), before)
    out = torch.zeros(4)
    assert c.decode(Message.from_bytes(msg.to_bytes()), key(step=1), out) is False
    assert not out.any()
    # a NaN at the very first step creates no residual
    c2 = SignEF()
    assert c2.encode(g, key()).flags == FLAG_NONFINITE and c2.residual("layer.weight") is None


def test_overflow_of_g_plus_e_keeps_the_residual():
    c = SignEF()
    c.load_state_dict({"residuals": {"layer.weight": torch.tensor([3e38, 0.0])}})
    msg = c.encode(torch.tensor([3e38, 1.0]), key())          # p = 6e38 overflows float32
    assert msg.flags == FLAG_NONFINITE
    assert c.residual("layer.weight").tolist() == [float(F32(3e38)), 0.0]
    msg = SignEF().encode(torch.tensor([1e300, 0.0], dtype=torch.float64), key())
    assert msg.flags == FLAG_NONFINITE


# --------------------------------------------------------------------------------------------
# shapes, dtypes, special tensors
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_other_dtypes(dtype):
    x = torch.tensor([[1.5, -0.5], [0.25, -2.0]]).to(dtype)
    c = SignEF()
    msg = c.encode(x, key())
    # scale (1.5 + .5 + .25 + 2) / 4 = 1.0625; bits [0, 1, 0, 1] = 0x0A
    assert msg.dtype == {torch.float16: 2, torch.bfloat16: 3, torch.float64: 4}[dtype]
    assert sec(msg, 0) == f32(1.0625) and sec(msg, 1) == b"\x0a"
    assert c.residual("layer.weight").dtype == torch.float32
    assert c.residual("layer.weight").tolist() == [[0.4375, 0.5625], [-0.8125, -0.9375]]


def test_non_contiguous_layout():
    x = torch.arange(-6.0, 6.0).reshape(3, 4).t()           # (4, 3) strided view
    a, b = SignEF(), SignEF()
    ma, mb = a.encode(x, key()), b.encode(x.contiguous(), key())
    assert ma.shape == (4, 3) and ma.to_bytes() == mb.to_bytes()
    assert torch.equal(a.residual("layer.weight"), b.residual("layer.weight"))
    assert a.residual("layer.weight").shape == (4, 3)


@pytest.mark.parametrize("bs", [0, 3])
def test_empty_tensor(bs):
    c = SignEF(bucket_size=bs)
    msg = c.encode(torch.zeros(0, 5), key())
    assert msg.shape == (0, 5) and [len(s) for s in msg.sections] == [0, 0]
    out = torch.zeros(0)
    assert c.decode(Message.from_bytes(msg.to_bytes()), key(), out) is True
    assert c.residual("layer.weight").shape == (0, 5)
    c.encode(torch.zeros(0, 5), key(step=1))                 # and again, with the residual


@pytest.mark.parametrize("g", [torch.tensor(-1.25), torch.tensor([0.375]),
                               torch.tensor([[5.0]], dtype=torch.float64)])
def test_scalar_and_one_element_are_exact(g):
    c = SignEF()
    msg = c.encode(g, key())
    assert msg.shape == tuple(g.shape)
    assert sec(msg, 0) == f32(abs(float(g)))
    assert decoded(c, msg, key()).tolist() == [float(g)]
    assert c.residual("layer.weight").shape == g.shape
    assert float(c.residual("layer.weight")) == 0.0


@pytest.mark.parametrize("bs", [0, 5])
def test_all_zero_tensor(bs):
    c = SignEF(bucket_size=bs)
    for t in range(2):
        msg = c.encode(torch.zeros(4, 6), key(step=t))
        assert sec(msg, 0) == b"\x00" * 4 * (1 if bs == 0 else 5)   # scale 0
        assert sec(msg, 1) == b"\x00" * 3
        d = decoded(c, msg, key(step=t)).numpy()
        assert np.array_equal(d, np.zeros(24, F32)) and not np.any(np.signbit(d))
        assert not c.residual("layer.weight").any()


@pytest.mark.parametrize("shape,bs", [((5, 9), 0), ((5, 9), 16), ((1000,), 0), ((1000,), 7),
                                      ((0, 3), 0), ((), 0), ((2, 1, 3), 1)])
def test_message_size_formula(shape, bs):
    n = int(np.prod(shape)) if shape else 1
    b = bs or max(n, 1)
    payload = 4 * (-(-n // b)) + -(-n // 8)
    c = SignEF(bucket_size=bs)
    assert c.message_bytes(n) == payload
    assert len(c.encode(torch.ones(shape), key()).to_bytes()) == 48 + 8 * len(shape) + 16 \
        + payload + 4


# --------------------------------------------------------------------------------------------
# registry, settings, bad input
# --------------------------------------------------------------------------------------------

def test_registry_and_spec():
    c = hvdcomp.get("signef")
    assert type(c) is SignEF and c.name == "signef" and "signef" in hvdcomp.available()
    assert c.settings() == {"bucket_size": 0, "entropy": False}
    assert c.spec() == "signef:bucket_size=0,entropy=False"
    d = hvdcomp.get("signef:bucket_size=4096")
    assert d.bucket_size == 4096 and hvdcomp.get(d.spec()).settings() == d.settings()
    assert c.state_dict() == {"residuals": {}}
    assert not c.summable and not c.prescaled


@pytest.mark.parametrize("bs", [-1, 2**31 + 1, 1.5, True, "8"])
def test_bad_settings(bs):
    with pytest.raises(ValueError):
        SignEF(bucket_size=bs)


@pytest.mark.parametrize("spec", ["signef:bucket_size=-1", "signef:bucket_size=x",
                                  "signef:bits=1", "signef:clip=2"])
def test_bad_specs(spec):
    with pytest.raises(ConfigError):
        hvdcomp.get(spec)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.uint8, torch.bool])
def test_integer_tensors_raise_type_error(dtype):
    c = SignEF()
    with pytest.raises(TypeError):
        c.encode(torch.ones(4, dtype=dtype), key())
    assert c.residual("layer.weight") is None


# --------------------------------------------------------------------------------------------
# malformed messages
# --------------------------------------------------------------------------------------------

@pytest.fixture
def good():
    # 10 coordinates, buckets of 4: 3 scales (12 bytes), 2 bytes of sign bits
    x = torch.tensor([1.0, -2.0, 3.0, -4.0, 0.5, 0.5, -0.5, 0.0, 1.0, -1.0])
    return SignEF(bucket_size=4).encode(x, key())


def rebuild(msg, sections=None, **fields):
    d = dict(msg.__dict__)
    if sections is not None:
        d["sections"] = tuple(sections)
    d.update(fields)
    return Message.from_bytes(Message(**d).to_bytes())


def _decode(msg):
    SignEF(bucket_size=4).decode(msg, key(), torch.zeros(10))


def test_good_message_decodes(good):
    out = torch.zeros(10)
    SignEF(bucket_size=4).decode(rebuild(good), key(), out)
    # scales [2.5, .375, 1]
    assert out.tolist() == [2.5, -2.5, 2.5, -2.5, 0.375, 0.375, -0.375, 0.375, 1.0, -1.0]


@pytest.mark.parametrize("secs", [
    lambda s: (s[0][:-4], s[1]),
    lambda s: (np.concatenate([s[0], s[0][:4]]), s[1]),
    lambda s: (s[0][:-2], s[1]),
    lambda s: (s[0], s[1][:-1]),
    lambda s: (s[0], np.concatenate([s[1], s[1]])),
    lambda s: (s[0],),
    lambda s: (s[0], s[1], s[1]),
    lambda s: (),
])
def test_wrong_sections_raise(good, secs):
    with pytest.raises(WireFormatError):
        _decode(rebuild(good, secs(good.sections)))


@pytest.mark.parametrize("val", [-1.0, -1e-30, float("nan"), float("inf"), -float("inf")])
def test_bad_scales_raise(good, val):
    s = np.array(good.sections[0]).view(F32).copy()
    s[2] = val
    with pytest.raises(WireFormatError, match="finite"):
        _decode(rebuild(good, (s.view(np.uint8), good.sections[1])))


@pytest.mark.parametrize("fields", [dict(bits=2), dict(bits=0), dict(bucket_size=0),
                                    dict(bucket_size=8), dict(codec=15), dict(level_version=3),
                                    dict(step=1), dict(rank=1), dict(tensor_id=0), dict(seed=6),
                                    dict(shape=(11,)), dict(shape=(3, 3)), dict(flags=0x02)])
def test_header_mismatch_raises(good, fields):
    d = dict(good.__dict__)
    d.update(fields)
    with pytest.raises(WireFormatError):
        _decode(Message(**d))


def test_decode_does_not_touch_residuals(good):
    c = SignEF(bucket_size=4)
    c.load_state_dict({"residuals": {"layer.weight": torch.ones(10)}})
    out = torch.zeros(10)
    c.decode(rebuild(good), key(), out)
    c.decode(rebuild(good), key(rank=0), out)
    assert torch.equal(c.residual("layer.weight"), torch.ones(10))
