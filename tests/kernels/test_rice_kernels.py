"""kernels/rice.cu (hvdcomp/ops/rice.py's kernel implementations) against the NumPy
specification hvdcomp.ops.rice.encode.reference / decode.reference: sections identical
byte for byte, indices identical, invalid inputs and malformed sections rejected with the
same errors; the public encode_indices / decode_indices against HVDCOMP_BACKEND=reference.
GPU tests (requires_cuda) repeat the comparisons with the CUDA backend.
"""
import numpy as np
import pytest
import torch

from hvdcomp.codecs import sparse_vectors as S
from hvdcomp.ops import rice
from hvdcomp.errors import WireFormatError


def _indices(m, numel, seed):
    rng = np.random.default_rng(seed)
    if numel <= 4 * m or numel < 2**40:
        if m >= numel:
            return np.arange(numel, dtype=np.int64)
        return np.sort(rng.choice(numel, m, replace=False)).astype(np.int64)
    return np.unique(rng.integers(0, numel, m, dtype=np.int64))


CASES = [(0, 8), (1, 1), (1, 2**32 - 1), (4, 16), (7, 7), (7, 100), (100, 100),
         (999, 1000), (1000, 10**6), (25_000, 25_000_000), (3, 2**32), (500, 2**40),
         (100, 2**63 - 1), (5000, 2**60), (300, 2**55)]


@pytest.mark.parametrize("m,numel", CASES)
def test_encode_decode_match_reference(host, m, numel):
    idx = _indices(m, numel, seed=m + numel % 1000)
    ks = [-1, 62] + ([0, 1, 5, 17] if numel < 2**21 else [])
    for k in ks:
        want = rice.encode.reference(idx, numel, k).numpy()
        got = rice.encode.kernels(host.backend, torch.from_numpy(idx), numel, k).numpy()
        assert got.tobytes() == want.tobytes(), (m, numel, k)
        dec = rice.decode.kernels(host.backend, want, numel)
        assert np.array_equal(dec.numpy(), rice.decode.reference(want, numel).numpy())
        assert np.array_equal(dec.numpy(), idx)


def test_extreme_values(host):
    for idx, numel in (([2**62, 2**63 - 2], 2**63 - 1), ([0, 2**63 - 2], 2**63 - 1),
                       ([2**63 - 2], 2**63 - 1), ([0, 1, 2, 2**53 + 1, 2**62], 2**63 - 1)):
        a = np.array(idx, dtype=np.int64)
        want = rice.encode.reference(a, numel).numpy()
        assert rice.encode.kernels(host.backend, torch.from_numpy(a), numel).numpy().tobytes() \
            == want.tobytes()
        assert rice.decode.kernels(host.backend, want, numel).tolist() == idx


def test_gap_sum_beyond_2_53_uses_numpys_float_sum(host):
    # many large gaps whose float64 sum rounds: the parameter must still be the reference's
    rng = np.random.default_rng(7)
    for seed in range(5):
        gaps = rng.integers(2**52, 2**54, 400, dtype=np.int64)
        idx = np.cumsum(gaps + 1) - 1
        numel = int(idx[-1]) + 1 + seed
        want = rice.encode.reference(idx, numel).numpy()
        got = rice.encode.kernels(host.backend, torch.from_numpy(idx), numel).numpy()
        assert got.tobytes() == want.tobytes()


def test_invalid_indices_same_errors(host):
    bad = [([3, 3], 10), ([4, 2], 10), ([-1, 2], 10), ([1, 10], 10), ([5], 5),
           ([0, 1, 2, 2, 5], 10), ([1, 2], -1), ([1], 2**63)]
    for idx, numel in bad:
        with pytest.raises(ValueError) as ref:
            rice.encode.reference(np.array(idx, dtype=np.int64), numel)
        with pytest.raises(ValueError) as got:
            rice.encode.kernels(host.backend, torch.tensor(idx, dtype=torch.int64), numel)
        assert str(got.value) == str(ref.value)
    for k in (63, 100):
        with pytest.raises(ValueError) as ref:
            rice.encode.reference([1, 5], 10, k=k)
        with pytest.raises(ValueError) as got:
            rice.encode.kernels(host.backend, torch.tensor([1, 5]), 10, k=k)
        assert str(got.value) == str(ref.value)


def _outcome(fn):
    try:
        return ("ok", np.asarray(fn()).tolist())
    except WireFormatError as e:
        return ("error", str(e))


def _both(host, sec, numel):
    ref = _outcome(lambda: rice.decode.reference(sec, numel).numpy())
    got = _outcome(lambda: rice.decode.kernels(host.backend, sec, numel).numpy())
    assert got == ref
    return ref


def test_malformed_sections_same_errors(host):
    idx = _indices(300, 100_000, seed=1)
    base = rice.encode.reference(idx, 100_000).numpy()
    for cut in range(len(base) + 1):
        _both(host, base[:cut], 100_000)
    rng = np.random.default_rng(3)
    seen = set()
    for trial in range(400):
        sec = bytearray(base.tobytes())
        for _ in range(int(rng.integers(1, 3))):
            pos = int(rng.integers(0, len(sec)))
            sec[pos] ^= 1 << int(rng.integers(0, 8))
        kind, what = _both(host, np.frombuffer(bytes(sec), np.uint8), 100_000)
        seen.add(what[:25] if kind == "error" else kind)
    for extra in (b"\x00", b"\xff", b"\x00" * 9):
        _both(host, np.frombuffer(base.tobytes() + extra, np.uint8), 100_000)
    # hand-made: too few terminators, wrong numel, quotient too large, overflow
    _both(host, np.frombuffer(b"\x00\x02\x00\x00\x00" + bytes([0b100010]), np.uint8), 8)
    _both(host, np.frombuffer(b"\x00\x02\x00\x00\x00\x02\x00", np.uint8), 8)
    sec = rice.encode.reference([1, 4, 5, 13], 16).numpy()
    for numel in (16, 14, 13, 2):
        _both(host, sec, numel)
    big = rice.encode.reference([2**62, 2**63 - 2], 2**63 - 1).numpy()
    _both(host, big, 2**62 + 1)
    assert len(seen) >= 4


def test_public_api_equals_reference(host, monkeypatch):
    from hvdcomp import backends
    idx = _indices(25_000, 25_000_000, seed=2)
    want = rice.encode.reference(idx, 25_000_000).numpy()
    t = torch.from_numpy(idx)
    wide = torch.stack([t, t]).t()[:, 0]             # non-contiguous
    for inp in (idx, list(idx[:50]), t, t.to(torch.int32), wide):
        n_in = 50 if isinstance(inp, list) else idx.size
        ref = want if n_in == idx.size else rice.encode.reference(idx[:50], 25_000_000).numpy()
        assert S.encode_indices(inp, 25_000_000).tobytes() == ref.tobytes()
    assert np.array_equal(S.decode_indices(want, 25_000_000), idx)
    assert np.array_equal(S.decode_indices(torch.from_numpy(want), 25_000_000), idx)
    assert np.array_equal(S.decode_indices(want.tobytes(), 25_000_000), idx)
    monkeypatch.setenv("HVDCOMP_BACKEND", "reference")
    backends._choice.clear()
    assert S.encode_indices(t, 25_000_000).tobytes() == want.tobytes()
    assert np.array_equal(S.decode_indices(want, 25_000_000), idx)
    backends._choice.clear()


@pytest.mark.parametrize("spec", ["topk:density=0.01", "dgc:density=0.001"])
def test_sparsifier_messages_same_bytes(host, monkeypatch, spec):
    import hvdcomp
    from hvdcomp import backends
    from hvdcomp.compressors.base import TensorKey
    key = TensorKey(name="w", tensor_id=1, step=3, rank=0, world_size=2, seed=5)
    g = torch.randn(50_003, generator=torch.Generator().manual_seed(8))
    msgs, outs = [], []
    for mode in ("auto", "reference"):
        monkeypatch.setenv("HVDCOMP_BACKEND", mode)
        backends._choice.clear()
        try:
            comp = hvdcomp.get(spec)
        except Exception as e:          # a spec this branch's compressors do not take
            pytest.skip(f"{spec}: {e}")
        m = comp.encode(g, key).to_bytes()
        out = torch.zeros(g.numel())
        comp.decode(hvdcomp.Message.from_bytes(m), key, out)
        msgs.append(m)
        outs.append(out)
    backends._choice.clear()
    assert msgs[0] == msgs[1] and torch.equal(outs[0], outs[1])


# ---- GPU ---------------------------------------------------------------------------------------

@pytest.mark.requires_cuda
def test_gpu_matches_reference(cuda_backend):
    be = cuda_backend.backend
    for m, numel in CASES:
        idx = _indices(m, numel, seed=m)
        for k in [-1, 62] + ([0, 5] if numel < 2**21 else []):
            want = rice.encode.reference(idx, numel, k).numpy()
            got = rice.encode.kernels(be, torch.from_numpy(idx).cuda(), numel, k)
            assert got.is_cuda and got.cpu().numpy().tobytes() == want.tobytes()
            dec = rice.decode.kernels(be, want, numel, device="cuda")
            assert dec.is_cuda and np.array_equal(dec.cpu().numpy(), idx)
    base = rice.encode.reference(_indices(300, 100_000, 1), 100_000).numpy()
    rng = np.random.default_rng(3)
    for trial in range(100):
        sec = bytearray(base.tobytes())
        sec[int(rng.integers(0, len(sec)))] ^= 1 << int(rng.integers(0, 8))
        b = np.frombuffer(bytes(sec), np.uint8)
        ref = _outcome(lambda: rice.decode.reference(b, 100_000).numpy())
        got = _outcome(lambda: rice.decode.kernels(be, b, 100_000, device="cuda").cpu().numpy())
        assert got == ref
    t = torch.from_numpy(_indices(25_000, 25_000_000, 2)).cuda()
    assert S.encode_indices(t, 25_000_000).tobytes() == \
        rice.encode.reference(t.cpu().numpy(), 25_000_000).numpy().tobytes()
