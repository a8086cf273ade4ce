"""A non-editable install ships the kernel sources (setuptools ships only package files:
kernels/ is mapped to the package hvdcomp.kernels in setup.cfg)."""
import os
import subprocess
import sys
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_wheel_contains_kernel_sources(tmp_path):
    p = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                        "--no-build-isolation", ROOT, "-w", str(tmp_path)],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    wheels = list(tmp_path.glob("hvdcomp-*.whl"))
    assert len(wheels) == 1
    names = set(zipfile.ZipFile(wheels[0]).namelist())
    kernels = {f"hvdcomp/kernels/{f}" for f in os.listdir(os.path.join(ROOT, "kernels"))
               if f.endswith((".cu", ".cuh", ".h", ".cpp"))}
    assert kernels and kernels <= names, sorted(kernels - names)
    for pkg in ("backends", "codecs", "compressors", "torch", "transport"):
        assert f"hvdcomp/{pkg}/__init__.py" in names
