"""hvdcomp.exchange.frames, the frame helpers both collectives use, and the reduce-scatter
holding an allgather rather than being one."""
import torch

import hvdcomp
from hvdcomp.compressors import TensorKey
from hvdcomp.compressors.protocols import ReportsEvents
from hvdcomp.exchange import Allgather, Collective, Exchange, ReduceScatter
from hvdcomp.exchange.frames import drain_events, frame, observe
from hvdcomp.transport import Incoming, Stamp
from hvdcomp.transport.framing import split_frames

from world import run_ranks


def _key(i):
    return TensorKey(f"t{i}", i, 7, 0, 2, 3, shape=(5,), dtype=torch.float32)


def test_frame_holds_a_message_per_present_item_in_order():
    comp = hvdcomp.get("none")
    grads = {0: torch.arange(5.0), 1: None, 2: -torch.arange(5.0)}
    encoded = []

    def encode(i, g):
        encoded.append(i)
        return comp.encode(g, _key(i))

    out = frame([0, 1, 2], grads.get, encode, joined=True, stamp=Stamp(7, 9, True))
    assert encoded == [0, 2]                      # no encode for the absent item
    parts, present, joined, stamp = split_frames(out.data, 3)
    assert present == [True, False, True] and joined and stamp == Stamp(7, 9, True)
    assert len(parts[1]) == 0
    for i in (0, 2):
        assert parts[i].tobytes() == comp.encode(grads[i], _key(i)).to_bytes()
    # and read back: message 0 of "rank 0" decodes to the gradient
    inc = Incoming([out.data], 3)
    acc = torch.zeros(5)
    comp.decode(inc.message(0, 2), _key(2), acc)
    assert torch.equal(acc, grads[2])


class _Recorder:
    """Stands for an adaptive compressor: records what it observes, collects at even steps."""

    def __init__(self):
        self.seen = []

    def wants_stats(self, step):
        return step % 2 == 0

    def observe(self, g):
        self.seen.append(g)


def test_observe_takes_finite_float_gradients_of_the_steps_that_collect():
    from hvdcomp.compressors.protocols import AdaptiveLevels
    rec = type("Rec", (_Recorder, AdaptiveLevels), {})()
    g = torch.ones(3)
    observe(rec, g, 0)
    observe(rec, g, 1)                                        # not a collecting step
    observe(rec, torch.tensor([1.0, float("inf")]), 2)        # not finite
    observe(rec, torch.ones(3, dtype=torch.int64), 2)          # not floating point
    assert rec.seen == [g]
    plain = _Recorder()                                       # not AdaptiveLevels
    observe(plain, g, 0)
    assert plain.seen == []


def test_drain_events_labels_and_empties():
    class Noisy(ReportsEvents):
        pass

    c = Noisy()
    c._events = ["side information too far", "again"]
    assert drain_events(c, "w") == ["w: side information too far", "w: again"]
    assert drain_events(c, "w") == []
    assert drain_events(hvdcomp.get("none"), "w") == []


def test_reduce_scatter_holds_an_allgather_and_shares_its_failure_state():
    assert issubclass(ReduceScatter, Collective) and not issubclass(ReduceScatter, Allgather)

    def fn(rank, tp):
        p = torch.nn.Parameter(torch.zeros(64, 128))
        ex = Exchange([("w", p)], hvdcomp.get("qsgd:bits=4,bucket_size=512"), tp,
                      min_compress_numel=0, seed=3, collective="reduce_scatter")
        c = ex.collective
        got = (type(c.allgather) is Allgather, c.failing, c.failure_seen)
        c.failing = "stopping"
        c.allgather.failure_seen = True
        got += (c.allgather.failing, c.failure_seen)
        c.failing, c.failure_seen = None, False       # the exchange closes cleanly
        ex.close()
        return got

    for got in run_ranks(2, fn):
        assert got == (True, None, False, "stopping", True), got
