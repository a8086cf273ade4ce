"""What the kernel backends share: where the sources are, the kernels' signatures, launch
geometry, argument checks, and the operations themselves, written once over a small
backend interface (``launch``, ``device_type``).

Nothing here computes a quantizer: every number comes from a kernel in ``kernels/*.cu``.
The operations only check their arguments, allocate outputs, choose the geometry and type
the scalars.  ``hvdcomp/backends/host.py`` (g++, ctypes, CPU tensors) and
``hvdcomp/backends/cuda.py`` (CuPy, CUDA tensors) bind them to their device.
"""
from __future__ import annotations

import hashlib
import operator
import os
import re
from typing import Optional, Sequence, Tuple

import torch

__all__ = ["kernel_dir", "source_hash", "discover", "SIGNATURES", "KERNEL_SOURCE",
           "DEVICE_SOURCES", "HOST_SOURCES", "check_tensor", "check_int", "u32", "grid_for", "BLOCK", "MAX_GRID", "reduce_block", "packed_size",
           "Ops"]

# ---- sources ------------------------------------------------------------------------------
#
# Every kernel is an ``extern "C" __global__ void hvd_...(...)`` in some kernels/*.cu file.
# Nothing lists them by hand: the sources, the kernel -> file map and each kernel's parameter
# types are read from the .cu files themselves (``discover``).  The host build checks the
# types once more against the C++ declarations (kernels/host_shim.h) before the first launch.

SHARED_SOURCES = ("hvdcomp.cuh",)                 # included by every .cu file
HOST_ONLY = ("host_shim.h", "host_launch.cpp")    # the g++ build of the same sources

_DECL = re.compile(r'extern\s+"C"\s+__global__\s+(?:__launch_bounds__\s*\([^)]*\)\s+)?'
                   r'void\s+(?:__launch_bounds__\s*\([^)]*\)\s+)?(\w+)\s*\(([^)]*)\)')


def _type_code(param: str, kernel: str) -> str:
    """One parameter's letter: P pointer, q long long, i int, I unsigned int, f float,
    d double (host_shim.h's type_code)."""
    p = re.sub(r"__restrict__|const|volatile", " ", param)
    if "*" in p:
        return "P"
    words = p.split()[:-1]                         # drop the parameter name
    t = " ".join(words)
    table = {"long long": "q", "long long int": "q", "int": "i", "unsigned int": "I",
             "unsigned": "I", "hvd::u32": "I", "float": "f", "double": "d",
             "hvd::i64": "q"}
    if t not in table:
        raise ValueError(f"kernel {kernel}: unsupported parameter type {param.strip()!r} "
                         f"(use pointers, long long, int, unsigned int, float or double)")
    return table[t]


def discover(directory: Optional[str] = None):
    """(cu_files, {kernel: file}, {kernel: signature}) read from the sources in ``directory``
    (default kernel_dir()).  Raises ValueError on a kernel declared twice or a parameter type
    outside the launchers' set."""
    d = directory or kernel_dir()
    files = tuple(sorted(f for f in os.listdir(d) if f.endswith(".cu")))
    source, sigs = {}, {}
    for f in files:
        with open(os.path.join(d, f), encoding="utf-8") as fh:
            text = re.sub(r"/\*.*?\*/", " ", fh.read(), flags=re.S)   # block comments
            text = re.sub(r"//[^\n]*", "", text)                        # line comments
        for name, params in _DECL.findall(text):
            if name in source:
                raise ValueError(f"kernel {name} is declared in {source[name]} and {f}")
            source[name] = f
            sigs[name] = "".join(_type_code(p, name) for p in params.split(",") if p.strip())
    return files, source, sigs


_HERE = os.path.dirname(os.path.abspath(__file__))


def kernel_dir() -> str:
    """The folder holding the kernel sources.

    Looked up in order: ``$HVDCOMP_KERNEL_DIR``; ``hvdcomp/kernels`` (an installed package that
    ships the sources as package data); ``kernels/`` at the top of a source checkout.
    Raises FileNotFoundError naming the places tried.
    """
    tried = []
    env = os.environ.get("HVDCOMP_KERNEL_DIR")
    cands = [env] if env else []
    pkg = os.path.dirname(_HERE)
    cands += [os.path.join(pkg, "kernels"), os.path.join(os.path.dirname(pkg), "kernels")]
    for d in cands:
        tried.append(d)
        if all(os.path.isfile(os.path.join(d, f)) for f in SHARED_SOURCES + HOST_ONLY):
            return os.path.abspath(d)
    raise FileNotFoundError(
        "hvdcomp kernel sources (%s) not found; tried %s. Set HVDCOMP_KERNEL_DIR to the folder "
        "holding them." % (", ".join(SHARED_SOURCES + HOST_ONLY), ", ".join(tried)))


def source_hash(names: Optional[Sequence[str]] = None, directory: Optional[str] = None) -> str:
    """SHA-256 (hex) over the names and bytes of the given kernel source files (default:
    HOST_SOURCES, every source of the host build)."""
    d = directory or kernel_dir()
    h = hashlib.sha256()
    for name in (HOST_SOURCES if names is None else names):
        with open(os.path.join(d, name), "rb") as f:
            data = f.read()
        h.update(name.encode() + b"\0" + len(data).to_bytes(8, "little") + data)
    return h.hexdigest()


try:
    _CU_FILES, KERNEL_SOURCE, SIGNATURES = discover()
except (FileNotFoundError, ValueError):  # no (usable) sources: loading a backend says why;
    _CU_FILES, KERNEL_SOURCE, SIGNATURES = (), {}, {}   # the references still work

DEVICE_SOURCES = SHARED_SOURCES + _CU_FILES
HOST_SOURCES = DEVICE_SOURCES + HOST_ONLY


# ---- geometry ------------------------------------------------------------------------------

BLOCK = 256                 # threads per block of the element-wise kernels
MAX_GRID = 2**31 - 1        # gridDim.x limit; every kernel loops grid-stride beyond it
MAX_REDUCE_BLOCK = 256      # HVD_MAX_BLOCK in kernels/hvdcomp.cuh


def reduce_block(bucket_size: int) -> int:
    """Threads per block of the bucket-norm kernels: the smallest power of two >= bucket_size,
    at most 256.  It fixes the float64 summation order of the L2 norm, so it depends on
    ``bucket_size`` alone (never on the device): host and GPU norms are bit-identical."""
    return min(MAX_REDUCE_BLOCK, 1 << max(int(bucket_size) - 1, 0).bit_length())


def packed_size(n: int, bits: int) -> int:
    """Bytes of ``n`` codes of ``bits`` bits (hvdcomp.ops.bitpack.packed_size)."""
    return (n * bits + 7) // 8


def grid_for(items: int, block: int = BLOCK) -> int:
    """Blocks for ``items`` work items of ``block`` threads (at least 1, at most MAX_GRID)."""
    return max(1, min((items + block - 1) // block, MAX_GRID))


# ---- argument checks -----------------------------------------------------------------------

def check_int(v, name: str, lo: int, hi: int) -> int:
    if isinstance(v, bool):
        raise TypeError(f"{name} must be an integer, got bool")
    try:
        i = operator.index(v)
    except TypeError:
        raise TypeError(f"{name} must be an integer, got {type(v).__name__}") from None
    if not lo <= i <= hi:
        raise ValueError(f"{name} must be in {lo}..{hi}, got {i}")
    return i


def u32(v, name: str) -> int:
    """A key/counter word: any integer, taken modulo 2**32 as hvdcomp.random does."""
    return check_int(v, name, -2**63, 2**63 - 1) & 0xFFFFFFFF


def _bits(bits) -> int:
    return check_int(bits, "bits", 2, 8)


def _bucket(bucket_size) -> int:
    return check_int(bucket_size, "bucket_size", 1, 2**62)


def check_tensor(be, t, name: str, dtype: torch.dtype, numel: Optional[int] = None, *,
                 output: bool = False, device: Optional[torch.device] = None) -> torch.Tensor:
    """A kernel argument checked for backend ``be``: a 1-D torch tensor of ``dtype`` on ``be``'s
    device type (and on ``device`` when given), of ``numel`` elements when given.  Inputs are
    returned contiguous (a copy only if they were not); outputs must already be contiguous and
    not require grad.  Raises TypeError (type, dtype) or ValueError (device, shape, layout)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise TypeError(f"{name} must be {dtype}, got {t.dtype}")
    if t.device.type != be.device_type:
        raise ValueError(f"{name} must be on a {be.device_type} device for the "
                         f"{be.name} backend, got {t.device}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device}, the other arguments on {device}")
    if t.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(t.shape)}")
    if numel is not None and t.numel() != numel:
        raise ValueError(f"{name} must have {numel} elements, got {t.numel()}")
    if output:
        if not t.is_contiguous():
            raise ValueError(f"{name} (written by the kernel) must be contiguous")
        if t.requires_grad:
            raise ValueError(f"{name} (written by the kernel) must not require grad")
        return t
    return t.detach().contiguous()    # kernels read storage order


class Ops:
    """The kernel operations of one backend.

    ``backend`` provides ``device_type`` ("cpu" or "cuda") and
    ``launch(kernel, grid, block, args)``, where ``args`` follow ``SIGNATURES[kernel]``:
    contiguous tensors for ``P``, Python ints or floats for the scalars, already range-checked
    here; the backend types them exactly (ctypes or NumPy scalars).
    """

    def __init__(self, backend):
        self.be = backend

    # -- checks --
    def _tensor(self, t, name: str, dtype: torch.dtype, numel: Optional[int] = None,
                *, output: bool = False, device: Optional[torch.device] = None) -> torch.Tensor:
        return check_tensor(self.be, t, name, dtype, numel, output=output, device=device)

    def _levels(self, levels, bits: int, device) -> torch.Tensor:
        return self._tensor(levels, "levels", torch.float32, 1 << (bits - 1), device=device)

    # -- operations --
    def bucket_norms(self, x: torch.Tensor, bucket_size: int, norm: str,
                     out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Per-bucket norms of flat float32 ``x`` (n,): float32 (ceil(n / bucket_size),).

        norm "l2": sqrt of the float64 sum of squares, rounded once to float32, summed in the
        kernel's fixed order (see reduce_block); "linf": max |x|.  NaN propagates.
        Matches quantizers.bucket_norms: linf bit for bit, l2 to within 1 float32 ulp
        (bit for bit unless the two float64 sums straddle a float32 rounding boundary).
        """
        x = self._tensor(x, "x", torch.float32)
        bs = _bucket(bucket_size)
        if norm not in ("l2", "linf"):
            raise ValueError(f"norm must be 'l2' or 'linf', got {norm!r}")
        n = x.numel()
        nb = (n + bs - 1) // bs
        if out is None:
            out = torch.empty(nb, dtype=torch.float32, device=x.device)
        out = self._tensor(out, "out", torch.float32, nb, output=True, device=x.device)
        if nb:
            self.be.launch("hvd_bucket_norms_" + norm, min(nb, MAX_GRID), reduce_block(bs),
                           (x, n, bs, out))
        return out

    def quantize_pack(self, x: torch.Tensor, norms: torch.Tensor, levels: torch.Tensor,
                      bits: int, bucket_size: int, *, seed: int, rank: int, tensor_id: int,
                      step: int, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Stochastic quantization of ``x`` against the given ``norms``, packed.

        Returns uint8 (ceil(n * bits / 8),) equal to ``pack_bits(codes, bits)`` with
        ``codes = quantize_reference(x, levels, bucket_size, norm, u)[1]`` where the
        reference computes these same ``norms`` and
        ``u = hvdcomp.random.uniform(n, seed=seed, step=step, rank=rank, tensor_id=tensor_id)``.
        levels: float32 (2**(bits-1),), increasing (not checked here: no device sync).
        """
        b = _bits(bits)
        x = self._tensor(x, "x", torch.float32)
        bs = _bucket(bucket_size)
        n = x.numel()
        nb = (n + bs - 1) // bs
        norms = self._tensor(norms, "norms", torch.float32, nb, device=x.device)
        levels = self._levels(levels, b, x.device)
        nbytes = packed_size(n, b)
        if out is None:
            out = torch.empty(nbytes, dtype=torch.uint8, device=x.device)
        out = self._tensor(out, "out", torch.uint8, nbytes, output=True, device=x.device)
        if n:
            self.be.launch("hvd_quantize_pack", grid_for((n + 7) // 8), BLOCK,
                           (x, n, norms, bs, levels, b, u32(seed, "seed"),
                            u32(rank, "rank"), u32(tensor_id, "tensor_id"),
                            u32(step, "step"), out))
        return out

    def quantize(self, x: torch.Tensor, levels: torch.Tensor, bits: int, bucket_size: int,
                 norm: str, *, seed: int, rank: int, tensor_id: int,
                 step: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """(norms, packed codes): bucket_norms then quantize_pack (two launches)."""
        norms = self.bucket_norms(x, bucket_size, norm)
        packed = self.quantize_pack(x, norms, levels, bits, bucket_size, seed=seed, rank=rank,
                                    tensor_id=tensor_id, step=step)
        return norms, packed

    def dequantize_add(self, packed: torch.Tensor, n: int, norms: torch.Tensor,
                       levels: torch.Tensor, bits: int, bucket_size: int,
                       out: torch.Tensor) -> torch.Tensor:
        """``out += dequantize_reference(norms, unpack_bits(packed, n, bits), levels,
        bucket_size, bits - 1)``, bit for bit, without materializing the dense values.
        out: float32 (n,), contiguous, updated in place and returned."""
        b = _bits(bits)
        n = check_int(n, "n", 0, 2**62)
        bs = _bucket(bucket_size)
        out = self._tensor(out, "out", torch.float32, n, output=True)
        dev = out.device
        packed = self._tensor(packed, "packed", torch.uint8, packed_size(n, b), device=dev)
        norms = self._tensor(norms, "norms", torch.float32, (n + bs - 1) // bs, device=dev)
        levels = self._levels(levels, b, dev)
        if n:
            self.be.launch("hvd_dequantize_add", grid_for((n + 7) // 8), BLOCK,
                           (packed, n, norms, bs, levels, b, out))
        return out

    def dequantize_add_many(self, packed: Sequence[torch.Tensor], n: int,
                            norms: Sequence[torch.Tensor], levels: torch.Tensor, bits: int,
                            bucket_size: int, out: torch.Tensor) -> torch.Tensor:
        """``dequantize_add`` of several messages of one tensor (packed[m], norms[m]), added
        into ``out`` in list order, bit for bit as the sequence of single calls, in one pass
        over ``out`` (one launch).  All tensors on out's device; same shapes as there."""
        b = _bits(bits)
        n = check_int(n, "n", 0, 2**62)
        bs = _bucket(bucket_size)
        out = self._tensor(out, "out", torch.float32, n, output=True)
        dev = out.device
        if len(packed) != len(norms):
            raise ValueError(f"{len(packed)} packed streams but {len(norms)} norm vectors")
        if len(packed) > 2**31 - 1:
            raise ValueError("too many messages")
        packed = [self._tensor(p, "packed", torch.uint8, packed_size(n, b), device=dev)
                  for p in packed]
        norms = [self._tensor(m, "norms", torch.float32, (n + bs - 1) // bs, device=dev)
                 for m in norms]
        levels = self._levels(levels, b, dev)
        if n and packed:
            pp = torch.tensor([p.data_ptr() for p in packed], dtype=torch.int64).to(dev)
            npp = torch.tensor([m.data_ptr() for m in norms], dtype=torch.int64).to(dev)
            # packed / norms stay referenced (these lists) until the launch has been issued;
            # on a GPU the launch is ordered on the current stream before any later free
            self.be.launch("hvd_dequantize_add_many", grid_for((n + 7) // 8), BLOCK,
                           (pp, npp, len(packed), n, bs, levels, b, out))
        return out

    def _philox(self, kernel, dtype, n, seed, step, rank, tensor_id, offset, device):
        n = check_int(n, "n", 0, 2**62)
        offset = check_int(offset, "offset", 0, 2**62)
        out = torch.empty(n, dtype=dtype, device=device)
        if n:
            self.be.launch(kernel, grid_for(n), BLOCK,
                           (out, n, offset, u32(seed, "seed"), u32(rank, "rank"),
                            u32(tensor_id, "tensor_id"), u32(step, "step")))
        return out

    def random_words(self, n: int, *, seed: int, step: int, rank: int, tensor_id: int,
                     offset: int = 0, device=None) -> torch.Tensor:
        """As hvdcomp.random.random_words: int64 (n,) holding uint32 words."""
        dev = torch.device(device) if device is not None else torch.device(self.be.device_type)
        w = self._philox("hvd_philox_words", torch.int32, n, seed, step, rank, tensor_id,
                         offset, dev)
        return w.to(torch.int64) & 0xFFFFFFFF

    def uniform(self, n: int, *, seed: int, step: int, rank: int, tensor_id: int,
                offset: int = 0, device=None) -> torch.Tensor:
        """As hvdcomp.random.uniform: float32 (n,) in [0, 1)."""
        dev = torch.device(device) if device is not None else torch.device(self.be.device_type)
        return self._philox("hvd_uniform", torch.float32, n, seed, step, rank, tensor_id,
                            offset, dev)
