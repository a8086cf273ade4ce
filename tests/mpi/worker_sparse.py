"""Top-k, random-k and DGC on N ranks.

* The exchange (both transports) delivers on every rank exactly the average that one process
  computes from every rank's messages, keeping one compressor (hence one residual / u / v
  state) per simulated rank.  A tensor whose gradient on rank r has 3r nonzeros makes rank 0
  select nothing and every rank send a different count; the NaN tensor of rank 1 and the
  all-zero tensor follow the NaN policy / minimal messages.
* The drop-in optimizer (import hvdcomp.torch as hvd) with torch.optim.SGD(momentum=0.9)
  takes exactly the steps of a reference SGD fed those single-process averages.  For DGC the
  user's param group stays as it is (momentum 0.9 for every tensor), the compressor applies
  the group's 0.9 itself to the compressed tensors (momentum correction: the reference SGD
  has momentum 0 for them and 0.9 for the biases); rank 0's inputs are zero, so its
  first-layer gradient is zero and it selects nothing.  DGC's state survives a checkpoint.
"""
import io

import torch
import torch.nn.functional as F

from common import (LR, assert_bit_exact, assert_params, buckets, compressed, exchange_of,
                    exchange_step, local_grads, make_exchange, mlp, reference, reference_grads,
                    same, twins_of)
from cases import case, run

import hvdcomp
from hvdcomp.compressors.protocols import MomentumCorrection
import hvdcomp.torch as hvd
from hvdcomp.codecs.sparse_vectors import decode_indices

MOM = 0.9
EXCHANGE_SPECS = ["topk:density=0.01", "randk:density=0.02,values=fp16,unbiased=true",
                  "dgc:density=0.01,momentum=0.9,clip_norm=5",
                  "dgc:density=0.005,values=fp16,warmup_epochs=2,steps_per_epoch=1",
                  "topk:density=0.02,values=int8"]
OPTIMIZER_SPECS = ["dgc:density=0.05",
                   "dgc:density=0.02,values=fp16,clip_norm=2,warmup_epochs=2,steps_per_epoch=2",
                   "dgc:density=0.05,momentum_correction=false",
                   "topk:density=0.05", "randk:density=0.1"]
TRANSPORTS = ["mpi", "horovod"]

SHAPES = {"conv.weight": (7, 3, 5, 5), "fc1.weight": (300, 41), "fc1.bias": (300,),
          "half.weight": (33, 40), "zero.weight": (64, 64), "nan.weight": (40, 40),
          "sparse.weight": (50, 40)}
DTYPES = {"half.weight": torch.float16}

torch.set_num_threads(1)


def golden(name, rank, step):
    g = torch.Generator().manual_seed(1000 * step + 37 * rank + sum(map(ord, name)))
    x = torch.randn(SHAPES[name], generator=g) * (1 + rank)
    if name == "zero.weight":
        x.zero_()
    if name == "nan.weight" and rank == 1:
        x.view(-1)[5] = float("nan")
    if name == "sparse.weight":            # 3 * rank nonzeros: rank 0 selects nothing
        keep = torch.zeros(x.numel(), dtype=torch.bool)
        keep[torch.randperm(x.numel(), generator=g)[:3 * rank]] = True
        x = torch.where(keep.view(x.shape), x, torch.zeros_like(x))
    return x.to(DTYPES.get(name, torch.float32))


def params():
    return [(n, torch.nn.Parameter(torch.zeros(s, dtype=DTYPES.get(n, torch.float32))))
            for n, s in SHAPES.items()]


def count_sent(msg):
    """Indices in a top-k / DGC message (0 for NONFINITE)."""
    if not msg.sections:
        return 0
    return decode_indices(msg.sections[0], msg.numel).size


# --------------------------------------------------------------------------------------------
# the exchange
# --------------------------------------------------------------------------------------------

@case.each(EXCHANGE_SPECS)
def exchange(spec):
    """Both transports, three steps, each rank's compressor against its simulated twin;
    the counts of what each rank selected from sparse.weight."""
    by_transport = []
    for tname in TRANSPORTS:
        comp = hvdcomp.get(spec)
        ex = make_exchange(comp, tname, params())
        rank = ex.rank
        twins = [hvdcomp.get(spec) for _ in range(ex.size)]
        assert len(buckets(ex)) > 1
        names = compressed(ex)
        assert names == sorted(set(SHAPES) - {"fc1.bias"}), names
        results = []
        for step in range(3):
            res, stats = exchange_step(ex, step, lambda n, r: golden(n, r, step))
            counts = []

            def count(name, r, msg, c):
                if c is twins[r] and name == "sparse.weight" and c.name != "randk":
                    counts.append((r, count_sent(msg)))

            want, _ = reference(ex, step, lambda n, r: golden(n, r, step),
                                compressor_for=twins_of(comp, twins), on_message=count)
            assert_bit_exact(res, want, SHAPES, (spec, tname, step))
            assert stats.nonfinite == ["nan.weight"], stats.nonfinite
            assert stats.compressors["fc1.weight"] == comp.name
            assert not res["zero.weight"].any()
            if counts and comp.values == "fp32":
                # rank r had 3r nonzeros (at new places each step; what was sent left
                # exact zeros in v): it sends 3r of k >= 10
                assert counts == [(r, 3 * r) for r in range(ex.size)], (spec, counts)
            elif counts:
                # fp16: the rounding errors of earlier steps stay in v and are sent too
                assert counts[0] == (0, 0) and all(c > 0 for _, c in counts[1:]), counts
            # this rank's state equals its simulated twin's, bit for bit
            mine, ref = comp.state_dict(), twins[rank].state_dict()
            assert mine.keys() == ref.keys()
            for part in mine:
                assert sorted(mine[part]) == sorted(ref[part]), (spec, part)
                for n in mine[part]:
                    assert torch.equal(mine[part][n], ref[part][n]), (spec, part, n)
            results.append({k: v.clone() for k, v in res.items()})   # buffers are reused
        by_transport.append(results)
    for a, b in zip(*by_transport):
        for name in SHAPES:
            assert same(a[name], b[name]), (spec, "mpi vs horovod", name)


# --------------------------------------------------------------------------------------------
# the drop-in optimizer with SGD momentum
# --------------------------------------------------------------------------------------------

def batch(rank, step):
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + 5)
    x = torch.randn(8, 20, generator=g)
    if rank == 0:
        x.zero_()                   # rank 0: zero first-layer gradient, nothing selected
    return x, torch.randint(0, 4, (8,), generator=g)


def make_twins(spec, size, compressed):
    twins = [hvdcomp.get(spec) for _ in range(size)]
    for t in twins:
        if isinstance(t, MomentumCorrection):           # what SGD(momentum=0.9) hands over
            t.set_momentum({n: MOM for n in compressed})
    return twins


def expected_grads(model, opt, twins, step):
    """{name: average over ranks of decode(encode_r(g_r))}, single process."""
    grads = [local_grads(model, [batch(r, step)]) for r in range(hvd.size())]

    def selects_nothing(name, r, msg, c):
        if c is twins[r] and name == "0.weight" and r == 0 and c.name != "randk":
            assert count_sent(msg) == 0           # a rank that selects nothing

    return reference_grads(model, opt, step, grads,
                           compressor_for=twins_of(opt.compression, twins),
                           on_message=selects_nothing)


def reference_optimizer(model, opt):
    """A plain SGD over a copy of the parameters, with the drop-in's param groups, except
    momentum 0 for the tensors whose compressor applies the momentum (DGC's correction)."""
    ref = {n: p.detach().clone() for n, p in model.named_parameters()}
    name_of = {id(p): n for n, p in model.named_parameters()}
    comp = opt.compression
    moved = set(compressed(exchange_of(opt))) if comp.name == "dgc" and comp.momentum_correction \
        else set()
    groups = []
    for g in opt.param_groups:
        names = [name_of[id(p)] for p in g["params"]]
        for part, m in (([n for n in names if n not in moved], g["momentum"]),
                        ([n for n in names if n in moved], 0.0)):
            if part:
                groups.append(dict({k: v for k, v in g.items() if k != "params"},
                                   params=[ref[n] for n in part], momentum=m))
    return ref, torch.optim.SGD(groups, lr=LR)


def step_and_check(model, opt, twins, ref, ref_opt, step, where):
    want = expected_grads(model, opt, twins, step)
    for n, p in model.named_parameters():        # start from the drop-in's parameters
        ref[n].data.copy_(p.detach())
        ref[n].grad = want[n].clone()
    ref_opt.step()
    opt.zero_grad()
    x, y = batch(hvd.rank(), step)
    F.cross_entropy(model(x), y).backward()
    opt.step()
    assert_params(model, opt, ref, (where, step), atol=1e-6)
    assert opt.last_stats.compressors["0.weight"] == opt.compression.name


def make_opt(model, spec, transport):
    return hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR, momentum=MOM),
                                    named_parameters=model.named_parameters(),
                                    compression=spec, transport=transport,
                                    min_compress_numel=16)


def check_momentum_split(model, opt):
    """The user's param groups are left as they are (one group, momentum 0.9 for every
    tensor), whatever the compressor; DGC's momentum correction takes the group's momentum
    for its tensors at every step (checked after the steps: momentum_of)."""
    names = compressed(exchange_of(opt))
    assert names == ["0.weight", "2.weight"], names
    assert len(opt.param_groups) == 1 and opt.param_groups[0]["momentum"] == MOM
    assert [id(p) for p in opt.param_groups[0]["params"]] == [id(p) for p in model.parameters()]
    return names


@case.each(OPTIMIZER_SPECS, TRANSPORTS)
def optimizer(spec, transport, steps=4):
    """SGD(momentum=0.9) through the drop-in against a plain SGD fed the single-process
    averages; for DGC with momentum correction, the momentum split and a checkpoint."""
    model = mlp()
    opt = make_opt(model, spec, transport)
    names = check_momentum_split(model, opt)
    twins = make_twins(spec, hvd.size(), names)
    ref, ref_opt = reference_optimizer(model, opt)
    for step in range(steps):
        step_and_check(model, opt, twins, ref, ref_opt, step, (spec, transport))
    mine, theirs = opt.compression.state_dict(), twins[hvd.rank()].state_dict()
    for part in mine:
        for n in mine[part]:
            assert torch.equal(mine[part][n], theirs[part][n]), (spec, part, n)
    if opt.compression.name != "dgc" or not opt.compression.momentum_correction:
        return
    assert all(opt.compression.momentum_of(n) == MOM for n in names)
    assert opt.compression.momentum_buffer("2.weight").abs().sum() > 0
    # checkpoint: DGC's u and v travel in the optimizer's state_dict
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    model2 = mlp()
    model2.load_state_dict(model.state_dict())
    opt2 = make_opt(model2, spec, transport)
    opt2.load_state_dict(torch.load(buf))
    check_momentum_split(model2, opt2)
    for part in mine:
        for n in mine[part]:
            assert torch.equal(opt2.compression.state_dict()[part][n], mine[part][n])
    ref2, ref_opt2 = reference_optimizer(model2, opt2)
    ref_opt2.load_state_dict(ref_opt.state_dict())          # the biases' momentum buffers
    step_and_check(model2, opt2, twins, ref2, ref_opt2, steps, (spec, "restored"))


if __name__ == "__main__":
    run()
