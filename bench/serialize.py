"""What framing a message costs on one core: building a frame (hvdcomp.transport.Outgoing)
against a plain copy of its bytes and the CRC-32 the wire format adds, for one large
float32 ``none`` message (the hierarchical exchange's in-host pieces used to travel so) and
for the eight ALQ 3-bit messages of the real task's CNN; and the frame built the way it was
before the one-copy serializer (each message's ``to_bytes()`` joined), for comparison.

    .venv/bin/python bench/serialize.py        # writes bench/results/serialize.md

Times: best of --reps, one thread, wall clock.  The bytes of the frame are checked to be
the same both ways.
"""
from __future__ import annotations

import argparse
import os
import struct
import sys
import time
import zlib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402
import torch  # noqa: E402

import hvdcomp  # noqa: E402
from hvdcomp.auto import _best_of as best  # noqa: E402  (best of reps, wall clock)
from hvdcomp.compressors import TensorKey  # noqa: E402
from hvdcomp.transport import Outgoing, join_frames  # noqa: E402

CNN = [(32, 1, 5, 5), (32,), (64, 32, 5, 5), (64,), (1024, 3136), (1024,), (10, 1024), (10,)]


def old_to_bytes(m):
    """Message.to_bytes as it was before (its sections copied by tobytes, joined, and the
    CRC appended: three new copies)."""
    head, secs = m.layout()
    body = b"".join([head] + [s.tobytes() for s in secs])
    return body + struct.pack("<I", zlib.crc32(body))


def old_frame(msgs):
    """The frame as it was built before: each message's old bytes, then joined."""
    return join_frames([old_to_bytes(m) for m in msgs])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--numel", type=int, default=12_750_000)   # 51 MB of float32
    args = ap.parse_args()
    torch.set_num_threads(1)
    g = torch.randn(args.numel)
    big = [hvdcomp.get("none").encode(g, TensorKey("g", 0, 0, 0, 2, 1, shape=(args.numel,),
                                                     dtype=torch.float32))]
    alq = hvdcomp.get("alq:bits=3")
    small = [alq.encode(torch.randn(s), TensorKey(f"t{i}", i, 0, 0, 4, 1, shape=s,
                                                  dtype=torch.float32))
             for i, s in enumerate(CNN)]
    rows = []
    for name, msgs in ((f"one `none` message, {4 * args.numel / 1e6:.0f} MB", big),
                       ("8 ALQ 3-bit messages of the CNN", small)):
        frame = Outgoing(msgs).data
        assert frame.tobytes() == old_frame(msgs).tobytes()
        raw = frame.copy()
        rows.append((name, len(frame), best(lambda: Outgoing(msgs), args.reps),
                     best(lambda: old_frame(msgs), args.reps),
                     best(lambda: raw.copy(), args.reps),
                     best(lambda: zlib.crc32(raw), args.reps)))
    load = os.getloadavg()[0]
    lines = ["# Building a frame: one copy against the old serializer",
             "", f"`.venv/bin/python bench/serialize.py --reps {args.reps}` "
             f"({time.strftime('%Y-%m-%d %H:%M')} UTC, load average {load:.2f}, one thread; "
             "best of the reps). Frame bytes identical both ways.", "",
             "| messages | frame bytes | frame now (ms) | frame before (ms) | copy of the bytes "
             "(ms) | CRC-32 of the bytes (ms) |", "|---|---|---|---|---|---|"]
    for name, n, now, before, copy, crc in rows:
        lines.append(f"| {name} | {n} | {now * 1e3:.3f} | {before * 1e3:.3f} | "
                     f"{copy * 1e3:.3f} | {crc * 1e3:.3f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    with open(os.path.join(ROOT, "bench", "results", "serialize.md"), "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
