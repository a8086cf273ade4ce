"""rANS entropy coding: hand-worked bytes, exact round trips, size against the empirical
entropy, and rejection of malformed sections."""
import struct
import time

import numpy as np
import pytest
import torch

import hvdcomp
from hvdcomp.ops import rans as rans_ops
from hvdcomp.ops.rans import PRECISION, decode_symbols, encode_symbols, quantize_frequencies
from hvdcomp.errors import WireFormatError


def entropy_bits(sym, A):
    # independent of the module: plain definition n * H
    c = np.bincount(sym, minlength=A).astype(float)
    p = c[c > 0] / c.sum()
    return -(c[c > 0] * np.log2(p)).sum()


def test_hand_worked_two_symbols():
    # counts [1, 1] -> frequencies [2**14, 2**14]. Encoder state starts at 2**16 and codes in
    # reverse: symbol 1 (f = c = 16384): x = (65536 // 16384) << 15 | 0, + 16384 = 147456;
    # symbol 0: x = (147456 // 16384) << 15 + 147456 % 16384 + 0 = 9 * 32768 = 294912
    # = 0x00048000. No renormalization happened, so the chunk is the 4-byte state alone.
    got = encode_symbols(np.array([0, 1]), 2).tobytes()
    want = (struct.pack("<BBHIQ", 15, 0, 2, 2, 2) + struct.pack("<2H", 16384, 16384)
            + struct.pack("<I", 4) + struct.pack("<I", 294912))
    assert got == want
    assert decode_symbols(np.frombuffer(want, np.uint8), 2, 2).tolist() == [0, 1]


@pytest.mark.parametrize("n", [0, 1, 2, 7, 4095, 4096, 4097, 20000])
@pytest.mark.parametrize("A", [2, 8, 16, 256])
def test_round_trip(n, A):
    rng = np.random.default_rng(n * 31 + A)
    p = rng.dirichlet(np.full(A, 0.3))
    sym = rng.choice(A, n, p=p)
    assert np.array_equal(decode_symbols(encode_symbols(sym, A), n, A), sym)


@pytest.mark.parametrize("chunk", [1, 3, 64, 1000])
def test_round_trip_small_chunks(chunk):
    rng = np.random.default_rng(chunk)
    sym = rng.integers(0, 5, 3001)
    sec = encode_symbols(sym, 8, chunk_size=chunk)
    assert struct.unpack_from("<I", sec, 4)[0] == chunk
    assert np.array_equal(decode_symbols(sec, 3001, 8), sym)


def test_single_symbol_costs_only_state():
    sec = encode_symbols(np.full(10000, 3), 8)
    # f = 2**15 for the only symbol: coding it leaves the state unchanged, so each chunk is
    # its 4-byte length plus its 4-byte state: header 16 + model 16 + 8 per chunk
    K = -(-10000 // struct.unpack_from("<I", sec, 4)[0])
    assert len(sec) == 16 + 16 + 8 * K
    assert np.array_equal(decode_symbols(sec, 10000, 8), np.full(10000, 3))


def test_frequencies_sum_and_keep_rare_symbols():
    f = quantize_frequencies(np.array([10**9, 1, 0, 5]))
    assert f.sum() == 1 << PRECISION and f[1] >= 1 and f[2] == 0 and f[3] >= 1


def test_size_within_two_percent_of_entropy_on_real_gradient():
    from mnist import FC300100, load_digits
    x, y, _, _ = load_digits(0)
    torch.manual_seed(0)
    m = FC300100()
    torch.nn.functional.cross_entropy(m(x[:64]), y[:64]).backward()
    g = m[0].weight.grad
    c = hvdcomp.get("alq:bits=3")
    from hvdcomp.ops.level_stats import bucket_stats
    c.adopt(hvdcomp.levels.fit_alq(bucket_stats.reference(g, 8192).numpy(), 3))
    key = hvdcomp.TensorKey("w", 0, 0, 0, 4, 0)
    from hvdcomp.ops.quantize import quantize_reference
    from hvdcomp.philox import uniform
    u = uniform(g.numel(), seed=0, step=0, rank=0, tensor_id=0)
    _, codes = quantize_reference(g.reshape(-1), c.levels, 8192, "l2", u)
    sym = codes.numpy()
    sec = encode_symbols(sym, 8)
    n = sym.size
    K = -(-n // struct.unpack_from("<I", sec, 4)[0])
    fixed = 16 + 2 * 8 + 10 * K          # header, model, per chunk: length + state + flush
    assert len(sec) <= entropy_bits(sym, 8) / 8 * 1.02 + fixed
    assert len(sec) >= entropy_bits(sym, 8) / 8      # no code beats the entropy


def test_quantizer_entropy_stage_decodes_the_same_values():
    x = torch.randn(37, 300)
    key = hvdcomp.TensorKey("w", 1, 3, 2, 4, 9)
    for spec in ("alq:bits=3", "qsgd:bits=5,bucket_size=100", "qsgdinf:bits=2"):
        plain = hvdcomp.get(spec)
        ent = hvdcomp.get(spec + (",entropy=1" if ":" in spec else ":entropy=1"))
        a, b = torch.zeros(x.numel()), torch.zeros(x.numel())
        plain.decode(hvdcomp.Message.from_bytes(plain.encode(x, key).to_bytes()), key, a)
        m = hvdcomp.Message.from_bytes(ent.encode(x, key).to_bytes())
        assert m.flags & hvdcomp.wire.FLAG_ENTROPY
        ent.decode(m, key, b)
        assert torch.equal(a, b)


def _section():
    rng = np.random.default_rng(5)
    return encode_symbols(rng.choice(4, 9000, p=[0.7, 0.2, 0.05, 0.05]), 4, chunk_size=2000)


def test_truncations_rejected():
    sec = _section()
    for cut in range(0, len(sec), 97):
        with pytest.raises(WireFormatError):
            decode_symbols(sec[:cut], 9000, 4)


@pytest.mark.parametrize("what,offset,value", [
    ("precision", 0, 14), ("reserved", 1, 1), ("alphabet", 2, 5), ("count", 8, 8999),
])
def test_header_fields_rejected(what, offset, value):
    sec = bytearray(_section().tobytes())
    if what in ("precision", "reserved"):
        sec[offset] = value
    elif what == "alphabet":
        struct.pack_into("<H", sec, offset, value)
    else:
        struct.pack_into("<Q", sec, offset, value)
    with pytest.raises(WireFormatError):
        decode_symbols(np.frombuffer(bytes(sec), np.uint8), 9000, 4)


def test_model_not_summing_rejected():
    sec = bytearray(_section().tobytes())
    f0 = struct.unpack_from("<H", sec, 16)[0]
    struct.pack_into("<H", sec, 16, f0 + 1)
    with pytest.raises(WireFormatError, match="model"):
        decode_symbols(np.frombuffer(bytes(sec), np.uint8), 9000, 4)


def test_chunk_table_and_stream_corruption_rejected():
    sec = bytearray(_section().tobytes())
    table = 16 + 8
    struct.pack_into("<I", sec, table, struct.unpack_from("<I", sec, table)[0] + 2)
    with pytest.raises(WireFormatError):
        decode_symbols(np.frombuffer(bytes(sec), np.uint8), 9000, 4)
    sec = bytearray(_section().tobytes())
    start = table + 4 * 5
    struct.pack_into("<I", sec, start, 5)               # initial state below 2**16
    with pytest.raises(WireFormatError, match="state"):
        decode_symbols(np.frombuffer(bytes(sec), np.uint8), 9000, 4)
    sec = bytearray(_section().tobytes())
    sec += b"\0\0"                                      # extra bytes after the last chunk
    with pytest.raises(WireFormatError):
        decode_symbols(np.frombuffer(bytes(sec), np.uint8), 9000, 4)


def test_symbols_outside_alphabet_raise():
    with pytest.raises(ValueError):
        encode_symbols(np.array([0, 8]), 8)


@pytest.mark.parametrize("spec", ["terngrad", "psq:bits=3", "bhq:bits=4,block_size=4",
                                  "dqsg:bits=4", "amq:bits=5", "signef"])
def test_every_quantizer_has_the_entropy_stage(spec):
    """The same values decode with and without entropy coding, and the coded message is
    no larger than the packed one by more than the model and chunk table."""
    x = torch.randn(40, 250)
    key = hvdcomp.TensorKey("w", 2, 1, 0, 4, 5)
    plain = hvdcomp.get(spec)
    ent = hvdcomp.get(spec + (",entropy=1" if ":" in spec else ":entropy=1"))
    a, b = torch.zeros(x.numel()), torch.zeros(x.numel())
    mp = plain.encode(x, key).to_bytes()
    me = ent.encode(x, key).to_bytes()
    plain.decode(hvdcomp.Message.from_bytes(mp), key, a)
    m = hvdcomp.Message.from_bytes(me)
    assert m.flags & hvdcomp.wire.FLAG_ENTROPY
    ent.decode(m, key, b)
    assert torch.equal(a, b)
    assert len(me) <= len(mp) + 16 + 2 * 256 + 10 * 4


@pytest.mark.parametrize("chunk", [2**24, 2**31, 2**32 - 1])
def test_raised_chunk_size_is_bounded(chunk):
    """Issue #15: raising the chunk-size field of a one-chunk section made the reference
    iterate C times (minutes at 2**24) over a K x C array (16-32 GiB at 2**31).  The decode
    works on min(C, n) symbols per chunk: the same symbols (the stream is still valid),
    quickly, on the reference and on the default backend."""
    rng = np.random.default_rng(3)
    sym = rng.choice(4, 3000, p=[0.7, 0.2, 0.05, 0.05])
    sec = bytearray(encode_symbols(sym, 4).tobytes())
    assert struct.unpack_from("<I", sec, 4)[0] == 3000              # one chunk
    struct.pack_into("<I", sec, 4, chunk)
    buf = np.frombuffer(bytes(sec), np.uint8)
    for decode in (rans_ops.decode_symbols.reference, decode_symbols):
        t0 = time.process_time()
        assert np.array_equal(decode(buf, 3000, 4), sym)
        assert time.process_time() - t0 < 1.0


def test_chunk_with_more_words_than_symbols_rejected():
    """A chunk reads at most one word per symbol: a chunk table that claims more is
    rejected before anything is allocated for it."""
    sec = bytearray(_section().tobytes())               # 9000 symbols, chunks of 2000
    struct.pack_into("<I", sec, 4, 1)                   # 9000 chunks of one symbol
    table = 16 + 8
    body = bytes(sec[:table]) + struct.pack("<I", 8) * 9000 + b"\0" * 8 * 9000
    with pytest.raises(WireFormatError, match="more words than symbols"):
        decode_symbols(np.frombuffer(body, np.uint8), 9000, 4)
