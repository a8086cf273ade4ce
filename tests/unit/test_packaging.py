"""Packaging: the metadata in setup.cfg, pyproject.toml holding only the build system and
the tools' settings; a non-editable install ships every package and the kernel sources
(setuptools ships only package files: kernels/ is mapped to the package hvdcomp.kernels in
setup.cfg), and ``pip install .`` into a fresh venv gives a working ``hvdcomp`` command
whose host kernel build compiles from the installed sources; the declared minimum Python
is checked against what the code uses (vermin)."""
import configparser
import importlib
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import tomllib
import zipfile

import pytest

import hvdcomp
from hvdcomp.backends import _common, host

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _tree_packages():
    """Every folder under hvdcomp/ with an __init__.py, as a dotted name."""
    out = set()
    for d, _dirs, files in os.walk(os.path.join(ROOT, "hvdcomp")):
        if "__init__.py" in files and "__pycache__" not in d:
            out.add(os.path.relpath(d, ROOT).replace(os.sep, "."))
    return out


def _setup_cfg():
    cfg = configparser.ConfigParser(interpolation=None)
    assert cfg.read(os.path.join(ROOT, "setup.cfg")), "no setup.cfg"
    return cfg


def _lines(value):
    """A setup.cfg list (one item a line, or comma-separated on one line)."""
    return [v.strip() for line in value.strip().splitlines() for v in line.split(",")
            if v.strip()]


def test_every_package_is_declared():
    declared = set(_lines(_setup_cfg()["options"]["packages"]))
    assert declared == _tree_packages() | {"hvdcomp.kernels"}


def test_metadata_in_setup_cfg_build_system_in_pyproject():
    """#20 item 6: setup.cfg holds the package's metadata, pyproject.toml only the build
    system and the tools' settings (a [project] table there would take precedence over
    setup.cfg's metadata and split it in two places)."""
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        pyproject = tomllib.load(f)
    assert set(pyproject) <= {"build-system", "tool"}, sorted(pyproject)
    assert "setuptools" not in pyproject.get("tool", {})
    assert pyproject["build-system"]["build-backend"] == "setuptools.build_meta"
    cfg = _setup_cfg()
    assert cfg["metadata"]["name"] == "hvdcomp"
    assert cfg["metadata"]["version"].strip() == "attr: hvdcomp.__version__"
    assert {"python_requires", "install_requires", "packages", "package_dir"} <= set(
        cfg["options"])
    assert "torch" in " ".join(_lines(cfg["options"]["install_requires"]))
    assert {"mpi", "horovod", "cuda12", "cuda13", "test"} <= set(
        cfg["options.extras_require"])
    assert _lines(cfg["options.entry_points"]["console_scripts"]) == [
        "hvdcomp = hvdcomp.cli:main"]
    assert cfg["options.package_data"]["hvdcomp.kernels"]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheel")
    p = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                        "--no-build-isolation", ROOT, "-w", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    wheels = list(out.glob("hvdcomp-*.whl"))
    assert len(wheels) == 1
    return wheels[0]


def test_wheel_contains_packages_kernel_sources_and_license(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    kernels = {f"hvdcomp/kernels/{f}" for f in os.listdir(os.path.join(ROOT, "kernels"))
               if f.endswith((".cu", ".cuh", ".h", ".cpp"))}
    assert kernels and kernels <= names, sorted(kernels - names)
    for pkg in _tree_packages():
        assert pkg.replace(".", "/") + "/__init__.py" in names
    meta = next(n for n in names if n.endswith(".dist-info/METADATA"))
    text = zipfile.ZipFile(wheel).read(meta).decode()
    assert f"Version: {hvdcomp.__version__}" in text          # one version source
    assert any(n.endswith(".dist-info/entry_points.txt") for n in names)


def _declared_version():
    """The version setup.cfg declares, read from its one source as text (the attribute its
    ``version = attr: ...`` names), without importing anything."""
    spec = _setup_cfg()["metadata"]["version"].strip()
    assert spec.startswith("attr:"), spec
    attr = spec[len("attr:"):].strip()
    module, name = attr.rsplit(".", 1)                         # hvdcomp, __version__
    with open(os.path.join(ROOT, *module.split("."), "__init__.py")) as f:
        m = re.search(rf"^{name}\s*=\s*[\"']([^\"']+)[\"']", f.read(), re.M)
    assert m, f"{attr} not found"
    return m.group(1)


def _dependencies(tmp_path):
    """This interpreter's installed packages except hvdcomp itself (its editable install
    included), as symlinks in one folder: the fresh venv reads its dependencies from there
    instead of downloading them."""
    out = tmp_path / "deps"
    out.mkdir()
    for site in dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib")):
        for name in sorted(os.listdir(site)) if os.path.isdir(site) else ():
            if (name.lower().startswith(("hvdcomp", "__editable__", "__pycache__"))
                    or name.endswith(".pth") or (out / name).exists()):
                continue
            (out / name).symlink_to(os.path.join(site, name))
    return out


def _text_value(out, section, key):
    """The value of ``key`` in ``section`` of ``hvdcomp info``'s text output (a line with
    the section's name, then ``  key   value`` lines)."""
    m = re.search(rf"^{section}\n((?:  .*\n)*)", out, re.M)
    assert m, f"no section {section} in:\n{out}"
    v = re.search(rf"^  {re.escape(key)} +(.*)$", m.group(1), re.M)
    assert v, f"{section}.{key} not in:\n{out}"
    return v.group(1).strip()


def test_pip_install_into_a_fresh_venv(tmp_path, monkeypatch):
    """#13 item 3: ``pip install .`` (not editable) of a copy of the checkout into a fresh
    venv, then that venv's ``hvdcomp info --json`` console script and ``python -m hvdcomp
    info``, from a folder outside the checkout.  The venv sees this interpreter's packages
    (torch, numpy, mpi4py, Horovod, pip, setuptools) through a .pth file, but not hvdcomp:
    the package, its kernel sources and the console script come from the install alone, and
    nothing is downloaded (--no-index)."""
    version = _declared_version()
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=120)
    vpy = str(venv / "bin" / "python")
    site = subprocess.run([vpy, "-c", "import sysconfig; print(sysconfig.get_paths()"
                           "['purelib'])"], capture_output=True, text=True, check=True,
                          timeout=60).stdout.strip()
    assert site.startswith(str(venv)), site
    with open(os.path.join(site, "hvdcomp_test_deps.pth"), "w") as f:
        f.write(f"{_dependencies(tmp_path)}\n")
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, symlinks=True, ignore=shutil.ignore_patterns(
        ".git", ".venv", "__pycache__", "build", "*.egg-info", ".pytest_cache"))
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "HVDCOMP_KERNEL_DIR", "VIRTUAL_ENV", "PYTHONHOME")}
    env.update(PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1")
    p = subprocess.run([vpy, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                        "--no-build-isolation", str(src)], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]

    # installed, not linked: the dist-info says so, and the files are in the venv
    dist = os.path.join(site, f"hvdcomp-{version}.dist-info")
    with open(os.path.join(dist, "METADATA")) as f:
        assert f"\nVersion: {version}\n" in f.read()
    with open(os.path.join(dist, "direct_url.json")) as f:
        assert not json.load(f).get("dir_info", {}).get("editable", False)
    kdir = os.path.join(site, "hvdcomp", "kernels")
    sources = {f for f in os.listdir(os.path.join(ROOT, "kernels"))
               if f.endswith((".cu", ".cuh", ".h", ".cpp"))}
    assert sources and sources <= set(os.listdir(kdir)), sorted(sources - set(os.listdir(kdir)))

    # the console script (the host library: from this checkout's cache, same key)
    p = subprocess.run([str(venv / "bin" / "hvdcomp"), "info", "--json"], cwd=tmp_path,
                       env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    d = json.loads(p.stdout)
    import numpy
    import torch
    assert d["versions"]["hvdcomp"] == version
    assert d["versions"]["torch"] == torch.__version__
    assert d["versions"]["numpy"] == numpy.__version__
    for mod in ("mpi4py", "horovod"):
        try:
            want = importlib.import_module(mod).__version__
        except ImportError:
            want = None
        assert d["versions"][mod] == want, mod
    if d["versions"]["horovod"]:
        import horovod.torch as hvd
        assert d["horovod"] == {"installed": True, "mpi": bool(hvd.mpi_built()),
                                "gloo": bool(hvd.gloo_built()), "nccl": bool(hvd.nccl_built()),
                                "cuda": bool(hvd.cuda_built())}
    assert d["kernels"]["dir"] == kdir
    assert d["kernels"]["sha256"] == _common.source_hash(
        directory=os.path.join(ROOT, "kernels"))               # the same bytes as kernels/
    assert d["kernels"]["kernels"] == len(_common.SIGNATURES) > 0
    assert set(d["compressors"]) == {n for n in hvdcomp.available()
                                     if type(hvdcomp.get(n)).__module__.startswith("hvdcomp.")}
    loads = host.is_available()
    assert d["host_build"]["loads"] is loads
    if loads:       # the same sources and compiler: the library this checkout built
        assert d["host_build"]["library"] == host.library_path()

    # python -m hvdcomp
    p = subprocess.run([vpy, "-m", "hvdcomp", "info"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert _text_value(p.stdout, "versions", "hvdcomp") == version
    assert _text_value(p.stdout, "versions", "torch") == torch.__version__
    assert _text_value(p.stdout, "kernels", "dir") == kdir
    assert _text_value(p.stdout, "host_build", "loads") == str(loads)

    # The host build from the installed sources alone: its compile command (the installed
    # folder as the kernel folder) preprocessed with -M lists every file it includes; each of
    # hvdcomp's is in the installed folder (or the generated kernel registry), every kernel
    # source among them.  (A full build takes minutes on 2 cores: the cached library above
    # has the installed sources' hash in its name.)
    monkeypatch.setenv("HVDCOMP_KERNEL_DIR", kdir)
    deps = tmp_path / "host.d"
    cmd = host.compile_command(str(deps)) + ["-M"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    files = {os.path.realpath(f) for f in deps.read_text().replace("\\\n", " ").split()[1:]}
    ours = {f for f in files if not f.startswith(("/usr/", "/lib", "/opt/"))}
    registry = os.path.realpath(str(deps) + ".d")
    assert ours and all(os.path.dirname(f) in (os.path.realpath(kdir), registry)
                        for f in ours), sorted(ours)
    assert {os.path.join(os.path.realpath(kdir), f) for f in _common.HOST_SOURCES} <= files


# --- the declared minimum Python (#20 item 6) --------------------------------------------

# vermin, a maintained minimum-version detector (syntax, standard-library modules and
# functions, and keyword arguments such as zip(strict=...)), over the code users run: the
# package and the examples.  --eval-annotations with the union-types feature: annotations
# count as evaluated at run time and `X | Y` is detected (stricter than needed in modules
# with `from __future__ import annotations`).
VERMIN_FLAGS = ("--no-tips", "--violations", "--eval-annotations", "--feature", "union-types")


def _declared_minimum():
    req = _setup_cfg()["options"]["python_requires"].strip()
    m = re.fullmatch(r">=\s*(\d+)\.(\d+)", req)
    assert m, f"python_requires {req!r}: expected >=3.N"
    return int(m.group(1)), int(m.group(2))


def _vermin(target, *paths):
    """vermin's exit status and report for ``paths`` against "``target`` or older"."""
    pytest.importorskip("vermin", reason="vermin (in the test extra; launch/setup "
                        "installs it)")
    p = subprocess.run([sys.executable, "-c", "import sys, vermin; sys.exit(vermin.main())",
                        *VERMIN_FLAGS, f"-t={target[0]}.{target[1]}-", *map(str, paths)],
                       capture_output=True, text=True, timeout=600)
    return p.returncode, p.stdout + p.stderr


def test_the_code_needs_no_newer_python_than_declared():
    minimum = _declared_minimum()
    assert minimum >= (3, 10)      # hvdcomp/transport/framing.py: zip(strict=True)
    rc, out = _vermin(minimum, os.path.join(ROOT, "hvdcomp"), os.path.join(ROOT, "examples"))
    assert rc == 0, out


@pytest.mark.parametrize("source,construct", [
    ("def f(a, b):\n    return list(zip(a, b, strict=True))\n", "zip(strict)"),
    ("def f(x):\n    match x:\n        case 1:\n            return 2\n", "pattern matching"),
    ("def f(x: int | None) -> None:\n    return None\n", "union types"),
    ("import itertools\n\ndef f(xs):\n    return list(itertools.pairwise(xs))\n",
     "itertools.pairwise"),
])
def test_the_check_sees_what_needs_python_3_10(source, construct, tmp_path):
    """The check above is not blind: each of these 3.10 constructs (the kinds that matter
    here: a keyword argument, syntax, an annotation evaluated at run time, a library
    function) fails it for a declared 3.9, by name, and passes it for 3.10."""
    f = tmp_path / "probe.py"
    f.write_text(textwrap.dedent(source))
    rc, out = _vermin((3, 9), f)
    assert rc != 0 and construct in out, out
    rc, out = _vermin((3, 10), f)
    assert rc == 0, out
