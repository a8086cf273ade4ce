"""Multi-rank tests: each worker script runs under mpirun (launch/run) with 2 and 4 ranks,
once, and checks on every rank against a single-process computation of the same messages.

Every named case of a worker (cases.py) is one pytest case here, failing with the ranks
and messages of its failure; ``exit`` fails when a worker crashed, hung or did not finish
on every rank.  Selecting cases (-k, node ids) runs only those in the worker.  worker_faults.py
is no assert script: it makes one rank fail, and the job must end (issue 15).
"""
import os
import re
import shutil
import subprocess
import sys
import time

import pytest

from cases import Report, discover, launch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
RUN = os.path.join(ROOT, "launch", "run")
TIMEOUT = 300                       # seconds for one worker on N ranks

WORKERS = ["transport", "exchange", "optimizer", "psq", "ef", "dithered", "laq", "sparse",
           "loops", "loops_b", "mismatch"]
RANKS = [2, 4]

pytestmark = pytest.mark.skipif(shutil.which("mpirun") is None,
                                reason="mpirun not found (launch/setup installs Open MPI)")


def script_of(worker: str) -> str:
    return os.path.join(HERE, f"worker_{worker}.py")


CASES = [(worker, n, c) for worker in WORKERS for n in RANKS
         for c in discover(script_of(worker))]
_reports = {}


def run_worker(worker: str, n: int, cases, outdir: str) -> Report:
    """Run ``worker`` on ``n`` ranks (only ``cases`` if given), and read what it left."""
    return launch(script_of(worker), n, cases, outdir, TIMEOUT)


@pytest.fixture
def report(request, tmp_path_factory):
    """The report of this case's worker on its rank count: the worker runs once per session,
    with the cases of it that this session selected."""
    worker, n = request.node.callspec.params["worker"], request.node.callspec.params["n"]
    if (worker, n) not in _reports:
        wanted = [i.callspec.params["case"] for i in request.session.items
                  if getattr(i, "originalname", None) == "test_case"
                  and i.module is request.module       # (other files have a test_case too)
                  and (i.callspec.params["worker"], i.callspec.params["n"]) == (worker, n)]
        every = [c for w, k, c in CASES if (w, k) == (worker, n)]
        outdir = str(tmp_path_factory.mktemp(f"{worker}_np{n}"))
        _reports[worker, n] = run_worker(worker, n, [] if wanted == every else wanted, outdir)
    return _reports[worker, n]


@pytest.mark.parametrize("worker,n,case", CASES, ids=[f"{w}-np{n}-{c}" for w, n, c in CASES])
def test_case(worker, n, case, report):
    problem = report.failure(case)
    if problem:
        pytest.fail(problem, pytrace=False)


@pytest.mark.parametrize("worker,n", [(w, n) for w in WORKERS for n in RANKS],
                         ids=[f"{w}-np{n}" for w in WORKERS for n in RANKS])
def test_exit(worker, n, report):
    """Every rank ran to the end, and the exit status agrees with the cases."""
    problem = report.exit_failure()
    if problem:
        pytest.fail(problem, pytrace=False)


# --- scripts not yet split into named cases: one pytest case per script and rank count ----

def run_ranks(n: int, script: str, outdir: str, timeout: int = TIMEOUT) -> str:
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


@pytest.mark.parametrize("n", RANKS)
@pytest.mark.parametrize("script,marker", [("worker_checkpoint.py", "checkpoint OK")])
def test_workers(n, script, marker, tmp_path):
    out = run_ranks(n, script, str(tmp_path))
    # every rank reached the end of its assertions and said so in its own file
    for r in range(n):
        f = tmp_path / f"rank{r}.ok"
        assert f.exists(), f"rank {r} did not finish:\n{out[-4000:]}"
        assert f.read_text().startswith(marker)


@pytest.mark.parametrize("n", [3, 4])
def test_reduce_scatter(n, tmp_path):
    """The reduce-scatter collective on an odd number of ranks too (worker_scatter.py; 2
    ranks: the test_case groups that run over it, and tests/exchange/test_scatter.py)."""
    out = run_ranks(n, "worker_scatter.py", str(tmp_path), timeout=600)
    for r in range(n):
        f = tmp_path / f"rank{r}.ok"
        assert f.exists(), f"rank {r} did not finish:\n{out[-4000:]}"
        assert f.read_text().startswith("scatter OK")


# --- issue 15: one rank fails; the job ends ------------------------------------------------

@pytest.mark.parametrize("transport", ["mpi", "horovod"])
@pytest.mark.parametrize("mode", ["raise-mid", "raise-between", "interrupt", "kill"])
def test_one_failing_rank_ends_the_job(mode, transport, tmp_path):
    """Rank 1 raises (in backward or between steps), is interrupted or is SIGKILLed at
    step 3: the job ends within 30 s with a non-zero status, no segmentation fault, and a
    message naming rank 1 (a RankFailure on rank 0; mpirun's own report after SIGKILL)."""
    _one_failing_rank(mode, transport, "allgather", 2, tmp_path)


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("mode", ["raise-mid", "raise-between"])
def test_one_failing_rank_ends_the_job_over_the_reduce_scatter(mode, n, tmp_path):
    """As above with the weight matrices over the reduce-scatter (#11 item 2): the failing
    rank's error marks travel in both of its stages, and every other rank raises a
    RankFailure naming rank 1."""
    _one_failing_rank(mode, "mpi", "reduce_scatter", n, tmp_path)


@pytest.mark.parametrize("transport", ["mpi", "horovod"])
def test_a_rank_that_skipped_an_iteration_is_reported(transport, tmp_path):
    """Rank 1 skips one iteration, so it leaves after 9 steps while rank 0 waits for its
    part of step 10 (no step counter can tell a skipped iteration from a normal one before
    that).  The job ends within 30 s of rank 1's exit with a non-zero status and no crash;
    rank 0 raises naming rank 1 and its last step (mpi: OutOfStep quoting rank 1's farewell;
    horovod: Horovod's own shutdown error, which names no rank)."""
    out = _one_failing_rank("skip", transport, "allgather", 2, tmp_path)
    assert "[rank 1] left after its last step" in out, out[-4000:]
    text = (tmp_path / "rank0.failure").read_text()
    if transport == "mpi":
        assert "OutOfStep" in text and "rank 1 left" in text, text
        # rank 1 ran one step fewer: rank 0 waits in the step after rank 1's last
        m = re.search(r"after step (\d+) of exchange.*waits for its part of step (\d+)",
                      text, re.S)
        assert m and int(m.group(2)) == int(m.group(1)) + 1, text
    else:
        assert "shut down" in text, text


def _one_failing_rank(mode, transport, collective, n, tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE, ROOT]),
               HVDCOMP_TEST_OUT=str(tmp_path))
    cmd = [RUN, "-np", str(n), sys.executable, os.path.join(HERE, "worker_faults.py"), mode,
           transport, collective]
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
    if mode == "skip":
        return out
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
