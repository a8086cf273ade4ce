"""``DistributedOptimizer``: Horovod's drop-in, with compression that sends real bytes.

Wraps any ``torch.optim.Optimizer`` the way horovod.torch does (a subclass of the wrapped
optimizer's class created on the fly), and hands the gradient exchange to
:class:`hvdcomp.torch.exchange.Exchange`.
"""
from __future__ import annotations

import contextlib
import os
from typing import Dict, Optional

import torch

from .. import compressors
from ..auto import Auto, from_spec
from ..compressors import Compressor
from ..compressors.protocols import MomentumCorrection
from ..transport import make as make_transport
from .exchange import Exchange, StepStats

__all__ = ["DistributedOptimizer"]

_STATE_KEY = "hvdcomp"


def _as_compressor(compression) -> Compressor:
    if isinstance(compression, Auto):
        return compression
    if compression is None:
        return from_spec(os.environ.get("HVDCOMP_COMPRESSION") or "none")
    if isinstance(compression, str):
        return from_spec(compression)              # "auto+SPEC" gives Auto(SPEC)
    if isinstance(compression, Compressor):
        return compressors.get(compression)
    # Horovod's own Compression.none / Compression.fp16
    try:
        from horovod.torch.compression import Compression
        if compression is Compression.none:
            return compressors.get("none")
        if compression is Compression.fp16:
            return compressors.get("fp16")
    except ImportError:
        pass
    raise TypeError(f"compression must be an hvdcomp compressor, a spec string such as "
                    f"'alq:bits=3', or Horovod's Compression.none/fp16; got {compression!r}")


class _DistributedOptimizer(torch.optim.Optimizer):
    # Methods of this class are copied into a subclass of the user's optimizer class, so
    # they use super(self.__class__, self) rather than zero-argument super().

    def __init__(self, params, named_parameters, compression, backward_passes_per_step, op,
                 gradient_predivide_factor, transport, fusion_bytes, min_compress_numel,
                 compress_1d, seed, hvd):
        super(self.__class__, self).__init__(params)
        all_params = [p for g in self.param_groups for p in g["params"]]
        if named_parameters is not None:
            named = list(named_parameters)
            by_id = {id(p): n for n, p in named}
            missing = [i for i, p in enumerate(all_params) if id(p) not in by_id]
            if missing:
                raise ValueError(f"named_parameters lacks {len(missing)} of the optimizer's "
                                 f"parameters; pass model.named_parameters() of the model "
                                 f"whose parameters the optimizer holds")
            named = [(n, p) for n, p in named if any(p is q for q in all_params)]
        else:
            named = [(f"param.{i}.{j}", p) for i, g in enumerate(self.param_groups)
                     for j, p in enumerate(g["params"])]
        named = [(n, p) for n, p in named if p.requires_grad]
        compression = _as_compressor(compression)
        self._bpps = int(backward_passes_per_step)
        if self._bpps < 1:
            raise ValueError("backward_passes_per_step must be >= 1")
        average = op == hvd.Average
        if op not in (hvd.Average, hvd.Sum):
            raise ValueError("hvdcomp.torch.DistributedOptimizer supports op=Average and "
                             "op=Sum (Adasum cannot combine decoded messages)")
        tp = make_transport(transport) if isinstance(transport, str) else transport
        self._exchange = Exchange(named, compression, tp, hvd=hvd,
                                  fusion_bytes=fusion_bytes,
                                  min_compress_numel=min_compress_numel,
                                  compress_1d=compress_1d, seed=seed, average=average,
                                  predivide=gradient_predivide_factor)
        self._compression = self._exchange.compression     # with Auto: Auto's compressor
        self._named = named
        self._split_momentum()
        self._counts = {n: 0 for n, _ in named}
        self._hvdcomp_step = 0
        self._synchronized = False
        self._should_sync = True
        self.last_stats: Optional[StepStats] = None
        self._hooks = []
        for n, p in named:
            self._hooks.append(p.register_post_accumulate_grad_hook(self._make_hook(n)))

    def _split_momentum(self) -> None:
        """Momentum correction (DGC): for tensors whose compressor applies momentum itself,
        move them into param groups with momentum 0 and give the compressor the factor."""
        comp = self._compression
        if not (isinstance(comp, MomentumCorrection) and comp.handles_momentum):
            return
        handled = {id(e.param): n for n, e in self._exchange.entries.items()
                   if e.compressor is comp}
        factors, new_groups = {}, []
        for group in self.param_groups:
            mine = [p for p in group["params"] if id(p) in handled]
            if not mine:
                continue
            m = float(group.get("momentum", 0.0) or 0.0)
            if group.get("nesterov", False) or group.get("dampening", 0.0):
                raise ValueError(f"{comp.name} applies momentum correction itself (plain "
                                 f"momentum u = m u + g); Nesterov momentum and dampening "
                                 f"are not supported with it")
            for p in mine:
                factors[handled[id(p)]] = m
            if m and "momentum" in group:
                group["params"] = [p for p in group["params"] if id(p) not in handled]
                new_groups.append(dict({k: v for k, v in group.items() if k != "params"},
                                       params=mine, momentum=0.0))
        self.param_groups[:] = [g for g in self.param_groups if g["params"]]
        for g in new_groups:
            self.add_param_group(g)
        comp.set_momentum(factors)

    def _make_hook(self, name):
        def hook(p):
            if not self._exchange.in_step:
                self._exchange.begin(self._hvdcomp_step)
            self._counts[name] += 1
            if self._counts[name] == self._bpps:
                self._exchange.ready(name)
            elif self._counts[name] > self._bpps:
                raise RuntimeError(
                    f"gradient of {name} computed {self._counts[name]} times before step(); "
                    f"set backward_passes_per_step={self._counts[name]} or call step() "
                    f"after each backward pass")
        return hook

    @property
    def compression(self) -> Compressor:
        """The compressor (with ``Auto``, its inner compressor)."""
        return self._compression

    def close(self) -> None:
        """Stop the exchange's worker threads and free its buffers (they live as long as the
        threads otherwise, i.e. the process).  Call when done with the optimizer, between
        steps; it cannot step afterwards."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._exchange.close()

    @property
    def plan(self) -> Dict[str, str]:
        """{parameter name: name of the compressor its gradient travels with}."""
        return self._exchange.plan.compressor_names()

    def synchronize(self) -> StepStats:
        """Finish the exchange and write the averaged gradients into ``p.grad``.

        Returns the step's :class:`~hvdcomp.torch.exchange.StepStats` (also kept in
        ``last_stats``).  Raises WireFormatError if any rank's message is malformed.
        """
        ex = self._exchange
        if not ex.in_step:
            ex.begin(self._hvdcomp_step)
        results, stats = ex.finish()
        for n, p in self._named:
            avg = results[n].view(p.shape)
            if p.grad is None:
                p.grad = avg.to(p.dtype, copy=True)    # the exchange reuses its buffers
            else:
                p.grad.copy_(avg)
        for n in self._counts:
            self._counts[n] = 0
        self._synchronized = True
        self.last_stats = stats
        return stats

    @contextlib.contextmanager
    def skip_synchronize(self):
        """Inside, ``step()`` does not synchronize: call ``synchronize()`` yourself first
        (e.g. to unscale or clip the averaged gradients)."""
        self._should_sync = False
        try:
            yield
        finally:
            self._should_sync = True

    def step(self, closure=None):
        if self._should_sync and not self._synchronized:
            self.synchronize()
        elif not self._synchronized:
            raise RuntimeError("step() inside skip_synchronize() needs synchronize() first")
        self._synchronized = False
        self._exchange.before_step()
        loss = super(self.__class__, self).step(closure)
        self._exchange.after_step(self._hvdcomp_step)      # LAQ's rule, ALQ/AMQ's refit
        self._hvdcomp_step += 1
        return loss

    def zero_grad(self, set_to_none: bool = True):
        if self._exchange.in_step:
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() "
                                 "but before optimizer.step() or optimizer.synchronize()")
        return super(self.__class__, self).zero_grad(set_to_none)

    def state_dict(self):
        sd = super(self.__class__, self).state_dict()
        sd[_STATE_KEY] = {"step": self._hvdcomp_step,
                          "compression": self._compression.spec(),
                          "compressor_state": self._compression.state_dict()}
        return sd

    def load_state_dict(self, state_dict):
        state_dict = dict(state_dict)
        mine = state_dict.pop(_STATE_KEY, None)
        super(self.__class__, self).load_state_dict(state_dict)
        if mine is not None:
            if mine["compression"].split(":")[0] != self._compression.name:
                raise ValueError(f"checkpoint was saved with compression "
                                 f"{mine['compression']!r}, this optimizer uses "
                                 f"{self._compression.spec()!r}")
            self._hvdcomp_step = int(mine["step"])
            self._compression.load_state_dict(mine["compressor_state"])


def DistributedOptimizer(optimizer, named_parameters=None, compression=None,
                         backward_passes_per_step=1, op=None, gradient_predivide_factor=1.0,
                         num_groups=0, groups=None, sparse_as_dense=False, process_set=None,
                         *, transport="mpi", fusion_bytes=25 * 2**20, min_compress_numel=1024,
                         compress_1d=False, seed=0):
    """Wrap ``optimizer`` so that ``step()`` applies gradients averaged across ranks, sent
    with ``compression`` as real encoded bytes.

    Same signature as ``horovod.torch.DistributedOptimizer``, plus keyword-only settings:

    compression: an hvdcomp compressor, a spec string ("alq:bits=3,bucket_size=8192"),
        Horovod's Compression.none/fp16, None (then $HVDCOMP_COMPRESSION, else "none"), or
        ``hvdcomp.Auto(compressor)`` (spec "auto+alq:bits=3"): per tensor, fp32, fp16 or the
        compressor, whichever the cost model measured at construction says is fastest
        (``optimizer.plan``).
    op: hvd.Average (default) or hvd.Sum.  gradient_predivide_factor: as in Horovod.
    num_groups, groups: not used (hvdcomp fuses by ``fusion_bytes``); must be left default.
    process_set: only the global process set is supported.
    transport: "mpi" (mpi4py Allgatherv, default) or "horovod" (hvd.allgather); identical
        results.
    fusion_bytes: gradient bytes per fusion bucket (default 25 MiB).
    min_compress_numel, compress_1d: tensors with fewer elements, and 1-D tensors unless
        compress_1d, are sent uncompressed (fp32).
    seed: shared seed of the Philox streams (must be equal on every rank; checked).

    Raises ValueError / TypeError for invalid settings, RuntimeError if the ranks disagree on
    the model or settings.  After each step, ``optimizer.last_stats`` holds the bytes sent.
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
               backward_passes_per_step, op, gradient_predivide_factor, transport,
               fusion_bytes, min_compress_numel, compress_1d, seed, hvd)
