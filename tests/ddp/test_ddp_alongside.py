"""Issue 24 item 5 on the DDP door: worker_alongside.py under torchrun on 2 Gloo ranks
(a synchronized batch norm and the application's all-reduces on the default group in
every step next to the hook's exchange; DDP(static_graph=True) with no_sync()
accumulation), against plain torch.  A hang fails: the worker dumps its threads' stacks
and exits after HVDCOMP_WORKER_WAIT seconds, and the launch times out after TIMEOUT."""
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
TIMEOUT = 600


@pytest.mark.parametrize("n", [2])
def test_alongside_the_hook(n, tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE, ROOT]), OMP_NUM_THREADS="1",
               HVDCOMP_TEST_OUT=str(tmp_path), PYTHONUNBUFFERED="1",
               HVDCOMP_WORKER_WAIT=str(TIMEOUT - 60))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           str(n), os.path.join(HERE, "worker_alongside.py")]
    try:
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=TIMEOUT)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"worker_alongside.py on {n} ranks hung for {TIMEOUT} s:\n"
                    f"{e.stdout}\n{e.stderr}")
    out = p.stdout + p.stderr
    assert p.returncode == 0, f"worker_alongside.py failed (rc {p.returncode}):\n{out[-8000:]}"
    for r in range(n):
        f = tmp_path / f"rank{r}.ok"
        assert f.exists(), f"rank {r} did not finish:\n{out[-4000:]}"
        assert f.read_text().startswith("alongside OK"), f.read_text()
