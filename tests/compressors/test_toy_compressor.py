"""A compressor added the way a user adds one (toy_sign.py: one module, no other file of
hvdcomp changed) works alone, through the exchange on both transports and through the
drop-in optimizer (toy_sign_worker.py on 2 ranks)."""
import dataclasses
import math
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

import hvdcomp
from hvdcomp.errors import WireFormatError
from hvdcomp.wire import Message

from .toy_sign import ToySign

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def test_hand_worked_message_and_decode(make_key):
    g = torch.tensor([0.5, -1.5, 0.0, 2.0, -1.0])         # mean |g| = 1.0
    c = hvdcomp.get("toysign")
    assert isinstance(c, ToySign) and c.spec() == "toysign"
    key = make_key()
    raw = c.encode(g, key).to_bytes()
    msg = Message.from_bytes(raw)
    assert bytes(msg.sections[0]) == np.float32(1.0).tobytes()
    assert bytes(msg.sections[1]) == bytes([0b01101])      # bits 1,0,1,1,0 little-endian
    assert len(msg.sections[0]) + len(msg.sections[1]) == c.message_bytes(g.shape) == 5
    out = torch.full((5,), 0.25)
    assert c.decode(msg, key, out)
    assert out.tolist() == [1.25, -0.75, 1.25, 1.25, -0.75]


def test_malformed_messages_raise(make_key):
    c, key = ToySign(), make_key()
    msg = c.encode(torch.ones(20), key)
    short = dataclasses.replace(msg, sections=(msg.sections[0], msg.sections[1][:2]))
    with pytest.raises(WireFormatError, match="sign bits"):
        c.decode(short, key, torch.zeros(20))
    bad = dataclasses.replace(msg, sections=(np.array([math.inf], dtype=np.float32)
                                             .view(np.uint8), msg.sections[1]))
    with pytest.raises(WireFormatError, match="scale"):
        c.decode(bad, key, torch.zeros(20))


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="mpirun not found")
def test_two_ranks_both_transports_and_the_optimizer(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE, ROOT]),
               HVDCOMP_TEST_OUT=str(tmp_path))
    p = subprocess.run([os.path.join(ROOT, "launch", "run"), "-np", "2", sys.executable,
                        os.path.join(HERE, "toy_sign_worker.py")],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    for r in range(2):
        assert (tmp_path / f"rank{r}.txt").read_text() == "toy OK"
