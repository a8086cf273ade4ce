"""The GPU backend: hvdcomp's ``kernels/*.cu`` compiled by NVRTC and launched through CuPy on
PyTorch's current CUDA stream.

* Each source file is compiled once per process and GPU architecture by NVRTC itself
  (CuPy's NVRTC wrapper, ``cupy.cuda.nvrtc``) to a binary for that GPU (``-arch=sm_XY``;
  PTX of NVRTC's newest architecture only for a GPU newer than NVRTC: :func:`target`),
  kept on disk under ``$HVDCOMP_CACHE/kernels/cuda`` keyed by the sources, the options, the
  architecture and NVRTC's version, and loaded as a ``cupy.RawModule(path=...)``.  Not through
  ``RawModule(code=...)``: CuPy appends ``-ftz=true`` to every NVRTC compile (its
  ``_compile_with_cache_cuda``), after the caller's options, and flushing subnormal float32
  values to zero changes the bits (a bucket whose maximum is subnormal gets a norm of 0 on
  the GPU and not on the CPU).  Options: ``--ftz=false --prec-div=true --prec-sqrt=true``
  (IEEE float32: subnormals kept, division and square root correctly rounded, as g++ does
  on the CPU), ``--fmad=false`` (no FMA contraction: every float op rounds as in the
  PyTorch reference), ``-std=c++17`` and ``-I<kernels>`` for hvdcomp.cuh.
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

import fcntl
import glob
import hashlib
import importlib
import os
import tempfile
import threading
import warnings
from typing import Dict, Sequence, Tuple

import numpy as np
import torch

from ._common import DEVICE_SOURCES, KERNEL_SOURCE, SIGNATURES, kernel_dir, source_hash

__all__ = ["backend", "require", "is_available", "compile_options", "compile_all"]

# IEEE float32 as on the CPU: no flush to zero, correctly rounded / and sqrt, no FMA
NVRTC_OPTIONS = ("--ftz=false", "--prec-div=true", "--prec-sqrt=true", "--fmad=false",
                 "-std=c++17")

_lock = threading.RLock()
_modules: Dict[Tuple[str, str], object] = {}     # (source file, arch) -> cupy.RawModule
_functions: Dict[Tuple[str, str], object] = {}   # (kernel name, arch) -> cupy.RawKernel
_archs: Dict[int, str] = {}                      # CUDA device index -> NVRTC -arch


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


def target(cc: int, supported: Sequence[int] = ()) -> str:
    """NVRTC's ``-arch`` for a GPU of compute capability ``cc`` (e.g. 90): ``sm_XY``, a
    binary for that GPU, where this NVRTC supports it (``supported``: its architectures,
    empty when unknown); ``compute_XY`` PTX of NVRTC's newest where the GPU is newer (the
    driver builds it); RuntimeError where the GPU is older than NVRTC's oldest.  A binary,
    not PTX, wherever possible: PTX from an NVRTC newer than the driver does not load."""
    if not supported or cc in supported:
        return f"sm_{cc}"
    if cc > max(supported):
        return f"compute_{max(supported)}"
    raise RuntimeError(f"hvdcomp.backends.cuda: this NVRTC builds for compute capabilities "
                       f"{min(supported) / 10:.1f} and up; the GPU has {cc / 10:.1f}")


def _device_arch(index: int) -> str:
    cupy = _cupy()
    major, minor = torch.cuda.get_device_capability(index)
    get = getattr(_nvrtc(cupy), "getSupportedArchs", None)
    return target(10 * major + minor, tuple(get()) if get is not None else ())


def compile_binary(filename: str, arch: str) -> str:
    """The path of ``kernels/<filename>`` compiled by NVRTC with :func:`compile_options`
    for ``arch`` (``sm_XY``: a cubin; ``compute_XY``: PTX), cached on disk (written whole
    then renamed; the file's size is in its name, so a cut file is rebuilt; under a file
    lock, so that of the ranks of a machine one compiles and the others load); raises
    RuntimeError with NVRTC's log."""
    cupy = _cupy()
    nvrtc = _nvrtc(cupy)
    options = compile_options() + (f"-arch={arch}",)
    with open(os.path.join(kernel_dir(), filename), encoding="utf-8") as f:
        code = f.read()
    version = ".".join(map(str, nvrtc.getVersion()))
    key = hashlib.sha256("\0".join((filename, version, code) + options).encode()).hexdigest()
    from . import host                        # the cache root ($HVDCOMP_CACHE/kernels)
    cdir = os.path.join(host.cache_dir(), "cuda")
    ext = "cubin" if arch.startswith("sm_") else "ptx"
    stem = os.path.join(cdir, f"{filename}.{arch}.{key[:24]}")
    os.makedirs(cdir, exist_ok=True)
    with open(stem + ".lock", "w") as lockf:
        fcntl.flock(lockf, fcntl.LOCK_EX)      # one compiler per file; the others wait, then load
        try:
            return _cached_or_compiled(nvrtc, code, filename, options, version, stem, ext)
        finally:
            fcntl.flock(lockf, fcntl.LOCK_UN)


def _cached_or_compiled(nvrtc, code, filename, options, version, stem, ext) -> str:
    for old in glob.glob(f"{stem}.*.{ext}"):
        size = old[len(stem) + 1:-len(ext) - 1]
        if size.isdigit() and os.path.getsize(old) == int(size) > 0:
            return old
        os.remove(old)                        # cut short: build it again
    prog = nvrtc.createProgram(code, filename, (), ())
    try:
        try:
            nvrtc.compileProgram(prog, options)
        except Exception as e:                # NVRTCError: the log says why
            raise RuntimeError(f"NVRTC {version} could not compile {filename} "
                               f"({' '.join(options)}): {e}\n{nvrtc.getProgramLog(prog)}") from e
        data = nvrtc.getCUBIN(prog) if ext == "cubin" else nvrtc.getPTX(prog)
    finally:
        nvrtc.destroyProgram(prog)
    if isinstance(data, str):
        data = data.encode()
    if ext == "ptx":
        data = data.rstrip(b"\0")
    path = f"{stem}.{len(data)}.{ext}"
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(stem), suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return path


def _module(filename: str, arch: str):
    with _lock:
        mod = _modules.get((filename, arch))
        if mod is None:
            mod = _cupy().RawModule(path=compile_binary(filename, arch))
            _modules[(filename, arch)] = mod
        return mod


def _function(kernel: str, device: int):
    """The kernel, built for the architecture of CUDA device ``device`` (an index)."""
    with _lock:
        arch = _archs.get(device)
        if arch is None:
            arch = _archs[device] = _device_arch(device)
        fn = _functions.get((kernel, arch))
        if fn is None:
            fn = _module(KERNEL_SOURCE[kernel], arch).get_function(kernel)
            _functions[(kernel, arch)] = fn
        return fn


def compile_all(device=None) -> None:
    """Compile and load every kernel on ``device`` (default: the current one) now, so that a
    compile error surfaces here rather than at the first encode."""
    cupy = _cupy()
    dev = torch.device(device) if device is not None else torch.device(
        "cuda", torch.cuda.current_device())
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    with cupy.cuda.Device(index):
        for name in SIGNATURES:
            _function(name, index).kernel   # the property compiles and loads for this device


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
        fn = _function(kernel, dev.index if dev.index is not None
                       else torch.cuda.current_device())
        with cupy.cuda.Device(dev.index):
            stream = _current_stream(cupy, dev)
            with stream:
                # from_dlpack inside the stream context: the consumer stream CuPy announces
                # is torch's current stream, so DLPack inserts no extra synchronization.
                typed = tuple(cupy.from_dlpack(a) if c == "P" else _NUMPY[c](a)
                              for a, c in zip(args, sig))
                fn((grid, 1, 1), (block, 1, 1), typed)


backend = _CudaBackend()     # what the ops' kernel implementations launch through
