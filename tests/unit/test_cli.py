"""``hvdcomp info`` / ``python -m hvdcomp info``: what it reports equals what the modules
say when asked directly."""
import json
import subprocess
import sys

import numpy as np
import torch

import hvdcomp
from hvdcomp.backends import _common, host


def _run(*args):
    p = subprocess.run([sys.executable, "-m", "hvdcomp", *args], capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    return p.stdout


def test_info_json_matches_the_modules():
    d = json.loads(_run("info", "--json"))
    assert d["versions"]["hvdcomp"] == hvdcomp.__version__
    assert d["versions"]["torch"] == torch.__version__
    assert d["versions"]["numpy"] == np.__version__
    # (registered by hvdcomp itself: other test modules register compressors of their own)
    assert d["compressors"] == {n: hvdcomp.get(n).spec() for n in hvdcomp.available()
                                if type(hvdcomp.get(n)).__module__.startswith("hvdcomp.")}
    assert d["kernels"]["sha256"] == _common.source_hash()
    assert d["kernels"]["kernels"] == len(_common.SIGNATURES) > 0
    assert d["host_build"]["loads"] is host.is_available()
    if d["host_build"]["loads"]:
        assert d["host_build"]["openmp"] == host.openmp_version()
    assert d["cuda"]["available"] is torch.cuda.is_available()
    try:
        from mpi4py import MPI
    except ImportError:
        assert d["mpi"] == {"installed": False}
    else:
        assert d["mpi"]["library"] == MPI.Get_library_version().strip().splitlines()[0]
        assert d["mpi"]["thread_level"] in ("single", "funneled", "serialized", "multiple")


def test_info_text_lists_every_section_and_compressor():
    out = _run("info")
    for section in ("versions", "horovod", "mpi", "compressors", "kernels", "host_build",
                    "cuda"):
        assert f"\n{section}\n" in "\n" + out
    for name in hvdcomp.available():
        if type(hvdcomp.get(name)).__module__.startswith("hvdcomp."):   # hvdcomp's own
            assert f"  {name:<10} {hvdcomp.get(name).spec()}" in out


def test_a_failing_probe_is_reported_not_raised(monkeypatch):
    from hvdcomp import cli
    monkeypatch.setattr(cli, "_kernels", lambda: 1 / 0)
    assert cli.info()["kernels"] == "error: ZeroDivisionError: division by zero"
