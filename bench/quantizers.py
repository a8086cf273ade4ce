"""Reproduce the quantizer claims of seeds 1, 4 and 5 on real gradients.

    .venv/bin/python bench/quantizers.py [--draws 20] [--out bench/results/quantizers]

Real gradients: FC-300-100 and a small CNN trained on the MNIST digits of the main job,
taken at steps 0, 100 and 400 of a real (one-process) training run; per-sample gradients of
FC-300-100's last layer for PSQ/BHQ.  For 2..5 bits and each quantizer it measures the
normalized variance E||Q(g) - g||^2 / ||g||^2 (averaged over --draws Philox streams), the
bits per coordinate on the wire (whole messages, headers included) with and without entropy
coding, and encode / decode times.  Writes <out>.json and <out>.md.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import FC300100, SmallCNN, per_sample_gradients, training_gradients  # noqa: E402

import hvdcomp  # noqa: E402
from hvdcomp import levels as L  # noqa: E402

FAMILY = ["qsgd", "qsgdinf", "nuqsgd", "terngrad", "alq", "alq-normal", "alq-inf", "amq",
          "amq-inf", "dqsg"]


def compressible(gdict):
    return {n: g for n, g in gdict.items() if g.dim() > 1 and g.numel() >= 1024}


def make(name, bits, bucket=8192, entropy=False):
    variants = {"alq-normal": ("alq", ",model=normal"),    # the paper's truncated normal
                "alq-inf": ("alq", ",norm=linf"), "amq-inf": ("amq", ",norm=linf")}
    if name in variants:
        base, extra = variants[name]
        c = make(base, bits, bucket, entropy)
        return None if c is None else hvdcomp.get(c.spec() + extra)
    if name not in hvdcomp.available():
        return None
    if name == "terngrad":
        if bits != 2:
            return None
        try:
            return hvdcomp.get("terngrad", **({"entropy": True} if entropy else {}))
        except hvdcomp.ConfigError:
            return None
    kw = dict(bits=bits, bucket_size=bucket)
    if entropy:
        kw["entropy"] = True
    try:
        return hvdcomp.get(name, **kw)
    except hvdcomp.ConfigError:
        return None


def fit_to(comp, grads):
    """ALQ/AMQ: fit the levels to these gradients, as the refit during training does."""
    if hasattr(comp, "fit"):
        stats = sum(comp.statistics(g) for g in grads.values())
        comp.adopt(comp.fit(stats))


def measure(comp, grads, draws):
    sq = sum(float(g.double().pow(2).sum()) for g in grads.values())
    err, enc_t, dec_t, nbytes, numel = [], [], [], 0, 0
    for d in range(draws):
        e = 0.0
        te = td = 0.0
        nbytes = numel = 0
        for i, (n, g) in enumerate(sorted(grads.items())):
            key = hvdcomp.TensorKey(n, i, d, 0, 4, 1)
            t0 = time.perf_counter()
            b = comp.encode(g, key).to_bytes()
            t1 = time.perf_counter()
            acc = torch.zeros(g.numel())
            comp.decode(hvdcomp.Message.from_bytes(b), key, acc)
            t2 = time.perf_counter()
            te += t1 - t0
            td += t2 - t1
            e += float((acc.double() - g.reshape(-1).double()).pow(2).sum())
            nbytes += len(b)
            numel += g.numel()
        err.append(e / sq)
        enc_t.append(te)
        dec_t.append(td)
    return dict(nvar=statistics.fmean(err), nvar_sem=(statistics.stdev(err) / len(err) ** .5
                                                       if len(err) > 1 else 0.0),
                bits_per_coord=8 * nbytes / numel, encode_ms=1e3 * statistics.median(enc_t),
                decode_ms=1e3 * statistics.median(dec_t), numel=numel)


def family_table(draws):
    rows = []
    for mname, mfn in (("FC-300-100", FC300100), ("SmallCNN", SmallCNN)):
        for step, gd in training_gradients(mfn).items():
            grads = compressible(gd)
            for bits in (2, 3, 4, 5):
                for q in FAMILY:
                    comp = make(q, bits)
                    if comp is None:
                        continue
                    fit_to(comp, grads)
                    r = measure(comp, grads, draws)
                    ent = make(q, bits, entropy=True)
                    if ent is not None and "entropy" in ent.settings():
                        fit_to(ent, grads)
                        r["bits_entropy"] = measure(ent, grads, 1)["bits_per_coord"]
                    rows.append(dict(model=mname, step=step, bits=bits, quantizer=q, **r))
                    print(f"{mname:10s} step {step:3d} {bits}b {q:8s} nvar {r['nvar']:10.4f}  "
                          f"bits/coord {r['bits_per_coord']:.3f}"
                          f" (entropy {r.get('bits_entropy', float('nan')):.3f})  "
                          f"enc {r['encode_ms']:.1f} ms dec {r['decode_ms']:.1f} ms", flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--draws", type=int, default=20)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                  "quantizers"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    t0 = time.time()
    res = {"command": "python bench/quantizers.py " + " ".join(sys.argv[1:]),
           "machine": f"{platform.machine()} {os.cpu_count()} cores, torch {torch.__version__}",
           "date": time.strftime("%Y-%m-%d"), "family": family_table(args.draws)}
    try:
        from quantizers_extra import extra_tables
        res.update(extra_tables(args.draws))
    except ImportError:
        pass
    res["seconds"] = time.time() - t0
    with open(args.out + ".json", "w") as f:
        json.dump(res, f, indent=1)
    print(f"wrote {args.out}.json in {res['seconds']:.0f} s")


if __name__ == "__main__":
    main()
