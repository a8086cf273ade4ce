"""Issue 24 items 3 and 4 through the drop-in optimizer: worker_objects.py under mpirun on
2 ranks, each of its named cases one pytest case (cases.py), with a timeout that turns a
hang into a failure (and cases.py's barrier, which aborts a job whose ranks stop meeting)."""
import os
import shutil
import subprocess
import sys

import pytest

from cases import Report, discover

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
SCRIPT = os.path.join(HERE, "worker_objects.py")
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
        outdir = str(tmp_path_factory.mktemp("objects"))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE, ROOT]),
                   HVDCOMP_TEST_OUT=outdir, HVDCOMP_CASE_WAIT="120")
        cmd = [os.path.join(ROOT, "launch", "run"), "-np", str(N), sys.executable, SCRIPT,
               *([] if wanted == CASES else wanted)]
        try:
            p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                               timeout=TIMEOUT)
            rc, out = p.returncode, p.stdout + p.stderr
        except subprocess.TimeoutExpired as e:
            text = [x.decode(errors="replace") if isinstance(x, bytes) else (x or "")
                    for x in (e.stdout, e.stderr)]
            rc, out = None, "".join(text)
        _report["r"] = Report(os.path.basename(SCRIPT), N, outdir, rc, out, TIMEOUT)
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
