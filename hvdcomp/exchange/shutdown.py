"""Ending a job cleanly when one rank fails.

Every collective of a step needs every rank: a rank that stops in the middle of training
(an exception, KeyboardInterrupt, an exit during a step) would leave the others waiting in
a collective forever, and its pipeline threads, still inside MPI, would be cut off when the
interpreter finalizes MPI (a segmentation fault).  So, at interpreter exit, before Horovod
shuts down and before mpi4py finalizes MPI (an :mod:`atexit` handler registered after
both), this module does, for every pipeline not closed:

* when the process is exiting with an unhandled exception (KeyboardInterrupt included), or
  during a step: :meth:`Pipeline.stop_after_error` (the rest of the step, then one more
  step unless one was seen, carry error marks: error frames and zero slots, see
  :mod:`hvdcomp.exchange.collective`), so that every other rank raises a
  :class:`~hvdcomp.errors.RankFailure` naming this rank at the step it is in or the next,
  exits with its own traceback and a non-zero status;
* then it ends the pipeline threads, so that no thread of hvdcomp is inside MPI when MPI is
  finalized.

If the other ranks do not complete those collectives within ``$HVDCOMP_EXIT_TIMEOUT``
seconds (default 10: they are stuck elsewhere, e.g. in a collective of the application's own,
or have exited), or a thread is still inside a collective, the message is printed and the
job is aborted with ``MPI_Abort`` (mpi4py's ``MPI.COMM_WORLD.Abort``; the launcher then
ends the other ranks), or ``os._exit(1)`` without MPI: the only safe way out, since a
collective cannot be cancelled.

A rank that dies outright (SIGKILL, a crash in native code) sends nothing: the launcher
(mpirun, horovodrun) notices and ends the other ranks, and names the rank that died.

A normal exit between steps does nothing collective (the other ranks may still be running
their own code), but it says farewell (:func:`farewell`): one small message per other rank
with each exchange's last step.  A rank that is waiting for a later step of that exchange
(the ranks ran different numbers of steps: one skipped an iteration, or the data was uneven
without hvd.join()) would otherwise wait forever, since no step counter can tell a skipped
iteration from a normal one until the counts differ at the end; it raises
:class:`~hvdcomp.errors.OutOfStep` quoting the farewell, and its exit handler aborts the
job at once (its collective can never complete).  Carriers whose own shutdown already fails
the other ranks' collectives (Horovod) send nothing.
"""
from __future__ import annotations

import atexit
import logging
import itertools
import os
import sys
import threading
import time
import weakref
from typing import Optional

from ..log import logger

__all__ = ["register", "exit_timeout", "stop_all", "farewell"]

_pipelines: "weakref.WeakValueDictionary" = weakref.WeakValueDictionary()
_order = itertools.count()
_lock = threading.Lock()
_hooked = False
_unhandled: Optional[BaseException] = None


def exit_timeout() -> float:
    """Seconds the exit handler waits for the other ranks ($HVDCOMP_EXIT_TIMEOUT, 10)."""
    try:
        return float(os.environ.get("HVDCOMP_EXIT_TIMEOUT", "") or 10.0)
    except ValueError:
        return 10.0


def register(pipeline, rank: int) -> None:
    """Let the exit handler stop ``pipeline`` (kept by a weak reference; its threads keep
    it alive while they run).  Re-registers the handler so that it runs before every exit
    handler registered so far (Horovod's shutdown, hvd.init() having come first)."""
    global _hooked
    with _lock:
        pipeline._shutdown_rank = rank
        _pipelines[next(_order)] = pipeline
        atexit.unregister(_at_exit)
        atexit.register(_at_exit)
        if not _hooked:
            _hooked = True
            prev = sys.excepthook

            def excepthook(tp, value, tb):
                global _unhandled
                _unhandled = value
                prev(tp, value, tb)

            sys.excepthook = excepthook


def _exiting_with() -> Optional[BaseException]:
    """The exception the interpreter is exiting with, if any."""
    exc = _unhandled or getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
    if isinstance(exc, SystemExit) and exc.code in (None, 0):
        return None
    return exc


def stop_all(exc: Optional[BaseException], timeout: float) -> bool:
    """Stop every registered pipeline (module docstring); ``exc``: the error this rank is
    stopping after (None: a normal exit).  Returns False if some pipeline could not be
    stopped in time (the caller aborts)."""
    with _lock:
        pipes = [p for _, p in sorted(_pipelines.items()) if not p.closed]
    deadline = time.monotonic() + timeout
    failing = [p for p in pipes if exc is not None or p.in_step]
    ok = [True]
    if failing:
        rank = failing[0]._shutdown_rank
        if exc is not None:
            text = (f"rank {rank} is stopping after {type(exc).__name__}: {exc}"
                    if str(exc) else f"rank {rank} is stopping after {type(exc).__name__}")
        else:
            text = f"rank {rank} exited during step {failing[0].step}"

        def run(p):
            try:
                if not p.stop_after_error(text, deadline):
                    ok[0] = False
            except BaseException:          # noqa: BLE001 - exiting: report by aborting
                ok[0] = False

        # concurrently: the other ranks may be waiting in any of them
        threads = [threading.Thread(target=run, args=(p,), daemon=True) for p in failing]
        for t in threads:
            t.start()
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()) + 0.5)
        if any(t.is_alive() for t in threads):
            ok[0] = False
    if ok[0]:
        for p in pipes:
            if not p.stop(max(0.0, deadline - time.monotonic()) + 0.5):
                ok[0] = False
    return ok[0]


def farewell(pipes, rank: int) -> None:
    """This rank is leaving normally: tell the other ranks (no waiting,
    :meth:`~hvdcomp.transport.Transport.farewell`) each pipeline's last step, so that a
    rank waiting for a later step raises instead of waiting forever."""
    for p in pipes:
        coll = p.collective
        transport = getattr(coll, "transport", None)
        if transport is None:
            continue
        ident = getattr(coll, "ident", 0)
        try:
            transport.farewell(p.step, ident, f"rank {rank} left: it exited normally after "
                               f"step {p.step} of exchange {ident}")
        except Exception as e:              # noqa: BLE001 - leaving anyway
            logger.debug("farewell of rank %d failed: %s", rank, e)


def _abort(text: str) -> None:
    logger.critical(text)
    for h in logger.handlers + logging.getLogger().handlers + [logging.lastResort]:
        try:
            if h is not None:
                h.flush()
        except Exception:                   # noqa: BLE001
            pass
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None:
        hvd = sys.modules.get("horovod.torch")
        try:
            if hvd is not None and hvd.is_initialized() and hvd.mpi_enabled():
                from mpi4py import MPI as mpi   # MPI is initialized (by Horovod)
        except Exception:                   # noqa: BLE001
            mpi = None
    try:
        if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
            mpi.COMM_WORLD.Abort(1)
    finally:
        os._exit(1)


def _at_exit() -> None:
    exc = _exiting_with()
    with _lock:
        pipes = [p for _, p in sorted(_pipelines.items()) if not p.closed]
    if not pipes:
        return
    rank = pipes[0]._shutdown_rank
    gone = [p.peer_departed for p in pipes if p.peer_departed]
    if gone:
        _abort(f"hvdcomp: rank {rank}: {gone[0]}, while this rank waited for a later step "
               f"(OutOfStep above); aborting the job (MPI_Abort)")
    if exc is None and not any(p.in_step for p in pipes):
        farewell(pipes, rank)
    timeout = exit_timeout()
    if not stop_all(exc, timeout):
        _abort(f"hvdcomp: rank {rank}: the other ranks did not complete the step with this "
               f"rank's error marks within {timeout:g} s ($HVDCOMP_EXIT_TIMEOUT), or a "
               f"thread is still inside a collective; aborting the job (MPI_Abort)")
