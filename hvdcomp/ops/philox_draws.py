"""Philox4x32-10 draws as ops: :func:`random_words` and :func:`uniform`.

Their references are the specification in hvdcomp/philox.py (PyTorch int64 arithmetic, CPU
or CUDA; the stream layout, key = (seed, rank), counter = (index // 4, tensor_id, step), is
described there and pinned by Random123's known-answer vectors); their kernels are
``hvd_philox_words`` and ``hvd_uniform`` of kernels/random.cu, bit-identical to them.
``seed``, ``rank``, ``tensor_id`` and ``step`` are taken modulo 2**32; the kernels raise
ValueError for ``n`` or ``offset`` outside 0..2**62.
"""
from __future__ import annotations

import torch

from .. import philox
from ..backends._common import BLOCK, check_int, grid_for, u32
from . import op

__all__ = ["random_words", "uniform"]

random_words = op(philox.random_words)     # int64 (n,) holding the uint32 words
uniform = op(philox.uniform)               # float32 (n,) in [0, 1): top 24 bits * 2**-24


def _philox(be, kernel, dtype, n, seed, step, rank, tensor_id, offset, device):
    """Launch ``kernel`` for the draws ``offset .. offset+n-1``: (n,) of ``dtype`` on
    ``device`` (default: the backend's device type)."""
    n = check_int(n, "n", 0, 2**62)
    offset = check_int(offset, "offset", 0, 2**62)
    dev = torch.device(device) if device is not None else torch.device(be.device_type)
    out = torch.empty(n, dtype=dtype, device=dev)
    if n:
        be.launch(kernel, grid_for(n), BLOCK,
                  (out, n, offset, u32(seed, "seed"), u32(rank, "rank"),
                   u32(tensor_id, "tensor_id"), u32(step, "step")))
    return out


@random_words.kernel
def _(be, n, *, seed, step, rank, tensor_id, offset=0, device=None):
    w = _philox(be, "hvd_philox_words", torch.int32, n, seed, step, rank, tensor_id, offset,
                device)
    return w.to(torch.int64) & 0xFFFFFFFF


@uniform.kernel
def _(be, n, *, seed, step, rank, tensor_id, offset=0, device=None):
    return _philox(be, "hvd_uniform", torch.float32, n, seed, step, rank, tensor_id, offset,
                   device)
