"""The GPU backend: hvdcomp's ``kernels/*.cu`` compiled by NVRTC and launched through CuPy on
PyTorch's current CUDA stream.

* Each source file is compiled once per process and architecture by NVRTC itself (CuPy's
  NVRTC wrapper, ``cupy.cuda.nvrtc``) to PTX, kept on disk under
  ``$HVDCOMP_CACHE/kernels/cuda`` keyed by the sources' hash, the options, the architecture
  and NVRTC's version, and loaded as a ``cupy.RawModule(path=...)``.  Not through
  ``RawModule(code=...)``: CuPy appends ``-ftz=true`` to every NVRTC compile (its
  ``_compile_with_cache_cuda``), after the caller's options, and flushing subnormal float32
  values to zero changes the bits (a bucket whose maximum is subnormal gets a norm of 0 on
  the GPU and not on the CPU).  Options: ``--ftz=false --prec-div=true --prec-sqrt=true``
  (IEEE float32: subnormals kept, division and square root correctly rounded, as g++ does
  on the CPU), ``--fmad=false`` (no FMA contraction: every float op rounds as in the
  PyTorch reference), ``-std=c++17``, ``-I<kernels>`` for hvdcomp.cuh, and
  ``-arch=compute_XY`` of the oldest visible GPU (the driver builds the PTX for each).
* Kernels run on ``torch.cuda.current_stream(device)`` (adopted with
  ``cupy.cuda.ExternalStream``, or ``Stream.from_external`` where that is gone: see
  _current_stream), so they are ordered with the surrounding PyTorch work without any
  synchronization.  Like any
  PyTorch op they are asynchronous: synchronize that stream before another library (MPI)
  reads the results through a raw pointer.
* Tensors cross to CuPy by DLPack (zero copy), detached and contiguous; every scalar is
  typed to the kernel's C signature (numpy.int64, numpy.int32, numpy.uint32).

CuPy is imported lazily: importing this module never fails; ``require()`` and the first
launch raise ImportError (no CuPy) or RuntimeError (no CUDA device) with the reason.
``backend`` is the launch object the ops' kernel implementations receive (hvdcomp.ops), as
hvdcomp.backends.host's is for CPU tensors.
"""
from __future__ import annotations

import hashlib
import importlib
import os
import tempfile
import threading
import warnings
from typing import Dict, Tuple

import numpy as np
import torch

from ._common import DEVICE_SOURCES, KERNEL_SOURCE, SIGNATURES, kernel_dir, source_hash

__all__ = ["backend", "require", "is_available", "compile_options", "compile_all"]

# IEEE float32 as on the CPU: no flush to zero, correctly rounded / and sqrt, no FMA
NVRTC_OPTIONS = ("--ftz=false", "--prec-div=true", "--prec-sqrt=true", "--fmad=false",
                 "-std=c++17")

_lock = threading.RLock()
_modules: Dict[str, object] = {}      # source file -> cupy.RawModule (of its PTX)
_functions: Dict[str, object] = {}    # kernel name -> cupy.RawKernel


def cupy_extra() -> str:
    """The pip extra of hvdcomp that brings CuPy for this PyTorch's CUDA major version
    (setup.cfg: cuda12 = cupy-cuda12x, cuda13 = cupy-cuda13x); cuda12 when PyTorch
    has no CUDA or another major version."""
    major = (torch.version.cuda or "").split(".")[0]
    return f"cuda{major}" if major in ("12", "13") else "cuda12"


def _cupy():
    try:
        import cupy
    except ImportError as e:
        extra = cupy_extra()
        raise ImportError(f"hvdcomp.backends.cuda needs CuPy for CUDA: pip install "
                          f"'hvdcomp[{extra}]' (CuPy's wheel cupy-{extra}x; the extras "
                          f"cuda12 and cuda13 match CUDA 12 and 13): {e}") from e
    return cupy


def require() -> None:
    """Raise ImportError without CuPy, RuntimeError without a CUDA device."""
    _cupy()
    if not torch.cuda.is_available():
        raise RuntimeError("hvdcomp.backends.cuda: torch.cuda.is_available() is False")


def is_available() -> bool:
    try:
        require()
        return True
    except (ImportError, RuntimeError):
        return False


def compile_options() -> Tuple[str, ...]:
    """NVRTC's options for every source (without the architecture)."""
    d = kernel_dir()
    return NVRTC_OPTIONS + (f"-I{d}",
                            f"-DHVDCOMP_SOURCE_HASH=0x{source_hash(DEVICE_SOURCES, d)[:16]}")


def _nvrtc(cupy):
    nvrtc = getattr(cupy.cuda, "nvrtc", None)
    return nvrtc if nvrtc is not None else importlib.import_module(
        "cupy_backends.cuda.libs.nvrtc")


def _arch() -> str:
    """compute_XY of the oldest visible GPU: PTX that every visible device's driver builds."""
    caps = [torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())]
    major, minor = min(caps) if caps else (7, 0)
    return f"compute_{major}{minor}"


def compile_ptx(filename: str, arch: str) -> str:
    """PTX of ``kernels/<filename>`` for ``arch`` (compute_XY), compiled by NVRTC with
    :func:`compile_options` and cached on disk; raises RuntimeError with NVRTC's log."""
    cupy = _cupy()
    nvrtc = _nvrtc(cupy)
    options = compile_options() + (f"-arch={arch}",)
    with open(os.path.join(kernel_dir(), filename), encoding="utf-8") as f:
        code = f.read()
    version = ".".join(map(str, nvrtc.getVersion()))
    key = hashlib.sha256("\0".join((filename, version, code) + options).encode()).hexdigest()
    from . import host                        # the cache root ($HVDCOMP_CACHE/kernels)
    cdir = os.path.join(host.cache_dir(), "cuda")
    path = os.path.join(cdir, f"{filename}.{arch}.{key[:24]}.ptx")
    if os.path.exists(path):
        return path
    prog = nvrtc.createProgram(code, filename, (), ())
    try:
        try:
            nvrtc.compileProgram(prog, options)
        except Exception as e:                # NVRTCError: the log says why
            raise RuntimeError(f"NVRTC {version} could not compile {filename} "
                               f"({' '.join(options)}): {e}\n{nvrtc.getProgramLog(prog)}") from e
        ptx = nvrtc.getPTX(prog)
    finally:
        nvrtc.destroyProgram(prog)
    if isinstance(ptx, str):
        ptx = ptx.encode()
    ptx = ptx.rstrip(b"\0")
    os.makedirs(cdir, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=cdir, suffix=".tmp")
    with os.fdopen(fd, "wb") as f:            # written whole, then renamed: never half a file
        f.write(ptx)
    os.replace(tmp, path)
    return path


def _module(filename: str):
    with _lock:
        mod = _modules.get(filename)
        if mod is None:
            mod = _cupy().RawModule(path=compile_ptx(filename, _arch()))
            _modules[filename] = mod
        return mod


def _function(kernel: str):
    with _lock:
        fn = _functions.get(kernel)
        if fn is None:
            fn = _module(KERNEL_SOURCE[kernel]).get_function(kernel)
            _functions[kernel] = fn
        return fn


def compile_all(device=None) -> None:
    """Compile and load every kernel on ``device`` (default: the current one) now, so that a
    compile error surfaces here rather than at the first encode."""
    cupy = _cupy()
    dev = torch.device(device) if device is not None else torch.device(
        "cuda", torch.cuda.current_device())
    with cupy.cuda.Device(dev.index if dev.index is not None else 0):
        for name in SIGNATURES:
            _function(name).kernel        # the property compiles and loads for this device


class _StreamPointer:
    """The CUDA stream protocol for a raw stream pointer (what Stream.from_external takes)."""

    def __init__(self, ptr: int):
        self._ptr = ptr

    def __cuda_stream__(self):
        return (0, self._ptr)


_streams: Dict[Tuple[int, int], object] = {}     # (device, stream pointer) -> CuPy stream


def _current_stream(cupy, dev: torch.device):
    """A CuPy view of torch.cuda.current_stream(dev), cached per (device, pointer).

    ``cupy.cuda.ExternalStream`` (deprecated in CuPy 14, still present) is preferred: it
    never destroys the stream.  CuPy 14's ``Stream.from_external`` returns a
    ``cupy.cuda.Stream``, whose ``__del__`` calls cudaStreamDestroy on any pointer other than
    the default streams (cupy/cuda/stream.pyx), i.e. on PyTorch's own stream; where it is the
    only way, the wrapper is kept in the cache for the life of the process, never collected.
    """
    ptr = int(torch.cuda.current_stream(dev).cuda_stream)
    key = (dev.index, ptr)
    stream = _streams.get(key)
    if stream is None:
        external = getattr(cupy.cuda, "ExternalStream", None)
        if external is not None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                stream = external(ptr, dev.index)
        else:
            stream = cupy.cuda.Stream.from_external(_StreamPointer(ptr))
        _streams[key] = stream
    return stream


_NUMPY = {"q": np.int64, "i": np.int32, "I": np.uint32, "f": np.float32, "d": np.float64}


class _CudaBackend:
    name = "cuda"
    device_type = "cuda"

    def launch(self, kernel: str, grid: int, block: int, args) -> None:
        cupy = _cupy()
        sig = SIGNATURES[kernel]
        if len(args) != len(sig):
            raise TypeError(f"{kernel} takes {len(sig)} arguments, got {len(args)}")
        dev = next(a.device for a, c in zip(args, sig) if c == "P")
        for a, c in zip(args, sig):
            if c == "P" and (not isinstance(a, torch.Tensor) or a.device != dev
                             or not a.is_contiguous() or a.requires_grad):
                raise TypeError(f"{kernel}: pointer arguments must be contiguous CUDA tensors "
                                f"on {dev} that do not require grad")
        fn = _function(kernel)
        with cupy.cuda.Device(dev.index):
            stream = _current_stream(cupy, dev)
            with stream:
                # from_dlpack inside the stream context: the consumer stream CuPy announces
                # is torch's current stream, so DLPack inserts no extra synchronization.
                typed = tuple(cupy.from_dlpack(a) if c == "P" else _NUMPY[c](a)
                              for a, c in zip(args, sig))
                fn((grid, 1, 1), (block, 1, 1), typed)


backend = _CudaBackend()     # what the ops' kernel implementations launch through
