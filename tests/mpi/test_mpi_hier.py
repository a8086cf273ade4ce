"""The hierarchical exchange under mpirun, hosts pretended by $HVDCOMP_TEST_HOSTS (a test
override, hvdcomp/transport/topology.py): worker_hier.py on 2 hosts x 2 ranks and 2 hosts x
3 ranks, worker_hier_bad.py (bad input) on hosts of 2 and 1 ranks, worker_hier_auto.py (Auto's
flat-or-hierarchical choice) on 2 hosts x 2 ranks.  Each named case of a
worker is one pytest case, as in test_multirank.py."""
import os
import shutil

import pytest

from cases import discover, launch

HERE = os.path.dirname(os.path.abspath(__file__))
TIMEOUT = 600

#: (worker, ranks, hosts of the ranks)
RUNS = [("hier", 4, "0,0,1,1"), ("hier", 6, "0,0,0,1,1,1"), ("hier_bad", 3, "0,0,1"),
        ("hier_auto", 4, "0,0,1,1")]

pytestmark = pytest.mark.skipif(shutil.which("mpirun") is None,
                                reason="mpirun not found (launch/setup installs Open MPI)")


def script_of(worker: str) -> str:
    return os.path.join(HERE, f"worker_{worker}.py")


CASES = [(w, n, hosts, c) for w, n, hosts in RUNS for c in discover(script_of(w))]
_reports = {}


@pytest.fixture
def report(request, tmp_path_factory):
    worker, n = request.node.callspec.params["worker"], request.node.callspec.params["n"]
    hosts = request.node.callspec.params["hosts"]
    if (worker, n) not in _reports:
        outdir = str(tmp_path_factory.mktemp(f"{worker}_np{n}"))
        _reports[worker, n] = launch(script_of(worker), n, [], outdir, TIMEOUT,
                                     HVDCOMP_TEST_HOSTS=hosts)
    return _reports[worker, n]


@pytest.mark.parametrize("worker,n,hosts,case", CASES,
                         ids=[f"{w}-np{n}-{c}" for w, n, _, c in CASES])
def test_case(worker, n, hosts, case, report):
    problem = report.failure(case)
    if problem:
        pytest.fail(problem, pytrace=False)


@pytest.mark.parametrize("worker,n,hosts", RUNS, ids=[f"{w}-np{n}" for w, n, _ in RUNS])
def test_exit(worker, n, hosts, report):
    problem = report.exit_failure()
    if problem:
        pytest.fail(problem, pytrace=False)
