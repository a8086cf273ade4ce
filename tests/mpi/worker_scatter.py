"""The reduce-scatter collective on N ranks (2, 3, 4), both transports: every compressor's
result equals, bit for bit on every rank, a single-process computation of the same messages
(tests/mpi/scatter_reference.py); the drop-in optimizer with it (DGC's momentum by piece,
ALQ's refit, a state_dict round trip); bad input (a malformed shard, an encoder error,
ranks disagreeing on the collective): every rank raises, none waits."""
import math

import torch
import torch.nn.functional as F

from common import SPECS, golden_grad, params, say
from scatter_reference import Reference

import horovod.torch as horovod
import hvdcomp
import hvdcomp.torch as hvd
from hvdcomp.exchange import Exchange
from hvdcomp.transport import HorovodAllreduce
from hvdcomp.transport import make

COMPRESSORS = ["qsgd:bits=4,bucket_size=512", "qsgdinf:bits=3,bucket_size=100",
               "nuqsgd:bits=2,bucket_size=1000", "alq:bits=3,bucket_size=512",
               "amq:bits=3,bucket_size=8192", "terngrad", "signef:bucket_size=300",
               "psq:bits=4", "bhq:bits=4,block_size=4", "dqsg:bits=4,bucket_size=512",
               "topk:density=0.05", "dgc:density=0.05,clip_norm=5", "randk:density=0.1"]
SHAPES = {n: s for n, (s, _) in SPECS.items()}


def run(ex, rank, step):
    for name, e in ex.entries.items():
        e.param.grad = golden_grad(name, rank)
    ex.begin(step)
    names = list(ex.entries)
    for name in (names if rank % 2 == 0 else names[::-1]):
        ex.ready(name)
    res, stats = ex.finish()
    return {n: t.clone() for n, t in res.items()}, stats


def same_everywhere(t):
    got = horovod.allgather_object(t.tolist())
    return all(g == got[0] for g in got)


def check_compressors(rank, size):
    checked = 0
    for spec in COMPRESSORS:
        by_transport = []
        for tname in ("mpi", "horovod"):
            ex = Exchange(params(), hvdcomp.get(spec), make(tname),
                          allreduce=HorovodAllreduce(horovod), fusion_bytes=20000,
                          min_compress_numel=16, seed=3, collective="reduce_scatter")
            ex.set_momentum({n: 0.9 for n in SPECS})
            lay = ex.collective.layout
            scattered = {n for n, e in ex.entries.items() if e.scatter}
            assert scattered == {n for n, (s, d) in SPECS.items() if len(s) > 1
                                 and math.prod(s) >= 16}, scattered
            ref = Reference(spec, size, seed=3)
            ref.set_momentum({p.label: 0.9 for b in lay for m in b for p in m})
            results = []
            for step in (0, 5):
                res, stats = run(ex, rank, step)
                grads = [{n: golden_grad(n, r) for n in SPECS} for r in range(size)]
                want = ref.step(lay, {n: SHAPES[n] for n in scattered}, grads, step)
                for n in scattered:
                    assert torch.equal(torch.nan_to_num(res[n], nan=7.5),
                                       torch.nan_to_num(want[n], nan=7.5)), \
                        (spec, tname, step, n, (res[n] - want[n]).abs().max())
                    checked += 1
                assert stats.nonfinite == ["nan.weight"], stats.nonfinite
                assert same_everywhere(torch.nan_to_num(res["fc1.weight"]))
                results.append(res)
            ex.close()
            by_transport.append(results)
        for a, b in zip(*by_transport):
            for n in SPECS:
                assert torch.equal(torch.nan_to_num(a[n]), torch.nan_to_num(b[n])), (spec, n)
    return checked


def model_fn():
    torch.manual_seed(11)
    return torch.nn.Sequential(torch.nn.Linear(40, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))


def train(spec, steps, rank, **kw):
    model = model_fn()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters(),
                                   compression=spec, min_compress_numel=16, **kw)
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(16, 40, generator=g), torch.randint(0, 4, (16,), generator=g)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return model, opt


def check_optimizer(rank, size):
    # DGC over the reduce-scatter: the momentum reaches the pieces (u is kept by piece),
    # parameters identical on every rank, the second stage's residuals round-trip.
    model, opt = train("rs+dgc:density=0.05", 3, rank)
    assert opt.paths["0.weight"] == "reduce_scatter" and opt.paths["0.bias"] == "allreduce"
    comp = opt.compression
    labels = [p.label for p in opt._driver.exchange.collective.pieces()]
    assert labels and all(comp.momentum_of(lb) == 0.9 for lb in labels)
    assert any(comp.momentum_buffer(lb) is not None for lb in labels)
    for p in model.parameters():
        assert same_everywhere(p.detach())
    sd = opt.state_dict()
    st2 = sd["hvdcomp"]["second_stage_state"]
    assert len(st2) == 1 and any(k.endswith("/avg") for k in st2[0]["v"]) == bool(
        opt._driver.exchange.collective.layout[0][rank])
    _, opt2 = train("dgc:density=0.05", 0, rank, collective="reduce_scatter")
    opt2.load_state_dict(sd)
    for k, t in st2[0]["v"].items():
        assert torch.equal(opt2._driver.exchange.second_stages()[0].accumulation(k), t)
    _, opt3 = train("dgc:density=0.05", 0, rank)                      # allgather: refused
    try:
        opt3.load_state_dict(sd)
        raise AssertionError("a reduce-scatter checkpoint loaded into an allgather optimizer")
    except ValueError as e:
        assert "second-stage" in str(e)
    # ALQ: statistics from whole gradients, tables identical on every rank, versions bumped
    model, opt = train("rs+alq:bits=3,bucket_size=512,refit_steps=1/2", 3, rank)
    assert opt.compression.level_version == 2
    assert same_everywhere(opt.compression.levels)
    for p in model.parameters():
        assert same_everywhere(p.detach())
    # the setting and the spec string must agree
    try:
        train("rs+alq", 0, rank, collective="allgather")
        raise AssertionError("a contradiction was accepted")
    except hvdcomp.ConfigError as e:
        assert "contradicts" in str(e)


def check_bad_input(rank, size):
    class Corrupt(hvdcomp.QSGD):
        on = True

        def encode(self, grad, key):
            msg = super().encode(grad, key)
            if Corrupt.on and key.rank == 1 and "/avg" not in key.name:
                return _Raw(bytes(msg.to_bytes()[:-1]) + b"\0")       # a bad CRC
            return msg

    for tname in ("mpi", "horovod"):
        Corrupt.on = True
        ex = Exchange(params(), Corrupt(bits=4, bucket_size=512), make(tname),
                      allreduce=HorovodAllreduce(horovod), fusion_bytes=20000,
                      min_compress_numel=16, seed=3, collective="reduce_scatter")
        try:
            run(ex, rank, 0)
            raise AssertionError("a malformed shard was accepted")
        except hvdcomp.WireFormatError:
            pass                                        # an owner that got one
        except RuntimeError as e:
            assert "failed to encode the averaged shards" in str(e), e
        Corrupt.on = False
        res, _ = run(ex, rank, 1)                       # the next step works
        assert same_everywhere(res["fc1.weight"])
        ex.close()
    # ranks disagreeing on the collective: refused at the handshake, on every rank
    try:
        Exchange(params(), hvdcomp.get("qsgd"), make("mpi"), allreduce=HorovodAllreduce(horovod),
                 min_compress_numel=16,
                 collective="reduce_scatter" if rank == size - 1 else "allgather")
        raise AssertionError("disagreeing ranks were not detected")
    except RuntimeError as e:
        assert "disagree" in str(e) and "collective" in str(e), e


class _Raw:
    def __init__(self, b):
        self.b = b

    def to_bytes(self):
        return self.b


def main():
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    checked = check_compressors(rank, size)
    check_optimizer(rank, size)
    check_bad_input(rank, size)
    say(rank, f"scatter OK ({checked} tensors bit-exact)")


if __name__ == "__main__":
    main()
