"""``hvdcomp selftest`` for real: it starts 2 ranks with mpirun (mpi and horovod
transports) and with horovodrun --gloo (horovod transport), and every item passes, bit for
bit, on every launcher this machine has."""
import os
import shutil
import subprocess
import sys

import pytest

from hvdcomp import selftest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = pytest.mark.skipif(shutil.which("mpirun") is None,
                                reason="mpirun not found (launch/setup installs Open MPI)")


def test_selftest_passes_on_every_available_transport():
    hvdcomp_cmd = os.path.join(os.path.dirname(sys.executable), "hvdcomp")
    cmd = [hvdcomp_cmd] if os.path.exists(hvdcomp_cmd) else [sys.executable, "-m", "hvdcomp"]
    try:
        p = subprocess.run(cmd + ["selftest"], cwd=ROOT, capture_output=True, text=True,
                           timeout=600, env=dict(os.environ, PYTHONPATH=ROOT))
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"hvdcomp selftest hung:\n{e.stdout}\n{e.stderr}")
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-5000:]
    lines = p.stdout.splitlines()
    want = 0
    for la in selftest.launchers():
        if "cmd" not in la:
            assert any(ln.startswith(f"SKIP  {la['name']}") for ln in lines), (la, out)
            continue
        for t in la["transports"]:
            for spec in selftest.SPECS:
                want += 1
                assert any(ln.startswith(f"PASS  {la['name']}") and f" {t} " in ln
                           and f" {spec} " in ln and "bit-exact on 2 ranks" in ln
                           for ln in lines), (la["name"], t, spec, out)
    assert want >= len(selftest.SPECS)                 # at least mpirun's mpi transport
    assert sum(ln.startswith("PASS") for ln in lines) == want
    assert lines[-1] == "selftest: all passed"
