"""Encode and decode speed of every compressor: kernels against the PyTorch reference, same
device, same process, with the bytes compared.

    .venv/bin/python bench/codec_speed.py --device cpu --sizes 25000000        # this machine
    python bench/codec_speed.py --device cuda --sizes 25000000,1000000        # launch/gpu-check

For each compressor (its usual settings) and size n, on one float32 gradient N(0, 1e-6):
  encode  compressor.encode(grad, key) -> message  (what a rank does once per step)
  decode  compressor.decode(message, key, acc)     (one rank's message added into acc;
                                                    a rank decodes N of them per step)
once with the kernels (HVDCOMP_BACKEND=kernels) and once with the PyTorch reference
(HVDCOMP_BACKEND=reference), each on its own fresh compressor fed the same steps, so that
stateful compressors (error feedback, DGC, LAQ) evolve identically.  Checked: the message bytes
of every step and the decoded accumulator are identical between the two paths.  Times:
median of --reps after one warm-up step (CPU: wall clock, one thread unless --threads;
CUDA: synchronized wall clock), and on CUDA a device-to-device copy of the 4n gradient bytes
(the memory floor: "fraction of copy bandwidth" = copy time / kernel time).
Results: --json (and a markdown table on stdout).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

import hvdcomp  # noqa: E402
from hvdcomp import backends  # noqa: E402
from hvdcomp.compressors.protocols import SummedRounds  # noqa: E402

# Every compressor of hvdcomp's registry but the casts (nothing to time but a copy) and those
# summed in rounds (powersgd: no encode/decode to time), at its defaults except the settings
# below (those of the recorded results), and ALQ entropy-coded.
SETTINGS = {"qsgd": "bits=4", "qsgdinf": "bits=4", "nuqsgd": "bits=4", "alq": "bits=3",
            "amq": "bits=3", "psq": "bits=4", "bhq": "bits=4", "dqsg": "bits=4",
            "ndqsg": "bits=4", "dgc": "density=0.001", "topk": "density=0.001",
            "randk": "density=0.001", "laq": "bits=4"}
METHODS = [name + (":" + SETTINGS[name] if name in SETTINGS else "")
           for name, cls in hvdcomp.compressors.registry().items()
           if cls.__module__.startswith("hvdcomp.") and cls.wire_dtype is None
           and not cls.sends_values and not issubclass(cls, SummedRounds)] + [
               "alq:bits=3,entropy=true"]


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device):
    _sync(device)
    t0 = time.perf_counter()
    out = fn()
    _sync(device)
    return time.perf_counter() - t0, out


def run_path(spec, mode, grads, device, world=4):
    """Encode every step's gradient, decode its message; returns times, bytes, accumulators."""
    with backends.use(mode):
        comp = hvdcomp.get(spec)
        enc_t, dec_t, msgs, accs = [], [], [], []
        for step, g in enumerate(grads):
            key = hvdcomp.TensorKey("w", 0, step, 0, world, 1)
            t, m = _timed(lambda: comp.encode(g, key), device)
            b = b"" if m is None else m.to_bytes()
            acc = torch.zeros(g.numel(), device=device)
            if m is not None:
                m2 = hvdcomp.Message.from_bytes(b)
                td, _ = _timed(lambda: comp.decode(m2, key, acc), device)
            else:
                td = 0.0
            enc_t.append(t)
            dec_t.append(td)
            msgs.append(b)
            accs.append(acc)
        return enc_t, dec_t, msgs, accs


def measure(spec, n, device, reps):
    gen = torch.Generator().manual_seed(n % 1000 + 7)
    grads = [(torch.randn(n, generator=gen) * 1e-3).to(device) for _ in range(reps + 1)]
    ke, kd, kmsg, kacc = run_path(spec, "kernels", grads, device)
    re_, rd, rmsg, racc = run_path(spec, "reference", grads, device)
    same_bytes = all(a == b for a, b in zip(kmsg, rmsg))
    same_acc = all(torch.equal(a, b) for a, b in zip(kacc, racc))
    row = dict(method=spec, n=n, device=str(device),
               encode_kernel_s=statistics.median(ke[1:]), encode_reference_s=statistics.median(re_[1:]),
               decode_kernel_s=statistics.median(kd[1:]), decode_reference_s=statistics.median(rd[1:]),
               message_bytes=len(kmsg[-1]), identical_bytes=same_bytes, identical_decode=same_acc)
    row["encode_speedup"] = row["encode_reference_s"] / max(row["encode_kernel_s"], 1e-12)
    row["decode_speedup"] = row["decode_reference_s"] / max(row["decode_kernel_s"], 1e-12)
    if device.type == "cuda":
        x, y = grads[0], torch.empty_like(grads[0])
        y.copy_(x)
        t = statistics.median(_timed(lambda: y.copy_(x), device)[0] for _ in range(5))
        row["copy_s"] = t
        row["encode_copy_fraction"] = t / max(row["encode_kernel_s"], 1e-12)
        row["decode_copy_fraction"] = t / max(row["decode_kernel_s"], 1e-12)
    return row


def table(rows) -> str:
    cuda = any("copy_s" in r for r in rows)
    head = ("| method | n | encode kernel / reference (ms) | speed-up | decode kernel / reference "
            "(ms) | speed-up | bytes identical | decode identical |"
            + (" copy (ms) | fraction of copy bw enc / dec |" if cuda else ""))
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        line = (f"| {r['method']} | {r['n']:,} | {r['encode_kernel_s'] * 1e3:.1f} / "
                f"{r['encode_reference_s'] * 1e3:.1f} | {r['encode_speedup']:.1f}x | "
                f"{r['decode_kernel_s'] * 1e3:.1f} / {r['decode_reference_s'] * 1e3:.1f} | "
                f"{r['decode_speedup']:.1f}x | {r['identical_bytes']} | {r['identical_decode']} |")
        if cuda:
            line += (f" {r['copy_s'] * 1e3:.2f} | {r['encode_copy_fraction']:.2f} / "
                     f"{r['decode_copy_fraction']:.2f} |")
        lines.append(line)
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--sizes", default="25000000")
    ap.add_argument("--methods", default=";".join(METHODS), help="';'-separated specs")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="CPU threads (torch and kernels)")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    from hvdcomp.backends import host
    host.set_num_threads(args.threads)
    rows = []
    for n in [int(s) for s in args.sizes.split(",")]:
        for spec in args.methods.split(";"):
            try:
                r = measure(spec, n, device, args.reps)
            except Exception as e:   # noqa: BLE001 - one method's failure is reported, not fatal
                r = dict(method=spec, n=n, device=str(device), error=f"{type(e).__name__}: {e}")
                print(json.dumps(r), flush=True)
                rows.append(r)
                continue
            rows.append(r)
            print(json.dumps(r), flush=True)
    good = [r for r in rows if "error" not in r]
    print(table(good))
    if args.json:
        meta = dict(date=time.strftime("%Y-%m-%d %H:%M"), machine=platform.node(),
                    cpu=platform.processor() or platform.machine(), torch=torch.__version__,
                    threads=args.threads, command="python bench/codec_speed.py "
                    + " ".join(sys.argv[1:]))
        if device.type == "cuda":
            meta["device_name"] = torch.cuda.get_device_name(device)
        with open(args.json, "w") as f:
            json.dump(dict(meta, results=rows), f, indent=1)
    bad = [r for r in rows if "error" in r or not (r["identical_bytes"] and r["identical_decode"])]
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
