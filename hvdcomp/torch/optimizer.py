"""``DistributedOptimizer``: Horovod's drop-in, with compression that sends real bytes.

Wraps any ``torch.optim.Optimizer`` the way horovod.torch does (a subclass of the wrapped
optimizer's class created on the fly), and hands the gradient exchange to
:class:`hvdcomp.torch.exchange.Exchange`.

Training-loop semantics (README, "Training-loop semantics"): the averaged gradients are in
``p.grad`` when ``loss.backward()`` returns, as with PyTorch's DistributedDataParallel.
Each parameter's post-accumulate-grad hook hands its gradient to the exchange as soon as it
is final (so communication overlaps the rest of backward), and a callback that the autograd
engine runs at the end of the backward pass waits for the exchange and writes the averages.
With ``backward_passes_per_step=k`` that happens in the k-th backward pass only.
``synchronize()`` and ``skip_synchronize()`` keep their Horovod meaning and are no-ops once
the gradients are averaged; ``step()`` exchanges whatever was not exchanged yet.
"""
from __future__ import annotations

import contextlib
import itertools
import os
import sys
import threading
import warnings
import weakref
from typing import Dict, Optional

import numpy as np
import torch
from torch.autograd import Variable

from .. import compressors
from ..auto import Auto, from_spec, merge_collective, spec_collective
from ..compressors import Compressor
from ..exchange import momentum
from ..exchange.buckets import agree_settings
from ..transport import HorovodTransport
from ..transport import select as select_transport
from .exchange import Exchange, StepStats

__all__ = ["DistributedOptimizer", "join"]

_STATE_KEY = "hvdcomp"
_FUNCTION_BACKWARD = torch.autograd.function.BackwardCFunction.apply.__code__
_created = itertools.count()
_live: "weakref.WeakValueDictionary[int, _DistributedOptimizer]" = weakref.WeakValueDictionary()


def _as_compressor(compression):
    """(compressor or Auto, the spec string's collective or None)."""
    if isinstance(compression, Auto):
        return compression, None
    if compression is None:
        return from_spec(os.environ.get("HVDCOMP_COMPRESSION") or "none")
    if isinstance(compression, str):
        return from_spec(compression)      # "auto+SPEC": Auto(SPEC); "rs+SPEC": reduce-scatter
    if isinstance(compression, Compressor):
        return compressors.get(compression), None
    # Horovod's own Compression.none / Compression.fp16
    try:
        from horovod.torch.compression import Compression
        if compression is Compression.none:
            return compressors.get("none"), None
        if compression is Compression.fp16:
            return compressors.get("fp16"), None
    except ImportError:
        pass
    raise TypeError(f"compression must be an hvdcomp compressor, a spec string such as "
                    f"'alq:bits=3', or Horovod's Compression.none/fp16; got {compression!r}")


def _raw_collective(collective, compression) -> str:
    """What ``collective=`` and the spec string's 'rs+'/'ag+' ask for together, as the ranks
    compare it (before either is checked): the setting, else the spec's prefix, else
    "default" ("auto" with Auto, else "allgather")."""
    if collective is not None:
        return str(collective)
    return spec_collective(_raw_spec(compression)) or "default"


def _raw_spec(compression) -> str:
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


def _plain(x):
    """A setting as JSON compares it (numbers and bools as themselves, others as repr)."""
    return x if isinstance(x, (bool, int, float, str, type(None))) else repr(x)


def _inside_function_backward() -> bool:
    """Whether the caller runs inside a custom autograd Function's backward: a backward
    pass started there (``checkpoint(use_reentrant=True)``) is nested in another."""
    f = sys._getframe(1)
    while f is not None:
        if f.f_code is _FUNCTION_BACKWARD:
            return True
        f = f.f_back
    return False


class _DistributedOptimizer(torch.optim.Optimizer):
    # Methods of this class are copied into a subclass of the user's optimizer class, so
    # they use super(self.__class__, self) rather than zero-argument super().

    def __init__(self, params, named_parameters, compression, backward_passes_per_step, op,
                 gradient_predivide_factor, sparse_as_dense, transport, fusion_bytes,
                 min_compress_numel, compress_1d, seed, check_replicas, collective,
                 allreduce_summable,
                 hvd):
        super(self.__class__, self).__init__(params)
        self._ident = next(_created)
        all_params = [p for g in self.param_groups for p in g["params"]]
        if named_parameters is not None:
            named = list(named_parameters)
            by_id = {id(p): n for n, p in named}
            missing = [i for i, p in enumerate(all_params) if id(p) not in by_id]
            if missing:
                raise ValueError(f"named_parameters lacks {len(missing)} of the optimizer's "
                                 f"parameters; pass model.named_parameters() of the model "
                                 f"whose parameters the optimizer holds")
            mine = {id(p) for p in all_params}
            named = [(n, p) for n, p in named if id(p) in mine]
        else:
            named = [(f"param.{i}.{j}", p) for i, g in enumerate(self.param_groups)
                     for j, p in enumerate(g["params"])]
        # frozen parameters too: one unfrozen later is exchanged like the others
        named = [(n, p) for n, p in named if p.is_floating_point()]
        # Every setting, agreed over one fixed channel (Horovod's allgather under a fixed
        # name) before anything that depends on them: building the transport is itself
        # collective, so ranks that differ in any setting are reported instead of hanging.
        agree_settings(HorovodTransport(prefix="hvdcomp.agree", numbered=False), {
            "optimizer": type(self).__name__, "optimizer number": self._ident,
            "transport": (transport if isinstance(transport, str) else "auto" if transport is None
                          else type(transport).__name__),
            "collective": _raw_collective(collective, compression),
            "compression": _raw_spec(compression),
            "backward_passes_per_step": _plain(backward_passes_per_step),
            "op": {hvd.Average: "Average", hvd.Sum: "Sum"}.get(op, repr(op)),
            "gradient_predivide_factor": _plain(gradient_predivide_factor),
            "sparse_as_dense": _plain(sparse_as_dense), "fusion_bytes": _plain(fusion_bytes),
            "min_compress_numel": _plain(min_compress_numel),
            "compress_1d": _plain(compress_1d), "seed": _plain(seed),
            "check_replicas": _plain(check_replicas),
            "allreduce_summable": _plain(allreduce_summable),
            "parameters": [[n, list(p.shape), str(p.dtype)] for n, p in named]},
            "the DistributedOptimizer settings")
        compression, spec_collective = _as_compressor(compression)
        collective = merge_collective(collective, spec_collective)
        self._bpps = int(backward_passes_per_step)
        if self._bpps < 1:
            raise ValueError("backward_passes_per_step must be >= 1")
        average = op == hvd.Average
        if op not in (hvd.Average, hvd.Sum):
            raise ValueError("hvdcomp.torch.DistributedOptimizer supports op=Average and "
                             "op=Sum (Adasum cannot combine decoded messages)")
        tp = select_transport(transport, hvd)
        self._exchange = Exchange(named, compression, tp, hvd=hvd, ident=self._ident,
                                  check_replicas=check_replicas,
                                  fusion_bytes=fusion_bytes,
                                  min_compress_numel=min_compress_numel,
                                  compress_1d=compress_1d, seed=seed, average=average,
                                  predivide=gradient_predivide_factor,
                                  sparse_as_dense=sparse_as_dense, collective=collective,
                                  allreduce_summable=allreduce_summable)
        self._compression = self._exchange.compression     # with Auto: Auto's compressor
        self._named = named
        self._corrected = self._momentum_corrected()
        self._hvdcomp_step = 0
        self._passes = 0          # backward passes since the last exchange
        self._fresh = False       # p.grad holds averages that no step() has applied yet
        self._queued = False      # the end-of-backward callback is queued
        self._fired = set()       # hooks fired in this backward pass
        self._readied = set()
        self._should_sync = True
        self._closed = False
        self.last_stats: Optional[StepStats] = None
        self._hooks: Dict[str, object] = {}
        self._hook_trainable()
        _live[self._ident] = self

    # --- DGC: momentum correction and weight decay on the local gradient ---------------
    def _momentum_corrected(self) -> Dict[str, torch.Tensor]:
        """{name: parameter} of the tensors whose compressor applies the SGD momentum itself
        (DGC, Lin et al. 2018, Sec. 3.2): the wrapped SGD never sees their gradients; their
        momentum and weight decay go into the local gradient before compression and the
        averaged update is applied as ``p -= lr * update``.  Empty for other compressors and
        for optimizers other than SGD (those apply their own rule to the average)."""
        return momentum.corrected(self._compression, self._exchange.entries, self)

    def _groups(self) -> Dict[int, dict]:
        return momentum.groups_by_param(self.param_groups)

    def _prepare(self, name: str, p: torch.Tensor, groups: Dict[int, dict]) -> None:
        """DGC's local gradient: weight decay folded in before momentum correction and
        selection, as the paper's reference code does."""
        if name in self._corrected:
            momentum.fold_weight_decay(p, p.grad, groups[id(p)])

    # --- the exchange, driven by backward -----------------------------------------------
    def _hook_trainable(self) -> None:
        for n, p in self._named:
            if n not in self._hooks and p.requires_grad:
                self._hooks[n] = p.register_post_accumulate_grad_hook(self._make_hook(n))

    def _make_hook(self, name):
        def hook(p):
            if not self._queued:
                self._queued = True
                Variable._execution_engine.queue_callback(self._end_of_backward)
            self._fired.add(name)
            if self._passes + 1 < self._bpps:
                return                            # accumulating: exchange in the k-th pass
            if not self._exchange.in_step:
                self._begin()
            if name not in self._readied:
                self._readied.add(name)
                self._prepare(name, p, self._groups())
                self._exchange.ready(name)
        return hook

    def _begin(self, sync: bool = False) -> None:
        if self._corrected:
            # also under the names of the reduce-scatter's pieces of those parameters
            self._exchange.set_momentum(
                momentum.momentum_factors(self._corrected, self._groups()))
        self._readied = set()
        self._exchange.begin(self._hvdcomp_step, sync=sync)

    def _end_of_backward(self) -> None:
        self._queued = False
        if _inside_function_backward() and set(self._hooks) - self._fired:
            # the end of a backward pass nested in another (reentrant checkpointing) while
            # gradients may still come in the outer one: its next hook queues the callback
            # there (if none comes, step() finishes the exchange)
            return
        self._fired = set()
        self._passes += 1
        if self._passes >= self._bpps and self._exchange.in_step:
            self._finish()

    def _finish(self) -> None:
        """Wait for the exchange and write the averages into ``p.grad``."""
        groups = self._groups()
        for n, p in self._corrected.items():
            if n not in self._readied:
                self._prepare(n, p, groups)
        self._passes, self._fresh = 0, False
        results, stats = self._exchange.finish()
        for n, p in self._named:
            avg = results.get(n)
            if avg is None:           # no rank had a gradient: p.grad stays None
                continue
            if avg.is_sparse:
                p.grad = avg
            elif p.grad is None or p.grad.is_sparse:
                p.grad = avg.view(p.shape).to(p.dtype, copy=True)  # buffers are reused
            else:
                p.grad.copy_(avg.view(p.shape))
        self._fresh = True
        self.last_stats = stats
        self._hook_trainable()        # parameters unfrozen since: hooked from now on

    # --- public ---------------------------------------------------------------------------
    @property
    def compression(self) -> Compressor:
        """The compressor (with ``Auto``, its inner compressor)."""
        return self._compression

    def close(self) -> None:
        """Stop the exchange's worker threads and free its buffers (they live as long as the
        threads otherwise, i.e. the process).  Call when done with the optimizer, between
        steps; it cannot step afterwards."""
        for h in self._hooks.values():
            h.remove()
        self._hooks = {}
        self._closed = True
        self._exchange.close()

    @property
    def plan(self) -> Dict[str, str]:
        """{parameter name: name of the compressor its gradient travels with}."""
        return self._exchange.plan.compressor_names()

    @property
    def cost_model(self):
        """With ``compression=hvdcomp.Auto(...)``: the :class:`hvdcomp.CostModel` it measured
        when the optimizer was built (``as_dict()``: link and codec costs, the same on every
        rank); None otherwise."""
        return self._exchange.cost_model

    @property
    def transport(self) -> str:
        """The name of the byte carrier in use ("mpi" or "horovod")."""
        return self._exchange.transport.name

    @property
    def collective(self) -> str:
        """The collective setting in effect: "allgather", "reduce_scatter" or "auto"."""
        return self._exchange.collective_setting

    @property
    def paths(self) -> Dict[str, str]:
        """{parameter name: "allreduce", "allgather" or "reduce_scatter"}."""
        return self._exchange.plan.paths()

    def synchronize(self) -> StepStats:
        """Make sure ``p.grad`` holds the averaged gradients.

        A no-op when backward already averaged them (the usual case); otherwise the
        exchange runs now: after fewer than ``backward_passes_per_step`` backward passes,
        after a backward pass that reached none of the hooked parameters, or when no
        backward ran since the last ``step()`` (then it averages ``p.grad`` as it is).
        Returns the :class:`~hvdcomp.torch.exchange.StepStats` of the last exchange (also
        in ``last_stats``).  Raises WireFormatError if any rank's message is malformed.
        """
        ex = self._exchange
        self._queued, self._fired = False, set()   # never inside a backward pass
        if not ex.in_step:
            if self._fresh and self._passes == 0:
                return self.last_stats
            self._begin(sync=True)
        self._finish()
        return self.last_stats

    @contextlib.contextmanager
    def skip_synchronize(self):
        """Inside, ``step()`` does not synchronize (Horovod's idiom: ``synchronize()``,
        then unscale or clip, then ``step()`` inside this).  With averaging at the end of
        backward it is rarely needed; ``step()`` inside raises RuntimeError when gradients
        of a backward pass were not exchanged yet."""
        self._should_sync = False
        try:
            yield
        finally:
            self._should_sync = True

    def step(self, closure=None):
        """Apply the averaged gradients.  Exchanges first what was not exchanged yet
        (:meth:`synchronize`).  With a ``closure`` (which typically calls ``zero_grad()``
        and ``backward()``), the closure's backward pass averages the gradients before the
        update; an optimizer that calls its closure several times (LBFGS) gets averaged
        gradients every time."""
        if closure is not None and not self._corrected:
            def run():
                loss = closure()
                if self._should_sync:
                    self.synchronize()
                return loss
            return self._update(run)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._should_sync:
            self.synchronize()
        elif self._passes or self._exchange.in_step:
            raise RuntimeError("step() inside skip_synchronize() needs synchronize() first: "
                               "gradients of a backward pass were not exchanged yet")
        self._update(None)
        return loss

    def _update(self, closure):
        ex = self._exchange
        ex.before_step()
        hidden = momentum.hide(self._corrected)
        try:
            loss = super(self.__class__, self).step(closure)
        finally:
            momentum.restore(self._corrected, hidden)
        if hidden:                                # DGC: p -= lr * averaged update
            momentum.apply_hidden(self._corrected, hidden, self._groups())
        ex.after_step(self._hvdcomp_step)      # LAQ's rule, ALQ/AMQ's refit
        self._hvdcomp_step += 1
        self._fresh = False
        return loss

    def zero_grad(self, set_to_none: bool = True):
        if self._exchange.in_step:
            # a backward pass that raised midway: its exchange is finished (the other
            # ranks finished theirs) and dropped
            self._passes = 0
            self._exchange.finish()
        self._passes, self._fresh, self._queued, self._fired = 0, False, False, set()
        return super(self.__class__, self).zero_grad(set_to_none)

    def state_dict(self):
        sd = super(self.__class__, self).state_dict()
        sd[_STATE_KEY] = {"step": self._hvdcomp_step,
                          "compression": self._compression.spec(),
                          "compressor_state": self._compression.state_dict(),
                          "second_stage_state": [c.state_dict()
                                                 for c in self._exchange.second_stages()]}
        return sd

    def load_state_dict(self, state_dict, *, allow_missing_hvdcomp: bool = False):
        """The wrapped optimizer's ``load_state_dict``, plus hvdcomp's part (the key
        ``"hvdcomp"`` that :meth:`state_dict` adds: hvdcomp's step, the compression's spec
        and the compressor's state), restored bit-exactly.

        A state_dict without hvdcomp's part (saved by a plain torch optimizer or by
        horovod.torch's DistributedOptimizer) carries no residuals, levels or step: where
        the compressor keeps state (``compression.keeps_state``: error feedback, ALQ/AMQ,
        DGC, LAQ) loading it raises ValueError on every rank, naming what is missing, unless
        ``allow_missing_hvdcomp`` (then it loads the rest and warns, on every rank, that
        hvdcomp's step and the compressor's state stay as they are).  A stateless
        compressor loads it silently (its step only keys the random streams).
        Raises ValueError for an hvdcomp part saved with another compressor, or malformed.
        """
        state_dict = dict(state_dict)
        mine = state_dict.pop(_STATE_KEY, None)
        if mine is None:
            self._missing_hvdcomp(allow_missing_hvdcomp)
        elif (not isinstance(mine, dict)
              or not {"step", "compression", "compressor_state"} <= set(mine)):
            raise ValueError(f"state_dict[{_STATE_KEY!r}] must be a dict with 'step', "
                             f"'compression' and 'compressor_state' (as state_dict() saves "
                             f"it), got {mine!r:.200}")
        elif str(mine["compression"]).split(":")[0] != self._compression.name:
            raise ValueError(f"checkpoint was saved with compression "
                             f"{mine['compression']!r}, this optimizer uses "
                             f"{self._compression.spec()!r}")
        super(self.__class__, self).load_state_dict(state_dict)
        if mine is not None:
            stages = self._exchange.second_stages()
            saved = mine.get("second_stage_state", [])
            if len(saved) != len(stages):
                raise ValueError(f"checkpoint holds {len(saved)} second-stage states, this "
                                 f"optimizer's collective has {len(stages)} (was it saved "
                                 f"with another collective?)")
            self._compression.load_state_dict(mine["compressor_state"])
            for c, st in zip(stages, saved):
                c.load_state_dict(st)
            self._hvdcomp_step = int(mine["step"])

    def _missing_hvdcomp(self, allow: bool) -> None:
        """load_state_dict of a state_dict without hvdcomp's part: ValueError (or, with
        ``allow``, a warning) where the compressor keeps state."""
        comp = self._compression
        if not comp.keeps_state:
            return
        held = ", ".join(repr(k) for k in sorted(comp.state_dict())) or "its state"
        what = (f"the state_dict has no {_STATE_KEY!r} entry (it was saved by a plain torch "
                f"optimizer or by horovod.torch's DistributedOptimizer, not by hvdcomp's), "
                f"so it lacks hvdcomp's step and the state of compressor {comp.spec()!r} "
                f"({held}: kept from step to step)")
        if not allow:
            raise ValueError(f"rank {self._exchange.rank}: {what}. Load the state_dict that "
                             f"this DistributedOptimizer's state_dict() saved, or pass "
                             f"load_state_dict(..., allow_missing_hvdcomp=True) to load it "
                             f"anyway (hvdcomp's step and the compressor's state then stay "
                             f"as they are: empty in a new optimizer)")
        warnings.warn(f"hvdcomp rank {self._exchange.rank}: {what}; hvdcomp's step stays at "
                      f"{self._hvdcomp_step} and the compressor's state as it is "
                      f"(allow_missing_hvdcomp=True)", UserWarning, stacklevel=3)

    # --- join ------------------------------------------------------------------------------
    def _join_rounds(self) -> int:
        """Take part, contributing nothing, in the other ranks' steps until every rank has
        joined; returns how many steps this rank sat out."""
        ex = self._exchange
        if ex.in_step:
            ex.finish()               # a backward pass that raised midway (as zero_grad)
        self._passes, self._fresh = 0, False
        rounds = 0
        while ex.buckets:
            ex.begin(self._hvdcomp_step, joined=True)
            _, stats = ex.finish()
            if stats.joined == ex.size:
                break
            ex.before_step()
            ex.after_step(self._hvdcomp_step)  # the others' refits (ALQ/AMQ) need this rank
            self._hvdcomp_step += 1
            rounds += 1
        return rounds


def join(device: int = -1) -> int:
    """``hvd.join()`` for hvdcomp: call it on a rank that has run out of data, and on every
    rank once it is done.  Until every rank has joined, this rank takes part in the other
    ranks' steps of every open hvdcomp DistributedOptimizer, each in a thread of its own,
    contributing no gradients: their averages count only the ranks that have not joined
    (as Horovod's join does).  Returns the highest rank among those that joined last.

    Without open hvdcomp optimizers it is horovod.torch.join(device).  While some rank
    waits here, the other ranks may only step their hvdcomp optimizers (a Horovod
    collective of their own, e.g. ``hvd.allreduce`` of a metric, waits for the joined
    ranks).  Compressors whose receivers keep per-rank state or need every rank's message
    (LAQ, NDQSG) raise ValueError on every rank in the first step a rank sits out; the
    optimizers' exceptions are re-raised here.
    """
    opts = [o for _, o in sorted(_live.items()) if not o._closed]
    if not opts:
        import horovod.torch as hvd
        return hvd.join(device)
    rounds: Dict[int, int] = {}
    errors = []

    def run(i, opt):
        try:
            rounds[i] = opt._join_rounds()
        except BaseException as e:     # noqa: BLE001 - re-raised below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i, o), name=f"hvdcomp-join-{i}")
               for i, o in enumerate(opts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    ex = opts[0]._exchange
    last = np.zeros(ex.size)
    last[ex.rank] = 1.0 if rounds[0] == 0 else 0.0
    return int(np.flatnonzero(ex.transport.allreduce_sum(last))[-1])


def DistributedOptimizer(optimizer, named_parameters=None, compression=None,
                         backward_passes_per_step=1, op=None, gradient_predivide_factor=1.0,
                         num_groups=0, groups=None, sparse_as_dense=False, process_set=None,
                         *, transport=None, fusion_bytes=25 * 2**20, min_compress_numel=1024,
                         compress_1d=False, seed=0, check_replicas=True,
                         collective=None, allreduce_summable=True):
    """Wrap ``optimizer`` so that ``p.grad`` holds gradients averaged across ranks, sent with
    ``compression`` as real encoded bytes, when ``loss.backward()`` returns (README,
    "Training-loop semantics").

    Same signature as ``horovod.torch.DistributedOptimizer``, plus keyword-only settings:

    compression: an hvdcomp compressor, a spec string ("alq:bits=3,bucket_size=8192"),
        Horovod's Compression.none/fp16, None (then $HVDCOMP_COMPRESSION, else "none"), or
        ``hvdcomp.Auto(compressor)`` (spec "auto+alq:bits=3"): per tensor, fp32, fp16 or the
        compressor (over each allowed collective), whichever the cost model measured at
        construction says is fastest (``optimizer.plan``, ``optimizer.paths``).  A spec
        string may name the collective: "rs+alq:bits=3" (reduce-scatter), "ag+..."
        (allgather), after "auto+" if any.
    collective: "allgather" (every rank's messages to every rank), "reduce_scatter"
        (shards averaged by their owners, re-encoded at 2 more bits for the quantizers and
        allgathered: about 2(N-1)/N of a compressed gradient per rank instead of N-1;
        hvdcomp.exchange.scatter) or "auto"
        (per tensor, by the cost model); None: the spec string's, else "auto" with Auto and
        "allgather" otherwise.  ConfigError when it contradicts the spec string, on one rank
        with "reduce_scatter", or for NDQSG and LAQ with "reduce_scatter" (they cannot work
        on shards; "auto" never picks it for them).
    backward_passes_per_step: the gradients of k backward passes are summed locally and
        exchanged in the k-th.
    op: hvd.Average (default) or hvd.Sum.  gradient_predivide_factor: as in Horovod.
    sparse_as_dense: densify sparse gradients (``nn.Embedding(sparse=True)``) before the
        exchange (``p.grad`` becomes dense); otherwise they travel uncompressed as every
        rank's indices and values and ``p.grad`` is a sparse average (as in Horovod).
    num_groups, groups: not used (hvdcomp fuses by ``fusion_bytes``); must be left default.
    process_set: only the global process set is supported.
    transport: the carrier of the wire messages, with identical results either way:
        None or "auto" (default) picks "mpi" when MPI's world is Horovod's, rank for rank
        (mpirun, horovodrun's MPI controller), else "horovod" (horovodrun --gloo; no
        mpi4py); "mpi" (mpi4py Allgatherv; RuntimeError at construction when MPI's world
        is not Horovod's); "horovod" (hvd.allgather); or a
        :class:`hvdcomp.transport.Transport`.  ``optimizer.transport`` names the one used
        (also logged at INFO on rank 0: :mod:`hvdcomp.log`).
    fusion_bytes: gradient bytes per fusion bucket (default 25 MiB).
    min_compress_numel, compress_1d: tensors with fewer elements, and 1-D tensors unless
        compress_1d, are sent uncompressed (fp32).
    seed: shared seed of the Philox streams (must be equal on every rank; checked).
    check_replicas: at the first step, compare a digest of the parameters' values across
        ranks and raise on every rank if they differ (forgotten
        ``hvd.broadcast_parameters``); False when they differ on purpose.
    allreduce_summable: summable tensors (``none``, ``fp16``, ``bf16``) through Horovod's
        allreduce (default); False: as wire messages decoded in rank order like the others
        (every average then bit-identical to the DDP hook's with the same setting).

    Raises ValueError / TypeError for invalid settings, :class:`hvdcomp.Mismatch` (a
    RuntimeError) on every rank if the ranks disagree on the model or any setting (each
    difference named), or at the first step on the parameters' values;
    :class:`hvdcomp.OutOfStep` on every rank when ranks exchange different steps (a rank that
    skipped step() or called it twice); :class:`hvdcomp.RankFailure` naming a rank that
    failed (README, "Failures").  After each step, ``optimizer.last_stats`` holds the bytes sent.
    """
    import horovod.torch as hvd
    if not hvd.is_initialized():
        raise RuntimeError("call hvd.init() before creating the DistributedOptimizer")
    if op is None:
        op = hvd.Average
    if num_groups or groups is not None:
        raise ValueError("hvdcomp fuses tensors into buckets of fusion_bytes; num_groups and "
                         "groups are not supported")
    if process_set is not None and process_set is not hvd.global_process_set:
        raise ValueError("hvdcomp supports only the global process set")
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,),
               dict(_DistributedOptimizer.__dict__))
    return cls(optimizer.param_groups, named_parameters, compression,
               backward_passes_per_step, op, gradient_predivide_factor, sparse_as_dense,
               transport, fusion_bytes, min_compress_numel, compress_1d, seed, check_replicas,
               collective, allreduce_summable, hvd)
