"""The hierarchical exchange's pieces (:mod:`hvdcomp.exchange.hier`): where each tensor is
cut among the ranks of a host, and the messages of those pieces inside the host: stage 1's
frames and the host means, stage 3's averaged pieces and their assembly into each tensor's
accumulator.

Inside the host a piece travels as its raw float32 bytes (a frame's message without the
wire format's header and checksum; the frame still carries the presence bits, the JOINED
flag, the stamp and error frames): these bytes cross shared memory, not a network, and the
checksum alone costs more CPU time than the copy (7.4 against 5.1 ms for 51 MB of float32
on one core: bench/results/serialize.md).  A piece of the wrong size is a WireFormatError; a value that is not
finite travels as it is, and the owner's mean (or the assembled average) is then NaN.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from ..compressors.state import finite as all_finite
from ..errors import WireFormatError
from ..ops import divide, divide_
from ..transport import Incoming, Outgoing, Stamp
from ..wire import raw_bytes
from .frames import frame
from .plan import Entry
from .shards import boundaries, unit

__all__ = ["HostPiece", "HostPieces", "cuts"]


def cuts(e: Entry, local_size: int) -> List[int]:
    """The ``local_size + 1`` cut points of ``e``'s flat gradient into its pieces (module
    docstring), at its compressor's unit boundaries."""
    shape = tuple(e.param.shape)
    return boundaries([e.param.numel()], [unit(e.compressor, shape)], local_size)


@dataclass(frozen=True)
class HostPiece:
    """Piece ``[lo, hi)`` (flat elements) of tensor ``name``, owned by local rank
    ``owner``; ``shape``: what the compressor encodes (``Compressor.shard_shape``);
    ``tensor_id``: the first of the piece's three tensor ids; ``+1`` is the cross-host
    messages' (``+0`` and ``+2`` are reserved: the in-host stages carry raw float32)."""
    name: str
    lo: int
    hi: int
    shape: Tuple[int, ...]
    owner: int
    tensor_id: int

    @property
    def numel(self) -> int:
        return self.hi - self.lo

    @property
    def label(self) -> str:
        """``name[lo:hi]``: the name the compressor keeps the piece's state under."""
        return f"{self.name}[{self.lo}:{self.hi}]"


class HostPieces:
    """The pieces of the tensors marked ``hier`` on a host of ``local_size`` ranks, and
    their messages inside the host.

    entries: name -> Entry; local: this rank's local rank; first_id: the first tensor id
    free for the pieces; seed: the shared seed; scatter: the stand-in entries of this
    rank's pieces (``virtual``) take the cross-host reduce-scatter.
    """

    def __init__(self, entries: Dict[str, Entry], local_size: int, local: int,
                 first_id: int, seed: int, scatter: bool = False):
        self.entries, self.local_size, self.local = entries, local_size, local
        self.seed = seed
        L = self.local_size
        #: {name: [HostPiece or None per owner]} (None: the owner has no piece of it)
        self.pieces: Dict[str, List[Optional[HostPiece]]] = {}
        self.virtual: Dict[str, Entry] = {}          # this rank's pieces, as the inner's
        for e in entries.values():
            if not e.hier:
                continue
            c = cuts(e, L)
            row: List[Optional[HostPiece]] = []
            for l in range(L):
                lo, hi = c[l], c[l + 1]
                if hi <= lo:
                    row.append(None)
                    continue
                p = HostPiece(e.name, lo, hi,
                              tuple(e.compressor.shard_shape(tuple(e.param.shape), lo, hi)),
                              l, first_id + 3 * (e.tensor_id * L + l))
                row.append(p)
                if l == self.local:
                    # a stand-in parameter: the piece's shape, float32, the device; no memory
                    stand_in = torch.zeros((), dtype=torch.float32,
                                           device=e.param.device).expand(p.shape)
                    self.virtual[e.name] = Entry(p.label, stand_in, p.tensor_id + 1,
                                                 e.compressor, False,
                                                 scatter=scatter)
            self.pieces[e.name] = row
        self._buffers: Dict[tuple, np.ndarray] = {}

    def owned(self, names: Sequence[str], owner: int) -> List[HostPiece]:
        """The pieces of ``names`` that local rank ``owner`` owns, in the order of
        ``names``."""
        return [self.pieces[n][owner] for n in names if self.pieces[n][owner] is not None]

    def index(self, names: Sequence[str]) -> Dict[Tuple[str, int], int]:
        """{(name, owner): the piece's index in the owner's frame} for ``names``."""
        out = {}
        for l in range(self.local_size):
            for i, p in enumerate(self.owned(names, l)):
                out[(p.name, l)] = i
        return out

    def frames(self, mine: Sequence[Entry], flat: Dict[str, Optional[torch.Tensor]],
               joined: bool, stamp: Stamp, k: int = 0) -> List[np.ndarray]:
        """Stage 1: one frame per local rank ``l``, piece ``l`` of each of ``mine`` (their
        flat float32 gradients ``flat``, None: absent) as its raw float32 bytes; this rank's
        own frame holds no bytes (:meth:`means` reads its pieces from ``flat``).  ``k``: the
        bucket, whose frames reuse their memory from step to step."""
        names = [e.name for e in mine]
        return [frame(self.owned(names, l), lambda p: flat[p.name],
                      (lambda p, g: raw_bytes(g[p.lo:p.hi])) if l != self.local else
                      (lambda p, g: None), joined, stamp, self._alloc((1, k, l))).data
                for l in range(self.local_size)]

    def means(self, mine: List[HostPiece], incoming: Incoming,
              own: Dict[str, Optional[torch.Tensor]]) -> Dict[str, Optional[torch.Tensor]]:
        """{name: the host's mean of this rank's piece of it, shaped as the compressor
        encodes it (NaN where a contribution was not finite), or None where no rank of the
        host had the gradient}: the contributions (this rank's from ``own``, its flat
        gradients) added in local-rank order into a float32 sum, divided by L (a sum that
        overflowed although every contribution was finite: each contribution divided by L
        first, in the same order)."""
        L, me = self.local_size, self.local
        out: Dict[str, Optional[torch.Tensor]] = {}
        for i, p in enumerate(mine):
            present = incoming.present(i)
            if not any(present):
                out[p.name] = None
                continue
            device = self.entries[p.name].param.device
            parts = [own[p.name][p.lo:p.hi] if l == me else
                     _floats(incoming.raw(l, i), p, f"local rank {l}").to(device)
                     for l in range(L) if present[l]]
            acc = torch.zeros(p.numel, dtype=torch.float32, device=device)
            for x in parts:
                acc.add_(x)
            if all_finite(acc):
                divide_(acc, L)
            elif not all(all_finite(x) for x in parts):
                acc.fill_(float("nan"))
            else:
                acc.zero_()
                for x in parts:
                    acc.add_(divide(x, L))
            out[p.name] = acc.view(p.shape)
        return out

    def averaged(self, mine: Sequence[HostPiece], averages: Dict[str, torch.Tensor],
                 stamp: Stamp, k: int = 0) -> Outgoing:
        """Stage 3: this rank's frame of its averaged pieces (``averages``: {stand-in
        name: average}; absent where it has none), raw float32 bytes; ``k``: the bucket."""
        msgs, present = [], []
        for p in mine:
            a = averages.get(self.virtual[p.name].name)
            present.append(a is not None)
            msgs.append(None if a is None else raw_bytes(a))
        return Outgoing(msgs, present, stamp=stamp, alloc=self._alloc((3, k)))

    def assemble(self, name: str, averaged: Incoming, index: Dict[Tuple[str, int], int],
                 acc: torch.Tensor) -> bool:
        """Stage 3: add every owner's averaged piece of ``name`` from ``averaged`` into its
        part of the flat float32 accumulator ``acc``; False if any is not finite.  Raises
        WireFormatError for a piece of the wrong size."""
        finite = True
        for l, p in enumerate(self.pieces[name]):
            if p is None:
                continue
            part = acc[p.lo:p.hi]
            part.add_(_floats(averaged.raw(l, index[(name, l)]), p,
                              f"local rank {l}'s average").to(part.device))
            finite = finite and all_finite(part)
        return finite

    def _alloc(self, key: tuple):
        """Where a frame of ``key`` (stage, bucket[, owner]) is written: the memory of the
        last step's frame of that key where it is large enough (no new allocation of tens
        of MB per bucket and step).  Safe because a bucket's frames have been sent before
        that bucket is encoded again."""
        def alloc(n: int) -> np.ndarray:
            buf = self._buffers.get(key)
            if buf is None or buf.size < n:
                buf = self._buffers[key] = np.empty(n, dtype=np.uint8)
            return buf[:n]
        return alloc


def _floats(raw: np.ndarray, p: HostPiece, sender: str) -> torch.Tensor:
    """The float32 values of piece ``p`` in the raw bytes ``raw`` (a view where it can be).
    WireFormatError unless ``raw`` holds exactly ``p.numel`` of them."""
    if raw.size != 4 * p.numel:
        raise WireFormatError(f"{sender} sent {raw.size} bytes for {p.label}, expected "
                              f"{4 * p.numel} (float32)")
    x = raw.view(np.float32)
    return torch.from_numpy(x if x.flags.writeable else x.copy())
