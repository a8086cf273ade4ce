"""Fixtures of the kernel tests: the host build, the CUDA backend, seeded inputs.

Markers:
  requires_cuda -- needs a CUDA device, PyTorch with CUDA and CuPy; skipped with the reason
                   otherwise.  With HVDCOMP_REQUIRE_GPU=1 (launch/gpu-check) the missing
                   GPU is a failure instead, so a GPU run cannot pass by skipping.
  requires_nvcc -- needs nvcc on PATH (or $NVCC); skipped with the reason otherwise.

The host library is built on first use into the usual cache ($HVDCOMP_CACHE/kernels,
default ~/.cache/hvdcomp/kernels), keyed by the sources' hash, so editing a kernel rebuilds
it; test_compile.py builds it once more from scratch with -Werror.
"""
import os

import pytest
import torch

from kernel_cases import nvcc_path


def pytest_configure(config):
    config.addinivalue_line("markers", "requires_cuda: needs a CUDA device and CuPy")
    config.addinivalue_line("markers", "requires_nvcc: needs the CUDA compiler nvcc")


def cuda_unavailable_reason():
    """None when the CUDA backend can run here, else why not."""
    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False)"
    try:
        import cupy  # noqa: F401
    except ImportError as e:
        return f"CuPy is not installed ({e})"
    return None


@pytest.fixture(autouse=True)
def _one_intra_op_thread():
    """The PyTorch reference on one intra-op thread: on a small shared machine, thread
    start-up dominates its small ops (tests/compressors/conftest.py measured the same).  The host
    kernels keep their own thread setting (hvdcomp.backends.host.set_num_threads)."""
    nthreads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(nthreads)


def _require_cuda():
    reason = cuda_unavailable_reason()
    if reason:
        if os.environ.get("HVDCOMP_REQUIRE_GPU") == "1":
            pytest.fail(f"HVDCOMP_REQUIRE_GPU=1 but {reason}")
        pytest.skip(reason)


@pytest.fixture(autouse=True)
def _device_requirements(request):
    if request.node.get_closest_marker("requires_cuda"):
        _require_cuda()
    if request.node.get_closest_marker("requires_nvcc") and not nvcc_path():
        pytest.skip("nvcc not found on PATH (set NVCC=/path/to/nvcc)")


@pytest.fixture(scope="session")
def host():
    """hvdcomp.backends.host, built and loaded (skips with the reason without a compiler)."""
    from hvdcomp.backends import host as h
    try:
        h.load()
    except RuntimeError as e:
        if "need a C++17 compiler" in str(e):
            pytest.skip(str(e))
        raise
    return h


@pytest.fixture(scope="session")
def maybe_host():
    """The host build where it can be built, else None (GPU tests then skip the host
    comparisons and keep the reference ones: a GPU machine may lack g++)."""
    from hvdcomp.backends import host as h
    return h if h.is_available() else None


@pytest.fixture(scope="session")
def cuda_backend():
    """hvdcomp.backends.cuda with every kernel compiled (session fixtures run before the
    function-level marker check, so the check is repeated here)."""
    _require_cuda()
    from hvdcomp.backends import cuda as c
    c.compile_all()
    return c
