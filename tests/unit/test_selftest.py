"""``hvdcomp selftest`` (hvdcomp/selftest.py): the report it makes from its workers' lines,
a worker run on one process (singleton MPI), and a launcher that fails.  The real 2-rank
run through mpirun and horovodrun is tests/mpi/test_selftest.py."""
import io
import os
import sys

import pytest

from hvdcomp import selftest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _fake_launchers(monkeypatch, entries):
    monkeypatch.setattr(selftest, "launchers", lambda np_=2: entries)


def test_one_process_worker_passes_every_item(monkeypatch):
    """The workers started without a launcher (``env`` runs them in this machine's shell):
    one rank, the mpi transport (mpi4py's singleton world)."""
    pytest.importorskip("mpi4py")
    monkeypatch.setenv("OMPI_ALLOW_RUN_AS_ROOT", "1")
    monkeypatch.setenv("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    monkeypatch.setenv("PYTHONPATH", ROOT)
    _fake_launchers(monkeypatch, [{"name": "one process", "cmd": ["env"],
                                   "transports": ["mpi"]},
                                  {"name": "horovodrun --gloo", "why": "not here"}])
    out = io.StringIO()
    assert selftest.run(timeout=240, out=out) == 0, out.getvalue()
    lines = out.getvalue().splitlines()
    passed = [ln for ln in lines if ln.startswith("PASS")]
    assert len(passed) == len(selftest.SPECS), lines
    for spec in selftest.SPECS:
        assert any(f" {spec} " in ln and "bit-exact on 1 ranks" in ln for ln in passed), spec
    assert any(ln.startswith("SKIP") and "not here" in ln for ln in lines)
    assert lines[-1] == "selftest: all passed"


def test_failed_launcher_and_failed_item_are_reported(monkeypatch):
    item = ('{"launcher": "x", "transport": "mpi", "compressor": "qsgd", "ranks": 2, '
            '"passed": false, "ranks_failed": 1, "detail": "fc.weight: differs"}')
    script = f"import sys; print('{selftest.MARK}' + {item!r}); sys.exit(1)"
    _fake_launchers(monkeypatch, [{"name": "broken", "cmd": [sys.executable, "-c", script],
                                   "transports": ["mpi"]}])
    out = io.StringIO()
    assert selftest.run(timeout=60, out=out) == 1
    text = out.getvalue()
    assert "FAIL  broken" in text and "fc.weight: differs" in text
    assert f"after 1 of {len(selftest.SPECS)} items" in text
    assert text.splitlines()[-1] == "selftest: FAILED"


def test_no_launcher_at_all(monkeypatch):
    _fake_launchers(monkeypatch, [{"name": "mpirun", "why": "mpirun not found"}])
    out = io.StringIO()
    assert selftest.run(out=out) == 2
    assert "SKIP  mpirun" in out.getvalue() and "nothing was tested" in out.getvalue()
