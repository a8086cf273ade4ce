"""``hvdcomp info``: what this machine offers hvdcomp (``python -m hvdcomp info``), and
``hvdcomp selftest``: a 2-rank exchange through every available transport
(:mod:`hvdcomp.selftest`).

Versions (hvdcomp, torch, numpy, mpi4py, Horovod) and Horovod's build (MPI, Gloo, NCCL,
CUDA, from Horovod's own ``*_built()`` checks); the MPI library and the thread level it
actually provides; the registered compressors with their default specs; the kernel
sources (folder, SHA-256); the host build of the kernels (compiler, OpenMP, whether it
builds and loads); CUDA (devices, CuPy, NVRTC, whether every kernel compiles for the
present device) and whether MPI is CUDA-aware.  ``--json`` prints one JSON object.

``--build`` first builds the CPU kernels (:mod:`hvdcomp.backends.host`, about 40 s once
per kernel sources and compiler; launch/setup runs it) so that the first training step
does not, and exits with status 1, the compiler's output on stderr, when they do not build.
(Without it the report still builds them when they are missing, to say whether they load.)

Each probe reports its own failure as a value ("error: ...") instead of stopping the
report: the command is for finding out what is missing.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from importlib import metadata
from typing import Any, Callable, Dict, List, Optional

__all__ = ["info", "build", "main"]

_THREAD_LEVELS = ["single", "funneled", "serialized", "multiple"]


def _version(dist: str) -> Optional[str]:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _probe(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except Exception as e:          # noqa: BLE001 - reported, not raised (see module doc)
        return f"error: {type(e).__name__}: {e}"


def _versions() -> Dict[str, Optional[str]]:
    import hvdcomp
    return {"hvdcomp": hvdcomp.__version__, "python": sys.version.split()[0],
            "torch": _version("torch"), "numpy": _version("numpy"),
            "mpi4py": _version("mpi4py"), "horovod": _version("horovod"),
            "cupy": next((v for v in map(_version, ("cupy", "cupy-cuda13x", "cupy-cuda12x"))
                          if v), None)}


def _horovod() -> Dict[str, Any]:
    if _version("horovod") is None:
        return {"installed": False}
    import horovod.torch as hvd
    return {"installed": True, "mpi": bool(hvd.mpi_built()), "gloo": bool(hvd.gloo_built()),
            "nccl": bool(hvd.nccl_built()), "cuda": bool(hvd.cuda_built())}


def library_line(raw: str) -> str:
    """The first line of MPI's library version string, up to its first NUL (Open MPI's
    string, through mpi4py, ends in the C string's terminator), without blanks or other
    control characters around or in it; "" when nothing is left."""
    text = raw.split("\0", 1)[0].strip()
    first = text.splitlines()[0] if text else ""
    return "".join(ch for ch in first if ch.isprintable()).strip()


def _mpi() -> Dict[str, Any]:
    if _version("mpi4py") is None:
        return {"installed": False}
    from mpi4py import MPI
    level = MPI.Query_thread()
    return {"installed": True, "library": library_line(MPI.Get_library_version()),
            "thread_level": _THREAD_LEVELS[level] if 0 <= level < 4 else str(level),
            "world_size": MPI.COMM_WORLD.Get_size()}


def _compressors() -> Dict[str, str]:
    from .compressors.base import REGISTRY
    return {name: REGISTRY[name]().spec() for name in sorted(REGISTRY)}


def _kernels() -> Dict[str, Any]:
    from .backends import _common
    return {"dir": _common.kernel_dir(), "sha256": _common.source_hash(),
            "kernels": len(_common.SIGNATURES)}


def _host() -> Dict[str, Any]:
    from .backends import host
    out: Dict[str, Any] = {"compiler": _probe(host.compiler)}
    try:
        host.load()
        out.update(loads=True, openmp=host.openmp_version(), threads=host.get_num_threads(),
                   library=host.library_path())
    except Exception as e:          # noqa: BLE001
        out.update(loads=False, error=f"{type(e).__name__}: {e}")
    return out


def build() -> float:
    """Build the CPU kernels now if they are not cached (``hvdcomp info --build``) and load
    them; returns the seconds it took (a few milliseconds when cached).  Raises RuntimeError
    or OSError when they do not build or load."""
    from .backends import host
    t0 = time.monotonic()
    host.load()
    return time.monotonic() - t0


def _cuda() -> Dict[str, Any]:
    import torch
    out: Dict[str, Any] = {"available": torch.cuda.is_available(),
                           "devices": [torch.cuda.get_device_name(i)
                                       for i in range(torch.cuda.device_count())]
                           if torch.cuda.is_available() else []}
    out["nvrtc"] = _nvrtc()
    if out["available"]:
        def compile_all():
            from .backends import cuda
            cuda.compile_all()
            return True
        out["kernels_compile"] = _probe(compile_all)
    from .transport.mpi import cuda_aware
    aware = _probe(cuda_aware)
    out["mpi_cuda_aware"] = {True: "yes", False: "no", None: "unknown"}.get(aware, aware)
    return out


def _nvrtc() -> Optional[str]:
    """NVRTC's version where a copy can be found (CuPy's, or the nvidia-cuda-nvrtc wheel)."""
    v = _version("nvidia-cuda-nvrtc") or _version("nvidia-cuda-nvrtc-cu12")
    if v:
        return v
    try:
        import cupy
        major, minor = cupy.cuda.nvrtc.getVersion()
        return f"{major}.{minor}"
    except Exception:               # noqa: BLE001 - no CuPy, or no NVRTC library
        return None


def info() -> Dict[str, Any]:
    """Everything ``hvdcomp info`` reports, as a dict (see the module docstring)."""
    return {"versions": _probe(_versions), "horovod": _probe(_horovod), "mpi": _probe(_mpi),
            "compressors": _probe(_compressors), "kernels": _probe(_kernels),
            "host_build": _probe(_host), "cuda": _probe(_cuda)}


def _print_text(d: Dict[str, Any]) -> None:
    def show(prefix: str, v: Any) -> List[str]:
        if isinstance(v, dict):
            return [line for k, x in v.items() for line in show(f"{prefix}{k}.", x)]
        if isinstance(v, list):
            v = ", ".join(map(str, v)) or "none"
        return [f"{prefix[:-1]:<28} {v}"]
    for section, v in d.items():
        if section == "compressors" and isinstance(v, dict):
            print("compressors")
            for name, spec in v.items():
                print(f"  {name:<10} {spec}")
            continue
        print(section)
        for line in show("", v):
            print("  " + line)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="hvdcomp", description="hvdcomp: gradient compression "
                                "for data-parallel PyTorch over Horovod and MPI")
    sub = p.add_subparsers(dest="command", required=True)
    pi = sub.add_parser("info", help="what this machine offers hvdcomp")
    pi.add_argument("--json", action="store_true", help="one JSON object")
    pi.add_argument("--build", action="store_true", help="build the CPU kernels first if "
                    "they are not cached (about 40 s, once per kernel sources and compiler; "
                    "launch/setup runs this) and exit with status 1 if they do not build")
    ps = sub.add_parser("selftest", help="a 2-rank exchange of a few compressors through "
                        "every available transport (starts its own processes), PASS/FAIL "
                        "per item")
    ps.add_argument("--timeout", type=float, default=300.0,
                    help="seconds each launcher's workers may take (default 300)")
    args = p.parse_args(argv)
    if args.command == "selftest":
        from .selftest import run
        return run(timeout=args.timeout)
    if args.command == "info":
        if args.build:
            try:
                seconds = build()
            except (RuntimeError, OSError) as e:
                print(f"hvdcomp info --build: the CPU kernels did not build: {e}",
                      file=sys.stderr)
                return 1
            print(f"hvdcomp info --build: CPU kernels ready ({seconds:.1f} s)",
                  file=sys.stderr)
        d = info()
        if args.json:
            print(json.dumps(d, indent=2, default=str))
        else:
            _print_text(d)
    return 0


if __name__ == "__main__":
    sys.exit(main())
