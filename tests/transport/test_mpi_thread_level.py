"""hvdcomp.transport.mpi checks the MPI thread level: MPI_THREAD_SERIALIZED for hvdcomp's own
calls, MPI_THREAD_MULTIPLE when Horovod runs on MPI in the same process."""
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from hvdcomp.transport.mpi import check_thread_level, horovod_threads_disabled

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MPI = SimpleNamespace(THREAD_SINGLE=0, THREAD_FUNNELED=1, THREAD_SERIALIZED=2,
                      THREAD_MULTIPLE=3)


@pytest.mark.parametrize("provided,horovod,ok", [
    (3, True, True), (2, True, False), (1, True, False),
    (3, False, True), (2, False, True), (1, False, False), (0, False, False)])
def test_required_level(provided, horovod, ok):
    if ok:
        check_thread_level(provided, horovod, MPI)
        return
    with pytest.raises(RuntimeError) as e:
        check_thread_level(provided, horovod, MPI)
    names = ["MPI_THREAD_SINGLE", "MPI_THREAD_FUNNELED", "MPI_THREAD_SERIALIZED",
             "MPI_THREAD_MULTIPLE"]
    need = "MPI_THREAD_MULTIPLE" if horovod else "MPI_THREAD_SERIALIZED"
    assert f"provides {names[provided]}" in str(e.value) and f"needs {need}" in str(e.value)
    assert "transport='horovod'" in str(e.value)


def test_a_second_transport_needs_thread_multiple():
    check_thread_level(3, False, MPI, several=True)
    with pytest.raises(RuntimeError, match="needs MPI_THREAD_MULTIPLE .the exchanges of several optimizers"):
        check_thread_level(2, False, MPI, several=True)


@pytest.mark.parametrize("level,ok", [("funneled", False), ("serialized", True)])
def test_mpi_transport_checks_the_provided_level(level, ok):
    """A one-process MPI started by mpi4py at ``level`` (no Horovod)."""
    pytest.importorskip("mpi4py")
    env = dict(os.environ, MPI4PY_RC_THREAD_LEVEL=level, PYTHONPATH=ROOT,
               OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    code = ("from hvdcomp.transport import MPITransport\n"
            "try:\n    MPITransport()\n    print('built')\n"
            "except RuntimeError as e:\n    print(e)\n")
    try:
        p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                           text=True, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.skip("a one-process MPI does not start here")
    if p.returncode != 0:
        pytest.skip(f"a one-process MPI does not start here: {p.stderr[-500:]}")
    if ok:
        assert "built" in p.stdout, p.stdout
    else:
        assert "provides MPI_THREAD_FUNNELED" in p.stdout, p.stdout


@pytest.mark.parametrize("value,disabled", [("1", True), (" 2", True), ("1x", True),
                                            ("0", False), ("", False), ("no", False),
                                            (None, False)])
def test_horovod_threads_disabled_is_read_as_horovod_reads_it(value, disabled, monkeypatch):
    """Horovod: strtol(HOROVOD_MPI_THREADS_DISABLE) > 0 (leading digits, else 0)."""
    if value is None:
        monkeypatch.delenv("HOROVOD_MPI_THREADS_DISABLE", raising=False)
    else:
        monkeypatch.setenv("HOROVOD_MPI_THREADS_DISABLE", value)
    assert horovod_threads_disabled() is disabled
    with pytest.raises(RuntimeError) as e:
        check_thread_level(0, True, MPI)
    assert ("HOROVOD_MPI_THREADS_DISABLE is set" in str(e.value)) is disabled
