"""Sparse gradients (``nn.Embedding(sparse=True)``) as Horovod sends them without
``sparse_as_dense``: every rank's indices and values to every rank, concatenated in rank
order, the values averaged; the result is a sparse COO tensor of the parameter's shape.

They travel uncompressed, as ``coo`` wire messages (docs/wire-format.md): section 0 the
int64 indices (``d x nnz``, row-major; the header's bucket size holds ``d``), section 1
the values (``nnz x`` the dense dimensions) in the gradient's dtype.
"""
from __future__ import annotations

import math
from typing import List, Sequence, Tuple

import numpy as np
import torch

from ..compressors import TensorKey
from ..compressors.state import finite as all_finite
from ..errors import WireFormatError
from ..ops import divide
from ..wire import CODECS, Message, code_dtype, dtype_code

__all__ = ["CODEC", "encode", "combine"]

CODEC = CODECS["coo"]


def encode(grad: torch.Tensor, key: TensorKey) -> Message:
    """``grad`` (a sparse COO tensor, any dtype the wire format knows) as one message."""
    g = grad.detach().coalesce().cpu()
    idx = g.indices().contiguous().numpy().astype("<i8", copy=False)
    vals = g.values().contiguous()
    raw = (vals.view(torch.int16) if vals.dtype in (torch.float16, torch.bfloat16)
           else vals).numpy()
    return Message(codec=CODEC, dtype=dtype_code(g.dtype), shape=tuple(g.shape),
                   sections=(idx.view(np.uint8).reshape(-1), raw.view(np.uint8).reshape(-1)),
                   bucket_size=g.sparse_dim(), tensor_id=key.tensor_id, rank=key.rank,
                   seed=key.seed, step=key.step)


def _decode(msg: Message, key: TensorKey, shape: Sequence[int], dtype: torch.dtype):
    msg.expect(codec=CODEC, tensor_id=key.tensor_id, step=key.step, rank=key.rank,
               seed=key.seed, shape=shape, nsections=2, bits=0, level_version=0)
    if msg.flags:
        raise WireFormatError(f"coo: flags 0x{msg.flags:02x}, expected 0 (a coo message "
                              f"carries its values, NaN included, and no flag)")
    d = msg.bucket_size
    if not 1 <= d <= len(shape):
        raise WireFormatError(f"coo: {d} sparse dimensions for a tensor of shape "
                              f"{tuple(shape)}")
    if code_dtype(msg.dtype) != dtype:
        raise WireFormatError(f"coo: values of dtype {code_dtype(msg.dtype)}, the gradient "
                              f"is {dtype}")
    ni = len(msg.sections[0])
    if ni % (8 * d):
        raise WireFormatError(f"coo section 0 (indices) has {ni} bytes, not a multiple of "
                              f"8 x {d}")
    nnz = ni // (8 * d)
    per = math.prod(shape[d:]) * torch.empty(0, dtype=dtype).element_size()
    msg.section_size_check(1, nnz * per, "values")
    idx = torch.from_numpy(np.frombuffer(bytes(msg.sections[0]), dtype="<i8")
                           .astype(np.int64).reshape(d, nnz))
    lim = torch.tensor(list(shape[:d]), dtype=torch.int64).view(d, 1)
    if nnz and (bool((idx < 0).any()) or bool((idx >= lim).any())):
        raise WireFormatError(f"coo: an index lies outside the shape {tuple(shape)}")
    buf = torch.from_numpy(np.frombuffer(bytes(msg.sections[1]), dtype=np.uint8).copy())
    vals = buf.view(dtype).reshape(nnz, *shape[d:])
    return idx, vals


def combine(msgs: List[Message], keys: List[TensorKey], shape: Sequence[int],
            dtype: torch.dtype, divisor: float, device) -> Tuple[torch.Tensor, bool]:
    """The sparse average of ``msgs`` (the contributing ranks', in rank order; ``keys``
    theirs) and whether it is finite: indices and values concatenated, values divided by
    ``divisor`` in float32 and cast back to ``dtype``; not coalesced (as Horovod's sparse
    allreduce).  NaN or Inf among the values makes every value NaN (the NaN policy).
    Raises WireFormatError for a malformed message or ranks that disagree on the number of
    sparse dimensions."""
    parts = [_decode(m, k, shape, dtype) for m, k in zip(msgs, keys)]
    if len({p[0].shape[0] for p in parts}) > 1:
        raise WireFormatError(f"coo: the ranks' gradients of tensor {keys[0].tensor_id} "
                              f"differ in their number of sparse dimensions")
    idx = torch.cat([p[0] for p in parts], dim=1)
    vals = torch.cat([p[1] for p in parts]).to(torch.float32)
    if divisor != 1.0:
        vals = divide(vals, divisor)
    finite = all_finite(vals)
    if not finite:
        vals = torch.full_like(vals, float("nan"))
    # the indices were checked against the shape above
    return torch.sparse_coo_tensor(idx, vals.to(dtype), tuple(shape),
                                   check_invariants=False).to(device), finite
