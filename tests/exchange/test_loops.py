"""The exchange core on N ranks as threads of this process (issue 14's core parts): which
gradients exist (absent everywhere: no average; absent on some ranks: zeros from them),
ranks that have joined (averages over the others), sparse gradients as indices and values,
casts that keep their range, and the frozen parameters' buckets; both paths (wire messages
and the summable carrier).  Expected values are plain torch arithmetic."""
import threading

import numpy as np
import pytest
import torch

import hvdcomp
from hvdcomp.exchange import Exchange
from hvdcomp.exchange.buckets import fuse
from hvdcomp.exchange.plan import keep_range
from hvdcomp.transport import Allreduce, Transport


class World:
    def __init__(self, n):
        self.n = n
        self.barrier = threading.Barrier(n, timeout=30)
        self.slots = {}

    def gather(self, rank, tag, value):
        self.slots[(tag, rank)] = value
        self.barrier.wait()
        out = [self.slots[(tag, r)] for r in range(self.n)]
        self.barrier.wait()
        return out


class Threads(Transport):
    name = "threads"

    def __init__(self, world, rank):
        super().__init__()
        self.world, self.rank, self.size = world, rank, world.n

    def _allgather_counts(self, n):
        return self.world.gather(self.rank, "ag", n)

    def _allgatherv(self, data, counts):
        return self.world.gather(self.rank, "ag", np.array(data, dtype=np.uint8, copy=True))

    def allreduce_sum(self, arr):
        return np.sum(self.world.gather(self.rank, "ar", np.asarray(arr, np.float64)), axis=0)

    def broadcast(self, arr, root=0):
        return self.world.gather(self.rank, "bc", np.array(arr, copy=True))[root]


class Sums(Allreduce):
    """In-place sums in rank order (float32 and float16), synchronous."""
    dtypes = (torch.float32, torch.float16)
    prefix = "t"

    def __init__(self, world, rank):
        self.world, self.rank = world, rank

    def start(self, buf, name):
        got = self.world.gather(self.rank, "sum", buf.clone())
        total = got[0].clone()
        for g in got[1:]:
            total += g
        buf.copy_(total)
        return None

    def wait(self, handle):
        pass


def on_ranks(n, fn):
    """fn(rank, transport, allreduce) on n thread-ranks; results (or exceptions) by rank."""
    world = World(n)
    out = [None] * n

    def run(r):
        try:
            out[r] = fn(r, Threads(world, r), Sums(world, r))
        except BaseException as e:          # noqa: BLE001 - returned to the test
            out[r] = e

    threads = [threading.Thread(target=run, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    return out


def _grad(name, rank, shape=(8, 8), dtype=torch.float32):
    g = torch.Generator().manual_seed(rank * 101 + sum(map(ord, name)))
    return torch.randn(shape, generator=g).to(dtype)


def _exchange(rank, tp, ar, spec, names, summable, **kw):
    params = [(n, torch.nn.Parameter(torch.zeros(8, 8))) for n in names]
    ex = Exchange(params, hvdcomp.get(spec), tp, allreduce=ar if summable else None,
                  min_compress_numel=16, **kw)
    return ex, dict(params)


@pytest.mark.parametrize("summable", [False, True])
@pytest.mark.parametrize("spec", ["none", "qsgd:bits=4,bucket_size=16"])
def test_absent_everywhere_has_no_average_and_absent_somewhere_counts_zeros(spec, summable):
    n = 3

    def fn(rank, tp, ar):
        ex, p = _exchange(rank, tp, ar, spec, ["a", "b", "c"], summable)
        p["a"].grad = _grad("a", rank)                          # everywhere
        p["b"].grad = _grad("b", rank) if rank == 1 else None   # rank 1 only
        ex.begin(0)                                             # c: nowhere
        res, stats = ex.finish()
        ex.close()
        return {k: v.clone() for k, v in res.items()}, ex

    got = on_ranks(n, fn)
    for r in range(n):
        assert not isinstance(got[r], BaseException), got[r]
        res, ex = got[r]
        assert sorted(res) == ["a", "b"]
        if spec == "none":
            want_b = (_grad("b", 1) / n).reshape(-1)              # zeros from ranks 0 and 2
            want_a = sum(_grad("a", q) for q in range(n)).reshape(-1) / n
            assert torch.allclose(res["b"], want_b, atol=1e-7), r
            assert torch.allclose(res["a"], want_a, atol=1e-6), r
        else:                                   # rank 1's message alone, averaged over n
            e = ex.entries["b"]
            acc = torch.zeros(64)
            key = hvdcomp.TensorKey("b", e.tensor_id, 0, 1, n, 0)
            e.compressor.decode(e.compressor.encode(_grad("b", 1), key), key, acc)
            assert torch.equal(res["b"], acc / n), r
        assert torch.equal(res["b"], got[0][0]["b"])              # every rank the same


@pytest.mark.parametrize("summable", [False, True])
@pytest.mark.parametrize("spec", ["none", "qsgd:bits=4,bucket_size=16"])
def test_call_writes_the_averages_into_out_where_it_serves(spec, summable):
    """Exchange.call's ``out`` (the DDP hook's bucket views): a contiguous float32 tensor of
    the parameter's size receives the average itself (its old contents ignored), bit for
    bit the average of the same call without ``out``; any other (float16, another size) is
    left alone and the average comes in the exchange's own buffer."""
    n, names = 2, ["a", "b", "c"]

    def fn(rank, tp, ar):
        params = [(m, torch.nn.Parameter(torch.zeros(8, 8))) for m in names]
        ex = Exchange(params, hvdcomp.get(spec), tp, allreduce=ar if summable else None,
                      min_compress_numel=16, fusion_bytes=None)
        grads = {m: _grad(m, rank) for m in names}
        out = {"a": torch.full((8, 8), float("nan")),              # served: overwritten
               "b": torch.full((8, 8), 7.0, dtype=torch.float16),  # not float32
               "c": torch.full((65,), 7.0)}                       # not its size
        got, finished = [], threading.Event()

        def done(res, stats, err):
            got.append((err, dict(res), {m: v.clone() for m, v in res.items()}))
            finished.set()

        for dest in (None, out):
            finished.clear()
            ex.call(0, names, grads, 0, done, out=dest)
            assert finished.wait(30)
        ex.close()
        return got, out

    for r, res in enumerate(on_ranks(n, fn)):
        assert not isinstance(res, BaseException), res
        (err1, _, plain), (err2, live, into), out = *res[0], res[1]
        assert err1 is None and err2 is None
        assert sorted(plain) == sorted(into) == names
        for m in names:
            assert torch.equal(plain[m], into[m]), (r, m)
            if spec == "none":
                want = sum(_grad(m, q) for q in range(n)).reshape(-1) / n
                assert torch.allclose(plain[m], want, atol=1e-6), (r, m)
        assert live["a"].data_ptr() == out["a"].data_ptr()
        assert torch.equal(out["a"].reshape(-1), plain["a"])
        assert live["b"].data_ptr() != out["b"].data_ptr()
        assert live["c"].data_ptr() != out["c"].data_ptr()
        assert bool((out["b"] == 7).all()) and bool((out["c"] == 7).all())


@pytest.mark.parametrize("summable", [False, True])
def test_joined_ranks_are_left_out_of_the_average(summable):
    n = 4

    def fn(rank, tp, ar):
        ex, p = _exchange(rank, tp, ar, "none", ["a"], summable)
        p["a"].grad = _grad("a", rank)
        ex.begin(0, joined=rank in (0, 2))
        res, stats = ex.finish()
        ex.close()
        return res.get("a"), stats.joined

    got = on_ranks(n, fn)
    want = (_grad("a", 1) + _grad("a", 3)).reshape(-1) / 2
    for r in range(n):
        assert not isinstance(got[r], BaseException), got[r]
        avg, joined = got[r]
        assert joined == 2 and torch.allclose(avg, want, atol=1e-7), r


def test_all_joined_is_seen_by_every_rank():
    def fn(rank, tp, ar):
        ex, p = _exchange(rank, tp, ar, "qsgd:bits=4,bucket_size=16", ["a"], False)
        ex.begin(5, joined=True)
        res, stats = ex.finish()
        ex.close()
        return res, stats.joined

    for got in on_ranks(3, fn):
        assert got == ({}, 3)


def test_ndqsg_refuses_a_tensor_that_some_ranks_lack_on_every_rank():
    def fn(rank, tp, ar):
        params = [("w", torch.nn.Parameter(torch.zeros(16, 16)))]
        ex = Exchange(params, hvdcomp.get("ndqsg"), tp, min_compress_numel=16)
        params[0][1].grad = None if rank == 2 else _grad("w", rank, (16, 16))
        ex.begin(0)
        try:
            ex.finish()
        finally:
            ex.close()

    for err in on_ranks(4, fn):
        assert isinstance(err, ValueError) and "ranks [2] had none" in str(err), err


@pytest.mark.parametrize("summable", [False, True])
@pytest.mark.parametrize("spec", ["none", "qsgd:bits=4,bucket_size=16"])
def test_sparse_gradients_travel_as_indices_and_values(spec, summable):
    n = 3

    def sparse_grad(rank):
        g = torch.Generator().manual_seed(rank)
        rows = torch.randint(0, 10, (5,), generator=g)
        return torch.sparse_coo_tensor(rows.view(1, -1), torch.randn(5, 4, generator=g),
                                       (10, 4), check_invariants=True)

    def fn(rank, tp, ar):
        params = [("emb", torch.nn.Parameter(torch.zeros(10, 4))),
                  ("w", torch.nn.Parameter(torch.zeros(8, 8)))]
        ex = Exchange(params, hvdcomp.get(spec), tp, allreduce=ar if summable else None,
                      min_compress_numel=16)
        params[0][1].grad = sparse_grad(rank) if rank != 1 else None    # absent on rank 1
        params[1][1].grad = _grad("w", rank)
        ex.begin(0)
        res, _ = ex.finish()
        ex.close()
        return res

    want = sum(sparse_grad(r).to_dense() for r in (0, 2)) / n
    for res in on_ranks(n, fn):
        assert not isinstance(res, BaseException), res
        assert res["emb"].is_sparse and res["emb"].shape == (10, 4)
        assert torch.allclose(res["emb"].to_dense(), want, atol=1e-7)
        # each rank's rows coalesced, then concatenated in rank order (not coalesced)
        assert torch.equal(res["emb"]._indices(), torch.cat(
            [sparse_grad(r).coalesce().indices() for r in (0, 2)], 1))


def test_sparse_on_some_ranks_dense_on_others_raises_on_every_rank():
    def fn(rank, tp, ar):
        params = [("emb", torch.nn.Parameter(torch.zeros(10, 4)))]
        ex = Exchange(params, hvdcomp.get("none"), tp, allreduce=ar, min_compress_numel=16)
        dense = torch.ones(10, 4)
        params[0][1].grad = dense.to_sparse() if rank == 0 else dense
        ex.begin(0)
        try:
            ex.finish()
        finally:
            ex.close()

    for err in on_ranks(2, fn):
        assert isinstance(err, RuntimeError) and "sparse on some ranks" in str(err), err


def test_sparse_as_dense_densifies():
    def fn(rank, tp, ar):
        params = [("emb", torch.nn.Parameter(torch.zeros(10, 4)))]
        ex = Exchange(params, hvdcomp.get("none"), tp, allreduce=None, min_compress_numel=16,
                      sparse_as_dense=True)
        params[0][1].grad = torch.ones(10, 4).to_sparse() * (rank + 1)
        ex.begin(0)
        res, _ = ex.finish()
        ex.close()
        return res["emb"]

    for avg in on_ranks(2, fn):
        assert not avg.is_sparse and torch.equal(avg, torch.full((40,), 1.5))


@pytest.mark.parametrize("summable", [False, True])
@pytest.mark.parametrize("spec,dtype,big", [
    ("fp16", torch.bfloat16, [70000.0, 3e38]),     # sent as bf16; the float32 sum overflows
    ("fp16", torch.float32, [1e6, -4e5]),          # beyond fp16: sent as float32 values
    ("none", torch.float32, [3e38, -3e38]),        # the float32 sum overflows
    ("bf16", torch.float32, [3.4e38, 1.0]),        # rounds to Inf in bf16
])
def test_casts_keep_their_range(spec, dtype, big, summable):
    n = 2
    grads = []
    for r in range(n):
        x = _grad("w", r)
        x.view(-1)[:2] = torch.tensor(big)
        grads.append(x.to(dtype))

    def fn(rank, tp, ar):
        params = [("w", torch.nn.Parameter(torch.zeros(8, 8, dtype=dtype)))]
        ex = Exchange(params, hvdcomp.get(spec), tp, allreduce=ar if summable else None,
                      min_compress_numel=16)
        params[0][1].grad = grads[rank]
        ex.begin(0)
        res, stats = ex.finish()
        ex.close()
        return res["w"].clone(), stats.nonfinite, ex.entries["w"].compressor.name

    want = (sum(g.double() for g in grads) / n).reshape(-1)
    for avg, nonfinite, name in on_ranks(n, fn):
        assert torch.isfinite(avg).all() and nonfinite == []
        assert torch.allclose(avg.double(), want, rtol=8e-3, atol=1e-2)
        assert name == ("bf16" if spec == "fp16" and dtype == torch.bfloat16 else spec)


def test_a_non_finite_gradient_still_gives_nan_on_every_rank():
    def fn(rank, tp, ar):
        params = [("w", torch.nn.Parameter(torch.zeros(8, 8)))]
        ex = Exchange(params, hvdcomp.get("fp16"), tp, allreduce=ar, min_compress_numel=16)
        g = _grad("w", rank)
        if rank == 1:
            g[0, 0] = float("inf")
        params[0][1].grad = g
        ex.begin(0)
        res, stats = ex.finish()
        ex.close()
        return res["w"], stats.nonfinite

    for avg, nonfinite in on_ranks(2, fn):
        assert torch.isnan(avg).all() and nonfinite == ["w"]


def test_keep_range_sends_bfloat16_as_bf16():
    fp16 = hvdcomp.get("fp16")
    assert keep_range(fp16, torch.zeros(2, dtype=torch.bfloat16)).name == "bf16"
    assert keep_range(fp16, torch.zeros(2)) is fp16
    assert keep_range(fp16, torch.zeros(2, dtype=torch.float16)) is fp16


def test_frozen_parameters_fill_the_last_buckets():
    a = torch.nn.Parameter(torch.zeros(10))
    b = torch.nn.Parameter(torch.zeros(10), requires_grad=False)
    c = torch.nn.Parameter(torch.zeros(10))
    d = torch.nn.Parameter(torch.zeros(10), requires_grad=False)
    named = [("a", a), ("b", b), ("c", c), ("d", d)]
    assert fuse(named, 1000) == [["c", "a"], ["d", "b"]]
    assert fuse(named, 1) == [["c"], ["a"], ["d"], ["b"]]


def test_coo_messages_are_validated():
    from hvdcomp.exchange import coo
    from hvdcomp.wire import Message
    key = hvdcomp.TensorKey("emb", 3, 7, 1, 2, 5)
    g = torch.sparse_coo_tensor(torch.tensor([[1, 4, 4]]), torch.arange(6.).view(3, 2),
                                (6, 2), check_invariants=True)
    msg = Message.from_bytes(coo.encode(g, key).to_bytes())
    assert msg.codec_name == "coo" and msg.bucket_size == 1 and msg.shape == (6, 2)
    res, finite = coo.combine([msg], [key], (6, 2), torch.float32, 2.0, "cpu")
    assert finite and torch.equal(res.to_dense(), g.to_dense() / 2)
    row5 = coo.encode(torch.sparse_coo_tensor(torch.tensor([[5]]), torch.ones(1, 2),
                                              (6, 2), check_invariants=True), key)
    with pytest.raises(hvdcomp.WireFormatError, match="outside the shape"):   # row 5 of 1
        coo.combine([Message(**{**row5.__dict__, "shape": (1, 2)})], [key], (1, 2),
                    torch.float32, 1.0, "cpu")
    short = Message(**{**msg.__dict__, "sections": (msg.sections[0], msg.sections[1][:-4])})
    with pytest.raises(hvdcomp.WireFormatError, match="values"):
        coo.combine([short], [key], (6, 2), torch.float32, 1.0, "cpu")
    with pytest.raises(hvdcomp.WireFormatError, match="step"):
        coo.combine([msg], [hvdcomp.TensorKey("emb", 3, 8, 1, 2, 5)], (6, 2),
                    torch.float32, 1.0, "cpu")
    # fields coo does not use must be zero (#15 item 4)
    for field, value, match in (("bits", 3, "bits"), ("level_version", 1, "level"),
                                ("flags", 1, "flags"), ("flags", 2, "flags")):
        with pytest.raises(hvdcomp.WireFormatError, match=match):
            coo.combine([Message(**{**msg.__dict__, field: value})], [key], (6, 2),
                        torch.float32, 1.0, "cpu")
    nan = torch.sparse_coo_tensor(torch.tensor([[0]]), torch.tensor([[float("nan"), 1.0]]),
                                  (6, 2), check_invariants=True)
    res, finite = coo.combine([coo.encode(nan, key)], [key], (6, 2), torch.float32, 1.0, "cpu")
    assert not finite and torch.isnan(res._values()).all()
