"""The DDP hook under torchrun, on every rank, against values computed independently (a
single-process encode/decode of every rank's gradient, or plain arithmetic): the torch
transport, stateless compressors in both DDP bucket sizes, the summable all_reduce path,
static_graph, find_unused_parameters with a parameter unused on one rank, frozen parameters,
no_sync accumulation, Auto, the NaN policy, and the errors that must reach every rank.

Then issue 14's training loops through the hook (the cases of tests/mpi/worker_loops*.py),
each against plain torch in this one process: every rank recomputes every rank's gradients
on a copy of the model and averages them through its own per-rank twin of the compressor
(:class:`Twins`: residuals and DGC's momentum are per rank), bit for bit for ``none`` as
wire messages, QSGD (deterministic given its keys), EF-SignSGD and DGC (to 1e-5 where
Gloo's all_reduce sums): clipping between backward and step, closures and AMP's
GradScaler with an inf on one rank, a GAN's two DDP models each with its own HookState,
sparse embeddings (refused at set-up), Join with uneven inputs, casts that keep range, DGC
with two param groups and LambdaLR.

The launch ends with the first part of the checkpoint test (worker_resume.run("first")).
HVDCOMP_DDP_CASES=check_a,check_b runs only those checks (and not that part).
"""
import copy
import faulthandler
import json
import math
import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP

import golden
import hvdcomp
import hvdcomp.ddp
import worker_resume
from hvdcomp.exchange import plan_trial
from hvdcomp.transport import Outgoing
from hvdcomp.transport.torch_dist import TorchDistTransport, private_group

SEED = 3


def say(rank, msg):
    print(f"[rank {rank}] {msg}", flush=True)
    with open(os.path.join(os.environ["HVDCOMP_TEST_OUT"], f"rank{rank}.ok"), "w") as f:
        f.write(msg)


def expected(spec, named, grads_of, step, size, rank):
    """{name: average} from a fresh compressor: every rank's gradient (``grads_of(r)``)
    encoded with that rank's key, serialized, decoded in rank order, averaged; NaN policy."""
    ids = {n: i for i, n in enumerate(sorted(n for n, _ in named))}
    comp = hvdcomp.get(spec)
    out = {}
    for name, p in named:
        route = p.is_floating_point() and p.dim() > 1 and p.numel() >= 16
        c = comp if route else hvdcomp.get("none")
        acc = torch.zeros(p.numel(), dtype=torch.float32)
        finite = True
        for r in range(size):
            key = hvdcomp.TensorKey(name, ids[name], step, r, size, SEED)
            msg = hvdcomp.Message.from_bytes(c.encode(grads_of(r)[name], key).to_bytes())
            finite &= c.decode(msg, key, acc)
        if finite:
            c.finalize(acc, hvdcomp.TensorKey(name, ids[name], step, rank, size, SEED))
            finite = bool(torch.isfinite(acc).all())
        out[name] = (acc if finite else torch.full_like(acc, math.nan)).view(p.shape).to(p.dtype)
    return out


def same(a, b):
    return torch.equal(torch.nan_to_num(a, nan=7.5), torch.nan_to_num(b, nan=7.5))


def train(model, state_kwargs, rank, steps, spec, ddp_kwargs=None, grads_at=None):
    """DDP(model) with the hook; returns [(averaged grads per step)] and the state."""
    ddp = DDP(model, **(ddp_kwargs or {}))
    state = hvdcomp.ddp.HookState(ddp, spec, seed=SEED, min_compress_numel=16, **state_kwargs)
    ddp.register_comm_hook(state, hvdcomp.ddp.hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    seen = []
    for step in range(steps):
        opt.zero_grad()
        ddp((grads_at or golden.inputs)(rank, step)).backward()
        seen.append({n: p.grad.clone() for n, p in model.named_parameters()
                     if p.grad is not None})
        opt.step()
    return seen, state


def check_transport(rank, size):
    tp = TorchDistTransport(private_group(), max_chunk=7)        # rounds of 7 bytes
    mine = (np.arange(rank * 5) + rank).astype(np.uint8)         # rank 0: zero bytes
    got = tp.allgather(mine)
    assert [len(g) for g in got] == [5 * r for r in range(size)]
    for r, g in enumerate(got):
        assert np.array_equal(g, (np.arange(r * 5) + r).astype(np.uint8)), r
    assert all(len(g) == 0 for g in tp.allgather(np.empty(0, np.uint8)))
    assert np.array_equal(tp.allreduce_sum(np.array([rank, 1.5])),
                          [sum(range(size)), 1.5 * size])
    assert tp.broadcast(np.array([2.0 * rank + 1], np.float32), root=size - 1)[0] == 2 * size - 1
    # an error frame from rank 1 raises on every rank
    out = (Outgoing.failed(ValueError("no bytes on rank 1")) if rank == 1 else Outgoing([]))
    try:
        tp.exchange(out, what="the test frame")
        raise AssertionError("the error frame was not raised")
    except ValueError as e:
        assert rank == 1 and "no bytes" in str(e)
    except RuntimeError as e:
        assert rank != 1 and "rank 1 failed to encode the test frame" in str(e), e


def check_stateless(rank, size):
    """Stateless compressors in both bucket sizes against the single-process reference."""
    n = 0
    for spec in ["qsgd:bits=4,bucket_size=512", "terngrad", "psq:bits=4", "dqsg:bits=4",
                 "nuqsgd:bits=2,bucket_size=1000"]:
        for cap in (0.002, 25):
            model = golden.Golden()
            named = [(k, p) for k, p in model.named_parameters()]
            seen, state = train(model, {"allreduce_summable": False}, rank, 3, spec,
                                {"bucket_cap_mb": cap})
            for step in range(3):
                want = expected(spec, named, lambda r: golden.inputs(r, step), step, size, rank)
                for name in golden.SPECS:
                    assert same(seen[step][name], want[name]), (spec, cap, step, name)
                    n += 1
            assert state.step == 3 and state.last_stats.fp32_bytes == 4 * sum(
                p.numel() for _, p in named)
            assert state.last_stats.compressors["conv.weight"] == spec.split(":")[0]
            state.close()
    return n


def check_summable(rank, size):
    """none and fp16 through all_reduce (bf16 is not summable: wire messages), the average
    up to the cast's rounding; a NaN on one rank makes the tensor NaN everywhere (the NaN
    policy of the sum path)."""
    specs = {n: golden.SPECS[n] for n in ("conv.weight", "fc1.weight", "nan.weight")}

    def grads_at(r, step):
        g = {n: golden.golden_grad(n, r, step) for n in specs}
        if step == 1 and r == 1:
            g["nan.weight"].view(-1)[3] = float("inf")
        return g

    for spec, tol in (("none", 1e-6), ("fp16", 2e-3), ("bf16", 2e-2)):
        model = golden.Golden(specs)
        seen, state = train(model, {}, rank, 2, spec, grads_at=grads_at)
        summed = {n for n, e in state.exchange.entries.items() if e.allreduce}
        assert summed == (set() if spec == "bf16" else set(specs)), (spec, summed)
        for step in range(2):
            for n in specs:
                ref = torch.stack([grads_at(r, step)[n].float() for r in range(size)]).mean(0)
                got = seen[step][n]
                if not torch.isfinite(ref).all():
                    assert torch.isnan(got).all() and step == 1, (spec, n)
                    continue
                assert torch.allclose(got, ref, rtol=tol, atol=tol * 4), \
                    (spec, n, (got - ref).abs().max())
        assert state.last_stats.nonfinite == ["nan.weight"], state.last_stats.nonfinite
        state.close()


def check_static_graph(rank, size):
    spec = "qsgd:bits=4,bucket_size=512"
    model = golden.Golden()
    named = list(model.named_parameters())
    seen, state = train(model, {"allreduce_summable": False}, rank, 3, spec,
                        {"bucket_cap_mb": 0.002, "static_graph": True})
    for step in range(3):
        want = expected(spec, named, lambda r: golden.inputs(r, step), step, size, rank)
        for name in golden.SPECS:
            assert same(seen[step][name], want[name]), ("static", step, name)
    state.close()


class Partly(torch.nn.Module):
    """``used`` on every rank, ``skip`` on every rank but 1, ``frozen`` never trained."""

    def __init__(self):
        super().__init__()
        self.used = torch.nn.Parameter(torch.zeros(20, 30))
        self.skip = torch.nn.Parameter(torch.zeros(30, 20))
        self.frozen = torch.nn.Parameter(torch.ones(10, 10), requires_grad=False)

    def forward(self, g):
        loss = (self.used * g["used"]).sum() + (self.frozen * 0).sum()
        if g["rank"] != 1:
            loss = loss + (self.skip * g["skip"]).sum()
        return loss


def check_unused_and_frozen(rank, size):
    spec = "qsgd:bits=4,bucket_size=64"

    def grads_at(r, step):
        gen = torch.Generator().manual_seed(50 + 10 * r + step)
        return {"used": torch.randn(20, 30, generator=gen),
                "skip": torch.randn(30, 20, generator=gen) if r != 1 else torch.zeros(30, 20),
                "rank": r}

    model = Partly()
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    seen, state = train(model, {"allreduce_summable": False}, rank, 2, spec,
                        {"find_unused_parameters": True, "bucket_cap_mb": 0.001},
                        grads_at=grads_at)
    assert set(state.plan) == {"used", "skip"}           # the frozen one is not exchanged
    for step in range(2):
        want = expected(spec, named, lambda r: grads_at(r, step), step, size, rank)
        for name in ("used", "skip"):       # rank 1 contributes zeros for `skip`
            assert same(seen[step][name], want[name]), (step, name)
        assert "frozen" not in seen[step] and model.frozen.grad is None
    assert torch.equal(model.frozen, torch.ones(10, 10))
    state.close()


def check_no_sync(rank, size):
    """Two micro-batches, the first under no_sync: one exchange of their sum."""
    spec = "qsgd:bits=4,bucket_size=512"
    model = golden.Golden()
    named = list(model.named_parameters())
    ddp = DDP(model, bucket_cap_mb=0.002)
    state = hvdcomp.ddp.HookState(ddp, spec, seed=SEED, min_compress_numel=16,
                                  allreduce_summable=False)
    ddp.register_comm_hook(state, hvdcomp.ddp.hook)
    grads = golden.inputs(rank, 0)
    with ddp.no_sync():
        ddp(grads).backward()
    assert state.step == 0
    ddp(grads).backward()
    assert state.step == 1
    # the hook saw each rank's accumulated gradient, 2 G (exact: a doubling)
    want = expected(spec, named, lambda r: {n: g * 2 for n, g in golden.inputs(r, 0).items()},
                    0, size, rank)
    for n in golden.SPECS:
        assert same(model.get_parameter(n).grad, want[n]), n
    state.close()


def check_auto(rank, size):
    model = golden.Golden()
    seen, state = train(model, {}, rank, 2, "auto+alq:bits=3,bucket_size=512")
    plans = [None] * size
    dist.all_gather_object(plans, json.dumps(state.plan, sort_keys=True))
    assert len(set(plans)) == 1, plans              # every rank made the same plan
    for n, c in state.plan.items():   # fp16 of a bfloat16 tensor is sent as bf16 (its range)
        cast = "bf16" if golden.SPECS[n][1] == torch.bfloat16 else "fp16"
        assert c in {"none", cast, "alq"}, (n, c)
    assert state.exchange.auto is not None and state.exchange.auto.model is not None
    for n, g in seen[1].items():                   # and the averages agree across ranks
        got = [torch.empty_like(g) for _ in range(size)]
        dist.all_gather(got, g.contiguous())
        assert all(same(x, g) for x in got), n
    state.close()


def check_auto_per_layer(rank, size):
    """Auto per layer (hvdcomp.exchange.layer_plan) through the hook: step 0 in fp32 (the
    average of every rank's gradient), then the plan made from step 0's gradients when step
    1 begins, the same on every rank, with averages identical across ranks; the plan is in
    the hook's checkpoint.  With a trial (hvdcomp.exchange.plan_trial) where there are
    rivals: every rank measured the same seconds and kept the faster rival."""
    for trial in (0, 2):
        auto_per_layer(rank, size, trial)


def auto_per_layer(rank, size, trial):
    from hvdcomp.auto import LinkCost
    model = small(width=64)
    ddp = DDP(model)
    auto = hvdcomp.Auto(QSGD, per_layer=True, link=LinkCost(1e-4, 1e-7, 1e-4, 1e-7),
                        calibrate_numel=1 << 14, trial=trial)
    state = hvdcomp.ddp.HookState(ddp, auto, seed=SEED, min_compress_numel=16)
    ddp.register_comm_hook(state, hvdcomp.ddp.hook)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(3):
        every = [grads_on_copy(model, lambda m, r=r: ce(m, r, step)) for r in range(size)]
        opt.zero_grad()
        ce(ddp, rank, step).backward()
        for n, p in model.named_parameters():
            got = [torch.empty_like(p.grad) for _ in range(size)]
            dist.all_gather(got, p.grad.contiguous())
            assert all(same(x, p.grad) for x in got), (step, n)
            if step == 0:
                want = sum(g[n] for g in every) / size
                assert torch.allclose(p.grad, want, rtol=1e-6, atol=1e-8), (n, step)
        layer = state.exchange.layer
        assert layer.pending == (step == 0), step
        opt.step()
    plan = layer.state_dict()["plan"]
    assert sorted(plan) == ["0.weight", "2.weight"], plan
    plans = [None] * size
    dist.all_gather_object(plans, json.dumps(plan, sort_keys=True))
    assert len(set(plans)) == 1, plans
    assert state.state_dict()["layer_plan"]["plan"] == plan
    assert {n: c["spec"].split(":")[0] for n, c in plan.items()} == {
        n: state.plan[n] for n in plan}
    rivals = plan_trial.rivals(layer)
    if trial and rivals:
        assert set(layer.trial) == {"plan", "uniform"}, layer.trial
        kept = min(layer.trial, key=layer.trial.get)
        assert layer.choices == rivals[kept]
        seen = [None] * size
        dist.all_gather_object(seen, layer.trial)
        assert all(t == layer.trial for t in seen), seen
    else:
        assert layer.trial == {} and layer.choices == layer.planned
    state.close()


def check_auto_per_layer_trial(rank, size):
    """The per-layer plan's trial through the hook (hvdcomp.exchange.plan_trial: one call of
    the recorded gradients into scratch buffers).  On a link priced as free the plan sends
    both weights in fp32 and its rival is QSGD on both; with the trial's QSGD encoding
    0.1 s slower the trial keeps the plan on every rank, from the same seconds; the averages of
    steps 1 and 2 equal, bit for bit, those of a hook that planned the same with no trial,
    and the trial leaves no buffers behind."""
    from hvdcomp.auto import LinkCost
    free = LinkCost(1e-9, 1e-15, 1e-9, 1e-15)
    inner = plan_trial.get

    def get(spec):              # the trial's own QSGD instances encode 0.1 s slower
        comp = inner(spec)
        if comp.name == "qsgd":
            encode = comp.encode

            def slow(grad, key):
                time.sleep(0.1)
                return encode(grad, key)
            comp.encode = slow
        return comp
    plan_trial.get = get
    try:
        runs = [per_layer_run(rank, size, hvdcomp.Auto(QSGD, per_layer=True, link=free,
                                                       calibrate_numel=1 << 14, trial=t))
                for t in (2, 0)]
    finally:
        plan_trial.get = inner
    (tried, layer, accs), (untried, ref, ref_accs) = runs
    assert plan_trial.rivals(layer) and ref.trial == {}
    assert {c.spec for c in layer.planned.values()} == {"none"}, layer.planned
    assert layer.trial["uniform"] > layer.trial["plan"] + 0.1, layer.trial
    assert layer.choices == layer.planned == ref.choices
    seen = [None] * size
    dist.all_gather_object(seen, layer.trial)
    assert all(t == layer.trial for t in seen), seen
    for step in (1, 2):
        assert all(same(tried[step][n], untried[step][n]) for n in tried[step]), step
    assert accs == ref_accs, (accs, ref_accs)


def per_layer_run(rank, size, auto):
    """3 steps of the small model through the hook with ``auto``: ({step: {name: averaged
    gradient}}, the per-layer planner, the names of the exchange's own average buffers)."""
    model = small(width=64)
    ddp = DDP(model)
    state = hvdcomp.ddp.HookState(ddp, auto, seed=SEED, min_compress_numel=16)
    ddp.register_comm_hook(state, hvdcomp.ddp.hook)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    out = {}
    for step in range(3):
        opt.zero_grad()
        ce(ddp, rank, step).backward()
        out[step] = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
    layer, accs = state.exchange.layer, sorted(state.exchange.averaging._accs)
    state.close()
    return out, layer, accs


def raises_everywhere(rank, fn, here, elsewhere):
    """fn() raises on every rank: ``here`` (exception type, text) on rank 1, ``elsewhere``
    on the others."""
    want = here if rank == 1 else elsewhere
    try:
        fn()
    except want[0] as e:
        assert want[1] in str(e), (want[1], str(e))
        return
    raise AssertionError(f"rank {rank}: {want} was not raised")


def check_errors(rank, size):
    class Flaky(hvdcomp.QSGD):
        def _encode(self, grad, key):
            if key.rank == 1:
                raise ValueError("boom on rank 1")
            return super()._encode(grad, key)

    model = golden.Golden()
    ddp = DDP(model)
    state = hvdcomp.ddp.HookState(ddp, Flaky(bits=4, bucket_size=512), seed=SEED,
                                  min_compress_numel=16)
    ddp.register_comm_hook(state, hvdcomp.ddp.hook)
    # (DDP re-raises a hook's error as a RuntimeError quoting the original)
    raises_everywhere(rank, lambda: ddp(golden.inputs(rank, 0)).backward(),
                      (RuntimeError, "ValueError: boom on rank 1"),
                      (RuntimeError, "rank 1 failed to encode"))
    state.close()

    # a rank that raises while preparing its buckets (before encoding): every rank raises,
    # through an error frame (qsgd: wire messages) or the failing rank's slot in the summed
    # buffers (none: every tensor summed, no frame at all)
    for spec, elsewhere in (("qsgd:bits=4,bucket_size=512", "rank 1 failed to encode"),
                            ("none", "rank 1 stopped in bucket")):
        model = golden.Golden()
        ddp = DDP(model, bucket_cap_mb=0.002)
        state = hvdcomp.ddp.register(ddp, spec, seed=SEED, min_compress_numel=16)
        prepare = hvdcomp.ddp.bucket.prepare
        if rank == 1:
            def failing(*_):
                raise KeyError("prepare boom on rank 1")
            hvdcomp.ddp.bucket.prepare = failing
        try:
            raises_everywhere(rank, lambda: ddp(golden.inputs(rank, 0)).backward(),
                              (RuntimeError, "prepare boom on rank 1"), (RuntimeError, elsewhere))
        finally:
            hvdcomp.ddp.bucket.prepare = prepare
        state.close()

    # DGC told the optimizer on every rank but rank 1: rank 1's first step raises, and so
    # does every other rank's
    model = golden.Golden()
    ddp = DDP(model)
    opt = golden.optimizer(model)
    state = hvdcomp.ddp.register(ddp, "dgc:density=0.05", seed=SEED, min_compress_numel=16,
                                 optimizer=None if rank == 1 else opt)
    raises_everywhere(rank, lambda: ddp(golden.inputs(rank, 0)).backward(),
                      (RuntimeError, "attach_optimizer"), (RuntimeError, "rank 1 failed"))
    state.close()

    # ranks that disagree on the seed, or on the model: Mismatch on every rank, agreed over
    # DDP's group before anything else; the seed is named with each rank's value
    def disagree_seed():
        hvdcomp.ddp.HookState(golden.Golden(), "qsgd", seed=SEED + (rank == 1))
    seed_line = f"seed: {SEED} on rank{'s' if size > 2 else ''} 0"
    raises_everywhere(rank, disagree_seed, (hvdcomp.Mismatch, seed_line),
                      (hvdcomp.Mismatch, seed_line))
    raises_everywhere(rank, disagree_seed, (hvdcomp.Mismatch, f"{SEED + 1} on rank 1"),
                      (hvdcomp.Mismatch, f"{SEED + 1} on rank 1"))

    # a rank a step ahead (as after loading another step's checkpoint): every collective
    # carries the step, so every rank raises OutOfStep (DDP re-raises it as a RuntimeError
    # quoting it), through the frames' stamps (qsgd) or the summed buffers' slots (none)
    for spec in ("qsgd:bits=4,bucket_size=512", "none"):
        ddp2 = DDP(golden.Golden())
        st2 = hvdcomp.ddp.register(ddp2, spec, seed=SEED, min_compress_numel=16)
        st2.step = 3 if rank == 1 else 0
        raises_everywhere(rank, lambda: ddp2(golden.inputs(rank, 0)).backward(),
                          (RuntimeError, "ranks out of step"),
                          (RuntimeError, "ranks out of step"))
        st2.close()

    def disagree_model():
        specs = dict(golden.SPECS)
        if rank == 1:
            specs["conv.weight"] = ((7, 3, 5, 4), torch.float32)
        hvdcomp.ddp.HookState(golden.Golden(specs), "qsgd")
    raises_everywhere(rank, disagree_model, (RuntimeError, "disagree"),
                      (RuntimeError, "disagree"))

    # a typo: the compressor's valid settings, before any collective
    try:
        hvdcomp.ddp.HookState(golden.Golden(), "alq:bitz=3")
        raise AssertionError("typo accepted")
    except hvdcomp.ConfigError as e:
        assert "unknown setting 'bitz'" in str(e) and "alq:bits=3" in str(e), e

    # not DDP: register() refuses, the hook refuses anything but a GradBucket
    try:
        hvdcomp.ddp.register(golden.Golden(), "qsgd")
        raise AssertionError("non-DDP module accepted")
    except TypeError as e:
        assert "DistributedDataParallel" in str(e)
    st = hvdcomp.ddp.HookState(golden.Golden(), "qsgd")
    try:
        hvdcomp.ddp.hook(st, torch.zeros(3))
        raise AssertionError("a tensor accepted as a bucket")
    except TypeError as e:
        assert "GradBucket" in str(e)
    st.close()

    # DGC applies momentum itself: without the optimizer, the first step raises everywhere
    model = golden.Golden()
    ddp = DDP(model)
    state = hvdcomp.ddp.register(ddp, "dgc:density=0.05", seed=SEED, min_compress_numel=16)
    raises_everywhere(rank, lambda: ddp(golden.inputs(rank, 0)).backward(),
                      (RuntimeError, "attach_optimizer"), (RuntimeError, "attach_optimizer"))
    state.close()
    model = golden.Golden()
    nesterov = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True)
    try:
        hvdcomp.ddp.HookState(model, "dgc", optimizer=nesterov, min_compress_numel=16)
        raise AssertionError("Nesterov accepted with DGC")
    except ValueError as e:
        assert "Nesterov" in str(e)

    # a checkpoint of another rank
    st = hvdcomp.ddp.HookState(golden.Golden(), "signef")
    sd = st.state_dict()
    sd["rank"] = (rank + 1) % size
    try:
        st.load_state_dict(sd)
        raise AssertionError("another rank's checkpoint accepted")
    except ValueError as e:
        assert "one checkpoint per rank" in str(e)
    st.close()


# --- issue 14's training loops through the hook ------------------------------------------

LR, MOM, CLIP = 0.1, 0.9, 0.05
QSGD = "qsgd:bits=4,bucket_size=64"
DGC = "dgc:density=0.1"


def small(seed=11, width=30):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(20, width), nn.Tanh(), nn.Linear(width, 4))


def batch(rank, step, n=8):
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + 1)
    return torch.randn(n, 20, generator=g), torch.randint(0, 4, (n,), generator=g)


def ce(model, rank, step):
    x, y = batch(rank, step)
    return F.cross_entropy(model(x), y)


def grads_on_copy(model, loss_of):
    """{name: gradient} of ``loss_of(copy of model)`` (a name missing: no gradient)."""
    m = copy.deepcopy(model)
    m.zero_grad(set_to_none=True)
    loss_of(m).backward()
    return {n: p.grad.detach().clone() for n, p in m.named_parameters() if p.grad is not None}


class Twins:
    """What one HookState must deliver, computed in this process: rank r's gradient of each
    tensor encoded by rank r's own instance of the compression (its residuals, DGC's
    momentum) when the state routes the tensor to it, by ``none`` otherwise, with rank r's
    key, through bytes; decoded in rank order into float32; finalized with this rank's key
    over ``contributors`` ranks (default all); NaN policy.  Counts its steps like the
    hook (one per exchange).  Routing and tensor ids come from the state's plan; the
    values from these independent compressors."""

    def __init__(self, spec, state, size, rank, momentum=None):
        self.comps = [hvdcomp.get(spec) for _ in range(size)]
        self.none = hvdcomp.get("none")
        ex = state.exchange
        self.routed = {n for n, e in ex.entries.items() if e.compressor is ex.compression}
        self.entries = {n: (e.tensor_id, e.param.shape, e.param.dtype)
                        for n, e in ex.entries.items()}
        self.size, self.rank, self.step = size, rank, 0
        if momentum is not None:
            for c in self.comps:
                c.set_momentum(momentum)

    def average(self, grads, contributors=None):
        """grads[r]: rank r's {name: gradient} (a missing name: absent on rank r)."""
        out = {}
        for name, (tid, shape, dtype) in self.entries.items():
            present = [r for r in range(self.size) if grads[r].get(name) is not None]
            if not present:
                continue
            mine = self.comps[self.rank] if name in self.routed else self.none
            acc = torch.zeros(math.prod(shape), dtype=torch.float32)
            finite = True
            for r in present:
                c = self.comps[r] if name in self.routed else self.none
                key = hvdcomp.TensorKey(name, tid, self.step, r, self.size, SEED)
                msg = hvdcomp.Message.from_bytes(c.encode(grads[r][name], key).to_bytes())
                finite &= mine.decode(msg, key, acc)
            if finite:
                mine.finalize(acc, hvdcomp.TensorKey(name, tid, self.step, self.rank,
                                                     contributors or self.size, SEED))
                finite = bool(torch.isfinite(acc).all())
            out[name] = (acc if finite else torch.full_like(acc, math.nan)).view(shape).to(dtype)
        self.step += 1
        return out


def hooked(model, spec, opt, summable=False, **ddp_kwargs):
    """DDP(model) in small buckets (several per step) with the hook and ``opt`` attached."""
    ddp = DDP(model, bucket_cap_mb=ddp_kwargs.pop("bucket_cap_mb", 0.001), **ddp_kwargs)
    state = hvdcomp.ddp.HookState(ddp, spec, seed=SEED, min_compress_numel=16,
                                  allreduce_summable=summable, optimizer=opt)
    ddp.register_comm_hook(state, hvdcomp.ddp.hook)
    return ddp, state


def reference_sgd(ref, dgc=()):
    """Plain SGD over ``ref``: momentum MOM, except for DGC's tensors, whose step is
    p -= lr * average (DGC applies the momentum itself): SGD without momentum."""
    ps = dict(ref.named_parameters())
    groups = [dict(params=[p for n, p in ps.items() if n not in dgc], momentum=MOM)]
    if dgc:
        groups.append(dict(params=[ps[n] for n in sorted(dgc)], momentum=0.0))
    return torch.optim.SGD(groups, lr=LR)


def ref_apply(ref, ref_opt, want, clip=None):
    for n, p in ref.named_parameters():
        p.grad = want[n].clone() if n in want else None
    norm = None if clip is None else torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
    ref_opt.step()
    return norm


def close_to(got, want, exact, what):
    if exact:
        assert torch.equal(got, want), (what, (got - want).abs().max())
    else:
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), (what, (got - want).abs().max())


def compare(model, ref, exact, what):
    """``model``'s parameters against ``ref``'s; then ``ref`` continues from ``model``'s
    (Gloo's all_reduce sums in its own order: not bit for bit)."""
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.isfinite(p).all(), (what, n)
        close_to(p.detach(), q.detach(), exact, (what, n))
        with torch.no_grad():
            q.copy_(p)


def agree(model, what, grads=False):
    """Every rank holds the same parameters (``grads``: the same p.grad)."""
    flat = torch.cat([(p.grad if grads else p).detach().reshape(-1).double()
                      for p in model.parameters()])
    got = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(got, flat)
    assert all(torch.equal(g, flat) for g in got), what


# (spec, allreduce_summable): none as wire messages and through all_reduce, error feedback,
# DGC (momentum correction with the SGD attached)
LOOP_SPECS = [("none", False), ("none", True), ("signef", False), (DGC, False)]
# the loop's steps: backward then step; clipping between them; a closure; AMP's GradScaler
# (an inf in rank 1's input at the first "scaler-inf" step)
MODES = ("plain", "clip", "closure", "scaler", "scaler-inf", "scaler", "closure")


def loop_setup(spec, summable, rank, size):
    model = small()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOM)
    ddp, state = hooked(model, spec, opt, summable)
    dgc = spec.startswith("dgc")
    twins = Twins(spec, state, size, rank)
    if dgc:
        assert twins.routed == {"0.weight", "2.weight"}, twins.routed
        for c in twins.comps:
            c.set_momentum({n: MOM for n in twins.routed})
    return model, ref, opt, ddp, state, twins, reference_sgd(ref, twins.routed if dgc else ())


def check_loops(rank, size):
    """#14 item 1 through the hook (its gradients are averaged when backward returns):
    (b) clip_grad_norm_ between backward and step clips the average: the norm and the
    clipped gradients as plain torch computes them from every rank's gradients; (c)
    opt.step(closure) with a closure that calls zero_grad and backward applies the
    closure's average, the same on every rank (DGC too: the closure runs before the hook's
    step hooks set DGC's tensors aside); (a) AMP's GradScaler (CPU): the hook averages the
    scaled gradients and the step applies them unscaled (bit for bit: the scale is a power
    of two); with an inf in rank 1's input the tensor is NaN on every rank, so every rank
    skips that step and halves its scale, and no weight anywhere turns NaN."""
    for spec, summable in LOOP_SPECS:
        model, ref, opt, ddp, state, twins, ref_opt = loop_setup(spec, summable, rank, size)
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        exact = not summable
        for step, mode in enumerate(MODES):
            what = (spec, summable, mode, step)
            scale = scaler.get_scale() if mode.startswith("scaler") else 1.0

            def loss_of(m, r):
                x, y = batch(r, step)
                if mode == "scaler-inf" and r == 1:
                    x[0, 0] = float("inf")
                loss = F.cross_entropy(m(x), y)
                # (GradScaler.scale: the loss times its float32 scale tensor)
                return loss * torch.full((), scale) if mode.startswith("scaler") else loss

            want = twins.average([grads_on_copy(ref, lambda m: loss_of(m, r))
                                  for r in range(size)])
            before = [p.detach().clone() for p in model.parameters()]
            clip = None
            if mode == "closure":
                def closure():
                    opt.zero_grad()
                    loss = loss_of(ddp, rank)
                    loss.backward()
                    return loss
                assert torch.isfinite(opt.step(closure)), what
            elif mode.startswith("scaler"):
                opt.zero_grad()
                x, y = batch(rank, step)
                if mode == "scaler-inf" and rank == 1:
                    x[0, 0] = float("inf")
                scaler.scale(F.cross_entropy(ddp(x), y)).backward()
                scaler.step(opt)
                scaler.update()
            else:
                opt.zero_grad()
                loss_of(ddp, rank).backward()
                for n, p in model.named_parameters():     # averaged when backward returns
                    close_to(p.grad, want[n], exact, (what, n))
                if mode == "clip":
                    clip = CLIP
                    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
                opt.step()
            if mode == "scaler-inf":                      # skipped everywhere
                assert scaler.get_scale() == scale / 2, (what, scaler.get_scale())
                assert state.last_stats.nonfinite, what
                assert not all(torch.isfinite(w).all() for w in want.values()), what
                assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before)), what
                continue
            if mode == "scaler":
                assert scaler.get_scale() == scale, (what, scaler.get_scale())
                inv = torch.full((), scale, dtype=torch.float64).reciprocal().float()
                want = {n: g * inv for n, g in want.items()}      # GradScaler.unscale_
            agree(model, what, grads=True)
            got = {n: p.grad.clone() for n, p in model.named_parameters()}
            ref_norm = ref_apply(ref, ref_opt, want, clip)
            for n, p in ref.named_parameters():           # the gradients the step applied
                close_to(got[n], p.grad, exact, (what, "grad", n))
            if clip is not None:
                assert ref_norm > clip, (what, ref_norm)  # not vacuous: it clipped
                close_to(norm, ref_norm, exact, (what, "norm"))
            compare(model, ref, exact, what)              # (finite, too)
            agree(model, what)
        assert state.step == len(MODES) and scaler.get_scale() == 512.0
        opt.zero_grad()
        state.close()


def check_gan(rank, size):
    """#14 item 2 through the hook: a GAN's generator and discriminator, each DDP-wrapped
    with its own HookState and SGD, stepped discriminator-first or generator-first by turns;
    the generator's backward runs through both DDP models (both hooks' exchanges in flight
    at once, on their own private groups).  Each model's parameters, and the discriminator's
    gradients from the generator's step, exact against plain torch."""
    def real(r, it):
        g = torch.Generator().manual_seed(300 + 10 * it + r)
        return torch.randn(6, 20, generator=g) + 1

    def noise(r, it, k):
        return torch.randn(6, 8, generator=torch.Generator().manual_seed(700 + 10 * it + r + k))

    def d_loss(d, g, r, it):
        with torch.no_grad():
            fake = g(noise(r, it, 0))
        out = d(torch.cat([real(r, it), fake]))
        return F.softplus(-out[:6]).mean() + F.softplus(out[6:]).mean()

    def g_loss(d, g, r, it):
        return F.softplus(-d(g(noise(r, it, 5)))).mean()

    for spec in ("none", "signef"):
        torch.manual_seed(21)
        gen = nn.Linear(8, 20)
        disc = nn.Sequential(nn.Linear(20, 16), nn.Tanh(), nn.Linear(16, 1))
        ref_g, ref_d = copy.deepcopy(gen), copy.deepcopy(disc)
        opt_g = torch.optim.SGD(gen.parameters(), lr=LR, momentum=MOM)
        opt_d = torch.optim.SGD(disc.parameters(), lr=LR, momentum=MOM)
        ddp_g, st_g = hooked(gen, spec, opt_g)
        ddp_d, st_d = hooked(disc, spec, opt_d)
        assert st_g.exchange.ident != st_d.exchange.ident
        tw_g, tw_d = Twins(spec, st_g, size, rank), Twins(spec, st_d, size, rank)
        ref_opt_g, ref_opt_d = reference_sgd(ref_g), reference_sgd(ref_d)
        held_d = None           # the discriminator's p.grad: the generator's step adds to it
        for it in range(3):
            for phase in (("d", "g") if it % 2 == 0 else ("g", "d")):
                what = (spec, it, phase)
                if phase == "d":
                    held_d = None                   # opt_d.zero_grad() below
                per_g, per_d = [], []
                for r in range(size):
                    md, mg = copy.deepcopy(ref_d), copy.deepcopy(ref_g)
                    (d_loss if phase == "d" else g_loss)(md, mg, r, it).backward()
                    per_d.append({n: p.grad if held_d is None else held_d[n] + p.grad
                                  for n, p in md.named_parameters()})
                    per_g.append({n: p.grad for n, p in mg.named_parameters()
                                  if p.grad is not None})
                # the discriminator's hook, both phases: in the generator's, on the gradient
                # accumulated onto what p.grad held (as DDP buckets it)
                want_d = held_d = tw_d.average(per_d)
                if phase == "d":
                    opt_d.zero_grad()
                    d_loss(ddp_d, ddp_g, rank, it).backward()
                    opt_d.step()
                    ref_apply(ref_d, ref_opt_d, want_d)
                    compare(disc, ref_d, True, what)
                else:
                    want_g = tw_g.average(per_g)
                    opt_g.zero_grad()
                    g_loss(ddp_d, ddp_g, rank, it).backward()
                    for n, p in disc.named_parameters():   # averaged too (dropped later)
                        close_to(p.grad, want_d[n], True, (what, n))
                    opt_g.step()
                    ref_apply(ref_g, ref_opt_g, want_g)
                    compare(gen, ref_g, True, what)
                agree(gen, what)
                agree(disc, what)
        assert (st_g.step, st_d.step) == (3, 6), (st_g.step, st_d.step)
        st_g.close()
        st_d.close()


class Bag(nn.Module):
    def __init__(self, sparse):
        super().__init__()
        torch.manual_seed(4)
        self.emb = nn.Embedding(50, 8, sparse=sparse)
        self.head = nn.Linear(8, 4)

    def forward(self, idx):
        return self.head(self.emb(idx).mean(1))


def bag_loss(m, r):
    g = torch.Generator().manual_seed(77 + r)
    idx, y = torch.randint(0, 50, (6, 5), generator=g), torch.randint(0, 4, (6,), generator=g)
    return F.cross_entropy(m(idx), y)


def check_sparse(rank, size):
    """#14 item 5 through the hook: nn.Embedding(sparse=True) under DDP is refused when the
    state is set up, with one TypeError on every rank naming the parameter and the ways out
    (DDP would hand the hook a sparse bucket); the same model with sparse=False trains
    through the hook, exact against plain torch."""
    faulthandler.dump_traceback_later(300, exit=True)       # a hang fails fast, with stacks
    for make in (lambda d: hvdcomp.ddp.HookState(d, "qsgd", seed=SEED),
                 lambda d: hvdcomp.ddp.register(d, "none", seed=SEED)):
        ddp = DDP(Bag(sparse=True))
        try:
            make(ddp)
            raise AssertionError("a sparse embedding accepted")
        except TypeError as e:
            assert "['emb.weight']" in str(e) and "sparse=False" in str(e), e
    # a state built before the embedding turned sparse: DDP's sparse bucket fails every
    # rank's backward (the hook's own check), it is not left un-averaged
    model = Bag(sparse=False)
    state = hvdcomp.ddp.HookState(model, "none", seed=SEED)
    model.emb.sparse = True
    ddp = DDP(model)
    ddp.register_comm_hook(state, hvdcomp.ddp.hook)
    try:
        bag_loss(ddp, rank).backward()
        raise AssertionError("a sparse bucket accepted")
    except RuntimeError as e:
        assert "['emb.weight'] is sparse" in str(e), e
    state.close()
    dist.barrier()                                  # every rank got here, none hung
    model = Bag(sparse=False)
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOM)
    ddp, state = hooked(model, "none", opt)
    twins = Twins("none", state, size, rank)
    want = twins.average([grads_on_copy(ref, lambda m: bag_loss(m, r)) for r in range(size)])
    opt.zero_grad()
    bag_loss(ddp, rank).backward()
    opt.step()
    ref_apply(ref, reference_sgd(ref), want)
    compare(model, ref, True, "dense embedding")
    state.close()
    faulthandler.cancel_dump_traceback_later()


# (spec, divide_by_initial_world_size)
JOIN_SPECS = [("none", True), (QSGD, False), ("signef", True), (DGC, False)]


def check_join(rank, size):
    """#14 item 6 through the hook: Join([ddp_model]) with odd ranks running one batch
    more.  The ranks that ran out shadow the others' buckets and send nothing: the extra
    step's average divides by the world size (DDP's default, divide_by_initial_world_size
    =True, as DDP's own all-reduce) or by the ranks that had not joined (False, as
    hvd.join()); exact against plain torch, on the ranks that stepped and, after Join's
    final broadcast, on every rank.  LAQ, which cannot leave a rank out, raises on every
    rank.  No hang (a watchdog ends the process with its stacks)."""
    faulthandler.dump_traceback_later(300, exit=True)
    active = [r for r in range(size) if r % 2 == 1]
    steps = 2 + rank % 2
    for spec, divide in JOIN_SPECS:
        what = (spec, divide)
        model, ref, opt, ddp, state, twins, ref_opt = loop_setup(spec, False, rank, size)
        # plain torch first, every step: each rank's gradients (none from the ranks out of
        # data at step 2), averaged over the world or over the ranks that contributed
        trajectory = []
        for step in range(3):
            ranks = range(size) if step < 2 else active
            grads = [grads_on_copy(ref, lambda m: ce(m, r, step)) if r in ranks else {}
                     for r in range(size)]
            ref_apply(ref, ref_opt, twins.average(
                grads, None if divide or step < 2 else len(active)))
            trajectory.append([p.detach().clone() for p in ref.parameters()])
        with Join([ddp], divide_by_initial_world_size=divide):
            for step in range(steps):
                opt.zero_grad()
                ce(ddp, rank, step).backward()
                opt.step()
                for p, q in zip(model.parameters(), trajectory[step]):
                    assert torch.equal(p.detach(), q), (what, step)
        assert state.step == 3, (what, state.step)
        assert state.last_stats.joined == (0 if divide else size - len(active)), \
            (what, state.last_stats.joined)
        for p, q in zip(model.parameters(), trajectory[-1]):   # Join's final broadcast
            assert torch.equal(p.detach(), q), (what, "after join")
        state.close()
    # LAQ, with DDP's default (it refuses even where zeros from the joined ranks would do)
    model = small()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    ddp, state = hooked(model, "laq:bits=4", opt)
    try:
        with Join([ddp]):
            for step in range(steps):
                opt.zero_grad()
                ce(ddp, rank, step).backward()
                opt.step()
        raise AssertionError("LAQ with a joined rank did not raise")
    except (RuntimeError, ValueError) as e:
        assert "laq needs every rank's gradient" in str(e), e
    state.close()
    dist.barrier()
    faulthandler.cancel_dump_traceback_later()


def check_casts(rank, size):
    """#14 item 7 through the hook: finite gradients give finite averages whenever the
    average fits the gradient's dtype: a bf16 gradient holding 70000 and 3e38 with fp16
    compression (sent as bf16), fp32 gradients beyond fp16's range with fp16, 3e38 on every
    rank with none (whose float32 sum overflows) and with bf16; through all_reduce and as
    wire messages; against the float64 average."""
    bigs = {"fp16": {"b.weight": (torch.bfloat16, [70000.0, 3e38, -3e38]),
                     "f.weight": (torch.float32, [1e6, -3e5, 7e4 * size])},
            "none": {"f.weight": (torch.float32, [3e38, -3e38, 1e38])},
            "bf16": {"f.weight": (torch.float32, [3e38, 1e6, -2e38])}}
    for spec, params in bigs.items():
        def grads_at(r, step, params=params):
            out = {}
            for n, (dtype, big) in params.items():
                x = torch.randn(40, 40, generator=torch.Generator().manual_seed(r))
                x.view(-1)[:3] = torch.tensor(big)
                out[n] = x.to(dtype)
            return out
        for summable in (True, False) if spec != "bf16" else (False,):  # (bf16: wire only)
            what = (spec, summable)
            model = golden.Golden({n: ((40, 40), d) for n, (d, _) in params.items()})
            seen, state = train(model, {"allreduce_summable": summable}, rank, 1, spec,
                                grads_at=grads_at)
            if "b.weight" in params:
                assert state.exchange.entries["b.weight"].compressor.name == "bf16", what
            assert not state.last_stats.nonfinite, (what, state.last_stats.nonfinite)
            for n in params:
                got = seen[0][n]
                want = sum(grads_at(r, 0)[n].double() for r in range(size)) / size
                assert torch.isfinite(got).all(), (what, n)
                assert torch.allclose(got.double(), want, rtol=1e-2, atol=1e-2), \
                    (what, n, (got.double() - want).abs().max())
            state.close()


def check_dgc_groups(rank, size):
    """#14 item 4 through the hook: DGC with two SGD groups (own lr, momentum, weight
    decay) and LambdaLR with two lambdas: the param groups stay as the user made them, the
    scheduler sets each group's lr, each rank folds its group's weight decay into the local
    gradient, DGC applies the group's momentum and the step is p -= lr * average; exact
    against per-rank twins, and the optimizer's state_dict groups equal a plain SGD's."""
    model = small(width=40)
    groups = [dict(params=list(model[0].parameters()), lr=0.1, momentum=0.9, weight_decay=1e-2),
              dict(params=list(model[2].parameters()), lr=0.05, momentum=0.5, weight_decay=0.0)]
    opt = torch.optim.SGD(groups, lr=0.1)
    lambdas = [lambda t: 0.9 ** t, lambda t: 1.0 / (1 + t)]
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambdas)
    ref = copy.deepcopy(model)
    plain = torch.optim.SGD([dict(g, params=list(m.parameters()))
                             for g, m in zip(groups, (ref[0], ref[2]))], lr=0.1)
    plain_sched = torch.optim.lr_scheduler.LambdaLR(plain, lambdas)
    ddp, state = hooked(model, DGC, opt)
    assert len(opt.param_groups) == 2
    assert opt.param_groups[0]["params"] == list(model[0].parameters())
    assert opt.param_groups[1]["momentum"] == 0.5
    twins = Twins(DGC, state, size, rank, momentum={"0.weight": 0.9, "2.weight": 0.5})
    assert twins.routed == {"0.weight", "2.weight"}, twins.routed
    group_of = {"0.weight": 0, "0.bias": 0, "2.weight": 1, "2.bias": 1}
    for step in range(4):
        refp = dict(ref.named_parameters())
        local = []
        for r in range(size):
            g = grads_on_copy(ref, lambda m: ce(m, r, step))
            for n in twins.routed:                  # DGC's local gradient: g + wd * p
                wd = plain.param_groups[group_of[n]]["weight_decay"]
                if wd:
                    g[n] = g[n].add(refp[n].detach(), alpha=wd)
            local.append(g)
        want = twins.average(local)
        with torch.no_grad():                       # DGC's update: p -= lr * average
            for n in twins.routed:
                refp[n].add_(want[n], alpha=-plain.param_groups[group_of[n]]["lr"])
        for n, p in ref.named_parameters():         # the biases: plain SGD on the average
            p.grad = None if n in twins.routed else want[n].clone()
        plain.step()
        opt.zero_grad()
        ce(ddp, rank, step).backward()
        opt.step()
        sched.step()
        plain_sched.step()
        compare(model, ref, True, ("dgc groups", step))
    assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in plain.param_groups]
    assert opt.state_dict()["param_groups"] == plain.state_dict()["param_groups"]
    mine, theirs = state.compression.state_dict(), twins.comps[rank].state_dict()
    for part, held in mine.items():
        for n, t in held.items():
            assert torch.equal(t, theirs[part][n]), (part, n)
    state.close()


CHECKS = ["check_transport", "check_stateless", "check_summable", "check_static_graph",
          "check_unused_and_frozen", "check_no_sync", "check_auto", "check_auto_per_layer",
          "check_auto_per_layer_trial",
          "check_errors",
          "check_loops", "check_gan", "check_sparse",
          "check_join", "check_casts", "check_dgc_groups"]


def main():
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, size = dist.get_rank(), dist.get_world_size()
    n = 0
    for name in os.environ.get("HVDCOMP_DDP_CASES", ",".join(CHECKS)).split(","):
        t = time.perf_counter()
        got = globals()[name](rank, size)
        n += got if name == "check_stateless" else 0
        if rank == 0:
            print(f"{name}: {time.perf_counter() - t:.1f} s", flush=True)
    if "HVDCOMP_DDP_CASES" not in os.environ:
        # the first part of test_checkpoint_resumes_exactly_in_new_processes
        t = time.perf_counter()
        worker_resume.run("first", os.environ["HVDCOMP_TEST_OUT"], rank, size)
        if rank == 0:
            print(f"checkpoint, first part: {time.perf_counter() - t:.1f} s", flush=True)
    say(rank, f"ddp cases OK ({n} averages bit-exact)")
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
