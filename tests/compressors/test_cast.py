"""none / fp16 / bf16: encode -> bytes -> decode, scaling, NaN policy, Horovod's contract.

Expected values are computed with NumPy (float16 casts, float32 arithmetic) and, for
bfloat16, with explicit round-to-nearest-even bit arithmetic on the float32 bit pattern, so
they do not depend on the torch code paths under test.
"""
import numpy as np
import pytest
import torch

import hvdcomp
from hvdcomp import Message, WireFormatError
from hvdcomp.wire import DTYPES, FLAG_NONFINITE


def wire_round_trip(comp, x, key):
    """encode -> to_bytes -> from_bytes; returns (message as sent, message as received)."""
    msg = comp.encode(x, key)
    return msg, Message.from_bytes(msg.to_bytes())


def bf16_rne_bits(x32: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns, round to nearest, ties to even (finite inputs)."""
    u = x32.astype(np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def bf16_bits_to_f32(b: np.ndarray) -> np.ndarray:
    return (b.astype(np.uint32) << 16).view(np.float32)


def spread_values(rng, n):
    """float32 values over many binades (including fp16 subnormals), both signs."""
    mag = 10.0 ** rng.uniform(-7, 4, n)
    sign = np.where(rng.random(n) < 0.5, -1.0, 1.0)
    return (sign * mag * rng.random(n)).astype(np.float32)


# --- none ----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_none_is_bit_exact(dtype, rng, make_key):
    # float64 values with bits below float32 precision, so x.float() really rounds
    x64 = spread_values(rng, 60).astype(np.float64) * (1 + rng.random(60) * 1e-3)
    x = torch.from_numpy(x64).reshape(3, 4, 5).to(dtype)
    key = make_key(rank=2, world_size=4)
    c = hvdcomp.get("none")
    sent, got = wire_round_trip(c, x, key)
    # the section is the tensor's own bytes
    if dtype == torch.bfloat16:
        raw = x.view(torch.int16).numpy().tobytes()
    else:
        raw = x.numpy().astype(x.numpy().dtype.newbyteorder("<")).tobytes()
    assert bytes(got.sections[0]) == raw
    assert got.codec == 1 and got.dtype == DTYPES[dtype] and got.shape == (3, 4, 5)
    assert (got.tensor_id, got.step, got.rank, got.seed) == (3, 7, 2, 11)
    assert got.flags == 0 and got.bits == 0 and got.bucket_size == 0
    acc = torch.zeros(60)
    assert c.decode(got, key, acc) is True
    assert torch.equal(acc, x.float().reshape(-1))


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.int8, torch.uint8,
                                   torch.int16, torch.bool])
def test_none_integer_and_bool_tensors(dtype, make_key):
    vals = [0, 1, 5, 100, 7, 1] if dtype != torch.bool else [0, 1, 1, 0, 1, 1]
    x = torch.tensor(vals).to(dtype)
    key = make_key()
    c = hvdcomp.get("none")
    _, got = wire_round_trip(c, x, key)
    assert got.dtype == DTYPES[dtype]
    acc = torch.full((6,), 0.5)
    assert c.decode(got, key, acc) is True
    assert acc.tolist() == [0.5 + v for v in vals]


def test_none_decode_adds_and_finalize_averages(rng, make_key):
    ws = 4
    c = hvdcomp.get("none")
    assert c.prescaled is False
    grads = [torch.from_numpy(spread_values(rng, 10)) for _ in range(ws)]
    acc = torch.zeros(10)
    for r, g in enumerate(grads):
        key = make_key(rank=r, world_size=ws)
        assert c.decode(wire_round_trip(c, g, key)[1], key, acc)
    expected = np.zeros(10, np.float32)
    for g in grads:
        expected = expected + g.numpy()
    assert np.array_equal(acc.numpy(), expected)
    c.finalize(acc, make_key(world_size=ws))
    assert np.array_equal(acc.numpy(), expected / np.float32(ws))


# --- fp16 ----------------------------------------------------------------------------------

@pytest.mark.parametrize("ws", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fp16_sends_half_of_x_over_world_size(ws, dtype, rng, make_key):
    x32 = spread_values(rng, 200)
    x = torch.from_numpy(x32).to(dtype)
    xin = x.float().numpy()                      # the value the encoder sees, in float32
    h = (xin / np.float32(ws)).astype(np.float16)
    c = hvdcomp.get("fp16")
    key = make_key(rank=ws - 1, world_size=ws)
    _, got = wire_round_trip(c, x, key)
    assert got.codec == 2 and got.dtype == DTYPES[dtype]
    assert bytes(got.sections[0]) == h.astype("<f2").tobytes()
    acc0 = rng.standard_normal(200).astype(np.float32)
    acc = torch.from_numpy(acc0.copy())
    assert c.decode(got, key, acc) is True
    expected = acc0 + h.astype(np.float32)
    assert np.array_equal(acc.numpy(), expected)
    # prescaled: the sum already is the average, finalize leaves it as it is
    assert c.prescaled is True
    out = c.finalize(acc, make_key(world_size=ws))
    assert np.array_equal(out.numpy(), expected)


def test_fp16_rounding_hand_worked(make_key):
    # fp16 has 10 mantissa bits: spacing 2**-10 on [1, 2).
    #   1 + 2**-11       is halfway between 1 and 1 + 2**-10       -> ties to even -> 1
    #   1 + 3 * 2**-11   is halfway between 1 + 2**-10 and 1 + 2**-9 -> even -> 1 + 2**-9
    #   3 / 3 (ws = 3) would be exact; here ws = 1, no division
    #   70000 > 65504 (fp16 max) -> inf: the tensor keeps its range (#24 item 6): it is
    #   sent as its own float32 values (a `none` message), which fp16's decode adds exactly
    x = torch.tensor([1 + 2**-11, 1 + 3 * 2**-11, -2.0, 70000.0], dtype=torch.float32)
    c = hvdcomp.get("fp16")
    key = make_key(world_size=1)
    acc = torch.zeros(3)
    assert c.decode(wire_round_trip(c, x[:3], key)[1], key, acc)
    assert acc.tolist() == [1.0, 1 + 2**-9, -2.0]
    m = wire_round_trip(c, x, key)[1]
    assert m.codec == 1 and m.dtype == DTYPES[torch.float32] and m.flags == 0
    assert bytes(m.sections[0]) == np.array([1 + 2**-11, 1 + 3 * 2**-11, -2.0, 70000.0],
                                            "<f4").tobytes()
    acc = torch.zeros(4)
    assert c.decode(m, key, acc) is True
    assert acc.tolist() == [1 + 2**-11, 1 + 3 * 2**-11, -2.0, 70000.0]


@pytest.mark.parametrize("name,dtype", [("none", torch.float32), ("none", torch.float64),
                                        ("fp16", torch.float32), ("bf16", torch.float32)])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 1e300])
def test_unflagged_nonfinite_values_are_rejected(name, dtype, bad, make_key):
    """A payload value that is not finite in float32 (which no encoder sends unflagged: it
    sends NONFINITE) is a WireFormatError, the accumulator untouched (#15 item 3)."""
    if bad == 1e300 and dtype != torch.float64:
        pytest.skip("1e300 is finite only in float64")
    c = hvdcomp.get(name)
    key = make_key(world_size=1)
    m = Message.from_bytes(c.encode(torch.tensor([1.0, 2.0, 3.0], dtype=dtype),
                                    key).to_bytes())
    raw = np.array(m.sections[0], dtype=np.uint8)
    wire = {"none": dtype, "fp16": torch.float16, "bf16": torch.bfloat16}[name]
    vals = torch.from_numpy(raw.copy()).view(wire)
    vals[1] = bad
    bad_msg = Message(**{**m.__dict__, "sections": (vals.view(torch.uint8).numpy(),)})
    acc = torch.full((3,), 5.0)
    with pytest.raises(hvdcomp.WireFormatError, match="NaN or Inf"):
        c.decode(Message.from_bytes(bad_msg.to_bytes()), key, acc)
    assert acc.tolist() == [5.0] * 3
    # and no encoder sends such a value unflagged: a float64 1e300 is Inf in float32
    sent = c.encode(torch.tensor([1.0, bad, 3.0], dtype=dtype), key)
    assert sent.flags == FLAG_NONFINITE


def test_fp16_divides_before_the_cast(make_key):
    # 100000 / 4 = 25000 is representable-range in fp16 although 100000 is not:
    # fp16 spacing on [16384, 32768) is 16; 25000 / 16 = 1562.5 -> tie -> even 1562 -> 24992.
    x = torch.tensor([100000.0, -1.0])
    c = hvdcomp.get("fp16")
    key = make_key(world_size=4)
    acc = torch.zeros(2)
    assert c.decode(wire_round_trip(c, x, key)[1], key, acc)
    assert acc.tolist() == [24992.0, -0.25]


def test_fp16_average_over_ranks(rng, make_key):
    ws = 3
    c = hvdcomp.get("fp16")
    grads = [spread_values(rng, 50) for _ in range(ws)]
    acc = torch.zeros(50)
    for r, g in enumerate(grads):
        key = make_key(rank=r, world_size=ws)
        assert c.decode(wire_round_trip(c, torch.from_numpy(g), key)[1], key, acc)
    c.finalize(acc, make_key(world_size=ws))
    expected = np.zeros(50, np.float32)
    for g in grads:
        expected = expected + (g / np.float32(ws)).astype(np.float16).astype(np.float32)
    assert np.array_equal(acc.numpy(), expected)
    # and that is the average to within fp16 precision (3 half-ulps plus subnormal floor)
    mean = np.mean(np.stack(grads).astype(np.float64), axis=0)
    tol = 3 * (np.abs(mean) + max(np.abs(g).max() for g in grads) / ws) * 2**-11 + 3 * 2**-25
    assert np.all(np.abs(acc.numpy() - mean) <= tol)


def _beyond_fp16(rng, n=64):
    """bfloat16 values, most beyond fp16's 65504 (up to 1e30), some small, both signs."""
    mag = np.concatenate([10.0 ** rng.uniform(4.9, 30, n - 8), 10.0 ** rng.uniform(-6, 2, 8)])
    x32 = (np.where(rng.random(n) < 0.5, -1.0, 1.0) * mag).astype(np.float32)
    return torch.from_numpy(bf16_bits_to_f32(bf16_rne_bits(x32))).to(torch.bfloat16)


@pytest.mark.parametrize("ws", [1, 3])
def test_fp16_encode_keeps_the_range_of_a_bf16_gradient(ws, rng, make_key):
    """#24 item 6, outside the exchange: a bf16 gradient beyond fp16's range encodes as its
    own bf16 values divided by the world size (a `none` message, as the exchange sends
    it), never Inf; decode adds them and the sum over ranks is the average."""
    grads = [_beyond_fp16(rng) for _ in range(ws)]
    c = hvdcomp.get("fp16")
    acc = torch.zeros(64)
    for r, g in enumerate(grads):
        key = make_key(rank=r, world_size=ws)
        sent, got = wire_round_trip(c, g, key)
        assert got.codec == 1 and got.dtype == DTYPES[torch.bfloat16] and got.flags == 0
        # g / ws in float32, rounded to bf16 (RNE), little-endian
        want = bf16_rne_bits(g.float().numpy() / np.float32(ws))
        assert bytes(got.sections[0]) == want.astype("<u2").tobytes()
        assert c.decode(got, key, acc) is True
    c.finalize(acc, make_key(world_size=ws))
    assert torch.isfinite(acc).all()
    mean = np.mean(np.stack([g.double().numpy() for g in grads]), axis=0)
    # each share rounded once to bf16 (8 significant bits: a relative error of at most
    # 2**-8), then summed in float32
    tol = sum(np.abs(g.double().numpy()) / ws for g in grads) * (2.0 ** -8 + 2.0 ** -22)
    assert np.all(np.abs(acc.double().numpy() - mean) <= tol)


@pytest.mark.parametrize("name", ["fp16", "bf16"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_encode_outside_the_exchange_sends_what_the_exchange_sends(name, dtype, make_key):
    """A finite gradient whose cast overflows: encode's message is byte for byte the one
    the exchange sends in its place (Averaging.cast_fallback), so both routes decode
    alike."""
    from types import SimpleNamespace
    from hvdcomp.exchange.averaging import Averaging
    big = 3.4e38 if name == "bf16" else 3e5                # bf16 rounds 3.4e38 up to Inf
    if dtype == torch.bfloat16 and name == "bf16":
        pytest.skip("a finite bf16 gradient always casts to bf16")
    g = torch.tensor([big, -2.5, 1e-3, -big / 7], dtype=dtype)
    c = hvdcomp.get(name)
    key = make_key(rank=1, world_size=3)
    want = Averaging(3).cast_fallback(SimpleNamespace(compressor=c), g, key)
    assert want is not None and want.codec == 1
    assert c.encode(g, key).to_bytes() == want.to_bytes()


# --- bf16 ----------------------------------------------------------------------------------

@pytest.mark.parametrize("ws", [1, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_bf16_sends_rne_bfloat16(ws, dtype, rng, make_key):
    x = torch.from_numpy(spread_values(rng, 200)).to(dtype)
    b = bf16_rne_bits(x.float().numpy())
    c = hvdcomp.get("bf16")
    key = make_key(rank=0, world_size=ws)
    _, got = wire_round_trip(c, x, key)
    assert got.codec == 3 and got.dtype == DTYPES[dtype]
    assert bytes(got.sections[0]) == b.astype("<u2").tobytes()
    acc0 = rng.standard_normal(200).astype(np.float32)
    acc = torch.from_numpy(acc0.copy())
    assert c.decode(got, key, acc) is True
    expected = acc0 + bf16_bits_to_f32(b)
    assert np.array_equal(acc.numpy(), expected)
    # bf16 is not prescaled: finalize divides the sum by the world size
    assert c.prescaled is False
    c.finalize(acc, make_key(world_size=ws))
    assert np.array_equal(acc.numpy(), expected / np.float32(ws))


def test_bf16_rounding_hand_worked(make_key):
    # bfloat16 keeps 7 mantissa bits: spacing 2**-7 on [1, 2).
    #   1 + 2**-8      halfway between 1 and 1 + 2**-7           -> even -> 1
    #   1 + 3 * 2**-8  halfway between 1 + 2**-7 and 1 + 2**-6   -> even -> 1 + 2**-6
    #   1 + 2**-8 + 2**-20   just above halfway                   -> 1 + 2**-7
    #   3e38 stays finite (fp32's range)
    x = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-8 + 2**-20, 1.0])
    c = hvdcomp.get("bf16")
    key = make_key(world_size=2)
    acc = torch.zeros(4)
    assert c.decode(wire_round_trip(c, x, key)[1], key, acc)
    assert acc.tolist() == [1.0, 1 + 2**-6, 1 + 2**-7, 1.0]
    big = torch.tensor([3e38])
    acc = torch.zeros(1)
    assert c.decode(wire_round_trip(c, big, key)[1], key, acc)
    assert np.isfinite(acc.item()) and abs(acc.item() / 3e38 - 1) < 2**-8


def test_bf16_average_over_ranks(rng, make_key):
    ws = 4
    c = hvdcomp.get("bf16")
    grads = [spread_values(rng, 40) for _ in range(ws)]
    acc = torch.zeros(40)
    for r, g in enumerate(grads):
        key = make_key(rank=r, world_size=ws)
        assert c.decode(wire_round_trip(c, torch.from_numpy(g), key)[1], key, acc)
    c.finalize(acc, make_key(world_size=ws))
    expected = np.zeros(40, np.float32)
    for g in grads:
        expected = expected + bf16_bits_to_f32(bf16_rne_bits(g))
    assert np.array_equal(acc.numpy(), expected / np.float32(ws))


# --- layouts, empty and 0-d tensors ----------------------------------------------------------

def _layouts(gen):
    base = torch.randn(6, 10, generator=gen)
    yield "transposed", base.t()
    yield "step slice", base[::2, 1::3]
    yield "column", base[:, 4]
    yield "expanded", torch.randn(1, 5, generator=gen).expand(4, 5)
    yield "permuted 3d", torch.randn(2, 3, 4, generator=gen).permute(2, 0, 1)


@pytest.mark.parametrize("name", ["none", "fp16", "bf16"])
def test_non_contiguous_same_bytes_as_contiguous(name, gen, make_key):
    c = hvdcomp.get(name)
    key = make_key(world_size=3)
    for what, x in _layouts(gen):
        assert not x.is_contiguous(), what
        before = x.clone()
        a = c.encode(x, key).to_bytes()
        b = c.encode(x.contiguous(), key).to_bytes()
        assert a == b, what
        assert torch.equal(x, before), what          # the input is read, not modified
        got = Message.from_bytes(a)
        assert got.shape == tuple(x.shape)


@pytest.mark.parametrize("name", ["none", "fp16", "bf16"])
@pytest.mark.parametrize("shape", [(0,), (2, 0, 3), (0, 0)])
def test_empty_tensors(name, shape, make_key):
    c = hvdcomp.get(name)
    key = make_key(world_size=2)
    x = torch.empty(shape)
    sent, got = wire_round_trip(c, x, key)
    assert got.shape == shape and got.numel == 0
    assert got.flags == 0
    assert [len(s) for s in got.sections] == [0]
    assert len(sent.to_bytes()) == 48 + 8 * len(shape) + 8 + 0 + 4
    acc = torch.zeros(0)
    assert c.decode(got, key, acc) is True
    assert acc.numel() == 0


@pytest.mark.parametrize("name,expected", [("none", 1.25), ("fp16", 0.625), ("bf16", 1.25)])
def test_zero_dim_tensor(name, expected, make_key):
    # 1.25 is exact everywhere; fp16 sends 1.25 / 2 = 0.625 (exact) for world size 2.
    c = hvdcomp.get(name)
    key = make_key(world_size=2)
    x = torch.tensor(1.25)
    _, got = wire_round_trip(c, x, key)
    assert got.shape == () and got.numel == 1
    assert len(got.sections[0]) == (4 if name == "none" else 2)
    acc = torch.zeros(1)
    assert c.decode(got, key, acc) is True
    assert acc.tolist() == [expected]


@pytest.mark.parametrize("name", ["fp16", "bf16"])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.uint8, torch.bool])
def test_cast_of_integer_tensor_raises_type_error(name, dtype):
    x = torch.ones(4, dtype=dtype)
    with pytest.raises(TypeError, match=name):
        hvdcomp.get(name).encode(x, hvdcomp.TensorKey("w", 0, 0, 0, 1, 0))


# --- NaN / Inf -------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["none", "fp16", "bf16"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nonfinite_message(name, bad, rng, make_key):
    c = hvdcomp.get(name)
    key = make_key(rank=1, world_size=2, tensor_id=9, step=40, seed=3)
    x = torch.ones(2, 5)
    x[1, 3] = bad
    sent, got = wire_round_trip(c, x, key)
    for m in (sent, got):
        assert m.flags & FLAG_NONFINITE and m.flags == 1
        assert len(m.sections) == 0
        assert m.shape == (2, 5)
        assert (m.tensor_id, m.step, m.rank, m.seed) == (9, 40, 1, 3)
    # header (48) + shape (16) + no section lengths + CRC (4)
    assert len(sent.to_bytes()) == 48 + 16 + 4
    acc0 = rng.standard_normal(10).astype(np.float32)
    acc = torch.from_numpy(acc0.copy())
    assert c.decode(got, key, acc) is False
    assert np.array_equal(acc.numpy(), acc0)


def test_nonfinite_still_validates_header(make_key):
    c = hvdcomp.get("fp16")
    key = make_key(tensor_id=9)
    x = torch.tensor([float("nan"), 1.0])
    got = wire_round_trip(c, x, key)[1]
    with pytest.raises(WireFormatError, match="tensor id"):
        c.decode(got, make_key(tensor_id=8), torch.zeros(2))
    with pytest.raises(WireFormatError, match="numel"):
        c.decode(got, key, torch.zeros(3))


# --- decode validation -------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["none", "fp16", "bf16"])
def test_decode_rejects_mismatches(name, make_key):
    c = hvdcomp.get(name)
    key = make_key(rank=1, world_size=2, step=5, tensor_id=2)
    got = wire_round_trip(c, torch.arange(6.0), key)[1]
    acc = torch.zeros(6)
    for bad_key, field in [(make_key(rank=0, world_size=2, step=5, tensor_id=2), "rank"),
                           (make_key(rank=1, world_size=2, step=6, tensor_id=2), "step"),
                           (make_key(rank=1, world_size=2, step=5, tensor_id=3), "tensor id")]:
        with pytest.raises(WireFormatError, match=field):
            c.decode(got, bad_key, acc)
    with pytest.raises(WireFormatError, match="numel"):
        c.decode(got, key, torch.zeros(5))
    # (a cast also decodes `none` messages: its range fallback, test_*_keeps_the_range)
    other = {"none": "qsgd", "fp16": "none", "bf16": "fp16"}[name]
    with pytest.raises(WireFormatError, match="codec"):
        hvdcomp.get(other).decode(got, key, acc)
    assert torch.equal(acc, torch.zeros(6))


@pytest.mark.parametrize("name,itemsize", [("none", 4), ("fp16", 2), ("bf16", 2)])
def test_decode_rejects_wrong_section_size(name, itemsize, make_key):
    c = hvdcomp.get(name)
    key = make_key()
    codec = {"none": 1, "fp16": 2, "bf16": 3}[name]
    for nbytes in (itemsize * 3 - 1, itemsize * 3 + itemsize, 0):
        msg = Message(codec=codec, dtype=1, shape=(3,), sections=(bytes(nbytes),),
                      tensor_id=key.tensor_id, step=key.step, rank=key.rank, seed=key.seed)
        with pytest.raises(WireFormatError, match="section 0"):
            c.decode(Message.from_bytes(msg.to_bytes()), key, torch.zeros(3))
    two = Message(codec=codec, dtype=1, shape=(3,), sections=(bytes(3 * itemsize), b""),
                  tensor_id=key.tensor_id, step=key.step, rank=key.rank, seed=key.seed)
    with pytest.raises(WireFormatError, match="sections"):
        c.decode(Message.from_bytes(two.to_bytes()), key, torch.zeros(3))


# --- Horovod's compress / decompress contract --------------------------------------------------

def test_none_compress_is_identity():
    c = hvdcomp.get("none")
    t = torch.randn(3, 4)
    out, ctx = c.compress(t)
    assert out is t and ctx is None
    assert c.decompress(out, ctx) is t


def test_fp16_compress_decompress_outside_horovod():
    # without an initialized Horovod the world size is 1: plain half cast and back
    c = hvdcomp.get("fp16")
    x = spread_values(np.random.default_rng(5), 30)
    t = torch.from_numpy(x)
    y, ctx = c.compress(t)
    assert y.dtype == torch.float16
    assert np.array_equal(y.numpy(), x.astype(np.float16))
    back = c.decompress(y, ctx)
    assert back.dtype == torch.float32
    assert np.array_equal(back.numpy(), x.astype(np.float16).astype(np.float32))
    ints = torch.arange(4)
    y, ctx = c.compress(ints)
    assert y is ints and ctx is None and c.decompress(y, ctx) is ints


def test_fp16_compress_keeps_the_range_of_a_bf16_gradient():
    """#24 item 6: Horovod's contract on a bf16 gradient beyond fp16's range: compress gives
    float32 (the same choice on every rank: it depends on the dtype alone), decompress the
    bf16 values back, exactly, none of them Inf."""
    c = hvdcomp.get("fp16")
    g = _beyond_fp16(np.random.default_rng(8))
    assert g.float().abs().max() > 65504
    y, ctx = c.compress(g)
    assert y.dtype == torch.float32 and c.contract_dtype(torch.bfloat16) == torch.float32
    exact = bf16_bits_to_f32(g.view(torch.int16).numpy().view(np.uint16))
    assert np.array_equal(y.numpy(), exact)
    back = c.decompress(y, ctx)
    assert back.dtype == torch.bfloat16 and torch.isfinite(back).all()
    assert np.array_equal(back.float().numpy(), exact)
    # float32 and float16 gradients still travel as fp16 (2 bytes per element)
    assert c.compress(torch.ones(3))[0].dtype == torch.float16
    assert c.compress(torch.ones(3, dtype=torch.float16))[0].dtype == torch.float16


def test_fp16_compress_of_bf16_averages_over_ranks(monkeypatch):
    """Horovod's optimizer on 3 ranks, simulated: compress on each (divided by the world
    size: Horovod's size is 3), the allreduce's average of the compressed tensors (float32),
    decompress: the mean of the bf16 gradients to within bf16's rounding, finite."""
    from hvdcomp.compressors import cast
    monkeypatch.setattr(cast, "_horovod_size", lambda: 3)
    c = hvdcomp.get("fp16")
    rng = np.random.default_rng(9)
    grads = [_beyond_fp16(rng) for _ in range(3)]
    sent = [c.compress(g) for g in grads]
    assert all(y.dtype == torch.float32 for y, _ in sent)
    reduced = sum(y for y, _ in sent) / 3                  # hvd.allreduce, op=Average
    out = c.decompress(reduced, sent[0][1])
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    mean = np.mean(np.stack([g.double().numpy() for g in grads]), axis=0)
    scale = np.max(np.abs(np.stack([g.double().numpy() for g in grads])), axis=0)
    # float32 arithmetic (a few ulps of the largest share), then one bf16 rounding (8
    # significant bits: a relative error of at most 2**-8)
    tol = np.abs(mean) * 2.0 ** -8 + scale * 2.0 ** -20
    assert np.all(np.abs(out.double().numpy() - mean) <= tol)


@pytest.mark.parametrize("spec", ["alq", "amq", "qsgd", "qsgdinf", "nuqsgd"])
def test_packed_compressors_refuse_horovod_compress(spec):
    c = hvdcomp.get(spec)
    with pytest.raises(TypeError, match=r"hvdcomp\.torch\.DistributedOptimizer") as ei:
        c.compress(torch.randn(8))
    assert c.spec() in str(ei.value)
    with pytest.raises(TypeError):
        c.decompress(torch.randn(8), None)
