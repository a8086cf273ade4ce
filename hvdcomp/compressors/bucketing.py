"""Bucket geometry of the compressors whose ``bucket_size`` setting 0 means "one bucket per
tensor" (TernGrad, EF-SignSGD): one float32 scale per bucket plus ``code_bits`` bits per
coordinate on the wire (section 0: the scales, section 1: the codes)."""
from __future__ import annotations

from typing import ClassVar

import numpy as np
import torch

from ..ops.bitpack import packed_size
from ..errors import WireFormatError
from ..wire import Message
from .base import numel_of

__all__ = ["TensorBuckets"]


class TensorBuckets:
    """Mixin: ``bucket_size`` (int >= 0; 0 = the whole tensor is one bucket) and
    ``code_bits`` (bits per coordinate) give the geometry below."""
    bucket_size: int
    code_bits: ClassVar[int]
    name: ClassVar[str]

    def shard_unit(self, shape) -> int:
        """A bucket, or with ``bucket_size`` 0 one element: each piece of the reduce-scatter
        then has a scale of its own (hvdcomp.exchange.shards)."""
        return self.bucket_size or 1

    def _bs(self, n: int) -> int:
        """Effective bucket size for a tensor of ``n`` elements (>= 1)."""
        return self.bucket_size if self.bucket_size else max(n, 1)

    def num_buckets(self, numel: int) -> int:
        """Number of float32 scales sent for ``numel`` coordinates (0 for an empty tensor)."""
        bs = self._bs(numel)
        return (numel + bs - 1) // bs

    def message_bytes(self, shape) -> int:
        """Payload bytes for a tensor of ``shape`` (or ``numel`` coordinates):
        ``4 * num_buckets(numel) + ceil(code_bits * numel / 8)``."""
        numel = numel_of(shape)
        return 4 * self.num_buckets(numel) + packed_size(numel, self.code_bits)

    def _read_scales(self, msg: Message) -> torch.Tensor:
        """Section 0 of a message of two sections: its ``num_buckets(numel)`` float32 scales
        (CPU).  Raises WireFormatError for another number of sections, a section of the wrong
        size, or scales that are negative or not finite."""
        msg.expect(nsections=2)
        msg.section_size_check(0, 4 * self.num_buckets(msg.numel), "scales")
        s = torch.from_numpy(np.array(msg.sections[0]).view(np.float32))
        if not bool(torch.isfinite(s).all()) or bool((s < 0).any()):
            raise WireFormatError(f"{self.name}: bucket scales must be finite and >= 0")
        return s
