"""Train the main job with every quantizer at 2 and 3 bits and bucket sizes 8192 and 65536
(4 ranks, the same seed) and tabulate final test accuracy and bytes sent.

    .venv/bin/python bench/train_quantizers.py [--epochs 12] [--out bench/results/train_quantizers]

ALQ/AMQ's robustness claim (Faghri et al. 2020): at the harshest setting (2 bits, bucket
65536) ALQ and AMQ stay within 1 point of `none` while uniform QSGD loses more than 2 points.
Each run is `launch/run -np 4 .venv/bin/python examples/train_mnist.py --compression SPEC`.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

BUCKETED = ["qsgd", "qsgdinf", "nuqsgd", "alq", "alq:norm=linf", "amq", "amq:norm=linf",
            "dqsg", "ndqsg"]
UNBUCKETED = ["psq", "bhq"]


def specs():
    yield "none", None, None
    yield "terngrad", 2, None
    for bits in (2, 3):
        for bucket in (8192, 65536):
            for q in BUCKETED:
                name, _, extra = q.partition(":")
                if name == "ndqsg":              # nested codes must be narrower than bits
                    extra = f"nested_bits={bits - 1}"
                yield (f"{name}:bits={bits},bucket_size={bucket}" + (f",{extra}" if extra else ""),
                       bits, bucket)
        for q in UNBUCKETED:
            yield f"{q}:bits={bits}", bits, None


def run(spec, epochs, seed):
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    cmd = [os.path.join(ROOT, "launch", "run"), "-np", "4", sys.executable,
           os.path.join(ROOT, "examples", "train_mnist.py"), "--compression", spec,
           "--epochs", str(epochs), "--seed", str(seed), "--no-progress", "--json", path]
    t0 = time.time()
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    if p.returncode != 0:
        return {"error": (p.stdout + p.stderr)[-800:]}
    with open(path) as f:
        res = json.load(f)
    os.unlink(path)
    last = res["epochs"][-1]
    return {"test_acc": last["test_acc"], "bytes_per_rank": last["bytes_per_rank"],
            "ratio": last["ratio"], "wall_s": time.time() - t0,
            "curve": [e["test_acc"] for e in res["epochs"]]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=12)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", default="", help="comma-separated substrings of specs to run")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "train_quantizers"))
    args = ap.parse_args()
    import hvdcomp
    rows = []
    for spec, bits, bucket in specs():
        if spec.split(":")[0] not in hvdcomp.available():
            continue
        if args.only and not any(s in spec for s in args.only.split(",")):
            continue
        r = run(spec, args.epochs, args.seed)
        r.update(spec=spec, bits=bits, bucket=bucket)
        rows.append(r)
        if "error" in r:
            print(f"{spec:45s} FAILED: {r['error'][-300:]}", flush=True)
        else:
            print(f"{spec:45s} acc {r['test_acc']:6.2f} %  bytes/rank/epoch "
                  f"{r['bytes_per_rank'] / 1e6:7.3f} MB  ratio {r['ratio']:6.2f}x  "
                  f"[{r['wall_s']:.0f} s]", flush=True)
    out = {"command": "python bench/train_quantizers.py " + " ".join(sys.argv[1:]),
           "date": time.strftime("%Y-%m-%d"), "epochs": args.epochs, "seed": args.seed,
           "rows": rows}
    with open(args.out + ".json", "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {args.out}.json")


if __name__ == "__main__":
    main()
