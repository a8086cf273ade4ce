"""The DDP hook's state (:class:`HookState`): the settings, the set-up over
torch.distributed, DGC's optimizer, checkpoints; the lifecycle itself is
:class:`hvdcomp.exchange.driver.Driver`'s."""
import atexit
import itertools
import threading
import weakref
from typing import Any, Dict, List, Optional, Set, Tuple

import torch
import torch.distributed as dist

from ..errors import ConfigError
from ..exchange import Exchange
from ..exchange.driver import Driver, Reports, Settings, merge_hierarchy, resolve
from ..exchange.owners import Door, Owner, agree, take_over
from ..transport.torch_dist import TorchDistAllreduce, TorchDistTransport, private_group
from .model import check_backend, inner_module, sparse_names

__all__ = ["HookState"]

_created = itertools.count()     # HookStates built in this process: the exchange id
#: The HookStates set up and not closed, by number: held until closed (or replaced), so
#: that every rank sees the same ones when a new HookState replaces an old one (a garbage
#: collection at different moments on different ranks must not decide it).
_open: Dict[int, "HookState"] = {}


class HookState(Reports, Owner):
    """The state of :func:`hook`: the exchange (compressors with their statistics, level
    tables, residuals, momentum), the step counter and the last step's statistics.

    model: the model (or the DistributedDataParallel wrapping it); its trainable parameters,
      named by ``named_parameters()``, are what the hook exchanges.
    compression, seed, min_compress_numel, compress_1d, allreduce_summable,
      check_replicas, hierarchy: as :class:`hvdcomp.exchange.driver.Settings` says (the
      same settings as the drop-in optimizer's; hierarchy: with several ranks per host,
      compress only across hosts, over private process groups per host and per local
      rank); the collective is the allgather ("rs+" in the spec: ConfigError).  A typo in
      the spec raises ConfigError, before any collective.
    process_group: DDP's process group (default: the default group); hvdcomp runs on two
      private groups with its ranks and backend (its threads' collectives never mix with
      DDP's).  Gloo for CPU parameters, NCCL for CUDA ones (ValueError otherwise).
    optimizer: needed with a compressor that applies momentum itself (DGC, Lin et al.
      2018, Sec. 3.2; an SGD): see :meth:`attach_optimizer`.  Without one, the first step
      raises RuntimeError (the SGD would apply its momentum a second time).

    Construction is collective (private groups, the handshake, Auto's measurements) when
    torch.distributed is initialized; otherwise (PyTorch Lightning builds the process group
    after the strategy) it happens on the first hook call.  Every setting, the parameters'
    names, shapes, dtypes and devices and the group's backend are first agreed over one
    fixed channel (an ``all_gather`` on DDP's process group): ranks that disagree raise
    :class:`hvdcomp.Mismatch` (a RuntimeError) on every rank, naming each difference.

    A HookState set up on parameters that an open HookState exchanges replaces it (the
    old one is closed: threads stopped, process groups destroyed; a hook call on it raises
    RuntimeError); ValueError if the old one also holds parameters the new one does not.
    One HookState serves one DDP wrapper at a time (RuntimeError when two wrappers call it
    in one backward pass).  Pickling and copying: before set-up only (TypeError after:
    save :meth:`state_dict`).  docs/semantics.md, "Objects built again, re-wrapped or
    copied".

    ``last_stats``, ``step``, ``plan``, ``specs``, ``paths``, ``compression``: as their docstrings say.
    """

    DOOR = Door(
        label="HookState", prefix="hvdcomp.ddp: ",
        use_new="run backward through the DDP wrapper that one is registered on (a DDP "
                "wrapper takes one communication hook: to use a new HookState, wrap the "
                "module in a new DDP)",
        rebuild="build the new HookState on the whole model",
        closed="(threads stopped, process groups destroyed); its state (step, residuals, "
               "levels) is not carried over (new.load_state_dict(old.state_dict()) before "
               "closing carries it)",
        copy="an hvdcomp.ddp.HookState cannot be pickled, copied or deep-copied once set up: "
             "it holds a live exchange (threads, process groups).  Save state.state_dict() "
             "(one file per rank: torch.save(state.state_dict(), f'hook.{rank}.pt')) and "
             "load it with HookState(model, ...).load_state_dict(...)")

    def __init__(self, model, compression=None, *, process_group=None, optimizer=None,
                 seed: int = 0, min_compress_numel: int = 1024, compress_1d: bool = False,
                 allreduce_summable: bool = True, check_replicas: bool = True,
                 hierarchy: Optional[str] = None):
        module = inner_module(model)
        self._ident = next(_created)
        self._named: List[Tuple[str, torch.Tensor]] = [
            (n, p) for n, p in module.named_parameters() if p.requires_grad]
        self._sparse = sparse_names(module, self._named)
        # the DDP model, when given: its Join setting (divide_by_initial_world_size)
        self._ddp = (weakref.ref(model) if isinstance(
            model, torch.nn.parallel.DistributedDataParallel) else None)
        comp, collective = resolve(compression)     # a typo: ConfigError, no collective
        hierarchy = merge_hierarchy(hierarchy, compression)
        if collective == "reduce_scatter":
            raise ConfigError(f"compression {compression!r}: the DDP hook sends over the "
                              f"allgather (torch.distributed has no variable-length "
                              f"all-to-all here); drop the 'rs+' prefix")
        self._settings = Settings(
            compression=comp, collective="allgather", seed=seed,
            min_compress_numel=min_compress_numel, compress_1d=compress_1d,
            allreduce_summable=allreduce_summable, check_replicas=check_replicas,
            fusion_bytes=None,                        # DDP forms the buckets
            hierarchy=hierarchy)
        self._pg = process_group
        self._pending_optimizer = optimizer
        self._loaded: Optional[Dict[str, Any]] = None
        self._driver: Optional[Driver] = None
        self._in_step = False
        self._joined = False                # this step: DDP's Join shadow calls
        self._seen = 0
        self._in_flight = 0                 # calls handed to the exchange, not yet done
        self._step_names: Set[str] = set()  # parameters handed to this step's calls
        self._step_task = -1                # the backward pass (graph task) of this step
        self._last_task = -1                # ... of the step before
        self._lock = threading.Lock()
        if dist.is_available() and dist.is_initialized():
            self.setup()

    # --- copies ------------------------------------------------------------------------
    def __getstate__(self):
        """Pickling and copying: only before set-up (the settings, the parameters, a
        checkpoint loaded: e.g. a state handed to Lightning's strategy, which spawns its
        processes first); TypeError once the exchange is live (threads, process groups)."""
        if self._driver is not None or self._closed:
            raise self._copy_refused()
        d = dict(self.__dict__)
        del d["_lock"]
        return d

    def __setstate__(self, d) -> None:
        self.__dict__.update(d)
        self._lock = threading.Lock()

    # --- set-up -----------------------------------------------------------------------
    def setup(self) -> None:
        """Build the exchange (collective; done at construction when torch.distributed is
        initialized, else by the first hook call).  Nothing if already built.

        Raises RuntimeError without torch.distributed or when the ranks disagree (the
        handshake), ValueError for parameters the process group's backend cannot carry or
        an optimizer the compressor cannot share momentum with.
        """
        if self._driver is not None:
            return
        self._check_open()
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("hvdcomp.ddp: torch.distributed is not initialized; call "
                               "torch.distributed.init_process_group first (torchrun sets "
                               "its environment)")
        group = self._pg or dist.group.WORLD
        devices = {p.device.type for _, p in self._named}
        backend = dist.get_backend(group)
        # Every setting, agreed over one fixed channel (DDP's group) before anything that
        # depends on them: making the private groups is itself collective, so ranks that
        # differ in any setting are reported instead of hanging.  An open HookState that
        # exchanges some of these parameters (built again for a new DDP wrapper of the same
        # module) is replaced, once the ranks agree on it.
        old = agree(
            self._settings, TorchDistTransport(group), "the DDP hook settings",
            (o for _, o in sorted(_open.items())), self._named, self._ident,
            launcher="hvdcomp.ddp.HookState", backend=backend, devices=sorted(devices),
            **{"HookState number": self._ident, "sparse gradients": self._sparse})
        take_over(old, self._ident, dist.get_rank())     # (every rank alike: agreed above)
        if self._sparse:                      # (every rank alike: agreed above)
            raise TypeError(
                f"hvdcomp.ddp: {self._sparse} get sparse gradients (nn.Embedding or "
                f"nn.EmbeddingBag with sparse=True); the DDP hook averages dense buckets "
                f"only: build them with sparse=False (DDP then hands the hook their dense "
                f"gradients), or train them with the drop-in optimizer (hvdcomp.torch), "
                f"which sends sparse gradients as indices and values")
        check_backend(devices, backend)
        # (private groups: destroyed by close())
        transport = TorchDistTransport(private_group(group))
        self._driver = Driver(self._named, self._settings, transport,
                              TorchDistAllreduce(private_group(group)), ident=self._ident,
                              owns_carriers=True)
        self._names = {id(p): n for n, p in self._named}
        _open[self._ident] = self
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
        if self._driver is None:
            self._pending_optimizer = optimizer
            if dist.is_available() and dist.is_initialized():
                self.setup()                  # attaches it
            return
        self._driver.momentum.attach(optimizer, hook_steps=True)

    # --- what users read (and Reports' properties) --------------------------------------
    def _built(self) -> Driver:
        self.setup()
        return self._driver

    @property
    def exchange(self) -> Optional[Exchange]:
        """The :class:`~hvdcomp.exchange.Exchange` (None before set-up and after close)."""
        return self._driver.exchange if self._driver is not None else None

    @property
    def step(self) -> int:
        """The number of exchanges done: the step of the next messages' headers and Philox
        keys."""
        return self._driver.step if self._driver is not None else 0

    @step.setter
    def step(self, value: int) -> None:
        self.setup()
        self._driver.step = int(value)

    # --- checkpoints ------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """Everything the hook remembers, to resume bit-exactly: the step, the compressor's
        state (level tables, residuals, momentum, LAQ's aggregates) and, for LAQ, the
        parameters of the last step (the next step's parameter change is measured against
        them): :meth:`hvdcomp.exchange.driver.Driver.state_dict`, with this rank and the
        world size.  Residuals are per rank: save one checkpoint per rank
        (``torch.save(state.state_dict(), f"hook.{rank}.pt")``).  Call between steps
        (RuntimeError during backward)."""
        self.setup()
        if self._in_step:
            raise RuntimeError("HookState.state_dict() during a step: call it after backward")
        return self._driver.rank_state_dict()

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s result (before the first step; kept until setup if
        torch.distributed is not initialized yet).  ValueError for another rank's checkpoint
        of a world of this size, or another compressor's.  A checkpoint of another world
        size (an elastic restart that resized the job; any rank's) keeps the step and the
        shared state and resets the per-rank state, with a warning
        (:meth:`hvdcomp.exchange.driver.Driver.load_state_dict`)."""
        if self._driver is None and not (dist.is_available() and dist.is_initialized()):
            self._loaded = dict(state)
            return
        self.setup()
        self._driver.load_rank_state_dict(state, self.DOOR.label)

    def close(self) -> None:
        """Stop the exchange's threads and free its buffers and process groups (between
        steps; the hook cannot run afterwards: RuntimeError).  A new HookState built on
        the same parameters closes the old one itself."""
        self._closed = True
        _open.pop(self._ident, None)
        if self._driver is not None:
            self._driver.close()              # and its process groups
            self._driver = None


def _stop_at_exit(ref) -> None:
    """Stop the exchange's threads when the interpreter exits (daemon threads still alive
    while it finalizes can abort the process), unless a call is in flight (its collective
    may wait for a rank that is gone: leave it to the process's end)."""
    state = ref()
    if state is not None and state._driver is not None and state._in_flight == 0:
        state.exchange.close()
        state._driver = None
