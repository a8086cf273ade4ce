"""Speed of the host build's element-wise kernels (kernels/*.cu compiled with g++), per thread,
two versions of the sources side by side in one process.

    .venv/bin/python bench/host_kernels.py --old main --n 25000000 --reps 7
    .venv/bin/python bench/host_kernels.py --n 25000000            # the current sources alone

Each version (``--old``: a git ref whose kernels/ is extracted, or a folder of sources;
``--new``: default the checkout's kernels/) is built with the host build's own flags
(hvdcomp/backends/host.py: BASE_FLAGS + OpenMP + $HVDCOMP_HOST_CXXFLAGS) into a temporary
folder and loaded with ctypes; the operations are hvdcomp's own launchers (the kernel
implementations of the ops in hvdcomp/ops, ``op.kernels(be, ...)``), given a launch object
bound to that library.  For every operation the versions are timed alternately (old, new, old, new, ...),
so that a busy neighbour slows both alike, and the median of --reps is reported, with the
ratio old / new, and the best (minimum) of the reps: on a shared machine the closest to the
uncontended time.  The outputs of the two versions are compared byte for byte.

GB/s: 4n bytes (the float32 gradient read once) per second: the figure the issue's targets
use (1 GB/s per thread for an encode: 25M coordinates in 100 ms).  --threads (default 1):
OpenMP threads per launch.

Only the two libraries are loaded (not hvdcomp's own, host.load()): each takes a slot of
glibc's static TLS surplus (host_shim.h's initial-exec TLS), which holds about two.

The reduce-scatter's cost per piece (``--pieces 8,64,1024``: this alone, with hvdcomp's own
library and compressors, no --old):

    .venv/bin/python bench/host_kernels.py --pieces 8,64,1024 --piece 8192 --reps 15

One tensor of N x --piece float32 coordinates (ALQ 3 bits, bucket 8192: the reduce-scatter
cuts at bucket boundaries; a piece of one bucket is a shard of ResNet-50's 25M coordinates
among about 3,000 ranks, or of a 64 MiB fusion bucket among 2,000) is encoded and decoded as the
reduce-scatter does it for N destination ranks: *before*, one
``encode`` / ``decode`` call per piece (its earlier code); *after*, one
``Compressor.encode_pieces`` / ``decode_pieces`` call for all N (one kernel launch); and,
as the baseline, the whole tensor as 1 message.  The per-piece cost is (time for the N
pieces - time for 1 message) / (N - 1), as bench/scaling_model.py's ``piece_costs``
defines it.  Rows: the stage-1 encode (3 bits) and the final decode of the N owners'
stage-2 messages (5 bits: :class:`~hvdcomp.compressors.quantizers.Finer`); the owner's
combine of the N ranks' contributions to its own piece was one launch already and is not
here.  The three versions are timed in turn (before, after, one message), medians of
--reps after a warm-up, taken round-robin over every case and version (one call each per round,
so that a busy spell of a shared machine falls on all alike).  Times are the calling
thread's CPU time (``time.thread_time``: the kernels run in it, one thread), so that the
time a loaded machine keeps the process waiting is not counted; the wall-clock per-piece
costs follow in the last columns.  The messages of before and after are compared byte for
byte and the decoded sums bit for bit.
"""
from __future__ import annotations

import argparse
import ctypes
import datetime
import hashlib
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from hvdcomp import levels as L  # noqa: E402
from hvdcomp.backends import _common, host  # noqa: E402
from hvdcomp.compressors.base import TensorKey  # noqa: E402
from hvdcomp.ops import dithered as Dith  # noqa: E402
from hvdcomp.ops import psq as P  # noqa: E402
from hvdcomp.ops import quantize as Q  # noqa: E402
from hvdcomp.ops import philox_draws as R  # noqa: E402
from hvdcomp.ops import ternary as T  # noqa: E402

_CTYPES = {"q": ctypes.c_longlong, "i": ctypes.c_int, "I": ctypes.c_uint,
           "f": ctypes.c_float, "d": ctypes.c_double}


def sources(ref: str, tmp: str) -> str:
    """A folder holding the kernel sources of ``ref`` (a folder, or a git ref of this repo)."""
    if os.path.isdir(ref):
        return os.path.abspath(ref)
    d = os.path.join(tmp, "src-" + ref.replace("/", "_"))
    os.makedirs(d)
    arc = subprocess.run(["git", "-C", ROOT, "archive", ref, "kernels"], check=True,
                         capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", d], input=arc, check=True)
    return os.path.join(d, "kernels")


def build(src: str, out: str) -> str:
    """Build the host library from the sources in ``src`` with host.py's flags (kept in
    host.cache_dir()/bench-<hash>.so, keyed by the sources and flags)."""
    flags = [*host.BASE_FLAGS, *host.OPENMP_FLAGS, *host._extra_flags()]
    h = hashlib.sha256(" ".join([host.compiler(), *flags]).encode())
    for f in sorted(os.listdir(src)):
        if f.endswith((".cu", ".cuh", ".h", ".cpp")):
            with open(os.path.join(src, f), "rb") as fh:
                h.update(f.encode() + b"\0" + fh.read())
    cached = os.path.join(host.cache_dir(), f"bench-{h.hexdigest()[:20]}.so")
    if os.path.exists(cached):
        return cached
    _, kernel_source, _ = _common.discover(src)
    reg = out + ".d"
    os.makedirs(reg, exist_ok=True)
    files = sorted(set(kernel_source.values()))
    lines = ["#pragma once"] + [f'#include "{f}"' for f in files]
    lines.append("#define HVD_HOST_KERNEL_TABLE \\")
    lines += [f"  HVD_HOST_KERNEL({k}), \\" for f in files
              for k in kernel_source if kernel_source[k] == f]
    with open(os.path.join(reg, "hvd_host_kernels.h"), "w") as fh:
        fh.write("\n".join(lines) + "\n\n")
    cmd = [host.compiler(), *flags, "-I", reg, "-I", src, "-o", out,
           os.path.join(src, "host_launch.cpp")]
    subprocess.run(cmd, check=True)
    os.makedirs(os.path.dirname(cached), exist_ok=True)
    shutil.copyfile(out, cached + ".tmp")
    os.replace(cached + ".tmp", cached)
    return cached


class Lib:
    """A launch object (as host.backend) bound to one built library."""
    device_type = "cpu"
    name = "host"

    def __init__(self, path: str, threads: int):
        lib = host.declare(ctypes.CDLL(path))
        self.lib = lib
        self.threads = threads
        self.kernels = {lib.hvd_host_kernel_name(k).decode():
                        (k, lib.hvd_host_kernel_signature(k).decode())
                        for k in range(lib.hvd_host_kernel_count())}
        try:
            lib.hvd_host_simd.restype = ctypes.c_int
            self.simd = lib.hvd_host_simd()
        except AttributeError:          # sources from before the SIMD bulk paths
            self.simd = None

    def launch(self, kernel, grid, block, args):
        index, sig = self.kernels[kernel]
        vals = []
        for code, a in zip(sig, args):
            vals.append(ctypes.c_void_p(a.data_ptr()) if code == "P" else _CTYPES[code](a))
        argv = (ctypes.c_void_p * len(vals))(*[ctypes.addressof(v) for v in vals])
        if self.lib.hvd_host_launch(index, grid, block, self.threads, argv):
            raise RuntimeError(f"{kernel}: {self.lib.hvd_host_last_error().decode()}")


def cases(n: int, ref: "Lib"):
    """(name, fn(lib) -> output tensor(s)) for the timed operations; inputs made with ``ref``.
    Each op allocates its output as hvdcomp does (torch.empty), except the decodes, which
    add into one accumulator per (library, case)."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(n, generator=gen) * 1e-3
    key = dict(seed=1234, rank=1, tensor_id=3, step=5)
    tk = TensorKey("w", 3, 5, 1, 4, 1234)
    bs = 8192
    lv4 = torch.tensor(L.uniform_levels(4), dtype=torch.float32)
    # ALQ-like non-uniform 3-bit table (the level search does not care about the values)
    lv3 = torch.tensor([0.0, 0.1, 0.35, 1.0], dtype=torch.float32)
    norms_l2 = Q.bucket_norms.kernels(ref, x, bs, "l2")
    norms_inf = Q.bucket_norms.kernels(ref, x, bs, "linf")
    p3 = Q.quantize_pack.kernels(ref, x, norms_l2, lv3, 3, bs, **key)
    p4 = Q.quantize_pack.kernels(ref, x, norms_l2, lv4, 4, bs, **key)
    # the reduce-scatter's second stage of 3-bit ALQ: lv3 refined to 5 bits (16 levels)
    lv5 = torch.from_numpy(L.refine(lv3.double().numpy(), 5))
    p5 = Q.quantize_pack.kernels(ref, x, norms_l2, lv5, 5, bs, **key)
    msgs = [Q.quantize_pack.kernels(ref, x, norms_l2, lv3, 3, bs, seed=1234, rank=r,
                                    tensor_id=3, step=5) for r in range(4)]
    acc = torch.zeros(n)
    scales_t, thr = T.terngrad_scales.reference(x, 2.5, bs)
    tern = T.terngrad_pack.kernels(ref, x, scales_t, bs, thr, **key)
    scales_s = T.signef_scales.reference(x, None, bs)
    signs, _ = T.signef_pack.kernels(ref, x, None, scales_s, bs)
    delta = Dith.bucket_steps.kernels(ref, x, 4, bs)
    dq4 = Dith.dqsg_encode.kernels(ref, x, delta, 4, bs, tk)
    D = 512
    xr = x[: (n // D) * D].view(-1, D)
    lohi, ps4 = P.quantize_rows.kernels(ref, xr, 4, **key)
    bufs = {}

    def buf(lib, tag, like):
        """One accumulator per (library, case): it accumulates over the repetitions, and both
        versions get the same number of calls, so they stay comparable bit for bit."""
        k = (id(lib), tag)
        if k not in bufs:
            bufs[k] = like.clone()
        return bufs[k]

    def qp(lib, norms, lv, bits):
        return Q.quantize_pack.kernels(lib, x, norms, lv, bits, bs, **key)

    def dq(lib, tag, packed, bits, lv):
        return Q.dequantize_add.kernels(lib, packed, n, norms_l2, lv, bits, bs,
                                        buf(lib, tag, acc))

    def dqm(lib, tag):
        return Q.dequantize_add_many.kernels(lib, msgs, n, [norms_l2] * 4, lv3, 3, bs,
                                             buf(lib, tag, acc))

    return [
        ("bucket_norms l2 (bucket 8192)", lambda lib: Q.bucket_norms.kernels(lib, x, bs, "l2")),
        ("bucket_norms linf (bucket 8192)",
         lambda lib: Q.bucket_norms.kernels(lib, x, bs, "linf")),
        ("quantize_pack 3 bits (ALQ/AMQ)", lambda lib: qp(lib, norms_l2, lv3, 3)),
        ("quantize_pack 4 bits (QSGD/NUQSGD)", lambda lib: qp(lib, norms_l2, lv4, 4)),
        ("quantize_pack 4 bits, linf norms (QSGDinf)", lambda lib: qp(lib, norms_inf, lv4, 4)),
        ("quantize_pack 5 bits (second stage of 3-bit ALQ)",
         lambda lib: qp(lib, norms_l2, lv5, 5)),
        ("dequantize_add 3 bits", lambda lib: dq(lib, "d3", p3, 3, lv3)),
        ("dequantize_add 4 bits", lambda lib: dq(lib, "d4", p4, 4, lv4)),
        ("dequantize_add 5 bits", lambda lib: dq(lib, "d5", p5, 5, lv5)),
        ("dequantize_add_many 3 bits, 4 messages (per message)", lambda lib: dqm(lib, "dm")),
        ("terngrad_pack", lambda lib: T.terngrad_pack.kernels(lib, x, scales_t, bs, thr, **key)),
        ("terngrad_decode_add", lambda lib: T.terngrad_decode_add.kernels(
            lib, tern, n, scales_t, bs, buf(lib, "td", acc))),
        ("signef_pack (no residual)",
         lambda lib: T.signef_pack.kernels(lib, x, None, scales_s, bs)[0]),
        ("signef_decode_add", lambda lib: T.signef_decode_add.kernels(
            lib, signs, n, scales_s, bs, buf(lib, "sd", acc))),
        ("dqsg encode 4 bits", lambda lib: Dith.dqsg_encode.kernels(lib, x, delta, 4, bs, tk)),
        ("dqsg decode_add 4 bits", lambda lib: Dith.dqsg_decode_add.kernels(
            lib, dq4, n, delta, 4, bs, buf(lib, "dd", acc), tk)),
        ("psq quantize_rows 4 bits (rows of 512)",
         lambda lib: P.quantize_rows.kernels(lib, xr, 4, **key)[1]),
        ("psq dequantize_add 4 bits (rows of 512)", lambda lib: P.dequantize_add.kernels(
            lib, ps4, xr.shape[0], D, lohi, 4, buf(lib, "pd", acc[: xr.numel()]))),
        ("random_words (Philox, int64 out)",
         lambda lib: R.random_words.kernels(lib, n, **key)),
        ("uniform (Philox, float32 out)", lambda lib: R.uniform.kernels(lib, n, **key)),
    ]


def pieces_cases(m: int, counts, bucket: int = 8192):
    """(name, N, {version: fn() -> result}) for the --pieces comparison (module docstring):
    pieces of ``m`` coordinates."""
    from hvdcomp.compressors import get
    if m % bucket:
        raise SystemExit(f"--piece {m} is not a multiple of the bucket size {bucket}")
    gen = torch.Generator().manual_seed(7)
    x_all = torch.randn(max(counts) * m, generator=gen) * 1e-3
    alq = get(f"alq:bits=3,bucket_size={bucket}")
    fine = alq.second_stage()

    def case(N):
        n = N * m
        x = x_all[:n]
        spans = [(k * m, (k + 1) * m) for k in range(N)]
        # the keys the reduce-scatter gives a tensor's pieces (Piece.key, Piece.key2)
        keys = [TensorKey(f"w[{lo}:{hi}]", 100 + 2 * k, 5, 1, N, 1234, shape=(hi - lo,),
                          dtype=torch.float32) for k, (lo, hi) in enumerate(spans)]
        keys2 = [TensorKey(k.name + "/avg", k.tensor_id + 1, 5, j, 1, 1234, shape=k.shape,
                           dtype=torch.float32) for j, k in enumerate(keys)]
        whole = TensorKey("w", 3, 5, 1, N, 1234, shape=(n,), dtype=torch.float32)
        whole2 = TensorKey("w/avg", 4, 5, 1, 1, 1234, shape=(n,), dtype=torch.float32)
        msgs2 = [fine.encode(x[lo:hi], k) for (lo, hi), k in zip(spans, keys2)]
        one2 = fine.encode(x, whole2)
        acc = {v: torch.zeros(n) for v in ("before", "after", "one")}

        def dec_before():
            a = acc["before"]
            for msg, k, (lo, hi) in zip(msgs2, keys2, spans):
                fine.decode(msg, k, a[lo:hi])
            return a

        def dec_after():
            fine.decode_pieces(msgs2, keys2, spans, acc["after"])
            return acc["after"]

        return [("encode, ALQ 3 bits (stage 1)", N, {
                    "before": lambda: [alq.encode(x[lo:hi], k)
                                       for (lo, hi), k in zip(spans, keys)],
                    "after": lambda: alq.encode_pieces(x, spans, keys),
                    "one": lambda: [alq.encode(x, whole)]}),
                ("decode, 5 bits (stage 2 of ALQ 3 bits)", N, {
                    "before": dec_before,
                    "after": dec_after,
                    "one": lambda: fine.decode(one2, whole2, acc["one"])})]

    return [c for N in counts for c in case(N)]


def run_pieces(args) -> int:
    """The --pieces comparison (module docstring)."""
    counts = [int(c) for c in args.pieces.split(",")]
    print(f"# reduce-scatter pieces of {args.piece:,} coordinates (ALQ 3 bits, bucket 8192), "
          f"1 thread, median of {args.reps}, "
          f"{datetime.datetime.now():%Y-%m-%d %H:%M}, {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} CPUs, torch {torch.__version__}, SIMD level {host.simd_level()}")
    print("\n| operation | pieces N | N calls ms | one call ms | 1 message ms "
          "| per-piece cost before us | after us | before / after "
          "| wall clock, per piece: before / after us | before / after, wall | identical |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    host.set_num_threads(1)
    cases_ = pieces_cases(args.piece, counts)
    same, times = [], []
    for name, N, fns in cases_:
        res = {v: f() for v, f in fns.items()}          # warm-up
        same.append([m.to_bytes() for m in res["before"]] == [m.to_bytes() for m in res["after"]]
                    if "encode" in name else None)      # decodes: their sums, at the end
        times.append({v: [] for v in fns})
    # round-robin over every case and version, one call each per round: a busy spell of
    # the shared machine then falls on all of them alike
    walls = [{v: [] for v in t} for t in times]
    for _ in range(args.reps):
        for (name, N, fns), t, w in zip(cases_, times, walls):
            for v, f in fns.items():
                c0, t0 = time.thread_time(), time.perf_counter()
                f()
                w[v].append(time.perf_counter() - t0)
                t[v].append(time.thread_time() - c0)
    for (name, N, fns), t, w, ok in zip(cases_, times, walls, same):
        if ok is None:                                  # both accumulated reps + 1 decodes
            ok = torch.equal(fns["before"](), fns["after"]())
        med = {v: statistics.median(x) for v, x in t.items()}
        wm = {v: statistics.median(x) for v, x in w.items()}
        per_b = (med["before"] - med["one"]) / (N - 1)
        per_a = (med["after"] - med["one"]) / (N - 1)
        wb = (wm["before"] - wm["one"]) / (N - 1)
        wa = (wm["after"] - wm["one"]) / (N - 1)
        ratio = f"{per_b / per_a:.1f}x" if per_a > 0 else "-"
        ratio_w = f"{wb / wa:.1f}x" if wa > 0 else "-"
        print(f"| {name} | {N} | {med['before'] * 1e3:.2f} | {med['after'] * 1e3:.2f} | "
              f"{med['one'] * 1e3:.2f} | {per_b * 1e6:.1f} | {per_a * 1e6:.1f} | {ratio} | "
              f"{wb * 1e6:.1f} / {wa * 1e6:.1f} | {ratio_w} | {ok} |", flush=True)
    return 0


def per(name: str) -> int:
    return 4 if "4 messages" in name else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", default=None, help="git ref or folder of the baseline sources")
    ap.add_argument("--new", default=None, help="folder of the sources (default kernels/)")
    ap.add_argument("--n", type=int, default=25_000_000)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--only", default="", help="comma-separated substrings of case names")
    ap.add_argument("--pieces", default="", help="comma-separated piece counts: the "
                    "reduce-scatter's per-piece cost, before and after (module docstring)")
    ap.add_argument("--piece", type=int, default=8192, help="coordinates per piece (--pieces)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    if args.pieces:
        return run_pieces(args)
    tmp = tempfile.mkdtemp(prefix="hvd-host-bench-")
    try:
        versions = []
        if args.old:
            versions.append(("old", build(sources(args.old, tmp), os.path.join(tmp, "old.so"))))
        new_src = os.path.abspath(args.new) if args.new else _common.kernel_dir()
        versions.append(("new", build(new_src, os.path.join(tmp, "new.so"))))
        libs = [(name, Lib(path, args.threads)) for name, path in versions]
        n = args.n
        print(f"# host kernels, n = {n:,}, {args.threads} thread(s), median of {args.reps}, "
              f"{datetime.datetime.now():%Y-%m-%d %H:%M}, {platform.processor() or platform.machine()}, "
              f"{os.cpu_count()} CPUs, torch {torch.__version__}; versions: " + ", ".join(
                  f"{nm} = {args.old if nm == 'old' else (args.new or 'kernels/')}"
                  f" (SIMD level {lib.simd})" for (nm, _), (_, lib) in zip(versions, libs)))
        if len(libs) == 2:
            print("\n| operation | old ms | new ms | old GB/s | new GB/s | old / new "
                  "| old / new ms, best of reps | new GB/s, best | identical |")
            print("|---|---|---|---|---|---|---|---|---|")
        else:
            print("\n| operation | ms | GB/s | ms, best of reps | GB/s, best |")
            print("|---|---|---|---|---|")
        only = [s for s in args.only.split(",") if s]
        for name, fn in cases(n, libs[0][1]):
            if only and not any(s in name for s in only):
                continue
            times = {nm: [] for nm, _ in libs}
            outs = {}
            for nm, lib in libs:           # warm-up (and the outputs compared)
                outs[nm] = fn(lib)
            for _ in range(args.reps):
                for nm, lib in libs:
                    t0 = time.perf_counter()
                    fn(lib)
                    times[nm].append(time.perf_counter() - t0)
            med = {nm: statistics.median(t) for nm, t in times.items()}
            best = {nm: min(t) for nm, t in times.items()}
            gbs = {nm: per(name) * 4 * n / med[nm] / 1e9 for nm in med}
            gbb = {nm: per(name) * 4 * n / best[nm] / 1e9 for nm in best}
            if len(libs) == 2:
                same = torch.equal(outs["old"], outs["new"])
                print(f"| {name} | {med['old'] * 1e3:.1f} | {med['new'] * 1e3:.1f} | "
                      f"{gbs['old']:.2f} | {gbs['new']:.2f} | "
                      f"{med['old'] / med['new']:.2f}x | "
                      f"{best['old'] * 1e3:.1f} / {best['new'] * 1e3:.1f} | {gbb['new']:.2f} | "
                      f"{same} |", flush=True)
            else:
                print(f"| {name} | {med['new'] * 1e3:.1f} | {gbs['new']:.2f} | "
                      f"{best['new'] * 1e3:.1f} | {gbb['new']:.2f} |", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
