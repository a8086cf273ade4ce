"""Compressor.encode_pieces / decode_pieces: a tensor's reduce-scatter pieces (one per
destination rank) in one call give the messages, byte for byte, and the decoded sums, bit for
bit, that one encode / decode per piece gives (the reduce-scatter's earlier path, and the
base class's default), for every compressor that can be cut into shards, and for the
bucketed quantizers' one-launch path in every case where it must fall back (not finite,
norms that overflow, pieces off a bucket boundary, keys of different ranks, entropy coding,
a subclass's own encoding)."""
import pytest
import torch

from hvdcomp.compressors import Compressor, get
from hvdcomp.compressors.base import TensorKey, examples
from hvdcomp.errors import WireFormatError
from hvdcomp.exchange.shards import boundaries, refusal

SHARDABLE = sorted(n for n, spec in examples().items() if refusal(get(spec)) is None)


def spans_of(comp, n, count):
    """The reduce-scatter's cuts of one tensor of n coordinates among ``count`` ranks
    (units: ``comp``'s, a first-stage compressor's)."""
    c = boundaries([n], [comp.shard_unit((n,))], count)
    return [(lo, hi) for lo, hi in zip(c[:-1], c[1:]) if hi > lo]


def keys_of(spans, rank=1, stage2=False, dtype=torch.float32):
    return [TensorKey(f"w[{lo}:{hi}]" + ("/avg" if stage2 else ""), 40 + 2 * k + stage2, 9,
                      k if stage2 else rank, 1 if stage2 else 4, 77, shape=(hi - lo,),
                      dtype=dtype) for k, (lo, hi) in enumerate(spans)]


def one_by_one(comp, x, spans, keys):
    return [comp.encode(x[lo:hi], k) for (lo, hi), k in zip(spans, keys)]


def same_messages(a, b):
    return [m.to_bytes() for m in a] == [m.to_bytes() for m in b]


def decoded(comp, msgs, keys, spans, n, pieces):
    out = torch.zeros(n)
    if pieces:
        fin = comp.decode_pieces(msgs, keys, spans, out)
    else:
        fin = True
        for m, k, (lo, hi) in zip(msgs, keys, spans):
            fin &= comp.decode(m, k, out[lo:hi])
    return fin, out


@pytest.mark.parametrize("name", SHARDABLE)
def test_every_shardable_compressor(name):
    n = 5000
    x = torch.randn(n, generator=torch.Generator().manual_seed(3))
    for stage in ("first", "second"):
        mk = lambda: get(examples()[name]) if stage == "first" else get(examples()[name]).second_stage()  # noqa: E731
        a, b = mk(), mk()                   # two instances: stateful ones stay in step
        spans = spans_of(get(examples()[name]), n, 6)
        keys = keys_of(spans, stage2=stage == "second")
        ma = a.encode_pieces(x, spans, keys)
        mb = one_by_one(b, x, spans, keys)
        assert same_messages(ma, mb), (name, stage)
        fa, oa = decoded(a, ma, keys, spans, n, True)
        fb, ob = decoded(b, mb, keys, spans, n, False)
        assert fa == fb and torch.equal(oa, ob), (name, stage)


SPECS = ["qsgd:bits=4,bucket_size=100", "qsgdinf:bits=2,bucket_size=7",
         "nuqsgd:bits=8,bucket_size=1", "alq:bits=3,bucket_size=64",
         "amq:bits=3,bucket_size=512", "alq:bits=3,bucket_size=64,entropy=True"]


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64])
def test_quantizers_one_launch_equals_one_by_one(spec, dtype):
    n = 3000
    x = (torch.randn(n, generator=torch.Generator().manual_seed(5)) * 1e-2).to(dtype)
    for comp in (get(spec), get(spec).second_stage()):
        for count in (1, 2, 7, 64):
            spans = spans_of(get(spec), n, count)
            keys = keys_of(spans, dtype=dtype)
            ma = comp.encode_pieces(x, spans, keys)
            mb = one_by_one(comp, x, spans, keys)
            assert same_messages(ma, mb), (spec, count)
            assert all(m.dtype == mb[0].dtype and m.shape == (hi - lo,)
                       for m, (lo, hi) in zip(ma, spans))
            fa, oa = decoded(comp, ma, keys, spans, n, True)
            fb, ob = decoded(comp, mb, keys, spans, n, False)
            assert fa and fb and torch.equal(oa, ob)


def test_the_one_launch_path_is_taken():
    """ALQ's pieces cost one quantize_pack_pieces and one dequantize_add_pieces launch."""
    from hvdcomp.ops import quantize as Q
    comp = get("alq:bits=3,bucket_size=64")
    n = 64 * 50
    x = torch.randn(n)
    spans = spans_of(comp, n, 10)
    keys = keys_of(spans)
    calls = []
    orig = (Q.quantize_pack_pieces.reference, Q.dequantize_add_pieces.reference,
            Q.quantize_pack.reference)
    Q.quantize_pack_pieces._kernel, saved = None, Q.quantize_pack_pieces._kernel
    Q.dequantize_add_pieces._kernel, saved2 = None, Q.dequantize_add_pieces._kernel
    try:
        Q.quantize_pack_pieces.reference = lambda *a, **k: calls.append("qp") or orig[0](*a, **k)
        Q.dequantize_add_pieces.reference = lambda *a, **k: calls.append("dq") or orig[1](*a, **k)
        msgs = comp.encode_pieces(x, spans, keys)
        comp.decode_pieces(msgs, keys, spans, torch.zeros(n))
    finally:
        Q.quantize_pack_pieces.reference, Q.dequantize_add_pieces.reference = orig[:2]
        Q.quantize_pack_pieces._kernel, Q.dequantize_add_pieces._kernel = saved, saved2
    assert calls == ["qp", "dq"]


@pytest.mark.parametrize("case", ["nan", "inf", "overflow", "off_bucket", "ranks", "terngrad"])
def test_fallbacks_give_the_same_messages(case):
    n = 1024
    x = torch.randn(n, generator=torch.Generator().manual_seed(8))
    comp = get("terngrad:bucket_size=64" if case == "terngrad" else "qsgd:bits=3,bucket_size=64")
    spans = spans_of(comp, n, 4)
    keys = keys_of(spans)
    if case == "nan":
        x[700] = float("nan")               # one piece NONFINITE, the others as usual
    elif case == "inf":
        x[3] = float("inf")
    elif case == "overflow":
        x[:64] = 3e38                       # finite values whose bucket norm overflows
    elif case == "off_bucket":
        spans = [(0, 100), (100, 1024)]
        keys = keys_of(spans)
    elif case == "ranks":
        keys = [TensorKey(k.name, k.tensor_id, k.step, j, 4, k.seed, k.shape, k.dtype)
                for j, k in enumerate(keys)]
    ma = comp.encode_pieces(x, spans, keys)
    mb = one_by_one(comp, x, spans, keys)
    assert same_messages(ma, mb)
    fa, oa = decoded(comp, ma, keys, spans, n, True)
    fb, ob = decoded(comp, mb, keys, spans, n, False)
    assert fa == fb and torch.equal(oa, ob)
    if case in ("nan", "inf", "overflow"):
        assert fa is False                  # a NONFINITE piece among them


def test_decode_pieces_checks_every_message():
    comp = get("alq:bits=3,bucket_size=64")
    n = 640
    x = torch.randn(n)
    spans = spans_of(comp, n, 4)
    keys = keys_of(spans, stage2=True)
    msgs = comp.encode_pieces(x, spans, keys)
    # a wrong tensor id in the last message
    bad = keys[:-1] + [TensorKey(keys[-1].name, 999, 9, 3, 1, 77, keys[-1].shape,
                                 keys[-1].dtype)]
    with pytest.raises(WireFormatError, match="tensor id"):
        comp.decode_pieces(msgs, bad, spans, torch.zeros(n))
    # a negative norm in the second message
    import dataclasses
    import numpy as np
    nm = np.array(msgs[1].sections[0]).view(np.float32).copy()
    nm[0] = -1.0
    m1 = dataclasses.replace(msgs[1], sections=(nm.view(np.uint8), msgs[1].sections[1]))
    with pytest.raises(WireFormatError, match="finite and >= 0"):
        comp.decode_pieces([msgs[0], m1] + msgs[2:], keys, spans, torch.zeros(n))
    # a truncated code section
    m2 = dataclasses.replace(msgs[2], sections=(msgs[2].sections[0], msgs[2].sections[1][:-1]))
    with pytest.raises(WireFormatError, match="codes"):
        comp.decode_pieces(msgs[:2] + [m2] + msgs[3:], keys, spans, torch.zeros(n))
    with pytest.raises(ValueError):
        comp.decode_pieces(msgs, keys[:-1], spans, torch.zeros(n))
    with pytest.raises(ValueError):
        comp.encode_pieces(x, spans, keys[:-1])


def test_base_class_default_is_one_call_per_piece():
    calls = []

    class Spy(Compressor):
        def encode(self, grad, key):
            calls.append((key.tensor_id, grad.shape))
            return key.tensor_id

    keys = [TensorKey("a", 1, 0, 0, 2, shape=(2, 3)), TensorKey("b", 2, 0, 0, 2)]
    out = Spy().encode_pieces(torch.zeros(10), [(0, 6), (6, 10)], keys)
    assert out == [1, 2] and calls == [(1, (2, 3)), (2, (4,))]
