"""A compile check run once per exact input, as ccache does for objects.

The warning checks of tests/kernels/test_compile.py compile every kernel source with nvcc
(two architectures) and the whole host library with g++ -Werror: about 110 s of one test
run on the project's 2-core machines, to answer a question whose inputs rarely change.  The
answer is a function of the command line, the compiler (its ``--version`` text) and the
kernel sources (every file of kernels/), so a successful result is kept under that key in
``$HVDCOMP_CACHE/compile-checks`` (default ``~/.cache/hvdcomp/compile-checks``) and reused
until one of them changes.  A failed compile is never kept: it runs again every time.
HVDCOMP_NO_COMPILE_CACHE=1 turns the cache off.
"""
import glob
import hashlib
import json
import os
import subprocess
from types import SimpleNamespace
from typing import List

from hvdcomp.backends import _common


def cache_dir() -> str:
    root = os.environ.get("HVDCOMP_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
        "hvdcomp")
    return os.path.join(root, "compile-checks")


def _key(cmd: List[str], scratch: str) -> str:
    h = hashlib.sha256()
    ver = subprocess.run([cmd[0], "--version"], capture_output=True, text=True,
                         timeout=60).stdout
    h.update(ver.encode() + b"\0")
    for arg in cmd:                               # the scratch folder's name does not count
        h.update(arg.replace(scratch, "<scratch>").encode() + b"\0")
    kdir = _common.kernel_dir()
    for path in sorted(glob.glob(os.path.join(kdir, "*"))):
        if os.path.isfile(path):
            h.update(os.path.basename(path).encode() + b"\0")
            with open(path, "rb") as f:
                h.update(hashlib.sha256(f.read()).digest())
    return h.hexdigest()[:32]


def run(cmd: List[str], scratch: str, timeout: int = 600):
    """``subprocess.run(cmd)``'s (returncode, stdout, stderr) as a namespace, with
    ``cached`` True when a successful earlier run of the same inputs answered instead.
    ``scratch``: the folder the command writes its outputs into (left out of the key)."""
    use = os.environ.get("HVDCOMP_NO_COMPILE_CACHE") != "1"
    path = os.path.join(cache_dir(), _key(cmd, scratch) + ".json") if use else None
    if path and os.path.exists(path):
        with open(path) as f:
            return SimpleNamespace(cached=True, **json.load(f))
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if path and r.returncode == 0:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump({"returncode": 0, "stdout": r.stdout, "stderr": r.stderr,
                       "cmd": cmd}, f)
        os.replace(tmp, path)
    return SimpleNamespace(cached=False, returncode=r.returncode, stdout=r.stdout,
                           stderr=r.stderr)
