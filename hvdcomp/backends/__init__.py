"""Kernel backends: where the CUDA kernels of ``kernels/*.cu`` run, on a GPU or the CPU.

* ``hvdcomp.backends.host``: the sources built with g++ against ``kernels/host_shim.h`` and
  run on the CPU (ctypes, OpenMP), for CPU tensors;
* ``hvdcomp.backends.cuda``: the same sources through CuPy (NVRTC), for CUDA tensors, on
  PyTorch's current stream.

Each exposes ``backend``, a launch object (``name``, ``device_type``, ``launch(kernel, grid,
block, args)``), and nothing that computes: the operations are the ops of hvdcomp.ops (a
PyTorch reference, the specification, and a kernel implementation that receives this launch
object, checks its arguments with hvdcomp.backends._common, allocates and launches).  Both
backends give the same bytes: the kernels' fixed summation orders depend on the arguments,
never on the device or the thread count.

``for_device(device)`` returns the backend module for a device; ``kernel_backend(device)``
is what the op dispatcher calls: the backend, or None to run the PyTorch reference.  Nothing
here imports CuPy until a CUDA tensor asks for it.

Environment: HVDCOMP_BACKEND = ``auto`` (default: kernels where they can run, else the
reference with one warning on the "hvdcomp" logger), ``kernels`` (kernels or an error),
``reference`` (never the kernels).  The results are those each op's docstring states either way; only the speed
differs.
"""
from __future__ import annotations

import contextlib
import importlib
import os
import threading
from typing import Optional

import torch

from ..log import logger

__all__ = ["for_device", "kernel_backend", "use"]

_choice = {}
_choice_lock = threading.Lock()


def for_device(device) -> object:
    """The backend module (``host`` or ``cuda``) for ``device`` (a torch.device or string).

    Raises ValueError for other device types; importing ``cuda`` raises ImportError with the
    reason when CuPy is missing.
    """
    dev = torch.device(device)
    if dev.type == "cpu":
        return importlib.import_module(".host", __name__)
    if dev.type == "cuda":
        mod = importlib.import_module(".cuda", __name__)
        mod.require()
        return mod
    raise ValueError(f"no kernel backend for device type {dev.type!r}")


def kernel_backend(device) -> Optional[object]:
    """The kernel backend for ``device``, or None where the PyTorch reference should run.

    Decided once per (device type, HVDCOMP_BACKEND) and cached.  ``auto``: a backend that
    cannot be loaded (no C++ compiler; no CuPy or CUDA) gives None and one warning (on the
    "hvdcomp" logger) naming the reason; ``kernels``: that raises RuntimeError instead; ``reference``: always None.
    The first CPU call builds the host library where it is not cached (about 40 s, once per
    kernel sources and compiler, with one warning saying so: hvdcomp.backends.host).
    """
    mode = os.environ.get("HVDCOMP_BACKEND", "auto").strip().lower() or "auto"
    if mode not in ("auto", "kernels", "reference"):
        raise ValueError(f"HVDCOMP_BACKEND must be auto, kernels or reference, got {mode!r}")
    if mode == "reference":
        return None
    dev = torch.device(device)
    key = (dev.type, mode)
    with _choice_lock:
        if key in _choice:
            return _choice[key]
        try:
            mod = for_device(dev)
            if dev.type == "cpu":
                mod.load()
        except (ImportError, RuntimeError, OSError, ValueError) as e:
            if mode == "kernels":
                raise RuntimeError(f"HVDCOMP_BACKEND=kernels but no kernel backend for "
                                   f"{dev.type}: {e}") from e
            logger.warning(f"no kernel backend for {dev.type} ({e}); the ops run the "
                           f"PyTorch reference (same bytes, slower)")
            mod = None
        _choice[key] = mod
        return mod


@contextlib.contextmanager
def use(mode: str):
    """Inside, HVDCOMP_BACKEND is ``mode`` ("auto", "kernels" or "reference"); the previous
    value is restored on exit.  For benchmarks and tests that compare the two paths in one
    process (the choice is cached per mode, so switching back costs nothing)."""
    old = os.environ.get("HVDCOMP_BACKEND")
    os.environ["HVDCOMP_BACKEND"] = mode
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("HVDCOMP_BACKEND", None)
        else:
            os.environ["HVDCOMP_BACKEND"] = old
