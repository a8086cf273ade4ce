"""Issue 24 item 3 through the DDP hook: worker_objects.py under torchrun on 2 CPU
processes (Gloo), with a timeout that turns a hang into a failure (and the worker's own
faulthandler watchdog, which prints where each rank was)."""
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
TIMEOUT = 400


def test_objects_rewrapped_and_copied(tmp_path):
    """A new DDP wrapper with the same HookState or a new one, copies and pickles of the
    state and the model, and one state on two wrappers in one backward pass (refused):
    every rank reaches the end of worker_objects.py's assertions."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE, ROOT]), OMP_NUM_THREADS="1",
               HVDCOMP_TEST_OUT=str(tmp_path), PYTHONUNBUFFERED="1",
               HVDCOMP_WATCHDOG=str(TIMEOUT - 60))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           "2", os.path.join(HERE, "worker_objects.py")]
    try:
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=TIMEOUT)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"worker_objects.py hung for {TIMEOUT} s:\n{e.stdout}\n{e.stderr}")
    out = p.stdout + p.stderr
    assert p.returncode == 0, f"worker_objects.py failed (rc {p.returncode}):\n{out[-8000:]}"
    for r in range(2):
        f = tmp_path / f"rank{r}.ok"
        assert f.exists() and f.read_text() == "objects OK", f"rank {r}:\n{out[-4000:]}"


def test_state_before_setup_pickles_with_its_model():
    """Before set-up (torch.distributed not initialized: e.g. handed to Lightning's
    strategy, which starts the processes later) a HookState pickles and deep-copies
    together with its model: the copy names the copy's parameters and keeps its settings
    and a loaded checkpoint; once closed it refuses (TypeError), and its set-up raises
    RuntimeError naming close()."""
    import copy
    import pickle

    import torch
    import torch.distributed as dist

    import hvdcomp.ddp

    assert not (dist.is_available() and dist.is_initialized())
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 2))
    state = hvdcomp.ddp.HookState(model, compression="topk:density=0.25", seed=9)
    ckpt = {"format": 1, "rank": 0, "world_size": 2, "step": 4, "compression": "topk",
            "compressor_state": {"residuals": {}}}
    state.load_state_dict(ckpt)                     # kept until set-up
    for m2, s2 in [pickle.loads(pickle.dumps((model, state))),
                   copy.deepcopy((model, state))]:
        mine = [p for _, p in s2._named]
        assert [id(p) for p in mine] == [id(p) for p in m2.parameters()]
        assert all(torch.equal(a, b) for a, b in zip(mine, model.parameters()))
        assert s2.compression.spec() == state.compression.spec() and s2._settings.seed == 9
        assert s2._loaded == ckpt and s2.exchange is None
    state.close()
    for fn in (lambda: pickle.dumps(state), lambda: copy.deepcopy(state)):
        with pytest.raises(TypeError, match="state_dict"):
            fn()
    with pytest.raises(RuntimeError, match=r"closed: close\(\) was called"):
        state.setup()
