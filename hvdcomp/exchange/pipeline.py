"""The pipeline: encode | communicate | decode threads driving a collective, bucket by bucket.

As soon as all gradients of a bucket are ready, the encode thread encodes it, while the
communicate thread has the bucket before on the wire and the decode thread decodes the one
before that, and backward goes on computing earlier layers.  Buckets go through every stage
in the fixed bucket order on every rank, whatever order they become ready in.  Kernels, MPI
and PyTorch release the GIL while they work.

A launcher that forms its own buckets (the DDP communication hook: one call per DDP bucket)
uses :meth:`Pipeline.call` instead of begin / ready / finish: the same threads, in call order.
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
from .stats import StepStats

__all__ = ["Pipeline", "Done"]

#: Seconds between two looks at the transport's farewells while a step is waited for.
_POLL_S = 0.2
#: Seconds a failed step looks for a farewell that explains the failure.
_GRACE_S = 0.5

# done(results, stats, error) of Pipeline.call
Done = Callable[[Dict[str, torch.Tensor], StepStats, Optional[BaseException]], None]


@dataclass
class _Call:
    """One exchange of an explicit group of tensors (:meth:`Pipeline.call`)."""
    k: int
    entries: List[Entry]
    step: int
    grads: Dict[str, torch.Tensor]
    done: Done
    stats: StepStats
    error: Optional[BaseException] = None
    failure: Optional[BaseException] = None     # raised by the launcher before the call
    out: Optional[Dict[str, torch.Tensor]] = None   # where the averages may be written


class Pipeline:
    """Runs ``collective`` over ``buckets`` (lists of names of ``entries``) once per step:
    ``begin(step)``, ``ready(name)`` for each gradient, ``finish()``.  The threads start on
    the first step and run until ``close()``.

    Errors: the first error of a step (on any thread) is raised by ``finish()``; every bucket
    is still encoded and communicated (see :class:`~hvdcomp.exchange.collective.Collective`),
    so no rank is left waiting in a collective, and the next step starts clean.

    Stopping (:mod:`hvdcomp.exchange.shutdown`): :meth:`stop_after_error` makes this rank
    send error marks in every remaining collective of its step (or of one more step), so
    that every other rank raises instead of waiting for it; :meth:`stop` ends the threads.
    ``failure_seen``: some step of this pipeline carried a rank's error marks (every rank
    has seen them).
    """

    def __init__(self, buckets: List[List[str]], entries: Dict[str, Entry],
                 collective: Collective):
        self.buckets = buckets
        self.bucket_of = {n: k for k, b in enumerate(buckets) for n in b}
        self.collective = collective
        self._entries = [[entries[n] for n in b] for b in buckets]
        self._error_lock = threading.Lock()
        self._q: "queue.Queue" = queue.Queue()
        self._cq: "queue.Queue" = queue.Queue()
        self._dq: "queue.Queue" = queue.Queue()
        self._threads: List[threading.Thread] = []
        self._closed = False
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
    def failure_seen(self) -> bool:
        return self.collective.failure_seen

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def step(self) -> int:
        """The step begun last."""
        return self._stats.step

    def begin(self, step: int, sync: bool = False) -> None:
        """Start a step; ``sync``: started by synchronize()/step(), not by backward."""
        if self._closed:
            raise RuntimeError("the exchange is closed")
        self._reset(step)
        self._in_step = True
        if not self.buckets:                  # no trainable parameters: nothing to exchange
            self._done.set()
        self._start()
        self._q.put(("step", (step, bool(sync))))

    def ready(self, name: str) -> None:
        """The gradient of ``name`` is final for this step; submit its bucket when complete."""
        if not self._in_step:
            raise RuntimeError("ready() outside a step: call begin(step) first")
        k = self.bucket_of[name]
        self._pending[k] -= 1
        if self._pending[k] == 0:
            self._submit(k)

    def finish(self) -> Tuple[Dict[str, torch.Tensor], StepStats]:
        """Submit what is left, wait, and return the results and the step's statistics;
        re-raises the step's first error on the calling thread.  Raises
        :class:`~hvdcomp.errors.OutOfStep` when, while it waits, another rank says farewell
        after an earlier step (:mod:`hvdcomp.exchange.shutdown`): that rank's part will never
        come."""
        if not self._in_step:
            raise RuntimeError("finish() outside a step")
        for k in range(len(self.buckets)):
            self._submit(k)
        transport = getattr(self.collective, "transport", None)
        ident = getattr(self.collective, "ident", 0)
        while not self._done.wait(_POLL_S):
            gone = self._departed(transport, ident)
            if gone is not None and not self._done.is_set():
                self.peer_departed = gone
                raise OutOfStep(self._departed_text(gone, transport))
        self._in_step = False
        if self._error is not None:
            err, self._error = self._error, None
            # a rank that left may also have failed this step's collectives (Horovod's
            # shutdown fails the other ranks' pending allreduces): its farewell says why
            ours = isinstance(err, (RankFailure, OutOfStep, WireFormatError))
            gone = self._departed(transport, ident, wait=0.0 if ours else _GRACE_S)
            if gone is not None:
                self.peer_departed = gone
                raise OutOfStep(self._departed_text(gone, transport)) from err
            raise err
        return self._results, self._stats

    def _departed(self, transport, ident: int, wait: float = 0.0) -> Optional[str]:
        """The farewell text of a rank that left after an earlier step than this one (looking
        for up to ``wait`` seconds on a transport that carries farewells), or None."""
        if transport is None or not transport.farewells:
            return None
        deadline = time.monotonic() + wait
        while True:
            gone = transport.departed(ident)
            if gone is not None and gone[0] < self.step:
                return gone[1]
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.01)

    def _departed_text(self, gone: str, transport) -> str:
        return (f"hvdcomp: {gone}, while this rank (rank {transport.rank}) waits for its part "
                f"of step {self.step}: the ranks ran different numbers of steps (a rank "
                f"skipped an iteration or a batch? with uneven data every rank calls "
                f"hvd.join() at its end). This step's collectives can never complete: the "
                f"job is aborted.")

    def call(self, k: int, entries: Sequence[Entry], step: int,
             grads: Dict[str, torch.Tensor], done: Done,
             failure: Optional[BaseException] = None,
             out: Optional[Dict[str, torch.Tensor]] = None) -> None:
        """Exchange ``entries`` of step ``step`` as one collective bucket numbered ``k``,
        outside begin / ready / finish, and return at once: the pipeline's threads encode,
        communicate and decode the calls in call order, so every rank must make the same
        calls in the same order.  ``grads``: {name: gradient} for every entry (read on the
        encode thread: leave them unchanged until ``done``).

        ``done(results, stats, error)`` runs on the decode thread once the call is over:
        {name: average (flat float32, reused by the next call of the same tensor; where
        ``out`` has a contiguous float32 tensor of the tensor's numel, e.g. ``grads``' own,
        the average is written there and is that tensor, flattened)} and the
        call's own :class:`StepStats`, or ({}, stats, the exception) after an error, raised
        by the collective on every rank as for a bucket.  ``done`` must not raise (what it
        raises is logged and dropped: nothing waits for it).  ``failure``: an exception the
        launcher met while preparing the call on this rank; the call still makes its
        collectives (contributing nothing) and fails on every rank (this rank with
        ``failure``, the others with a RuntimeError naming the bucket).  RuntimeError
        during a step of begin / ready / finish."""
        if self._in_step:
            raise RuntimeError("call() during a step of begin/ready/finish: finish() first")
        self._start()
        self._q.put(("call", _Call(k, list(entries), step, grads, done, StepStats(step=step),
                                   failure=failure, out=out)))

    def close(self) -> None:
        """Stop the threads (they hold the collective and its buffers until then) and free
        the collective's buffers.  Call between steps, with every call done; the pipeline
        cannot run afterwards."""
        if self._in_step:
            raise RuntimeError("close() during a step: call finish() first")
        self.stop()
        self._closed = True
        self.collective.close()
        self._results = {}

    def stop(self, timeout: Optional[float] = None) -> bool:
        """End the threads (between steps); False if they did not end within ``timeout``
        seconds (a thread still inside a collective)."""
        if self._threads:
            self._q.put(("stop", None))     # passed down the pipeline, each thread exits
            deadline = None if timeout is None else time.monotonic() + timeout
            for t in self._threads:
                t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if any(t.is_alive() for t in self._threads):
                return False
            self._threads = []
        return True

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
        if self._in_step:
            for k in range(len(self.buckets)):
                self._submit(k)
            if not self._done.wait(max(0.0, deadline - time.monotonic())):
                return False
            self._in_step = False
        if not self.failure_seen:
            self.begin(self.step + 1)
            for k in range(len(self.buckets)):
                self._submit(k)
            if not self._done.wait(max(0.0, deadline - time.monotonic())):
                return False
            self._in_step = False
        self._error = None
        return True

    # --- per step -------------------------------------------------------------------
    def _reset(self, step: int) -> None:
        self._pending = {k: len(b) for k, b in enumerate(self.buckets)}
        self._submitted = set()
        self._results: Dict[str, torch.Tensor] = {}
        self._done = threading.Event()
        self._error: Optional[BaseException] = None
        self._stats = StepStats(step=step)
        self._in_step = False

    def _submit(self, k: int) -> None:
        if k not in self._submitted:
            self._submitted.add(k)
            self._q.put(("bucket", k))

    def _set_error(self, e: BaseException) -> None:
        """Keep the first error of the step (the one finish() raises)."""
        with self._error_lock:
            if self._error is None:
                self._error = e

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
        ready, nxt, step, sync = set(), 0, 0, False
        while True:
            kind, val = self._q.get()
            if kind == "step":
                ready, nxt, (step, sync) = set(), 0, val
                continue
            if kind == "stop":
                self._cq.put((None, None, None))
                return
            if kind == "call":
                job = None
                try:
                    job = self._encode(val.k, val.entries, val.step, val.stats,
                                       grads=val.grads, failure=val.failure)
                except BaseException as e:      # handed to the call's done()
                    val.error = e
                self._cq.put((val.k, job, val))
                continue
            ready.add(val)
            # Fixed bucket order on every rank: wait for bucket `nxt` even if later ones
            # are ready first.
            while nxt in ready:
                # Always encode, even after an error elsewhere: whether this rank joins the
                # bucket's collectives must never depend on another thread's timing.
                job = None
                try:
                    job = self._encode(nxt, self._entries[nxt], step, self._stats, sync)
                except BaseException as e:      # surfaced by finish()
                    self._set_error(e)
                self._cq.put((nxt, job, None))
                nxt += 1

    def _encode(self, k: int, entries: List[Entry], step: int, st: StepStats,
                sync: bool = False, grads: Optional[Dict[str, torch.Tensor]] = None,
                failure: Optional[BaseException] = None):
        for e in entries:
            st.compressors[e.name] = e.compressor.name
            st.fp32_bytes += 4 * e.param.numel()
        t0 = time.perf_counter()
        job = self.collective.encode(k, entries, step, st, sync, grads, failure)
        st.encode_s += time.perf_counter() - t0
        return job

    def _communicator(self) -> None:
        while True:
            k, job, call = self._cq.get()
            if k is None:
                self._dq.put((None, None, None))
                return
            if job is not None:                 # every bucket goes on the wire (see above)
                st = self._stats if call is None else call.stats
                try:
                    t0 = time.perf_counter()
                    self.collective.communicate(job, st)
                    st.comm_s += time.perf_counter() - t0
                except BaseException as e:      # surfaced by finish() / the call's done()
                    if call is None:
                        self._set_error(e)
                    else:
                        call.error = e
                    job = None                  # nothing to decode
            self._dq.put((k, job, call))

    def _decoder(self) -> None:
        while True:
            k, job, call = self._dq.get()
            if k is None:
                return
            if call is not None:
                self._finish_call(job, call)
                continue
            if job is not None and self._error is None:
                try:                            # local work only: may stop after an error
                    t0 = time.perf_counter()
                    self._results.update(self.collective.decode(job, self._stats))
                    self._stats.decode_s += time.perf_counter() - t0
                except BaseException as e:      # surfaced by finish()
                    self._set_error(e)
            if k == len(self.buckets) - 1:
                self._done.set()

    def _finish_call(self, job, call: _Call) -> None:
        results: Dict[str, torch.Tensor] = {}
        if job is not None and call.error is None:
            try:
                t0 = time.perf_counter()
                results = self.collective.decode(job, call.stats, call.out)
                call.stats.decode_s += time.perf_counter() - t0
            except BaseException as e:          # handed to the call's done()
                call.error, results = e, {}
        try:
            call.done(results, call.stats, call.error)
        except BaseException:                   # noqa: BLE001 - keep the thread alive
            logger.error("the done() of call %d (step %d) raised; dropped:\n%s", call.k,
                         call.step, traceback.format_exc())
