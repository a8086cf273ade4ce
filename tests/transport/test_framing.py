"""hvdcomp.transport framing without MPI: frames round-trip, malformed frames raise
WireFormatError, and an error frame makes every rank raise (N ranks as threads of this
process, on the shared Transport code: rounds, exchange, error frames)."""
import struct
import threading

import numpy as np
import pytest
import torch

import hvdcomp
from hvdcomp.transport import (Incoming, Outgoing, Stamp, Transport, check_stamps,
                               error_frame, frame_error, join_frames, split_frames)

HEAD = 4 + 4 + 8 + 4          # magic, count, step (u64), exchange id (u32)


class _World:
    """N ranks in threads: gather(rank, value) returns every rank's value, by rank."""

    def __init__(self, n):
        self.n = n
        self.barrier = threading.Barrier(n, timeout=30)
        self.slots = [None] * n

    def gather(self, rank, value):
        self.slots[rank] = value
        self.barrier.wait()
        out = list(self.slots)
        self.barrier.wait()
        return out


class ThreadTransport(Transport):
    name = "threads"

    def __init__(self, world, rank, max_chunk=0):
        super().__init__(max_chunk)
        self.world, self.rank, self.size = world, rank, world.n
        self.calls = 0

    def _allgather_counts(self, n):
        return self.world.gather(self.rank, n)

    def _allgatherv(self, data, counts):
        self.calls += 1
        got = self.world.gather(self.rank, np.array(data, dtype=np.uint8, copy=True))
        assert [len(g) for g in got] == list(counts)
        return got


def on_ranks(n, fn, max_chunk=0):
    """fn(transport) on n thread-ranks; returns [(result, exception)] by rank."""
    world = _World(n)
    out = [None] * n

    def run(r):
        try:
            out[r] = (fn(ThreadTransport(world, r, max_chunk)), None)
        except BaseException as e:          # noqa: BLE001 - returned to the test
            out[r] = (None, e)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


def _messages(rank):
    """Rank-dependent messages: a QSGD message, a skipped upload (None), an fp32 one."""
    g = torch.Generator().manual_seed(rank)
    return [hvdcomp.get("qsgd:bits=4,bucket_size=64").encode(
                torch.randn(100, generator=g), hvdcomp.TensorKey("w", 0, 3, rank, 3, 5)),
            None,
            hvdcomp.get("none").encode(torch.randn(7, generator=g),
                                       hvdcomp.TensorKey("b", 1, 3, rank, 3, 5))]


# --- join / split ------------------------------------------------------------------------

def test_join_split_round_trip_with_empty_messages():
    msgs = [b"abc", b"", bytes(range(256)) * 3, b"z"]
    frame = join_frames(msgs)
    # header 20, lengths 8 x 4, flags 1, bitmap 1
    assert frame.dtype == np.uint8 and len(frame) == HEAD + 8 * 4 + 2 + sum(map(len, msgs))
    parts, present, joined, stamp = split_frames(frame, 4)
    assert [bytes(p) for p in parts] == msgs and present == [True] * 4 and not joined
    assert stamp == Stamp(0, 0, False)
    assert split_frames(join_frames([]), 0) == ([], [], False, Stamp())


def test_stamp_bytes_and_round_trip():
    stamp = Stamp(step=2**40 + 7, ident=0xDEADBEEF, sync=True)
    frame = join_frames([b"ab"], stamp=stamp)
    # hand-packed: magic, count 1, step u64 LE, id u32 LE, length 2, flags SYNC, bitmap 1
    want = (b"HVDF" + (1).to_bytes(4, "little") + (2**40 + 7).to_bytes(8, "little")
            + (0xDEADBEEF).to_bytes(4, "little") + (2).to_bytes(8, "little") + bytes([2, 1])
            + b"ab")
    assert bytes(frame) == want
    assert split_frames(frame, 1)[3] == stamp
    frame = join_frames([b""], [False], joined=True, stamp=Stamp(3, 1, True))
    assert frame[HEAD + 8] == 3 and split_frames(frame, 1)[2:] == (True, Stamp(3, 1, True))


def test_presence_bitmap_and_joined_flag_round_trip():
    present = [True, False, True, True, False, False, True, False, True]   # 9: two bytes
    msgs = [b"m%d" % i if p else b"" for i, p in enumerate(present)]
    frame = join_frames(msgs, present)
    assert len(frame) == HEAD + 8 * 9 + 1 + 2 + sum(map(len, msgs))
    flags_at = HEAD + 8 * 9
    # bitmap LSB first: byte 0 = bits 0..7 = 1,0,1,1,0,0,1,0 -> 0b01001101, byte 1 = bit 8
    assert list(frame[flags_at:flags_at + 3]) == [0, 0b01001101, 0b00000001]
    parts, got, joined, _ = split_frames(frame, 9)
    assert got == present and not joined and [bytes(p) for p in parts] == msgs
    frame = join_frames([b"", b""], [False, False], joined=True)
    parts, got, joined, _ = split_frames(frame, 2)
    assert frame[HEAD + 16] == 1 and [len(p) for p in parts] == [0, 0]
    assert got == [False, False] and joined
    with pytest.raises(ValueError, match="absent"):
        join_frames([b"x"], [False])
    bad = join_frames([b"x"], [True]).copy()
    bad[HEAD + 8 + 1] = 0                         # clear the bit of a non-empty message
    with pytest.raises(hvdcomp.WireFormatError, match="absent"):
        split_frames(bad, 1)
    bad[HEAD + 8] = 0x80                          # an unknown flag
    with pytest.raises(hvdcomp.WireFormatError, match="flags"):
        split_frames(bad, 1)


@pytest.mark.parametrize("cut", [0, 3, 7, 19])
def test_truncated_header_raises(cut):
    with pytest.raises(hvdcomp.WireFormatError, match="truncated"):
        split_frames(join_frames([b"abc"])[:cut], 1)


def test_truncated_length_table_raises():
    with pytest.raises(hvdcomp.WireFormatError, match="length table"):
        split_frames(join_frames([b"abc", b"de"])[:HEAD + 12], 2)


@pytest.mark.parametrize("delta", [-1, 1])
def test_lengths_not_matching_the_frame_raise(delta):
    frame = join_frames([b"abc", b"de"])
    bad = frame[:-1] if delta < 0 else np.concatenate([frame, np.zeros(1, np.uint8)])
    with pytest.raises(hvdcomp.WireFormatError, match="lengths sum"):
        split_frames(bad, 2)


def test_bad_magic_and_wrong_count_raise():
    frame = join_frames([b"abc"]).copy()
    with pytest.raises(hvdcomp.WireFormatError, match="expected 2"):
        split_frames(frame, 2)
    frame[0] ^= 1
    with pytest.raises(hvdcomp.WireFormatError, match="magic"):
        split_frames(frame, 1)


def test_corrupt_length_raises():
    frame = join_frames([b"abc", b"de"]).copy()
    frame[HEAD:HEAD + 8] = np.frombuffer(struct.pack("<Q", 2**40), np.uint8)
    with pytest.raises(hvdcomp.WireFormatError):
        split_frames(frame, 2)


# --- error frames ------------------------------------------------------------------------

def test_error_frame_round_trip_and_cut():
    assert frame_error(error_frame("ValueError: boom")) == "ValueError: boom"
    assert len(frame_error(error_frame("x" * 10000))) == 4000
    assert frame_error(join_frames([b"abc"])) is None
    assert frame_error(np.zeros(0, np.uint8)) is None


def test_outgoing_failed_carries_the_exception():
    exc = ValueError("boom")
    out = Outgoing.failed(exc)
    assert out.failure is exc and frame_error(out.data) == "ValueError: boom"
    assert len(out) == len(out.data)


# --- Outgoing / Incoming -----------------------------------------------------------------

def test_incoming_parses_every_ranks_messages():
    per_rank = [_messages(r) for r in range(3)]
    inc = Incoming([Outgoing(m).data for m in per_rank], 3)
    assert inc.nbytes == [len(Outgoing(m)) for m in per_rank]
    for i in range(3):
        got = inc.messages(i)
        for r in range(3):
            want = per_rank[r][i]
            assert (got[r] is None) if want is None else got[r].to_bytes() == want.to_bytes()


def test_incoming_corrupt_message_raises_when_parsed():
    data = Outgoing(_messages(0)).data.copy()
    data[-1] ^= 0xFF                              # the last message's CRC
    inc = Incoming([data], 3)
    inc.messages(0)                               # the others are intact
    with pytest.raises(hvdcomp.WireFormatError):
        inc.messages(2)


def test_incoming_wrong_count_raises():
    with pytest.raises(hvdcomp.WireFormatError, match="expected 2"):
        Incoming([Outgoing(_messages(0)).data], 2)


# --- Transport.exchange on N thread-ranks ------------------------------------------------

@pytest.mark.parametrize("max_chunk", [0, 7, 1000])
def test_exchange_delivers_every_ranks_messages(max_chunk):
    def fn(tp):
        inc = tp.exchange(Outgoing(_messages(tp.rank)), what="bucket 0")
        return [[m and m.to_bytes() for m in inc.messages(i)] for i in range(3)], tp.calls

    got = on_ranks(3, fn, max_chunk)
    want = [[m and m.to_bytes() for m in _messages(r)] for r in range(3)]
    for (cols, calls), err in got:
        assert err is None, err
        assert cols == [[want[r][i] for r in range(3)] for i in range(3)]
        assert calls == (1 if max_chunk == 0 else -(-max(len(Outgoing(_messages(r)))
                                                         for r in range(3)) // max_chunk))


def test_error_frame_makes_every_rank_raise():
    def fn(tp):
        if tp.rank == 1:
            out = Outgoing.failed(ValueError("boom on rank 1"))
        else:
            out = Outgoing(_messages(tp.rank))
        return tp.exchange(out, what="bucket 3 (tensors ['w', 'b'])")

    got = on_ranks(3, fn)
    for r, (res, err) in enumerate(got):
        assert res is None
        if r == 1:
            assert isinstance(err, ValueError) and str(err) == "boom on rank 1"
        else:
            assert isinstance(err, hvdcomp.RankFailure) and err.rank == 1, err
            assert ("rank 1 failed to encode bucket 3 (tensors ['w', 'b'])" in str(err)
                    and "ValueError: boom on rank 1" in str(err)), err


def test_check_stamps_names_the_ranks_out_of_step():
    mine = Stamp(5, 2, False)
    check_stamps([mine] * 3, [False] * 3, mine, 0, "bucket 0")
    # a joined rank takes part without a backward pass: its SYNC flag is not compared
    check_stamps([mine, Stamp(5, 2, True), mine], [False, True, False], mine, 0, "bucket 0")
    for other in (Stamp(6, 2, False), Stamp(5, 3, False), Stamp(5, 2, True)):
        with pytest.raises(hvdcomp.OutOfStep) as err:
            check_stamps([mine, other, mine], [False] * 3, mine, 0, "bucket 0")
        assert err.value.ranks == [1] and f"rank 1: {other.describe()}" in str(err.value)


@pytest.mark.parametrize("sync", [False, True])
def test_a_rank_out_of_step_raises_on_every_rank(sync):
    """Rank 2 exchanges step 4 (or step 3 started by step() instead of backward) while the
    others exchange step 3: every rank raises OutOfStep naming the other side."""
    def fn(tp):
        stamp = Stamp(3, 0, False)
        if tp.rank == 2:
            stamp = Stamp(3, 0, True) if sync else Stamp(4, 0, False)
        return tp.exchange(Outgoing(_messages(tp.rank), stamp=stamp), what="bucket 0")

    got = on_ranks(3, fn)
    for r, (res, err) in enumerate(got):
        assert res is None and isinstance(err, hvdcomp.OutOfStep), (r, err)
        assert err.ranks == ([0, 1] if r == 2 else [2]), (r, err.ranks)


def test_frame_of_messages_is_the_frame_of_their_bytes():
    # join_frames serializes Message items straight into the frame: the same bytes as the
    # frame of their to_bytes(), with None and b"" as zero-length messages; with alloc it
    # writes into the memory it is given
    msgs = [hvdcomp.get("none").encode(torch.arange(5.0) - k, hvdcomp.compressors.TensorKey(
        f"t{k}", k, 3, 0, 2, 1)) for k in range(3)]
    stamp = Stamp(7, 2, True)
    mixed = [msgs[0], None, msgs[1], b"xyz", msgs[2]]
    as_bytes = [msgs[0].to_bytes(), b"", msgs[1].to_bytes(), b"xyz", msgs[2].to_bytes()]
    want = join_frames(as_bytes, joined=False, stamp=stamp)
    assert join_frames(mixed, stamp=stamp).tobytes() == want.tobytes()
    pool = np.zeros(len(want) + 8, dtype=np.uint8)
    got = join_frames(mixed, stamp=stamp, alloc=lambda n: pool[:n])
    assert got.tobytes() == want.tobytes() and np.shares_memory(got, pool)
    parts, present, joined, st = split_frames(got, 5)
    assert [p.tobytes() for p in parts] == as_bytes and st == stamp
    with pytest.raises(ValueError, match="marked absent"):
        join_frames(mixed, present=[True, True, False, True, True])
