"""Horovod elastic with hvdcomp's drop-in optimizer (issue 24, item 2): Horovod's elastic
driver on this machine, ``horovodrun --gloo -np 2 --min-np 2 --max-np 3
--host-discovery-script``, whose host list the workers rewrite (tests/launch/worker_elastic.py):
2 ranks for steps 0-2, 3 for steps 3-5 (a worker added), 2 for steps 6-8 (Horovod stops
the third worker).

* after each reset every rank holds the same parameters, hvdcomp's step equals the
  committed step (it continues, in the worker that joined too), and PowerSGD's shared Q is
  the same on every rank while its per-rank residuals were reset (docs/semantics.md,
  "Elastic restarts"), with a warning naming them;
* the final parameters of the model trained with compression "none" equal plain torch's
  SGD with momentum on the average of the ranks' gradients at each step's world size;
* ``hvd.elastic.run`` with LAQ or NDQSG raises one clear ValueError before anything
  collective; a TorchState holding an hvdcomp optimizer under Horovod's own
  ``horovod.torch.elastic.run`` raises one clear RuntimeError at its first sync.
"""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
PY = sys.executable
HOROVODRUN = os.path.join(os.path.dirname(PY), "horovodrun")
WORKER = os.path.join(HERE, "worker_elastic.py")
TIMEOUT = 300

pytest.importorskip("horovod.torch")
pytestmark = pytest.mark.skipif(not os.path.exists(HOROVODRUN),
                                reason="needs horovodrun (launch/setup installs it)")
STEPS, GROW, SHRINK, DIM = 9, 3, 6, 32        # the worker's schedule and model width
LR, MOMENTUM = 0.05, 0.9


def _env(out, **extra):
    return dict(os.environ, PYTHONPATH=ROOT, HVDCOMP_TEST_OUT=str(out), OMP_NUM_THREADS="1",
                PYTHONUNBUFFERED="1", **extra)


def _elastic(out):
    hosts = out / "hosts"
    hosts.write_text("localhost:2\n")
    disc = out / "discover.sh"
    disc.write_text(f"#!/bin/sh\ncat {hosts}\n")
    disc.chmod(0o755)
    cmd = [HOROVODRUN, "--gloo", "--network-interface", "lo", "-np", "2", "--min-np", "2",
           "--max-np", "3", "--host-discovery-script", str(disc), PY, WORKER]
    env = _env(out, ELASTIC_SCHEDULE=f"{STEPS},{GROW},{SHRINK},{DIM}",
               ELASTIC_SGD=f"{LR},{MOMENTUM}")
    try:
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=TIMEOUT)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"horovodrun elastic hung for {TIMEOUT} s:\n{e.stdout}\n{e.stderr}")
    return p.returncode, p.stdout + p.stderr


def _reference():
    """Plain torch: model "a" (seed 1) trained by SGD with momentum on the average of the
    ranks' MSE gradients, with the world size of each step."""
    torch.manual_seed(1)
    model = torch.nn.Linear(DIM, DIM)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    for step in range(STEPS):
        n = 3 if GROW <= step < SHRINK else 2
        grads = []
        for r in range(n):
            g = torch.Generator().manual_seed(1000 * step + r)
            x, y = torch.randn(4, DIM, generator=g), torch.randn(4, DIM, generator=g)
            model.zero_grad()
            F.mse_loss(model(x), y).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for i, p in enumerate(model.parameters()):
            p.grad = sum(gr[i] for gr in grads) / n
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def test_two_three_two_ranks(tmp_path):
    rc, out = _elastic(tmp_path)
    assert rc == 0, out[-8000:]
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    # each (re)start of the training function, the moments just before each reset, the end
    seen = [(ev[0]["starts"], ev[0]["size"], ev[0]["step"]) for ev in events]
    assert seen == [(1, 2, 0), ("before", 2, GROW), (2, 3, GROW), ("before", 3, SHRINK),
                    (3, 2, SHRINK), (3, 2, STEPS)], (seen, out[-6000:])
    joined = {r["pid"] for r in events[2]} - {r["pid"] for r in events[1]}
    assert len(joined) == 1, events[2]                    # the worker added at the reset
    for ev in events:
        size, step = ev[0]["size"], ev[0]["step"]
        assert [r["rank"] for r in ev] == list(range(size))
        for r in ev:
            # the step continues on every rank (hvdcomp's counters too)
            assert r["step"] == step and r["hvdcomp_steps"] == [step, step], r
            assert r["transports"] == ["horovod", "horovod"]
            # identical parameters and shared state on every rank
            for key in ("a", "b", "q"):
                assert r[key] == ev[0][key], (key, size, step)
            # at most the exchange threads of the two optimizers (one per stage each,
            # started at their first step): a reset leaves none of the old ones behind
            assert all(r["threads"].count(t) <= 2 for t in r["threads"]), r["threads"]
            assert len(r["threads"]) in (0, 6), r["threads"]
        assert all(torch.isfinite(torch.tensor(ev[0][k])).all() for k in ("a", "b"))
    before_grow, after_grow, before_shrink, after_shrink = events[1:5]
    for before, after in ((before_grow, after_grow), (before_shrink, after_shrink)):
        # the resize kept the parameters and PowerSGD's shared Q (rank 0's, now everyone's)
        # and reset the per-rank residuals, which held something before
        for key in ("a", "b", "q"):
            assert after[0][key] == before[0][key], key
        assert len(before[0]["q"]) and all(r["residual"] > 0 for r in before)
        assert all(r["residual"] == 0 for r in after)
    assert events[-1][0]["residual"] > 0                  # filled again by the steps after
    assert out.count("per-rank state reset (powersgd: residual)") >= 4, out[-6000:]
    # the worker that left: Horovod stopped it, the job went on
    assert "has been removed from elastic job" in out, out[-6000:]
    final = torch.load(tmp_path / "final.pt", weights_only=False)
    assert final["sizes"] == [3 if GROW <= s < SHRINK else 2 for s in range(STEPS)]
    ref = _reference()
    print("max |a - plain torch|:", float((final["a"] - ref).abs().max()))
    assert torch.allclose(final["a"], ref, rtol=1e-5, atol=1e-6)
    assert torch.equal(final["a"], torch.tensor(events[-1][0]["a"]))


BAD = r"""
import sys
sys.path.insert(0, {root!r})
import copy
import horovod.torch.elastic
import torch
import hvdcomp.torch as hvd
hvd.init()
for spec, run in {cases!r}:
    model = torch.nn.Linear(8, 8)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(),
                                   compression=spec, min_compress_numel=0)
    state = hvd.elastic.TorchState(model=model, optimizer=opt, step=0)
    run = eval(run)

    @run
    def train(state):
        print("TRAINED", spec)
    try:
        train(state)
    except Exception as e:
        print("REFUSED", spec, type(e).__name__ + ":", e)
    opt.close()

# commit() keeps, and restore() brings back, hvdcomp's state (TopK's residuals, the step)
# with the parameters and the wrapped optimizer's momentum
torch.manual_seed(0)
model = torch.nn.Linear(8, 8)
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                               named_parameters=model.named_parameters(),
                               compression="topk:density=0.25", min_compress_numel=0)
state = hvd.elastic.TorchState(model=model, optimizer=opt, step=0)


def step():
    opt.zero_grad()
    model(torch.randn(4, 8)).pow(2).sum().backward()
    opt.step()


step(); step()
state.commit()
kept = copy.deepcopy((opt.state_dict(), model.state_dict()))
step(); step()
moved = opt.state_dict()["hvdcomp"]
state.restore()
back = (opt.state_dict(), model.state_dict())
same = lambda a, b: torch.equal(a, b) if torch.is_tensor(a) else (
    a.keys() == b.keys() and all(same(a[k], b[k]) for k in a) if isinstance(a, dict) else
    len(a) == len(b) and all(map(same, a, b)) if isinstance(a, (list, tuple)) else a == b)
print("RESTORE", same(back, kept), not same(moved, kept[0]["hvdcomp"]))
step()
print("STEPS", opt.state_dict()["hvdcomp"]["step"], kept[0]["hvdcomp"]["step"])
opt.close()
"""

CASES = [("laq", "hvd.elastic.run", "ValueError: hvdcomp: compression 'laq"),
         ("ndqsg:bits=4", "hvd.elastic.run", "ValueError: hvdcomp: compression 'ndqsg"),
         ("qsgd:bits=4", "horovod.torch.elastic.run",
          "RuntimeError: hvdcomp: a TorchState holding an hvdcomp DistributedOptimizer must "
          "be run by hvdcomp's elastic run")]


def test_refused(tmp_path):
    """One process (Horovod on one rank): each error comes before the training function
    runs (LAQ's and NDQSG's before anything collective); then commit() and restore() of a
    TorchState carry hvdcomp's state."""
    script = tmp_path / "bad.py"
    script.write_text(BAD.format(root=ROOT, cases=[c[:2] for c in CASES]))
    p = subprocess.run([PY, str(script)], cwd=tmp_path, env=_env(tmp_path),
                       capture_output=True, text=True, timeout=120)
    out = p.stdout + p.stderr
    assert p.returncode == 0 and "TRAINED" not in out, out[-4000:]
    for spec, _, error in CASES:
        assert f"REFUSED {spec} {error}" in out, out[-4000:]
    # restore() gave back what commit() kept (and the two steps after it had changed it)
    assert "RESTORE True True" in out, out[-4000:]
    assert "STEPS 3 2" in out, out[-4000:]
