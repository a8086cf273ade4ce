"""The one checkpoint format of both doors: what an exchange remembers from step to step.

:meth:`Checkpoints.state_dict` holds everything needed to resume bit-exactly (the step,
the compressor's state, the reduce-scatter's second stages, LAQ's parameters of the last
step) under a ``format`` number.  The doors store it as their kind of checkpoint wants:

* the drop-in optimizer nests it in the wrapped optimizer's state_dict under one key
  (:meth:`Checkpoints.split` takes it out again, and says what a state_dict without it
  lacks: :meth:`Checkpoints.check_missing`);
* the DDP hook returns it as it is, one file per rank (:meth:`Checkpoints.rank_state_dict`,
  :meth:`Checkpoints.load_rank_state_dict`: another rank's checkpoint of this world size
  is refused).

It records the rank and world size that saved it: loaded into a world of another size (an
elastic restart), the state every rank shares carries over and the per-rank state is
reset (:meth:`Checkpoints.load_state_dict`).

Every load is checked first (:meth:`Checkpoints.check_state`: another compressor, format
or collective raises ValueError before anything is changed).
"""
from __future__ import annotations

import warnings
from typing import Any, Dict, Optional, Tuple

from ..compressors import Compressor
from ..log import warn_limited
from .core import Exchange, rebuild_flat

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
        """Everything to resume bit-exactly: ``format``, ``rank`` and ``world_size`` (of
        the rank that saved it), ``step``, ``compression`` (the spec), ``compressor_state``,
        ``second_stage_state`` (the reduce-scatter's) and ``params_before`` (LAQ's
        parameters of the last step, between before_step and after_step; else None); for a
        hierarchical exchange also ``hierarchy`` (:meth:`hierarchy_record`: the state is
        that of this rank's pieces); with a per-layer Auto ``layer_plan`` (its budget, plan
        and candidates' states: :meth:`~.layer_plan.LayerPlanner.state_dict`)."""
        ex, comp = self.exchange, self.compression
        before = ex.params_before
        out = {"format": FORMAT, "rank": ex.rank, "world_size": ex.size,
               "step": self.step, "compression": comp.spec(),
               "compressor_state": comp.state_dict(),
               "second_stage_state": [c.state_dict() for c in ex.second_stages()],
               "params_before": None if before is None else [b.clone() for b in before]}
        if ex.hierarchy is not None:
            out["hierarchy"] = self.hierarchy_record()
        if ex.layer is not None:
            out["layer_plan"] = ex.layer.state_dict()
        return out

    def hierarchy_record(self) -> Optional[list]:
        """[hosts, ranks per host, this rank's local rank] of a hierarchical exchange (whose
        compressor state belongs to the pieces this rank owns), None for a flat one."""
        h = self.exchange.hierarchy
        return None if h is None else [h[1].size, h[0].size, h[0].rank]

    def load_state_dict(self, state: Dict[str, Any], own_rank: bool = False) -> None:
        """Restore :meth:`state_dict`'s result (:meth:`check_state` first), bit-exactly when
        it was saved at this world size.

        Saved at another world size (an elastic job that restarted larger or smaller; any
        rank's checkpoint will do): the step, the parameters of the last step and the state
        every rank shares (``Compressor.shared_state``: fitted levels, PowerSGD's Q) carry
        over; the state each rank owns (error-feedback residuals, DGC's momentum and
        accumulation, LAQ's records, the reduce-scatter's second stage) is reset, as at the
        first step, and a warning names it.  The effect on convergence is that of a fresh
        start of that state: the gradient mass a residual still held is dropped (at most one
        step's worth for error feedback; DGC's momentum restarts from zero), and LAQ's next
        step uploads every tensor.  ``own_rank``: ValueError for a checkpoint another rank
        of a world of this size saved (the DDP hook: residuals are per rank)."""
        self.check_state(state)
        ex = self.exchange
        size = state.get("world_size", ex.size)    # (older checkpoints say none: this one)
        if own_rank and size == ex.size and state.get("rank", ex.rank) != ex.rank:
            raise ValueError(f"checkpoint of rank {state['rank']} of {size}, this is rank "
                             f"{ex.rank} of {ex.size}: save and load one checkpoint per rank "
                             f"(residuals are per rank)")
        comp_state, stage_states = state["compressor_state"], state.get("second_stage_state", [])
        if size != ex.size:
            comp_state, dropped = _shared(self.compression, comp_state)
            stages = [_shared(c, st) for c, st in zip(ex.second_stages(), stage_states)]
            stage_states = [st for st, _ in stages]
            dropped += ["the second stage's " + k for _, ks in stages for k in ks]
            if dropped:
                warn_limited(f"hvdcomp rank {ex.rank}: checkpoint of world size {size} loaded "
                             f"into a world of {ex.size}: per-rank state reset "
                             f"({self.compression.name}: {', '.join(dropped)}); shared state "
                             f"kept ({', '.join(self.compression.shared_state) or 'none'})")
        self.compression.load_state_dict(comp_state)
        layer = state.get("layer_plan")
        if layer is not None:
            if size != ex.size:          # the candidates' per-rank state is reset too
                layer = dict(layer, states={s: _shared(ex.layer.by_spec[s], st)[0]
                                            for s, st in layer["states"].items()
                                            if s in ex.layer.by_spec})
            ex.layer.load_state_dict(layer)
            ex.layer.adopt(ex.plan)
            rebuild_flat(ex)
        for c, st in zip(ex.second_stages(), stage_states):
            c.load_state_dict(st)
        self.step = int(state["step"])
        before = state.get("params_before")
        ex.params_before = None if before is None else [
            b.to(e.param.device, copy=True) for b, e in zip(before, ex.entries.values())]

    def load_shared(self, state: Dict[str, Any]) -> None:
        """From ``state`` (another rank's :meth:`state_dict`, e.g. rank 0's broadcast after an
        elastic reset), the step and the state every rank shares (``Compressor.shared_state``:
        fitted levels, PowerSGD's Q; a per-layer Auto's plan and budget); this rank's
        per-rank state (residuals, DGC's momentum, the second stage's, the per-layer
        candidates') stays as it is.  :meth:`check_state` first (ValueError)."""
        self.check_state(state)
        own = self.state_dict()
        comp = dict(own["compressor_state"])
        comp.update(_shared(self.compression, state["compressor_state"])[0])
        shared = dict(own, step=state["step"], compressor_state=comp)
        theirs = state.get("layer_plan")
        if theirs is not None and own.get("layer_plan") is not None:
            shared["layer_plan"] = dict(own["layer_plan"], **{
                k: theirs[k] for k in ("plan", "budget", "reference")})
        self.load_state_dict(shared)

    def check_state(self, state) -> None:
        """ValueError unless ``state`` is a :meth:`state_dict` this exchange can load (also
        one saved before ``format`` existed): the keys, the compressor, the hierarchy (at
        this world size), the second stages."""
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
        mine, theirs = self.hierarchy_record(), state.get("hierarchy")
        resized = state.get("world_size", self.exchange.size) != self.exchange.size
        # (at another world size the per-rank state is reset: load_state_dict)
        if mine != theirs and self.compression.keeps_state and not resized:
            def say(h):
                return ("a flat exchange" if h is None else
                        f"{h[0]} hosts x {h[1]} ranks, local rank {h[2]}")
            raise ValueError(f"checkpoint was saved by {say(theirs)}, this exchange is "
                             f"{say(mine)}: the compressor's state belongs to the pieces a "
                             f"rank owns (hierarchy=, docs/settings.md), so it cannot be "
                             f"carried over")
        if state.get("layer_plan") is not None and self.exchange.layer is None:
            raise ValueError("checkpoint was saved with a per-layer Auto (Auto(per_layer="
                             "True)), this exchange has none: its plan cannot be kept")
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
        """:meth:`state_dict` (which holds this rank and the world size): the DDP hook's
        checkpoint, one file per rank (residuals are per rank)."""
        return self.state_dict()

    def load_rank_state_dict(self, state: Dict[str, Any], label: str) -> None:
        """Restore :meth:`rank_state_dict`'s result.  ValueError for anything else (naming
        ``label``, the door's object), another rank's checkpoint of a world of this size, or
        what :meth:`check_state` refuses; another world size's: :meth:`load_state_dict`."""
        if not isinstance(state, dict) or state.get("format") != FORMAT:
            got = state.get("format") if isinstance(state, dict) else type(state).__name__
            raise ValueError(f"not a {label} checkpoint (format {got!r})")
        self.load_state_dict(state, own_rank=True)


def _shared(comp: Compressor, state: Dict[str, Any]) -> Tuple[Dict[str, Any], list]:
    """(the part of a compressor's ``state`` that every rank shares, the keys left out)."""
    keep = set(comp.shared_state)
    return ({k: v for k, v in state.items() if k in keep},
            sorted(k for k, v in state.items() if k not in keep and v))
