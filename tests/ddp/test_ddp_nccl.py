"""The DDP hook's nccl path: the golden training (golden.py) with CUDA parameters over nccl
gives the same averaged gradients, bit for bit, as with CPU parameters over gloo, for every
compressor (those not declared ``device_identical``, PowerSGD and BHQ: as close to the exact
average), with and without the allreduce of summable encodings.  One rank per GPU (nccl
refuses two ranks on one device), so up to torch.cuda.device_count() ranks.
Needs a CUDA device and CuPy: skipped otherwise, a failure under HVDCOMP_REQUIRE_GPU=1
(launch/gpu-check)."""
import os
import sys

import pytest
import torch

import hvdcomp

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import golden  # noqa: E402
from test_ddp import torchrun  # noqa: E402


def _cuda_reason():
    """None where hvdcomp's CUDA backend can run (a CUDA device and CuPy), else why not."""
    from hvdcomp.backends import cuda
    try:
        cuda.require()
    except (ImportError, RuntimeError) as e:
        return str(e)
    return None


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    reason = _cuda_reason()
    if reason:
        if os.environ.get("HVDCOMP_REQUIRE_GPU") == "1":
            pytest.fail(f"HVDCOMP_REQUIRE_GPU=1 but {reason}")
        pytest.skip(reason)
    n = min(2, torch.cuda.device_count())
    out = tmp_path_factory.mktemp("nccl")
    logs = [torchrun(n, "worker_nccl.py", out, dev, outdir=out, timeout=600)
            for dev in ("cpu", "cuda")]
    return n, out, logs


# Encoders whose bits depend on the device's floating-point reductions: PowerSGD's matrix
# products (cuBLAS and the CPU's BLAS sum in different orders): its CUDA averages are within
# 1e-4 of the CPU's (relative to the norm); BHQ's choice of blocks (from torch.sum and
# torch.amax over rows), which can change a block's quantization: its CUDA averages are no
# further from the exact average than the CPU's, within 50 % (where the two encodings
# agree, as on most tensors, the errors are equal).
def device_rounding(spec):
    """The compressor's encode sums in an order its device chooses (its declaration)."""
    return not hvdcomp.get(spec).device_identical


CLOSE_TO_CPU = ("powersgd",)


def _exact_average(n, step):
    g = [golden.inputs(r, step) for r in range(n)]
    return {name: sum(x[name].double() for x in g) / n for name in g[0]}


@pytest.mark.parametrize("summable", [0, 1])
@pytest.mark.parametrize("spec", golden.COMPRESSORS)
def test_nccl_hook_gives_the_gloo_hooks_bits(runs, spec, summable):
    """The averaged gradients of every step (the optimizer's parameters are not compared:
    PyTorch's SGD rounds half-precision parameters differently on the two devices)."""
    n, out, _ = runs
    for rank in range(n):
        cpu = torch.load(golden.out_path(out, f"nccl{summable}", spec, n, rank, "cpu"))
        gpu = torch.load(golden.out_path(out, f"nccl{summable}", spec, n, rank, "cuda"))
        assert len(cpu["grads"]) == len(gpu["grads"]) == golden.STEPS
        for step, (a, b) in enumerate(zip(cpu["grads"], gpu["grads"])):
            exact = _exact_average(n, step)
            for name in a:
                assert a[name].dtype == b[name].dtype, (spec, step, name)
                if device_rounding(spec):
                    if not torch.isfinite(a[name]).all():       # the NaN policy: same places
                        assert torch.equal(a[name].isnan(), b[name].isnan()), (spec, name)
                        continue
                    if spec.split(":")[0] in CLOSE_TO_CPU:
                        d = float((a[name].double() - b[name].double()).norm())
                        assert d <= 1e-4 * float(a[name].double().norm()), (spec, step, name, d)
                        continue
                    ea = float((a[name].double() - exact[name]).norm())
                    eb = float((b[name].double() - exact[name]).norm())
                    assert eb <= 1.5 * ea + 1e-6 * float(exact[name].norm()) + 1e-30, \
                        (spec, step, name, ea, eb)
                    continue
                assert torch.equal(a[name].reshape(-1).view(torch.uint8),
                                   b[name].reshape(-1).view(torch.uint8)), \
                    f"{spec} step {step} {name}: nccl/CUDA average differs from gloo/CPU's"
