"""The drop-in optimizer's wiring (:func:`hvdcomp.torch.DistributedOptimizer` builds it).

Wraps any ``torch.optim.Optimizer`` the way horovod.torch does (a subclass of the wrapped
optimizer's class created on the fly, :func:`hvdcomp.torch.wrapped.make`), and hands the
gradient exchange to :class:`hvdcomp.exchange.driver.Driver` (shared with the DDP hook).

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
from typing import Dict

import torch
from torch.autograd import Variable

from ..exchange import StepStats
from ..exchange.backward import inside_function_backward
from ..exchange.driver import Driver, Settings, plain
from ..exchange.owners import Door, Owner, agree, take_over
from ..transport import HorovodAllreduce, HorovodTransport
from ..transport.horovod import name_unnamed_collectives
from ..transport import select as select_transport
from .join import live, register

__all__: list = []   # (the class is copied by hvdcomp.torch.wrapped.make, not used as is)

_STATE_KEY = "hvdcomp"
_created = itertools.count()


class _DistributedOptimizer(torch.optim.Optimizer):
    # Methods of this class are copied into a subclass of the user's optimizer class
    # (hvdcomp.torch.wrapped.make), so they use super(self.__class__, self) rather than
    # zero-argument super().

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

    def __init__(self, params, named, settings: Settings, backward_passes_per_step, op,
                 transport, hvd, refused=None):
        super(self.__class__, self).__init__(params)
        self._ident = next(_created)
        self._named = named
        self._settings, self._transport_arg, self._hvd = settings, transport, hvd
        self._record = dict(
            optimizer=type(self).__name__, **{"optimizer number": self._ident},
            transport=(transport if isinstance(transport, str) else "auto" if transport is None
                       else type(transport).__name__),
            backward_passes_per_step=plain(backward_passes_per_step),
            op={hvd.Average: "Average", hvd.Sum: "Sum"}.get(op, repr(op)))
        old = self._agree(live(), refused)
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
        self._build_driver()
        self._passes = 0          # backward passes since the last exchange
        self._fresh = False       # p.grad holds averages that no step() has applied yet
        self._queued = False      # the end-of-backward callback is queued
        self._fired = set()       # hooks fired in this backward pass
        self._should_sync = True
        self._hooks: Dict[str, object] = {}
        self._hook_trainable()
        register(self._ident, self)     # for join()

    def _agree(self, candidates, refused=None):
        """The settings handshake: every setting, agreed over one fixed channel (Horovod's
        allgather under a fixed name) before anything that depends on them (building the
        transport is itself collective, so ranks that differ in any setting are reported
        instead of hanging).  Returns the open hvdcomp optimizers among ``candidates`` that
        already hook these parameters (the optimizer built again, e.g. to change the
        learning rate), to be replaced once the ranks agree (hvdcomp.exchange.owners), so
        that each backward pass exchanges once."""
        return agree(self._settings, HorovodTransport(prefix="hvdcomp.agree", numbered=False),
                     "the DistributedOptimizer settings", candidates, self._named,
                     self._ident, **self._record, refused=refused)

    def _build_driver(self) -> None:
        """The exchange for Horovod's world as it is now (collective)."""
        transport, hvd = self._transport_arg, self._hvd
        # a carrier built here (not handed in) is freed by close()
        self._driver = Driver(self._named, self._settings, select_transport(transport, hvd),
                              HorovodAllreduce(hvd) if self._settings.allreduce_summable
                              else None, ident=self._ident,
                              owns_carriers=transport is None or isinstance(transport, str))
        self._driver.momentum.attach(self)   # DGC with SGD: momentum correction (momentum.py)
        self._exchange = self._driver.exchange

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
                self._driver.begin()
            self._driver.ready(name, p)
        return hook

    def _end_of_backward(self) -> None:
        self._queued = False
        if inside_function_backward() and set(self._hooks) - self._fired:
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
        self._passes, self._fresh = 0, False
        results = self._driver.finish()
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
        self._driver.drop()                   # (every rank: the ranks agreed on the swap)
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
            self._driver.close()              # and the carrier built here (MPI_Comm_free)

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
            self._driver.begin(sync=True)
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
        # a backward pass that raised midway: its exchange is finished (the other ranks
        # finished theirs) and dropped
        self._passes = 0
        self._driver.drop()
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
        rest, mine = self._driver.split(state_dict, _STATE_KEY, allow_missing_hvdcomp)
        super(self.__class__, self).load_state_dict(rest)
        if mine is not None:
            self._driver.load_state_dict(mine)

    def _join_rounds(self) -> int:
        self._passes, self._fresh = 0, False
        return self._driver.sit_out()

