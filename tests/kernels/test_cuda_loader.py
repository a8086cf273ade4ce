"""hvdcomp.backends.cuda without a GPU: the Python side of the CuPy path, run against a
stand-in ``cupy`` module that records what the loader asks for (the real thing runs in
test_gpu.py on a GPU machine).  Checks: importing never needs CuPy; one RawModule per
source and GPU architecture, compiled once by NVRTC (not through CuPy's
RawModule(code=...), which appends -ftz=true) with --ftz=false, IEEE division and square
root, --fmad=false, -std=c++17, the include path, the source hash and the device's
architecture (a cubin; PTX only for a GPU newer than NVRTC), cached on disk, a cut file
rebuilt, and loaded by RawModule(path=...);
launches on PyTorch's current stream (ExternalStream, else Stream.from_external, one cached
wrapper per stream); scalars typed exactly as the kernel signature; pointers through DLPack.
"""
import contextlib
import importlib
import os
import sys
import types

import numpy as np
import pytest
import torch

from hvdcomp.backends import _common
from hvdcomp.ops import philox_draws, quantize


def test_import_without_cupy(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)     # "import cupy" raises ImportError
    import hvdcomp.backends.cuda as cuda
    importlib.reload(cuda)
    assert not cuda.is_available()
    with pytest.raises(ImportError, match="CuPy"):
        cuda.require()
    from hvdcomp import backends
    with pytest.raises(ImportError, match="CuPy"):
        backends.for_device("cuda")
    assert backends.for_device("cpu").__name__ == "hvdcomp.backends.host"


class _FakeCupy:
    """Just enough of CuPy's surface for the loader; records every call."""

    def __init__(self, api="both"):
        self.modules, self.launches, self.streams, self.devices = [], [], [], []
        fake = self

        class RawModule:
            def __init__(self, *, path):
                with open(path) as f:             # what the fake NVRTC wrote: the source
                    self.code = f.read()
                self.path = path
                fake.modules.append(self)

            def get_function(self, name):
                def launch(grid, block, args):
                    fake.launches.append((name, grid, block, args, fake.current_stream))
                return _Callable(launch)

        class Stream:
            def __init__(self, ptr):
                self.ptr = ptr

            def __enter__(self):
                fake.current_stream = self.ptr
                return self

            def __exit__(self, *a):
                fake.current_stream = None

        if api in ("both", "from_external"):
            def from_external(obj):
                version, ptr = obj.__cuda_stream__()
                assert version == 0
                fake.streams.append(("from_external", ptr))
                return Stream(ptr)
            Stream.from_external = staticmethod(from_external)

        def ExternalStream(ptr, device_id=-1):
            fake.streams.append(("ExternalStream", ptr, device_id))
            return Stream(ptr)

        @contextlib.contextmanager
        def Device(i):
            fake.devices.append(i)
            yield

        class Nvrtc:                               # CuPy's wrapper of NVRTC's C API
            def getVersion(self):
                return (13, 0)

            def createProgram(self, src, name, headers, include_names):
                fake.programs.append({"src": src, "name": name})
                return len(fake.programs)

            def compileProgram(self, prog, options):
                fake.programs[prog - 1]["options"] = tuple(options)

            def getSupportedArchs(self):
                return (75, 80, 86, 89, 90, 100)

            def getCUBIN(self, prog):              # stands in for a binary: the source
                return fake.programs[prog - 1]["src"].encode()

            def getPTX(self, prog):
                return fake.programs[prog - 1]["src"]

            def getProgramLog(self, prog):
                return ""

            def destroyProgram(self, prog):
                fake.programs[prog - 1]["destroyed"] = True

        self.programs = []
        self.RawModule = RawModule
        self.cuda = types.SimpleNamespace(Stream=Stream, Device=Device, nvrtc=Nvrtc())
        if api in ("both", "external"):
            self.cuda.ExternalStream = ExternalStream
        self.current_stream = None

    def from_dlpack(self, t):
        assert self.current_stream is not None, "from_dlpack outside torch's stream"
        return ("dlpack", t)


class _Callable:
    def __init__(self, f):
        self.f = f
        self.kernel = None

    def __call__(self, *a):
        return self.f(*a)


def test_target_architecture():
    """A binary for the GPU where NVRTC knows it; PTX of NVRTC's newest for a newer GPU;
    a clear error for an older one; a binary when NVRTC cannot say."""
    import hvdcomp.backends.cuda as cuda
    archs = (75, 80, 86, 89, 90, 100)
    assert cuda.target(90, archs) == "sm_90"
    assert cuda.target(120, archs) == "compute_100"
    with pytest.raises(RuntimeError, match="7.5 and up; the GPU has 6.0"):
        cuda.target(60, archs)
    assert cuda.target(86, ()) == "sm_86"


@pytest.mark.parametrize("api", ["both", "external", "from_external"])
def test_loader_and_launch_with_stand_in_cupy(monkeypatch, tmp_path, api):
    # CuPy 14 has both (ExternalStream deprecated); older ones ExternalStream only; a future
    # one may keep only Stream.from_external
    fake = _FakeCupy(api)
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setenv("HVDCOMP_CACHE", str(tmp_path))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    caps = {0: (9, 0), 1: (8, 6)}                        # launches go to device 0
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=None: caps[i])
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    import hvdcomp.backends.cuda as cuda
    cuda = importlib.reload(cuda)                       # fresh per-process caches
    monkeypatch.setattr(torch.cuda, "current_stream",
                        lambda dev=None: types.SimpleNamespace(cuda_stream=0xABC))

    class Backend(cuda._CudaBackend):                   # CPU tensors stand in for CUDA ones
        device_type = "cpu"
    be = Backend()
    lv = torch.tensor([0.0, 0.25, 0.5, 1.0])
    x = torch.randn(1000)
    norms = quantize.bucket_norms.kernels(be, x, 100, "l2")
    quantize.quantize_pack.kernels(be, x, norms, lv, 3, 100, seed=-1, rank=2, tensor_id=3,
                                   step=2**32 + 4)
    quantize.dequantize_add.kernels(be, torch.zeros(375, dtype=torch.uint8), 1000, norms, lv,
                                    3, 100, torch.zeros(1000))
    philox_draws.uniform.kernels(be, 10, seed=1, step=2, rank=3, tensor_id=4)

    # one module per source file, each built once, with the options that keep it exact
    # (the modules of the two files these launches need, each with all its kernels)
    want_counts = sorted(open(os.path.join(_common.kernel_dir(), f)).read()
                         .count("extern \"C\" __global__") for f in ("quantize.cu", "random.cu"))
    assert sorted(m.code.count("extern \"C\" __global__") for m in fake.modules) == want_counts
    assert len(fake.programs) == 2 and all(p.get("destroyed") for p in fake.programs)
    for prog in fake.programs:
        opts = prog["options"]
        for o in ("--ftz=false", "--prec-div=true", "--prec-sqrt=true", "--fmad=false",
                  "-std=c++17", f"-I{_common.kernel_dir()}", "-arch=sm_90"):
            assert o in opts, (o, opts)
        assert not any("ftz=true" in o or "fast" in o for o in opts), opts
        assert any(o.startswith("-DHVDCOMP_SOURCE_HASH=0x") for o in opts)
    for m in fake.modules:                              # the PTX on disk, in the cache
        assert m.path.startswith(os.path.join(str(tmp_path), "kernels", "cuda"))
    # a new process (fresh caches) loads the cached binary without compiling again; a
    # cached file cut short is built again; device 1 (8.6) gets its own binary
    importlib.reload(cuda)
    cuda._module("quantize.cu", "sm_90")
    assert len(fake.programs) == 2 and len(fake.modules) == 3
    with open(fake.modules[-1].path, "r+b") as f:
        f.truncate(10)
    importlib.reload(cuda)
    cuda._module("quantize.cu", "sm_90")
    assert len(fake.programs) == 3 and os.path.getsize(fake.modules[-1].path) > 10
    cuda._function("hvd_uniform", 1)
    assert fake.programs[-1]["options"][-1] == "-arch=sm_86"
    assert not [f for f in os.listdir(os.path.join(str(tmp_path), "kernels", "cuda"))
                if f.endswith(".tmp")]
    # every launch on torch's stream, scalars typed as the C signature
    names = [ln[0] for ln in fake.launches]
    assert names == ["hvd_bucket_norms_l2", "hvd_quantize_pack", "hvd_dequantize_add",
                     "hvd_uniform"]
    want = {"q": np.int64, "i": np.int32, "I": np.uint32}
    for name, grid, block, args, stream in fake.launches:
        assert stream == 0xABC
        assert len(grid) == 3 and len(block) == 3
        for code, a in zip(_common.SIGNATURES[name], args):
            if code == "P":
                assert a[0] == "dlpack"
            else:
                assert type(a) is want[code], (name, code, type(a))
    q = fake.launches[1]
    assert q[2] == (256, 1, 1) and q[1] == (1, 1, 1)
    assert q[3][6] == np.uint32(0xFFFFFFFF) and q[3][9] == np.uint32(4)   # seed, step mod 2^32
    assert fake.launches[0][2] == (128, 1, 1)            # reduce_block(100)
    # ExternalStream whenever it exists (CuPy 14's from_external wrapper would destroy
    # torch's stream when collected); one wrapper per stream, reused
    assert [s[0] for s in fake.streams] == (["from_external"] if api == "from_external"
                                            else ["ExternalStream"])
    importlib.reload(cuda)                               # leave no stand-in behind


def test_one_compile_per_file_when_ranks_start_together(monkeypatch, tmp_path):
    """Ranks of one machine that start together: one compiles each file, the others wait
    for it (a file lock) and load its binary."""
    import threading
    import time
    fake = _FakeCupy()
    slow = fake.cuda.nvrtc.compileProgram

    def compile_slowly(prog, options):
        time.sleep(0.3)
        slow(prog, options)
    fake.cuda.nvrtc.compileProgram = compile_slowly
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setenv("HVDCOMP_CACHE", str(tmp_path))
    import hvdcomp.backends.cuda as cuda
    cuda = importlib.reload(cuda)
    paths = []
    threads = [threading.Thread(target=lambda: paths.append(
        cuda.compile_binary("random.cu", "sm_90"))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(paths) == 3 and len(set(paths)) == 1
    assert len(fake.programs) == 1
    importlib.reload(cuda)
