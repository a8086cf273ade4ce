"""hvdcomp.get / parse_spec / spec(): the compressor registry and one-line spec strings."""
import pytest

import hvdcomp
from hvdcomp import ConfigError
from hvdcomp.compressors.base import Compressor, register

EXPECTED_NAMES = ["alq", "amq", "bf16", "fp16", "none", "nuqsgd", "qsgd", "qsgdinf"]
CLASSES = {"alq": hvdcomp.ALQ, "amq": hvdcomp.AMQ, "bf16": hvdcomp.BF16, "fp16": hvdcomp.FP16,
           "none": hvdcomp.NoneCompressor, "nuqsgd": hvdcomp.NUQSGD, "qsgd": hvdcomp.QSGD,
           "qsgdinf": hvdcomp.QSGDInf}


def test_available_lists_every_compressor_sorted():
    names = hvdcomp.available()
    assert names == sorted(names)
    assert set(EXPECTED_NAMES) <= set(names)
    # every registered name is a codec of the wire format
    assert set(names) <= set(hvdcomp.wire.CODECS)


@pytest.mark.parametrize("name", EXPECTED_NAMES)
def test_get_by_name_gives_the_right_class(name):
    c = hvdcomp.get(name)
    assert type(c) is CLASSES[name]
    assert c.name == name


def test_config_error_is_value_error():
    assert issubclass(ConfigError, ValueError)


# --- name + kwargs == spec string == constructor ------------------------------------------

@pytest.mark.parametrize("name,kwargs,spec", [
    ("qsgd", dict(bits=5, bucket_size=64), "qsgd:bits=5,bucket_size=64"),
    ("qsgdinf", dict(bits=2), "qsgdinf:bits=2"),
    ("nuqsgd", dict(bucket_size=1), "nuqsgd:bucket_size=1"),
    ("alq", dict(bits=4, refit_steps=(7, 9), refit_every=0),
     "alq:bits=4,refit_steps=7/9,refit_every=0"),
    ("amq", dict(bits=8, bucket_size=2**31), "amq:bits=8,bucket_size=2147483648"),
    ("fp16", {}, "fp16"),
])
def test_get_by_name_and_by_spec_agree(name, kwargs, spec):
    a = hvdcomp.get(name, **kwargs)
    b = hvdcomp.get(spec)
    c = CLASSES[name](**kwargs)
    assert type(a) is type(b) is type(c)
    assert a.settings() == b.settings() == c.settings()
    for k, v in kwargs.items():
        assert a.settings()[k] == v


def test_settings_of_defaults():
    assert hvdcomp.get("qsgd").settings() == {"bits": 3, "bucket_size": 8192,
                                              "entropy": False}
    assert hvdcomp.get("alq").settings() == {"bits": 3, "bucket_size": 8192, "entropy": False,
                                             "refit_steps": (100, 2000), "refit_every": 10000,
                                             "model": "hist", "norm": "l2"}
    assert hvdcomp.get("none").settings() == {}


def test_spec_strings_by_hand():
    assert hvdcomp.get("qsgd", bits=5, bucket_size=64).spec() == (
        "qsgd:bits=5,bucket_size=64,entropy=False")
    assert hvdcomp.get("alq", refit_steps=(50, 500)).spec() == (
        "alq:bits=3,bucket_size=8192,entropy=False,refit_steps=50/500,refit_every=10000,"
        "model=hist,norm=l2")
    assert hvdcomp.get("none").spec() == "none"
    assert hvdcomp.get("bf16").spec() == "bf16"


def test_spec_is_case_and_whitespace_tolerant():
    c = hvdcomp.get("  QSGD : bits = 4 , bucket_size=16 ,")
    assert type(c) is hvdcomp.QSGD
    assert c.settings() == {"bits": 4, "bucket_size": 16, "entropy": False}


def test_kwargs_override_spec_settings():
    assert hvdcomp.get("qsgd:bits=3", bits=6).bits == 6


# --- spec() round trip --------------------------------------------------------------------

def _variants(name):
    yield hvdcomp.get(name)
    if name in ("qsgd", "qsgdinf", "nuqsgd"):
        yield hvdcomp.get(name, bits=2, bucket_size=1)
        yield hvdcomp.get(name, bits=8, bucket_size=333)
    if name in ("alq", "amq"):
        yield hvdcomp.get(name, bits=5, bucket_size=7, refit_steps=(3,), refit_every=0)
        yield hvdcomp.get(name, refit_steps=(1, 2, 3, 4))
        yield hvdcomp.get(name, refit_steps=())


@pytest.mark.parametrize("name", hvdcomp.available())
def test_spec_round_trips_for_every_compressor(name):
    for c in _variants(name):
        s = c.spec()
        assert s.split(":")[0] == name
        back = hvdcomp.get(s)
        assert type(back) is type(c)
        assert back.settings() == c.settings()
        assert back.spec() == s
        # repr is a call that rebuilds it
        again = eval(repr(c), {"hvdcomp": hvdcomp})
        assert again.settings() == c.settings()


def test_tuple_setting_parses():
    assert hvdcomp.get("alq:refit_steps=50/500").refit_steps == (50, 500)
    assert hvdcomp.get("amq:refit_steps=50+500+7").refit_steps == (50, 500, 7)
    assert hvdcomp.get("alq:refit_steps=42").refit_steps == (42,)
    assert hvdcomp.parse_spec("alq:bits=4,refit_steps=50/500") == (
        "alq", {"bits": 4, "refit_steps": (50, 500)})


def test_parse_spec_types():
    name, kw = hvdcomp.parse_spec("qsgd:bits=4,bucket_size=10")
    assert name == "qsgd"
    assert kw == {"bits": 4, "bucket_size": 10}
    assert all(type(v) is int for v in kw.values())
    assert hvdcomp.parse_spec("none") == ("none", {})


# --- errors -------------------------------------------------------------------------------

@pytest.mark.parametrize("spec", ["nosuch", "qsgd8", "", ":bits=3", "alq2:bits=3"])
def test_unknown_name_lists_all_valid_names(spec):
    with pytest.raises(ConfigError) as ei:
        hvdcomp.get(spec)
    text = str(ei.value)
    assert "unknown compressor" in text
    for n in EXPECTED_NAMES:     # each with its default spec (or "(no settings)")
        assert f"{n}:" in text or f"{n} (no settings)" in text


def test_unknown_name_in_parse_spec():
    with pytest.raises(ConfigError, match="unknown compressor"):
        hvdcomp.parse_spec("zzz:bits=3")


@pytest.mark.parametrize("spec,kwargs,valid", [
    ("qsgd:bitz=3", {}, "qsgd:bits=3,bucket_size=8192,entropy=False"),
    ("qsgd:self=3", {}, "qsgd:bits=3,bucket_size=8192,entropy=False"),
    ("qsgd", {"bitz": 3}, "qsgd:bits=3,bucket_size=8192,entropy=False"),
    ("none:bits=3", {}, "none (no settings)"),
    ("fp16", {"bits": 3}, "fp16 (no settings)"),
    ("alq:refit=5", {}, "alq:bits=3,bucket_size=8192,entropy=False,refit_steps=100/2000,"
                        "refit_every=10000,model=hist,norm=l2"),
])
def test_unknown_setting_lists_valid_settings(spec, kwargs, valid):
    with pytest.raises(ConfigError, match="unknown setting") as ei:
        hvdcomp.get(spec, **kwargs)
    assert valid in str(ei.value)


@pytest.mark.parametrize("spec", ["qsgd:bits=three", "qsgd:bits=3.5", "qsgd:bucket_size=",
                                  "alq:refit_steps=a/b", "alq:refit_every=1e4",
                                  "nuqsgd:bits=3=4"])
def test_badly_typed_value_lists_valid_settings(spec):
    with pytest.raises(ConfigError, match="not a valid") as ei:
        hvdcomp.get(spec)
    assert "bits=3" in str(ei.value) and "bucket_size=8192" in str(ei.value)


def test_setting_without_value():
    with pytest.raises(ConfigError, match="key=value") as ei:
        hvdcomp.get("qsgd:bits")
    assert "bucket_size=8192" in str(ei.value)


@pytest.mark.parametrize("name", ["alq", "amq", "qsgd", "qsgdinf", "nuqsgd"])
@pytest.mark.parametrize("bits", [1, 9, 0, -3])
def test_bits_out_of_range(name, bits):
    with pytest.raises(ConfigError, match="bits") as ei:
        hvdcomp.get(f"{name}:bits={bits}")
    assert f"{name}:bits=3" in str(ei.value)
    with pytest.raises(ConfigError):
        hvdcomp.get(name, bits=bits)


@pytest.mark.parametrize("bits", [2, 8])
def test_bits_boundaries_accepted(bits):
    assert hvdcomp.get(f"alq:bits={bits}").bits == bits


@pytest.mark.parametrize("value", [0, -1, 2**31 + 1])
def test_bucket_size_out_of_range(value):
    with pytest.raises(ConfigError, match="bucket_size"):
        hvdcomp.get(f"qsgd:bucket_size={value}")
    with pytest.raises(ConfigError, match="bucket_size"):
        hvdcomp.get("alq", bucket_size=value)


@pytest.mark.parametrize("spec", ["alq:refit_every=-1", "alq:refit_steps=0/5",
                                  "amq:refit_steps=-2"])
def test_refit_schedule_validated(spec):
    with pytest.raises(ConfigError, match="refit"):
        hvdcomp.get(spec)


@pytest.mark.parametrize("kwargs", [dict(bits="4"), dict(bits=4.5), dict(bucket_size=8.0),
                                    dict(refit_steps=5)])
def test_badly_typed_kwargs(kwargs):
    with pytest.raises(ConfigError):
        hvdcomp.get("alq", **kwargs)


def test_instance_passes_through_unchanged():
    c = hvdcomp.ALQ(bits=4, bucket_size=128)
    assert hvdcomp.get(c) is c
    n = hvdcomp.NoneCompressor()
    assert hvdcomp.get(n) is n
    with pytest.raises(ConfigError):
        hvdcomp.get(c, bits=3)


@pytest.mark.parametrize("bad", [3, None, hvdcomp.QSGD, ["qsgd"]])
def test_get_rejects_non_spec(bad):
    with pytest.raises(ConfigError):
        hvdcomp.get(bad)


def test_register_twice_raises():
    with pytest.raises(ValueError, match="qsgd"):
        register("qsgd")(type("Dup", (Compressor,), {}))
    assert type(hvdcomp.get("qsgd")) is hvdcomp.QSGD


# --- exchange prefixes ("auto+", "rs+", "host+"...): settings of the exchange, not of get --

def test_get_with_an_exchange_prefix_says_where_it_belongs():
    """Newcomer trial item 3: a short error naming the prefix and where it is taken, not
    the whole registry."""
    with pytest.raises(ConfigError) as e:
        hvdcomp.get("auto+alq:bits=3")
    assert str(e.value) == (
        "'auto+alq:bits=3': 'auto+' is an exchange setting (hvdcomp.Auto(SPEC)), not part of "
        "a compressor's spec, which is all hvdcomp.get takes; give the whole string as the "
        "exchange's compression= (hvdcomp.torch.DistributedOptimizer, hvdcomp.ddp, "
        "$HVDCOMP_COMPRESSION, the main job's --compression), prefixes in the order "
        "[host+|flat+][auto+[layer+]][rs+|ag+]SPEC (docs/compressors.md, \"Spec prefixes\")")


@pytest.mark.parametrize("spec, prefix, meaning", [
    ("host+alq:bits=3", "host+", "hierarchy='host'"),
    ("flat+alq", "flat+", "hierarchy='flat'"),
    (" Auto+layer+alq", "auto+", "hvdcomp.Auto(SPEC)"),
    ("layer+alq", "layer+", "hvdcomp.Auto(SPEC, per_layer=True), after 'auto+'"),
    ("RS+qsgd:bits=4", "rs+", "collective='reduce_scatter'"),
    ("ag+topk", "ag+", "collective='allgather'"),
])
def test_every_exchange_prefix_is_refused_by_get_and_parse_spec(spec, prefix, meaning):
    for parse in (hvdcomp.get, hvdcomp.compressors.parse_spec):
        with pytest.raises(ConfigError) as e:
            parse(spec)
        msg = str(e.value)
        assert msg.startswith(f"{spec.strip()!r}: {prefix!r} is an exchange setting "
                              f"({meaning}), not part of a compressor's spec"), msg
        assert "valid (with their defaults)" not in msg and len(msg) < 450, msg


def test_the_prefixes_get_refuses_are_those_the_exchange_reads():
    """The list in hvdcomp.compressors.prefixes is the real one: each prefix is consumed by
    the exchange's spec parsing (split_hierarchy, from_spec) with the setting it names."""
    from hvdcomp.auto import from_spec
    from hvdcomp.compressors import prefixes
    from hvdcomp.exchange.driver import split_hierarchy
    assert set(prefixes.MEANING) == {"host+", "flat+", "auto+", "layer+", "rs+", "ag+"}
    assert split_hierarchy("host+alq") == ("host", "alq")
    assert split_hierarchy("flat+auto+alq") == ("flat", "auto+alq")
    auto, coll = from_spec("auto+alq:bits=3")
    assert isinstance(auto, hvdcomp.Auto) and not auto.per_layer and coll is None
    auto, coll = from_spec("auto+layer+rs+alq:bits=3")
    assert isinstance(auto, hvdcomp.Auto) and auto.per_layer and coll == "reduce_scatter"
    assert auto.compressor.spec() == hvdcomp.get("alq:bits=3").spec()
    comp, coll = from_spec("ag+qsgd:bits=4")
    assert comp.spec() == hvdcomp.get("qsgd:bits=4").spec() and coll == "allgather"
    with pytest.raises(ConfigError, match=r"^prefix 'auto\+' out of order in 'rs\+auto\+alq'"):
        from_spec("rs+auto+alq")           # out of order: named, with the whole string
