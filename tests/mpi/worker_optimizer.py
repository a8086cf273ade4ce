"""The drop-in optimizer on N ranks: its step equals a hand-computed averaged step; ALQ
refits give an identical level table on every rank; state round-trips; Horovod's own
optimizer refuses to sum hvdcomp codes; disagreeing ranks get a clear error, not a hang."""
import time

import torch
import torch.nn.functional as F

from common import (LR, assert_params, local_grads, mlp, reference_grads, sent_paths,
                    sgd_reference)
from cases import case, run

import hvdcomp
import hvdcomp.torch as hvd

SPECS = ["none", "fp16", "qsgd:bits=4,bucket_size=64", "alq:bits=3,bucket_size=64"]
TRANSPORTS = ["mpi", "horovod"]


def batch(rank, step, bp=0):
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + bp)
    return torch.randn(8, 20, generator=g), torch.randint(0, 4, (8,), generator=g)


def expected_step(model, opt, step, bpps=1):
    """p - lr * average over ranks of decode(encode(g_r)), computed in this one process."""
    grads = [local_grads(model, [batch(r, step, bp) for bp in range(bpps)])
             for r in range(hvd.size())]
    return sgd_reference(model, reference_grads(model, opt, step, grads))


def train_steps(spec, transport, steps, bpps=1, **kw):
    rank = hvd.rank()
    model = mlp()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR),
                                   named_parameters=model.named_parameters(),
                                   compression=spec, transport=transport,
                                   backward_passes_per_step=bpps, min_compress_numel=16,
                                   **kw)
    for step in range(steps):
        want = expected_step(model, opt, step, bpps)
        sent = sent_paths(opt)       # (a per-layer Auto's plan changes them in step 0)
        opt.zero_grad()
        for bp in range(bpps):
            x, y = batch(rank, step, bp)
            F.cross_entropy(model(x), y).backward()
        opt.step()
        # summed by Horovod in MPI's order (fp16 sums in fp16) or decoded in rank order
        assert_params(model, opt, want, (spec, transport, step), atol=1e-7, atol_fp16=1e-4,
                      sent=sent)
    return model, opt


class _Recording(hvdcomp.QSGD):
    """QSGD that notes which tensors it has combined (on the exchange's decoder thread)."""
    combined = set()

    def combine(self, msgs, keys, out):
        finite = super().combine(msgs, keys, out)
        _Recording.combined.add(keys[0].name)
        return finite


class _Probe(torch.autograd.Function):
    """Identity whose backward waits until the exchange has already averaged the last
    layer's gradient: proof that communication overlaps the rest of backward."""
    seen = None

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        deadline = time.time() + 20
        while "4.weight" not in _Recording.combined and time.time() < deadline:
            time.sleep(0.01)
        _Probe.seen = sorted(_Recording.combined)
        return g


@case
def overlap():
    """While layer 0's gradient is still being computed, layer 4's is already averaged."""
    rank = hvd.rank()
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(20, 30), torch.nn.Tanh(), torch.nn.Linear(30, 30),
                                torch.nn.Tanh(), torch.nn.Linear(30, 4))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR),
                                   named_parameters=model.named_parameters(),
                                   compression=_Recording(bits=4), min_compress_numel=16,
                                   fusion_bytes=1)             # one bucket per tensor
    x, y = batch(rank, 0)
    h = _Probe.apply(model[1](model[0](x)))                   # between layer 0 and layer 2
    F.cross_entropy(model[4](model[3](model[2](h))), y).backward()
    opt.step()
    # while layer 0's gradient was still being computed, layers 4 (and 2) were averaged
    assert "4.weight" in _Probe.seen and "0.weight" not in _Probe.seen, _Probe.seen


@case.each(SPECS, TRANSPORTS)
def exact_steps(spec, transport):
    """Three steps equal to the hand-computed averaged SGD steps."""
    train_steps(spec, transport, 3)


@case
def backward_passes_per_step():
    """Two backward passes per step (AMQ)."""
    train_steps("amq:bits=3,bucket_size=64", "mpi", 2, bpps=2)


@case
def alq_refit():
    """ALQ refit: statistics of step 1 summed across ranks, fitted, broadcast before step 2;
    a state_dict round trip restores levels, version and step bit-exactly."""
    size = hvd.size()
    model, opt = train_steps("alq:bits=3,bucket_size=64,refit_steps=2/4,refit_every=0",
                             "mpi", 5)
    comp = opt.compression
    assert comp.level_version == 2, comp.level_version
    lv = hvd.allgather(comp.levels.view(1, -1), name="levels")
    assert all(torch.equal(lv[0], lv[r]) for r in range(size)), lv
    assert not torch.equal(comp.levels, torch.tensor(comp.initial_levels(), dtype=torch.float32))
    sd = opt.state_dict()
    model2 = mlp()
    opt2 = hvd.DistributedOptimizer(torch.optim.SGD(model2.parameters(), lr=LR),
                                    named_parameters=model2.named_parameters(),
                                    compression="alq:bits=3,bucket_size=64",
                                    min_compress_numel=16)
    opt2.load_state_dict(sd)
    assert torch.equal(opt2.compression.levels, comp.levels)
    assert opt2.compression.level_version == 2
    assert opt2.state_dict()["hvdcomp"]["step"] == 5


@case
def horovod_optimizer_refuses_codes():
    """Horovod's own DistributedOptimizer never sums hvdcomp codes."""
    import horovod.torch as horovod
    m = mlp()
    try:
        hopt = horovod.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=LR),
                                            named_parameters=m.named_parameters(),
                                            compression=hvdcomp.get("alq"))
        x, y = batch(hvd.rank(), 0)
        F.cross_entropy(m(x), y).backward()
        hopt.step()
        raise AssertionError("Horovod summed ALQ codes")
    except TypeError as e:
        assert "hvdcomp.torch.DistributedOptimizer" in str(e), e


@case
def horovod_allreduce():
    """Horovod's allreduce takes fp16 and refuses to sum QSGD codes."""
    import horovod.torch as horovod
    size = hvd.size()
    t = torch.full((5,), float(hvd.rank() + 1))
    avg = horovod.allreduce(t, compression=hvdcomp.get("fp16"), name="fp16check")
    assert torch.allclose(avg, torch.full((5,), (size + 1) / 2)), avg
    try:
        horovod.allreduce(t, compression=hvdcomp.get("qsgd"), name="qsgdcheck")
        raise AssertionError("hvd.allreduce summed QSGD codes")
    except TypeError as e:
        assert "DistributedOptimizer" in str(e)


@case
def auto_given_costs():
    """Auto: given costs that favour QSGD for the 600-element weight and fp32 for the
    120-element one (hand-worked: t32 = 2e-6 * 4n; tQSGD = 1e-6 * (100 + n / 2) + N * 5e-4),
    the plan is that, identical on every rank, and the step is exact as above."""
    from hvdcomp.auto import CodecCost, LinkCost
    auto = hvdcomp.Auto("qsgd:bits=4,bucket_size=64",
                        link=LinkCost(0.0, 2e-6, 0.0, 1e-6),
                        codec=CodecCost(0.0, 0.0, 5e-4, 0.0, 100.0, 0.5, 1e-3))
    _, opt = train_steps(auto, "mpi", 2)         # the all-to-all costs 0 here, yet with N
    plan = opt.plan                             # decodes of fixed cost the allgather wins
    assert plan["0.weight"] == "qsgd" and plan["2.weight"] == "none", plan
    assert plan["0.bias"] == "none" and plan["2.bias"] == "none", plan
    assert opt.compression is auto.compressor and auto.plan == {"0.weight": "qsgd",
                                                                "2.weight": "none"}


@case
def auto_measured_costs():
    """Measured costs: whatever the plan, every rank makes the same one and steps exactly
    (over the allgather, which expected_step computes)."""
    _, opt = train_steps(hvdcomp.Auto("qsgd:bits=4,bucket_size=64"), "mpi", 1,
                         collective="allgather")
    assert set(opt.paths.values()) <= {"allreduce", "allgather"}
    digests = hvd.allgather_object(sorted(opt.plan.items()))
    assert all(d == digests[0] for d in digests), digests


@case
def auto_per_layer():
    """Auto per layer (hvdcomp.exchange.layer_plan) on both transports: step 0 is fp32 and
    equals the hand-computed step; then every rank adopts the same plan, made from step
    0's gradients, and the parameters stay identical on every rank (so do the averages);
    the plan is in the optimizer's state_dict.  Its candidates: QSGD at 2-5 bits over
    either collective, the all-to-all given 100x cheaper per byte than the allgather, every
    collective's latency 1 us (the plan pays each collective it uses once: a latency of the
    order of these tiny tensors' seconds would decide alone) and a budget of twice QSGD 4
    bits' error (its second stage's is then within it), so that the plan sends tensors over
    the reduce-scatter, which the exchange then builds."""
    from hvdcomp.auto import CodecCost, LinkCost
    from hvdcomp.exchange.layer_plan import STAGE2, candidates
    from hvdcomp.exchange.scatter import ReduceScatter
    from common import exchange_of
    spec = "qsgd:bits=4,bucket_size=64"
    codecs = {}                          # 1 ns per element: the machine's load cannot decide
    for c in candidates(hvdcomp.get(spec), (), densities=(), ranks=()):
        for key, comp in ((c.spec(), c), (STAGE2 + c.spec(), c.second_stage())):
            codecs[key] = CodecCost(0, 1e-9, 0, 1e-9, 64, comp.message_bytes(4096) / 4096)
    for transport in TRANSPORTS:
        auto = hvdcomp.Auto(spec, per_layer=True, fallbacks=(), densities=(), ranks=(), budget=2.0,
                            codecs=codecs, link=LinkCost(1e-6, 1e-7, 1e-6, 1e-6, 1e-6, 1e-8))
        model, opt = train_steps(auto, transport, 1)      # step 0, against the reference
        layer = exchange_of(opt).layer
        assert not layer.pending and sorted(layer.choices) == ["0.weight", "2.weight"]
        scattered = sorted(n for n, c in layer.choices.items() if c.path == "reduce_scatter")
        assert scattered, layer.choices
        coll = exchange_of(opt).collective
        assert isinstance(coll, ReduceScatter), coll
        assert sorted({p.name for p in coll.pieces()}) == scattered
        for step in range(1, 4):
            opt.zero_grad()
            x, y = batch(hvd.rank(), step)
            F.cross_entropy(model(x), y).backward()
            opt.step()
            mine = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
            every = hvd.allgather_object(mine)
            assert all(torch.equal(m, mine) for m in every), (transport, step)
        plans = hvd.allgather_object(sorted((n, c.spec, c.path)
                                            for n, c in layer.choices.items()))
        assert all(p == plans[0] for p in plans), plans
        sd = opt.state_dict()
        assert any(v["layer_plan"]["plan"].keys() == layer.choices.keys()
                   for v in sd.values() if isinstance(v, dict) and "layer_plan" in v), \
            sorted(sd)
        opt.close()


@case
def disagreeing_ranks():
    """Ranks that disagree on the compressor: every rank raises, nobody hangs."""
    spec = "alq:bits=3" if hvd.rank() == 0 else "alq:bits=4"
    m = mlp()
    try:
        hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=LR),
                                 named_parameters=m.named_parameters(), compression=spec)
        raise AssertionError("disagreeing ranks were not detected")
    except RuntimeError as e:
        assert "disagree" in str(e)


if __name__ == "__main__":
    run()
