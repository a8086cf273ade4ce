"""Issue 24 items 3 and 4 through the drop-in optimizer, under mpirun: objects built again,
copied or pickled, Horovod's broadcast helpers with fresh ranks and with only rank 0
restored from a checkpoint, and Horovod's DistributedOptimizer options.

Expected values come from plain torch (every rank recomputes every rank's gradients on a
copy of the model and averages them) or from horovod.torch's own DistributedOptimizer
with Compression.none on a twin model, never from hvdcomp.  Hangs: cases.py's barrier
after each case aborts the job, and test_mpi_objects.py's timeout fails it.
"""
import copy
import io
import pickle
import threading

import torch
import torch.nn as nn
import torch.nn.functional as F

from cases import case, run

import horovod.torch as horovod
import hvdcomp.torch as hvd

LR = 0.1
RESTORED = ["topk:density=0.1", "alq:bits=3", "signef", "dgc:density=0.1", "laq", "none"]


def model_fn(seed=11):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(20, 30), nn.Tanh(), nn.Linear(30, 4))


def batch(rank, step, n=8):
    g = torch.Generator().manual_seed(1000 * step + 10 * rank)
    return torch.randn(n, 20, generator=g), torch.randint(0, 4, (n,), generator=g)


def loss_of(model, rank, step):
    x, y = batch(rank, step)
    return F.cross_entropy(model(x), y)


def mean_grads(model, step):
    """{name: average over ranks} of every rank's gradient at ``step``, plain torch (a
    copy of ``model`` per rank, no hooks: deepcopy drops them), float64 sums."""
    size = hvd.size()
    acc = {}
    for r in range(size):
        m = copy.deepcopy(model)
        loss_of(m, r, step).backward()
        for n, p in m.named_parameters():
            acc[n] = acc.get(n, 0) + p.grad.double()
    return {n: (g / size).float() for n, g in acc.items()}


def sgd_reference(model, step, lr):
    """``model``'s parameters after one plain SGD step on the averaged gradients."""
    want = mean_grads(model, step)
    return {n: (p.detach() - lr * want[n]) for n, p in model.named_parameters()}


def close(got, want, what, tol=1e-6):
    for n, w in want.items():
        g = got[n]
        assert torch.allclose(g, w, rtol=tol, atol=tol), (what, n, float((g - w).abs().max()))


def params_of(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def identical_everywhere(tensors, what):
    """Every rank holds bit-identical ``tensors`` (a list)."""
    flat = torch.cat([t.detach().reshape(-1).double() for t in tensors]).view(1, -1)
    got = horovod.allgather(flat, name=f"objects.same.{identical_everywhere.n}")
    identical_everywhere.n += 1
    for r in range(hvd.size()):
        assert torch.equal(got[0], got[r]), (what, r)


identical_everywhere.n = 0


def raises(fn, exc, *words):
    """``fn()`` raises ``exc`` whose text holds every one of ``words`` (on this rank; every
    rank runs the same call)."""
    try:
        fn()
    except exc as e:
        text = str(e)
        missing = [w for w in words if w not in text]
        assert not missing, (missing, text)
        return text
    raise AssertionError(f"no {exc.__name__} raised")


def make(model, spec="none", lr=LR, base=None, **kw):
    kw.setdefault("min_compress_numel", 16)
    base = base or torch.optim.SGD(model.parameters(), lr=lr)
    return hvd.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                    compression=spec, **kw)


def train_step(model, opt, step):
    opt.zero_grad()
    loss_of(model, hvd.rank(), step).backward()
    opt.step()


def state_tensors(state, out=None):
    """Every tensor and number in hvdcomp's ``state`` (nested dicts/lists), in key order."""
    out = [] if out is None else out
    if isinstance(state, torch.Tensor):
        out.append(state.detach().double().reshape(-1))
    elif isinstance(state, dict):
        for k in sorted(state, key=str):
            state_tensors(state[k], out)
    elif isinstance(state, (list, tuple)):
        for v in state:
            state_tensors(v, out)
    elif isinstance(state, (int, float)) and not isinstance(state, bool):
        out.append(torch.tensor([float(state)], dtype=torch.float64))
    return out


# --- item 3: objects built again ----------------------------------------------------------

@case.each(["none", "topk:density=0.1"], [True, False])
def recreate(spec, summable):
    """A DistributedOptimizer built again on the same parameters (to change the learning
    rate) replaces the old one: the old one is closed (its hooks removed: one exchange
    per backward pass; no thread left: the thread count is what one exchange has), the
    old one's step() raises naming the new one, and one step of the new one gives the
    parameters plain torch gives (``none``)."""
    model = model_fn()
    opt1 = make(model, spec, allreduce_summable=summable)
    train_step(model, opt1, 0)
    threads = threading.active_count()
    old_step = opt1._driver.step
    old_stats = opt1.last_stats
    want = sgd_reference(model, 1, LR / 2)
    opt2 = make(model, spec, lr=LR / 2, allreduce_summable=summable)
    assert opt1._closed and not opt2._closed
    train_step(model, opt2, 1)
    # one exchange in that backward: the new one's; the old one's hooks are gone
    assert opt2._driver.step == 1 and opt2.last_stats.step == 0
    assert opt1._driver.step == old_step and opt1.last_stats is old_stats
    assert threading.active_count() == threads, (threading.active_count(), threads)
    if opt1.transport == "mpi":                 # its communicators freed
        from mpi4py import MPI
        ex = opt1._exchange
        assert ex.transport.comm == MPI.COMM_NULL and ex.transport._bye_comm == MPI.COMM_NULL
    if spec == "none":
        close(params_of(model), want, "after re-creating the optimizer")
    identical_everywhere(list(model.parameters()), "replicas after re-creating")
    raises(opt1.step, RuntimeError, "replaced by hvdcomp DistributedOptimizer number",
           str(opt2._ident))
    raises(opt1.synchronize, RuntimeError, "closed")
    # a third one, carrying the second's state by its state_dict (the documented way)
    sd = opt2.state_dict()
    opt3 = make(model, spec, lr=LR / 2, allreduce_summable=summable)
    opt3.load_state_dict(sd)
    assert opt3._driver.step == 1
    train_step(model, opt3, 2)
    assert opt3._driver.step == 2
    identical_everywhere(list(model.parameters()), "replicas after the third")
    assert threading.active_count() == threads
    opt3.close()


@case
def recreate_many_times():
    """An optimizer built again 200 times (a learning-rate schedule done by rebuilding):
    each replaces the last (threads and MPI communicators freed: MPICH allows only a few
    thousand), one exchange per backward pass, replicas identical."""
    model = model_fn()
    opt = make(model, "topk:density=0.1")
    train_step(model, opt, 0)
    threads = threading.active_count()
    for k in range(200):
        opt = make(model, "topk:density=0.1", lr=LR / (k + 2))
    train_step(model, opt, 1)
    assert opt._driver.step == 1 and threading.active_count() == threads
    identical_everywhere(list(model.parameters()), "replicas after 200 rebuilds")
    opt.close()


@case
def recreate_subset_refused():
    """A new optimizer on some of an open one's parameters would leave the others
    unexchanged: ValueError on every rank naming close(); the old one still works, and
    after its close() the new one is built."""
    model = model_fn()
    opt = make(model)
    raises(lambda: hvd.DistributedOptimizer(
        torch.optim.SGD(model[0].parameters(), lr=LR),
        named_parameters=model[0].named_parameters(), compression="none"),
        ValueError, "close()", "2.weight")
    want = sgd_reference(model, 0, LR)
    train_step(model, opt, 0)
    close(params_of(model), want, "the old optimizer after the refusal")
    opt.close()
    sub = hvd.DistributedOptimizer(torch.optim.SGD(model[0].parameters(), lr=LR),
                                   named_parameters=model[0].named_parameters(),
                                   compression="none")
    train_step(model, sub, 1)
    sub.close()


@case
def wrap_twice_refused():
    """hvdcomp's optimizer wrapped again, or Horovod's own: TypeError (each would hook the
    parameters a second time)."""
    model = model_fn()
    opt = make(model)
    raises(lambda: hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters()),
           TypeError, "already an hvdcomp DistributedOptimizer")
    other = model_fn()
    theirs = horovod.DistributedOptimizer(torch.optim.SGD(other.parameters(), lr=LR),
                                          named_parameters=other.named_parameters())
    raises(lambda: hvd.DistributedOptimizer(theirs, named_parameters=other.named_parameters()),
           TypeError, "horovod.torch's DistributedOptimizer")
    want = sgd_reference(model, 0, LR)
    train_step(model, opt, 0)
    close(params_of(model), want, "after the refusals")
    opt.close()


@case.each(["none", "topk:density=0.1"])
def copies(spec):
    """deepcopy, copy, pickle and torch.save of the optimizer: TypeError naming
    state_dict(); deepcopy of the model works and its backward exchanges nothing (torch
    drops the parameters' hooks), the original still exchanges once per backward; the
    state_dict goes through torch.save and loads into a new optimizer."""
    model = model_fn()
    opt = make(model, spec)
    train_step(model, opt, 0)
    for what, fn in [("deepcopy", lambda: copy.deepcopy(opt)), ("copy", lambda: copy.copy(opt)),
                     ("pickle", lambda: pickle.dumps(opt)),
                     ("torch.save", lambda: torch.save(opt, io.BytesIO()))]:
        raises(fn, TypeError, "cannot be pickled, copied or deep-copied", "state_dict()")
    twin = copy.deepcopy(model)             # e.g. an EMA / SWA copy
    step, stats = opt._driver.step, opt.last_stats
    loss_of(twin, hvd.rank(), 1).backward()
    assert opt._driver.step == step and opt.last_stats is stats and not opt._exchange.in_step
    local = copy.deepcopy(model)
    loss_of(local, hvd.rank(), 1).backward()
    for (n, p), q in zip(twin.named_parameters(), local.parameters()):
        assert torch.equal(p.grad, q.grad), n      # the local gradient, not an average
    if spec == "none":
        want = mean_grads(model, 1)
    opt.zero_grad()
    loss_of(model, hvd.rank(), 1).backward()
    assert opt.last_stats.step == step             # exactly one exchange, of this step
    if spec == "none":
        close({n: p.grad for n, p in model.named_parameters()}, want, "original after copy")
    opt.step()
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    sd = torch.load(buf, weights_only=False)
    opt2 = make(model, spec)                        # replaces opt
    opt2.load_state_dict(sd)
    assert opt2._driver.step == opt._driver.step == 2
    got = state_tensors(opt2._driver.state_dict()["compressor_state"])
    want = state_tensors(sd["hvdcomp"]["compressor_state"])
    assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))
    train_step(model, opt2, 2)
    identical_everywhere(list(model.parameters()), "replicas after reload")
    opt2.close()


# --- item 4: Horovod's broadcast helpers --------------------------------------------------

def twins(seed_by_rank):
    """(hvdcomp model, Horovod's twin) with the same parameters on this rank; different
    on every rank when ``seed_by_rank`` (fresh processes)."""
    seed = 11 + (100 * hvd.rank() if seed_by_rank else 0)
    return model_fn(seed), model_fn(seed)


@case.each(["none", "topk:density=0.1", "alq:bits=3"], ["hvdcomp", "horovod"])
def broadcast_fresh(spec, helper):
    """Fresh ranks (different initial parameters), Adam: broadcast_parameters, then
    broadcast_optimizer_state (hvdcomp.torch's or horovod.torch's own function): no
    exchange runs in it (hvdcomp's step stays 0: no compressed message of zeros), no
    deadlock, and the parameters after it and after one step equal those of Horovod's
    own DistributedOptimizer with Compression.none given the same calls (``none``; the
    others: identical on every rank)."""
    model, ref = twins(seed_by_rank=True)
    opt = make(model, spec, base=torch.optim.Adam(model.parameters(), lr=0.01))
    ref_opt = horovod.DistributedOptimizer(torch.optim.Adam(ref.parameters(), lr=0.01),
                                           named_parameters=ref.named_parameters(),
                                           compression=horovod.Compression.none)
    for m, o, f in [(model, opt, hvd if helper == "hvdcomp" else horovod),
                    (ref, ref_opt, horovod)]:
        horovod.broadcast_parameters(m.state_dict(), root_rank=0)
        f.broadcast_optimizer_state(o, root_rank=0)
    assert opt._driver.step == 0 and opt.last_stats is None and not opt._exchange.in_step
    close(params_of(model), params_of(ref), "after the broadcasts", tol=0)
    assert set(opt.state_dict()["state"]) == set(ref_opt.state_dict()["state"])
    identical_everywhere(list(model.parameters()), "replicas after the broadcasts")
    for m, o in [(model, opt), (ref, ref_opt)]:
        train_step(m, o, 0)
    assert opt._driver.step == 1
    if spec == "none":
        close(params_of(model), params_of(ref), "one step after the broadcasts")
    identical_everywhere(list(model.parameters()), "replicas after one step")
    opt.close()


@case.each(RESTORED)
def broadcast_restored(spec):
    """Only rank 0 restored from a checkpoint (model and optimizer state_dict, with
    hvdcomp's state: residuals, fitted levels, step), the other ranks fresh:
    hvd.broadcast_parameters + hvdcomp.torch.broadcast_optimizer_state leave every rank
    with rank 0's parameters, SGD momentum and hvdcomp state (bit for bit), no exchange
    runs in them and none deadlocks; the next step matches Horovod's own optimizer
    (Compression.none) given the same restored start (``none``), identical on every rank
    (all)."""
    rank = hvd.rank()
    model = model_fn()
    opt = make(model, spec, base=torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9))
    for step in range(3):
        train_step(model, opt, step)
    ckpt = {"model": copy.deepcopy(model.state_dict()), "opt": opt.state_dict()}
    opt.close()
    saved = copy.deepcopy(horovod.broadcast_object(ckpt if rank == 0 else None, 0,
                                                   name="objects.ckpt"))

    # new processes, as it were: fresh parameters on every rank; rank 0 restores.  The
    # reference (Horovod's own optimizer, Compression.none) only for ``none``: its SGD
    # state cannot take hvdcomp's (DGC's tensors have no SGD momentum buffer there).
    fresh, ref = twins(seed_by_rank=True)
    opt = make(fresh, spec, base=torch.optim.SGD(fresh.parameters(), lr=LR, momentum=0.9))
    ref_opt = None
    if spec == "none":
        ref_opt = horovod.DistributedOptimizer(
            torch.optim.SGD(ref.parameters(), lr=LR, momentum=0.9),
            named_parameters=ref.named_parameters(), compression=horovod.Compression.none)
    if rank == 0:        # (copies: load_state_dict keeps the tensors it is given)
        fresh.load_state_dict(ckpt["model"])
        opt.load_state_dict(copy.deepcopy(ckpt["opt"]))
        if ref_opt is not None:
            ref.load_state_dict(ckpt["model"])
            ref_opt.load_state_dict(copy.deepcopy(
                {k: v for k, v in ckpt["opt"].items() if k != "hvdcomp"}))
    horovod.broadcast_parameters(fresh.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    if ref_opt is not None:
        horovod.broadcast_parameters(ref.state_dict(), root_rank=0)
        horovod.broadcast_optimizer_state(ref_opt, root_rank=0)

    assert opt.last_stats is None and not opt._exchange.in_step      # no exchange ran
    close(params_of(fresh), {n: t for n, t in saved["model"].items()}, "rank 0's params",
          tol=0)
    mine = opt._driver.state_dict()
    assert mine["step"] == saved["opt"]["hvdcomp"]["step"] == 3
    want = state_tensors(saved["opt"]["hvdcomp"]["compressor_state"])
    got = state_tensors(mine["compressor_state"])
    assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want)), \
        "hvdcomp state differs from rank 0's"
    # the SGD momentum: rank 0's checkpoint's, on every rank (the entries it has: DGC's
    # tensors have none, their momentum is hvdcomp's)
    saved_mom = saved["opt"]["state"]
    mom = [opt.state[p]["momentum_buffer"] for p in fresh.parameters() if opt.state[p]]
    assert len(mom) == len(saved_mom) > 0
    close(dict(enumerate(mom)), {i: saved_mom[k]["momentum_buffer"]
                                 for i, k in enumerate(sorted(saved_mom))}, "momentum", tol=0)
    identical_everywhere(list(fresh.parameters()) + mom + (got or [torch.zeros(1)]),
                         "params, momentum and hvdcomp state after the broadcasts")
    train_step(fresh, opt, 3)
    if ref_opt is not None:
        train_step(ref, ref_opt, 3)
    assert opt._driver.step == 4
    if spec == "none":
        close(params_of(fresh), params_of(ref), "one step after the restore")
    identical_everywhere(list(fresh.parameters()), "replicas one step after the restore")
    opt.close()


@case
def broadcast_state_during_step_refused():
    """broadcast_state between a backward pass and its step (k = 2 passes, one done on
    every rank): the same RuntimeError on every rank, no hang; afterwards the step works."""
    model = model_fn()
    opt = make(model, "topk:density=0.1", backward_passes_per_step=2)
    opt.zero_grad()
    loss_of(model, hvd.rank(), 0).backward()
    raises(lambda: hvd.broadcast_state(opt, 0), RuntimeError, "during a step")
    loss_of(model, hvd.rank(), 0).backward()
    opt.step()
    hvd.broadcast_state(opt, 0)
    assert opt._driver.step == 1
    opt.close()


# --- item 4: Horovod's options ------------------------------------------------------------

class Bag(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(5)
        self.emb = nn.Embedding(50, 8, sparse=True)
        self.head = nn.Linear(8, 4)

    def forward(self, idx):
        return self.head(self.emb(idx).mean(1))


def bag_loss(m, step):
    g = torch.Generator().manual_seed(77 + 10 * hvd.rank() + step)
    idx = torch.randint(0, 50, (6, 5), generator=g)
    return F.cross_entropy(m(idx), torch.randint(0, 4, (6,), generator=g))


OPTIONS = ["sum", "predivide", "bpps", "sparse_as_dense"]


@case.each(OPTIONS)
def option_honoured(option):
    """op=Sum, gradient_predivide_factor=2, backward_passes_per_step=2, sparse_as_dense:
    two steps give the parameters of Horovod's own DistributedOptimizer with
    Compression.none and the same option."""
    kw = {"sum": dict(op=hvd.Sum), "predivide": dict(gradient_predivide_factor=2.0),
          "bpps": dict(backward_passes_per_step=2),
          "sparse_as_dense": dict(sparse_as_dense=True)}[option]
    build = Bag if option == "sparse_as_dense" else model_fn
    model, ref = build(), build()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR),
                                   named_parameters=model.named_parameters(),
                                   compression="none", **kw)
    ref_opt = horovod.DistributedOptimizer(torch.optim.SGD(ref.parameters(), lr=LR),
                                           named_parameters=ref.named_parameters(),
                                           compression=horovod.Compression.none, **kw)
    passes = 2 if option == "bpps" else 1
    for step in range(2):
        for m, o in [(model, opt), (ref, ref_opt)]:
            o.zero_grad()
            for bp in range(passes):
                if option == "sparse_as_dense":
                    bag_loss(m, step).backward()
                else:
                    loss_of(m, hvd.rank(), 10 * step + bp).backward()
            o.step()
    close(params_of(model), params_of(ref), f"option {option}", tol=1e-6)
    opt.close()


REFUSED = ["groups", "num_groups", "process_set", "adasum", "predivide_sum"]


@case.each(REFUSED)
def option_refused(option):
    """Options hvdcomp does not honour: ValueError on every rank at construction, after
    the settings handshake (no rank left waiting)."""
    model = model_fn()
    kw, words = {
        "groups": (dict(groups=[[p] for p in model.parameters()]), "groups"),
        "num_groups": (dict(num_groups=2), "num_groups"),
        "process_set": (dict(process_set=horovod.ProcessSet([0, 1])), "global process set"),
        "adasum": (dict(op=horovod.Adasum), "Adasum"),
        "predivide_sum": (dict(op=hvd.Sum, gradient_predivide_factor=2.0),
                          "gradient_predivide_factor")}[option]
    raises(lambda: make(model, **kw), ValueError, words)
    opt = make(model)                               # nothing left behind: a new one works
    want = sgd_reference(model, 0, LR)
    train_step(model, opt, 0)
    close(params_of(model), want, f"after refusing {option}")
    opt.close()


if __name__ == "__main__":
    run()
