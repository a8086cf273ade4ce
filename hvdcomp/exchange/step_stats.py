"""What one rank sent in one step."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any, Dict, List

__all__ = ["StepStats"]


@dataclass
class StepStats:
    """What one rank sent in one step.

    bytes_sent:   bytes of this rank's encoded payload (wire messages with their headers,
                  plus allreduced buffers), i.e. what it contributes to the collectives.
    fp32_bytes:   4 * elements of every gradient exchanged: the uncompressed fp32 payload.
    ratio:        fp32_bytes / bytes_sent.
    recv_bytes:   bytes of the other ranks' frames this rank received through the
                  transport (exact: allgather and all-to-all; allreduced buffers excluded).
                  With the reduce-scatter, bytes_sent counts this rank's shards for the
                  other ranks and its frame of averaged shards.
    traffic_bytes: estimate of bytes this rank puts on the network with ring algorithms:
                  allgather (N-1)/N of all ranks' messages, allreduce 2(N-1)/N of the
                  buffer, all-to-all exactly its parts for the other ranks.
                  With the hierarchical exchange (:mod:`hvdcomp.exchange.hier`), these
                  three count what crosses hosts (the compressed pieces this rank sends
                  for its host, and the flat part); what stays inside the host is
                  ``host_bytes``.
    host_bytes:   the hierarchical exchange's bytes this rank sends to the other ranks of
                  its host (float32 pieces to their owners, its averaged pieces to all).
    compressors:  parameter name -> name of the compressor applied to it.
    nonfinite:    names of tensors that held NaN/Inf on some rank (their average is NaN).
    events:       notable events reported by compressors (e.g. side information too far).
    joined:       number of ranks that had joined (``hvd.join()``) and contributed nothing;
                  the averages count the others only.
    encode_s, comm_s, decode_s: seconds spent in each phase (summed over buckets; the
                  phases of different buckets overlap in the pipeline).
    reduce_s:     the part of comm_s that is local work, not the wire: the reduce-scatter's
                  decoding, averaging and re-encoding of the shards this rank owns.
    """
    step: int = 0
    bytes_sent: int = 0
    fp32_bytes: int = 0
    recv_bytes: int = 0
    traffic_bytes: float = 0.0
    host_bytes: int = 0
    compressors: Dict[str, str] = field(default_factory=dict)
    nonfinite: List[str] = field(default_factory=list)
    events: List[str] = field(default_factory=list)
    joined: int = 0
    encode_s: float = 0.0
    comm_s: float = 0.0
    decode_s: float = 0.0
    reduce_s: float = 0.0

    @property
    def ratio(self) -> float:
        return self.fp32_bytes / self.bytes_sent if self.bytes_sent else float("inf")

    def merge(self, other: "StepStats") -> "StepStats":
        """Add ``other`` (the statistics of another part of the same step, e.g. one DDP
        bucket) into this one and return it: byte counts and seconds summed, compressors
        updated, nonfinite and events extended, ``joined`` the larger; ``step`` stays."""
        for f in fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if f.name == "step":
                continue
            if f.name == "joined":
                self.joined = max(mine, theirs)
            elif isinstance(mine, dict):
                mine.update(theirs)
            elif isinstance(mine, list):
                mine.extend(theirs)
            else:
                setattr(self, f.name, mine + theirs)
        return self

    def as_dict(self) -> Dict[str, Any]:
        """Every field, plus ``ratio`` (None when nothing was sent, instead of inf), as plain
        Python values (ints, floats, lists, dicts): ready for json.dumps, a CSV row or a
        metrics logger."""
        d = asdict(self)
        d["ratio"] = self.ratio if self.bytes_sent else None
        return d
