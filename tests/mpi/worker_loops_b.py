"""Issue 14, cases 2 and 4-7 on N ranks: several optimizers, DGC and param groups, sparse
gradients, hvd.join() with uneven batches, casts that keep range (expectations as in
worker_loops.py, whose helpers this worker uses)."""
import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

from cases import case, run
from common import exchange_of, step_of
from worker_loops import (ALL, LR, MOM, STATELESS, batch, compare, expect, expected_avg,
                          local_grads, loss_of, make, model_fn, ref_apply, replicas_agree)

import hvdcomp
import hvdcomp.torch as hvd
from hvdcomp.exchange import Exchange
from hvdcomp.transport import HorovodAllreduce
from hvdcomp.transport import make as make_transport

TRANSPORTS = ["mpi", "horovod"]
# worker_loops' lists, literally (the pytest side reads case lists from this file)
ALL_SPECS = ["none", "qsgd:bits=4,bucket_size=64", "topk:density=0.1", "dgc:density=0.1"]
STATELESS_SPECS = ["none", "qsgd:bits=4,bucket_size=64"]
JOIN_SPECS = ["none", "qsgd:bits=4,bucket_size=64",
              "alq:bits=3,bucket_size=64,refit_steps=3,refit_every=0"]
JOIN_TWO_SPECS = ["none", "topk:density=0.1", "dgc:density=0.1"]
# over the reduce-scatter (#11 item 2): joined ranks still own (and re-encode) their shards
JOIN_RS_SPECS = ["rs+none", "rs+qsgd:bits=4,bucket_size=64",
                 "rs+alq:bits=3,bucket_size=64,refit_steps=3,refit_every=0"]
# label -> (spec, optimizers, one backward through all of them, stepped in reverse order)
SEVERAL = {"none-2-apart": ("none", 2, False, False),
           "none-2-apart-reversed": ("none", 2, False, True),
           "qsgd-3-joint-reversed": ("qsgd:bits=4,bucket_size=64", 3, True, True),
           "qsgd-3-apart": ("qsgd:bits=4,bucket_size=64", 3, False, False),
           "topk-2-joint": ("topk:density=0.1", 2, True, False),
           "dgc-3-apart-reversed": ("dgc:density=0.1", 3, False, True)}
assert ALL_SPECS == ALL and STATELESS_SPECS == STATELESS

# --- 2. several optimizers ----------------------------------------------------------------

@case.each(SEVERAL, TRANSPORTS)
def several(label, transport):
    """n_opt optimizers over parts of one model: one backward through all of them (their
    exchanges run at the same time) or one backward each (a GAN's generator and
    discriminator), stepped in either order; exact against plain torch."""
    spec, n_opt, joint, reverse = SEVERAL[label]
    rank, size = hvd.rank(), hvd.size()
    torch.manual_seed(5)
    parts = [nn.Linear(20, 20) for _ in range(n_opt)]
    model = nn.Sequential(*parts)
    opts = [hvd.DistributedOptimizer(torch.optim.SGD(p.parameters(), lr=LR, momentum=MOM),
                                     named_parameters=p.named_parameters(),
                                     compression=spec, transport=transport,
                                     min_compress_numel=16) for p in parts]
    ref = copy.deepcopy(model)
    ref_opts = [torch.optim.SGD(p.parameters(), lr=LR, momentum=MOM) for p in ref]

    def losses(m, r, step):
        x, y = batch(r, step)
        if joint:
            return [m(x).pow(2).mean()]
        return [part(x + i).tanh().pow(2).mean() for i, part in enumerate(m)]

    def grads_of(r, step):
        m = copy.deepcopy(ref)
        for loss in losses(m, r, step):
            loss.backward()
        return [{n: p.grad.clone() for n, p in part.named_parameters()} for part in m]

    for step in range(3):
        per_rank = [grads_of(r, step) for r in range(size)]
        wants = [expect(o, spec, [g[i] for g in per_rank], step) for i, o in enumerate(opts)]
        for o in opts:
            o.zero_grad()
        for loss in losses(model, rank, step):
            loss.backward()
        order = list(range(n_opt))[::-1] if reverse else range(n_opt)
        for i in order:
            opts[i].step()
            if wants[i] is not None:
                ref_apply(ref[i], ref_opts[i], wants[i])
        for i, o in enumerate(opts):
            if wants[i] is not None:
                compare(o, parts[i], ref[i], (spec, transport, n_opt, joint, reverse, step))
        replicas_agree(model, (spec, "several", step))
    for o in opts:
        o.close()


# --- 4. DGC and parameter groups --------------------------------------------------------------

@case.each(TRANSPORTS)
def dgc_groups(transport, spec="dgc:density=0.1"):
    """Two SGD groups with their own lr, momentum and weight decay, and LambdaLR with two
    lambdas: the groups stay as the user made them; DGC folds each group's weight decay
    into the local gradient, applies its momentum, and the step is p -= lr * average;
    exact against per-rank twins of the compressor."""
    rank, size = hvd.rank(), hvd.size()
    model = model_fn(width=40)
    groups = [dict(params=list(model[0].parameters()), lr=0.1, momentum=0.9, weight_decay=1e-2),
              dict(params=list(model[2].parameters()), lr=0.05, momentum=0.5, weight_decay=0.0)]
    opt = make(model, spec, transport, base=torch.optim.SGD(groups, lr=0.1))
    lambdas = [lambda t: 0.9 ** t, lambda t: 1.0 / (1 + t)]
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambdas)
    assert len(opt.param_groups) == 2
    assert opt.param_groups[0]["params"] == list(model[0].parameters())
    assert opt.param_groups[1]["momentum"] == 0.5
    ref = copy.deepcopy(model)
    plain = torch.optim.SGD([dict(g, params=list(m.parameters()))
                             for g, m in zip(groups, (ref[0], ref[2]))], lr=0.1)
    plain_sched = torch.optim.lr_scheduler.LambdaLR(plain, lambdas)
    ex = exchange_of(opt)
    dgc = {n for n, e in ex.entries.items() if e.compressor is opt.compression}
    assert dgc == {"0.weight", "2.weight"}, dgc
    group_of = {"0.weight": 0, "0.bias": 0, "2.weight": 1, "2.bias": 1}
    twins = [hvdcomp.get(spec) for _ in range(size)]
    for t in twins:
        t.set_momentum({"0.weight": 0.9, "2.weight": 0.5})
    for step in range(4):
        grads = [local_grads(ref, r, step) for r in range(size)]
        refp = dict(ref.named_parameters())
        for name in sorted(dgc):
            e, g = ex.entries[name], plain.param_groups[group_of[name]]
            acc = torch.zeros(e.param.numel())
            for r in range(size):
                key = hvdcomp.TensorKey(name, e.tensor_id, step, r, size, ex.seed)
                local = grads[r][name].add(refp[name].detach(), alpha=g["weight_decay"])
                twins[r].decode(hvdcomp.Message.from_bytes(
                    twins[r].encode(local, key).to_bytes()), key, acc)
            twins[rank].finalize(acc, key)
            with torch.no_grad():                   # DGC's update: p -= lr * average
                refp[name].add_(acc.view(e.param.shape), alpha=-g["lr"])
        want = expected_avg(opt, grads, step, skip=dgc)   # biases: plain SGD on the average
        for n, p in ref.named_parameters():
            p.grad = None if n in dgc else want[n].clone()
        plain.step()
        opt.zero_grad()
        loss_of(model, rank, step).backward()
        opt.step()
        sched.step()
        plain_sched.step()
        compare(opt, model, ref, (spec, transport, "dgc groups", step))
    assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in plain.param_groups]
    mine, theirs = opt.state_dict(), plain.state_dict()
    assert mine["param_groups"] == theirs["param_groups"], (mine["param_groups"],
                                                           theirs["param_groups"])
    assert "hvdcomp" in mine
    for part, held in opt.compression.state_dict().items():
        for n, t in held.items():
            assert torch.equal(t, twins[rank].state_dict()[part][n]), (part, n)
    opt.close()


# --- 5. sparse gradients ----------------------------------------------------------------------

class Bag(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(4)
        self.emb = nn.Embedding(50, 8, sparse=True)
        self.head = nn.Linear(8, 4)

    def forward(self, idx):
        return self.head(self.emb(idx).mean(1))


def bag_batch(rank, step):
    g = torch.Generator().manual_seed(77 + 100 * step + rank)
    return torch.randint(0, 50, (6, 5), generator=g), torch.randint(0, 4, (6,), generator=g)


@case.each(ALL_SPECS, TRANSPORTS)
def sparse_as_dense(spec, transport):
    """nn.Embedding(sparse=True) densified (``sparse_as_dense``): see sparse_gradients."""
    sparse_gradients(spec, transport, as_dense=True)


@case.each(STATELESS_SPECS, TRANSPORTS)
def sparse_coo(spec, transport):
    """nn.Embedding(sparse=True) as indices and values: see sparse_gradients."""
    sparse_gradients(spec, transport, as_dense=False)


def sparse_gradients(spec, transport, as_dense):
    """nn.Embedding(sparse=True): densified (``sparse_as_dense``, SGD, compressed like any
    gradient), or as indices and values with SparseAdam (a second optimizer for the
    sparse table): averages as plain torch computes them (for the compressors without
    state; the others: the same parameters on every rank)."""
    rank, size = hvd.rank(), hvd.size()
    model = Bag()
    ref = copy.deepcopy(model)
    if as_dense:
        opts = [make(model, spec, transport, sparse_as_dense=True,
                     base=torch.optim.SGD(model.parameters(), lr=LR))]
        refs = [torch.optim.SGD(ref.parameters(), lr=LR)]
    else:
        opts = [hvd.DistributedOptimizer(torch.optim.SparseAdam(model.emb.parameters(), lr=0.01),
                                         named_parameters=model.emb.named_parameters(),
                                         compression=spec, transport=transport,
                                         min_compress_numel=16),
                hvd.DistributedOptimizer(torch.optim.SGD(model.head.parameters(), lr=LR),
                                         named_parameters=model.head.named_parameters(),
                                         compression=spec, transport=transport,
                                         min_compress_numel=16)]
        refs = [torch.optim.SparseAdam(ref.emb.parameters(), lr=0.01),
                torch.optim.SGD(ref.head.parameters(), lr=LR)]
    for step in range(3):
        per_rank = []
        for r in range(size):
            m = copy.deepcopy(ref)
            F.cross_entropy(m(bag_batch(r, step)[0]), bag_batch(r, step)[1]).backward()
            per_rank.append({n: p.grad for n, p in m.named_parameters()})
        exact = spec in STATELESS
        if not exact:
            pass
        elif as_dense:                           # dense gradients, compressed as such
            want = expected_avg(opts[0], [{n: g.to_dense() if g.is_sparse else g
                                           for n, g in gr.items()} for gr in per_rank], step)
        else:                                    # the head's (the second optimizer's)
            want = {f"head.{n}": g for n, g in expected_avg(
                opts[1], [{n[5:]: g for n, g in gr.items() if n.startswith("head.")}
                          for gr in per_rank], step).items()}
        for n, p in ref.named_parameters():
            if not exact:
                break
            gs = [g[n] for g in per_rank]
            if n in want:
                p.grad = want[n].clone()
            else:                                # sent as they are: indices and values
                p.grad = torch.sparse_coo_tensor(
                    torch.cat([x._indices() for x in gs], 1),
                    torch.cat([x._values() for x in gs]) / size, p.shape,
                    check_invariants=True)
        if exact:
            for o in refs:
                o.step()
        for o in opts:
            o.zero_grad()
        x, y = bag_batch(rank, step)
        F.cross_entropy(model(x), y).backward()
        g = model.emb.weight.grad
        assert g.is_sparse != as_dense, (spec, as_dense)
        for o in opts:
            o.step()
        for (n, p), q in zip(model.named_parameters(), ref.parameters()):
            if exact:
                assert torch.allclose(p.detach(), q.detach(), rtol=1e-5, atol=1e-6), \
                    (spec, transport, as_dense, step, n, (p - q).abs().max())
            with torch.no_grad():               # the reference goes on from here
                q.copy_(p)
        replicas_agree(model, (spec, "sparse"))
    for o in opts:
        o.close()


# --- 6. hvd.join() with uneven batches --------------------------------------------------------

@case.each(JOIN_SPECS, TRANSPORTS)
def join(spec, transport):
    """One optimizer: see join_uneven."""
    join_uneven(spec, transport)


@case.each(JOIN_TWO_SPECS, TRANSPORTS)
def join_two_optimizers(spec, transport):
    """Two optimizers: see join_uneven."""
    join_uneven(spec, transport, n_opt=2)


@case.each(JOIN_RS_SPECS, TRANSPORTS)
def join_reduce_scatter(spec, transport):
    """One optimizer over the reduce-scatter: see join_uneven."""
    join_uneven(spec, transport)


@case.each(TRANSPORTS)
def join_two_optimizers_reduce_scatter_dgc(transport):
    """Two DGC optimizers over the reduce-scatter: see join_uneven."""
    join_uneven("rs+dgc:density=0.1", transport, n_opt=2)


def join_uneven(spec, transport, n_opt=1):
    """Odd ranks have one batch more; the others join.  The extra step averages over the
    odd ranks only (exact for the compressors without state; ALQ refits after it, with the
    joined ranks taking part); every rank leaves join() and agrees on the last rank to
    join."""
    rank, size = hvd.rank(), hvd.size()
    torch.manual_seed(9)
    parts = [nn.Linear(20, 20) for _ in range(n_opt)]
    model = nn.Sequential(*parts)
    opts = [make(p, spec, transport) for p in parts]
    ref = copy.deepcopy(model)
    ref_opts = [torch.optim.SGD(p.parameters(), lr=LR, momentum=MOM) for p in ref]
    active = [r for r in range(size) if r % 2 == 1]
    steps = 2 + (rank % 2)
    base = spec.split("+")[-1]
    # exact: the stateless ones over the allgather; over the reduce-scatter only "none",
    # whose second stage is exact (the two-stage quantizers are checked in worker_scatter)
    exact = (base.split(":")[0] == "none" if spec.startswith("rs+")
             else spec.split(":")[0] in ("none", "qsgd", "alq"))
    for step in range(3):
        ranks = range(size) if step < 2 else active
        if step < steps:
            for i, o in enumerate(opts):
                if exact:
                    grads = []
                    for r in range(size):
                        m = copy.deepcopy(ref[i])
                        if r in ranks:
                            m(batch(r, step)[0]).pow(2).mean().backward()
                            grads.append({n: p.grad for n, p in m.named_parameters()})
                        else:
                            grads.append({})
                    want = expected_avg(o, grads, step, contributors=len(ranks))
                o.zero_grad()
                parts[i](batch(rank, step)[0]).pow(2).mean().backward()
                o.step()
                if exact:
                    ref_apply(ref[i], ref_opts[i], want)
                    compare(o, parts[i], ref[i], (spec, transport, "join", step, i))
                assert all(torch.isfinite(p).all() for p in parts[i].parameters())
                if step == 2:
                    assert o.last_stats.joined == size - len(active), o.last_stats.joined
    last = hvd.join()
    assert last == active[-1], (last, active)
    for o in opts:                     # every rank counted the step it sat out
        assert step_of(o) == 3, step_of(o)
        if base.startswith("alq"):     # refitted after step 2, the same table everywhere
            comp = o.compression
            assert comp.level_version == 1, comp.level_version
            lv = hvd.allgather(comp.levels.view(1, -1), name=f"join.levels.{transport}")
            assert all(torch.equal(lv[0], lv[r]) for r in range(size)), lv
    for o in opts:
        o.close()


@case.each(TRANSPORTS)
def join_refuses_laq(transport):
    """LAQ keeps per-rank aggregates, so it cannot leave a joined rank out: a clear error
    on every rank (the active ranks' backward, the joined ranks' join()), not a hang."""
    rank, size = hvd.rank(), hvd.size()
    model = model_fn()
    opt = make(model, "laq:bits=4", transport)
    opt.zero_grad()
    loss_of(model, rank, 0).backward()
    opt.step()
    try:
        if rank % 2 == 1:
            opt.zero_grad()
            loss_of(model, rank, 1).backward()
        else:
            hvd.join()
        raise AssertionError("LAQ with a joined rank did not raise")
    except ValueError as e:
        assert "laq needs every rank's gradient" in str(e), e
    opt.zero_grad()
    assert hvd.join() == size - 1          # all at once: the highest rank
    opt.close()


# --- 7. casts that keep range ------------------------------------------------------------------

@case.each(TRANSPORTS)
def casts(transport):
    """Finite gradients give finite averages whenever the average is representable in the
    gradient's dtype: a bf16 gradient holding 70000 and 3e38 with fp16 compression (sent
    as bf16), fp32 gradients beyond fp16's range with fp16 (summed again in float32), and
    3e38 on every rank with none (whose float32 sum overflows)."""
    rank, size = hvd.rank(), hvd.size()
    cases = [("fp16", torch.bfloat16, [70000.0, 3e38, -3e38]),
             ("fp16", torch.float32, [1e6, -3e5, 7e4 * size]),
             ("none", torch.float32, [3e38, -3e38, 1e38]),
             ("bf16", torch.float32, [3e38, 1e6, -2e38])]
    for spec, dtype, big in cases:
        for summable in (True, False):
            p = nn.Parameter(torch.zeros(40, 40, dtype=dtype))
            grads = []
            for r in range(size):
                g = torch.Generator().manual_seed(r)
                x = torch.randn(40, 40, generator=g)
                x.view(-1)[:3] = torch.tensor(big)
                grads.append(x.to(dtype))
            ex = Exchange([("w", p)], hvdcomp.get(spec), make_transport(transport),
                          allreduce=HorovodAllreduce(hvd) if summable else None,
                          min_compress_numel=16)
            if spec == "fp16" and dtype == torch.bfloat16:
                assert ex.entries["w"].compressor.name == "bf16"
            p.grad = grads[rank]
            ex.begin(0)
            res, stats = ex.finish()
            got = res["w"]
            what = (spec, dtype, summable, transport)
            assert torch.isfinite(got).all() and not stats.nonfinite, what
            want = sum(x.double() for x in grads) / size
            assert torch.allclose(got.double(), want.reshape(-1), rtol=1e-2, atol=1e-2), \
                (what, (got.double() - want.reshape(-1)).abs().max())
            ex.close()


torch.set_num_threads(1)

if __name__ == "__main__":
    run()
