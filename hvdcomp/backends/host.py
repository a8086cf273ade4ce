"""The CPU build of hvdcomp's CUDA kernels: the same ``kernels/*.cu`` sources, compiled by g++
through ``kernels/host_shim.h`` into a shared library that runs each grid on the CPU
(blocks in parallel with OpenMP, the threads of a block one after another).

The library is built once per (sources, compiler, flags) hash into
``$HVDCOMP_CACHE/kernels`` (default ``~/.cache/hvdcomp/kernels``), under a file lock so that
ranks started together build it once, and loaded with ctypes.  Python only checks arguments
and launches (hvdcomp/backends/_common.py); every number comes from the kernels.

Functions (torch CPU tensors, float32 values; see _common.Ops for the exact contracts):

    bucket_norms(x, bucket_size, norm)                              -> norms
    quantize_pack(x, norms, levels, bits, bucket_size, *, seed, rank, tensor_id, step)
                                                                    -> packed uint8
    quantize(x, levels, bits, bucket_size, norm, *, seed, rank, tensor_id, step)
                                                                    -> (norms, packed)
    dequantize_add(packed, n, norms, levels, bits, bucket_size, out) -> out (+= decoded)
    random_words(n, *, seed, step, rank, tensor_id, offset=0), uniform(...)

Example::

    import torch
    from hvdcomp.backends import host
    from hvdcomp import levels as L
    x = torch.randn(10_000)
    lv = torch.tensor(L.uniform_levels(3), dtype=torch.float32)
    norms, packed = host.quantize(x, lv, 3, 512, "l2", seed=1, rank=0, tensor_id=0, step=0)
    acc = host.dequantize_add(packed, x.numel(), norms, lv, 3, 512, torch.zeros(10_000))

Threads: ``set_num_threads(k)``; by default PyTorch's intra-op thread count at each call.
Environment: HVDCOMP_CACHE (cache root), HVDCOMP_KERNEL_DIR (the sources), CXX (compiler,
default g++ or c++), HVDCOMP_HOST_CXXFLAGS (extra flags, e.g. -march=native; part of the
cache key; -ffp-contract=off stays, so the results do not change).
Raises RuntimeError (with the compiler's output) when no compiler can build the library.
"""
from __future__ import annotations

import ctypes
import fcntl
import hashlib
import os
import shlex
import shutil
import subprocess
import tempfile
import threading
from typing import Dict, List, Optional, Tuple

import torch

from ._common import HOST_SOURCES, SIGNATURES, Ops, kernel_dir, source_hash

__all__ = ["bucket_norms", "quantize_pack", "quantize", "dequantize_add", "random_words",
           "uniform", "set_num_threads", "get_num_threads", "library_path", "compile_command",
           "load", "openmp_version", "is_available"]

ABI_VERSION = 1
# -ffp-contract=off: no a*b+c fused into one rounding (the GPU build uses --fmad=false).
# No -ffast-math (host_shim.h refuses it).  -fvisibility=hidden: only hvd_host_* exported.
BASE_FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-ffp-contract=off", "-fno-fast-math",
              "-fvisibility=hidden", "-Wall", "-Wextra")
OPENMP_FLAGS = ("-fopenmp",)

_lock = threading.Lock()        # loading
_launch_lock = threading.Lock() # the library's error slot is per process: one launch at a time
_lib = None
_kernels: Dict[str, Tuple[int, str]] = {}
_threads: Optional[int] = None


def cache_dir() -> str:
    """Where built libraries are kept: $HVDCOMP_CACHE/kernels (as launch/setup's cache)."""
    root = os.environ.get("HVDCOMP_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
        "hvdcomp")
    return os.path.join(root, "kernels")


def compiler() -> str:
    """The C++ compiler: $CXX, else g++, else c++.  Raises RuntimeError if none is found."""
    cxx = os.environ.get("CXX")
    if cxx:
        return cxx
    for name in ("g++", "c++"):
        path = shutil.which(name)
        if path:
            return path
    raise RuntimeError("hvdcomp host kernels need a C++17 compiler (g++); none found "
                       "(set CXX, or install g++)")


def _extra_flags() -> List[str]:
    return shlex.split(os.environ.get("HVDCOMP_HOST_CXXFLAGS", ""))


def compile_command(output: str, *, openmp: bool = True, werror: bool = False,
                    extra: Optional[List[str]] = None) -> List[str]:
    """The g++ command line that builds the host library into ``output``."""
    flags = list(BASE_FLAGS) + (list(OPENMP_FLAGS) if openmp else [])
    flags += _extra_flags() + list(extra or [])
    if werror:
        flags.append("-Werror")
    return [compiler(), *flags, "-o", output, os.path.join(kernel_dir(), "host_launch.cpp")]


def _key() -> str:
    cxx = compiler()
    try:
        ver = subprocess.run([cxx, "--version"], capture_output=True, text=True,
                             timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise RuntimeError(f"cannot run the C++ compiler {cxx!r}: {e}") from e
    h = hashlib.sha256()
    for part in (source_hash(HOST_SOURCES), cxx, ver, " ".join(BASE_FLAGS + OPENMP_FLAGS),
                 " ".join(_extra_flags()), str(ABI_VERSION)):
        h.update(part.encode() + b"\0")
    return h.hexdigest()[:20]


def library_path() -> str:
    """The cached library for the current sources and compiler (built if missing)."""
    d = cache_dir()
    os.makedirs(d, exist_ok=True)
    path = os.path.join(d, f"hvdcomp_host_{_key()}.so")
    if os.path.exists(path):
        return path
    with open(path + ".lock", "w") as lockf:
        fcntl.flock(lockf, fcntl.LOCK_EX)          # one builder; the others wait, then load
        try:
            if not os.path.exists(path):
                _build(path)
        finally:
            fcntl.flock(lockf, fcntl.LOCK_UN)
    return path


def _build(path: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=os.path.dirname(path))
    os.close(fd)
    errors = []
    try:
        for openmp in (True, False):              # a compiler without OpenMP: serial blocks
            cmd = compile_command(tmp, openmp=openmp)
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode == 0:
                os.replace(tmp, path)             # atomic: readers see all or nothing
                return
            errors.append(f"$ {shlex.join(cmd)}\n{r.stdout}{r.stderr}")
        raise RuntimeError("hvdcomp: building the host kernels failed:\n" + "\n".join(errors))
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load():
    """Build (if needed) and load the library; verify its ABI and every kernel signature."""
    global _lib
    with _lock:
        if _lib is not None:
            return _lib
        lib = ctypes.CDLL(library_path())
        lib.hvd_host_abi_version.restype = ctypes.c_int
        lib.hvd_host_kernel_count.restype = ctypes.c_int
        lib.hvd_host_kernel_name.restype = ctypes.c_char_p
        lib.hvd_host_kernel_name.argtypes = [ctypes.c_int]
        lib.hvd_host_kernel_signature.restype = ctypes.c_char_p
        lib.hvd_host_kernel_signature.argtypes = [ctypes.c_int]
        lib.hvd_host_launch.restype = ctypes.c_int
        lib.hvd_host_launch.argtypes = [ctypes.c_int, ctypes.c_uint, ctypes.c_uint,
                                        ctypes.c_int, ctypes.POINTER(ctypes.c_void_p)]
        lib.hvd_host_last_error.restype = ctypes.c_char_p
        lib.hvd_host_openmp.restype = ctypes.c_int
        if lib.hvd_host_abi_version() != ABI_VERSION:
            raise RuntimeError(f"hvdcomp host library ABI {lib.hvd_host_abi_version()}, "
                               f"expected {ABI_VERSION}")
        found = {}
        for k in range(lib.hvd_host_kernel_count()):
            found[lib.hvd_host_kernel_name(k).decode()] = (
                k, lib.hvd_host_kernel_signature(k).decode())
        for name, sig in SIGNATURES.items():
            if name not in found:
                raise RuntimeError(f"hvdcomp host library lacks kernel {name}")
            if found[name][1] != sig:
                raise RuntimeError(f"kernel {name}: the source's signature {found[name][1]} "
                                   f"differs from the launcher's {sig} (_common.SIGNATURES)")
        _kernels.update(found)
        _lib = lib
        return lib


def is_available() -> bool:
    """True if the host library can be built (or is cached) and loaded here."""
    try:
        load()
        return True
    except (RuntimeError, OSError, FileNotFoundError):
        return False


def openmp_version() -> int:
    """The _OPENMP date the library was built with, 0 if it runs blocks serially."""
    return load().hvd_host_openmp()


def set_num_threads(k: Optional[int]) -> None:
    """CPU threads for the kernels' blocks; None: torch.get_num_threads() at each call."""
    global _threads
    if k is not None and (not isinstance(k, int) or k < 1):
        raise ValueError(f"threads must be a positive int or None, got {k!r}")
    _threads = k


def get_num_threads() -> int:
    return _threads if _threads is not None else max(1, torch.get_num_threads())


_CTYPES = {"q": ctypes.c_longlong, "i": ctypes.c_int, "I": ctypes.c_uint,
           "f": ctypes.c_float, "d": ctypes.c_double}


class _HostBackend:
    name = "host"
    device_type = "cpu"

    def launch(self, kernel: str, grid: int, block: int, args) -> None:
        lib = load()
        index, sig = _kernels[kernel]
        if len(args) != len(sig):
            raise TypeError(f"{kernel} takes {len(sig)} arguments, got {len(args)}")
        vals = []
        for code, a in zip(sig, args):
            if code == "P":
                if not isinstance(a, torch.Tensor) or a.device.type != "cpu" \
                        or not a.is_contiguous():
                    raise TypeError(f"{kernel}: pointer arguments must be contiguous CPU "
                                    f"tensors")
                vals.append(ctypes.c_void_p(a.data_ptr()))
            else:
                vals.append(_CTYPES[code](a))
        argv = (ctypes.c_void_p * len(vals))(*[ctypes.addressof(v) for v in vals])
        with _launch_lock:
            rc = lib.hvd_host_launch(index, grid, block, get_num_threads(), argv)
            if rc:
                raise RuntimeError(f"{kernel}: {lib.hvd_host_last_error().decode()}")


_ops = Ops(_HostBackend())
bucket_norms = _ops.bucket_norms
quantize_pack = _ops.quantize_pack
quantize = _ops.quantize
dequantize_add = _ops.dequantize_add
random_words = _ops.random_words
uniform = _ops.uniform
