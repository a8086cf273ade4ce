"""Which open exchange owns a set of parameters: the object lifecycle both doors share.

An object of either door (the drop-in optimizer, the DDP hook's HookState) exchanges the
gradients of a set of named parameters through one live exchange (threads, communicators).
The rules for such objects are the same in both doors and live here:

* a new object built on parameters that an open one exchanges replaces it: the old one is
  closed once the ranks agree on it (the door's settings handshake, :func:`agree`, names
  it; then the door calls :func:`take_over`), so each backward pass exchanges once;
  ValueError on every rank if the old one also holds parameters the new one does not;
* a closed object refuses to be used (:meth:`Owner._check_open`, RuntimeError naming the
  object that replaced it, and what to do with that one);
* pickling and copying are refused while the exchange is live (:meth:`Owner._copy_refused`,
  TypeError naming ``state_dict()``).

What differs between the doors is only how their objects are named and what to do
instead: a :class:`Door`.  This module imports neither door.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterable, List, Sequence, Tuple

import torch

from ..log import logger

__all__ = ["Door", "Owner", "agree", "replaced", "record", "take_over"]


@dataclass(frozen=True)
class Door:
    """How one door's objects are named in the lifecycle's messages.

    label: the object's name ("hvdcomp DistributedOptimizer"); prefix: what every
    message starts with ("" or "hvdcomp.ddp: "); use_new: what to do with the object that
    replaced a closed one; rebuild: how to build one on all the old one's parameters;
    closed: what the log says after "the old one is closed"; copy: the TypeError's text
    for a copy or pickle.
    """
    label: str
    prefix: str
    use_new: str
    rebuild: str
    closed: str
    copy: str


class Owner:
    """What an object of either door has for its lifecycle: ``_ident`` (its creation
    number, the same on every rank), ``_named`` ([(name, parameter)] it exchanges),
    ``_closed``, ``_replaced_by`` and ``close()``; ``DOOR`` names it in messages."""

    DOOR: Door
    _closed = False
    _replaced_by = None

    def _check_open(self) -> None:
        """RuntimeError if closed: naming the object that replaced it, or close()."""
        if self._closed:
            d = self.DOOR
            why = (f"it was replaced by {d.label} number {self._replaced_by}, built on the "
                   f"same parameters: {d.use_new}" if self._replaced_by is not None
                   else "close() was called")
            raise RuntimeError(f"{d.prefix}this {d.label} (number {self._ident}) is "
                               f"closed: {why}")

    def _replace(self, by: int, rank: int) -> None:
        """Closed because number ``by`` replaces it (every rank alike); logged on rank 0."""
        self.close()
        self._replaced_by = by
        if rank == 0:
            logger.info("%s%s number %d replaces number %d on the same parameters: the old "
                        "one is closed %s", self.DOOR.prefix, self.DOOR.label, by, self._ident,
                        self.DOOR.closed)

    def _copy_refused(self) -> TypeError:
        """The TypeError for pickling or copying this object (its exchange is live)."""
        return TypeError(self.DOOR.copy)


def replaced(candidates: Iterable[Owner], named: Sequence[Tuple[str, torch.Tensor]],
             ident: int) -> Dict[Owner, List[str]]:
    """The open objects among ``candidates`` (in creation order) that exchange any of
    ``named``'s parameters (the new object number ``ident`` replaces them), each with the
    names of its other parameters (those the new one would leave unexchanged)."""
    mine = {id(p) for _, p in named}
    out = {}
    for other in candidates:
        if other._ident == ident or other._closed:
            continue
        held = [(n, id(p)) for n, p in other._named]
        if any(i in mine for _, i in held):
            out[other] = [n for n, i in held if i not in mine]
    return out


def record(old: Dict[Owner, List[str]]) -> Dict[str, List[str]]:
    """What the ranks agree on about :func:`replaced`'s result (the settings handshake's
    ``replaces`` entry): {number: names left unexchanged}."""
    return {str(o._ident): left for o, left in old.items()}


def agree(settings, channel, what: str, candidates: Iterable[Owner],
          named: Sequence[Tuple[str, torch.Tensor]], ident: int,
          **extras) -> Dict[Owner, List[str]]:
    """The settings handshake of a new object (number ``ident``, exchanging ``named``):
    ``settings.agree`` (:meth:`hvdcomp.exchange.driver.Settings.agree`, over ``channel``)
    with the door's ``extras``, the parameters' names, shapes and dtypes, and
    :func:`record` of the open objects among ``candidates`` that the new one replaces.
    Returns those (:func:`replaced`), for :func:`take_over` once the door's own checks
    passed."""
    old = replaced(candidates, named, ident)
    settings.agree(channel, what, **extras, replaces=record(old),
                   parameters=[[n, list(p.shape), str(p.dtype)] for n, p in named])
    return old


def take_over(old: Dict[Owner, List[str]], ident: int, rank: int) -> None:
    """After the ranks agreed on :func:`record`: ValueError (every rank alike) if an old
    object also holds parameters the new one (number ``ident``) does not; else each old
    one is closed (:meth:`Owner._replace`)."""
    for o, left in old.items():
        if left:
            d = o.DOOR
            raise ValueError(
                f"{d.prefix}{d.label} number {o._ident} (still open) exchanges some of these "
                f"parameters and also {left[:5]}{'...' if len(left) > 5 else ''}, which this "
                f"one does not: replacing it would leave those unexchanged.  Call its "
                f"close() first, or {d.rebuild}")
    for o in old:
        o._replace(ident, rank)
