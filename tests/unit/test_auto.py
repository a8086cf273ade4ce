"""hvdcomp.auto: the cost model's arithmetic on hand-worked numbers, the plan it makes, and
the measurement of a compressor's costs (single process; the multi-rank plan is checked in
tests/mpi/worker_optimizer.py)."""
import numpy as np
import pytest
import torch

import hvdcomp
from hvdcomp.auto import Auto, CodecCost, CostModel, LinkCost, fit_line, measure_codec


def test_fit_line_hand_case():
    assert fit_line(10, 3.0, 20, 5.0) == pytest.approx((1.0, 0.2))
    # a noisy second point below the first: slope clamped at 0, intercept = first time
    assert fit_line(10, 3.0, 20, 2.0) == (3.0, 0.0)
    # a line through negative intercept is clamped at 0
    assert fit_line(10, 1.0, 20, 3.0) == (0.0, 0.2)


LINK = LinkCost(ar_latency=1e-3, ar_per_byte=8e-9, ag_latency=2e-3, ag_per_byte=4e-9)
CODEC = CodecCost(encode_fixed=1e-4, encode_per_elem=5e-9, decode_fixed=2e-5,
                  decode_per_elem=2e-9, bytes_fixed=64, bytes_per_elem=0.4,
                  fp16_per_elem=1e-9)


def test_cost_model_seconds_hand_worked():
    m = CostModel(LINK, CODEC, world_size=4)
    n = 1_000_000
    t = m.seconds(n)
    assert t["none"] == pytest.approx(1e-3 + 8e-9 * 4e6)                   # 0.033
    assert t["fp16"] == pytest.approx(1e-3 + 8e-9 * 2e6 + 1e-9 * 1e6)      # 0.018
    assert t["allgather"] == pytest.approx(1e-4 + 5e-9 * 1e6 + 2e-3 + 4e-9 * (64 + 0.4e6)
                                           + 4 * (2e-5 + 2e-9 * 1e6))      # 0.0167...
    assert m.choose(n, ("none", "fp16", "allgather")) == "allgather"
    assert m.choose(n, ("none", "fp16")) == "fp16"
    # 1000 elements: t32 = 1e-3 + 3.2e-5, t16 = 1e-3 + 1.6e-5 + 1e-6, tC = 2.1e-3 + ...
    assert m.choose(1000, ("none", "fp16", "allgather")) == "fp16"
    assert m.choose(1000, ("none", "allgather")) == "none"
    # without Horovod, the uncompressed paths go through the allgather
    t2 = CostModel(LINK, CODEC, 4, allreduce=False).seconds(n)
    assert t2["none"] == pytest.approx(2e-3 + 4e-9 * 4e6)


class _NoCollectives:
    rank, size = 0, 4

    def allgather(self, x):
        raise AssertionError("given link and codec costs, Auto must not measure")


def test_reduce_scatter_cost_hand_worked():
    # all-to-all: 3 ms + 5 ns per byte; the reduce-scatter's pieces are n / N elements
    link = LinkCost(1e-3, 8e-9, 2e-3, 4e-9, aa_latency=3e-3, aa_per_byte=5e-9)
    n = 1_000_000
    enc, dec, msg = 1e-4 + 5e-9 * 250_000, 2e-5 + 2e-9 * 250_000, 64 + 0.4 * 250_000
    # N encodes of a piece, the all-to-all of N pieces' messages, N decodes of a piece,
    # one re-encode, the allgather of one piece's message, N decodes of a piece
    want = (4 * enc + 3e-3 + 5e-9 * 4 * msg + 4 * dec + enc + 2e-3 + 4e-9 * msg + 4 * dec)
    assert want == pytest.approx(0.018311536)
    m = CostModel(link, CODEC, world_size=4)
    t = m.seconds(n)
    assert t["reduce_scatter"] == pytest.approx(want)
    # the choice leaves the collectives' latencies out (a bucket pays them, not a tensor):
    # allgather 0.016780256 - 2e-3, reduce-scatter 0.018311536 - 5e-3, fp16 0.018 - 1e-3
    f = m.seconds(n, fused=True)
    assert f["allgather"] == pytest.approx(0.016780256 - 2e-3)
    assert f["reduce_scatter"] == pytest.approx(want - 5e-3)
    assert f["fp16"] == pytest.approx(0.017)
    assert m.choose(n) == "reduce_scatter"
    assert m.choose(n, ("none", "fp16", "allgather")) == "allgather"
    # 64 ranks: the allgather decodes 64 messages of n (0.13 s); the reduce-scatter 2 n
    m64 = CostModel(link, CODEC, world_size=64)
    t64 = m64.seconds(n)
    assert t64["allgather"] > 0.13 and t64["reduce_scatter"] < 0.03
    assert m64.choose(n, ("allgather", "reduce_scatter")) == "reduce_scatter"


def test_plan_from_given_costs():
    auto = Auto("alq:bits=3", link=LINK, codec=CODEC)
    plan = auto.make_plan({"big": 1_000_000, "small": 1000}, _NoCollectives(), allreduce=object())
    assert plan["big"] == (auto.compressor, False) and isinstance(plan["small"][0], hvdcomp.FP16)
    assert auto.plan == {"big": "alq", "small": "fp16"}
    # only fp32 as fallback: the small tensor goes fp32 instead
    auto = Auto("alq:bits=3", fallbacks=("none",), link=LINK, codec=CODEC)
    plan = auto.make_plan({"small": 1000}, _NoCollectives(), allreduce=object())
    assert auto.plan == {"small": "none"} and isinstance(plan["small"][0], hvdcomp.NoneCompressor)
    # the reduce-scatter allowed, 64 ranks: the big tensor takes it (test above)
    link = LinkCost(1e-3, 8e-9, 2e-3, 4e-9, aa_latency=3e-3, aa_per_byte=5e-9)
    auto = Auto("alq:bits=3", fallbacks=(), link=link, codec=CODEC)

    class _64:
        rank, size = 0, 64
    plan = auto.make_plan({"big": 1_000_000}, _64(), allreduce=object(),
                          collectives=("allgather", "reduce_scatter"))
    assert plan == {"big": (auto.compressor, True)} and auto.plan == {"big": "rs+alq"}
    with pytest.raises(ValueError, match="collectives"):
        auto.make_plan({"big": 1}, _64(), collectives=("ring",))
    # a slow link makes everything big enough worth compressing; a fast one nothing
    slow = LinkCost(1e-3, 8e-7, 2e-3, 4e-7)
    auto = Auto("alq:bits=3", link=slow, codec=CODEC)
    auto.make_plan({"a": 100_000}, _NoCollectives(), allreduce=object())
    assert auto.plan == {"a": "alq"}
    fast = LinkCost(1e-5, 8e-12, 2e-5, 4e-12)
    auto = Auto("alq:bits=3", link=fast, codec=CODEC)
    auto.make_plan({"a": 10_000_000}, _NoCollectives(), allreduce=object())
    # t32 = 1e-5 + 8e-12 * 4e7 = 3.3e-4 s; fp16's casts alone cost 1e-9 * 1e7 = 1e-2 s
    assert auto.plan == {"a": "none"}


def test_bad_settings():
    with pytest.raises(ValueError, match="calibrate_numel"):
        Auto("alq", calibrate_numel=4096)
    with pytest.raises(ValueError, match="fallbacks"):
        Auto("alq", fallbacks=("bf16",))
    with pytest.raises(TypeError):
        Auto(3)
    with pytest.raises(hvdcomp.ConfigError):
        Auto("alq:bits=99")


class _OneRank:
    rank, size = 0, 1

    def allgather(self, x):
        return [np.array(x, copy=True)]


def test_measure_codec_bytes_and_state():
    comp = hvdcomp.get("alq:bits=3,bucket_size=4096")
    cost = measure_codec(comp, _OneRank(), numel=1 << 16, reps=2)
    # message bytes are exactly linear here: header + norms (4 B per bucket) + 3 bits/elem
    n1, n2 = 4096, 1 << 16
    m = lambda n: len(comp.encode(torch.randn(n), hvdcomp.TensorKey("x", 0, 0, 0, 1)).to_bytes())
    slope = (m(n2) - m(n1)) / (n2 - n1)
    assert cost.bytes_per_elem == pytest.approx(slope) and slope == pytest.approx(3 / 8 + 4 / 4096)
    assert cost.encode_per_elem > 0 and cost.decode_per_elem > 0 and cost.fp16_per_elem > 0
    # the real compressor's state is untouched (a fresh copy was measured)
    assert comp.level_version == 0


def test_measure_codec_times_a_full_upload_of_lazy_compressors():
    # LAQ skips an upload that repeats the last one: each repetition must use a fresh
    # compressor, so the measured message is a full upload (4 bits per element)
    cost = measure_codec(hvdcomp.get("laq:bits=4"), _OneRank(), numel=1 << 15, reps=1)
    assert cost.bytes_per_elem == pytest.approx(0.5, rel=1e-3)
    assert cost.decode_per_elem > 0


def test_auto_spec_strings():
    from hvdcomp.auto import from_spec
    a, coll = from_spec(" auto+alq:bits=3 ")
    assert isinstance(a, Auto) and a.compressor.spec() == hvdcomp.get("alq:bits=3").spec()
    assert coll is None
    c, coll = from_spec("qsgd:bits=4")
    assert c.spec() == hvdcomp.get("qsgd:bits=4").spec() and coll is None
    with pytest.raises(hvdcomp.ConfigError):
        from_spec("auto+nonsense")


def test_collective_in_spec_strings():
    from hvdcomp.auto import from_spec, merge_collective
    c, coll = from_spec("rs+alq:bits=3")
    assert c.spec() == hvdcomp.get("alq:bits=3").spec() and coll == "reduce_scatter"
    c, coll = from_spec("ag+dgc:density=0.01")
    assert c.name == "dgc" and c.density == 0.01 and coll == "allgather"
    a, coll = from_spec("AUTO+RS+qsgd")
    assert isinstance(a, Auto) and a.compressor.name == "qsgd" and coll == "reduce_scatter"
    # the order is [auto+][rs+|ag+]SPEC: "auto+" after "rs+" is named, with the whole string
    with pytest.raises(hvdcomp.ConfigError) as e:
        from_spec("rs+auto+qsgd")
    assert str(e.value) == ("prefix 'auto+' out of order in 'rs+auto+qsgd'; the order is "
                            "[host+|flat+][auto+[layer+]][rs+|ag+]SPEC")
    assert merge_collective(None, None) is None
    assert merge_collective("auto", None) == "auto"
    assert merge_collective(None, "allgather") == "allgather"
    assert merge_collective("reduce_scatter", "reduce_scatter") == "reduce_scatter"
    with pytest.raises(hvdcomp.ConfigError, match="contradicts"):
        merge_collective("allgather", "reduce_scatter")
    with pytest.raises(hvdcomp.ConfigError, match="collective must be one of"):
        merge_collective("ring", None)


def test_reduce_scatter_cost_prices_the_second_stage_apart():
    # second stage: 2 more bits a coordinate (0.65 B), slower encode and decode
    link = LinkCost(1e-3, 8e-9, 2e-3, 4e-9, aa_latency=3e-3, aa_per_byte=5e-9)
    stage2 = CodecCost(encode_fixed=2e-4, encode_per_elem=7e-9, decode_fixed=3e-5,
                       decode_per_elem=3e-9, bytes_fixed=64, bytes_per_elem=0.65)
    n, N = 1_000_000, 4
    s = n / N
    enc, dec, msg = 1e-4 + 5e-9 * s, 2e-5 + 2e-9 * s, 64 + 0.4 * s
    enc2, dec2, msg2 = 2e-4 + 7e-9 * s, 3e-5 + 3e-9 * s, 64 + 0.65 * s
    want = (N * enc + 3e-3 + 5e-9 * N * msg + N * dec + enc2 + 2e-3 + 4e-9 * msg2 + N * dec2)
    t = CostModel(link, CODEC, N, stage2=stage2).seconds(n)
    assert t["reduce_scatter"] == pytest.approx(want)
    # the allgather path does not use the second stage
    assert t["allgather"] == pytest.approx(CostModel(link, CODEC, N).seconds(n)["allgather"])
    assert CostModel(link, CODEC, N, stage2=stage2).as_dict()["stage2"]["bytes_per_elem"] == 0.65


def test_measure_codec_of_the_second_stage():
    from hvdcomp.exchange.shards import second_stage
    comp = hvdcomp.get("alq:bits=3,bucket_size=4096")
    cost = measure_codec(comp, _OneRank(), numel=1 << 16, reps=1, second_stage=second_stage)
    # the finer stage: 5 bits a coordinate + a float32 norm per bucket of 4096
    assert cost.bytes_per_elem == pytest.approx(5 / 8 + 4 / 4096)
    assert comp.level_version == 0


class _Recorder:
    """Records the byte sizes of the collectives measure_link makes (one rank of ``size``)."""

    def __init__(self, size):
        self.rank, self.size, self.calls = 0, size, []

    def allgather(self, x):
        self.calls.append(("ag", x.nbytes))
        return [np.array(x, copy=True)] * self.size

    def alltoall(self, parts):
        self.calls.append(("aa", sum(p.nbytes for p in parts)))
        return [np.array(p, copy=True) for p in parts]


class _SumRecorder:
    def __init__(self, calls):
        self.calls = calls

    def sum_(self, buf, name):
        self.calls.append(("ar", buf.numel() * 4))
        return buf


def test_measure_link_moves_about_large_bytes_per_rank():
    from hvdcomp.auto import LINK_SMALL, measure_link
    tp = _Recorder(5)
    measure_link(tp, _SumRecorder(tp.calls), large=8 << 20, reps=1, alltoall=True)
    sizes = {k: sorted({b for kk, b in tp.calls if kk == k}) for k in ("ar", "aa", "ag")}
    assert sizes["ar"] == [LINK_SMALL, 8 << 20]
    assert sizes["aa"] == [LINK_SMALL - LINK_SMALL % 5, (8 << 20) - (8 << 20) % 5]
    # the allgather: each rank receives (N - 1) x its contribution ~ large; the last
    # allgather is of the measured values (8 x 6 float64)
    assert sizes["ag"] == [48, LINK_SMALL, (8 << 20) // 4]


def test_a_small_tensor_pays_no_latency_of_its_own():
    # Horovod's allreduce answers a 64 KiB probe in 1 ms, the allgather in 10 us: counting
    # those per tensor would send a 4096-element tensor through ALQ (1.0e-3 + 1.6e-5 for
    # fp16 against 5.2e-4 for ALQ); in a fusion bucket it pays per-byte costs only
    link = LinkCost(ar_latency=1e-3, ar_per_byte=8e-9, ag_latency=1e-5, ag_per_byte=4e-9)
    m = CostModel(link, CODEC, world_size=4)
    n = 4096
    t, f = m.seconds(n), m.seconds(n, fused=True)
    assert t["allgather"] < t["fp16"]
    assert f["fp16"] == pytest.approx(8e-9 * 2 * n + 1e-9 * n)
    assert f["allgather"] == pytest.approx(1e-4 + 5e-9 * n + 4e-9 * (64 + 0.4 * n)
                                           + 4 * (2e-5 + 2e-9 * n))
    assert m.choose(n, ("fp16", "allgather")) == "fp16"


@pytest.mark.parametrize("spec, prefix", [
    ("auto+host+alq:bits=3", "host+"),        # the hierarchy prefix goes first
    ("auto+rs+layer+alq:bits=3", "layer+"),   # "layer+" right after "auto+"
    ("rs+auto+alq:bits=3", "auto+"),
    ("ag+flat+qsgd", "flat+"),
    ("layer+alq", "layer+"),                  # "layer+" only after "auto+"
    ("rs+ag+alq", "ag+"),                     # one collective
    ("auto+auto+alq", "auto+"),               # repeated
    (" AUTO+Host+alq ", "host+"),             # prefixes are case-insensitive
])
def test_a_prefix_out_of_order_is_named_with_the_whole_string_and_the_order(spec, prefix):
    """Review finding: a prefix out of order used to reach hvdcomp.get, whose error quoted
    only the rest and told the user to give the whole string as compression=, which they
    had done.  The message here is written out by hand from the documented order
    (docs/compressors.md, "Spec prefixes")."""
    from hvdcomp.auto import from_spec
    with pytest.raises(hvdcomp.ConfigError) as e:
        from_spec(spec)
    assert str(e.value) == (f"prefix {prefix!r} out of order in {spec.strip()!r}; the order "
                            f"is [host+|flat+][auto+[layer+]][rs+|ag+]SPEC")


def test_the_exchange_quotes_the_whole_string_with_its_hierarchy_prefix():
    """resolve() reads "host+"/"flat+" before from_spec: the error quotes what the user gave,
    and a hierarchy prefix given twice is out of order."""
    from hvdcomp.exchange.driver import resolve
    for spec, prefix in [("host+auto+flat+alq", "flat+"), ("flat+rs+auto+alq", "auto+"),
                         ("host+host+alq", "host+")]:
        with pytest.raises(hvdcomp.ConfigError) as e:
            resolve(spec)
        assert str(e.value) == (f"prefix {prefix!r} out of order in {spec!r}; the order is "
                                f"[host+|flat+][auto+[layer+]][rs+|ag+]SPEC")


@pytest.mark.parametrize("spec, per_layer, collective", [
    ("auto+alq:bits=3", False, None),
    ("auto+layer+alq:bits=3", True, None),
    ("auto+layer+rs+alq:bits=3", True, "reduce_scatter"),
    ("auto+ag+alq:bits=3", False, "allgather"),
    ("Auto+Layer+AG+alq:bits=3", True, "allgather"),
    ("rs+alq:bits=3", None, "reduce_scatter"),
    ("alq:bits=3", None, None),
])
def test_prefixes_in_order_still_parse(spec, per_layer, collective):
    from hvdcomp.auto import from_spec
    from hvdcomp.exchange.driver import resolve
    for parsed in (from_spec(spec), resolve(spec), resolve("host+" + spec),
                   resolve("flat+" + spec)):
        comp, coll = parsed
        assert coll == collective
        if per_layer is None:
            assert comp.spec() == hvdcomp.get("alq:bits=3").spec()
        else:
            assert isinstance(comp, Auto) and comp.per_layer == per_layer
            assert comp.compressor.spec() == hvdcomp.get("alq:bits=3").spec()


def test_from_spec_with_a_leading_hierarchy_prefix_says_the_exchange_reads_it():
    """from_spec does not read "host+"/"flat+" (the exchange does, before it): in front it
    is in order, and hvdcomp.get's message says where it is taken."""
    from hvdcomp.auto import from_spec
    with pytest.raises(hvdcomp.ConfigError, match=r"^'host\+alq:bits=3': 'host\+' is an "
                       r"exchange setting \(hierarchy='host'\)"):
        from_spec("host+alq:bits=3")
