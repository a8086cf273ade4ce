"""Multi-rank tests: each worker script runs under mpirun (launch/run) with 2 and 4 ranks
and asserts, on every rank, against a single-process computation of the same messages."""
import os
import shutil
import subprocess
import sys
import time

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
    ("worker_mismatch.py", "mismatch OK"),
    ("worker_checkpoint.py", "checkpoint OK"),
])
def test_workers(n, script, marker, tmp_path):
    out = run_ranks(n, script, str(tmp_path))
    # every rank reached the end of its assertions and said so in its own file
    for r in range(n):
        f = tmp_path / f"rank{r}.ok"
        assert f.exists(), f"rank {r} did not finish:\n{out[-4000:]}"
        assert f.read_text().startswith(marker)


# --- issue 15: one rank fails; the job ends ------------------------------------------------

@pytest.mark.parametrize("transport", ["mpi", "horovod"])
@pytest.mark.parametrize("mode", ["raise-mid", "raise-between", "interrupt", "kill"])
def test_one_failing_rank_ends_the_job(mode, transport, tmp_path):
    """Rank 1 raises (in backward or between steps), is interrupted or is SIGKILLed at
    step 3: the job ends within 30 s with a non-zero status, no segmentation fault, and a
    message naming rank 1 (a RankFailure on rank 0; mpirun's own report after SIGKILL)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE, ROOT]),
               HVDCOMP_TEST_OUT=str(tmp_path))
    cmd = [RUN, "-np", "2", sys.executable, os.path.join(HERE, "worker_faults.py"), mode,
           transport]
    # 30 s from the fault (rank 1 writes its time) to the end of mpirun; the start-up of a
    # busy machine does not count
    try:
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=240)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{mode}/{transport}: the job did not end:\n{e.stdout}\n{e.stderr}")
    ended = time.time()
    out = p.stdout + p.stderr
    fault = tmp_path / "fault.time"
    assert fault.exists(), f"rank 1 never reached the fault:\n{out[-4000:]}"
    took = ended - float(fault.read_text())
    assert took < 30, f"{mode}/{transport}: the job ended {took:.1f} s after the fault"
    assert p.returncode != 0, out[-4000:]
    for crash in ("Segmentation fault", "signal 11", "SIGSEGV", "core dumped",
                  "Fatal Python error"):
        assert crash not in out, f"{mode}/{transport}: {crash}\n{out[-6000:]}"
    assert "trained to the end" not in out, out[-4000:]
    if mode == "kill":
        assert "rank 1" in out and "signal 9" in out, out[-4000:]
        return
    # rank 0 raised a RankFailure naming rank 1, and no rank died by a signal
    f = tmp_path / "rank0.failure"
    assert f.exists(), f"rank 0 did not raise a RankFailure:\n{out[-6000:]}"
    first, text = f.read_text().split("\n", 1)
    assert first == "1" and "rank 1" in text, text
    if mode.startswith("raise"):
        assert "ValueError: boom" in out, out[-4000:]
    if mode == "interrupt":
        # Python ends a process whose KeyboardInterrupt went uncaught by SIGINT (status
        # 130, as shells expect); every other rank exits with a status, by no signal
        assert "KeyboardInterrupt" in out, out[-4000:]
        out = out.replace("process rank 1 with PID", "").replace("signal 2 (Interrupt)", "")
    assert "exited on signal" not in out and "MPI_ABORT" not in out, out[-6000:]
