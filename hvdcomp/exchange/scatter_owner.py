"""The second stage of the reduce-scatter (:mod:`hvdcomp.exchange.scatter`, step 2 and the
decode of step 3): an owner's pieces averaged and re-encoded with the second-stage
compressor (:func:`~hvdcomp.exchange.shards.second_stage`), and every rank's decode of the
owners' averaged pieces with that same compressor.
"""
from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import torch

from ..compressors import Compressor, TensorKey, get
from ..compressors.state import finite as all_finite
from ..transport import Incoming, Outgoing, Stamp
from ..wire import Message
from .averaging import Averaging
from .frames import drain_events
from .plan import Entry
from .shards import Piece, second_stage

__all__ = ["ShardOwner"]


class ShardOwner:
    """Both ends of the reduce-scatter's second stage for one exchange.

    entries: name -> :class:`~hvdcomp.exchange.plan.Entry` (those marked ``scatter`` take
    the reduce-scatter); averaging: the exchange's; seed: the shared seed; rank, size: this
    rank and the world size.  ``stage2``: {id of a first-stage compressor: its second
    stage}.
    """

    def __init__(self, entries: Dict[str, Entry], averaging: Averaging, seed: int,
                 rank: int, size: int):
        self.entries, self.averaging, self.seed = entries, averaging, seed
        self.rank, self.size = rank, size
        self.stage2: Dict[int, Compressor] = {}
        for e in entries.values():
            if e.scatter:
                self.stage2.setdefault(id(e.compressor), second_stage(e.compressor))
        self._piece_accs = _PieceAccumulators()
        self._none = get("none")

    def second_stages(self) -> List[Compressor]:
        """The second-stage compressors that keep state of their own (DGC's residuals of
        the averaged shards; a quantizer's finer stage follows its first stage's table and
        has none)."""
        firsts = {id(e.compressor): e.compressor for e in self.entries.values() if e.scatter}
        return [c for i, c in self.stage2.items() if c is not firsts[i] and c.keeps_state]

    def reduce(self, mine: Sequence[Piece], incoming: Incoming, step: int, stamp: Stamp,
               events: List[str]) -> Tuple[Outgoing, int]:
        """This rank's frame of averaged pieces (``mine``: the pieces it owns in the bucket,
        ``incoming``: every rank's stage-1 frame, ``stamp``: this rank's), and how many
        ranks had joined: for each piece, the contributions present decoded in rank order
        and averaged over the ranks that had not joined, re-encoded (a NONFINITE message
        where a contribution was NONFINITE; absent where no rank had the tensor).  The
        compressors' events are appended to ``events``."""
        joined = sum(incoming.joined)
        msgs, present_out = [], []
        for i, p in enumerate(mine):
            present = incoming.present(i)
            present_out.append(any(present))
            if not any(present):
                msgs.append(None)
                continue
            e = self.entries[p.name]
            acc = self._piece_accs.zeroed(p, e.param.device)
            keys = [p.key(step, r, self.size, self.seed) for r in range(self.size)]
            fin, prescaled = self.averaging.combine(e, incoming.messages(i), keys, present,
                                                    acc, joined)
            events.extend(drain_events(e.compressor, p.label))
            if fin:
                self.averaging.mean(e, acc, keys[self.rank], joined, prescaled)
                x = acc.view(p.shape)
            else:                                   # NaN policy: the tensor is NaN on all
                x = torch.full(p.shape, float("nan"), device=acc.device)
            msgs.append(self._encode_average(e, p, x, step))
        return (Outgoing(msgs, present_out, joined=self.averaging.joined, stamp=stamp),
                joined)

    def _encode_average(self, e: Entry, p: Piece, x: torch.Tensor, step: int):
        """The owner's stage-2 message of piece ``p``'s average ``x``: a cast whose wire
        dtype cannot hold the finite average sends it as float32 (``none``)."""
        comp = self.stage2[id(e.compressor)]
        key = p.key2(step, self.seed)
        if (comp.wire_dtype is not None and all_finite(x)
                and not all_finite(x.to(comp.wire_dtype))):
            return self._none.encode(x, key)
        return comp.encode(x, key)

    def decode_averages(self, e: Entry, msgs: Sequence[Message], keys: Sequence[TensorKey],
                        spans: Sequence[Tuple[int, int]], acc: torch.Tensor) -> bool:
        """Add the owners' averaged pieces of ``e`` (``msgs``, with their ``keys`` and flat
        ``spans``, in owner order) into its float32 accumulator ``acc``, with the second
        stage; False if any was NONFINITE."""
        comp = self.stage2[id(e.compressor)]
        decs = [self.averaging._decoder(comp, m, key) for m, key in zip(msgs, keys)]
        if all(d is comp for d in decs):            # one call for all the pieces
            return comp.decode_pieces(msgs, keys, spans, acc)
        finite = True                               # a cast's fallback among them
        for d, m, key, (lo, hi) in zip(decs, msgs, keys, spans):
            finite &= d.decode(m, key, acc[lo:hi])
        return finite

    def close(self) -> None:
        """Drop the pieces' accumulators."""
        self._piece_accs.clear()


class _PieceAccumulators(dict):
    """{piece tensor id: its float32 accumulator}, reused from step to step."""

    def zeroed(self, p: Piece, device) -> torch.Tensor:
        """A zeroed float32 accumulator for piece ``p`` on ``device``."""
        acc = self.get(p.tensor_id)
        if acc is None or acc.device != device:
            acc = self[p.tensor_id] = torch.zeros(p.numel, dtype=torch.float32, device=device)
        else:
            acc.zero_()
        return acc
