"""Uncompressed and cast compressors: ``none``, ``fp16``, ``bf16``.

Their encodings can be summed, so the drop-in optimizer sends them through Horovod's
allreduce by default; through the allgather path they travel as wire messages with one
section holding the raw element bytes (little-endian, in the wire dtype).
"""
from __future__ import annotations

import numpy as np
import torch

from ..errors import WireFormatError
from ..ops import divide
from ..wire import Message, code_dtype, raw_bytes
from .base import Compressor, TensorKey, numel_of, register
from .state import finite

__all__ = ["NoneCompressor", "FP16", "BF16"]


def _from_raw(sec: np.ndarray, dtype: torch.dtype, n: int) -> torch.Tensor:
    buf = torch.from_numpy(np.array(sec))    # a writable copy, suitably aligned
    return buf.view(dtype)[:n] if n else torch.empty(0, dtype=dtype)


def _finite_values(name: str, values: torch.Tensor) -> torch.Tensor:
    """``values`` as float32, checked finite: an encoder sends a tensor that is not finite
    (in float32) as a NONFINITE message, so NaN or Inf in a payload is a WireFormatError."""
    x = values.to(torch.float32)
    if not finite(x):
        raise WireFormatError(f"{name}: the values hold NaN or Inf (in float32) although the "
                              f"message is not flagged NONFINITE")
    return x


@register("none", codec=1)
class NoneCompressor(Compressor):
    """No compression: the gradient's own bytes.

    grad: any shape and dtype.  Message payload: numel * itemsize bytes.
    decode: WireFormatError for a payload of the wrong size, or one holding values that are
    not finite in float32 (the encoder sends those as NONFINITE).
    """
    summable = True
    sends_values = True

    def __init__(self):
        pass

    def shard_unit(self, shape) -> int:
        """Any cut will do: one element."""
        return 1

    def _encode(self, grad, key):
        return self._new_message(grad, key, (raw_bytes(grad),))

    def _decode(self, msg, key, out):
        dt = code_dtype(msg.dtype)
        msg.expect(nsections=1)
        msg.section_size_check(0, msg.numel * torch.empty(0, dtype=dt).element_size(), "values")
        out.add_(_finite_values(self.name, _from_raw(msg.sections[0], dt, msg.numel))
                 .to(out.device))

    def compress(self, tensor):
        return tensor, None

    def decompress(self, tensor, ctx):
        return tensor


_NONE = NoneCompressor()        # the range fallback's encoder and decoder (stateless)


class _Cast(Compressor):
    """A cast to ``wire_dtype`` that keeps the gradient's range.

    encode: a finite gradient whose cast is not finite (beyond fp16's 65504 after the
    division by the world size) is sent as a ``none`` message of its own values instead
    (:meth:`range_fallback`, the message the exchange sends for it), which decode accepts.
    compress (Horovod's contract): a bfloat16 gradient through fp16 travels as float32
    (:meth:`contract_dtype`).  decode: WireFormatError for a payload of the wrong size or
    holding NaN or Inf."""
    wire_dtype: torch.dtype
    sends_values = True

    def __init__(self):
        pass

    def shard_unit(self, shape) -> int:
        """Any cut will do: one element."""
        return 1

    def _scale(self, key: TensorKey) -> float:
        return 1.0

    def message_bytes(self, shape) -> int:
        """Payload bytes for a tensor of ``shape``: two per element."""
        return 2 * numel_of(shape)

    def _encode(self, grad, key):
        if not grad.is_floating_point():
            raise TypeError(f"{self.name} casts floating-point gradients only, got {grad.dtype}")
        x = grad.detach()
        s = self._scale(key)
        if s != 1.0:
            x = divide(x.to(torch.float32), s)   # before the cast, so sums cannot overflow
        y = x.to(self.wire_dtype)
        if not finite(y):                   # the cast overflowed (grad is finite: encode)
            return self.range_fallback(grad, key)
        return self._new_message(grad, key, (raw_bytes(y),))

    def range_fallback(self, grad: torch.Tensor, key: TensorKey) -> Message:
        """The message for a finite ``grad`` whose cast is not finite: a ``none`` message of
        ``grad`` in its own dtype, divided by ``key.world_size`` first (in float64 for a
        float64 gradient, else float32) where the cast is prescaled, so that the sum over
        ranks stays the average as for the cast.  The same bytes as the exchange's
        hvdcomp.exchange.averaging.Averaging.cast_fallback."""
        x = grad.detach()
        if self.prescaled:
            wide = torch.float64 if x.dtype == torch.float64 else torch.float32
            x = divide(x.to(wide), key.world_size).to(grad.dtype)
        return _NONE.encode(x, key)

    def decode(self, msg, key, out):
        """As Compressor.decode, and a ``none`` message (:meth:`range_fallback`) adds its
        values."""
        if msg is not None and msg.codec == _NONE.codec:
            return _NONE.decode(msg, key, out)
        return super().decode(msg, key, out)

    def _decode(self, msg, key, out):
        msg.expect(nsections=1)
        msg.section_size_check(0, 2 * msg.numel, "values")
        out.add_(_finite_values(self.name, _from_raw(msg.sections[0], self.wire_dtype,
                                                     msg.numel)).to(out.device))

    # Horovod's contract (hvd.allreduce / horovod.torch.DistributedOptimizer): the cast
    # is summable, so this works there too.
    def contract_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype compress() gives a floating gradient of ``dtype``: ``wire_dtype``, but
        float32 for a bfloat16 gradient through fp16 (fp16 would turn its values beyond
        65504 into Inf, and Horovod 0.28.1's CPU allreduce rejects bfloat16).  It depends on
        the dtype alone, so every rank chooses the same without communicating, as
        Horovod's allreduce of the result needs."""
        if dtype == torch.bfloat16 and self.wire_dtype == torch.float16:
            return torch.float32
        return self.wire_dtype

    def compress(self, tensor):
        """Horovod's Compression.compress: (the tensor to allreduce, ctx).  A floating
        ``tensor`` is divided by Horovod's world size where the cast is prescaled (fp16)
        and cast to :meth:`contract_dtype`; any other tensor passes as it is (ctx None)."""
        if not tensor.is_floating_point():
            return tensor, None
        s = _horovod_size() if self.prescaled else 1
        x = divide(tensor.to(torch.float32), s) if s != 1 else tensor
        return x.to(self.contract_dtype(tensor.dtype)), (tensor.dtype, s)

    def decompress(self, tensor, ctx):
        if ctx is None:
            return tensor
        dtype, s = ctx
        x = tensor.to(torch.float32)
        return (x * s if s != 1 else x).to(dtype)


def _horovod_size() -> int:
    try:
        import horovod.torch as hvd
        return hvd.size() if hvd.is_initialized() else 1
    except ImportError:
        return 1


@register("fp16", codec=2)
class FP16(_Cast):
    """IEEE half precision.  Each rank sends fp16(grad / world_size), so the sum over ranks is
    the average and stays within fp16 range whenever every |grad| does; a tensor with a
    value whose grad / world_size exceeds 65504 is sent as its own values instead (a
    ``none`` message, :meth:`range_fallback`).  Payload: 2 bytes per element.  (Same
    scaling as PyTorch DDP's fp16 hook.)

    Under Horovod's own DistributedOptimizer (compress / decompress): a bfloat16 gradient
    travels as float32, 4 bytes per element (:meth:`contract_dtype`); a float32 or float64
    gradient as fp16, where a value beyond 65504 * world_size becomes Inf, as with
    Horovod's own fp16 compression: only hvdcomp.torch.DistributedOptimizer, which sends
    such a tensor as its own values, keeps that range.
    """
    summable = True
    prescaled = True
    wire_dtype = torch.float16

    def _scale(self, key):
        return float(key.world_size)

    def for_dtype(self, dtype):
        """bf16 for a bfloat16 tensor (fp16 cannot hold bfloat16's range; bf16 sends the
        gradient's own bytes), this compressor otherwise."""
        return BF16() if dtype == torch.bfloat16 else self


@register("bf16", codec=3)
class BF16(_Cast):
    """bfloat16: fp32's range with 8 bits of mantissa.  Payload: 2 bytes per element."""
    # Mathematically summable, but Horovod 0.28.1's CPU allreduce rejects bfloat16, so the
    # drop-in optimizer sends it through the allgather path and averages in float32.
    summable = False
    wire_dtype = torch.bfloat16

    def compress(self, tensor):
        """Horovod's contract: refused with this error (Horovod 0.28.1's allreduce rejects
        bfloat16 tensors), at the first gradient Horovod's DistributedOptimizer or
        hvd.allreduce would compress.  Raises TypeError."""
        raise TypeError(
            "hvdcomp's bf16 cannot go through Horovod's own allreduce (Horovod 0.28.1 "
            "rejects bfloat16 tensors). Use hvdcomp.torch.DistributedOptimizer(..., "
            "compression='bf16') (import hvdcomp.torch as hvd), which sends bf16 as wire "
            "messages and averages in float32, or compression=hvdcomp.get('fp16') with "
            "Horovod's optimizer.")
