"""``hvdcomp info`` / ``python -m hvdcomp info``: what it reports equals what the modules
say when asked directly."""
import json
import subprocess
import sys

import numpy as np
import pytest
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
        raw = MPI.Get_library_version()
        assert d["mpi"]["library"] == raw.split("\0")[0].strip().splitlines()[0].strip()
        assert "\0" not in d["mpi"]["library"] and d["mpi"]["library"].isprintable()
        assert d["mpi"]["thread_level"] in ("single", "funneled", "serialized", "multiple")


def test_info_text_lists_every_section_and_compressor():
    out = _run("info")
    assert "\0" not in out                   # Open MPI's version string ends in a NUL
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


@pytest.mark.parametrize("raw, want", [
    # Open MPI 4.1 through mpi4py 4: the C string's terminator comes along
    ("Open MPI v4.1.4, package: Debian OpenMPI, ident: 4.1.4, repo rev: v4.1.4, May 26, "
     "2022\x00", "Open MPI v4.1.4, package: Debian OpenMPI, ident: 4.1.4, repo rev: v4.1.4, "
     "May 26, 2022"),
    ("Open MPI v5.0.3\x00\x7f\x12garbage", "Open MPI v5.0.3"),     # bytes after the NUL
    ("MPICH Version:      4.0\nMPICH Release date: Fri Jan 21 2022\n", "MPICH Version:      4.0"),
    ("  Intel(R) MPI Library 2021.6\t\x1b \n", "Intel(R) MPI Library 2021.6"),
    ("\x00", ""),
    ("", ""),
])
def test_mpi_library_line_strips_nul_and_trailing_garbage(raw, want):
    from hvdcomp.cli import library_line
    assert library_line(raw) == want
