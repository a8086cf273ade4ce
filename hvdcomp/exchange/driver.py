"""The lifecycle that both doors share: settings, the exchange, the step, checkpoints, DGC.

The drop-in optimizer (:mod:`hvdcomp.torch`) and the DDP communication hook
(:mod:`hvdcomp.ddp`) differ only in how gradients reach the exchange (autograd hooks and
the end-of-backward callback; DDP's GradBucket and Future).  Everything else is here:

* :class:`Settings`: every setting both doors take, validated once, and the record the
  ranks agree on (one handshake per construction; a door adds its own entries to it);
* :func:`resolve`: what ``compression=`` means (a spec string, a compressor, an Auto, or
  None for $HVDCOMP_COMPRESSION);
* :class:`Driver`: the :class:`~hvdcomp.exchange.Exchange`, the step counter, the last
  step's statistics, one checkpoint format (:mod:`~hvdcomp.exchange.checkpoint`) and
  DGC's momentum rules (:mod:`~hvdcomp.exchange.momentum`), which both doors call the
  same way;
* :class:`Reports`: what both doors show of it (``last_stats``, ``plan``, ...).

The doors build the carriers (Horovod's or torch.distributed's) and hand them in: this
module imports neither.
"""
from __future__ import annotations

import numbers
import os
from dataclasses import dataclass, fields
from typing import Any, Dict, Optional, Sequence, Set, Tuple

import torch

from ..auto import Auto, from_spec, merge_collective, spec_collective
from ..compressors import Compressor, prefixes
from ..errors import ConfigError
from ..transport import Allreduce, Transport
from . import momentum
from .buckets import agree_settings
from .checkpoint import Checkpoints
from .core import Exchange
from .step_stats import StepStats

__all__ = ["Settings", "Driver", "Reports", "resolve"]


#: The spec string's hierarchy prefixes ("host+alq:bits=3"), before everything else.
HIERARCHY_PREFIXES = prefixes.HIERARCHY


def split_hierarchy(spec: str) -> Tuple[Optional[str], str]:
    """``(hierarchy named by the spec string's prefix or None, the rest)``: "host+" (the
    hierarchical exchange: :mod:`hvdcomp.exchange.hier`) or "flat+", before any other
    prefix.  Never raises."""
    s = str(spec).strip()
    for prefix, name in HIERARCHY_PREFIXES.items():
        if s.lower().startswith(prefix):
            return name, s[len(prefix):]
    return None, s


def merge_hierarchy(given: Optional[str], compression) -> str:
    """The hierarchy of an exchange from the setting (``given``, None: unset) and the
    ``compression`` setting's spec prefix ("host+", "flat+"): either, else "auto".
    ConfigError when both are given and differ."""
    raw = compression if isinstance(compression, str) else (
        os.environ.get("HVDCOMP_COMPRESSION") or "none" if compression is None else "")
    from_spec, _ = split_hierarchy(raw)
    if given is not None and from_spec is not None and given != from_spec:
        raise ConfigError(f"hierarchy={given!r} contradicts the spec string's {from_spec!r} "
                          f"('host+' / 'flat+'); give one of them")
    return given if given is not None else from_spec or "auto"


def resolve(compression) -> Tuple[Any, Optional[str]]:
    """``(compressor or Auto, collective named by the spec string or None)`` of what users
    pass as ``compression=``: a spec string (``"[host+|flat+][auto+][rs+|ag+]SPEC"``: the
    hierarchy prefix is read by :func:`merge_hierarchy`), a
    :class:`~hvdcomp.compressors.Compressor`, an :class:`~hvdcomp.Auto`, or None
    ($HVDCOMP_COMPRESSION, else ``"none"``).  ConfigError for a bad spec, TypeError for
    anything else."""
    if compression is None:
        compression = os.environ.get("HVDCOMP_COMPRESSION") or "none"
    if isinstance(compression, str):
        return from_spec(split_hierarchy(compression)[1], whole=compression)
    if isinstance(compression, (Auto, Compressor)):
        return compression, None
    raise TypeError(f"compression must be an hvdcomp compressor, an hvdcomp.Auto or a spec "
                    f"string such as 'alq:bits=3' (hvdcomp.torch also takes Horovod's "
                    f"Compression.none/fp16); got {compression!r}")


def raw_spec(compression) -> str:
    """What ``compression=`` asks for, as the ranks compare it (before it is parsed)."""
    if compression is None:
        return os.environ.get("HVDCOMP_COMPRESSION") or "none"
    if isinstance(compression, str):
        return compression
    spec = getattr(compression, "spec", None)
    if callable(spec):
        try:
            return str(spec())
        except Exception:                   # noqa: BLE001 - compared as its repr
            pass
    return getattr(compression, "__name__", None) or type(compression).__name__


def plain(x):
    """A setting as JSON compares it (numbers and bools as themselves, others as repr)."""
    return x if isinstance(x, (bool, int, float, str, type(None))) else repr(x)


def _integer(name: str, x, low: int) -> None:
    if isinstance(x, bool) or not isinstance(x, numbers.Integral):
        raise TypeError(f"{name} must be an integer; got {x!r}")
    if x < low:
        raise ValueError(f"{name} must be >= {low}")


@dataclass(frozen=True)
class Settings:
    """Every setting the two doors share (the drop-in optimizer's keywords and the DDP
    hook's), with the same meaning in both.

    compression: an hvdcomp compressor, a spec string ("alq:bits=3,bucket_size=8192"),
      ``hvdcomp.Auto(compressor)`` (spec "auto+alq:bits=3": per tensor, fp32, fp16 or the
      compressor, over each allowed collective, whichever the cost model measured at
      construction says is fastest) or None ($HVDCOMP_COMPRESSION, else "none").  A spec
      string may name the collective: "rs+alq:bits=3" (reduce-scatter), "ag+..."
      (allgather), after "auto+" if any.  A typo raises ConfigError listing the valid
      settings (:func:`resolve`).
    collective: "allgather" (every rank's messages to every rank), "reduce_scatter"
      (shards averaged by their owners, re-encoded at 2 more bits for the quantizers and
      allgathered: about 2(N-1)/N of a compressed gradient per rank instead of N-1;
      :mod:`hvdcomp.exchange.scatter`) or "auto" (per tensor, by the cost model); None: the
      spec string's, else "auto" with Auto and "allgather" otherwise.  ConfigError when it
      contradicts the spec string, on one rank with "reduce_scatter", or for a compressor
      that cannot work on shards.  The DDP hook uses "allgather".
    hierarchy: "auto" (default), "flat" or "host": with several ranks per host (the
      launcher says which: :mod:`hvdcomp.transport.topology`), the compressed tensors are
      summed in float32 inside each host and compressed only across hosts
      (:mod:`hvdcomp.exchange.hier`); "auto" does so where every host has the same number
      (more than one) of ranks and there is more than one host, else stays flat and logs
      why; "host" raises ConfigError on every rank where it cannot; "flat": every rank a
      host of its own.  A spec string may name it: "host+alq:bits=3", "flat+...".  None:
      the spec string's, else "auto".
    seed: the shared seed of the Philox streams (an integer, equal on every rank: checked).
    min_compress_numel (>= 0), compress_1d: tensors with fewer elements, and 1-D tensors
      unless compress_1d, travel uncompressed.
    allreduce_summable: summable tensors (``none``, ``fp16``, ``bf16``) through the
      allreduce carrier (Horovod's allreduce, torch.distributed's all_reduce; default);
      False: as wire messages decoded in rank order like the others (every average then
      bit-identical between the two doors).
    check_replicas: at the first step, compare a digest of the parameters' values across
      ranks and raise :class:`hvdcomp.Mismatch` on every rank if they differ (a forgotten
      ``hvd.broadcast_parameters``); False when they differ on purpose.
    fusion_bytes: gradient bytes per fusion bucket (>= 1; default 25 MiB); None where the
      door forms its own buckets (DDP).
    average: False for a sum (Horovod's op=Sum); predivide: Horovod's
      gradient_predivide_factor (> 0).
    sparse_as_dense: densify sparse gradients (``nn.Embedding(sparse=True)``) before the
      exchange; otherwise they travel uncompressed as every rank's indices and values and
      the average is sparse (as in Horovod).

    Raises TypeError / ValueError for an invalid value, at construction (values are kept
    as given, so :meth:`record` is what the user passed).
    """
    compression: Any = None
    collective: Optional[str] = None
    seed: int = 0
    min_compress_numel: int = 1024
    compress_1d: bool = False
    allreduce_summable: bool = True
    check_replicas: bool = True
    fusion_bytes: Optional[int] = 25 * 2**20
    average: bool = True
    predivide: float = 1.0
    sparse_as_dense: bool = False
    hierarchy: Optional[str] = None

    def __post_init__(self):
        _integer("seed", self.seed, -2**63)
        _integer("min_compress_numel", self.min_compress_numel, 0)
        if self.fusion_bytes is not None:
            _integer("fusion_bytes", self.fusion_bytes, 1)
        if self.collective is not None and not isinstance(self.collective, str):
            raise TypeError(f"collective must be a string or None; got {self.collective!r}")
        if self.hierarchy is not None and not isinstance(self.hierarchy, str):
            raise TypeError(f"hierarchy must be a string or None; got {self.hierarchy!r}")
        if (isinstance(self.predivide, bool) or not isinstance(self.predivide, numbers.Real)
                or not 0 < float(self.predivide) < float("inf")):
            raise ValueError(f"gradient_predivide_factor must be a finite number > 0; got "
                             f"{self.predivide!r}")

    def record(self) -> Dict[str, Any]:
        """The settings as the ranks compare them (JSON values; Horovod's names): the
        compression as given (before it is parsed) and the collective as asked for
        (the setting, else the spec string's prefix, else "default")."""
        rec = {f.name: plain(getattr(self, f.name)) for f in fields(self)}
        rec["compression"] = raw_spec(self.compression)
        rec["collective"] = (str(self.collective) if self.collective is not None
                             else spec_collective(split_hierarchy(rec["compression"])[1])
                             or "default")
        rec["gradient_predivide_factor"] = rec.pop("predivide")
        rec["hierarchy"] = (str(self.hierarchy) if self.hierarchy is not None
                            else split_hierarchy(rec["compression"])[0] or "default")
        return rec

    def agree(self, channel: Transport, what: str, **extras) -> None:
        """Every rank's :meth:`record` with the door's ``extras`` (its own settings, the
        parameters' names, shapes and dtypes) compared over ``channel``, one collective:
        :class:`~hvdcomp.errors.Mismatch` on every rank, naming each difference."""
        agree_settings(channel, {**self.record(), **extras}, what)


class Driver(Checkpoints):
    """One exchange and the lifecycle around it, for a door.

    named: [(name, parameter)] in registration order; settings: the agreed
    :class:`Settings`; transport, allreduce: the carriers the door built (``allreduce``
    used only with ``settings.allreduce_summable``); ident: the exchange's number (the same
    on every rank).  Builds the :class:`~hvdcomp.exchange.Exchange` (collective; the
    settings are not compared again).  ConfigError when the collective setting contradicts
    the spec string.

    owns_carriers: the door built the carriers for this exchange alone, so :meth:`close`
    frees them (their ``free()``: MPI communicators, process groups).

    ``step``: the step of the next exchange (the messages' headers and Philox keys);
    ``last_stats``: the last step's :class:`StepStats`; checkpoints:
    :class:`~hvdcomp.exchange.checkpoint.Checkpoints` (``state_dict``, ...).
    """

    def __init__(self, named: Sequence[Tuple[str, torch.Tensor]], settings: Settings,
                 transport: Transport, allreduce: Optional[Allreduce] = None, *,
                 ident: int = 0, owns_carriers: bool = False):
        compression, from_prefix = resolve(settings.compression)
        s = settings
        self.settings = s
        self.exchange = Exchange(
            named, compression, transport,
            allreduce=allreduce if s.allreduce_summable else None,
            fusion_bytes=s.fusion_bytes, min_compress_numel=s.min_compress_numel,
            compress_1d=s.compress_1d, seed=s.seed, average=s.average, predivide=s.predivide,
            sparse_as_dense=s.sparse_as_dense, ident=ident, check_replicas=s.check_replicas,
            collective=merge_collective(s.collective, from_prefix), agreed=True,
            hierarchy=merge_hierarchy(s.hierarchy, s.compression))
        self.step = 0
        self.last_stats: Optional[StepStats] = None
        self.step_stats = StepStats()
        self.momentum = momentum.Correction(self.exchange)   # DGC's rules
        self._readied: Set[str] = set()     # names handed to ready() in this step
        self._owned = (transport, allreduce) if owns_carriers else ()

    @property
    def compression(self) -> Compressor:
        """The compressor (with Auto, Auto's compressor)."""
        return self.exchange.compression

    # --- the step -----------------------------------------------------------------------
    def begin(self, sync: bool = False) -> None:
        """Start the exchange of step :attr:`step` over the fusion buckets (begin / ready /
        finish), the momentum factors set first."""
        self._readied = set()
        self.momentum.set_momentum()
        self.exchange.begin(self.step, sync=sync)

    def ready(self, name: str, p: torch.Tensor) -> None:
        """``p.grad`` (parameter ``name``) is final for this step: DGC's weight decay folded
        into it, then handed to the exchange (:meth:`Exchange.ready`); once per step."""
        if name not in self._readied:
            self._readied.add(name)
            self.momentum.fold_weight_decay(name, p, p.grad)
            self.exchange.ready(name)

    def finish(self) -> Dict[str, torch.Tensor]:
        """Wait for the exchange: {name: average} (:meth:`Exchange.finish`, which sends
        what was not :meth:`ready`, DGC's weight decay folded into it first); the step's
        statistics in :attr:`last_stats`."""
        for n, p in self.momentum.corrected.items():
            if n not in self._readied:
                self.momentum.fold_weight_decay(n, p, p.grad)
        results, self.last_stats = self.exchange.finish()
        return results

    def drop(self) -> None:
        """Finish an exchange left open (a backward pass that raised midway, an object
        replaced mid-step: the other ranks finish theirs) and drop its averages."""
        if self.exchange.in_step:
            self.exchange.finish()

    def close(self) -> None:
        """Stop the exchange's threads and free its buffers (they live as long as the
        threads otherwise), then the carriers it owns (``owns_carriers``).  Between steps;
        the exchange cannot be used afterwards."""
        self.exchange.close()
        for carrier in self._owned:
            free = getattr(carrier, "free", None)
            if free is not None:
                free()

    def update(self, step_fn=None):
        """The parameter update of step :attr:`step`: ``before_step``, ``step_fn()`` (the
        optimizer's step) with the corrected tensors' gradients hidden and then
        ``p -= lr * average`` for them, ``after_step`` (LAQ's rule, ALQ/AMQ's refit) and
        the step counted.  Returns what ``step_fn`` returns."""
        ex = self.exchange
        ex.before_step()
        hidden = self.momentum.hide()
        try:
            out = step_fn() if step_fn is not None else None
        except BaseException:
            self.momentum.unhide(hidden, apply=False)
            raise
        self.momentum.unhide(hidden)
        ex.after_step(self.step)
        self.step += 1
        return out

    def begin_calls(self, joined: bool = False) -> None:
        """Start a step of :meth:`Exchange.call` s (the DDP hook's buckets): ``joined``
        (this rank takes part with no gradients), the momentum factors, the parameter
        change since the last step (LAQ) and the parameters copied for the next one.
        :attr:`step_stats` collects the calls' statistics (:meth:`call_done`)."""
        ex = self.exchange
        if self.step > 0:
            # a per-layer Auto's plan, from the first step's calls
            ex.settle_plan(self.step - 1)
        self.step_stats = StepStats(step=self.step)
        ex.set_joined(joined)
        self.momentum.set_momentum()
        ex.report_param_deltas(self.step - 1)
        ex.before_step()

    def call_done(self, stats: StepStats, last: bool, step: int) -> None:
        """A call of step ``step`` is over (on the decode thread): its statistics merged;
        after the step's last call, ALQ/AMQ's refit (collective; what it raises is raised
        here, after :attr:`last_stats` is set)."""
        self.step_stats.merge(stats)
        if last:
            try:
                self.exchange.refit_levels(step)
            finally:
                self.last_stats = self.step_stats

    def sit_out(self) -> int:
        """``hvd.join()`` on this rank: take part, contributing nothing, in the other ranks'
        steps (their after-step collectives too: ALQ/AMQ's refit) until a step shows every
        rank joined; returns how many steps this rank sat out.  A step left open by a
        backward pass that raised midway is finished first."""
        ex = self.exchange
        self.drop()
        rounds = 0
        while ex.buckets:
            ex.begin(self.step, joined=True)
            _, stats = ex.finish()
            if stats.joined == ex.size:
                break
            ex.before_step()
            ex.after_step(self.step)
            self.step += 1
            rounds += 1
        return rounds


class Reports:
    """What a door shows of its exchange (both doors).

    ``self._driver`` is the :class:`Driver`, or None where the door builds it later (the
    DDP hook before its set-up, and after close): then ``last_stats`` is None,
    ``compression`` the one ``self._settings`` (the door's :class:`Settings`) names, and
    the other properties build the driver first (:meth:`_built`).
    """
    _driver: Optional[Driver]
    _settings: Settings

    def _built(self) -> Driver:
        """The driver; a door that builds it on first use builds it here."""
        return self._driver

    @property
    def compression(self) -> Compressor:
        """The compressor (with ``Auto``, its inner compressor)."""
        if self._driver is not None:
            return self._driver.compression
        comp, _ = resolve(self._settings.compression)
        return comp.compressor if isinstance(comp, Auto) else comp

    @property
    def last_stats(self) -> Optional[StepStats]:
        """The last step's :class:`~hvdcomp.exchange.StepStats` (bytes sent, ratio, tensors
        made NaN, timings), complete once its averages are in place (None before the first
        step)."""
        return self._driver.last_stats if self._driver is not None else None

    @property
    def plan(self) -> Dict[str, str]:
        """{parameter name: name of the compressor its gradient travels with}."""
        return self._built().exchange.plan.compressor_names()

    @property
    def specs(self) -> Dict[str, str]:
        """{parameter name: spec of the compressor its gradient travels with} (with a
        per-layer Auto: each tensor's choice, bits, density or rank included)."""
        return self._built().exchange.plan.compressor_specs()

    @property
    def paths(self) -> Dict[str, str]:
        """{parameter name: "allreduce", "allgather", "reduce_scatter" or "rounds" (summed by
        allreduces in rounds: PowerSGD)}."""
        return self._built().exchange.plan.paths()

    @property
    def cost_model(self):
        """With ``compression=hvdcomp.Auto(...)``: the :class:`hvdcomp.CostModel` it measured
        when the exchange was built (``as_dict()``: link and codec costs, the same on every
        rank); None otherwise."""
        return self._built().exchange.cost_model

    @property
    def hierarchy_choice(self):
        """With ``compression=hvdcomp.Auto(...)`` and ``hierarchy="auto"`` on several hosts
        of several ranks: Auto's flat-or-hierarchical decision
        (:class:`hvdcomp.exchange.hier_choice.HierChoice`: ``hierarchical``, ``reason``,
        the predicted seconds each way, the measured host and cross-host links; the same
        on every rank); None otherwise."""
        return self._built().exchange.hierarchy_choice

    @property
    def transport(self) -> str:
        """The name of the byte carrier in use ("mpi", "horovod" or "torch")."""
        return self._built().exchange.transport.name

    @property
    def collective(self) -> str:
        """The collective setting in effect: "allgather", "reduce_scatter" or "auto"."""
        return self._built().exchange.collective_setting
