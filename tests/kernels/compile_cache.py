"""A compile check run once per exact input, as ccache does for objects.

The warning checks of tests/kernels/test_compile.py compile every kernel source with nvcc
and NVRTC (two architectures each) and the whole host library with g++ -Werror: about 110 s of one test
run on the project's 2-core machines, to answer a question whose inputs rarely change.  The
answer is a function of the command line (less the checkout's path), the compiler (its
``--version`` text) and the kernel sources (every file of kernels/, by content), so a successful result is kept under that key in
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
    ver = subprocess.run([cmd[0], "--version"], capture_output=True, text=True,
                         timeout=60).stdout
    # the scratch folder's name does not count, nor where the checkout is (the key holds
    # every file of kernels/ by content): a fresh clone of the same sources hits the cache
    kdir = _common.kernel_dir()
    return _key_of([ver] + [arg.replace(scratch, "<scratch>").replace(kdir, "<kernels>")
                            for arg in cmd])


def _key_of(parts: List[str]) -> str:
    """The key of ``parts`` (strings naming the inputs) and every file of kernels/."""
    h = hashlib.sha256()
    for part in parts:
        h.update(part.encode() + b"\0")
    kdir = _common.kernel_dir()
    for path in sorted(glob.glob(os.path.join(kdir, "*"))):
        if os.path.isfile(path):
            h.update(os.path.basename(path).encode() + b"\0")
            with open(path, "rb") as f:
                h.update(hashlib.sha256(f.read()).digest())
    return h.hexdigest()[:32]


def memo(parts: List[str], check):
    """``check()``'s (returncode, log) kept under the key of ``parts`` (strings that name
    every input besides the kernel sources: the compiler library's file and size, the
    options), for an in-process compile (NVRTC through ctypes).  Returns (returncode, log,
    cached); only returncode 0 is kept."""
    use = os.environ.get("HVDCOMP_NO_COMPILE_CACHE") != "1"
    path = os.path.join(cache_dir(), _key_of(["memo"] + list(parts)) + ".json") if use else None
    if path and os.path.exists(path):
        with open(path) as f:
            got = json.load(f)
        return got["returncode"], got["log"], True
    rc, log = check()
    if path and rc == 0:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump({"returncode": rc, "log": log, "parts": list(parts)}, f)
        os.replace(tmp, path)
    return rc, log, False


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
