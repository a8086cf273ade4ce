"""The GPU backend: hvdcomp's ``kernels/*.cu`` compiled by NVRTC through CuPy and launched on
PyTorch's current CUDA stream.

* One ``cupy.RawModule`` per source file, built from the file's text once per process
  (CuPy then keeps the binary per device, and on disk under ~/.cupy/kernel_cache).  Options:
  ``--fmad=false`` (no FMA contraction: every float op rounds as in the PyTorch reference),
  ``-std=c++17``, ``-I<kernels>`` for hvdcomp.cuh, and ``-DHVDCOMP_SOURCE_HASH=...``: CuPy's
  disk cache keys on the main source and the options only, so the hash of every kernel
  source (the header included) goes into the options to invalidate it when any changes.
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

import os
import threading
import warnings
from typing import Dict, Tuple

import numpy as np
import torch

from ._common import DEVICE_SOURCES, KERNEL_SOURCE, SIGNATURES, kernel_dir, source_hash

__all__ = ["backend", "require", "is_available", "compile_options", "compile_all"]

NVRTC_OPTIONS = ("--fmad=false", "-std=c++17")

_lock = threading.RLock()
_modules: Dict[str, object] = {}      # source file -> cupy.RawModule
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
    d = kernel_dir()
    return NVRTC_OPTIONS + (f"-I{d}",
                            f"-DHVDCOMP_SOURCE_HASH=0x{source_hash(DEVICE_SOURCES, d)[:16]}")


def _module(filename: str):
    with _lock:
        mod = _modules.get(filename)
        if mod is None:
            cupy = _cupy()
            with open(os.path.join(kernel_dir(), filename), encoding="utf-8") as f:
                code = f.read()
            mod = cupy.RawModule(code=code, options=compile_options())
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
