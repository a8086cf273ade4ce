"""kernels/rans.cu (the kernel implementations of hvdcomp.ops.rans) against the NumPy
specification encode_symbols.reference / decode_symbols.reference: sections identical
byte for byte, decoded symbols identical, malformed sections rejected with the same errors.
The public entry points (encode_symbols, decode_symbols, encode_codes, decode_codes) and the
quantizers' entropy path are checked against HVDCOMP_BACKEND=reference end to end.
GPU tests (requires_cuda) repeat the comparisons with the CUDA backend.
"""
import struct
import time

import numpy as np
import pytest
import torch

from hvdcomp.compressors.base import TensorKey
from hvdcomp.errors import WireFormatError
from hvdcomp.ops import rans
from hvdcomp.ops.bitpack import pack_bits

KEY = TensorKey(name="w", tensor_id=2, step=5, rank=1, world_size=2, seed=3)


def _symbols(n, alphabet, kind, seed):
    rng = np.random.default_rng(seed)
    if kind == "uniform":
        return rng.integers(0, alphabet, n)
    if kind == "one":                      # one distinct symbol (not necessarily 0)
        return np.full(n, alphabet - 1, dtype=np.int64)
    if kind == "skewed":                   # geometric-like, most mass on a few symbols
        return np.minimum(rng.geometric(0.6, n) - 1, alphabet - 1)
    if kind == "all":                      # every symbol present at least once
        s = rng.integers(0, alphabet, n)
        s[:min(n, alphabet)] = np.arange(min(n, alphabet))
        return s
    raise ValueError(kind)


def _bits_for(alphabet):
    return max(1, (alphabet - 1).bit_length())


def _kernel_encode(be, sym, alphabet, chunk_size=0, bits=None):
    bits = bits or _bits_for(alphabet)
    packed = pack_bits(torch.from_numpy(np.asarray(sym, dtype=np.int64)), bits)
    return rans.encode_codes.kernels(be, packed, len(sym), bits, alphabet, chunk_size).numpy()


CASES = [(n, a, kind) for n in (0, 1, 7, 255, 256, 4095, 4096, 4097, 9001)
         for a in (1, 2, 3, 8, 256) for kind in ("uniform", "one", "skewed", "all")
         if not (a == 1 and kind != "one")]


@pytest.mark.parametrize("n,alphabet,kind", CASES)
def test_encode_decode_match_reference(host, n, alphabet, kind):
    sym = _symbols(n, alphabet, kind, seed=n * 7 + alphabet)
    want = rans.encode_symbols.reference(sym, alphabet)
    got = _kernel_encode(host.backend, sym, alphabet)
    assert got.tobytes() == want.tobytes()
    bits = _bits_for(alphabet)
    dec = rans.decode_codes.kernels(host.backend, want, n, bits, alphabet)
    assert torch.equal(dec, pack_bits(torch.from_numpy(rans.decode_symbols.reference(
        want, n, alphabet)), bits))
    got = rans.decode_codes.kernels(host.backend, want, n, 8, alphabet)
    assert np.array_equal(got.numpy(), sym)


@pytest.mark.parametrize("chunk", [1, 7, 8, 256, 2000, 4096, 9001, 9010])
def test_chunk_boundaries(host, chunk):
    for n in (chunk - 1, chunk, chunk + 1, 3 * chunk + 5, 9001):
        if n < 0:
            continue
        sym = _symbols(n, 16, "skewed", seed=chunk + n)
        want = rans.encode_symbols.reference(sym, 16, chunk_size=chunk)
        assert _kernel_encode(host.backend, sym, 16, chunk).tobytes() == want.tobytes()
        got = rans.decode_codes.kernels(host.backend, want, n, 8, 16).numpy()
        assert np.array_equal(got, sym)


@pytest.mark.parametrize("bits", range(1, 9))
def test_every_packing_width(host, bits):
    for alphabet in {1 << bits, max(1, (1 << bits) - 1), (1 << (bits - 1)) + 1}:
        for n in (1, 9, 1001, 20_003):
            sym = _symbols(n, alphabet, "all", seed=bits * 100 + n)
            want = rans.encode_symbols.reference(sym, alphabet)
            got = _kernel_encode(host.backend, sym, alphabet, bits=bits)
            assert got.tobytes() == want.tobytes(), (bits, alphabet, n)
            packed = rans.decode_codes.kernels(host.backend, want, n, bits, alphabet)
            assert torch.equal(packed, pack_bits(torch.from_numpy(sym), bits))


def test_large_input_many_chunks(host):
    n = 2_000_003
    sym = _symbols(n, 8, "skewed", seed=3)
    for chunk in (0, 256):                  # ~1024 chunks; 7813 chunks
        want = rans.encode_symbols.reference(sym, 8, chunk_size=chunk)
        assert _kernel_encode(host.backend, sym, 8, chunk).tobytes() == want.tobytes()
        assert np.array_equal(rans.decode_codes.kernels(host.backend, want, n, 8, 8).numpy(), sym)


def test_alq_codes_of_a_gaussian_gradient(host):
    """The measured case, smaller: 3-bit codes from the quantize kernel, packed."""
    from hvdcomp import levels as L
    n = 1_000_003
    x = torch.randn(n, generator=torch.Generator().manual_seed(4))
    lv = torch.tensor(L.exponential_levels(3, 0.5), dtype=torch.float32)
    from hvdcomp.ops import quantize
    _, packed = quantize.quantize.kernels(host.backend, x, lv, 3, 8192, "l2", seed=1, rank=0,
                                          tensor_id=0, step=0)
    from hvdcomp.ops.bitpack import unpack_bits
    codes = unpack_bits(packed, n, 3)
    want = rans.encode_symbols.reference(codes.numpy(), 8)
    got = rans.encode_codes.kernels(host.backend, packed, n, 3, 8)
    assert got.numpy().tobytes() == want.tobytes()
    assert torch.equal(rans.decode_codes.kernels(host.backend, want, n, 3, 8), packed)


def test_histogram(host):
    for bits in range(1, 9):
        for n in (0, 1, 13, 70_001, 200_000):
            sym = _symbols(n, 1 << bits, "uniform", seed=n + bits)
            packed = pack_bits(torch.from_numpy(sym), bits)
            got = rans.histogram.kernels(host.backend, packed, n, bits)
            assert got.tolist() == np.bincount(sym, minlength=1 << bits).tolist()


def test_symbols_outside_alphabet_raise(host):
    for sym, alphabet in (([0, 8], 8), ([5, 1, 2], 5), ([255], 200)):
        with pytest.raises(ValueError) as ref:
            rans.encode_symbols.reference(np.array(sym), alphabet)
        with pytest.raises(ValueError) as got:
            _kernel_encode(host.backend, np.array(sym), alphabet, bits=8)
        assert str(got.value) == str(ref.value)
        with pytest.raises(ValueError):
            rans.encode_symbols(np.array(sym), alphabet)
        with pytest.raises(ValueError):
            rans.encode_symbols(torch.tensor(sym), alphabet)
    with pytest.raises(ValueError):
        rans.encode_symbols(np.array([-1, 0]), 4)


def _outcome(fn):
    try:
        return ("ok", fn().tolist())
    except WireFormatError as e:
        return ("error", str(e))


def _both(host, sec, n, alphabet):
    ref = _outcome(lambda: rans.decode_symbols.reference(sec, n, alphabet))
    got = _outcome(lambda: rans.decode_codes.kernels(host.backend, sec, n, 8, alphabet)
                   .to(torch.int64))
    assert got == ref
    return ref


def _section():
    return rans.encode_symbols.reference(_symbols(9000, 4, "skewed", 5), 4, chunk_size=2000)


def test_truncated_and_extended_sections(host):
    sec = _section()
    for cut in range(0, len(sec), 37):
        assert _both(host, sec[:cut], 9000, 4)[0] == "error"
    assert _both(host, np.concatenate([sec, np.zeros(2, np.uint8)]), 9000, 4)[0] == "error"


def test_corrupted_sections_same_errors(host):
    base = _section()
    rng = np.random.default_rng(9)
    kinds = set()
    for trial in range(300):
        sec = bytearray(base.tobytes())
        pos = int(rng.integers(0, len(sec)))
        sec[pos] ^= 1 << int(rng.integers(0, 8))
        kinds.add(_both(host, np.frombuffer(bytes(sec), np.uint8), 9000, 4)[1][:30])
    # a state below 2**16, words run out, a chunk not ending in its initial state
    table = 16 + 8
    for value in (5, 0xFFFFFFFF, 1 << 16):
        sec = bytearray(base.tobytes())
        struct.pack_into("<I", sec, table + 4 * 5, value)
        kinds.add(_both(host, np.frombuffer(bytes(sec), np.uint8), 9000, 4)[1][:30])
    sec = bytearray(base.tobytes())
    struct.pack_into("<I", sec, table, struct.unpack_from("<I", sec, table)[0] - 2)
    struct.pack_into("<I", sec, table + 4, struct.unpack_from("<I", sec, table + 4)[0] + 2)
    kinds.add(_both(host, np.frombuffer(bytes(sec), np.uint8), 9000, 4)[1][:30])
    assert len(kinds) >= 3                 # several distinct errors were exercised


def test_chunk_size_field_bounded_on_both_paths(host):
    """Issue #15: a raised chunk-size field (one chunk: the stream stays valid) decodes to
    the same symbols on both paths within a second, where the reference used to iterate C
    times over a K x C array; a chunk table claiming more words than symbols is the same
    WireFormatError on both paths."""
    sym = _symbols(3000, 4, "skewed", 5)
    base = rans.encode_symbols.reference(sym, 4)
    for chunk in (2**24, 2**31, 2**32 - 1):
        sec = bytearray(base.tobytes())
        struct.pack_into("<I", sec, 4, chunk)
        t0 = time.process_time()
        assert _both(host, np.frombuffer(bytes(sec), np.uint8), 3000, 4) == ("ok", sym.tolist())
        assert time.process_time() - t0 < 2.0
    sec = bytearray(_section().tobytes())
    struct.pack_into("<I", sec, 4, 1)                    # 9000 chunks of one symbol each
    body = bytes(sec[:24]) + struct.pack("<I", 8) * 9000 + b"\0" * 8 * 9000
    got = _both(host, np.frombuffer(body, np.uint8), 9000, 4)
    assert got[0] == "error" and "more words than symbols" in got[1]


def test_public_entry_points_equal_reference(host, monkeypatch):
    from hvdcomp import backends
    rng = np.random.default_rng(2)
    sym = np.minimum(rng.geometric(0.3, 50_001) - 1, 15)
    packed = pack_bits(torch.from_numpy(sym), 4)
    want = rans.encode_symbols.reference(sym, 16)
    for inp in (sym, sym.astype(np.uint8), sym.astype(np.int32), torch.from_numpy(sym),
                torch.from_numpy(sym).to(torch.uint8), torch.from_numpy(sym)[::1]):
        assert rans.encode_symbols(inp, 16).tobytes() == want.tobytes()
    assert rans.encode_codes(packed, sym.size, 4).numpy().tobytes() == want.tobytes()
    assert np.array_equal(rans.decode_symbols(want, sym.size, 16), sym)
    assert torch.equal(rans.decode_codes(want, sym.size, 4), packed)
    monkeypatch.setenv("HVDCOMP_BACKEND", "reference")
    backends._choice.clear()
    assert rans.encode_codes(packed, sym.size, 4).numpy().tobytes() == want.tobytes()
    assert torch.equal(rans.decode_codes(want, sym.size, 4), packed)
    assert rans.encode_symbols(torch.from_numpy(sym), 16).tobytes() == want.tobytes()
    backends._choice.clear()


@pytest.mark.parametrize("spec", ["alq", "qsgd:bits=4", "nuqsgd:bits=2", "psq:bits=3",
                                  "dqsg:bits=3", "signef"])
def test_compressors_entropy_same_bytes(host, monkeypatch, spec):
    import hvdcomp
    from hvdcomp import backends
    def fresh():        # stateful compressors (error feedback): one instance per run
        return hvdcomp.get(spec + (",entropy=1" if ":" in spec else ":entropy=1"))
    key = KEY
    for shape in ((1,), (7,), (3, 1001), (100_003,)):
        g = torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape)))
        backends._choice.clear()
        monkeypatch.setenv("HVDCOMP_BACKEND", "auto")
        comp = fresh()
        m_k = comp.encode(g, key).to_bytes()
        out_k = torch.zeros(g.numel())
        comp.decode(hvdcomp.Message.from_bytes(m_k), key, out_k)
        monkeypatch.setenv("HVDCOMP_BACKEND", "reference")
        backends._choice.clear()
        comp = fresh()
        m_r = comp.encode(g, key).to_bytes()
        out_r = torch.zeros(g.numel())
        comp.decode(hvdcomp.Message.from_bytes(m_r), key, out_r)
        assert m_k == m_r, (spec, shape)
        assert torch.equal(out_k, out_r), (spec, shape)
    backends._choice.clear()


# ---- GPU ---------------------------------------------------------------------------------------

@pytest.mark.requires_cuda
def test_gpu_matches_reference(cuda_backend):
    be = cuda_backend.backend
    for n, alphabet, kind in [(0, 4, "uniform"), (1, 2, "one"), (9001, 256, "all"),
                              (100_003, 8, "skewed"), (2_000_003, 8, "skewed")]:
        sym = _symbols(n, alphabet, kind, seed=n)
        bits = _bits_for(alphabet)
        for chunk in (0, 256):
            want = rans.encode_symbols.reference(sym, alphabet, chunk_size=chunk)
            packed = pack_bits(torch.from_numpy(sym), bits).cuda()
            got = rans.encode_codes.kernels(be, packed, n, bits, alphabet, chunk)
            assert got.is_cuda and got.cpu().numpy().tobytes() == want.tobytes()
            dec = rans.decode_codes.kernels(be, want, n, bits, alphabet, device="cuda")
            assert dec.is_cuda and torch.equal(dec.cpu(), packed.cpu())
    sec = _section()
    for cut in range(0, len(sec), 97):
        ref = _outcome(lambda: rans.decode_symbols.reference(sec[:cut], 9000, 4))
        got = _outcome(lambda: rans.decode_codes.kernels(be, sec[:cut], 9000, 8, 4, device="cuda")
                       .cpu().to(torch.int64))
        assert got == ref


@pytest.mark.requires_cuda
def test_gpu_quantizer_entropy_path(cuda_backend):
    import hvdcomp
    comp = hvdcomp.get("alq:entropy=1")
    key = KEY
    g = torch.randn(300_001, generator=torch.Generator().manual_seed(1))
    m_gpu = comp.encode(g.cuda(), key).to_bytes()
    m_cpu = comp.encode(g, key).to_bytes()
    assert m_gpu == m_cpu
    out = torch.zeros(g.numel(), device="cuda")
    comp.decode(hvdcomp.Message.from_bytes(m_gpu), key, out)
    ref = torch.zeros(g.numel())
    comp.decode(hvdcomp.Message.from_bytes(m_cpu), key, ref)
    assert torch.equal(out.cpu(), ref)
