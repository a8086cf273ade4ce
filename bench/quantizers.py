"""Reproduce the quantizer claims of ALQ/AMQ (Faghri et al. 2020), PSQ/BHQ (Chen et al. 2020)
and DQSG/NDQSG (Abdi & Fekri 2019) on real gradients.

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
from common import (FC300100, SmallCNN, per_sample_gradients, training_gradients,  # noqa: E402
                    worker_gradients)

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


def psq_table(draws):
    """PSQ/BHQ (Chen et al. 2020): PTQ (one range per tensor) vs PSQ (per row) vs BHQ on
    per-sample gradients."""
    rows = []
    G = per_sample_gradients(n=128)
    for bits in (2, 3, 4, 5):
        for name, spec, x in (("ptq", f"psq:bits={bits}", G.reshape(1, -1)),
                              ("psq", f"psq:bits={bits}", G), ("bhq", f"bhq:bits={bits}", G)):
            if spec.split(":")[0] not in hvdcomp.available():
                continue
            r = measure(hvdcomp.get(spec), {"g": x}, draws)
            rows.append(dict(quantizer=name, bits=bits, **r))
            print(f"per-sample {bits}b {name}: nvar {r['nvar']:.5f} bits/coord "
                  f"{r['bits_per_coord']:.3f} enc {r['encode_ms']:.1f} ms", flush=True)
    return rows


def dithered_table():
    """DQSG/NDQSG (Abdi & Fekri 2019): DQSG vs NDQSG bits at the same step (same variance
    bound Delta^2/12) on the gradients 4 ranks hold at one step, the side-information
    failures, and the correlation of DQSG's error with the gradient."""
    if "ndqsg" not in hvdcomp.available():
        return {}
    grads = worker_gradients(FC300100, step=100, workers=4)
    names = sorted(n for n in grads[0] if grads[0][n].dim() > 1 and grads[0][n].numel() >= 1024)
    rows = []
    for bits, nb in ((4, 2), (6, 3), (8, 4)):
        for groups in (2, 1):
            for entropy in (False, True):
                dq = hvdcomp.get("dqsg", bits=bits, entropy=entropy)
                nd = hvdcomp.get("ndqsg", bits=bits, nested_bits=nb, dqsg_ranks=groups,
                                 entropy=entropy)
                dq_bytes = nd_bytes = numel = failed = buckets = 0
                for i, n in enumerate(names):
                    keys = [hvdcomp.TensorKey(n, i, 5, r, 4, 1) for r in range(4)]
                    msgs = [hvdcomp.Message.from_bytes(nd.encode(grads[r][n], keys[r]).to_bytes())
                            for r in range(4)]
                    nd_bytes += sum(len(m.to_bytes()) for m in msgs)
                    dq_bytes += sum(len(dq.encode(grads[r][n], keys[r]).to_bytes())
                                    for r in range(4))
                    numel += 4 * grads[0][n].numel()
                    out = torch.zeros(grads[0][n].numel())
                    nd.combine(msgs, keys, out)
                    for ev in nd.drain_events():
                        f, _, rest = ev.partition(" of ")
                        failed += int(f.split()[-1])
                    res = nd.resolve(msgs, keys, out.numel())
                    buckets += sum(int(res.failed[r].numel()) for r in range(groups, 4))
                row = dict(bits=bits, nested_bits=nb, dqsg_ranks=groups, entropy=entropy,
                           dqsg_bits=8 * dq_bytes / numel, ndqsg_bits=8 * nd_bytes / numel,
                           saving=1 - nd_bytes / dq_bytes, failed_buckets=failed,
                           nested_buckets=buckets)
                rows.append(row)
                print(f"dqsg vs ndqsg {bits}b/{nb}b groups {groups} entropy {entropy}: "
                      f"{row['dqsg_bits']:.3f} vs {row['ndqsg_bits']:.3f} bits/coord "
                      f"({100 * row['saving']:.1f} % fewer), side information failed in "
                      f"{failed}/{buckets} nested buckets", flush=True)
    # error independence of DQSG on a real gradient: one bucket (one step Delta), so that the
    # bucket-to-bucket variation of Delta does not masquerade as dependence
    g = grads[0][names[-1]].reshape(-1)
    dq = hvdcomp.get("dqsg", bits=4, bucket_size=g.numel())
    errs, xs = [], []
    for d in range(20):
        key = hvdcomp.TensorKey("w", 0, d, 0, 4, 1)
        acc = torch.zeros(g.numel())
        dq.decode(hvdcomp.Message.from_bytes(dq.encode(g, key).to_bytes()), key, acc)
        errs.append((acc - g).double())
        xs.append(g.double())
    e, x = torch.cat(errs), torch.cat(xs)
    corr = float(torch.corrcoef(torch.stack([e, x]))[0, 1])
    corr2 = float(torch.corrcoef(torch.stack([e * e, x.abs()]))[0, 1])
    print(f"DQSG error vs gradient (one bucket): corr(e, g) = {corr:+.2e}, "
          f"corr(e^2, |g|) = {corr2:+.2e} "
          f"over {e.numel()} samples (5/sqrt(n) = {5 / e.numel() ** .5:.1e})", flush=True)
    return {"dithered": rows, "dqsg_error_corr": {"corr_e_g": corr, "corr_e2_absg": corr2,
                                                  "samples": e.numel()}}


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
    res["per_sample"] = psq_table(args.draws)
    res.update(dithered_table())
    res["seconds"] = time.time() - t0
    with open(args.out + ".json", "w") as f:
        json.dump(res, f, indent=1)
    with open(args.out + ".tables.md", "w") as f:
        f.write(tables_md(res))
    print(f"wrote {args.out}.json and {args.out}.tables.md in {res['seconds']:.0f} s")


def tables_md(res) -> str:
    """Markdown tables of the measurements (the analysis lives in quantizers.md)."""
    out = [f"Command: `{res['command']}` ({res['machine']}, {res['date']}, "
           f"{res['seconds']:.0f} s)\n"]
    fam = res["family"]
    qs = [q for q in FAMILY if any(r["quantizer"] == q for r in fam)]
    for model in ("FC-300-100", "SmallCNN"):
        for step in sorted({r["step"] for r in fam if r["model"] == model}):
            out.append(f"\n### {model}, gradient at step {step}: normalized variance "
                       f"E||Q(g)-g||^2/||g||^2 (bits/coord packed / entropy-coded)\n")
            out.append("| bits | " + " | ".join(qs) + " |")
            out.append("|---" * (len(qs) + 1) + "|")
            for bits in (2, 3, 4, 5):
                cells = []
                for q in qs:
                    r = [x for x in fam if x["model"] == model and x["step"] == step
                         and x["bits"] == bits and x["quantizer"] == q]
                    if not r:
                        cells.append("")
                        continue
                    r = r[0]
                    cells.append(f"{r['nvar']:.4g} ({r['bits_per_coord']:.2f} / "
                                 f"{r.get('bits_entropy', float('nan')):.2f})")
                out.append(f"| {bits} | " + " | ".join(cells) + " |")
    times = [r for r in fam if r["model"] == "FC-300-100" and r["bits"] == 3]
    if times:
        out.append("\n### Encode / decode time, FC-300-100 (266,200 coordinates), 3 bits, "
                   "1 thread, PyTorch reference path\n")
        out.append("| quantizer | encode ms | decode ms |\n|---|---|---|")
        for q in qs:
            r = [x for x in times if x["quantizer"] == q]
            if r:
                out.append(f"| {q} | {statistics.median(x['encode_ms'] for x in r):.1f} | "
                           f"{statistics.median(x['decode_ms'] for x in r):.1f} |")
    if res.get("per_sample"):
        out.append("\n### Per-sample gradients (128 x 1000, FC-300-100 last layer): "
                   "normalized variance\n")
        out.append("| bits | PTQ | PSQ | BHQ |\n|---|---|---|---|")
        for bits in (2, 3, 4, 5):
            v = {r["quantizer"]: r["nvar"] for r in res["per_sample"] if r["bits"] == bits}
            out.append(f"| {bits} | {v.get('ptq', float('nan')):.4g} | "
                       f"{v.get('psq', float('nan')):.4g} | {v.get('bhq', float('nan')):.4g} |")
    if res.get("dithered"):
        out.append("\n### DQSG vs NDQSG on the gradients of 4 ranks (FC-300-100, step 100), "
                   "same step Delta\n")
        out.append("| bits / nested bits | DQSG ranks | entropy | DQSG bits/coord | "
                   "NDQSG bits/coord | fewer bits | side info failed |")
        out.append("|---|---|---|---|---|---|---|")
        for r in res["dithered"]:
            out.append(f"| {r['bits']} / {r['nested_bits']} | {r['dqsg_ranks']} of 4 | "
                       f"{r['entropy']} | {r['dqsg_bits']:.3f} | {r['ndqsg_bits']:.3f} | "
                       f"{100 * r['saving']:.1f} % | {r['failed_buckets']} / "
                       f"{r['nested_buckets']} buckets |")
        c = res["dqsg_error_corr"]
        out.append(f"\nDQSG error vs gradient (one bucket, {c['samples']} samples): "
                   f"corr(e, g) = {c['corr_e_g']:+.2e}, corr(e^2, |g|) = "
                   f"{c['corr_e2_absg']:+.2e}.")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    main()
