"""Bucket geometry of the compressors whose ``bucket_size`` setting 0 means "one bucket per
tensor" (TernGrad, EF-SignSGD): one float32 scale per bucket plus ``code_bits`` bits per
coordinate on the wire."""
from __future__ import annotations

from typing import ClassVar

from ..codecs import packed_size

__all__ = ["TensorBuckets"]


class TensorBuckets:
    """Mixin: ``bucket_size`` (int >= 0; 0 = the whole tensor is one bucket) and
    ``code_bits`` (bits per coordinate) give the geometry below."""
    bucket_size: int
    code_bits: ClassVar[int]

    def _bs(self, n: int) -> int:
        """Effective bucket size for a tensor of ``n`` elements (>= 1)."""
        return self.bucket_size if self.bucket_size else max(n, 1)

    def num_buckets(self, numel: int) -> int:
        """Number of float32 scales sent for ``numel`` coordinates (0 for an empty tensor)."""
        bs = self._bs(numel)
        return (numel + bs - 1) // bs

    def message_bytes(self, numel: int) -> int:
        """Payload bytes for ``numel`` coordinates:
        ``4 * num_buckets(numel) + ceil(code_bits * numel / 8)``."""
        return 4 * self.num_buckets(numel) + packed_size(numel, self.code_bits)
