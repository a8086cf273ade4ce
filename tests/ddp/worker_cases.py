"""The DDP hook under torchrun, on every rank, against values computed independently (a
single-process encode/decode of every rank's gradient, or plain arithmetic): the torch
transport, stateless compressors in both DDP bucket sizes, the summable all_reduce path,
static_graph, find_unused_parameters with a parameter unused on one rank, frozen parameters,
no_sync accumulation, Auto, the NaN policy, and the errors that must reach every rank."""
import json
import math
import os
import sys

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import golden
import hvdcomp
import hvdcomp.ddp
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
        if rank == 1:
            def prepare(*_):
                raise KeyError("prepare boom on rank 1")
            state._prepare = prepare
        raises_everywhere(rank, lambda: ddp(golden.inputs(rank, 0)).backward(),
                          (RuntimeError, "prepare boom on rank 1"), (RuntimeError, elsewhere))
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


def main():
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, size = dist.get_rank(), dist.get_world_size()
    check_transport(rank, size)
    n = check_stateless(rank, size)
    check_summable(rank, size)
    check_static_graph(rank, size)
    check_unused_and_frozen(rank, size)
    check_no_sync(rank, size)
    check_auto(rank, size)
    check_errors(rank, size)
    say(rank, f"ddp cases OK ({n} averages bit-exact)")
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
