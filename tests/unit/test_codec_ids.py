"""One registry: every compressor registers its wire id next to its class; hvdcomp's own ids
are never renumbered (FROZEN, copied from the wire format as first published), each class
declares an example spec, and docs/wire-format.md's codec table is the registry's."""
import os

import pytest

import hvdcomp
from hvdcomp import wire
from hvdcomp.compressors import examples, registry
from hvdcomp.compressors.listing import BEGIN, END, wire_codec_table

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The wire ids of hvdcomp's own codecs.  Part of the wire format: never edit a line of this
# table, only add one for a new codec.
FROZEN = {
    "none": 1, "fp16": 2, "bf16": 3,
    "qsgd": 10, "qsgdinf": 11, "nuqsgd": 12, "alq": 13, "amq": 14,
    "terngrad": 15, "signef": 16, "psq": 17, "bhq": 18, "dqsg": 19, "ndqsg": 20,
    "dgc": 21, "topk": 22, "randk": 23, "laq": 24,
    "coo": 25,
    "powersgd": 26,
    "uniformef": 27,
}


def _builtin():
    return {n: c for n, c in registry().items() if c.__module__.startswith("hvdcomp.")}


def test_builtin_ids_are_the_frozen_table():
    ids = {n: c.codec for n, c in _builtin().items()}
    assert ids == {n: i for n, i in FROZEN.items() if n != "coo"}
    assert {n: i for n, i in wire.CODECS.items() if i in wire.BUILTIN_CODECS} == FROZEN


def test_each_id_is_registered_next_to_its_class():
    # the class's own module passes it to @register; no table elsewhere assigns it
    for name, cls in _builtin().items():
        src = open(os.path.join(ROOT, *cls.__module__.split(".")) + ".py").read()
        assert f'@register("{name}", codec={cls.codec})' in src, name
    wire_src = open(os.path.join(ROOT, "hvdcomp", "wire.py")).read()
    assert not any(f'"{n}": {i}' in wire_src for n, i in FROZEN.items() if n != "coo")


def test_examples_are_valid_specs_of_their_own_class():
    ex = examples()
    assert sorted(ex) == hvdcomp.available() == sorted(registry())
    for name, spec in ex.items():
        c = hvdcomp.get(spec)
        assert c.name == name
        assert hvdcomp.get(c.spec()).settings() == c.settings()


def test_registry_keeps_the_old_functions():
    assert list(registry()) == hvdcomp.available()
    assert all(type(hvdcomp.get(n)) is cls for n, cls in registry().items())


def test_ids_below_128_are_for_hvdcomps_own_classes_only():
    with pytest.raises(ValueError, match="128..255"):
        @hvdcomp.register("outsider", codec=100)
        class Outsider(hvdcomp.NoneCompressor):
            pass
    assert "outsider" not in hvdcomp.available() and "outsider" not in wire.CODECS
    with pytest.raises(ValueError, match="1..127"):
        wire.register_codec("mine", 200, builtin=True)


def test_wire_format_doc_holds_the_registrys_codec_table():
    doc = open(os.path.join(ROOT, "docs", "wire-format.md")).read()
    assert doc.count(BEGIN) == 1 and doc.count(END) == 1
    got = doc[doc.index(BEGIN):doc.index(END) + len(END)]
    want = wire_codec_table()
    assert got == want, f"docs/wire-format.md's codec table should read:\n{want}"
    # and the table lists every frozen id
    for name, i in FROZEN.items():
        assert f"| {i} | `{name}` |" in want
