"""Reproducibility (#13 item 6): two 4-rank runs of a few training steps, with 1 and with 3
threads per rank for hvdcomp (OMP_NUM_THREADS and the kernels' thread count), give
bit-identical parameters for every compressor of worker_threads.py (the kernels promise
reductions in a fixed order whatever the thread count; this holds them to it).  The model's
own forward and backward run on one thread in both (see worker_threads.py: PyTorch's CPU
GEMMs are not thread-count invariant)."""
import json
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


def _params_after(threads, outdir):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE, ROOT]), HVDCOMP_TEST_OUT=outdir,
               HVDCOMP_TEST_THREADS=str(threads))
    try:
        worker = os.path.join(HERE, "worker_threads.py")
        p = subprocess.run([RUN, "-np", "4", sys.executable, worker], cwd=ROOT, env=env, capture_output=True, text=True, timeout=500)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"worker_threads.py hung:\n{e.stdout}\n{e.stderr}")
    assert p.returncode == 0, (p.stdout + p.stderr)[-5000:]
    with open(os.path.join(outdir, "params.json")) as f:
        got = json.load(f)
    assert got["threads"] == threads
    return got["digests"]


def test_thread_count_does_not_change_the_parameters(tmp_path):
    (tmp_path / "t1").mkdir()
    (tmp_path / "t3").mkdir()
    one = _params_after(1, str(tmp_path / "t1"))
    three = _params_after(3, str(tmp_path / "t3"))
    assert len(one) >= 5
    assert one == three, {k: (one[k][:12], three[k][:12]) for k in one if one[k] != three[k]}
