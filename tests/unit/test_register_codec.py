"""Wire ids for compressors defined outside hvdcomp: hvdcomp.register(name, codec=ID)."""
import pytest
import torch

import hvdcomp
from hvdcomp import wire
from hvdcomp.compressors.base import REGISTRY


def _forget(name):
    REGISTRY.pop(name, None)
    cid = wire.CODECS.pop(name, None)
    wire._CODEC_NAMES.pop(cid, None)


def test_user_codec_round_trips_through_the_wire():
    try:
        @hvdcomp.register("userneg", codec=201)
        class UserNeg(hvdcomp.NoneCompressor):
            pass

        assert UserNeg.codec == 201 == wire.CODECS["userneg"]
        g = torch.arange(6, dtype=torch.float32).reshape(2, 3)
        msg = UserNeg().encode(g, hvdcomp.TensorKey("w", 0, 0, 0, 1))
        back = wire.Message.from_bytes(msg.to_bytes())
        assert back.codec == 201 and back.codec_name == "userneg"
        assert hvdcomp.get("userneg").spec() == "userneg"
    finally:
        _forget("userneg")
    with pytest.raises(Exception):              # forgotten again: an unknown codec id
        wire.Message.from_bytes(msg.to_bytes())


def test_ids_below_128_and_taken_ids_are_refused():
    with pytest.raises(ValueError, match="128..255"):
        wire.register_codec("mine", 24)         # LAQ's
    with pytest.raises(ValueError, match="128..255"):
        wire.register_codec("mine", 256)
    try:
        assert wire.register_codec("mine", 250) == 250
        assert wire.register_codec("mine", 250) == 250      # the same again: a no-op
        with pytest.raises(ValueError, match="id 250 is 'mine'"):
            wire.register_codec("other", 250)
        with pytest.raises(ValueError, match="'mine' has id 250"):
            wire.register_codec("mine", 251)
    finally:
        _forget("mine")
