"""A toy compressor, written the way a user adds one: this module and its tests, nothing else.

1-bit signs with one scale per tensor and no error feedback: a tensor ``g`` of ``n``
elements is sent as ``s = mean(|g|)`` (float32) and the bits ``g_i >= 0``; a receiver adds
``s * (2 * bit_i - 1)``.  (The sign compressor of signSGD, Bernstein et al. 2018, "signSGD:
Compressed Optimisation for Non-Convex Problems", Alg. 1, with the l1 scale of their Sec. 3;
biased, which is why hvdcomp's own 1-bit compressor, ``signef``, keeps a residual.)

Wire format: codec 222 (an id for compressors defined outside hvdcomp), bits = 1, two
sections: the scale (4 bytes) and ``ceil(n / 8)`` bytes of bits, little-endian bit order.

Reduce-scatter: it declares its shard unit (one element: any cut will do, each piece then
has a scale of its own), so the reduce-scatter collective takes it; the owner of a piece
re-encodes the average of its pieces with this same compressor (the base class's
``second_stage``).
"""
import numpy as np
import torch

import hvdcomp
from hvdcomp.compressors import Compressor
from hvdcomp.compressors.base import numel_of
from hvdcomp.errors import WireFormatError


@hvdcomp.register("toysign", codec=222)
class ToySign(Compressor):
    """grad: any shape, floating dtype.  Payload: 4 + ceil(numel / 8) bytes."""

    def __init__(self):
        pass

    def shard_unit(self, shape) -> int:
        return 1

    def _header_fields(self):
        return {"bits": 1, "bucket_size": 0, "level_version": 0}

    def message_bytes(self, shape) -> int:
        return 4 + (numel_of(shape) + 7) // 8

    def _encode(self, grad, key):
        if not grad.is_floating_point():
            raise TypeError(f"toysign compresses floating-point gradients, got {grad.dtype}")
        g = grad.detach().reshape(-1).to(torch.float32).cpu().numpy()
        scale = np.float32(np.abs(g).mean()) if g.size else np.float32(0)
        bits = np.packbits(g >= 0, bitorder="little")
        return self._new_message(grad, key, (np.array([scale]).view(np.uint8), bits))

    def _decode(self, msg, key, out):
        n = msg.numel
        msg.expect(nsections=2)
        msg.section_size_check(0, 4, "scale")
        msg.section_size_check(1, (n + 7) // 8, "sign bits")
        scale = np.frombuffer(bytes(msg.sections[0]), dtype=np.float32)[0]
        if not np.isfinite(scale) or scale < 0:
            raise WireFormatError(f"toysign: scale {scale} is not a finite non-negative number")
        bits = np.unpackbits(np.frombuffer(bytes(msg.sections[1]), dtype=np.uint8),
                             count=n, bitorder="little")
        signs = torch.from_numpy(bits.astype(np.float32) * 2 - 1)
        out.add_(signs.to(out.device) * float(scale))
