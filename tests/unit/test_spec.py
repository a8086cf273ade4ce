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
