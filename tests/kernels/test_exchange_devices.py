"""The whole exchange (hvdcomp.exchange.Exchange) of a small model, through every
compressor: the result on one device and backend equals the result on another, bit for bit.

* CPU, kernels vs the PyTorch reference (runs in CI): the host kernels change nothing.
* CUDA vs CPU (requires_cuda, run by launch/gpu-check): CUDA parameters are encoded and
  decoded on the GPU and give the CPU's averaged gradients exactly, so ranks on different
  devices interoperate.

One rank (a local transport whose allgather returns the rank's own frame), no Horovod, three
steps, so stateful compressors (error feedback, DGC, LAQ) carry state across steps.
"""

import numpy as np
import pytest
import torch

import hvdcomp
from hvdcomp import backends
from hvdcomp.exchange import Exchange
from hvdcomp.transport.base import Transport

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


def _run(spec, device, mode, steps=3):
    with backends.use(mode):
        params = _model(device)
        ex = Exchange(params, hvdcomp.get(spec), LocalTransport(),
                      fusion_bytes=4096, min_compress_numel=16, seed=3)
        out = []
        for step in range(steps):
            g = torch.Generator().manual_seed(100 + step)
            for _, p in params:
                p.grad = (torch.randn(p.shape, generator=g) * 1e-2).to(device)
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
    _same(_run(spec, "cuda", "auto"), _run(spec, "cpu", "reference"), spec)


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
