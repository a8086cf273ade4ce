"""What the kernel backends share: where the kernel sources are and what they declare (the
kernels' signatures), launch geometry, and the argument checks of the kernel launchers.

The launchers themselves are the kernel implementations of the ops (hvdcomp/ops/*.py): they
receive a backend's launch object (``backend`` of ``hvdcomp/backends/host.py``, g++ and
ctypes for CPU tensors, or of ``hvdcomp/backends/cuda.py``, CuPy for CUDA tensors), which
provides ``name``, ``device_type`` ("cpu" or "cuda") and ``launch(kernel, grid, block,
args)``, where ``args`` follow ``SIGNATURES[kernel]``: contiguous tensors for ``P``, Python
ints or floats for the scalars, range-checked by the launcher; the backend types them
exactly (ctypes or NumPy scalars).
"""
from __future__ import annotations

import hashlib
import operator
import os
import re
from typing import Optional, Sequence

import torch

__all__ = ["kernel_dir", "source_hash", "discover", "SIGNATURES", "KERNEL_SOURCE",
           "DEVICE_SOURCES", "HOST_SOURCES", "check_tensor", "check_int", "u32", "grid_for",
           "BLOCK", "MAX_GRID", "reduce_block", "packed_size"]

# ---- sources ------------------------------------------------------------------------------
#
# Every kernel is an ``extern "C" __global__ void hvd_...(...)`` in some kernels/*.cu file.
# Nothing lists them by hand: the sources, the kernel -> file map and each kernel's parameter
# types are read from the .cu files themselves (``discover``).  The host build checks the
# types once more against the C++ declarations (kernels/host_shim.h) before the first launch.

SHARED_SOURCES = ("hvdcomp.cuh",)                 # included by every .cu file
HOST_ONLY = ("host_shim.h", "host_launch.cpp")    # the g++ build of the same sources

_DECL = re.compile(r'extern\s+"C"\s+__global__\s+(?:__launch_bounds__\s*\([^)]*\)\s+)?'
                   r'void\s+(?:__launch_bounds__\s*\([^)]*\)\s+)?(\w+)\s*\(([^)]*)\)')


def _type_code(param: str, kernel: str) -> str:
    """One parameter's letter: P pointer, q long long, i int, I unsigned int, f float,
    d double (host_shim.h's type_code)."""
    p = re.sub(r"__restrict__|const|volatile", " ", param)
    if "*" in p:
        return "P"
    words = p.split()[:-1]                         # drop the parameter name
    t = " ".join(words)
    table = {"long long": "q", "long long int": "q", "int": "i", "unsigned int": "I",
             "unsigned": "I", "hvd::u32": "I", "float": "f", "double": "d",
             "hvd::i64": "q"}
    if t not in table:
        raise ValueError(f"kernel {kernel}: unsupported parameter type {param.strip()!r} "
                         f"(use pointers, long long, int, unsigned int, float or double)")
    return table[t]


def discover(directory: Optional[str] = None):
    """(cu_files, {kernel: file}, {kernel: signature}) read from the sources in ``directory``
    (default kernel_dir()).  Raises ValueError on a kernel declared twice or a parameter type
    outside the launchers' set."""
    d = directory or kernel_dir()
    files = tuple(sorted(f for f in os.listdir(d) if f.endswith(".cu")))
    source, sigs = {}, {}
    for f in files:
        with open(os.path.join(d, f), encoding="utf-8") as fh:
            text = re.sub(r"/\*.*?\*/", " ", fh.read(), flags=re.S)   # block comments
            text = re.sub(r"//[^\n]*", "", text)                        # line comments
        for name, params in _DECL.findall(text):
            if name in source:
                raise ValueError(f"kernel {name} is declared in {source[name]} and {f}")
            source[name] = f
            sigs[name] = "".join(_type_code(p, name) for p in params.split(",") if p.strip())
    return files, source, sigs


_HERE = os.path.dirname(os.path.abspath(__file__))


def kernel_dir() -> str:
    """The folder holding the kernel sources.

    Looked up in order: ``$HVDCOMP_KERNEL_DIR``; ``hvdcomp/kernels`` (an installed package that
    ships the sources as package data); ``kernels/`` at the top of a source checkout.
    Raises FileNotFoundError naming the places tried.
    """
    tried = []
    env = os.environ.get("HVDCOMP_KERNEL_DIR")
    cands = [env] if env else []
    pkg = os.path.dirname(_HERE)
    cands += [os.path.join(pkg, "kernels"), os.path.join(os.path.dirname(pkg), "kernels")]
    for d in cands:
        tried.append(d)
        if all(os.path.isfile(os.path.join(d, f)) for f in SHARED_SOURCES + HOST_ONLY):
            return os.path.abspath(d)
    raise FileNotFoundError(
        "hvdcomp kernel sources (%s) not found; tried %s. Set HVDCOMP_KERNEL_DIR to the folder "
        "holding them." % (", ".join(SHARED_SOURCES + HOST_ONLY), ", ".join(tried)))


def source_hash(names: Optional[Sequence[str]] = None, directory: Optional[str] = None) -> str:
    """SHA-256 (hex) over the names and bytes of the given kernel source files (default:
    HOST_SOURCES, every source of the host build)."""
    d = directory or kernel_dir()
    h = hashlib.sha256()
    for name in (HOST_SOURCES if names is None else names):
        with open(os.path.join(d, name), "rb") as f:
            data = f.read()
        h.update(name.encode() + b"\0" + len(data).to_bytes(8, "little") + data)
    return h.hexdigest()


try:
    _CU_FILES, KERNEL_SOURCE, SIGNATURES = discover()
except (FileNotFoundError, ValueError):  # no (usable) sources: loading a backend says why;
    _CU_FILES, KERNEL_SOURCE, SIGNATURES = (), {}, {}   # the references still work

DEVICE_SOURCES = SHARED_SOURCES + _CU_FILES
HOST_SOURCES = DEVICE_SOURCES + HOST_ONLY


# ---- geometry ------------------------------------------------------------------------------

BLOCK = 256                 # threads per block of the element-wise kernels
MAX_GRID = 2**31 - 1        # gridDim.x limit; every kernel loops grid-stride beyond it
MAX_REDUCE_BLOCK = 256      # HVD_MAX_BLOCK in kernels/hvdcomp.cuh


def reduce_block(bucket_size: int) -> int:
    """Threads per block of the bucket-norm kernels: the smallest power of two >= bucket_size,
    at most 256.  It fixes the float64 summation order of the L2 norm, so it depends on
    ``bucket_size`` alone (never on the device): host and GPU norms are bit-identical."""
    return min(MAX_REDUCE_BLOCK, 1 << max(int(bucket_size) - 1, 0).bit_length())


def packed_size(n: int, bits: int) -> int:
    """Bytes of ``n`` codes of ``bits`` bits (hvdcomp.ops.bitpack.packed_size)."""
    return (n * bits + 7) // 8


def grid_for(items: int, block: int = BLOCK) -> int:
    """Blocks for ``items`` work items of ``block`` threads (at least 1, at most MAX_GRID)."""
    return max(1, min((items + block - 1) // block, MAX_GRID))


# ---- argument checks -----------------------------------------------------------------------

def check_int(v, name: str, lo: int, hi: int) -> int:
    """An integer argument in lo..hi.  Raises TypeError (bool, not an integer) or ValueError
    (out of range) naming it."""
    if isinstance(v, bool):
        raise TypeError(f"{name} must be an integer, got bool")
    try:
        i = operator.index(v)
    except TypeError:
        raise TypeError(f"{name} must be an integer, got {type(v).__name__}") from None
    if not lo <= i <= hi:
        raise ValueError(f"{name} must be in {lo}..{hi}, got {i}")
    return i


def u32(v, name: str) -> int:
    """A key/counter word: any integer, taken modulo 2**32 as hvdcomp.philox does."""
    return check_int(v, name, -2**63, 2**63 - 1) & 0xFFFFFFFF


def check_tensor(be, t, name: str, dtype: torch.dtype, numel: Optional[int] = None, *,
                 output: bool = False, device: Optional[torch.device] = None) -> torch.Tensor:
    """A kernel argument checked for backend ``be``: a 1-D torch tensor of ``dtype`` on ``be``'s
    device type (and on ``device`` when given), of ``numel`` elements when given.  Inputs are
    returned contiguous (a copy only if they were not); outputs must already be contiguous and
    not require grad.  Raises TypeError (type, dtype) or ValueError (device, shape, layout)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise TypeError(f"{name} must be {dtype}, got {t.dtype}")
    if t.device.type != be.device_type:
        raise ValueError(f"{name} must be on a {be.device_type} device for the "
                         f"{be.name} backend, got {t.device}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device}, the other arguments on {device}")
    if t.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(t.shape)}")
    if numel is not None and t.numel() != numel:
        raise ValueError(f"{name} must have {numel} elements, got {t.numel()}")
    if output:
        if not t.is_contiguous():
            raise ValueError(f"{name} (written by the kernel) must be contiguous")
        if t.requires_grad:
            raise ValueError(f"{name} (written by the kernel) must not require grad")
        return t
    return t.detach().contiguous()    # kernels read storage order
