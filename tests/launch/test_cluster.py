"""launch/cluster: hosts in their own network namespaces behind rate-limited links, MPI
between them without ssh, and nothing left behind."""
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CLUSTER = os.path.join(ROOT, "launch", "cluster")
RUN = os.path.join(ROOT, "launch", "run")
PY = sys.executable

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc")
    or not shutil.which("mpirun"),
    reason="launch/cluster needs root, iproute2 and mpirun")

# Each rank reports its network namespace, its host address and how long it took to
# receive a payload from rank 0 (``PAYLOAD`` bytes, default none).
PROBE = r"""
import os, socket, subprocess, sys, time
from mpi4py import MPI
import numpy as np
comm = MPI.COMM_WORLD
r, n = comm.Get_rank(), comm.Get_size()
ns = os.readlink("/proc/self/ns/net")
addr = subprocess.run(["ip", "-4", "-o", "addr", "show", "eth0"], capture_output=True,
                      text=True).stdout.split()[3]
nbytes = int(os.environ.get("PAYLOAD", "0"))
comm.Barrier()
dt = 0.0
if nbytes and n > 1:
    buf = np.zeros(nbytes, np.uint8)
    if r == 0:
        comm.Send(buf, dest=n - 1)
    elif r == n - 1:
        t = time.perf_counter(); comm.Recv(buf, source=0); dt = time.perf_counter() - t
rows = comm.gather((r, ns, addr, dt), root=0)
if r == 0:
    for row in rows:
        print("PROBE", *row, flush=True)
"""


def _namespaces():
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.startswith("hvc-")}


def _probe(tmp_path, hosts, rate, np_, *extra, env=None):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    before = _namespaces()
    p = subprocess.run([CLUSTER, *extra, str(hosts), rate, "--", RUN, "-np", str(np_), PY,
                        str(script)], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, **(env or {})))
    assert p.returncode == 0, p.stderr[-3000:]
    assert _namespaces() == before, "namespaces left behind"
    rows = [line.split()[1:] for line in p.stdout.splitlines() if line.startswith("PROBE")]
    return sorted((int(r), ns, addr, float(dt)) for r, ns, addr, dt in rows)


def test_each_host_has_its_own_namespace_and_address(tmp_path):
    rows = _probe(tmp_path, 3, "1gbit", 3)
    assert [r for r, *_ in rows] == [0, 1, 2]
    assert len({ns for _, ns, _, _ in rows}) == 3
    assert [a for _, _, a, _ in rows] == ["10.213.0.11/24", "10.213.0.12/24", "10.213.0.13/24"]


def test_ranks_per_host_fill_hosts_in_order(tmp_path):
    rows = _probe(tmp_path, 2, "1gbit", 4, "--ranks-per-host", "2")
    assert [a for _, _, a, _ in rows] == ["10.213.0.11/24"] * 2 + ["10.213.0.12/24"] * 2
    assert rows[0][1] == rows[1][1] != rows[2][1] == rows[3][1]


def test_link_rate_limits_traffic_between_hosts(tmp_path):
    # 4 MB over a 40 Mbit/s link: after the token bucket's 64 KB burst, the rest takes at
    # least (4 MB - 64 KiB) * 8 / 40e6 = 0.79 s (a lower bound: a slower machine only makes
    # it longer); unshaped, the same bytes between namespaces take milliseconds.
    nbytes = 4_000_000
    rows = _probe(tmp_path, 2, "40mbit", 2, env={"PAYLOAD": str(nbytes)})
    assert rows[1][3] >= 0.95 * (nbytes - 2**16) * 8 / 40e6, rows


def test_failure_exit_code_passes_through_and_cleans_up():
    before = _namespaces()
    p = subprocess.run([CLUSTER, "2", "1gbit", "--", "sh", "-c", "exit 3"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 3
    assert _namespaces() == before


def test_interrupt_cleans_up():
    before = _namespaces()
    p = subprocess.Popen([CLUSTER, "2", "1gbit", "--", "sleep", "30"],
                         stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 20
    while time.time() < deadline and len(_namespaces() - before) < 3:
        time.sleep(0.1)
    assert len(_namespaces() - before) == 3        # switch + 2 hosts while running
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=30) == 143
    # the sleep inside the switch namespace was killed and everything removed
    assert _namespaces() == before


def test_bad_arguments_and_missing_tools(tmp_path):
    p = subprocess.run([CLUSTER, "0", "1gbit", "--", "true"], capture_output=True, text=True)
    assert p.returncode == 1 and "HOSTS must be 1..200" in p.stderr
    p = subprocess.run([CLUSTER, "2", "1gbit"], capture_output=True, text=True)
    assert p.returncode == 2 and "usage" in p.stderr
    bindir = tmp_path / "bin"           # a PATH with bash and coreutils but no ip/tc
    bindir.mkdir()
    for tool in ("bash", "env", "id", "mktemp", "rm"):
        os.symlink(shutil.which(tool), bindir / tool)
    p = subprocess.run([shutil.which("bash"), CLUSTER, "2", "1gbit", "--", "true"],
                       capture_output=True, text=True, env={"PATH": str(bindir)})
    assert p.returncode == 1 and "needs 'ip' and 'tc'" in p.stderr


@pytest.mark.skipif(not shutil.which("setpriv"), reason="setpriv missing")
def test_without_root_one_clear_message():
    p = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                        "bash", CLUSTER, "2", "1gbit", "--", "true"],
                       capture_output=True, text=True)
    assert p.returncode == 1 and "needs root" in p.stderr, p.stderr


HOSTS_PROBE = r"""
import socket, time
from mpi4py import MPI
import numpy as np
comm = MPI.COMM_WORLD
r = comm.Get_rank()
shared = comm.Split_type(MPI.COMM_TYPE_SHARED)
leader = shared.bcast(r, root=0)
buf = np.zeros(4_000_000, np.uint8)
comm.Barrier()
dt = 0.0
if r == 0:
    comm.Send(buf, dest=1)
elif r == 1:
    t = time.perf_counter(); comm.Recv(buf, source=0); dt = time.perf_counter() - t
rows = comm.gather((r, socket.gethostname(), leader, dt), root=0)
if r == 0:
    for row in rows:
        print("HOSTS", *row, flush=True)
"""


def test_ranks_of_a_host_share_its_name_memory_and_not_its_link(tmp_path):
    """2 hosts x 2 ranks: each host its own host name (a UTS namespace), MPI's shared-memory
    split finds the hosts, and 4 MB between the ranks of one host do not queue behind its
    40 Mbit/s link (which takes at least 0.59 s for them: the test above)."""
    script = tmp_path / "hosts.py"
    script.write_text(HOSTS_PROBE)
    p = subprocess.run([CLUSTER, "--ranks-per-host", "2", "2", "40mbit", "--", RUN, "-np",
                        "4", PY, str(script)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "btl tcp,vader,self" in p.stderr
    rows = sorted(line.split()[1:] for line in p.stdout.splitlines()
                  if line.startswith("HOSTS"))
    names = [name for _, name, _, _ in rows]
    assert names[0] == names[1] != names[2] == names[3], names
    assert [int(lead) for _, _, lead, _ in rows] == [0, 0, 2, 2], rows
    assert float(rows[1][3]) < 0.3, rows


@pytest.mark.parametrize("rate,burst", [("1gbit", 250_000), ("10gbit", 2_500_000),
                                        ("100mbit", 65_536), ("40mbit", 65_536),
                                        ("2Gbit", 500_000)])
def test_burst_is_two_ms_of_the_link_and_at_least_64_kb(rate, burst):
    # 2 ms of the link, in bytes: rate / 8 * 0.002; never below one 64 KB offload segment
    env = {k: v for k, v in os.environ.items() if k != "HVDCOMP_CLUSTER_BURST"}
    p = subprocess.run([os.path.join(os.path.dirname(CLUSTER), "tbf-burst"), rate],
                       capture_output=True, text=True, env=env, timeout=30)
    assert p.returncode == 0 and int(p.stdout) == burst, (p.stdout, p.stderr)


def test_a_rate_tc_cannot_shape_exactly_is_refused_before_anything_is_built():
    before = _namespaces()
    for rate in ("fast", "1.5gbit", "100mbps"):
        for burst in ("", "1mb"):               # an explicit burst does not let it through
            p = subprocess.run([CLUSTER, "2", rate, "--", "true"], capture_output=True,
                               text=True, timeout=30,
                               env=dict(os.environ, HVDCOMP_CLUSTER_BURST=burst))
            assert p.returncode == 2 and f"got '{rate}'" in p.stderr, (burst, p.stderr)
    assert _namespaces() == before
