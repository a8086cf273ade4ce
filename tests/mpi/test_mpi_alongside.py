"""Issue 24 item 5 through the drop-in optimizer: worker_alongside.py under mpirun on 2
ranks (synchronized batch norm and the application's own Horovod collectives in every
step next to hvdcomp's exchange, over both transports, with ranks in and out of phase),
each of its named cases one pytest case (cases.py), with a timeout that turns a hang into
a failure (and cases.py's barrier, which aborts a job whose ranks stop meeting)."""
import os
import shutil

import pytest

from cases import discover, launch

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "worker_alongside.py")
TIMEOUT = 600
N = 2

pytestmark = pytest.mark.skipif(shutil.which("mpirun") is None,
                                reason="mpirun not found (launch/setup installs Open MPI)")

CASES = discover(SCRIPT)
_report = {}


@pytest.fixture
def report(request, tmp_path_factory):
    """The worker's report: it runs once per session, with the cases selected."""
    if "r" not in _report:
        wanted = [i.callspec.params["case"] for i in request.session.items
                  if getattr(i, "originalname", None) == "test_case"
                  and i.module is request.module]
        outdir = str(tmp_path_factory.mktemp("alongside"))
        # Horovod reports a collective that some rank never starts after 10 s (not 60)
        _report["r"] = launch(SCRIPT, N, [] if wanted == CASES else wanted, outdir, TIMEOUT,
                              HVDCOMP_CASE_WAIT="120", HOROVOD_STALL_CHECK_TIME_SECONDS="10")
    return _report["r"]


@pytest.mark.parametrize("case", CASES)
def test_case(case, report):
    problem = report.failure(case)
    if problem:
        pytest.fail(problem, pytrace=False)


def test_exit(report):
    """Every rank ran to the end (no hang, no crash), and the exit status agrees."""
    problem = report.exit_failure()
    if problem:
        pytest.fail(problem, pytrace=False)
