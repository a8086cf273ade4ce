"""The ops layer: every computation that has a kernel, with its PyTorch reference.

An :class:`Op` is one named operation with

* a **reference**: plain PyTorch/NumPy code, the specification (what the bytes must be);
* a **kernel** implementation: the launcher of the CUDA C sources in ``kernels/`` (the same
  function serves the host build, g++ on the CPU, and CuPy on a GPU: it receives the launch
  object of :func:`hvdcomp.backends.kernel_backend` first).

Which one runs is decided here and nowhere else: the kernel where a kernel backend serves
the device of the op's tensors (``HVDCOMP_BACKEND``: ``auto``, ``kernels``, ``reference``),
else the reference.  A kernel implementation may return :data:`NotImplemented` for an input
it does not serve (say an alphabet over 256 symbols, or a strided output); the reference
then runs on that input.  Compressors and codecs call ops and never branch on the backend.

Layers point one way: compressors -> codecs -> ops -> backends -> kernels.

Defining an op (one module per kernel family, named for what it computes)::

    @op
    def bucket_norms(x, bucket_size, norm):          # the reference: the specification
        ...

    @bucket_norms.kernel
    def _(be, x, bucket_size, norm):                 # be: the backend's launch object
        ...
        be.launch("hvd_bucket_norms_l2", grid, block, (x, n, bucket_size, out))
        return out
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Dict, Optional

import torch

from ..backends import kernel_backend

__all__ = ["Op", "op", "device_of", "finite", "divide", "divide_", "bucket_width", "padded_buckets",
           "REGISTRY"]


def divide(t: torch.Tensor, k: float) -> torch.Tensor:
    """``t / k`` for a Python number ``k`` (a world size, a predivide factor), correctly
    rounded to ``t``'s dtype, the same bits on the CPU and on CUDA: a new tensor.

    PyTorch divides a tensor by a Python number as a true division on the CPU but as a
    multiplication by the reciprocal on CUDA, which rounds differently (for k = 3 about a
    third of float32 values); a divisor held in a 0-dim tensor on ``t``'s device is an IEEE
    division on both.  float16 and bfloat16 are divided in float32 and rounded once more,
    which gives their correctly rounded quotient (24 >= 2 x 11 + 2 bits)."""
    if k == 1:
        return t.clone()
    if t.dtype in (torch.float32, torch.float64):
        return t / torch.full((), k, dtype=t.dtype, device=t.device)
    return divide(t.to(torch.float32), k).to(t.dtype)


def divide_(t: torch.Tensor, k: float) -> torch.Tensor:
    """:func:`divide` in place (``t`` float32 or float64); returns ``t``."""
    if k == 1:
        return t
    return t.div_(torch.full((), k, dtype=t.dtype, device=t.device))


def bucket_width(n: int, bucket_size: int) -> int:
    """Row length of the references' zero-padded (nb, width) bucket layout of ``n`` values:
    ``bucket_size``, except where one bucket holds all n values (0 < n <= bucket_size):
    then n, since padding that lone bucket to bucket_size adds only zeros, and bucket_size
    may be as large as 2^31 (a 16 GiB float64 row for a 100-element tensor)."""
    return n if 0 < n <= bucket_size else bucket_size


def padded_buckets(values: torch.Tensor, bucket_size: int) -> torch.Tensor:
    """Flat ``values`` (n,) as buckets: (ceil(n / bucket_size), :func:`bucket_width`), the
    last row zero-padded, in ``values``' dtype and device (a view of ``values`` where no
    padding is needed).  The references' one bucket layout."""
    n = values.numel()
    nb = (n + bucket_size - 1) // bucket_size
    w = bucket_width(n, bucket_size)
    if n == nb * w:
        return values.reshape(nb, w)
    out = values.new_zeros(nb * w)
    out[:n] = values.reshape(-1)
    return out.view(nb, w)


def finite(t: Optional[torch.Tensor]) -> bool:
    """Whether every element of ``t`` is finite (True for None and for empty tensors).
    aminmax propagates NaN and is one vectorized pass (about 30x faster than
    isfinite(t).all() on a CPU, which materializes a bool tensor)."""
    if t is None or t.numel() == 0:
        return True
    lo, hi = torch.aminmax(t)
    return bool(torch.isfinite(lo)) and bool(torch.isfinite(hi))

REGISTRY: Dict[str, "Op"] = {}


def device_of(args, kwargs) -> torch.device:
    """The device an op runs on: its ``device=`` keyword if given, else that of its first
    tensor argument (in positional order, then keyword order), else the CPU."""
    dev = kwargs.get("device")
    if dev is not None:
        return torch.device(dev)
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, torch.Tensor):
            return a.device
        if isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor):
            return a[0].device
    return torch.device("cpu")


class Op:
    """One operation: ``reference`` (the specification) and an optional ``kernel``.

    Calling the op runs the kernel implementation where a kernel backend serves the
    device (see the module docstring), else the reference; both take the same arguments
    and return the same values (bit for bit unless the op's docstring says otherwise).
    ``op.reference(...)`` and ``op.kernels(be, ...)`` call one side directly (tests).
    """

    def __init__(self, reference: Callable, name: Optional[str] = None):
        self.reference = reference
        self.name = name or f"{reference.__module__.rsplit('.', 1)[-1]}.{reference.__name__}"
        self._kernel: Optional[Callable] = None
        functools.update_wrapper(self, reference)
        if self.name in REGISTRY:
            raise ValueError(f"op {self.name} defined twice")
        REGISTRY[self.name] = self

    def kernel(self, fn: Callable) -> Callable:
        """Decorator: ``fn(be, *args, **kwargs)`` is the kernel implementation."""
        if self._kernel is not None:
            raise ValueError(f"op {self.name} has a kernel implementation already")
        self._kernel = fn
        return fn

    @property
    def has_kernel(self) -> bool:
        return self._kernel is not None

    def kernels(self, be, *args, **kwargs) -> Any:
        """The kernel implementation with launch object ``be`` (NotImplemented where it
        does not serve these arguments)."""
        if self._kernel is None:
            raise NotImplementedError(f"op {self.name} has no kernel implementation")
        return self._kernel(be, *args, **kwargs)

    def backend(self, *args, **kwargs):
        """The kernel backend module this call would use, or None for the reference."""
        if self._kernel is None:
            return None
        return kernel_backend(device_of(args, kwargs))

    def __call__(self, *args, **kwargs):
        be = self.backend(*args, **kwargs)
        if be is not None:
            out = self._kernel(be.backend, *args, **kwargs)
            if out is not NotImplemented:
                return out
        return self.reference(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<op {self.name}{' +kernel' if self._kernel else ''}>"


def op(reference: Callable) -> Op:
    """Decorator: make ``reference`` (the specification) an :class:`Op`."""
    return Op(reference)
