"""Issue 14: the drop-in optimizer in the training loops people write, on N ranks (cases 1
and 3 here; cases 2 and 4-7 in worker_loops_b.py, which shares this module's helpers).

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
Each check is a named case per compressor and transport (cases.py).
"""
import copy
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from cases import case, run
from common import exchange_of, step_of

import hvdcomp
import hvdcomp.torch as hvd
from hvdcomp.transport import make as make_transport

LR = 0.1
MOM = 0.9
TRANSPORTS = ["mpi", "horovod"]
STATELESS = ["none", "qsgd:bits=4,bucket_size=64"]      # deterministic: exact expectations
ALL = ["none", "qsgd:bits=4,bucket_size=64",            # STATELESS, + residuals, + DGC
       "topk:density=0.1", "dgc:density=0.1"]


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
    ex, size = exchange_of(opt), hvd.size()
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
    if exchange_of(opt).entries[name].allreduce or not exact:
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

@case.each(ALL, TRANSPORTS)
def ddp(spec, transport):
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
            assert torch.isfinite(loss) and not exchange_of(opt).in_step, what
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


@case.each(ALL, TRANSPORTS)
def grad_scaler(spec, transport):
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
                      step_of(opt))         # a skipped step is no step
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


@case.each(ALL, TRANSPORTS)
def bpps(spec, transport, k=3):
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


@case.each(ALL, TRANSPORTS)
def checkpointing(spec, transport):
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
    finish = exchange_of(opt).finish

    def counted():
        count[0] += 1
        return finish()

    exchange_of(opt).finish = counted
    for step, reentrant in enumerate((True, False)):
        what = (spec, transport, "checkpoint", reentrant)
        want = expect(opt, spec, [local_grads(ref, r, step) for r in range(size)], step)
        x, y = batch(rank, step)
        opt.zero_grad()
        out = checkpoint(model[1:], model[0](x), use_reentrant=reentrant)
        F.cross_entropy(out, y).backward()
        assert count[0] == step + 1 and not exchange_of(opt).in_step, (what, count)
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


# --- 3. frozen and unused parameters -------------------------------------------------------

@case.each(ALL, TRANSPORTS)
def frozen(spec, transport):
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


@case.each(ALL, TRANSPORTS)
def unused_on_some_ranks(spec, transport):
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


@case.each(ALL, TRANSPORTS)
def unfrozen_later(spec, transport):
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


torch.set_num_threads(1)

if __name__ == "__main__":
    run()
