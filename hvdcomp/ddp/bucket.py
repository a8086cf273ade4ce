"""One DDP bucket through the exchange: GradBucket in, Future out (:func:`exchange_bucket`,
the body of :func:`hvdcomp.ddp.hook`).  The step is the HookState's
(:mod:`hvdcomp.ddp.state`): its first bucket begins it (:func:`prepare`, :func:`begin_step`),
its last one ends it (ALQ/AMQ's refit: :meth:`hvdcomp.exchange.driver.Driver.call_done`).

No ``from __future__ import annotations`` here or in :mod:`hvdcomp.ddp`: DDP compares the
hook's annotations with dist.GradBucket and torch.futures.Future[torch.Tensor].
"""
from typing import Dict, Optional

import torch
import torch.distributed as dist

from ..compressors import ABSENT_LAST
from ..exchange.backward import graph_task, in_backward

__all__ = ["exchange_bucket", "prepare", "begin_step", "value"]


def exchange_bucket(state, bucket: dist.GradBucket) -> torch.futures.Future:
    """:func:`hvdcomp.ddp.hook`'s work: the bucket handed to the exchange (one
    :meth:`~hvdcomp.exchange.Exchange.call`), a Future completed with the averaged bucket
    on the exchange's decode thread."""
    state.setup()
    ex = state.exchange
    # the first step: the parameters' digests compared (every rank alike, before anything
    # that could raise on some ranks only; a Mismatch raises on every rank)
    ex.check_replicas_once()
    grads = bucket.gradients()
    names = []
    for p in bucket.parameters():
        n = state._names.get(id(p))
        if n is None:
            raise RuntimeError(
                f"hvdcomp.ddp.hook: DDP's bucket {bucket.index()} holds a parameter of "
                f"shape {tuple(p.shape)} that is not a trainable parameter of the model "
                f"this HookState was built from; build it from the model DDP wraps")
        names.append(n)
    _check_one_wrapper(state, names)
    # Anything raised from here on (as any error of the exchange) fails every rank's
    # backward: the call still takes part in the bucket's collectives (Exchange.call)
    failure: Optional[BaseException] = None
    try:
        if bucket.buffer().is_sparse:     # (refused at set-up, unless DDP guessed more)
            raise TypeError(f"hvdcomp.ddp.hook: the gradient of {names} is sparse; the "
                            f"hook averages dense buckets only (use sparse=False, or "
                            f"the drop-in optimizer)")
        mine = prepare(state, names, bucket.parameters(), grads)
    except Exception as e:                       # noqa: BLE001 - raised on every rank
        failure, mine = e, {}
    # The step's last bucket: DDP's last index, or the one that completes the model (in
    # the first iteration with static_graph=True, every bucket reports index 0).
    state._seen += len(names)
    last = bucket.is_last() or state._seen >= len(state._named)
    driver, buffer = state._driver, bucket.buffer()
    step = driver.step
    fut = torch.futures.Future(devices=[buffer.device] if buffer.is_cuda else None)

    def done(results, stats, error):
        try:
            if error is None:
                for n, g in zip(names, grads):
                    avg = results.get(n)
                    # None: no rank had it (DDP: zeros); decoded into g itself: no copy
                    if avg is not None and avg.data_ptr() != g.data_ptr():
                        g.copy_(avg.view(g.shape))
        except BaseException as e:           # noqa: BLE001 - handed to the Future
            error = e
        try:          # stats merged; after the last call, every rank's refit (ALQ/AMQ)
            driver.call_done(stats, last, step)
        except BaseException as e:           # noqa: BLE001 - handed to the Future
            error = error or e
        with state._lock:
            state._in_flight -= 1
        if error is None:
            fut.set_result(buffer)
        else:
            fut.set_exception(error)

    with state._lock:
        state._in_flight += 1
    # float32 buckets: the averages are decoded straight into the bucket's views
    # (Exchange.call's ``out``: read by the encoder before the decoder writes them)
    out = {n: g for n, g in zip(names, grads)
           if g.dtype == torch.float32 and g.is_contiguous()}
    ex.call(bucket.index(), names, mine, step, done, failure, out)
    if last:
        state._in_step = False
        state._last_task = state._step_task
        driver.step += 1
    # Future.set_exception stores the exception as the value for Python's wait() to
    # raise; DDP's reducer waits in C++, where only an error set by a failing callback
    # is an error: chain one that re-raises it.
    return fut.then(value)


def _check_one_wrapper(state, names) -> None:
    """RuntimeError when a second DDP wrapper calls the hook with the same state in the
    same backward pass (the state registered on two DDP wrappers, both run forward): a
    parameter handed twice in one step, or a second step begun in the backward pass that
    began the previous one.  (Two wrappers used in turn, one per backward pass, are one
    wrapper at a time: that works.)  Every rank alike: raised from every rank's hook."""
    task = graph_task()
    if not state._in_step:
        twice = task != -1 and task == state._last_task
        state._step_names, state._step_task = set(), task
    else:
        twice = not state._step_names.isdisjoint(names)
    if twice:
        raise RuntimeError(
            "hvdcomp.ddp: this HookState exchanged the same parameters twice in one "
            "backward pass: it is registered on two DistributedDataParallel wrappers of "
            "the same module that both ran forward.  One HookState serves one DDP "
            "wrapper: build a HookState for each (HookState(ddp_model, ...)), or run "
            "forward through one wrapper only")
    state._step_names.update(names)


def prepare(state, names, params, grads) -> Dict[str, Optional[torch.Tensor]]:
    """The bucket's gradients as the exchange takes them ({name: view, None if absent}),
    starting the step on its first bucket (:func:`begin_step`)."""
    if not state._in_step:
        begin_step(state)
    # What this rank has: DDP passes a zero slot for a parameter this rank did not use
    # (find_unused_parameters), whose .grad is then still None; it is absent, as on the
    # Horovod path (averaging.py: absent somewhere counts zeros, except LAQ / NDQSG).
    # A rank that has joined (DDP's Join) has nothing (module docstring).
    mine: Dict[str, Optional[torch.Tensor]] = {}
    if state._joined:
        return {n: None for n in names}
    for n, p, g in zip(names, params, grads):
        mine[n] = g if p.grad is not None else None
        state._driver.momentum.fold_weight_decay(n, p, mine[n])   # DGC: local gradient
    return mine


def begin_step(state) -> None:
    """The step's first bucket: DDP's Join (a rank out of inputs calls the hook outside
    backward, with zeros), then the driver's step (DGC's momentum, RuntimeError without
    an optimizer; LAQ's parameter change)."""
    state._seen = 0
    state._in_step = True                    # (also if a check below raises)
    state._joined = not in_backward()
    state._driver.begin_calls(state._joined and not _divide_by_world_size(state))


def _divide_by_world_size(state) -> bool:
    """Under DDP's Join: whether the average divides by the world size (DDP's
    ``divide_by_initial_world_size``, default True; always True without the DDP model),
    so that a joined rank is absent rather than joined.  False for LAQ, which cannot
    leave a rank out (it raises on every rank)."""
    if state.exchange.compression.absent_rank == ABSENT_LAST:
        return False
    ddp = state._ddp() if state._ddp is not None else None
    return bool(getattr(ddp, "_divide_by_initial_world_size", True))


def value(fut: torch.futures.Future) -> torch.Tensor:
    return fut.value()
