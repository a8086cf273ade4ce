"""hvdcomp.codecs.sparse_vectors: Golomb-Rice coded index gaps and fp32/fp16 values.

Expected bytes are worked by hand, or built by a pure-Python reference written here from the
layout in the module docstring (one Python integer per bit stream), not taken from hvdcomp:

    byte 0: Rice parameter k | count m (u32 if numel < 2**32 else u64) |
    unary stream: per gap d_j = i_j - i_{j-1} - 1 (d_0 = i_0): q_j = d_j >> k one-bits, then a
    zero bit; LSB-first, zero padded | remainders d_j & (2**k - 1), k bits each, LSB-first.
    k: Kiely's k0 = max(0, 1 + floor(log2(ln(phi-1) / ln(mu/(mu+1))))), mu = mean gap, then
    the best of k0-1, k0, k0+1 by bits m(k+1) + sum(d >> k), the smaller on a tie.

The size test trains the main job's FC-300-100 a few steps on the real MNIST digits and
measures whole wire messages (header, CRC and both sections) of its first layer's gradient.
"""
import math
import struct
import zlib

import numpy as np
import pytest
import torch

import hvdcomp
from hvdcomp import WireFormatError
from hvdcomp.codecs.sparse_vectors import (decode_indices, decode_values, encode_indices,
                                           encode_values)
from hvdcomp.ops.rice import count_width, kiely_parameter, pack_uint, rice_parameter, unpack_uint
from hvdcomp.wire import Message

TOPK = 22                        # hvdcomp.wire.CODECS["topk"], fixed by the wire format
PHI = (1 + 5 ** 0.5) / 2


# --------------------------------------------------------------------------------------------
# pure-Python reference of the index section
# --------------------------------------------------------------------------------------------

def ref_gaps(idx):
    out, prev = [], -1
    for i in idx:
        out.append(i - prev - 1)
        prev = i
    return out


def ref_k(gaps):
    """Kiely's rule plus the +-1 window, straight from the docstring."""
    if not gaps:
        return 0
    mu = sum(gaps) / len(gaps)
    if mu == 0:
        k0 = 0
    else:
        # ln(mu / (mu + 1)) = log1p(-1 / (mu + 1)): still nonzero for mu beyond 2**53
        k0 = max(0, 1 + math.floor(math.log2(math.log(PHI - 1) / math.log1p(-1 / (mu + 1)))))
        k0 = min(k0, 62)
    best = None
    for k in (k0 - 1, k0, k0 + 1):
        if 0 <= k <= 62:
            bits = len(gaps) * (k + 1) + sum(d >> k for d in gaps)
            if best is None or bits < best[1]:
                best = (k, bits)
    return best[0]


def ref_section(idx, numel, k=None):
    idx = [int(i) for i in idx]
    gaps = ref_gaps(idx)
    if k is None:
        k = ref_k(gaps)
    return ref_from_gaps(gaps, numel, k if idx else 0)


def ref_from_gaps(gaps, numel, k):
    """The section for these gaps and this k (also for gaps no valid index set has)."""
    head = bytes([k]) + len(gaps).to_bytes(4 if numel < 2**32 else 8, "little")
    unary, pos = 0, 0
    for d in gaps:
        q = d >> k
        unary |= ((1 << q) - 1) << pos          # q one-bits, then the zero terminator
        pos += q + 1
    ubytes = unary.to_bytes((pos + 7) // 8, "little")
    rem = 0
    for j, d in enumerate(gaps):
        rem |= (d & ((1 << k) - 1)) << (j * k)
    rbytes = rem.to_bytes((len(gaps) * k + 7) // 8, "little")
    return head + ubytes + rbytes


def sec_bytes(a):
    return bytes(np.asarray(a, dtype=np.uint8))


# --------------------------------------------------------------------------------------------
# golden bytes, worked by hand
# --------------------------------------------------------------------------------------------

def test_golden_index_section():
    # indices 1, 4, 5, 13 of 16: gaps d = 1, 4-1-1 = 2, 0, 13-5-1 = 7; mean 10/4 = 2.5.
    # Kiely: ln(0.618) / ln(2.5/3.5) = -0.4812 / -0.3365 = 1.430, log2 = 0.516 -> k0 = 1.
    # bits: k=0: 4 + 10 = 14; k=1: 4*2 + (0+1+0+3) = 12; k=2: 4*3 + (0+0+0+1) = 13 -> k = 1.
    # unary (q = 0, 1, 0, 3): bits 0 | 1 0 | 0 | 1 1 1 0 = stream positions 0..7:
    #   0,1,0,0,1,1,1,0 -> byte = 2 + 16 + 32 + 64 = 114 = 0x72
    # remainders (d & 1 = 1, 0, 0, 1), 1 bit each: 1 + 8 = 9
    sec = encode_indices(np.array([1, 4, 5, 13]), 16)
    assert sec.dtype == np.uint8
    assert sec_bytes(sec) == b"\x01" + b"\x04\x00\x00\x00" + b"\x72" + b"\x09"
    assert decode_indices(sec, 16).tolist() == [1, 4, 5, 13]
    assert kiely_parameter(2.5) == 1


def test_golden_k0_and_empty():
    # indices 0, 2 of 8: gaps 0, 1; mean 0.5 -> Kiely: ln(.618)/ln(1/3) = 0.438 -> k0 = 0;
    # bits k=0: 2 + 1 = 3; k=1: 4 + 0 = 4 -> k = 0.  unary: "0" "10" -> bits 0,1,0 -> 0b010 = 2
    sec = encode_indices([0, 2], 8)
    assert sec_bytes(sec) == b"\x00\x02\x00\x00\x00\x02"
    assert decode_indices(sec, 8).tolist() == [0, 2]
    # nothing selected: k = 0 and the count alone
    assert sec_bytes(encode_indices([], 8)) == b"\x00" + b"\x00" * 4
    assert decode_indices(b"\x00" * 5, 8).tolist() == []


def test_golden_values():
    sec, dec = encode_values(torch.tensor([0.5, -1.0, 2.0]), 32)
    assert sec_bytes(sec) == struct.pack("<3f", 0.5, -1.0, 2.0)
    assert torch.equal(dec, torch.tensor([0.5, -1.0, 2.0]))
    # fp16: 1/3 rounds to 0x3555; 1e5 is clamped to 65504 = 0x7bff; -0.0 stays 0x8000
    sec, dec = encode_values(torch.tensor([1 / 3, 1e5, -0.0]), 16)
    assert sec_bytes(sec) == bytes.fromhex("5535" "ff7b" "0080")
    assert dec.tolist() == [float(np.float16(1 / 3)), 65504.0, -0.0]
    assert decode_values(sec, 3, 16).tolist() == dec.tolist()


def test_golden_topk_message():
    # top-2 of [0, 3, 0, -2, .5, 0, 0, 0] (density 0.25 of 8): indices 1, 3; values 3, -2.
    # index section: gaps 1, 1 (mean 1: Kiely ln(.618)/ln(.5) = 0.694 -> k0 = 0; bits k=0:
    # 2 + 2 = 4, k=1: 4 + 0 = 4 -> tie -> k = 0): unary "10" "10" = bits 0..3 1,0,1,0 -> 5.
    c = hvdcomp.get("topk:density=0.25")
    key = hvdcomp.TensorKey("w", tensor_id=3, step=9, rank=1, world_size=2, seed=77)
    got = c.encode(torch.tensor([0, 3, 0, -2, .5, 0, 0, 0]), key).to_bytes()
    isec = b"\x00" + b"\x02\x00\x00\x00" + b"\x05"
    vsec = struct.pack("<2f", 3.0, -2.0)
    body = (b"HVDC" + bytes([1, TOPK, 1, 0, 32, 1, 2, 0])
            + struct.pack("<5I", 0, 0, 3, 1, 77) + struct.pack("<2Q", 9, 8)
            + struct.pack("<Q", 8) + struct.pack("<2Q", len(isec), len(vsec)) + isec + vsec)
    assert got == body + struct.pack("<I", zlib.crc32(body))
    out = torch.zeros(8)
    c2 = hvdcomp.get("topk:density=0.25")           # a receiver holds no sender state
    assert c2.decode(Message.from_bytes(got), key, out)
    assert out.tolist() == [0, 3, 0, -2, 0, 0, 0, 0]


# --------------------------------------------------------------------------------------------
# round trips against the reference
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("numel", [1, 2, 7, 8, 9, 63, 64, 65, 1000, 12345, 10**6])
@pytest.mark.parametrize("density", [1e-4, 1e-3, 1e-2, 0.1, 0.5, 1.0])
def test_round_trip_sizes_and_densities(numel, density, rng):
    m = min(numel, max(1, int(round(density * numel))))
    idx = np.sort(rng.choice(numel, size=m, replace=False))
    sec = encode_indices(idx, numel)
    assert np.array_equal(decode_indices(sec, numel), idx)
    if m <= 20000:
        assert sec_bytes(sec) == ref_section(idx.tolist(), numel)


@pytest.mark.parametrize("k", list(range(0, 63)))
def test_every_rice_parameter(k, rng):
    # forced k: exercises pack_uint's 64-bit word path (k <= 56) and its bit-array path
    # (57..62); numel large enough that gaps of about 2**k occur
    numel = 2**62 if k >= 40 else max(64, 1 << (k + 4))
    idx = np.unique(rng.integers(0, numel, size=40, dtype=np.int64))
    sec = encode_indices(idx, numel, k=k)
    assert sec[0] == k
    assert sec_bytes(sec) == ref_section(idx.tolist(), numel, k)
    assert np.array_equal(decode_indices(sec, numel), idx)


@pytest.mark.parametrize("bits", [1, 3, 8, 9, 13, 24, 31, 33, 48, 56, 57, 61, 63])
def test_pack_uint_matches_one_big_integer(bits, rng):
    for n in (0, 1, 7, 8, 9, 100):
        codes = rng.integers(0, 2**min(bits, 62), size=n, dtype=np.int64)
        if bits == 63 and n:
            codes[0] = 2**63 - 1
        packed = pack_uint(codes, bits)
        acc = 0
        for j, c in enumerate(codes.tolist()):
            acc |= c << (j * bits)
        assert sec_bytes(packed) == acc.to_bytes((n * bits + 7) // 8, "little")
        assert unpack_uint(packed, n, bits).tolist() == codes.tolist()


def test_rice_parameter_is_near_optimal(rng):
    # For random sparse index sets the chosen k costs no more than the best of all 63.
    for numel, m in [(10**6, 1000), (10**6, 10**4), (235200, 236), (2**40, 5000), (5000, 4000)]:
        idx = np.unique(rng.integers(0, numel, size=m, dtype=np.int64))
        gaps = np.array(ref_gaps(idx.tolist()), dtype=np.int64)
        k = rice_parameter(gaps)
        cost = [len(gaps) * (j + 1) + int(np.sum(gaps >> j)) for j in range(63)]
        assert cost[k] == min(cost), (numel, m, k, int(np.argmin(cost)))
    # Kiely's rule by hand: mu = 1000: ln(.618)/ln(1000/1001) = 481.4, log2 8.91 -> 1 + 8 = 9
    assert kiely_parameter(1000.0) == 9
    assert kiely_parameter(0.0) == 0 and kiely_parameter(2.0**70) == 62


# --------------------------------------------------------------------------------------------
# large tensors (indices beyond 2**31 and 2**32) without allocating them
# --------------------------------------------------------------------------------------------

def test_count_width_follows_tensor_size():
    assert count_width(2**32 - 1) == 4 and count_width(2**32) == 8
    assert len(encode_indices([5], 2**32 - 1)) > 5 and encode_indices([], 2**32 - 1).size == 5
    assert encode_indices([], 2**32).size == 9


@pytest.mark.parametrize("numel,idx", [
    (2**31 + 10, [0, 2**31 - 1, 2**31, 2**31 + 9]),
    (2**33, [3, 2**31 + 5, 2**32, 2**32 + 1, 2**33 - 1]),
    (2**40, [2**31 + 5, 2**35, 2**40 - 1]),
    (2**63 - 1, [0, 2**62, 2**63 - 3, 2**63 - 2]),
])
def test_large_index_values(numel, idx):
    sec = encode_indices(np.array(idx, dtype=np.int64), numel)
    assert sec_bytes(sec) == ref_section(idx, numel)
    assert sec_bytes(sec)[1:1 + count_width(numel)] == len(idx).to_bytes(count_width(numel),
                                                                         "little")
    got = decode_indices(sec, numel)
    assert got.dtype == np.int64 and got.tolist() == idx


def test_many_large_indices(rng):
    numel = 3 * 2**31 + 7            # a 6.4e9-element tensor, 0.01 % of it selected
    idx = np.unique(rng.integers(0, numel, size=640_000, dtype=np.int64))
    sec = encode_indices(idx, numel)
    assert np.array_equal(decode_indices(sec, numel), idx)
    # log2(numel / m) + ~1.5 bits per index: well under the 64 of raw int64 indices
    assert 8 * len(sec) / idx.size < 16


# --------------------------------------------------------------------------------------------
# size on a real gradient
# --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def fc_grad():
    """float32 (300, 784): gradient of FC300100[0].weight on the 6th mini-batch of 64 real
    MNIST digits after 5 SGD steps (lr 0.1; model seed 0, data split seed 0, batch seed 1)."""
    from mnist import FC300100, load_digits
    x, y, _, _ = load_digits(seed=0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = FC300100()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1)
    for step in range(6):
        idx = torch.randint(0, len(x), (64,), generator=gen)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
        if step < 5:
            opt.step()
    return model[0].weight.grad.detach().clone()


@pytest.mark.parametrize("values", ["fp32", "fp16"])
def test_size_on_real_gradient(fc_grad, values, capsys):
    n = fc_grad.numel()
    assert n == 235200
    g = fc_grad.reshape(-1).numpy()
    rows = []
    for density in (0.01, 0.001, 0.0001):
        c = hvdcomp.get("topk", density=density, values=values)
        key = hvdcomp.TensorKey("0.weight", 0, 0, 0, 4, 0)
        buf = c.encode(fc_grad, key).to_bytes()
        k = math.ceil(round(density * n, 6))
        # independent expectation: the k largest |g| (ties by lower index), their gaps
        order = np.lexsort((np.arange(n), -np.abs(g)))[:k]
        sel = np.sort(order)
        gaps = np.array(ref_gaps(sel.tolist()), dtype=np.int64)
        kr = ref_k(gaps.tolist())
        isec = 1 + 4 + (k + int(np.sum(gaps >> kr)) + 7) // 8 + (k * kr + 7) // 8
        vb = 4 if values == "fp32" else 2
        header = 48 + 8 * 2 + 8 * 2 + 4
        assert len(buf) == header + isec + vb * k
        # and the message decodes to exactly those coordinates
        out = torch.zeros(n)
        c.decode(Message.from_bytes(buf), key, out)
        want = np.zeros(n, np.float32)
        want[sel] = g[sel] if values == "fp32" else g[sel].astype(np.float16).astype(np.float32)
        assert np.array_equal(out.numpy(), want)
        bpc = 8 * len(buf) / n
        rows.append((density, k, len(buf), bpc, 32 / bpc, 8 * (isec - 5) / k))
    with capsys.disabled():
        print(f"\n  FC-300-100 layer 0 (300x784) top-k, {values} values, whole messages:")
        for d, k, nb, bpc, ratio, ibits in rows:
            print(f"    density {d:7.4%}: k {k:5d}  {nb:6d} bytes  {bpc:.4f} bits/coord  "
                  f"ratio {ratio:7.1f}x  ({ibits:.2f} bits per index)")
    d01 = rows[1]
    # the target: at 0.1 % a message costs <= 32/600 bits per dense coordinate (>= 600x)
    assert d01[3] <= 32 / 600, d01
    # and fewer bytes than the paper's encoding (32-bit values + 16-bit run lengths, i.e.
    # 6 bytes per selected coordinate) would need for the same k
    assert d01[2] < header + 6 * d01[1]


# --------------------------------------------------------------------------------------------
# malformed sections and bad encoder input
# --------------------------------------------------------------------------------------------

GOOD = (np.array([3, 9, 10, 40, 41, 99], dtype=np.int64), 100)


def good_section():
    return bytearray(sec_bytes(encode_indices(*GOOD)))


def test_good_section_for_the_malformed_cases():
    b = good_section()
    assert decode_indices(bytes(b), 100).tolist() == GOOD[0].tolist()
    # gaps 3, 5, 0, 29, 0, 57: mean 94/6 = 15.67 -> Kiely ln(.618)/ln(.94) = 7.77 -> k0 = 3;
    # bits k=2: 18 + 22 = 40, k=3: 24 + 10 = 34, k=4: 30 + 4 = 34 -> tie -> k = 3
    assert b[0] == 3


@pytest.mark.parametrize("cut", [1, 2, 3, 5, 8])
def test_truncated_sections_raise(cut):
    b = good_section()
    with pytest.raises(WireFormatError):
        decode_indices(bytes(b[:-cut]) if cut < len(b) else b"", 100)


def test_malformed_sections_raise():
    b = good_section()
    cases = {
        "empty": b"",
        "short head": bytes(b[:3]),
        "k 63": bytes([63]) + bytes(b[1:]),
        "m > numel": bytes(b[:1]) + (101).to_bytes(4, "little") + bytes(b[5:]),
        "one more byte": bytes(b) + b"\x00",
        "m=0 with k": b"\x02" + b"\x00" * 4,
        "m=0 with data": b"\x00" * 5 + b"\x00",
        "count too big for stream": bytes(b[:1]) + (60).to_bytes(4, "little") + bytes(b[5:]),
    }
    for what, buf in cases.items():
        with pytest.raises(WireFormatError):
            decode_indices(buf, 100)
            pytest.fail(what)


def test_nonzero_padding_raises():
    # [1, 4, 5, 13]: unary byte 0x72 uses all 8 bits; remainders use 4 of 8 bits.
    b = bytearray(b"\x01\x04\x00\x00\x00\x72\x09")
    bad = bytearray(b)
    bad[-1] |= 0x80                          # a padding bit of the remainder stream
    with pytest.raises(WireFormatError, match="padding"):
        decode_indices(bytes(bad), 16)
    # [0, 2]: unary 0b010 uses 3 bits; setting bit 5 makes padding nonzero
    with pytest.raises(WireFormatError):
        decode_indices(b"\x00\x02\x00\x00\x00" + bytes([0b100010]), 8)
    # a unary stream with an extra all-zero byte after its last terminator
    with pytest.raises(WireFormatError):
        decode_indices(b"\x00\x02\x00\x00\x00\x02\x00", 8)


def test_indices_out_of_range_raise():
    sec = encode_indices([1, 4, 5, 13], 16)
    assert decode_indices(sec, 14).tolist() == [1, 4, 5, 13]
    with pytest.raises(WireFormatError, match="beyond"):
        decode_indices(sec, 13)                   # 13 is not < 13
    # a huge quotient with k = 62 cannot overflow into a small index
    evil = b"\x3e" + (2).to_bytes(8, "little") + bytes([0b11111110, 0]) + b"\x00" * 16
    with pytest.raises(WireFormatError):
        decode_indices(evil, 2**63 - 1)
    # the last index beyond numel (decoded against a smaller tensor)
    big = encode_indices([2**62, 2**63 - 2], 2**63 - 1)
    assert decode_indices(big, 2**63 - 1).tolist() == [2**62, 2**63 - 2]
    with pytest.raises(WireFormatError, match="beyond"):
        decode_indices(big, 2**62 + 1)
    # three gaps of 2**62, each in range, whose running sum wraps int64: caught, not
    # returned as negative indices
    wrap = ref_from_gaps([2**62] * 3, 2**63 - 1, 62)
    with pytest.raises(WireFormatError, match="beyond"):
        decode_indices(wrap, 2**63 - 1)


def test_encoder_rejects_bad_indices():
    for idx, numel in [([3, 3], 10), ([4, 2], 10), ([-1, 2], 10), ([2, 10], 10), ([0], 0)]:
        with pytest.raises(ValueError):
            encode_indices(np.array(idx), numel)
    with pytest.raises(ValueError):
        encode_indices([1], 10, k=63)


def test_bad_value_sections_raise():
    sec, _ = encode_values(torch.tensor([1.0, 2.0]), 32)
    with pytest.raises(WireFormatError):
        decode_values(sec, 3, 32)
    with pytest.raises(WireFormatError):
        decode_values(sec, 2, 16)
    with pytest.raises(WireFormatError, match="NaN"):
        decode_values(struct.pack("<2f", 1.0, math.nan), 2, 32)
    with pytest.raises(WireFormatError, match="NaN"):
        decode_values(bytes.fromhex("007c"), 1, 16)        # fp16 +Inf
    with pytest.raises(WireFormatError):
        decode_values(b"", 0, 12)


def test_golden_quantized_values():
    # int8, Q = 127, one block: scale 2; (v / 2) * 127 = 31.75, -63.5, 127 -> 32, -64 (ties
    # to even), 127; codes q + 127 = 159, 63, 254
    sec, dec = encode_values(torch.tensor([0.5, -1.0, 2.0]), 8)
    assert sec_bytes(sec) == struct.pack("<f", 2.0) + bytes([159, 63, 254])
    want = [float(np.float32(32 / 127) * 2), float(np.float32(-64 / 127) * 2), 2.0]
    assert dec.tolist() == want
    assert decode_values(sec, 3, 8).tolist() == want
    # int4, Q = 7: 1.75, -3.5, 7 -> 2, -4, 7; codes 9, 3, 14 packed low nibble first
    sec, dec = encode_values(torch.tensor([0.5, -1.0, 2.0]), 4)
    assert sec_bytes(sec) == struct.pack("<f", 2.0) + bytes([0x39, 0x0E])
    want = [float(np.float32(2 / 7) * 2), float(np.float32(-4 / 7) * 2), 2.0]
    assert dec.tolist() == want
    assert decode_values(sec, 3, 4).tolist() == want
    # nothing selected: an empty section
    assert sec_bytes(encode_values(torch.zeros(0), 4)[0]) == b""
    assert decode_values(b"", 0, 4).numel() == 0


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_values_blocks_and_error(bits):
    # 600 values: blocks of 256, 256 and 88, each its own scale (its largest magnitude);
    # every value within half a level (s / (2 Q)) of the original; a zero block decodes to 0
    torch.manual_seed(0)
    v = torch.randn(600) * torch.tensor([1.0] * 256 + [1e-3] * 256 + [0.0] * 88)
    Q = 2 ** (bits - 1) - 1
    sec, dec = encode_values(v, bits)
    assert len(sec_bytes(sec)) == 4 * 3 + (600 * bits) // 8
    scales = np.frombuffer(sec_bytes(sec)[:12], "<f4")
    assert scales.tolist() == [float(v[i:i + 256].abs().max()) for i in (0, 256, 512)]
    s = torch.tensor(scales).repeat_interleave(256)[:600]
    assert bool(((dec - v).abs() <= s / (2 * Q) * (1 + 1e-6)).all())
    assert torch.equal(dec[512:], torch.zeros(88))
    assert torch.equal(decode_values(sec, 600, bits), dec)
    # the reference: q = round((v / s) * Q), decoded (q / Q) * s, in float32
    q = torch.where(s > 0, torch.round((v / torch.where(s > 0, s, 1.0)) * Q), 0.0)
    assert torch.equal(dec, (q / Q) * s)


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_levels_are_true_divisions(bits):
    # every level q / Q is the correctly rounded float32 quotient (NumPy's), not a
    # multiplication by 1 / Q (which CUDA uses for a tensor divided by a number, and which
    # differs in the last bit for some q: a GPU sender's residual would then differ from
    # what the receivers decode)
    Q = 2 ** (bits - 1) - 1
    v = torch.tensor([float(q) for q in range(-Q, Q + 1)])
    sec, dec = encode_values(v, bits)                    # scale Q: codes q + Q, values q / Q * Q
    want = np.array([np.float32(q) / np.float32(Q) for q in range(-Q, Q + 1)],
                    np.float32) * np.float32(Q)
    assert np.array_equal(dec.numpy(), want)
    assert np.array_equal(decode_values(sec, v.numel(), bits).numpy(), want)


def test_bad_quantized_value_sections_raise():
    good = struct.pack("<f", 2.0) + bytes([159, 63, 254])
    assert decode_values(good, 3, 8).numel() == 3
    for bad, why in [(good[:-1], "bytes"),
                     (struct.pack("<f", -2.0) + good[4:], "scale"),
                     (struct.pack("<f", math.inf) + good[4:], "scale"),
                     (struct.pack("<f", math.nan) + good[4:], "scale"),
                     (good[:4] + bytes([159, 63, 255]), "code above 254")]:
        with pytest.raises(WireFormatError, match=why):
            decode_values(bad, 3, 8)
    # a -0 scale, and a block of scale 0 with a nonzero code: never sent by the encoder
    with pytest.raises(WireFormatError, match="scale"):
        decode_values(struct.pack("<f", -0.0) + bytes([127, 127, 127]), 3, 8)
    with pytest.raises(WireFormatError, match="scale 0"):
        decode_values(struct.pack("<f", 0.0) + bytes([127, 128, 127]), 3, 8)
    assert decode_values(struct.pack("<f", 0.0) + bytes([127] * 3), 3, 8).tolist() == [0.0] * 3
    good4 = struct.pack("<f", 2.0) + bytes([0x39, 0x0E])
    with pytest.raises(WireFormatError, match="padding"):
        decode_values(good4[:-1] + bytes([0x1E]), 3, 4)
    with pytest.raises(WireFormatError, match="code above 14"):
        decode_values(good4[:-1] + bytes([0x0F]), 3, 4)


def test_messages_with_inconsistent_sections_raise(make_key):
    c = hvdcomp.get("topk:density=0.5")
    key = make_key()
    msg = c.encode(torch.arange(1.0, 9.0), key)
    isec, vsec = msg.sections

    def rebuilt(**kw):
        fields = dict(codec=msg.codec, dtype=msg.dtype, shape=msg.shape, sections=(isec, vsec),
                      bits=32, tensor_id=key.tensor_id, rank=key.rank, seed=key.seed,
                      step=key.step)
        fields.update(kw)
        return Message.from_bytes(Message(**fields).to_bytes())

    out = torch.zeros(8)
    assert c.decode(rebuilt(), key, out) and out.tolist() == [0, 0, 0, 0, 5, 6, 7, 8]
    bad = [rebuilt(sections=(isec, bytes(vsec)[:-4])),             # 3 values for 4 indices
           rebuilt(sections=(isec, bytes(vsec) + b"\x00" * 4)),
           rebuilt(sections=(isec,)),
           rebuilt(bits=16),                                       # receiver expects fp32
           rebuilt(shape=(4,), sections=(isec, vsec))]             # indices beyond 4
    for m in bad:
        with pytest.raises(WireFormatError):
            c.decode(m, key, torch.zeros(m.numel))
