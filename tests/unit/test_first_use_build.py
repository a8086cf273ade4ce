"""#20 item 7: the CPU build of the kernels (one g++ run of about 40 s) says so, in one log
line, before the compiler starts, wherever it happens: at first use (the first CPU kernel
launch, inside a training step) or through ``hvdcomp info --build`` (launch/setup).

The compiler is stubbed only at the subprocess boundary (hvdcomp.backends.host's
``subprocess``): the cache key still asks the real compiler for its version, and the build's
own code (cache folder, file lock, temporary file, atomic rename, the retry without OpenMP,
the error with the compiler's output) runs as it does for real, in a temporary cache.  The
real build is what the kernel tests already pay for (tests/kernels, the shared cache)."""
import logging
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from hvdcomp.backends import host

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NOTICE = "building the CPU kernels"


def _is_compile(cmd):
    return "-o" in cmd and "--version" not in cmd


@pytest.fixture
def compiler(monkeypatch, tmp_path, caplog):
    """A stubbed compiler in a temporary cache: ``calls`` holds, for each compile command,
    the hvdcomp WARNING messages logged before it started; ``returncode`` is what it
    returns (0: it writes the output file, as g++ would)."""
    monkeypatch.setenv("HVDCOMP_CACHE", str(tmp_path / "cache"))
    caplog.set_level(logging.INFO, logger="hvdcomp")
    state = SimpleNamespace(calls=[], returncode=0)

    def run(cmd, *args, **kwargs):
        if not _is_compile(cmd):            # `g++ --version` for the cache key: the real one
            return subprocess.run(cmd, *args, **kwargs)
        state.calls.append([r.getMessage() for r in caplog.records
                            if r.name == "hvdcomp" and r.levelno == logging.WARNING])
        if state.returncode == 0:
            with open(cmd[cmd.index("-o") + 1], "wb") as f:
                f.write(b"\x7fELF stub")
        return subprocess.CompletedProcess(cmd, state.returncode, "", "stub: no such flag")

    monkeypatch.setattr(host, "subprocess", SimpleNamespace(
        run=run, SubprocessError=subprocess.SubprocessError))
    return state


def _notices(caplog):
    return [r for r in caplog.records if r.name == "hvdcomp" and NOTICE in r.getMessage()]


def test_a_build_says_so_before_the_compiler_starts(compiler, caplog, tmp_path):
    path = host.library_path()
    kernels = str(tmp_path / "cache" / "kernels")
    assert os.path.dirname(path) == kernels and os.path.exists(path)
    assert len(compiler.calls) == 1                 # OpenMP build, first try
    before = compiler.calls[0]
    assert len(before) == 1 and NOTICE in before[0], before
    # what it says: that the step waits, about how long, where it goes, how to do it ahead
    assert f"about {host.BUILD_SECONDS} s" in before[0]
    assert kernels in before[0] and "hvdcomp info --build" in before[0]
    assert [r.levelno for r in _notices(caplog)] == [logging.WARNING]
    assert any("built the CPU kernels in" in r.getMessage() and r.levelno == logging.INFO
               for r in caplog.records)
    # the build record: the command that built it (the output path is the temporary file
    # renamed into place) and what the compiler said
    record = host.build_record()
    assert record["output"] == "stub: no such flag"
    assert record["command"] == host.compile_command(record["library"])
    assert os.path.dirname(record["library"]) == kernels and record["library"] != path

    # cached: no compiler, no second line
    caplog.clear()
    assert host.library_path() == path
    assert len(compiler.calls) == 1 and _notices(caplog) == []


def test_a_failing_build_says_so_once_then_raises_with_the_compilers_output(compiler, caplog):
    compiler.returncode = 1
    with pytest.raises(RuntimeError, match="stub: no such flag"):
        host.library_path()
    # both tries (with and without OpenMP) came after the one line
    assert len(compiler.calls) == 2
    assert all(len(c) == 1 and NOTICE in c[0] for c in compiler.calls), compiler.calls
    assert len(_notices(caplog)) == 1
    assert not [f for f in os.listdir(host.cache_dir())
                if f.endswith((".so", ".json"))]    # nothing half-built left behind
    assert host.build_record() is None


def _info_build(tmp_path, **env):
    e = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    e.update(PYTHONPATH=ROOT, **env)
    return subprocess.run([sys.executable, "-m", "hvdcomp", "info", "--build", "--json"],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path, env=e)


def test_info_build_fails_with_the_reason_when_the_kernels_do_not_build(tmp_path):
    """A compiler that fails (``false``) in an empty cache: the line comes first, then the
    failure, status 1 (launch/setup reports it and goes on)."""
    p = _info_build(tmp_path, CXX="false", HVDCOMP_CACHE=str(tmp_path / "cache"))
    assert p.returncode == 1, p.stdout[-2000:] + p.stderr[-2000:]
    err = p.stderr
    assert NOTICE in err and "hvdcomp info --build: the CPU kernels did not build" in err
    assert err.index(NOTICE) < err.index("did not build")
    assert "$ false " in err                        # the failing command, as host.py quotes it
    assert p.stdout == ""


def test_info_build_readies_the_cached_library(tmp_path):
    """In the usual cache (the one the kernel tests build into: no second build when they
    ran first), ``--build`` succeeds exactly where the library loads here, and the report
    that follows names the same library."""
    import json
    p = _info_build(tmp_path)
    loads = host.is_available()
    assert p.returncode == (0 if loads else 1), p.stderr[-3000:]
    if loads:
        assert "hvdcomp info --build: CPU kernels ready" in p.stderr
        d = json.loads(p.stdout)
        assert d["host_build"]["loads"] is True
        assert d["host_build"]["library"] == host.library_path()
