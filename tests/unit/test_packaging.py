"""Packaging: a non-editable install ships every package and the kernel sources
(setuptools ships only package files: kernels/ is mapped to the package hvdcomp.kernels in
pyproject.toml), and the installed ``hvdcomp`` command works from it."""
import json
import os
import subprocess
import sys
import tomllib
import zipfile

import pytest

import hvdcomp

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _tree_packages():
    """Every folder under hvdcomp/ with an __init__.py, as a dotted name."""
    out = set()
    for d, _dirs, files in os.walk(os.path.join(ROOT, "hvdcomp")):
        if "__init__.py" in files and "__pycache__" not in d:
            out.add(os.path.relpath(d, ROOT).replace(os.sep, "."))
    return out


def test_every_package_is_declared():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        declared = set(tomllib.load(f)["tool"]["setuptools"]["packages"])
    assert declared == _tree_packages() | {"hvdcomp.kernels"}


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


def test_installed_command_runs_from_the_install(wheel, tmp_path):
    # Installed (not editable) into its own folder, run from elsewhere: the package, its
    # kernel sources and the console script all come from the install.
    target = tmp_path / "site"
    p = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                        "--target", str(target), str(wheel)], capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    env = dict(os.environ, PYTHONPATH=str(target))
    env.pop("HVDCOMP_KERNEL_DIR", None)
    p = subprocess.run([str(target / "bin" / "hvdcomp"), "info", "--json"], cwd=tmp_path,
                       capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    d = json.loads(p.stdout)
    assert d["kernels"]["dir"] == str(target / "hvdcomp" / "kernels")
    assert d["versions"]["hvdcomp"] == hvdcomp.__version__
    # (registered by hvdcomp itself: other test modules register compressors of their own)
    assert set(d["compressors"]) == {n for n in hvdcomp.available()
                                     if type(hvdcomp.get(n)).__module__.startswith("hvdcomp.")}
