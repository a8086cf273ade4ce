"""The DDP hook with the hierarchical exchange (hierarchy="host") under torchrun on Gloo,
hosts pretended by $HVDCOMP_TEST_HOSTS (a test override): 2 hosts x 2 ranks and 2 hosts x 3
ranks, bit for bit against a single-process reference, and a checkpoint resumed
(tests/ddp/worker_hier.py)."""
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


@pytest.mark.parametrize("hosts", ["0,0,1,1", "0,0,0,1,1,1"])
def test_hier_ddp(hosts, tmp_path):
    import subprocess
    n = len(hosts.split(","))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE, ROOT]), OMP_NUM_THREADS="1",
               HVDCOMP_TEST_OUT=str(tmp_path), PYTHONUNBUFFERED="1",
               HVDCOMP_TEST_HOSTS=hosts)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           str(n), os.path.join(HERE, "worker_hier.py")]
    try:
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=900)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{cmd} hung:\n{e.stdout}\n{e.stderr}")
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-8000:]
    for r in range(n):
        text = open(tmp_path / f"rank{r}.ok").read()
        assert text == f"hier ddp ok: 5 compressors, 15 tensors, {n} ranks", text
