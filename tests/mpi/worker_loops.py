"""Issue 14: the drop-in optimizer in the training loops people write, on N ranks.

Expected values come from plain torch arithmetic in this one process: every rank
recomputes every rank's gradients (on a copy of the model, from the seed) and averages
them, through the same encode/decode for a deterministic compressor (rank-order float32
sums, so tensors sent as wire messages compare bit for bit; tensors summed by Horovod's
allreduce, in MPI's order, to 1e-6).  Compressors with residuals (topk) and DGC are
checked against their own single-process twins or for the invariants (replicas equal,
frozen weights still, nothing non-finite).

Cases (issue 14's numbering): 1. averaged gradients when backward returns (GradScaler,
clipping, closures, thrown-away batches, Horovod's idioms, backward_passes_per_step);
2. several optimizers; 3. frozen, unused and later-unfrozen parameters; 4. DGC and param
groups; 5. sparse gradients; 6. hvd.join() with uneven batches; 7. casts that keep range.
"""
import copy
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from common import say

import hvdcomp
import hvdcomp.torch as hvd
from hvdcomp.transport import make as make_transport

LR = 0.1
MOM = 0.9
TRANSPORTS = ("mpi", "horovod")
STATELESS = ("none", "qsgd:bits=4,bucket_size=64")      # deterministic: exact expectations
ALL = STATELESS + ("topk:density=0.1", "dgc:density=0.1")  # + residuals, + DGC


def model_fn(seed=11, width=30):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(20, width), nn.Tanh(), nn.Linear(width, 4))


def batch(rank, step, bp=0, n=8):
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + bp)
    return torch.randn(n, 20, generator=g), torch.randint(0, 4, (n,), generator=g)


def loss_of(model, rank, step, bp=0):
    x, y = batch(rank, step, bp)
    return F.cross_entropy(model(x), y)


def local_grads(model, rank, step, passes=1):
    """{name: gradient} of ``rank``'s batches of ``step`` on a copy of ``model``
    (missing: the parameter got no gradient)."""
    m = copy.deepcopy(model)
    m.zero_grad(set_to_none=True)
    for bp in range(passes):
        loss_of(m, rank, step, bp).backward()
    return {n: p.grad.detach().clone() for n, p in m.named_parameters() if p.grad is not None}


def expected_avg(opt, grads, step, contributors=None, skip=()):
    """{name: average} of ``grads`` (one {name: gradient} per rank) as the exchange makes
    it: each present gradient through encode/decode with its rank's key, in rank order,
    then finalize over ``contributors`` ranks (default all).  Names no rank has: absent.
    Only for compressors without state (``skip`` the names of others)."""
    ex, size = opt._exchange, hvd.size()
    n_ranks = size if contributors is None else contributors
    out = {}
    for name, e in ex.entries.items():
        if name in skip:
            continue
        present = [r for r in range(size) if grads[r].get(name) is not None]
        if not present:
            continue
        acc = torch.zeros(e.param.numel())
        for r in present:
            key = hvdcomp.TensorKey(name, e.tensor_id, step, r, size, ex.seed)
            e.compressor.decode(hvdcomp.Message.from_bytes(
                e.compressor.encode(grads[r][name], key).to_bytes()), key, acc)
        e.compressor.finalize(acc, hvdcomp.TensorKey(name, e.tensor_id, step, hvd.rank(),
                                                     n_ranks, ex.seed))
        out[name] = acc.view(e.param.shape)
    return out


def same(opt, name, got, want, what, tol=1e-6, exact=True):
    """Bit for bit for wire messages, to ``tol`` for Horovod's allreduce (MPI's order) or
    when not ``exact``."""
    if opt._exchange.entries[name].allreduce or not exact:
        assert torch.allclose(got, want, rtol=tol, atol=tol), (what, name, (got - want).abs().max())
    else:
        assert torch.equal(got, want), (what, name, (got - want).abs().max())


def replicas_agree(model, what):
    flat = torch.cat([p.detach().reshape(-1).double() for p in model.parameters()])
    assert torch.isfinite(flat).all(), what
    got = hvd.allgather(flat.view(1, -1), name=f"replicas.{replicas_agree.n}")
    replicas_agree.n += 1
    assert all(torch.equal(got[0], got[r]) for r in range(hvd.size())), what


replicas_agree.n = 0


def grads_agree(model, what):
    """Every rank holds the same p.grad (the average) for every parameter."""
    flat = torch.cat([p.grad.detach().reshape(-1).double() for p in model.parameters()])
    got = hvd.allgather(flat.view(1, -1), name=f"grads.{replicas_agree.n}")
    replicas_agree.n += 1
    assert all(torch.equal(got[0], got[r]) for r in range(hvd.size())), what


def expect(opt, spec, grads, step, **kw):
    """expected_avg for the compressors without state, None for the others (then the
    checks are: every rank holds the same gradients and parameters)."""
    return expected_avg(opt, grads, step, **kw) if spec in STATELESS else None


def make(model, spec, transport, base=None, **kw):
    base = base or torch.optim.SGD(model.parameters(), lr=LR, momentum=MOM)
    kw.setdefault("min_compress_numel", 16)
    return hvd.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                    compression=spec, transport=transport, **kw)


def ref_sgd(model, **kw):
    ref = copy.deepcopy(model)
    return ref, torch.optim.SGD(ref.parameters(), lr=LR, momentum=kw.pop("momentum", MOM), **kw)


def ref_apply(ref, ref_opt, want, clip=None):
    for n, p in ref.named_parameters():
        p.grad = want[n].clone() if n in want else None
    if clip is not None:
        torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
    ref_opt.step()


def compare(opt, model, ref, what, tol=1e-6, exact=True):
    """The drop-in's parameters against the reference's; then the reference continues from
    the drop-in's (Horovod's allreduce sums in MPI's order: the next step's gradients would
    differ in the last bits)."""
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        same(opt, n, p.detach(), q.detach(), what, tol, exact)
        with torch.no_grad():
            q.copy_(p)


# --- 1. averaged gradients when backward returns ----------------------------------------

def check_ddp(spec, transport):
    """The plain loop, clipping after backward, a closure, a thrown-away batch and
    Horovod's synchronize / skip_synchronize idiom, each exact against plain torch (for
    the compressors without state; the others: the same averages on every rank)."""
    rank, size = hvd.rank(), hvd.size()
    model = model_fn()
    opt = make(model, spec, transport)
    ref, ref_opt = ref_sgd(model)
    for step, mode in enumerate(("plain", "clip", "closure", "thrown", "horovod", "plain")):
        want = expect(opt, spec, [local_grads(ref, r, step) for r in range(size)], step)
        what = (spec, transport, mode, step)
        if mode == "closure":
            def closure():
                opt.zero_grad()
                loss = loss_of(model, rank, step)
                loss.backward()
                return loss
            loss = opt.step(closure)
            assert torch.isfinite(loss) and not opt._exchange.in_step, what
            grads_agree(model, what)
            replicas_agree(model, what)
            if want is not None:
                ref_apply(ref, ref_opt, want)
                compare(opt, model, ref, what)
            continue
        opt.zero_grad()
        if mode == "thrown":            # a batch whose gradients are thrown away
            loss_of(model, rank, step, bp=7).backward()
            opt.synchronize()
            opt.zero_grad()
        loss_of(model, rank, step).backward()
        grads_agree(model, what)                # averaged when backward returns
        for n, p in model.named_parameters():
            if want is not None:
                same(opt, n, p.grad, want[n], what)
        clip = None
        if mode == "clip":
            clip = 0.05
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
        elif mode == "horovod":         # Horovod's idiom: a no-op synchronize now
            clip = 0.05
            opt.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            with opt.skip_synchronize():
                opt.step()
        else:
            opt.step()
        replicas_agree(model, what)
        if want is not None:
            ref_apply(ref, ref_opt, want, clip)
            # clipping scales every tensor by one factor from all norms, allreduced ones too
            compare(opt, model, ref, what, exact=clip is None)
    opt.close()


def check_grad_scaler(spec, transport):
    """AMP's GradScaler: an inf in rank 1's input skips the step on every rank and halves
    every rank's scale; the steps before and after apply the averages (exact: the scale
    is a power of two)."""
    rank, size = hvd.rank(), hvd.size()
    model = model_fn()
    opt = make(model, spec, transport)
    ref, ref_opt = ref_sgd(model)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    for step in range(3):
        what = (spec, transport, "scaler", step)
        want = expect(opt, spec, [local_grads(ref, r, step) for r in range(size)],
                      opt._hvdcomp_step)         # a skipped step is no step
        before = [p.detach().clone() for p in model.parameters()]
        x, y = batch(rank, step)
        if step == 1 and rank == 1:
            x[0, 0] = float("inf")
        opt.zero_grad()
        scaler.scale(F.cross_entropy(model(x), y)).backward()
        scaler.step(opt)
        scaler.update()
        if step == 1:
            assert scaler.get_scale() == 512.0, (what, scaler.get_scale())
            assert opt.last_stats.nonfinite, what
            assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before)), what
        else:
            assert scaler.get_scale() == (1024.0 if step == 0 else 512.0), what
            if want is not None:
                ref_apply(ref, ref_opt, want)
                compare(opt, model, ref, what)
        replicas_agree(model, what)
    opt.zero_grad()                     # never raises
    opt.close()


def check_bpps(spec, transport, k=3):
    """backward_passes_per_step=k: local sums until the k-th backward, which exchanges."""
    rank, size = hvd.rank(), hvd.size()
    model = model_fn()
    opt = make(model, spec, transport, backward_passes_per_step=k)
    ref, ref_opt = ref_sgd(model)
    for step in range(2):
        want = expect(opt, spec, [local_grads(ref, r, step, k) for r in range(size)], step)
        mine = local_grads(model, rank, step, k - 1)
        opt.zero_grad()
        stats = opt.last_stats
        for bp in range(k):
            loss_of(model, rank, step, bp).backward()
            if bp == k - 2:             # not exchanged yet: this rank's own sums
                assert opt.last_stats is stats
                for n, p in model.named_parameters():
                    assert torch.allclose(p.grad, mine[n], atol=1e-7), (spec, n)
        assert opt.last_stats is not stats
        grads_agree(model, (spec, transport, "bpps"))
        opt.step()
        replicas_agree(model, (spec, transport, "bpps"))
        if want is not None:
            ref_apply(ref, ref_opt, want)
            compare(opt, model, ref, (spec, transport, "bpps", step))
    opt.close()


def check_checkpointing(spec, transport):
    """Activation checkpointing, reentrant or not, over the layers next to the output: one
    exchange per backward pass (the nested backward pass of the reentrant checkpoint does
    not end it), averaged when backward returns."""
    from torch.utils.checkpoint import checkpoint
    rank, size = hvd.rank(), hvd.size()
    model = nn.Sequential(nn.Linear(20, 30), nn.Tanh(), nn.Linear(30, 30), nn.Tanh(),
                          nn.Linear(30, 4))
    opt = make(model, spec, transport, fusion_bytes=1)
    ref, ref_opt = ref_sgd(model)
    count = [0]
    finish = opt._exchange.finish

    def counted():
        count[0] += 1
        return finish()

    opt._exchange.finish = counted
    for step, reentrant in enumerate((True, False)):
        what = (spec, transport, "checkpoint", reentrant)
        want = expect(opt, spec, [local_grads(ref, r, step) for r in range(size)], step)
        x, y = batch(rank, step)
        opt.zero_grad()
        out = checkpoint(model[1:], model[0](x), use_reentrant=reentrant)
        F.cross_entropy(out, y).backward()
        assert count[0] == step + 1 and not opt._exchange.in_step, (what, count)
        grads_agree(model, what)
        if want is not None:
            for n, p in model.named_parameters():
                same(opt, n, p.grad, want[n], what)
        opt.step()
        replicas_agree(model, what)
        if want is not None:
            ref_apply(ref, ref_opt, want)
            compare(opt, model, ref, what)
    opt.close()


# --- 2. several optimizers ----------------------------------------------------------------

def check_several(spec, transport, n_opt, joint, reverse):
    """n_opt optimizers over parts of one model: one backward through all of them (their
    exchanges run at the same time) or one backward each (a GAN's generator and
    discriminator), stepped in either order; exact against plain torch."""
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


# --- 3. frozen and unused parameters -------------------------------------------------------

def check_frozen(spec, transport):
    """A layer frozen after 2 steps keeps p.grad None and does not move (SGD momentum and
    weight decay leave it alone; a residual compressor keeps its residual); a step with
    no backward moves nothing."""
    rank, size = hvd.rank(), hvd.size()
    model = model_fn()
    base = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOM, weight_decay=1e-3)
    opt = make(model, spec, transport, base=base)
    ref, ref_opt = ref_sgd(model, weight_decay=1e-3)
    for step in range(5):
        if step == 2:
            model[0].requires_grad_(False)
            ref[0].requires_grad_(False)
            frozen = [p.detach().clone() for p in model[0].parameters()]
            state = copy.deepcopy(opt.compression.state_dict())
        want = expect(opt, spec, [local_grads(ref, r, step) for r in range(size)], step)
        opt.zero_grad(set_to_none=True)
        loss_of(model, rank, step).backward()
        opt.step()
        what = (spec, transport, "frozen", step)
        if step >= 2:
            assert all(p.grad is None for p in model[0].parameters()), what
            assert all(torch.equal(p, q) for p, q in zip(model[0].parameters(), frozen)), what
            assert want is None or "0.weight" not in want
            st = opt.compression.state_dict()
            for part in st:                # residuals / DGC state of the frozen layer
                if isinstance(st[part], dict) and "0.weight" in state.get(part, {}):
                    assert torch.equal(st[part]["0.weight"], state[part]["0.weight"]), what
        if want is not None:
            ref_apply(ref, ref_opt, want)
            compare(opt, model, ref, what)
        replicas_agree(model, what)
    before = [p.detach().clone() for p in model.parameters()]
    opt.zero_grad(set_to_none=True)
    opt.step()                         # no backward at all: nothing moves
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before)), spec
    assert all(p.grad is None for p in model.parameters())
    opt.close()


def check_unused_on_some_ranks(spec, transport):
    """A head that only rank 0 uses: the average counts zeros from the other ranks, and
    every rank applies it (p.grad is set where the rank had none)."""
    rank, size = hvd.rank(), hvd.size()
    torch.manual_seed(2)
    model = nn.ModuleDict({"body": nn.Linear(20, 20), "a": nn.Linear(20, 4),
                           "b": nn.Linear(20, 4)})
    opt = make(model, spec, transport, base=torch.optim.SGD(model.parameters(), lr=LR))
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)

    def loss(m, r):
        x, y = batch(r, 0)
        h = m["body"](x).tanh()
        out = F.cross_entropy(m["a"](h), y)
        return out + m["b"](h).pow(2).mean() if r == 0 else out

    grads = []
    for r in range(size):
        m = copy.deepcopy(ref)
        loss(m, r).backward()
        grads.append({n: p.grad for n, p in m.named_parameters() if p.grad is not None})
    want = expect(opt, spec, grads, 0)
    assert "b.weight" in grads[0] and "b.weight" not in grads[1]
    opt.zero_grad()
    loss(model, rank).backward()
    grads_agree(model, (spec, "unused"))       # p.grad of b set on the ranks without one
    if want is not None:
        for n, p in model.named_parameters():
            same(opt, n, p.grad, want[n], (spec, "unused", n))
    opt.step()
    replicas_agree(model, (spec, "unused"))
    if want is not None:
        ref_apply(ref, ref_opt, want)
        compare(opt, model, ref, (spec, transport, "unused"))
    opt.close()


def check_unfrozen_later(spec, transport):
    """A layer frozen when the optimizer is built and unfrozen later is exchanged."""
    rank, size = hvd.rank(), hvd.size()
    model = model_fn()
    model[0].requires_grad_(False)
    opt = make(model, spec, transport)
    ref, ref_opt = ref_sgd(model)
    for step in range(4):
        if step == 2:
            model[0].requires_grad_(True)
            ref[0].requires_grad_(True)
        want = expect(opt, spec, [local_grads(ref, r, step) for r in range(size)], step)
        assert want is None or ("0.weight" in want) == (step >= 2)
        opt.zero_grad()
        loss_of(model, rank, step).backward()
        opt.step()
        what = (spec, transport, "unfrozen", step)
        assert (model[0].weight.grad is not None) == (step >= 2), what
        if want is not None:
            ref_apply(ref, ref_opt, want)
            compare(opt, model, ref, what)
        replicas_agree(model, what)
    opt.close()


# --- 4. DGC and parameter groups --------------------------------------------------------------

def check_dgc_groups(transport, spec="dgc:density=0.1"):
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
    ex = opt._exchange
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


def check_sparse(spec, transport, as_dense):
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

def check_join(spec, transport, n_opt=1):
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
    exact = spec.split(":")[0] in ("none", "qsgd", "alq")
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
        assert o._hvdcomp_step == 3, o._hvdcomp_step
        if spec.startswith("alq"):     # refitted after step 2, the same table everywhere
            comp = o.compression
            assert comp.level_version == 1, comp.level_version
            lv = hvd.allgather(comp.levels.view(1, -1), name=f"join.levels.{transport}")
            assert all(torch.equal(lv[0], lv[r]) for r in range(size)), lv
    for o in opts:
        o.close()


def check_join_refuses(transport):
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

def check_casts(transport):
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
            ex = hvd.Exchange([("w", p)], hvdcomp.get(spec), make_transport(transport),
                              hvd=hvd, min_compress_numel=16, allreduce_summable=summable)
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


def main(part):
    """part "a": cases 1 and 3 (tests/mpi/worker_loops.py); "b": cases 2, 4-7
    (tests/mpi/worker_loops_b.py)."""
    hvd.init()
    torch.set_num_threads(1)
    rank = hvd.rank()
    for transport in TRANSPORTS:
        if part == "a":
            for spec in ALL:
                check_ddp(spec, transport)
                check_bpps(spec, transport)
                check_checkpointing(spec, transport)
                check_grad_scaler(spec, transport)
                check_frozen(spec, transport)
                check_unused_on_some_ranks(spec, transport)
                check_unfrozen_later(spec, transport)
            continue
        for spec in STATELESS + ("alq:bits=3,bucket_size=64,refit_steps=3,refit_every=0",):
            check_join(spec, transport)
        for spec in ("none", "topk:density=0.1", "dgc:density=0.1"):
            check_join(spec, transport, n_opt=2)
        check_join_refuses(transport)
        for spec, n_opt, joint, reverse in (("none", 2, False, False), ("none", 2, False, True),
                                            (STATELESS[1], 3, True, True),
                                            (STATELESS[1], 3, False, False),
                                            ("topk:density=0.1", 2, True, False),
                                            ("dgc:density=0.1", 3, False, True)):
            check_several(spec, transport, n_opt, joint, reverse)
        check_dgc_groups(transport)
        for spec in ALL:
            check_sparse(spec, transport, as_dense=True)
        for spec in STATELESS:
            check_sparse(spec, transport, as_dense=False)
        check_casts(transport)
    say(rank, f"loops {part} OK")


if __name__ == "__main__":
    main("a")
