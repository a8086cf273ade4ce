"""Every kernel source compiles, warning-free, for every target it has:

* nvcc for sm_80 and sm_90 with all warnings as errors (device, host pass and ptxas);
* g++ through kernels/host_shim.h (the host build) with -Wall -Wextra -Werror;
* NVRTC, as CuPy compiles it (same options as hvdcomp.backends.cuda), where an NVRTC
  library can be found: CuPy's, $HVDCOMP_NVRTC, or libnvrtc on the loader path;

and the sources keep the rules that make those builds agree (kernels/hvdcomp.cuh).
"""
import ctypes
import ctypes.util
import glob
import os
import re
import subprocess
import sys

import pytest

from hvdcomp.backends import _common

KDIR = _common.kernel_dir()
CU_FILES = sorted(os.path.basename(p) for p in glob.glob(os.path.join(KDIR, "*.cu")))

from kernel_cases import nvcc_path  # noqa: E402  (tests/kernels is on sys.path under pytest)
import compile_cache  # noqa: E402


def _code(path):
    """A source without its // comments."""
    return re.sub(r"//[^\n]*", "", open(path).read())


def test_every_source_is_known():
    assert set(CU_FILES) == set(_common.KERNEL_SOURCE.values())
    declared = {}
    for f in CU_FILES:
        text = open(os.path.join(KDIR, f)).read()
        for name in re.findall(r'extern "C" __global__ void (\w+)\(', text):
            declared[name] = f
    assert declared == _common.KERNEL_SOURCE
    assert set(declared) == set(_common.SIGNATURES)
    # the host build's registry lists exactly these kernels
    from hvdcomp.backends import host
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        reg = open(host.write_registry(d)).read()
    assert set(re.findall(r"HVD_HOST_KERNEL\((\w+)\)", reg)) == set(declared)
    assert set(re.findall(r'#include "(\w+\.cu)"', reg)) == set(CU_FILES)


def test_sources_keep_the_rules():
    # NVRTC has no standard headers: the .cu files include only the shared header, and the
    # shared header includes nothing.
    for f in CU_FILES:
        text = _code(os.path.join(KDIR, f))
        assert re.findall(r'#include\s+(\S+)', text) == ['"hvdcomp.cuh"'], f
        # block cooperation only through hvdcomp.cuh's helpers (the host build runs the
        # threads of a block one after another); no atomics (deterministic output)
        for banned in (r"__syncthreads", r"__shfl\w*", r"atomic\w*\s*\(", r"__ballot\w*",
                       r"cooperative_groups", r"__shared__"):
            assert not re.search(banned, text), (f, banned)
    assert "#include" not in _code(os.path.join(KDIR, "hvdcomp.cuh"))


NVCC_ARCHS = ["80", "90"]


def _nvcc(source: str, arch: str, outdir: str):
    cmd = [nvcc_path(), "-c", os.path.join(KDIR, source),
           "-o", os.path.join(outdir, f"{source}.{arch}.o"),
           "-std=c++17", "--fmad=false", f"-gencode=arch=compute_{arch},code=sm_{arch}",
           "-Werror", "all-warnings", "-Xptxas", "-Werror",
           "-Xcompiler", "-Wall,-Wextra,-Werror"]
    return cmd, compile_cache.run(cmd, outdir)


@pytest.fixture(scope="module")
def nvcc_builds(tmp_path_factory):
    """Every (source, arch) compiled once, as many at a time as there are cores (each
    compile is one single-threaded process; one by one they took 105 s of the suite)."""
    from concurrent.futures import ThreadPoolExecutor
    if not nvcc_path():
        pytest.skip("nvcc not found on PATH (set NVCC=/path/to/nvcc)")
    outdir = str(tmp_path_factory.mktemp("nvcc"))
    jobs = [(s, a) for s in CU_FILES for a in NVCC_ARCHS]
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        results = pool.map(lambda job: _nvcc(*job, outdir), jobs)
        return dict(zip(jobs, results))


@pytest.mark.requires_nvcc
@pytest.mark.parametrize("arch", NVCC_ARCHS)
@pytest.mark.parametrize("source", CU_FILES)
def test_nvcc_compiles_without_warnings(nvcc_builds, arch, source):
    cmd, r = nvcc_builds[source, arch]
    assert r.returncode == 0, f"{' '.join(cmd)}\n{r.stdout}{r.stderr}"
    assert "warning" not in (r.stdout + r.stderr).lower(), r.stdout + r.stderr


def test_host_build_without_warnings(host, tmp_path):
    """g++ -Wall -Wextra -Werror builds the host library.  The library the tests load was
    built with the same command less -Werror (BASE_FLAGS hold -Wall -Wextra): when its
    build record is there and the compiler said no warning, -Werror cannot fail, and the
    ~50 s compile is not run a second time (also when another checkout of the same kernel
    sources built it: a fresh clone's CI run)."""
    out = str(tmp_path / "hvd_host.so")
    record = host.build_record()
    if record is not None:
        # the record names the checkout that built the library; the library's key holds the
        # kernel sources by content, so another checkout of the same sources shares it
        built_in = os.path.dirname(record["command"][-1])
        same = [a.replace(record["library"], out).replace(built_in, KDIR)
                for a in record["command"]]
        cmd = host.compile_command(out)
        if same == cmd:
            assert "warning" not in record["output"].lower(), record["output"]
            assert "-Wall" in cmd and "-Wextra" in cmd
            record = "checked"
    if record != "checked":
        cmd = host.compile_command(out, werror=True)
        r = compile_cache.run(cmd, str(tmp_path))
        assert r.returncode == 0, f"{' '.join(cmd)}\n{r.stdout}{r.stderr}"
        assert "warning" not in (r.stdout + r.stderr).lower(), r.stdout + r.stderr
        if not r.cached:                              # a library built just now: it loads
            lib = ctypes.CDLL(out)
            assert lib.hvd_host_abi_version() == host.ABI_VERSION
    # the cached library the tests use reports the launcher's signatures
    assert host.openmp_version() >= 0
    for name, sig in _common.SIGNATURES.items():
        assert host._kernels[name][1] == sig


def test_host_build_refuses_fast_math(host, tmp_path):
    cmd = host.compile_command(str(tmp_path / "x.so"), extra=["-ffast-math"])
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode != 0 and "fast-math" in r.stderr


# ---- NVRTC (what CuPy runs) ---------------------------------------------------------------------

def _nvrtc_library():
    path = os.environ.get("HVDCOMP_NVRTC")
    cands = [path] if path else []
    for base in sys.path:
        cands += sorted(glob.glob(os.path.join(base, "nvidia", "*", "lib", "libnvrtc.so*")))
        cands += sorted(glob.glob(os.path.join(base, "nvidia", "*", "*", "lib",
                                               "libnvrtc.so*")))
    found = ctypes.util.find_library("nvrtc")
    if found:
        cands.append(found)
    cands += sorted(glob.glob("/usr/local/cuda*/lib64/libnvrtc.so*"))
    for c in cands:
        if c and "builtins" not in c:
            # NVRTC dlopens its builtins library by name: load the one beside it first
            d = os.path.dirname(c)
            for b in sorted(glob.glob(os.path.join(d, "libnvrtc-builtins.so*"))) if d else []:
                try:
                    ctypes.CDLL(b, mode=ctypes.RTLD_GLOBAL)
                    break
                except OSError:
                    continue
            try:
                return ctypes.CDLL(c), c
            except OSError:
                continue
    return None, None


def _nvrtc_compile(lib, source_text, name, options):
    prog = ctypes.c_void_p()
    rc = lib.nvrtcCreateProgram(ctypes.byref(prog), source_text.encode(), name.encode(), 0,
                                None, None)
    assert rc == 0, f"nvrtcCreateProgram: {rc}"
    try:
        opts = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
        rc = lib.nvrtcCompileProgram(prog, len(options), opts)
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        buf = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, buf)
        log = buf.value.decode(errors="replace")
        if rc == 0:     # how many float instructions flush subnormals to zero (".ftz")
            lib.nvrtcGetPTXSize(prog, ctypes.byref(size))
            ptx = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetPTX(prog, ptx)
            log += f"\n[ptx .ftz instructions: {ptx.value.decode(errors='replace').count('.ftz')}]"
        return rc, log
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


@pytest.mark.parametrize("arch", ["80", "90"])
@pytest.mark.parametrize("source", CU_FILES)
def test_nvrtc_compiles_as_cupy_does(arch, source):
    lib, where = _nvrtc_library()
    if lib is None:
        pytest.skip("no NVRTC library (comes with CuPy / nvidia-cuda-nvrtc; or set "
                    "HVDCOMP_NVRTC=/path/to/libnvrtc.so)")
    from hvdcomp.backends import cuda
    options = list(cuda.compile_options()) + [f"-arch=compute_{arch}"]
    text = open(os.path.join(KDIR, source)).read()
    version = (ctypes.c_int(), ctypes.c_int())
    lib.nvrtcVersion(ctypes.byref(version[0]), ctypes.byref(version[1]))
    rc, log, _ = compile_cache.memo(
        ["nvrtc", "ptx-ftz-count", os.path.realpath(where), str(os.path.getsize(os.path.realpath(where))),
         f"{version[0].value}.{version[1].value}", source, *options],
        lambda: _nvrtc_compile(lib, text, source, options))
    if rc != 0 and "libnvrtc-builtins" in log:
        pytest.skip(f"NVRTC at {where} cannot find its builtins library: {log.strip()}")
    assert rc == 0, f"NVRTC ({where}) {options}:\n{log}"
    assert "warning" not in log.lower(), log
    # subnormals kept, as on the CPU (CuPy's own compile adds -ftz=true: backends/cuda.py)
    assert "[ptx .ftz instructions: 0]" in log, log


def test_the_ftz_check_sees_flushing():
    """The PTX check above can fail: the same source compiled with -ftz=true (what CuPy's
    RawModule(code=...) appends) has .ftz instructions."""
    lib, where = _nvrtc_library()
    if lib is None:
        pytest.skip("no NVRTC library")
    from hvdcomp.backends import cuda
    options = [o for o in cuda.compile_options() if not o.startswith("--ftz")]
    options += ["-ftz=true", "-arch=compute_90"]
    rc, log = _nvrtc_compile(lib, open(os.path.join(KDIR, "quantize.cu")).read(),
                             "quantize.cu", options)
    if rc != 0 and "libnvrtc-builtins" in log:
        pytest.skip(f"NVRTC at {where} cannot find its builtins library")
    assert rc == 0, log
    n = int(log.rsplit("[ptx .ftz instructions: ", 1)[1].split("]")[0])
    assert n > 0, log
