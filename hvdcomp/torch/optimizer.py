"""The drop-in optimizer's wiring (:func:`hvdcomp.torch.DistributedOptimizer` builds it).

Wraps any ``torch.optim.Optimizer`` the way horovod.torch does (a subclass of the wrapped
optimizer's class created on the fly, :func:`make`), and hands the gradient exchange to
:class:`hvdcomp.exchange.driver.Driver` (shared with the DDP hook).

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
import sys
from typing import Dict

import torch
from torch.autograd import Variable

from ..exchange import StepStats
from ..exchange.driver import Driver, Reports, Settings, plain
from ..exchange.owners import Door, Owner, record, replaced, take_over
from ..transport import HorovodAllreduce, HorovodTransport
from ..transport.horovod import name_unnamed_collectives
from ..transport import select as select_transport
from .join import live, register

__all__ = ["make"]

_STATE_KEY = "hvdcomp"
_FUNCTION_BACKWARD = torch.autograd.function.BackwardCFunction.apply.__code__
_created = itertools.count()


def _inside_function_backward() -> bool:
    """Whether the caller runs inside a custom autograd Function's backward: a backward
    pass started there (``checkpoint(use_reentrant=True)``) is nested in another."""
    f = sys._getframe(1)
    while f is not None:
        if f.f_code is _FUNCTION_BACKWARD:
            return True
        f = f.f_back
    return False


def _named_floats(param_groups, named_parameters):
    """[(name, parameter)] of the optimizer's floating-point parameters (frozen ones
    too: one unfrozen later is exchanged like the others)."""
    all_params = [p for g in param_groups for p in g["params"]]
    if named_parameters is None:
        named = [(f"param.{i}.{j}", p) for i, g in enumerate(param_groups)
                 for j, p in enumerate(g["params"])]
    else:
        named = list(named_parameters)
        by_id = {id(p): n for n, p in named}
        missing = [i for i, p in enumerate(all_params) if id(p) not in by_id]
        if missing:
            raise ValueError(f"named_parameters lacks {len(missing)} of the optimizer's "
                             f"parameters; pass model.named_parameters() of the model "
                             f"whose parameters the optimizer holds")
        mine = {id(p) for p in all_params}
        named = [(n, p) for n, p in named if id(p) in mine]
    return [(n, p) for n, p in named if p.is_floating_point()]


def _check_wrappable(optimizer) -> None:
    """TypeError for an optimizer that already exchanges its gradients: hvdcomp's own
    DistributedOptimizer or Horovod's (both hook the parameters; wrapped again, every
    backward pass would exchange twice)."""
    if getattr(type(optimizer), "_hvdcomp_optimizer", False):
        raise TypeError(
            "this optimizer is already an hvdcomp DistributedOptimizer; wrap the torch "
            "optimizer itself (a new hvdcomp DistributedOptimizer built on the same "
            "parameters replaces the old one: see hvdcomp.torch.DistributedOptimizer)")
    if hasattr(optimizer, "_allreduce_grad_async"):
        raise TypeError(
            "this optimizer is already horovod.torch's DistributedOptimizer (it allreduces "
            "the gradients itself); wrap the torch optimizer itself")


class _DistributedOptimizer(torch.optim.Optimizer):
    # Methods of this class are copied into a subclass of the user's optimizer class, so
    # they use super(self.__class__, self) rather than zero-argument super().

    _hvdcomp_optimizer = True
    DOOR = Door(
        label="hvdcomp DistributedOptimizer", prefix="", use_new="step that one",
        rebuild="build the new optimizer on all of its parameters",
        closed="(hooks removed, threads stopped); its hvdcomp state (step, residuals, levels) "
               "is not carried over (new.load_state_dict(old.state_dict()) carries it)",
        copy="an hvdcomp DistributedOptimizer cannot be pickled, copied or deep-copied: it "
             "holds a live exchange (threads, communicators) and hooks on the model's "
             "parameters.  Save optimizer.state_dict() (it includes hvdcomp's state) and "
             "load it into a DistributedOptimizer built on the model's parameters")

    def __init__(self, params, named_parameters, settings: Settings, backward_passes_per_step,
                 op, transport, hvd, refused=None):
        super(self.__class__, self).__init__(params)
        self._ident = next(_created)
        named = _named_floats(self.param_groups, named_parameters)
        # An open hvdcomp optimizer that already hooks these parameters (the optimizer
        # built again, e.g. to change the learning rate) is replaced once the ranks agree
        # (hvdcomp.exchange.owners), so that each backward pass exchanges once.
        old = replaced(live(), named, self._ident)
        # Every setting, agreed over one fixed channel (Horovod's allgather under a fixed
        # name) before anything that depends on them: building the transport is itself
        # collective, so ranks that differ in any setting are reported instead of hanging.
        settings.agree(
            HorovodTransport(prefix="hvdcomp.agree", numbered=False),
            "the DistributedOptimizer settings", optimizer=type(self).__name__,
            **{"optimizer number": self._ident},
            transport=(transport if isinstance(transport, str) else "auto" if transport is None
                       else type(transport).__name__),
            backward_passes_per_step=plain(backward_passes_per_step),
            op={hvd.Average: "Average", hvd.Sum: "Sum"}.get(op, repr(op)),
            parameters=[[n, list(p.shape), str(p.dtype)] for n, p in named],
            replaces=record(old),
            refused=refused)
        # (after the handshake: every rank raises the same error)
        if refused:
            raise ValueError(refused)
        self._bpps = int(backward_passes_per_step)
        if self._bpps < 1:
            raise ValueError("backward_passes_per_step must be >= 1")
        if op not in (hvd.Average, hvd.Sum):
            raise ValueError("hvdcomp.torch.DistributedOptimizer supports op=Average and "
                             "op=Sum (Adasum cannot combine decoded messages)")
        take_over(old, self._ident, hvd.rank())
        # the application's unnamed Horovod collectives get names that hvdcomp's threads
        # cannot shift (every rank here, before the exchange's first thread)
        name_unnamed_collectives()
        # a carrier built here (not handed in) is freed by close()
        self._owns_transport = transport is None or isinstance(transport, str)
        self._driver = Driver(named, settings, select_transport(transport, hvd),
                              HorovodAllreduce(hvd) if settings.allreduce_summable else None,
                              ident=self._ident)
        self._driver.momentum.attach(self)   # DGC with SGD: momentum correction (momentum.py)
        self._exchange = self._driver.exchange
        self._named = named
        self._passes = 0          # backward passes since the last exchange
        self._fresh = False       # p.grad holds averages that no step() has applied yet
        self._queued = False      # the end-of-backward callback is queued
        self._fired = set()       # hooks fired in this backward pass
        self._readied = set()
        self._should_sync = True
        self._hooks: Dict[str, object] = {}
        self._hook_trainable()
        register(self._ident, self)     # for join()

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
                self._driver.momentum.fold_weight_decay(name, p, p.grad)
                self._exchange.ready(name)
        return hook

    def _begin(self, sync: bool = False) -> None:
        self._readied = set()
        self._driver.begin(sync=sync)

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
        d = self._driver
        for n, p in d.momentum.corrected.items():
            if n not in self._readied:
                d.momentum.fold_weight_decay(n, p, p.grad)
        self._passes, self._fresh = 0, False
        results = d.finish()
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
        self._hook_trainable()        # parameters unfrozen since: hooked from now on

    def _replace(self, by: int, rank: int) -> None:
        if self._exchange.in_step:
            self._exchange.finish()           # (every rank: the ranks agreed on the swap)
        Owner._replace(self, by, rank)

    def __reduce_ex__(self, protocol):
        raise self._copy_refused()

    # --- public ---------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the exchange's worker threads and free its buffers (they live as long as the
        threads otherwise, i.e. the process), and remove its hooks from the parameters.
        Call when done with the optimizer, between steps; it cannot step afterwards
        (RuntimeError).  A new DistributedOptimizer built on the same parameters closes
        the old one itself."""
        for h in self._hooks.values():
            h.remove()
        self._hooks = {}
        if not self._closed:
            self._closed = True
            self._exchange.close()
            free = getattr(self._exchange.transport, "free", None)
            if self._owns_transport and free is not None:
                free()                        # its communicators (MPI_Comm_free)

    def synchronize(self) -> StepStats:
        """Make sure ``p.grad`` holds the averaged gradients.

        A no-op when backward already averaged them (the usual case); otherwise the
        exchange runs now: after fewer than ``backward_passes_per_step`` backward passes,
        after a backward pass that reached none of the hooked parameters, or when no
        backward ran since the last ``step()`` (then it averages ``p.grad`` as it is).
        Returns the :class:`~hvdcomp.exchange.StepStats` of the last exchange (also
        in ``last_stats``).  Raises WireFormatError if any rank's message is malformed.
        """
        self._check_open()
        self._queued, self._fired = False, set()   # never inside a backward pass
        if not self._exchange.in_step:
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
        self._check_open()
        if closure is not None and not self._driver.momentum.corrected:
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
        # the wrapped step, DGC's tensors hidden from it; LAQ's rule, ALQ/AMQ's refit after
        loss = self._driver.update(lambda: super(self.__class__, self).step(closure))
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
        sd[_STATE_KEY] = self._driver.state_dict()
        return sd

    def load_state_dict(self, state_dict, *, allow_missing_hvdcomp: bool = False):
        """The wrapped optimizer's ``load_state_dict``, plus hvdcomp's part (the key
        ``"hvdcomp"`` that :meth:`state_dict` adds: hvdcomp's step, the compression's spec
        and the compressor's state, :meth:`hvdcomp.exchange.driver.Driver.state_dict`),
        restored bit-exactly.

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
            self._driver.check_missing(allow_missing_hvdcomp, _STATE_KEY)
        else:
            self._driver.check_state(mine)
        super(self.__class__, self).load_state_dict(state_dict)
        if mine is not None:
            self._driver.load_state_dict(mine)

    def _join_rounds(self) -> int:
        self._passes, self._fresh = 0, False
        return self._driver.sit_out()


def make(optimizer, named_parameters, settings: Settings, backward_passes_per_step, op,
         transport, hvd, refused=None):
    """``optimizer`` wrapped: an instance of a subclass of its class with this module's
    methods and :class:`~hvdcomp.exchange.driver.Reports`' properties.  TypeError for an
    optimizer that is already a DistributedOptimizer (hvdcomp's or Horovod's).
    ``refused``: a ValueError's text, raised on every rank after the settings handshake
    (an option this door refuses, so that no rank is left waiting in the handshake)."""
    _check_wrappable(optimizer)
    body = dict(_DistributedOptimizer.__dict__)
    # Horovod's helpers recognise their DistributedOptimizer by its module:
    # broadcast_optimizer_state then initialises the state of a fresh optimizer with the
    # wrapped optimizer's own step (no exchange, which the other ranks would not join)
    # instead of calling step() (docs/semantics.md, "Horovod's helpers").
    body["__module__"] = _HOROVOD_OPTIMIZER_MODULE
    cls = type(optimizer.__class__.__name__, (optimizer.__class__, Reports, Owner), body)
    return cls(optimizer.param_groups, named_parameters, settings, backward_passes_per_step,
               op, transport, hvd, refused)


#: The module of horovod.torch's DistributedOptimizer (what its helpers compare with).
_HOROVOD_OPTIMIZER_MODULE = "horovod.torch.optimizer"
