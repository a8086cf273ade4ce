"""The exchange core, independent of Horovod and of the launcher that drives it.

* :mod:`.plan`: which compressor and which path each tensor takes (routing, Auto);
* :mod:`.buckets`: the fixed fusion order and the handshake that makes ranks agree on it;
* :mod:`.pipeline`: the encode | communicate | decode threads, bucket by bucket;
* :mod:`.collective`: what the pipeline drives, per bucket (the interface), and
  :class:`Allgather`;
* :mod:`.scatter`: :class:`ReduceScatter`, cut by :mod:`.shards` (which tensors, where),
  its second stage in :mod:`.scatter_owner`; it holds an :class:`Allgather` for the
  bucket's other tensors;
* :mod:`.hier`: :class:`Hierarchical`, several ranks per host (float32 sums inside the
  host, the compressed allgather across hosts; the pieces and their messages inside the
  host in :mod:`.host_pieces`); it holds an :class:`Allgather` for the bucket's other
  tensors;
* :mod:`.frames`: what both collectives do around a frame of messages (build it, the
  adaptive compressors' statistics, the compressors' events);
* :mod:`.averaging`: gradients in, averages out (predivide, op=Sum, the NaN policy);
* :mod:`.core`: :class:`Exchange`, all of it assembled, with the training-loop protocols
  (:mod:`.loop`);
* :mod:`.shutdown`: at interpreter exit, a failing rank's error marks and the threads'
  end, before MPI is finalized.
* :mod:`.driver`: the lifecycle both doors share (settings, the step, DGC's momentum
  rules in :mod:`.momentum`, checkpoints in :mod:`.checkpoint`, the objects' replacement
  in :mod:`.owners`, the autograd engine's answers in :mod:`.backward`).

Bytes travel through a :class:`hvdcomp.transport.Transport`, summable buffers through an
:class:`hvdcomp.transport.Allreduce`.
"""
from .collective import Allgather, Collective
from .core import Exchange, refit
from .hier import Hierarchical
from .plan import Entry, Plan
from .scatter import ReduceScatter
from .step_stats import StepStats

__all__ = ["Exchange", "StepStats", "Plan", "Entry", "Collective", "Allgather",
           "ReduceScatter", "Hierarchical", "refit"]
