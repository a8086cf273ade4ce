"""The one checkpoint format of both doors: what an exchange remembers from step to step.

:meth:`Checkpoints.state_dict` holds everything needed to resume bit-exactly (the step,
the compressor's state, the reduce-scatter's second stages, LAQ's parameters of the last
step) under a ``format`` number.  The doors store it as their kind of checkpoint wants:

* the drop-in optimizer nests it in the wrapped optimizer's state_dict under one key
  (:meth:`Checkpoints.split` takes it out again, and says what a state_dict without it
  lacks: :meth:`Checkpoints.check_missing`);
* the DDP hook returns it with the rank and the world size, one file per rank
  (:meth:`Checkpoints.rank_state_dict`, :meth:`Checkpoints.load_rank_state_dict`).

Every load is checked first (:meth:`Checkpoints.check_state`: another compressor, format
or collective raises ValueError before anything is changed).
"""
from __future__ import annotations

import warnings
from typing import Any, Dict

from ..compressors import Compressor
from .core import Exchange

__all__ = ["Checkpoints", "FORMAT"]

#: The layout version of :meth:`Checkpoints.state_dict`.
FORMAT = 1


class Checkpoints:
    """The checkpoint methods of :class:`hvdcomp.exchange.driver.Driver` (a mixin: they read
    and set the driver's ``exchange``, ``compression`` and ``step``)."""
    exchange: Exchange
    compression: Compressor
    step: int

    def state_dict(self) -> Dict[str, Any]:
        """Everything to resume bit-exactly: ``format``, ``step``, ``compression`` (the
        spec), ``compressor_state``, ``second_stage_state`` (the reduce-scatter's) and
        ``params_before`` (LAQ's parameters of the last step, between before_step and
        after_step; else None)."""
        ex, comp = self.exchange, self.compression
        before = ex.params_before
        return {"format": FORMAT, "step": self.step, "compression": comp.spec(),
                "compressor_state": comp.state_dict(),
                "second_stage_state": [c.state_dict() for c in ex.second_stages()],
                "params_before": None if before is None else [b.clone() for b in before]}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s result (:meth:`check_state` first)."""
        self.check_state(state)
        ex = self.exchange
        self.compression.load_state_dict(state["compressor_state"])
        for c, st in zip(ex.second_stages(), state.get("second_stage_state", [])):
            c.load_state_dict(st)
        self.step = int(state["step"])
        before = state.get("params_before")
        ex.params_before = None if before is None else [
            b.to(e.param.device, copy=True) for b, e in zip(before, ex.entries.values())]

    def check_state(self, state) -> None:
        """ValueError unless ``state`` is a :meth:`state_dict` this exchange can load (also
        one saved before ``format`` existed): the keys, the compressor, the second stages."""
        if (not isinstance(state, dict)
                or not {"step", "compression", "compressor_state"} <= set(state)):
            raise ValueError(f"an hvdcomp checkpoint must be a dict with 'step', "
                             f"'compression' and 'compressor_state' (as state_dict() saves "
                             f"it), got {state!r:.200}")
        if state.get("format", FORMAT) != FORMAT:
            raise ValueError(f"hvdcomp checkpoint of format {state['format']!r}; this "
                             f"version reads format {FORMAT}")
        if str(state["compression"]).split(":")[0] != self.compression.name:
            raise ValueError(f"checkpoint was saved with compression "
                             f"{state['compression']!r}, this exchange uses "
                             f"{self.compression.spec()!r}")
        saved, stages = state.get("second_stage_state", []), self.exchange.second_stages()
        if len(saved) != len(stages):
            raise ValueError(f"checkpoint holds {len(saved)} second-stage states, this "
                             f"exchange's collective has {len(stages)} (was it saved with "
                             f"another collective?)")

    def split(self, state_dict, key: str, allow_missing: bool):
        """``(the rest, hvdcomp's part)`` of an optimizer's state_dict that nests
        :meth:`state_dict` under ``key``; hvdcomp's part checked (:meth:`check_state`), or
        None where the state_dict has none (:meth:`check_missing` with ``allow_missing``).
        Nothing is loaded: the door loads the rest, then hvdcomp's part."""
        rest = dict(state_dict)
        mine = rest.pop(key, None)
        if mine is None:
            self.check_missing(allow_missing, key)
        else:
            self.check_state(mine)
        return rest, mine

    def check_missing(self, allow: bool, key: str) -> None:
        """Loading a checkpoint without hvdcomp's part (no ``key`` entry: saved by a plain
        torch optimizer or by horovod.torch's DistributedOptimizer): ValueError where the
        compressor keeps state (residuals, levels, momentum, LAQ's aggregates), or with
        ``allow`` a warning that the step and the compressor's state stay as they are
        (pointing at the line that called the door's ``load_state_dict``, through
        :meth:`split`)."""
        comp = self.compression
        if not comp.keeps_state:
            return
        held = ", ".join(repr(k) for k in sorted(comp.state_dict())) or "its state"
        what = (f"the state_dict has no {key!r} entry (it was saved by a plain torch "
                f"optimizer or by horovod.torch's DistributedOptimizer, not by hvdcomp's), "
                f"so it lacks hvdcomp's step and the state of compressor {comp.spec()!r} "
                f"({held}: kept from step to step)")
        rank = self.exchange.rank
        if not allow:
            raise ValueError(f"rank {rank}: {what}. Load the state_dict that this "
                             f"DistributedOptimizer's state_dict() saved, or pass "
                             f"load_state_dict(..., allow_missing_hvdcomp=True) to load it "
                             f"anyway (hvdcomp's step and the compressor's state then stay "
                             f"as they are: empty in a new optimizer)")
        warnings.warn(f"hvdcomp rank {rank}: {what}; hvdcomp's step stays at {self.step} and "
                      f"the compressor's state as it is (allow_missing_hvdcomp=True)",
                      UserWarning, stacklevel=4)

    def rank_state_dict(self) -> Dict[str, Any]:
        """:meth:`state_dict` with this rank and the world size (``rank``, ``world_size``):
        the DDP hook's checkpoint, one file per rank (residuals are per rank)."""
        ex = self.exchange
        return {"rank": ex.rank, "world_size": ex.size, **self.state_dict()}

    def load_rank_state_dict(self, state: Dict[str, Any], label: str) -> None:
        """Restore :meth:`rank_state_dict`'s result.  ValueError for anything else (naming
        ``label``, the door's object), another rank's or world size's checkpoint, or what
        :meth:`check_state` refuses."""
        ex = self.exchange
        if state.get("format") != FORMAT:
            raise ValueError(f"not a {label} checkpoint (format {state.get('format')!r})")
        if (state["rank"], state["world_size"]) != (ex.rank, ex.size):
            raise ValueError(f"checkpoint of rank {state['rank']} of {state['world_size']}, "
                             f"this is rank {ex.rank} of {ex.size}: save and load one "
                             f"checkpoint per rank (residuals are per rank)")
        self.load_state_dict(state)
