"""Multi-rank tests: each worker script runs under mpirun (launch/run) with 2 and 4 ranks
and asserts, on every rank, against a single-process computation of the same messages."""
import os
import shutil
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
RUN = os.path.join(ROOT, "launch", "run")

pytestmark = pytest.mark.skipif(shutil.which("mpirun") is None,
                                reason="mpirun not found (launch/setup installs Open MPI)")


def run_ranks(n: int, script: str, outdir: str, timeout: int = 300) -> str:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE, ROOT]), HVDCOMP_TEST_OUT=outdir)
    try:
        p = subprocess.run([RUN, "-np", str(n), sys.executable, os.path.join(HERE, script)],
                           cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=timeout)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{script} on {n} ranks hung for {timeout} s:\n{e.stdout}\n{e.stderr}")
    out = p.stdout + p.stderr
    assert p.returncode == 0, f"{script} on {n} ranks failed (rc {p.returncode}):\n{out[-6000:]}"
    return out


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("script,marker", [
    ("worker_transport.py", "transport OK"),
    ("worker_exchange.py", "exchange OK"),
    ("worker_optimizer.py", "optimizer OK"),
    ("worker_psq.py", "psq OK"),
    ("worker_ef.py", "ef OK"),
    ("worker_dithered.py", "dithered OK"),
    ("worker_laq.py", "laq OK"),
    ("worker_sparse.py", "sparse OK"),
    ("worker_loops.py", "loops a OK"),
    ("worker_loops_b.py", "loops b OK"),
])
def test_workers(n, script, marker, tmp_path):
    out = run_ranks(n, script, str(tmp_path))
    # every rank reached the end of its assertions and said so in its own file
    for r in range(n):
        f = tmp_path / f"rank{r}.ok"
        assert f.exists(), f"rank {r} did not finish:\n{out[-4000:]}"
        assert f.read_text().startswith(marker)
