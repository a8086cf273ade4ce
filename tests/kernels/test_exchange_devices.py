"""The whole exchange (hvdcomp.exchange.Exchange) of a small model, through every
compressor: the result on one device and backend equals the result on another, bit for bit.

* CPU, kernels vs the PyTorch reference (runs in CI): the host kernels change nothing.
* CUDA vs CPU (requires_cuda, run by launch/gpu-check): CUDA parameters are encoded and
  decoded on the GPU and give the CPU's averaged gradients exactly, so ranks on different
  devices interoperate.  Except where the encoding rests on PyTorch's own reductions, which
  sum in another order on CUDA (compressors not declared ``device_identical``: PowerSGD's
  matrix products, BHQ's choice of blocks): there the CUDA average is within 1e-4 of the
  CPU's (PowerSGD) or as close to the exact gradient as the CPU's (BHQ).

One rank (a local transport whose allgather returns the rank's own frame), no Horovod, three
steps, so stateful compressors (error feedback, DGC, LAQ) carry state across steps.
"""

import os
import sys

import numpy as np
import pytest
import torch

import hvdcomp
from hvdcomp import backends
from hvdcomp.exchange import Exchange
from hvdcomp.transport.base import Transport

# tests/exchange's thread ranks (test_loops.on_ranks) for the 3-rank tests
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "exchange"))

# every compressor of hvdcomp's registry, by its example spec, and one entropy-coded
SPECS = [spec for name, spec in hvdcomp.compressors.examples().items()
         if hvdcomp.compressors.registry()[name].__module__.startswith("hvdcomp.")]
SPECS.append("alq:bits=3,bucket_size=512,entropy=true")


class LocalTransport(Transport):
    name = "local"

    def _allgather_counts(self, n):
        return [n]

    def _allgatherv(self, data, counts):
        return [np.array(data, copy=True)]

    def allreduce_sum(self, arr):
        return np.array(arr, dtype=np.float64, copy=True)

    def broadcast(self, arr, root=0):
        return np.array(arr, copy=True)


def _model(device):
    torch.manual_seed(5)
    m = torch.nn.Sequential(torch.nn.Linear(37, 64), torch.nn.Tanh(), torch.nn.Linear(64, 29),
                            torch.nn.Conv1d(1, 3, 5))
    return [(n, p.detach().to(device).requires_grad_(True)) for n, p in m.named_parameters()]


def device_rounding(spec):
    """The compressor's encode sums in an order its device chooses (its declaration)."""
    return not hvdcomp.get(spec).device_identical


# PowerSGD's products differ in the last bits: its CUDA average is within 1e-4 of the CPU's
# (relative to the tensor's norm).  BHQ's choice of blocks can differ, and with it a block's
# quantization: its CUDA average is as close to the exact gradient as the CPU's (50 %).
CLOSE_TO_CPU = ("powersgd",)


def _grads(params, step):
    g = torch.Generator().manual_seed(100 + step)
    return {n: torch.randn(p.shape, generator=g) * 1e-2 for n, p in params}


def _run(spec, device, mode, steps=3):
    with backends.use(mode):
        params = _model(device)
        ex = Exchange(params, hvdcomp.get(spec), LocalTransport(),
                      fusion_bytes=4096, min_compress_numel=16, seed=3)
        out = []
        for step in range(steps):
            for n, p in params:
                p.grad = _grads(params, step)[n].to(device)
            ex.begin(step)
            for n, _ in reversed(params):
                ex.ready(n)
            res, _ = ex.finish()
            out.append({n: r.detach().cpu().clone() for n, r in res.items()})
        return out


def _same(a, b, spec):
    for step, (x, y) in enumerate(zip(a, b)):
        for n in x:
            assert torch.equal(x[n], y[n]) or (torch.isnan(x[n]).all() and torch.isnan(y[n]).all()), \
                (spec, step, n, (x[n] - y[n]).abs().max())


@pytest.mark.parametrize("spec", SPECS)
def test_cpu_kernels_equal_reference_through_the_exchange(spec, host):
    _same(_run(spec, "cpu", "kernels"), _run(spec, "cpu", "reference"), spec)


@pytest.mark.requires_cuda
@pytest.mark.parametrize("spec", SPECS)
def test_cuda_equals_cpu_through_the_exchange(spec):
    gpu, cpu = _run(spec, "cuda", "auto"), _run(spec, "cpu", "reference")
    if spec.split(":")[0] in CLOSE_TO_CPU:
        _close(gpu, cpu, spec)
    elif device_rounding(spec):
        _as_close_to_exact(gpu, cpu, spec)
    else:
        _same(gpu, cpu, spec)


def _close(a, b, spec, rtol=1e-4):
    for step, (x, y) in enumerate(zip(a, b)):
        for n in x:
            d, ref = float((x[n] - y[n]).norm()), float(y[n].norm())
            assert d <= rtol * ref, (spec, step, n, d, ref)


def _as_close_to_exact(a, b, spec):
    """Each averaged gradient of ``a`` is no further from the exact gradient than ``b``'s,
    within 50 % (the check for device_rounding's encoders across devices)."""
    params = _model("cpu")
    for step, (x, y) in enumerate(zip(a, b)):
        exact = _grads(params, step)
        for n in x:
            e = exact[n].reshape(-1)           # the exchange returns flat averages
            ex, ey = float((x[n] - e).norm()), float((y[n] - e).norm())
            assert ex <= 1.5 * ey + 1e-6 * float(e.norm()), (spec, step, n, ex, ey)


def test_device_rounding_checks_can_fail(host):
    """The CUDA test's two checks, run here on two CPU paths: they pass for the same
    averages and fail for worse ones (BHQ: twice the error, or nothing sent; PowerSGD: an
    average off by 1e-3)."""
    params = _model("cpu")
    spec = next(s for s in SPECS if s.startswith("bhq"))
    a, b = _run(spec, "cpu", "kernels"), _run(spec, "cpu", "reference")
    _as_close_to_exact(a, b, spec)
    worse = [{n: 2 * v - _grads(params, k)[n].reshape(-1) for n, v in s.items()}
             for k, s in enumerate(b)]                      # exact + 2 (b - exact)
    zeros = [{n: torch.zeros_like(v) for n, v in s.items()} for s in b]
    for bad in (worse, zeros):
        with pytest.raises(AssertionError):
            _as_close_to_exact(bad, b, spec)
    spec = next(s for s in SPECS if s.startswith("powersgd"))
    a, b = _run(spec, "cpu", "kernels"), _run(spec, "cpu", "reference")
    _close(a, b, spec)
    with pytest.raises(AssertionError):
        _close([{n: v * (1 + 1e-3) for n, v in s.items()} for s in a], b, spec)


THREE_RANK_SPECS = ["none", "fp16", "qsgd:bits=4,bucket_size=512", "dgc:density=0.05",
                    "dqsg:bits=4", "topk:density=0.05"]


def _three_ranks(spec, device, mode, summable):
    """Three thread-ranks (a world size that is not a power of two: every average divides
    by 3), three steps; one tensor so large that its float32 sum overflows (the averaging's
    divide-first fallback).  Returns rank 0's averages per step."""
    from test_loops import on_ranks
    base = _model("cpu")                 # (torch's seed is global: not in the threads)

    def fn(rank, tp, ar):
        with backends.use(mode):
            params = [(n, p.detach().clone().to(device).requires_grad_(True))
                      for n, p in base]
            params.append(("huge", torch.zeros(300, device=device, requires_grad=True)))
            # one fusion bucket: the test's allreduce (test_loops.Sums) pairs the ranks'
            # calls by their order, not by name as Horovod does
            ex = Exchange(params, hvdcomp.get(spec), tp, allreduce=ar if summable else None,
                          fusion_bytes=1 << 20, min_compress_numel=16, seed=3)
            out = []
            for step in range(3):
                g = _grads(params[:-1], step)
                for n, p in params[:-1]:
                    p.grad = (g[n] * (1 + rank)).to(device)
                params[-1][1].grad = torch.full((300,), 1.5e38 * (1 + step % 2),
                                                device=device)
                ex.begin(step)
                for n, _ in reversed(params):
                    ex.ready(n)
                res, _ = ex.finish()
                out.append({n: r.detach().cpu().clone() for n, r in res.items()})
            ex.close()
            return out
    got = on_ranks(3, fn)
    for r in got:
        assert not isinstance(r, BaseException), r
    return got[0]


@pytest.mark.parametrize("summable", [False, True])
@pytest.mark.parametrize("spec", THREE_RANK_SPECS)
def test_three_ranks_cpu_kernels_equal_reference(spec, summable, host):
    _same(_three_ranks(spec, "cpu", "kernels", summable),
          _three_ranks(spec, "cpu", "reference", summable), spec)


@pytest.mark.requires_cuda
@pytest.mark.parametrize("summable", [False, True])
@pytest.mark.parametrize("spec", THREE_RANK_SPECS)
def test_three_ranks_cuda_equals_cpu(spec, summable):
    """World size 3 on CUDA: the divisions by the world size (fp16's prescaling, the
    average, the overflow fallback, the sparse average) give the CPU's bits."""
    _same(_three_ranks(spec, "cuda", "auto", summable),
          _three_ranks(spec, "cpu", "reference", summable), spec)


def test_close_stops_the_threads_and_frees_the_exchange():
    import gc
    import threading
    import weakref
    before = {t.name for t in threading.enumerate()}
    params = _model("cpu")
    ex = Exchange(params, hvdcomp.get("qsgd:bits=4"), LocalTransport(),
                  min_compress_numel=16)
    for _, p in params:
        p.grad = torch.ones_like(p)
    ex.begin(0)
    for n, _ in params:
        ex.ready(n)
    ex.finish()
    assert any(t.name == "hvdcomp-decode" for t in threading.enumerate())
    ref = weakref.ref(ex)
    ex.close()
    del ex
    gc.collect()
    assert ref() is None
    assert {t.name for t in threading.enumerate()} <= before | {"MainThread"}
