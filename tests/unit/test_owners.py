"""hvdcomp.exchange.owners without a collective: which open object owns which parameters, the
replacement, the closed object's RuntimeError and the copy's TypeError (the doors' objects
are checked under mpirun and torchrun: tests/mpi/test_mpi_objects.py,
tests/ddp/test_ddp_objects.py)."""
import copy

import pytest
import torch

from hvdcomp.exchange.owners import Door, Owner, agree, record, replaced, take_over

DOOR = Door(label="Thing", prefix="door: ", use_new="use that one", rebuild="build it whole",
            closed="(freed)", copy="a Thing cannot be copied: save state_dict()")


class Thing(Owner):
    DOOR = DOOR

    def __init__(self, ident, named):
        self._ident, self._named, self.closes = ident, named, 0

    def close(self):
        self.closes += 1
        self._closed = True

    def __reduce_ex__(self, protocol):
        raise self._copy_refused()


def _params(n):
    return [(f"p{i}", torch.zeros(1)) for i in range(n)]


def test_replaced_finds_the_owners_of_shared_parameters_and_what_they_would_leave():
    a, b, c = _params(3)
    old1, old2, other = Thing(0, [a, b]), Thing(1, [c]), Thing(2, [("q", torch.zeros(1))])
    closed = Thing(3, [a])
    closed._closed = True
    got = replaced([old1, old2, other, closed], [a], ident=4)
    assert got == {old1: ["p1"]}                 # b is old1's and not the new one's
    assert record(got) == {"0": ["p1"]}
    assert replaced([old1], [a, b], ident=0) == {}          # itself: not replaced
    assert replaced([old1, old2], [a, b, c], ident=4) == {old1: [], old2: []}


def test_take_over_closes_the_old_ones_and_they_name_the_new_one():
    a, b = _params(2)
    old = Thing(0, [a, b])
    take_over(replaced([old], [a, b], 5), 5, rank=1)
    assert old._closed and old.closes == 1 and old._replaced_by == 5
    with pytest.raises(RuntimeError) as e:
        old._check_open()
    assert str(e.value) == ("door: this Thing (number 0) is closed: it was replaced by Thing "
                            "number 5, built on the same parameters: use that one")


def test_take_over_refuses_to_leave_parameters_unexchanged():
    params = _params(8)
    old = Thing(0, params)
    with pytest.raises(ValueError, match=r"door: Thing number 0 \(still open\) exchanges .*"
                       r"\['p1', 'p2', 'p3', 'p4', 'p5'\]\.\.\., .*close\(\) first, or "
                       r"build it whole"):
        take_over(replaced([old], params[:1], 1), 1, rank=0)
    assert not old._closed and old.closes == 0


def test_closed_by_hand_and_copies():
    t = Thing(7, [])
    t._check_open()                                   # open: nothing
    t.close()
    with pytest.raises(RuntimeError, match=r"^door: this Thing \(number 7\) is closed: "
                       r"close\(\) was called$"):
        t._check_open()
    with pytest.raises(TypeError, match=r"save state_dict\(\)"):
        copy.deepcopy(t)


def test_agree_puts_the_parameters_and_the_replaced_objects_in_the_one_handshake():
    class Recorder:                       # Settings.agree's signature, the call kept
        def agree(self, channel, what, **extras):
            self.call = (channel, what, extras)

    a = ("a.w", torch.zeros(2, 3, dtype=torch.float16))
    b = ("b", torch.zeros(4))
    old, unrelated = Thing(0, [a, ("c", torch.zeros(1))]), Thing(1, [("d", torch.zeros(1))])
    settings = Recorder()
    got = agree(settings, "chan", "the test settings", [old, unrelated], [a, b], 2, door="x")
    assert got == {old: ["c"]} and not old._closed   # closed by take_over only
    assert settings.call == ("chan", "the test settings", {
        "door": "x", "replaces": {"0": ["c"]},
        "parameters": [["a.w", [2, 3], "torch.float16"], ["b", [4], "torch.float32"]]})
