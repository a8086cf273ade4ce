"""Every hvdcomp compressor as a DistributedDataParallel communication hook.

    import hvdcomp.ddp
    ddp_model = torch.nn.parallel.DistributedDataParallel(model)
    state = hvdcomp.ddp.HookState(ddp_model, compression="alq:bits=3")
    ddp_model.register_comm_hook(state, hvdcomp.ddp.hook)

The hook sends the same messages as the drop-in optimizer (:mod:`hvdcomp.torch`) for the
same gradients, seed, step and rank: it drives the same exchange core
(:mod:`hvdcomp.exchange`: routing, Auto, the compressors, the handshake, the NaN policy,
ALQ/AMQ refits, LAQ's rule), with torch.distributed as the carrier
(:mod:`hvdcomp.transport.torch_dist`) and DDP's buckets in place of the optimizer's fusion
buckets.  Compressed tensors travel as real encoded bytes (Gloo on CPU, NCCL on GPU);
summable casts (``none``, ``fp16``, ``bf16``) through ``all_reduce``.

What the hook does with one DDP bucket (``hook(state, bucket)``):

1. On the first bucket of a step: a compressor that needs the parameter change (LAQ,
   Chen et al. 2018, Sec. 2) gets the previous step's ``sum ||theta_{k+1} - theta_k||^2``
   from the parameters it sees now, and the parameters are copied for the next step's;
   DGC (with an optimizer attached) gets each group's momentum factor.
2. Each parameter of the bucket is named (the model's ``named_parameters()``, as the
   optimizer names them).  A parameter whose ``.grad`` is None (unused on this rank, with
   ``find_unused_parameters=True``: DDP gives it a zero slot) is absent, as on the Horovod
   path: absent somewhere counts zeros from that rank (LAQ: its last upload stands; NDQSG:
   ValueError on every rank), absent everywhere leaves DDP's zeros.  For DGC's tensors the
   group's weight decay is added to the local gradient.  The bucket's gradient views go to
   the exchange, which returns at once; the hook returns a ``torch.futures.Future`` and
   backward goes on.
3. On the exchange's encode thread: each gradient encoded by the compressor routed to its
   tensor into one frame (summable tensors cast, flattened and ``all_reduce``-d).
4. On its communicate thread: every rank's frame over ``all_gather`` (the byte counts first,
   then the bytes; zero-length messages included).
5. On its decode thread: every rank's messages decoded in rank order, averaged in float32
   (a tensor non-finite on any rank is NaN on every rank), written into the bucket in its
   dtype (float32 buckets: decoded into the bucket itself, no copy); the Future completes
   with the bucket.  After the step's last bucket, an ALQ/AMQ
   that collected statistics refits (summed over ranks, fitted on rank 0, broadcast).

An encoder that raises on one rank sends an error frame instead: every rank's Future fails,
so backward raises on every rank (the failing rank its own exception, the others a
:class:`hvdcomp.RankFailure`, a RuntimeError, naming it) instead of hanging; so does a
rank that raises while preparing a bucket (its summed buffers carry its failure slot).
Ranks out of step (a rank that skipped a backward pass) raise :class:`hvdcomp.OutOfStep`.

Uneven inputs (``torch.distributed.algorithms.Join([ddp_model])``): a rank that has run out
of inputs shadows the others' buckets (DDP calls the hook outside any backward pass, with
zeros); the hook sends nothing for it.  With DDP's default
``divide_by_initial_world_size=True`` its gradients are absent (the average divides by the
world size, as DDP's own all-reduce does); with ``False`` the rank has joined and the
average divides by the ranks that have not (as ``hvd.join()``; ``last_stats.joined``).
LAQ cannot leave a rank out (it would reuse the joined rank's last upload): ValueError on
every rank in either case, as NDQSG's for any absent rank.  The DDP model given to
:class:`HookState` (or :func:`register`) says which; a state built from the bare module
divides by the world size.

Sparse gradients (``nn.Embedding`` / ``nn.EmbeddingBag`` with ``sparse=True``, trainable)
are refused when the state is set up (TypeError on every rank, naming the parameters): DDP
hands such a parameter to the hook as a sparse bucket, which the exchange cannot write back.
"""
import atexit
import itertools
import os
import threading
import weakref
from typing import Any, Dict, List, Optional, Set, Tuple

import torch
import torch.distributed as dist

from .auto import Auto, from_spec
from .compressors import ABSENT_LAST, Compressor
from .errors import ConfigError
from .exchange import Exchange, StepStats
from .exchange import momentum
from .exchange.buckets import agree_settings
from .transport.torch_dist import TorchDistAllreduce, TorchDistTransport, private_group

__all__ = ["HookState", "hook", "register", "check_backend"]

_FORMAT = 1          # state_dict layout version
_created = itertools.count()     # HookStates built in this process: the exchange id


def _as_compression(compression):
    """A compressor or Auto from what users pass (None: $HVDCOMP_COMPRESSION, else none)."""
    if compression is None:
        compression = os.environ.get("HVDCOMP_COMPRESSION") or "none"
    if isinstance(compression, str):
        comp, collective = from_spec(compression)      # "auto+SPEC" gives Auto(SPEC)
        if collective == "reduce_scatter":
            raise ConfigError(f"compression {compression!r}: the DDP hook sends over the "
                              f"allgather (torch.distributed has no variable-length "
                              f"all-to-all here); drop the 'rs+' prefix")
        return comp
    if isinstance(compression, (Auto, Compressor)):
        return compression
    raise TypeError(f"compression must be an hvdcomp compressor, an hvdcomp.Auto or a spec "
                    f"string such as 'alq:bits=3'; got {compression!r}")


def _spec(compression) -> str:
    """The compressor's (or Auto's) spec, as the ranks compare it."""
    try:
        return str(compression.spec())
    except Exception:                         # noqa: BLE001 - compared as its type
        return type(compression).__name__


def _inner(model) -> torch.nn.Module:
    """The module whose parameters are named: DDP's wrapped module, or ``model`` itself."""
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return model.module
    if isinstance(model, torch.nn.DataParallel):
        raise TypeError("hvdcomp.ddp works with DistributedDataParallel (one process per "
                        "device); torch.nn.DataParallel has no communication hooks")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"HookState needs the model (a torch.nn.Module, or the "
                        f"DistributedDataParallel wrapping it); got {type(model).__name__}")
    return model


def _sparse_names(module: torch.nn.Module, named: List[Tuple[str, torch.Tensor]]) -> List[str]:
    """Names of the trainable parameters that get sparse gradients: the weights of
    ``nn.Embedding`` / ``nn.EmbeddingBag`` modules with ``sparse=True`` (DDP's own rule)."""
    ids = {id(p): n for n, p in named}
    return sorted({ids[id(m.weight)] for m in module.modules()
                   if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag))
                   and m.sparse and id(m.weight) in ids})


def _in_backward() -> bool:
    """Whether the caller runs inside a backward pass (the autograd engine's current graph
    task; FSDP asks the same).  True where torch cannot tell."""
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is None or task() != -1


def check_backend(devices: Set[str], backend: str) -> None:
    """ValueError unless ``backend`` carries parameters on ``devices`` (device types): Gloo
    for CPU parameters, NCCL for CUDA ones, one device type."""
    if len(devices) > 1:
        raise ValueError(f"hvdcomp.ddp: parameters on several device types {sorted(devices)}")
    if "cuda" in devices and backend != "nccl":
        raise ValueError(f"hvdcomp.ddp: CUDA parameters need the nccl backend; the process "
                         f"group uses {backend!r}")
    if "cpu" in devices and backend != "gloo":
        raise ValueError(f"hvdcomp.ddp: CPU parameters need the gloo backend; the process "
                         f"group uses {backend!r}")


class HookState:
    """The state of :func:`hook`: the exchange (compressors with their statistics, level
    tables, residuals, momentum), the step counter and the last step's statistics.

    model: the model (or the DistributedDataParallel wrapping it); its trainable parameters,
      named by ``named_parameters()``, are what the hook exchanges.
    compression: a spec string ("alq:bits=3"; "auto+alq:bits=3" for Auto), an hvdcomp
      compressor or an ``hvdcomp.Auto``; None: $HVDCOMP_COMPRESSION, else "none".  A typo
      raises ConfigError listing the valid settings.
    process_group: DDP's process group (default: the default group); hvdcomp runs on two
      private groups with its ranks and backend (its threads' collectives never mix with
      DDP's).  Gloo for CPU parameters, NCCL for CUDA ones (ValueError otherwise).
    optimizer: needed with a compressor that applies momentum itself (DGC with momentum
      correction, Lin et al. 2018, Sec. 3.2): the hook is told the optimizer (an SGD), and,
      as the drop-in optimizer does (:mod:`hvdcomp.exchange.momentum`), hands each group's
      momentum factor to the compressor, folds its weight decay into the local gradient,
      keeps the compressor's tensors out of the SGD's own update (step pre/post hooks on
      the optimizer; its ``param_groups`` are left alone) and applies ``p -= lr * average``
      to them (``step(closure)``: the closure, whose backward is the exchange, runs
      before the gradients are set aside).  Without one, the first step raises
      RuntimeError (the SGD would apply its momentum a second time); Nesterov momentum,
      dampening or maximize: ValueError.  See :meth:`attach_optimizer`.
    seed: the shared seed of the Philox streams (checked equal on every rank).
    check_replicas: at the first step, compare a digest of the parameters' values across
      ranks and raise (:class:`hvdcomp.Mismatch`, every rank's backward) if they differ;
      False when they differ on purpose.  (DDP broadcasts rank 0's parameters when it
      wraps the model, so this catches parameters changed on some ranks afterwards.)
    min_compress_numel, compress_1d: tensors with fewer elements, and 1-D tensors unless
      compress_1d, travel uncompressed (as with the drop-in optimizer).
    allreduce_summable: summable tensors (``none``, ``fp16``, ``bf16``) through
      ``all_reduce`` (True) or as wire messages decoded in rank order (False: every average
      bit-identical to the drop-in optimizer's with the same setting).

    Construction is collective (private groups, the handshake, Auto's measurements) when
    torch.distributed is initialized; otherwise (PyTorch Lightning builds the process group
    after the strategy) it happens on the first hook call.  Every setting, the parameters'
    names, shapes, dtypes and devices and the group's backend are first agreed over one
    fixed channel (an ``all_gather`` on DDP's process group, before the private groups are
    made): ranks that disagree raise :class:`hvdcomp.Mismatch` (a RuntimeError) on every
    rank, naming each difference.  Every collective of the hook carries its step and
    HookState number (frames' stamps, summed buffers' per-rank slots): ranks out of step
    raise :class:`hvdcomp.OutOfStep` on every rank.

    ``last_stats``: the last step's :class:`~hvdcomp.exchange.StepStats` (bytes sent, ratio,
    tensors made NaN, timings), complete once backward has returned.  ``step``: the number
    of exchanges done (the step of the messages' headers and Philox keys).
    """

    def __init__(self, model, compression=None, *, process_group=None, optimizer=None,
                 seed: int = 0, min_compress_numel: int = 1024, compress_1d: bool = False,
                 allreduce_summable: bool = True, check_replicas: bool = True):
        module = _inner(model)
        self._ident = next(_created)
        self._named: List[Tuple[str, torch.Tensor]] = [
            (n, p) for n, p in module.named_parameters() if p.requires_grad]
        self._sparse = _sparse_names(module, self._named)
        # the DDP model, when given: its Join setting (divide_by_initial_world_size)
        self._ddp = (weakref.ref(model) if isinstance(
            model, torch.nn.parallel.DistributedDataParallel) else None)
        self._compression = _as_compression(compression)
        self._settings = dict(seed=int(seed), min_compress_numel=int(min_compress_numel),
                              compress_1d=bool(compress_1d))
        self._summable = bool(allreduce_summable)
        self._check_replicas = bool(check_replicas)
        self._pg = process_group
        self._optimizer = None
        self._pending_optimizer = optimizer
        self._corrected: Dict[str, torch.Tensor] = {}
        self._opt_hooks: list = []
        self._hidden: Dict[str, torch.Tensor] = {}
        self._groups: Dict[int, dict] = {}
        self._loaded: Optional[Dict[str, Any]] = None
        self.exchange: Optional[Exchange] = None
        self.step = 0
        self.last_stats: Optional[StepStats] = None
        self._in_step = False
        self._joined = False                # this step: DDP's Join shadow calls
        self._seen = 0
        self._step_stats = StepStats()
        self._in_flight = 0                 # calls handed to the exchange, not yet done
        self._lock = threading.Lock()
        if dist.is_available() and dist.is_initialized():
            self.setup()

    # --- set-up -----------------------------------------------------------------------
    def setup(self) -> None:
        """Build the exchange (collective; done at construction when torch.distributed is
        initialized, else by the first hook call).  Nothing if already built.

        Raises RuntimeError without torch.distributed or when the ranks disagree (the
        handshake), ValueError for parameters the process group's backend cannot carry or
        an optimizer the compressor cannot share momentum with.
        """
        if self.exchange is not None:
            return
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("hvdcomp.ddp: torch.distributed is not initialized; call "
                               "torch.distributed.init_process_group first (torchrun sets "
                               "its environment)")
        group = self._pg or dist.group.WORLD
        devices = {p.device.type for _, p in self._named}
        # Every setting, agreed over one fixed channel (DDP's group) before anything that
        # depends on them: making the private groups is itself collective, so ranks that
        # differ in any setting are reported instead of hanging.
        agree_settings(TorchDistTransport(group), {
            "launcher": "hvdcomp.ddp.HookState", "HookState number": self._ident,
            "compression": _spec(self._compression), "backend": dist.get_backend(group),
            "devices": sorted(devices), "allreduce_summable": self._summable,
            "check_replicas": self._check_replicas, **self._settings,
            "parameters": [[n, list(p.shape), str(p.dtype)] for n, p in self._named],
            "sparse gradients": self._sparse},
            "the DDP hook settings")
        if self._sparse:                      # (every rank alike: agreed above)
            raise TypeError(
                f"hvdcomp.ddp: {self._sparse} get sparse gradients (nn.Embedding or "
                f"nn.EmbeddingBag with sparse=True); the DDP hook averages dense buckets "
                f"only: build them with sparse=False (DDP then hands the hook their dense "
                f"gradients), or train them with the drop-in optimizer (hvdcomp.torch), "
                f"which sends sparse gradients as indices and values")
        check_backend(devices, dist.get_backend(group))
        transport = TorchDistTransport(private_group(group))
        sums = private_group(group)
        self.exchange = Exchange(self._named, self._compression, transport,
                                 allreduce=TorchDistAllreduce(sums) if self._summable else None,
                                 fusion_bytes=None, ident=self._ident,
                                 check_replicas=self._check_replicas,
                                 collective="allgather",     # torch_dist has no all-to-all
                                 **self._settings)
        self._sums_group = sums
        self._names = {id(p): n for n, p in self._named}
        atexit.register(_stop_at_exit, weakref.ref(self))
        if self._pending_optimizer is not None:
            opt, self._pending_optimizer = self._pending_optimizer, None
            self.attach_optimizer(opt)
        if self._loaded is not None:
            loaded, self._loaded = self._loaded, None
            self.load_state_dict(loaded)

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Tell the state the optimizer that applies the averaged gradients (before the
        first step).  With a compressor that applies momentum itself (DGC) and an SGD, the
        rules of :mod:`hvdcomp.exchange.momentum`: per step the groups' momentum factors go
        to the compressor and their weight decay into the local gradient, and the SGD's
        step (through its step pre/post hooks) leaves the compressor's tensors to the
        hook's ``p -= lr * average``; ``param_groups`` are not altered.  ValueError for
        Nesterov momentum, dampening or maximize; TypeError for a non-optimizer.  Other
        compressors need no optimizer (it is only remembered).  Collective when
        torch.distributed is initialized (it sets the state up)."""
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"attach_optimizer needs a torch.optim.Optimizer; got "
                            f"{type(optimizer).__name__}")
        if self.exchange is None:
            self._pending_optimizer = optimizer
            if dist.is_available() and dist.is_initialized():
                self.setup()                  # attaches it
            return
        corrected = momentum.corrected(self.compression, self.exchange.entries, optimizer)
        for h in self._opt_hooks:
            h.remove()
        self._optimizer, self._corrected, self._opt_hooks = optimizer, corrected, []
        if corrected:
            self._opt_hooks = [optimizer.register_step_pre_hook(self._before_opt_step),
                               optimizer.register_step_post_hook(self._after_opt_step)]

    def _before_opt_step(self, optimizer, args, kwargs):
        # A closure (zero_grad, backward) must run before the gradients are hidden: its
        # backward pass is the exchange.  Run it here and hand the step its loss.  (args[0]
        # is the optimizer itself: the hook sees step's own arguments.)
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
            if "closure" in kwargs:
                kwargs = dict(kwargs, closure=lambda: loss)
            else:
                args = (args[0], lambda: loss) + tuple(args[2:])
        self._hidden = momentum.hide(self._corrected)
        return tuple(args), kwargs

    def _after_opt_step(self, optimizer, args, kwargs) -> None:
        hidden, self._hidden = self._hidden, {}
        momentum.restore(self._corrected, hidden)
        if hidden:                            # DGC: p -= lr * the averaged update
            momentum.apply_hidden(self._corrected, hidden,
                                  momentum.groups_by_param(optimizer.param_groups))

    # --- what users read --------------------------------------------------------------
    @property
    def compression(self) -> Compressor:
        """The compressor (with Auto, Auto's compressor)."""
        c = self._compression
        return self.exchange.compression if self.exchange is not None else (
            c.compressor if isinstance(c, Auto) else c)

    @property
    def plan(self) -> Dict[str, str]:
        """{parameter name: the compressor its gradient travels with} (after setup)."""
        self.setup()
        return self.exchange.plan.compressor_names()

    # --- one DDP bucket ---------------------------------------------------------------
    # (no `from __future__ import annotations` in this module: DDP compares the hook's
    # annotations with dist.GradBucket and torch.futures.Future[torch.Tensor])
    def _prepare(self, names, params, grads) -> Dict[str, Optional[torch.Tensor]]:
        """The bucket's gradients as the exchange takes them ({name: view, None if absent}),
        starting the step on its first bucket."""
        if not self._in_step:
            self._begin_step()
        # What this rank has: DDP passes a zero slot for a parameter this rank did not use
        # (find_unused_parameters), whose .grad is then still None; it is absent, as on the
        # Horovod path (averaging.py: absent somewhere counts zeros, except LAQ / NDQSG).
        # A rank that has joined (DDP's Join) has nothing (module docstring).
        mine: Dict[str, Optional[torch.Tensor]] = {}
        if self._joined:
            return {n: None for n in names}
        for n, p, g in zip(names, params, grads):
            mine[n] = g if p.grad is not None else None
            if n in self._corrected:                 # DGC: weight decay on the local gradient
                momentum.fold_weight_decay(p, mine[n], self._groups[id(p)])
        return mine

    def _begin_step(self) -> None:
        ex = self.exchange
        self._step_stats = StepStats(step=self.step)
        self._seen = 0
        self._in_step = True                    # (also if a check below raises)
        # DDP's Join: a rank out of inputs calls the hook outside backward (with zeros)
        self._joined = not _in_backward()
        ex.set_joined(self._joined and not self._divide_by_world_size())
        if momentum.handles_momentum(ex.compression) and self._optimizer is None:
            raise RuntimeError(
                f"hvdcomp.ddp: {ex.compression.name} applies momentum correction itself "
                f"(Lin et al. 2018, Sec. 3.2), so the optimizer's momentum must be off for "
                f"its tensors: pass optimizer= to HookState or call "
                f"state.attach_optimizer(optimizer) before the first step (Lightning: in "
                f"configure_optimizers), or use {ex.compression.name}:momentum_correction="
                f"False")
        if self._corrected:
            self._groups = momentum.groups_by_param(self._optimizer.param_groups)
            ex.compression.set_momentum(momentum.momentum_factors(self._corrected,
                                                                  self._groups))
        ex.report_param_deltas(self.step - 1)   # LAQ: the update since the last step
        ex.before_step()

    def _divide_by_world_size(self) -> bool:
        """Under DDP's Join: whether the average divides by the world size (DDP's
        ``divide_by_initial_world_size``, default True; always True without the DDP model),
        so that a joined rank is absent rather than joined.  False for LAQ, which cannot
        leave a rank out (it raises on every rank)."""
        if self.exchange.compression.absent_rank == ABSENT_LAST:
            return False
        ddp = self._ddp() if self._ddp is not None else None
        return bool(getattr(ddp, "_divide_by_initial_world_size", True))

    def _exchange_bucket(self, bucket: dist.GradBucket) -> torch.futures.Future:
        self.setup()
        ex = self.exchange
        # the first step: the parameters' digests compared (every rank alike, before anything
        # that could raise on some ranks only; a Mismatch raises on every rank)
        ex.check_replicas_once()
        grads = bucket.gradients()
        names = []
        for p in bucket.parameters():
            n = self._names.get(id(p))
            if n is None:
                raise RuntimeError(
                    f"hvdcomp.ddp.hook: DDP's bucket {bucket.index()} holds a parameter of "
                    f"shape {tuple(p.shape)} that is not a trainable parameter of the model "
                    f"this HookState was built from; build it from the model DDP wraps")
            names.append(n)
        # Anything raised from here on (as any error of the exchange) fails every rank's
        # backward: the call still takes part in the bucket's collectives (Exchange.call)
        failure: Optional[BaseException] = None
        try:
            if bucket.buffer().is_sparse:     # (refused at set-up, unless DDP guessed more)
                raise TypeError(f"hvdcomp.ddp.hook: the gradient of {names} is sparse; the "
                                f"hook averages dense buckets only (use sparse=False, or "
                                f"the drop-in optimizer)")
            mine = self._prepare(names, bucket.parameters(), grads)
        except Exception as e:                       # noqa: BLE001 - raised on every rank
            failure, mine = e, {}
        # The step's last bucket: DDP's last index, or the one that completes the model (in
        # the first iteration with static_graph=True, every bucket reports index 0).
        self._seen += len(names)
        last = bucket.is_last() or self._seen >= len(self._named)
        step, buffer = self.step, bucket.buffer()
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
            self._merge(stats)
            if last:
                try:                              # every rank, whatever happened above
                    ex.refit_levels(step)
                except BaseException as e:       # noqa: BLE001 - handed to the Future
                    error = error or e
                self.last_stats = self._step_stats
            with self._lock:
                self._in_flight -= 1
            if error is None:
                fut.set_result(buffer)
            else:
                fut.set_exception(error)

        with self._lock:
            self._in_flight += 1
        # float32 buckets: the averages are decoded straight into the bucket's views
        # (Exchange.call's ``out``: read by the encoder before the decoder writes them)
        out = {n: g for n, g in zip(names, grads)
               if g.dtype == torch.float32 and g.is_contiguous()}
        ex.call(bucket.index(), names, mine, step, done, failure, out)
        if last:
            self._in_step = False
            self.step += 1
        # Future.set_exception stores the exception as the value for Python's wait() to
        # raise; DDP's reducer waits in C++, where only an error set by a failing callback
        # is an error: chain one that re-raises it.
        return fut.then(_value)

    def _merge(self, st: StepStats) -> None:
        acc = self._step_stats
        acc.bytes_sent += st.bytes_sent
        acc.fp32_bytes += st.fp32_bytes
        acc.recv_bytes += st.recv_bytes
        acc.traffic_bytes += st.traffic_bytes
        acc.compressors.update(st.compressors)
        acc.nonfinite.extend(st.nonfinite)
        acc.events.extend(st.events)
        acc.joined = max(acc.joined, st.joined)
        acc.encode_s += st.encode_s
        acc.comm_s += st.comm_s
        acc.decode_s += st.decode_s
        acc.reduce_s += st.reduce_s

    # --- checkpoints ------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """Everything the hook remembers, to resume bit-exactly: the step, the compressor's
        state (level tables, residuals, momentum, LAQ's aggregates) and, for LAQ, the
        parameters of the last step (the next step's parameter change is measured against
        them).  Residuals are per rank: save one checkpoint per rank
        (``torch.save(state.state_dict(), f"hook.{rank}.pt")``).  Call between steps
        (RuntimeError during backward)."""
        self.setup()
        if self._in_step:
            raise RuntimeError("HookState.state_dict() during a step: call it after backward")
        ex = self.exchange
        before = ex.params_before
        return {"format": _FORMAT, "rank": ex.rank, "world_size": ex.size, "step": self.step,
                "compression": self.compression.spec(),
                "compressor_state": self.compression.state_dict(),
                "params_before": None if before is None else [b.clone() for b in before]}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s result (before the first step; kept until setup if
        torch.distributed is not initialized yet).  ValueError for another rank's or
        world size's checkpoint, or another compressor's."""
        if self.exchange is None and not (dist.is_available() and dist.is_initialized()):
            self._loaded = dict(state)
            return
        self.setup()
        ex = self.exchange
        if state.get("format") != _FORMAT:
            raise ValueError(f"not a HookState checkpoint (format {state.get('format')!r})")
        if (state["rank"], state["world_size"]) != (ex.rank, ex.size):
            raise ValueError(f"checkpoint of rank {state['rank']} of {state['world_size']}, "
                             f"this is rank {ex.rank} of {ex.size}: save and load one "
                             f"checkpoint per rank (residuals are per rank)")
        if state["compression"].split(":")[0] != self.compression.name:
            raise ValueError(f"checkpoint was saved with compression "
                             f"{state['compression']!r}, this state uses "
                             f"{self.compression.spec()!r}")
        self.compression.load_state_dict(state["compressor_state"])
        self.step = int(state["step"])
        before = state["params_before"]
        ex.params_before = None if before is None else [
            b.to(e.param.device, copy=True) for b, e in zip(before, ex.entries.values())]

    def close(self) -> None:
        """Stop the exchange's threads and free its buffers and process groups (between
        steps; the hook cannot run afterwards)."""
        if self.exchange is not None:
            self.exchange.close()
            dist.destroy_process_group(self.exchange.transport.group)
            dist.destroy_process_group(self._sums_group)
            self.exchange = None


def _stop_at_exit(ref) -> None:
    """Stop the exchange's threads when the interpreter exits (daemon threads still alive
    while it finalizes can abort the process), unless a call is in flight (its collective
    may wait for a rank that is gone: leave it to the process's end)."""
    state = ref()
    if state is not None and state.exchange is not None and state._in_flight == 0:
        state.exchange.close()
        state.exchange = None


def _value(fut: torch.futures.Future) -> torch.Tensor:
    return fut.value()


def hook(state: "HookState", bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: average the bucket's gradients across ranks with ``state``'s
    compressor, sending real encoded bytes; returns a Future of the averaged bucket without
    waiting (module docstring: the steps).

    Example::

        >>> state = hvdcomp.ddp.HookState(ddp_model, compression="alq:bits=3")
        >>> ddp_model.register_comm_hook(state, hvdcomp.ddp.hook)

    Raises TypeError when called with something other than a DDP GradBucket (e.g.
    registered on FSDP); the Future fails (every rank's) when a rank fails to encode or a
    message is malformed.
    """
    if not isinstance(state, HookState):
        raise TypeError(f"hvdcomp.ddp.hook needs a hvdcomp.ddp.HookState as its state; got "
                        f"{type(state).__name__}")
    if not isinstance(bucket, dist.GradBucket):
        raise TypeError(f"hvdcomp.ddp.hook is a DistributedDataParallel communication hook "
                        f"(it takes a GradBucket); got {type(bucket).__name__}")
    return state._exchange_bucket(bucket)


def register(ddp_model, compression=None, **kwargs) -> HookState:
    """``HookState(ddp_model, compression, **kwargs)`` registered on ``ddp_model``; returns
    the state.  TypeError unless ``ddp_model`` is a DistributedDataParallel."""
    if not isinstance(ddp_model, torch.nn.parallel.DistributedDataParallel):
        raise TypeError(f"hvdcomp.ddp.register needs a DistributedDataParallel module; got "
                        f"{type(ddp_model).__name__} (wrap the model in DDP first)")
    kwargs.setdefault("process_group", ddp_model.process_group)
    state = HookState(ddp_model, compression, **kwargs)
    ddp_model.register_comm_hook(state, hook)
    return state
