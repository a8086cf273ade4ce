"""The exchange behind the drop-in optimizer: the core (:mod:`hvdcomp.exchange`) with
Horovod's allreduce as the carrier of summable tensors."""
from __future__ import annotations

from typing import Sequence, Tuple

import torch

from ..exchange import Exchange as _Core
from ..exchange import StepStats
from ..transport import HorovodAllreduce, Transport

__all__ = ["Exchange", "StepStats"]


class Exchange(_Core):
    """:class:`hvdcomp.exchange.Exchange` (see there) with ``hvd``, the horovod.torch module
    or None: with ``allreduce_summable``, summable tensors (``none``, ``fp16``) travel
    through Horovod's allreduce; all others (and all of them without Horovod) as wire
    messages through ``transport``, decoded on every rank in rank order."""

    def __init__(self, named_params: Sequence[Tuple[str, torch.Tensor]], compression,
                 transport: Transport, *, hvd=None, fusion_bytes: int = 25 * 2**20,
                 min_compress_numel: int = 1024, compress_1d: bool = False, seed: int = 0,
                 average: bool = True, predivide: float = 1.0, allreduce_summable: bool = True,
                 sparse_as_dense: bool = False, ident: int = 0, check_replicas: bool = True,
                 collective=None):
        super().__init__(named_params, compression, transport,
                         allreduce=(HorovodAllreduce(hvd) if hvd is not None
                                    and allreduce_summable else None),
                         fusion_bytes=fusion_bytes, min_compress_numel=min_compress_numel,
                         compress_1d=compress_1d, seed=seed, average=average,
                         predivide=predivide, sparse_as_dense=sparse_as_dense, ident=ident,
                         check_replicas=check_replicas, collective=collective)
