"""The pipeline: encode | communicate | decode threads driving a collective, bucket by bucket.

As soon as all gradients of a bucket are ready, the encode thread encodes it, while the
communicate thread has the bucket before on the wire and the decode thread decodes the one
before that, and backward goes on computing earlier layers.  Buckets go through every stage
in the fixed bucket order on every rank, whatever order they become ready in.  Kernels, MPI
and PyTorch release the GIL while they work.

The threads know one protocol, :meth:`Calls.call`: one collective bucket, exchanged in
call order, with a ``done`` callback on the decode thread.  A launcher that forms its own
buckets (the DDP communication hook: one call per DDP bucket) calls it directly; the
drop-in optimizer's step (``begin``, ``ready`` per gradient, ``finish``) is a layer over it
that submits the fixed fusion buckets, in bucket order, as they complete.
"""
from __future__ import annotations

import queue
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..errors import OutOfStep, RankFailure, WireFormatError
from ..log import logger
from .collective import Collective
from .plan import Entry
from .step_stats import StepStats

__all__ = ["Calls", "Pipeline", "Done"]

#: Seconds between two looks at the transport's farewells while a step is waited for.
_POLL_S = 0.2
#: Seconds a failed step looks for a farewell that explains the failure.
_GRACE_S = 0.5

# done(results, stats, error) of Calls.call
Done = Callable[[Dict[str, torch.Tensor], StepStats, Optional[BaseException]], None]


@dataclass
class _Call:
    """One exchange of a group of tensors: a :meth:`Pipeline.call`, or a fusion bucket of
    a step (then ``stats`` is the step's and ``skip`` tells whether the step has failed
    already: its later buckets are not decoded)."""
    k: int
    entries: List[Entry]
    step: int
    grads: Optional[Dict[str, torch.Tensor]]
    done: Done
    stats: StepStats
    sync: bool = False
    error: Optional[BaseException] = None
    failure: Optional[BaseException] = None     # raised by the launcher before the call
    out: Optional[Dict[str, torch.Tensor]] = None   # where the averages may be written
    skip: Optional[Callable[[], bool]] = None


class Calls:
    """The encode | communicate | decode threads driving ``collective`` on the calls they
    are given (:meth:`call`), in call order; the threads start on the first call and run
    until ``close()``.  ``failure_seen``: some call carried a rank's error marks (every rank
    has seen them)."""

    def __init__(self, collective: Collective):
        self.collective = collective
        self._q: "queue.Queue" = queue.Queue()
        self._cq: "queue.Queue" = queue.Queue()
        self._dq: "queue.Queue" = queue.Queue()
        self._threads: List[threading.Thread] = []
        self._closed = False

    @property
    def failure_seen(self) -> bool:
        return self.collective.failure_seen

    @property
    def closed(self) -> bool:
        return self._closed

    # --- one call -------------------------------------------------------------------
    def call(self, k: int, entries: Sequence[Entry], step: int,
             grads: Dict[str, torch.Tensor], done: Done,
             failure: Optional[BaseException] = None,
             out: Optional[Dict[str, torch.Tensor]] = None) -> None:
        """Exchange ``entries`` of step ``step`` as one collective bucket numbered ``k`` and
        return at once; the threads take the calls in call order, so every rank makes the
        same calls in the same order (:meth:`hvdcomp.exchange.Exchange.call`: ``grads``,
        ``failure``, ``out``).  ``done(results, stats, error)`` runs on the decode thread
        once the call is over, with {name: average} and the call's own :class:`StepStats`,
        or ({}, stats, the exception) after an error (raised by the collective on every
        rank); what ``done`` raises is logged and dropped."""
        self._put(_Call(k, list(entries), step, grads, done, StepStats(step=step),
                        failure=failure, out=out))

    def _put(self, call: _Call) -> None:
        if self._closed:
            raise RuntimeError("the exchange is closed")
        self._start()
        self._q.put(call)

    def close(self) -> None:
        """Stop the threads (they hold the collective and its buffers until then) and free
        the collective's buffers.  Call with every call done; they cannot run afterwards."""
        self.stop()
        self._closed = True
        self.collective.close()

    def stop(self, timeout: Optional[float] = None) -> bool:
        """End the threads (between steps); False if they did not end within ``timeout``
        seconds (a thread still inside a collective)."""
        if self._threads:
            self._q.put(None)               # passed down the pipeline, each thread exits
            deadline = None if timeout is None else time.monotonic() + timeout
            for t in self._threads:
                t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if any(t.is_alive() for t in self._threads):
                return False
            self._threads = []
        return True

    # --- threads --------------------------------------------------------------------
    def _start(self) -> None:
        if not self._threads:
            self._threads = [threading.Thread(target=fn, name=f"hvdcomp-{name}", daemon=True)
                             for fn, name in ((self._encoder, "encode"),
                                              (self._communicator, "communicate"),
                                              (self._decoder, "decode"))]
            for t in self._threads:
                t.start()

    def _encoder(self) -> None:
        # Every call is encoded, even after an error elsewhere: whether this rank joins the
        # bucket's collectives must never depend on another thread's timing.
        while True:
            call = self._q.get()
            if call is None:
                self._cq.put((None, None))
                return
            for e in call.entries:
                call.stats.compressors[e.name] = e.compressor.name
                call.stats.fp32_bytes += 4 * e.param.numel()
            job = None
            try:
                t0 = time.perf_counter()
                job = self.collective.encode(call.k, call.entries, call.step, call.stats,
                                             call.sync, call.grads, call.failure)
                call.stats.encode_s += time.perf_counter() - t0
            except BaseException as e:          # handed to the call's done()
                call.error = e
            self._cq.put((job, call))

    def _communicator(self) -> None:
        while True:
            job, call = self._cq.get()
            if call is None:
                self._dq.put((None, None))
                return
            if job is not None:                 # every bucket goes on the wire (see above)
                try:
                    t0 = time.perf_counter()
                    self.collective.communicate(job, call.stats)
                    call.stats.comm_s += time.perf_counter() - t0
                except BaseException as e:      # handed to the call's done()
                    call.error, job = e, None   # nothing to decode
            self._dq.put((job, call))

    def _decoder(self) -> None:
        while True:
            job, call = self._dq.get()
            if call is None:
                return
            results: Dict[str, torch.Tensor] = {}
            # decoding is local work only: skipped after an error of the call or its step
            if job is not None and call.error is None and not (call.skip and call.skip()):
                try:
                    t0 = time.perf_counter()
                    results = self.collective.decode(job, call.stats, call.out)
                    call.stats.decode_s += time.perf_counter() - t0
                except BaseException as e:      # handed to the call's done()
                    call.error, results = e, {}
            try:
                call.done(results, call.stats, call.error)
            except BaseException:               # noqa: BLE001 - keep the thread alive
                logger.error("the done() of call %d (step %d) raised; dropped:\n%s", call.k,
                             call.step, traceback.format_exc())


class Pipeline(Calls):
    """The step of a launcher with fixed fusion buckets (``buckets``: lists of names of
    ``entries``), over :class:`Calls`: ``begin(step)``, ``ready(name)`` for each gradient
    (a bucket is submitted as a call once it and every bucket before it are complete, so
    every rank submits them in the same order), ``finish()``.  :meth:`call` serves
    launchers that form their own buckets, between steps.

    Errors: the first error of a step (on any thread) is raised by ``finish()``; every bucket
    is still encoded and communicated (see :class:`~hvdcomp.exchange.collective.Collective`),
    so no rank is left waiting in a collective, and the next step starts clean.

    Stopping (:mod:`hvdcomp.exchange.shutdown`): :meth:`stop_after_error` makes this rank
    send error marks in every remaining collective of its step (or of one more step), so
    that every other rank raises instead of waiting for it; :meth:`stop` ends the threads.
    """

    def __init__(self, buckets: List[List[str]], entries: Dict[str, Entry],
                 collective: Collective):
        self.buckets = buckets
        self.bucket_of = {n: k for k, b in enumerate(buckets) for n in b}
        super().__init__(collective)
        self._entries = [[entries[n] for n in b] for b in buckets]
        self._lock = threading.Lock()
        #: The farewell text of a rank that left while this one waited for a step (the
        #: step's collective will never complete: the exit handler aborts at once).
        self.peer_departed: Optional[str] = None
        self._reset(0)

    @property
    def in_step(self) -> bool:
        """Between ``begin`` and the end of ``finish``."""
        return self._in_step

    @property
    def results(self) -> Dict[str, torch.Tensor]:
        """{name: averaged gradient} of the buckets decoded so far in this step."""
        return self._results

    @property
    def step(self) -> int:
        """The step begun last."""
        return self._stats.step

    # --- the step: begin / ready / finish over the fusion buckets ----------------------
    def begin(self, step: int, sync: bool = False) -> None:
        """Start a step; ``sync``: started by synchronize()/step(), not by backward."""
        if self._closed:
            raise RuntimeError("the exchange is closed")
        self._reset(step)
        self._in_step, self._sync = True, bool(sync)
        if not self.buckets:                  # no trainable parameters: nothing to exchange
            self._done.set()

    def ready(self, name: str) -> None:
        """The gradient of ``name`` is final for this step; its bucket is submitted once it
        and every bucket before it are complete (the fixed bucket order on every rank)."""
        if not self._in_step:
            raise RuntimeError("ready() outside a step: call begin(step) first")
        k = self.bucket_of[name]
        with self._lock:
            self._pending[k] -= 1
            while self._next < len(self.buckets) and self._pending[self._next] == 0:
                self._submit_next()

    def finish(self) -> Tuple[Dict[str, torch.Tensor], StepStats]:
        """Submit what is left, wait, and return the results and the step's statistics;
        re-raises the step's first error on the calling thread.  Raises
        :class:`~hvdcomp.errors.OutOfStep` when, while it waits, another rank says farewell
        after an earlier step (:mod:`hvdcomp.exchange.shutdown`): that rank's part will never
        come."""
        if not self._in_step:
            raise RuntimeError("finish() outside a step")
        self._submit_rest()
        transport = getattr(self.collective, "transport", None)
        ident = getattr(self.collective, "ident", 0)
        while not self._done.wait(_POLL_S):
            gone = _departed(transport, ident, self.step)
            if gone is not None and not self._done.is_set():
                self.peer_departed = gone
                raise OutOfStep(_departed_text(gone, transport, self.step))
        self._in_step = False
        if self._error is not None:
            err, self._error = self._error, None
            # a rank that left may also have failed this step's collectives (Horovod's
            # shutdown fails the other ranks' pending allreduces): its farewell says why
            ours = isinstance(err, (RankFailure, OutOfStep, WireFormatError))
            gone = _departed(transport, ident, self.step, wait=0.0 if ours else _GRACE_S)
            if gone is not None:
                self.peer_departed = gone
                raise OutOfStep(_departed_text(gone, transport, self.step)) from err
            raise err
        return self._results, self._stats

    def _reset(self, step: int) -> None:
        self._pending = [len(b) for b in self.buckets]
        self._next = 0                         # the next bucket to submit
        self._results: Dict[str, torch.Tensor] = {}
        self._done = threading.Event()
        self._error: Optional[BaseException] = None
        self._stats = StepStats(step=step)
        self._in_step, self._sync = False, False

    def _submit_next(self) -> None:
        """Submit bucket ``_next`` of the step as a call (its stats: the step's)."""
        k, self._next = self._next, self._next + 1
        self._put(_Call(k, self._entries[k], self._stats.step, None,
                        lambda res, _, err: self._bucket_done(k, res, err), self._stats,
                        self._sync, skip=lambda: self._error is not None))

    def _submit_rest(self) -> None:
        with self._lock:
            while self._next < len(self.buckets):
                self._submit_next()

    def _bucket_done(self, k: int, results, error) -> None:
        if error is not None:
            with self._lock:
                if self._error is None:       # the step's first error: finish() raises it
                    self._error = error
        else:
            self._results.update(results)
        if k == len(self.buckets) - 1:
            self._done.set()

    def call(self, k: int, entries: Sequence[Entry], step: int,
             grads: Dict[str, torch.Tensor], done: Done,
             failure: Optional[BaseException] = None,
             out: Optional[Dict[str, torch.Tensor]] = None) -> None:
        """:meth:`Calls.call`; RuntimeError during a step of begin / ready / finish."""
        if self._in_step:
            raise RuntimeError("call() during a step of begin/ready/finish: finish() first")
        super().call(k, entries, step, grads, done, failure, out)

    def close(self) -> None:
        """:meth:`Calls.close`, between steps (RuntimeError during one)."""
        if self._in_step:
            raise RuntimeError("close() during a step: call finish() first")
        super().close()
        self._results = {}

    def stop_after_error(self, text: str, deadline: float) -> bool:
        """This rank is stopping after an error (``text``, for the other ranks): finish
        the current step with error marks in every collective not yet encoded, then, if no
        collective of this pipeline has carried a rank's error marks yet, run one more step
        of error marks only, so that every other rank raises (a RankFailure naming this
        rank) in the step it is in or the next one.  Returns False if the collectives did
        not complete by ``deadline`` (``time.monotonic()``; another rank is stuck or gone).
        Errors of these steps are dropped (this rank is stopping anyway)."""
        self.collective.failing = text
        if self._closed or not self.buckets:
            return True
        if self._in_step and not self._drain(deadline):
            return False
        if not self.failure_seen:
            self.begin(self.step + 1)
            if not self._drain(deadline):
                return False
        self._error = None
        return True

    def _drain(self, deadline: float) -> bool:
        """Submit the rest of the step and wait for it until ``deadline``."""
        self._submit_rest()
        if not self._done.wait(max(0.0, deadline - time.monotonic())):
            return False
        self._in_step = False
        return True


def _departed(transport, ident: int, step: int, wait: float = 0.0) -> Optional[str]:
    """The farewell text of a rank that left after an earlier step than ``step`` (looking
    for up to ``wait`` seconds on a transport that carries farewells), or None."""
    if transport is None or not transport.farewells:
        return None
    deadline = time.monotonic() + wait
    while True:
        gone = transport.departed(ident)
        if gone is not None and gone[0] < step:
            return gone[1]
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.01)


def _departed_text(gone: str, transport, step: int) -> str:
    return (f"hvdcomp: {gone}, while this rank (rank {transport.rank}) waits for its part "
            f"of step {step}: the ranks ran different numbers of steps (a rank "
            f"skipped an iteration or a batch? with uneven data every rank calls "
            f"hvd.join() at its end). This step's collectives can never complete: the "
            f"job is aborted.")
