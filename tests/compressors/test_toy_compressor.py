"""A compressor added the way a user adds one (toy_sign.py: one module, no other file of
hvdcomp changed) works alone; through the exchange over both collectives (the reduce-scatter
because it declares its shard unit), on ranks as threads here and on both transports under
mpirun; through both doors: the drop-in optimizer under mpirun (toy_sign_worker.py) and the
DDP hook under torchrun (toy_sign_ddp_worker.py), on 2 ranks.  Expected values: the closed
forms of toy_sign_reference.py, computed in one process."""
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
from .toy_sign_reference import close, closed_form, closed_form_rs, cuts

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "exchange"))
from world import run_ranks  # noqa: E402

from hvdcomp.exchange import Exchange  # noqa: E402
from hvdcomp.exchange.shards import refusal  # noqa: E402

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


def test_reduce_scatter_cut_and_closed_form_by_hand():
    assert cuts(7, 2) == [0, 4, 7] and cuts(1, 2) == [0, 1, 1] and cuts(10, 3) == [0, 3, 7, 10]
    g0 = torch.tensor([1.0, -3.0, 2.0, 2.0, -4.0])    # shard 0: [0, 3), shard 1: [3, 5)
    g1 = torch.tensor([-1.0, 1.0, 1.0, 6.0, 2.0])
    # shard 0: s = 2, 1 -> a = ((2 - 1) / 2, (-2 + 1) / 2, (2 + 1) / 2) = (.5, -.5, 1.5)
    #          mean |a| = 5/6 -> (5/6, -5/6, 5/6)
    # shard 1: s = 3, 4 -> a = ((3 + 4) / 2, (-3 + 4) / 2) = (3.5, .5) -> mean |a| = 2
    want = torch.tensor([5 / 6, -5 / 6, 5 / 6, 2.0, 2.0], dtype=torch.float64)
    assert torch.allclose(closed_form_rs([g0, g1]), want, rtol=0, atol=1e-12)


SHAPES = {"w": (7, 13), "b": (13,), "c": (3, 1, 5, 5), "one": (1,)}


def _grad(name, rank, step):
    g = torch.Generator().manual_seed(1000 * step + 37 * rank + sum(map(ord, name)))
    x = torch.randn(SHAPES[name], generator=g)
    x.view(-1)[0] = 0.0
    return x


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("collective", ["allgather", "reduce_scatter"])
def test_both_collectives_on_ranks_as_threads(size, collective):
    """The exchange core with ToySign over each collective (fusion_bytes=1: a bucket per
    tensor, cut alone) gives every rank the closed form of every rank's gradients."""
    assert refusal(ToySign()) is None

    def fn(rank, tp):
        params = [(n, torch.nn.Parameter(torch.zeros(s))) for n, s in SHAPES.items()]
        ex = Exchange(params, ToySign(), tp, fusion_bytes=1, min_compress_numel=1,
                      compress_1d=True, seed=5, collective=collective)
        out = []
        try:
            assert set(ex.plan.paths().values()) == {collective}
            for step in (0, 1):
                for n, p in params:
                    p.grad = _grad(n, rank, step)
                ex.begin(step)
                for n in SHAPES:
                    ex.ready(n)
                res, _ = ex.finish()
                out.append({n: r.detach().clone() for n, r in res.items()})
        finally:
            ex.close()
        return out

    got = run_ranks(size, fn)
    want_of = closed_form if collective == "allgather" else closed_form_rs
    for r in range(size):
        assert not isinstance(got[r], BaseException), got[r]
        for step in (0, 1):
            for n in SHAPES:
                want = want_of([_grad(n, q, step) for q in range(size)])
                assert close(got[r][step][n], want), (r, step, n)
                assert torch.equal(got[r][step][n], got[0][step][n])


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


def test_two_ranks_through_the_ddp_hook(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE, ROOT]), OMP_NUM_THREADS="1",
               HVDCOMP_TEST_OUT=str(tmp_path))
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        "--nproc_per_node", "2", os.path.join(HERE, "toy_sign_ddp_worker.py")],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    for r in range(2):
        assert (tmp_path / f"ddp{r}.txt").read_text() == "toy OK"
