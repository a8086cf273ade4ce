"""Bits on the wire against the error of the estimate, on real gradients (#22 item 2, target c).

    nice -n 10 .venv/bin/python bench/bits_variance.py [--draws 3] [--out PREFIX]

Real gradients: FC-300-100 and the small CNN of bench/common.py trained on the main job's
MNIST digits (one process, plain SGD), and the real task's Fashion-MNIST CNN
(examples/fashion.py, 3.27 M parameters, batch 64), at steps 0, 100 and 400 of the run; the
tensors with at least 1,024 elements and two or more dimensions (what the drop-in compresses). For every
method and setting, one operating point per gradient:

* bits per coordinate = 8 x (bytes of the whole encoded messages, headers included) / the
  coordinates, from the real messages hvdcomp encodes (``Message.to_bytes``), summed over the
  model's tensors;
* normalized error = ||C(g) - g||^2 / ||g||^2 summed over the tensors, averaged over
  ``--draws`` Philox streams for the stochastic (unbiased) quantizers: for those it is the
  normalized variance E||Q(g) - g||^2 / ||g||^2; for the biased methods (top-k, DGC, scaled
  sign, PowerSGD) it is the deterministic error of one step, which error feedback carries to
  the next step rather than averages away.  Each method's first step (empty residual), and
  for those with error feedback also its steady state: the error on g_t + e_t after Alg. 2
  ran over the 10 preceding real gradients, with the bits of that step's messages
  (``bits_ef``; PowerSGD's floats per step do not change, so its first step's bits).

Methods: hvdcomp's QSGD (2-8 bits), QSGDinf, NUQSGD, ALQ and AMQ (L2 and L-inf bucket norms;
levels fitted to the gradient as the refit during training does) at 2-5 bits, all with bucket
1024, packed and rANS-coded (``entropy=True``); DQSG (Abdi & Fekri 2019) rANS-coded at bucket
65536 with the paper's step (bucket max / M, 4-8 bits), and with its step set by a variance
target (``variance_target`` 0.01-0.1 in steps of 0.0025, bits 6, 7 and 8); uniformef
(nearest steps set by a variance target, 0.01-0.44, rANS, error feedback; each bucket's
step from its norm, and ``step_scope=model``: one step for every tensor from the previous
step's mean square, which at a first step falls back to the buckets' own; and, as an
oracle that streaming cannot have, with m taken from the step being sent); TernGrad;
EF-SignSGD's scaled sign; top-k and DGC at densities 0.1 %-40 % with fp32, fp16, int8 and
int4 values (``values=int8/int4``: a float32 scale per 256 values, rounded to nearest;
indices Golomb-Rice coded: the only index coding hvdcomp has); top-k whose values are
re-quantized by a second hvdcomp message (a composition made in this bench, with ALQ-inf or
QSGDinf levels and rANS); PowerSGD
(Vogels et al., NeurIPS 2019, Alg. 1 and 2) at ranks 1-64: hvdcomp's ``powersgd`` itself
(float32 sums, as PyTorch's hook; tensors where it does not pay sent uncompressed), and the
plain PyTorch reference below with P and Q rounded to fp16 (a variant hvdcomp does not
send; every matrix compressed); and CGX's quantizer (stochastic max-min,
Markov et al. 2022; its README: "basic stochastic max-min uniform quantization") whose exact
variance is computed in closed form.

The target (#22 (c)): at most 2.0 bits per coordinate at an error no higher than QSGD at
4 bits with bucket 1024.  Two readings of that reference are reported: hvdcomp's
``qsgd:bits=4,bucket_size=1024`` (L2 bucket norm, sign + levels {0, 1/7 .. 1}) and CGX's
4-bit max-min quantizer at bucket 1024 (16 levels between the bucket's min and max, two
fp32 per bucket: 4.0625 bits, the "4.06 bits" of the issue).
Writes <out>.json, <out>.tables.md and <out>.png (the analysis: bench/results/bits_variance.md).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import FC300100, SmallCNN, training_gradients  # noqa: E402
from quantizers import fit_to  # noqa: E402  (ALQ/AMQ levels fitted as bench/quantizers.py does)

import hvdcomp  # noqa: E402
from hvdcomp import TensorKey  # noqa: E402
from hvdcomp.exchange.rounds import simulate  # noqa: E402

BUCKET = 1024
STEPS = (0, 100, 400)
WARM = 10                    # PowerSGD: Alg. 1 run on this many preceding steps to warm Q
TARGET_BITS = 2.0
DENSITIES = (0.001, 0.003, 0.01, 0.03, 0.1, 0.2, 0.25, 0.3, 0.4)
RANKS = (1, 2, 4, 8, 16, 24, 32, 48, 64)
MODELS = (("FC-300-100", FC300100, 32), ("SmallCNN", SmallCNN, 32),
          ("FC-300-100 batch 256", FC300100, 256), ("Fashion-MNIST CNN", None, 64))


def fashion_gradients(points, batch=64, lr=0.05, seed=0):
    """common.training_gradients for the real task's model (examples/fashion.py's
    FashionCNN, 3.27 M parameters) on Fashion-MNIST (bench/real_task.py's settings: batch
    64, lr 0.05, momentum 0.9)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))), "examples"))
    import fashion
    x, y, _, _ = fashion.load()
    return training_gradients(fashion.FashionCNN, points=points, batch=batch, lr=lr,
                              seed=seed, data=(x, y, fashion.normalize))


# --- plain PyTorch references -----------------------------------------------------------------

def as_matrix(t: torch.Tensor) -> torch.Tensor:
    """A gradient as the 2-D matrix PowerSGD compresses: (shape[0], numel / shape[0])."""
    return t.reshape(t.shape[0], -1)


def powersgd_step(m: torch.Tensor, q: torch.Tensor, fp16: bool = False):
    """One power-iteration step of PowerSGD (Vogels, Karimireddy, Jaggi, NeurIPS 2019,
    Alg. 1) on one worker: ``P = M Q``; ``P_hat = orthogonalize(P)``; ``Q' = M^T P_hat``;
    the estimate is ``P_hat Q'^T``.

    m: (n, k) matrix; q: (k, r) float, the warm-started Q (the previous step's Q', or i.i.d.
    standard normal at the first step).  fp16: P_hat and Q' rounded to float16 (what travels
    when the allreduce carries half precision).  Orthogonalization: the reduced QR's Q, which
    spans the same columns as Alg. 1's Gram-Schmidt, and ``P_hat P_hat^T`` is the same
    projection.  Returns (estimate (n, k), Q' (k, r'), floats sent = (n + k) r'), r' = min(r, n)
    (the reduced QR of an n x r P has min(r, n) columns: what travels).
    On the wire: P and Q are each summed by an allreduce, no header.
    """
    p = m @ q
    p_hat, _ = torch.linalg.qr(p, mode="reduced")
    q_new = m.t() @ p_hat
    if fp16:
        p_hat, q_new = p_hat.half().to(m.dtype), q_new.half().to(m.dtype)
    return p_hat @ q_new.t(), q_new, (m.shape[0] + m.shape[1]) * p_hat.shape[1]


def maxmin_variance(x: torch.Tensor, bits: int, bucket: int) -> float:
    """Exact E||Q(x) - x||^2 of stochastic max-min quantization (CGX's quantizer): per bucket
    of ``bucket`` coordinates, ``unit = (max - min) / (2^bits - 1)``, each x rounded to one of
    the two neighbouring grid points ``min + j unit`` with the probabilities that make it
    unbiased, whose variance is ``unit^2 f (1 - f)`` with f the fractional part of
    ``(x - min) / unit``.  Computed in float64; a last bucket may be short."""
    x = x.reshape(-1).double()
    total = 0.0
    for b in x.split(bucket):
        lo, hi = float(b.min()), float(b.max())
        if hi == lo:
            continue
        unit = (hi - lo) / (2 ** bits - 1)
        t = (b - lo) / unit
        f = t - torch.floor(t)
        total += float((unit * unit * f * (1 - f)).sum())
    return total


def maxmin_bits(numel: int, bits: int, bucket: int) -> float:
    """Payload bits per coordinate of CGX's messages: ``bits`` per coordinate and two fp32
    (min, unit) per bucket; no framing counted."""
    return (bits * numel + 64 * math.ceil(numel / bucket)) / numel


# --- measurements ---------------------------------------------------------------------------

def compressible(gdict):
    return {n: g for n, g in gdict.items() if g.dim() > 1 and g.numel() >= 1024}


def quantizer(name, bits, entropy):
    """hvdcomp quantizer ``name`` (``-inf``: L-inf bucket norm) at bucket 1024, or None."""
    base, _, inf = name.partition("-")
    kw = dict(bits=bits, bucket_size=BUCKET, entropy=entropy)
    if inf:
        kw["norm"] = "linf"
    try:
        return hvdcomp.get(base, **kw)
    except hvdcomp.ConfigError:
        return None


def run_messages(make, grads, draw):
    """Encode and decode every tensor with a fresh compressor ``make()`` (empty residuals)
    under Philox stream ``draw``; returns (squared error, message bytes, coordinates)."""
    comp = make()
    err = 0.0
    nbytes = numel = 0
    for i, (n, g) in enumerate(sorted(grads.items())):
        key = hvdcomp.TensorKey(n, i, draw, 0, 4, 1)
        b = comp.encode(g, key).to_bytes()
        acc = torch.zeros(g.numel())
        comp.decode(hvdcomp.Message.from_bytes(b), key, acc)
        err += float((acc.double() - g.reshape(-1).double()).pow(2).sum())
        nbytes += len(b)
        numel += g.numel()
    return err, nbytes, numel


def measure(make, grads, draws, sq):
    runs = [run_messages(make, grads, d) for d in range(draws)]
    errs = [r[0] / sq for r in runs]
    nbytes, numel = runs[-1][1], runs[-1][2]
    return dict(nerr=statistics.fmean(errs),
                nerr_sem=statistics.stdev(errs) / len(errs) ** .5 if len(errs) > 1 else 0.0,
                bits=8 * nbytes / numel, bytes=nbytes, first_err=errs[0])


def ef_error(make, history, grads):
    """Error feedback in its steady state: a compressor ``make()`` (top-k, DGC, scaled sign,
    uniformef)
    runs Alg. 1 of Stich et al. / Karimireddy et al. over the preceding real gradients
    ``history`` (oldest first), then compresses g_t; returns ||C(p) - p||^2 / ||p||^2 for
    p = g_t + e_t, the vector it actually compresses at step t (what the residual carries).
    Returns {"nerr_ef": that error, "bits_ef": 8 x the bytes of step t's messages / coords}."""
    comp = make()
    names = sorted(grads)
    for j, gd in enumerate(history):
        for i, n in enumerate(names):
            comp.encode(gd[n], hvdcomp.TensorKey(n, i, j, 0, 4, 1))
    err = sq = 0.0
    nbytes = numel = 0
    for i, n in enumerate(names):
        g = grads[n]
        e = comp.residual(n) if hasattr(comp, "residual") else comp.accumulation(n)
        p = g.reshape(-1).double() + (0 if e is None else e.reshape(-1).double())
        key = hvdcomp.TensorKey(n, i, len(history), 0, 4, 1)
        acc = torch.zeros(g.numel())
        b = comp.encode(g, key).to_bytes()
        comp.decode(hvdcomp.Message.from_bytes(b), key, acc)
        err += float((acc.double() - p).pow(2).sum())
        sq += float(p.pow(2).sum())
        nbytes += len(b)
        numel += g.numel()
    return {"nerr_ef": err / sq, "bits_ef": 8 * nbytes / numel}


def same_step_model_scope(spec, grads):
    """``uniformef:...,step_scope=model`` with an empty residual whose mean square m is that
    of ``grads`` themselves (the compressor's own statistic, taken by encoding them once in a
    throw-away copy): one step for the whole model at a first step, which a streaming
    exchange cannot have (the first tensor leaves before the last gradient exists).  An
    oracle: it shows what the allocation alone would give at step 0."""
    probe = hvdcomp.get(spec)
    for i, n in enumerate(sorted(grads)):
        probe.encode(grads[n], hvdcomp.TensorKey(n, i, 0, 0, 4, 1))
    comp = hvdcomp.get(spec)
    comp.load_state_dict({"residuals": {}, "mean_square": probe.state_dict()["mean_square"]})
    return comp


def topk_quantized(p, density, vq, vbits, entropy, name, i, step, fitted):
    """Top-k (hvdcomp, fp32 values, no residual of its own) of tensor ``p`` whose values
    section is replaced by a second hvdcomp message quantizing the m selected values (a
    composition made in this bench, not a hvdcomp setting).  ALQ's levels are fitted to the
    values the first time a tensor is seen and kept in ``fitted`` (by name), as training
    refits them rarely.  Returns (decoded flat float64 tensor, bytes = the top-k message
    without its values section + the whole quantizer message)."""
    key = hvdcomp.TensorKey(name, i, step, 0, 4, 1)
    tk = hvdcomp.get("topk", density=density, error_feedback=False)
    msg = hvdcomp.Message.from_bytes(tk.encode(p, key).to_bytes())
    idx, vals = tk.decode_sparse(msg)
    q = fitted.get(name)
    if q is None:
        q = fitted[name] = quantizer(vq, vbits, entropy)
        fit_to(q, {"v": vals})
    vkey = hvdcomp.TensorKey(name + ".values", i, step, 0, 4, 1)
    vb = q.encode(vals, vkey).to_bytes()
    dec = torch.zeros(vals.numel())
    q.decode(hvdcomp.Message.from_bytes(vb), vkey, dec)
    acc = torch.zeros(p.numel(), dtype=torch.float64)
    acc[torch.from_numpy(idx)] = dec.double()
    return acc, len(msg.to_bytes()) - len(msg.sections[1]) + len(vb)


def sparse_quantized(grads, history, setting, draws, sq):
    """topk_quantized on every tensor: the error on g_t (first step, over ``draws``; levels
    fitted to g_t's values) and, with the residual kept as top-k's error feedback
    (e <- p - decoded) over ``history``, the error on p = g_t + e_t (one draw; levels fitted
    at the first step of the history) and the bits of that step's messages (``bits_ef``)."""
    errs, nbytes, numel = [], 0, 0
    names = sorted(grads)
    fitted = {}
    for d in range(draws):
        e = 0.0
        nbytes = numel = 0
        for i, n in enumerate(names):
            g = grads[n]
            acc, b = topk_quantized(g, *setting, n, i, d, fitted)
            e += float((acc - g.reshape(-1).double()).pow(2).sum())
            nbytes += b
            numel += g.numel()
        errs.append(e / sq)
    res = {n: torch.zeros(grads[n].numel(), dtype=torch.float64) for n in names}
    fitted = {}
    for j, gd in enumerate(history + [grads]):
        err = psq = 0.0
        ef_bytes = 0
        for i, n in enumerate(names):
            p = gd[n].reshape(-1).double() + res[n]
            acc, b = topk_quantized(p.float(), *setting, n, i, j, fitted)
            res[n] = p - acc
            err += float(res[n].pow(2).sum())
            psq += float(p.pow(2).sum())
            ef_bytes += b
    return dict(nerr=statistics.fmean(errs),
                nerr_sem=statistics.stdev(errs) / len(errs) ** .5 if len(errs) > 1 else 0.0,
                nerr_ef=err / psq, bits=8 * nbytes / numel, bytes=nbytes,
                bits_ef=8 * ef_bytes / numel)


def powersgd_rounds(comp, grads, step):
    """One step of an hvdcomp PowerSGD instance ``comp`` on world size 1, through the
    exchange's own one-process driver of the rounds (:func:`hvdcomp.exchange.rounds.simulate`).
    Returns ({name: average}, float32 elements summed: what the allreduces carry, per
    rank)."""
    est, floats = {}, 0
    for i, (n, g) in enumerate(sorted(grads.items())):
        key = TensorKey(n, i, step, 0, 1, shape=tuple(g.shape), dtype=g.dtype)
        floats += sum(comp.round_sizes(key.shape, step))
        (avg,) = simulate([comp], [g], [key])
        est[n] = avg.view_as(g)
    return est, floats


def hvdcomp_powersgd_points(history, grads, rank, step):
    """hvdcomp's ``powersgd:rank=<rank>`` itself (float32 sums, its rule for which tensors
    are compressed, Philox initial Q) on gradient ``grads`` at ``step``, after it ran
    (Alg. 2, error feedback) on the preceding real gradients ``history`` (oldest first).
    First step: a new instance with the warm Q and no residual, error on g_t; steady state:
    the running instance, error on p = g_t + e_t relative to ||p||^2.  Bits: 32 x the
    float32 elements its allreduces carry per rank (no header) / coordinates."""
    spec = f"powersgd:rank={rank}"
    comp = hvdcomp.get(spec)
    for s, gd in enumerate(history):
        powersgd_rounds(comp, {n: gd[n] for n in grads}, step - len(history) + s)
    state = comp.state_dict()
    first = hvdcomp.get(spec)
    first.load_state_dict({"q": state["q"], "residual": {}})
    est, floats = powersgd_rounds(first, grads, step)
    e_g = sum(float((est[n].double() - g.double()).pow(2).sum()) for n, g in grads.items())
    p = {n: g.double() + state["residual"][n].double().view_as(g)
         if n in state["residual"] else g.double() for n, g in grads.items()}
    est_ef, _ = powersgd_rounds(comp, grads, step)
    e_ef = sum(float((est_ef[n].double() - p[n]).pow(2).sum()) for n in grads)
    sq = sum(float(g.double().pow(2).sum()) for g in grads.values())
    sq_ef = sum(float(v.pow(2).sum()) for v in p.values())
    numel = sum(g.numel() for g in grads.values())
    return dict(nerr=e_g / sq, nerr_sem=0.0, nerr_ef=e_ef / sq_ef, bits=32 * floats / numel,
                bytes=4 * floats)


def powersgd_points(history, grads, rank, fp16, seed=0):
    """PowerSGD rank ``rank`` on gradient ``grads`` (step t): Q starts i.i.d. N(0, 1) and is
    warm-started through Alg. 1 with error feedback on the preceding real gradients
    ``history`` (oldest first); then one step on g_t.  Returns the error on M = g_t (comparable
    with the other methods) and on M = g_t + e_t (Alg. 1's actual input at step t), and the
    bits: 32 (or 16) x (n + k) x r per matrix, no header."""
    gen = torch.Generator().manual_seed(seed)
    qs, res = {}, {}
    for n, g in grads.items():
        mat = as_matrix(g).double()
        qs[n] = torch.randn(mat.shape[1], rank, generator=gen, dtype=torch.float64)
        res[n] = torch.zeros_like(mat)
    for gd in history:
        for n in grads:
            mat = as_matrix(gd[n]).double() + res[n]
            est, qs[n], _ = powersgd_step(mat, qs[n], fp16)
            res[n] = mat - est
    e_g = e_ef = sq_ef = 0.0
    floats = numel = 0
    for n, g in grads.items():
        mat = as_matrix(g).double()
        est, _, f = powersgd_step(mat, qs[n], fp16)
        e_g += float((mat - est).pow(2).sum())
        m_ef = mat + res[n]
        est_ef, _, _ = powersgd_step(m_ef, qs[n], fp16)
        e_ef += float((m_ef - est_ef).pow(2).sum())
        sq_ef += float(m_ef.pow(2).sum())
        floats += f
        numel += g.numel()
    sq = sum(float(g.double().pow(2).sum()) for g in grads.values())
    width = 16 if fp16 else 32
    return dict(nerr=e_g / sq, nerr_sem=0.0, nerr_ef=e_ef / sq_ef,
                bits=width * floats / numel, bytes=width * floats // 8)


QUANTIZERS = [("qsgd", range(2, 9)), ("qsgdinf", range(2, 9)), ("nuqsgd", range(2, 6)),
              ("alq", range(2, 6)), ("alq-inf", range(2, 6)), ("amq", range(2, 6)),
              ("amq-inf", range(2, 6))]
SPARSE_Q = [("qsgdinf", 8, False), ("alq-inf", 4, True), ("alq-inf", 5, True)]
SPARSE_Q_DENSITIES = (0.03, 0.1, 0.2, 0.25, 0.3, 0.4)
DQSG_BUCKET = 65536
VARIANCE_TARGETS = tuple(round(0.01 + 0.0025 * i, 4) for i in range(37))    # 0.01 .. 0.1
UNIFORMEF_TARGETS = tuple(round(0.01 * 1.25 ** i, 5) for i in range(18))     # 0.01 .. 0.44


def gradient_rows(model, step, grads, history, draws):
    sq = sum(float(g.double().pow(2).sum()) for g in grads.values())
    numel = sum(g.numel() for g in grads.values())
    zeros = sum(int((g == 0).sum()) for g in grads.values())
    rows = []

    def add(method, setting, r, biased, entropy=False):
        rows.append(dict(model=model, step=step, method=method, setting=setting,
                         biased=biased, entropy=entropy, numel=numel,
                         zero_fraction=zeros / numel, **r))
        print(f"{model:10s} {step:3d} {method:22s} {setting:34s} bits {r['bits']:7.4f} "
              f"err {r['nerr']:.4g}", flush=True)

    for bits in range(2, 9):                                   # CGX's max-min, exact
        v = sum(maxmin_variance(g, bits, BUCKET) for g in grads.values()) / sq
        add("cgx-maxmin", f"bits={bits},bucket_size={BUCKET}",
            dict(nerr=v, nerr_sem=0.0, bits=maxmin_bits(numel, bits, BUCKET), bytes=0), False)
    for name, bit_range in QUANTIZERS:
        for bits in bit_range:
            comp = quantizer(name, bits, False)
            if comp is None:
                continue
            fit_to(comp, grads)
            r = measure(lambda: comp, grads, draws, sq)
            add(name, comp.spec(), r, False)
            ent = quantizer(name, bits, True)
            fit_to(ent, grads)
            re = measure(lambda: ent, grads, 1, sq)
            # entropy coding is lossless: same decoded values in the same stream
            assert abs(re["first_err"] - r["first_err"]) <= 1e-9 * r["first_err"], (name, bits)
            add(name, ent.spec(), dict(r, bits=re["bits"], bytes=re["bytes"]), False, True)
    for bits in range(4, 9):                                   # DQSG, the paper's step
        spec = f"dqsg:bits={bits},bucket_size={DQSG_BUCKET},entropy=True"
        add("dqsg", spec, measure(lambda: hvdcomp.get(spec), grads, draws, sq), False, True)
    for bits in (6, 7, 8):                                     # DQSG, step set by a variance
        for v in VARIANCE_TARGETS:
            spec = (f"dqsg:bits={bits},bucket_size={DQSG_BUCKET},entropy=True,"
                    f"variance_target={v}")
            add("dqsg variance", spec, measure(lambda: hvdcomp.get(spec), grads, draws, sq),
                False, True)
    for v in UNIFORMEF_TARGETS:                                # nearest steps + EF, rANS
        spec = f"uniformef:bits=6,bucket_size={DQSG_BUCKET},variance_target={v}"
        add("uniformef", spec, dict(measure(lambda: hvdcomp.get(spec), grads, 1, sq),
                                    **ef_error(lambda: hvdcomp.get(spec), history, grads)),
            True, True)
    for v in UNIFORMEF_TARGETS:                 # one step for the model: step_scope=model
        spec = (f"uniformef:bits=6,bucket_size={DQSG_BUCKET},variance_target={v},"
                f"step_scope=model")
        add("uniformef model", spec, dict(measure(lambda: hvdcomp.get(spec), grads, 1, sq),
                                          **ef_error(lambda: hvdcomp.get(spec), history, grads)),
            True, True)
    for v in UNIFORMEF_TARGETS:     # the same, m from the step being sent: an oracle (below)
        spec = (f"uniformef:bits=6,bucket_size={DQSG_BUCKET},variance_target={v},"
                f"step_scope=model")
        add("uniformef model (oracle m)", spec,
            measure(lambda: same_step_model_scope(spec, grads), grads, 1, sq), True, True)
    for bucket in (0, BUCKET):
        for entropy in (False, True):
            spec = f"terngrad:bucket_size={bucket},entropy={entropy}"
            add("terngrad", spec, measure(lambda: hvdcomp.get(spec), grads, draws, sq), False,
                entropy)
        spec = f"signef:bucket_size={bucket}"
        add("signef", spec, dict(measure(lambda: hvdcomp.get(spec), grads, 1, sq),
                                 **ef_error(lambda: hvdcomp.get(spec), history, grads)),
            True)
    for d in DENSITIES:
        for values in ("fp32", "fp16", "int8", "int4"):
            spec = f"topk:density={d},values={values}"
            add("topk", spec, dict(measure(lambda: hvdcomp.get(spec), grads, 1, sq),
                                   **ef_error(lambda: hvdcomp.get(spec), history, grads)),
                True)
        if d in (0.001, 0.01, 0.1):                            # DGC, momentum 0: top-k's
            spec = f"dgc:density={d},values=fp16"
            add("dgc", spec, dict(measure(lambda: hvdcomp.get(spec), grads, 1, sq),
                                  **ef_error(lambda: hvdcomp.get(spec), history, grads)),
                True)
        for vq, vbits, entropy in SPARSE_Q if d in SPARSE_Q_DENSITIES else ():
            r = sparse_quantized(grads, history, (d, vq, vbits, entropy), draws, sq)
            add("topk+quantized values",
                f"topk:density={d} + {vq}:bits={vbits},entropy={entropy}", r, True, entropy)
    for rank in RANKS:
        add("powersgd", f"powersgd:rank={rank}",
            hvdcomp_powersgd_points(history, grads, rank, step), True)
        add("powersgd fp16", f"rank={rank},fp16",
            powersgd_points(history, grads, rank, True), True)
    return rows


def reference(g, which):
    """The reference point among a gradient's rows: hvdcomp's qsgd 4 bits bucket 1024
    (packed) or CGX's max-min 4 bits bucket 1024."""
    if which == "qsgd":
        return next(r for r in g if r["method"] == "qsgd" and not r["entropy"]
                    and r["setting"].startswith("qsgd:bits=4,"))
    return next(r for r in g if r["method"] == "cgx-maxmin" and r["setting"].startswith("bits=4,"))


def has(r, kind):
    """Whether a row has an error of ``kind``: every row a first step's; a biased row a
    steady state's only where measured (not the oracle rows), an unbiased one always (its
    error does not depend on the step)."""
    return kind == "nerr" or "nerr_ef" in r or not r["biased"]


def err(r, kind):
    """A row's error of kind "nerr" (first step, empty residual) or "nerr_ef" (error feedback
    in its steady state: on g_t + e_t); unbiased methods have no residual, so both are nerr."""
    return r.get(kind, r["nerr"])


def bits_of(r, kind):
    """A row's bits per coordinate at the error of ``kind``: for "nerr_ef" those of the
    steady state's messages (``bits_ef``) where measured, else the first step's (PowerSGD's
    do not change; the unbiased quantizers have no steady state)."""
    return r.get("bits_ef", r["bits"]) if kind == "nerr_ef" else r["bits"]


READINGS = {"qsgd": ("qsgd", "nerr"), "cgx": ("cgx", "nerr"), "cgx_ef": ("cgx", "nerr_ef")}


def verdict(rows):
    """Per gradient: both reference points; per method its lowest error at <= 2.0 bits and
    its fewest bits at an error no higher than the reference, for each reading (READINGS:
    reference, error kind)."""
    out = []
    for model, step in sorted({(r["model"], r["step"]) for r in rows},
                              key=lambda k: ([m[0] for m in MODELS].index(k[0]), k[1])):
        g = [r for r in rows if r["model"] == model and r["step"] == step]
        refs = {w: reference(g, w) for w in ("qsgd", "cgx")}
        per = {}
        for r in g:
            if r["method"] == "cgx-maxmin":
                continue
            m = per.setdefault(r["method"], {"best_under_2bits": {}, "fewest_bits": {}})
            for kind in ("nerr", "nerr_ef"):
                if not has(r, kind):
                    continue
                b = m["best_under_2bits"].get(kind)
                if bits_of(r, kind) <= TARGET_BITS and (b is None
                                                        or err(r, kind) < err(b, kind)):
                    m["best_under_2bits"][kind] = r
            for w, (ref, kind) in READINGS.items():
                if not has(r, kind):
                    continue
                f = m["fewest_bits"].get(w)
                if err(r, kind) <= refs[ref]["nerr"] and (
                        f is None or bits_of(r, kind) < bits_of(f, kind)):
                    m["fewest_bits"][w] = r
        out.append(dict(model=model, step=step, ref_qsgd4=refs["qsgd"], ref_cgx4=refs["cgx"],
                        zero_fraction=g[0]["zero_fraction"], methods=per))
    return out


# --- report ---------------------------------------------------------------------------------

def _is(method, entropy=None, has=""):
    return lambda r: (r["method"] == method and (entropy is None or r["entropy"] == entropy)
                      and has in r["setting"])


PLOT_SERIES = [   # (label, which rows, error kind)
    ("CGX max-min (reference curve)", _is("cgx-maxmin"), "nerr"),
    ("QSGD packed", _is("qsgd", False), "nerr"),
    ("QSGD rANS", _is("qsgd", True), "nerr"),
    ("QSGDinf rANS", _is("qsgdinf", True), "nerr"),
    ("NUQSGD rANS", _is("nuqsgd", True), "nerr"),
    ("ALQ rANS", _is("alq", True), "nerr"),
    ("ALQ-inf rANS", _is("alq-inf", True), "nerr"),
    ("AMQ rANS", _is("amq", True), "nerr"),
    ("AMQ-inf rANS", _is("amq-inf", True), "nerr"),
    ("TernGrad rANS", _is("terngrad", True), "nerr"),
    ("DQSG rANS, bucket 65536", _is("dqsg", True), "nerr"),
    ("DQSG variance target, rANS", _is("dqsg variance", True), "nerr"),
    ("uniformef", _is("uniformef"), "nerr"),
    ("uniformef, EF steady state", _is("uniformef"), "nerr_ef"),
    ("uniformef step_scope=model, EF steady state", _is("uniformef model"), "nerr_ef"),
    ("uniformef step_scope=model, m of the same step (oracle)",
     _is("uniformef model (oracle m)"), "nerr"),
    ("EF-sign", _is("signef"), "nerr"),
    ("top-k fp32", _is("topk", has="fp32"), "nerr"),
    ("top-k fp16", _is("topk", has="fp16"), "nerr"),
    ("top-k fp16, EF steady state", _is("topk", has="fp16"), "nerr_ef"),
    ("top-k int4", _is("topk", has="int4"), "nerr"),
    ("top-k int4, EF steady state", _is("topk", has="int4"), "nerr_ef"),
    ("top-k + QSGDinf 8b values (bench)", _is("topk+quantized values", has="qsgdinf:bits=8"),
     "nerr"),
    ("top-k + ALQ-inf 5b rANS values (bench)",
     _is("topk+quantized values", has="alq-inf:bits=5"), "nerr"),
    ("hvdcomp PowerSGD (fp32)", _is("powersgd"), "nerr"),
    ("hvdcomp PowerSGD (fp32), EF steady state", _is("powersgd"), "nerr_ef"),
    ("PowerSGD, P and Q in fp16 (bench)", _is("powersgd fp16"), "nerr"),
    ("PowerSGD, P and Q in fp16 (bench), EF steady state", _is("powersgd fp16"), "nerr_ef"),
]


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    keys = [(v["model"], v["step"]) for v in verdict(rows)]
    fig, axes = plt.subplots(4, 3, figsize=(18, 21), squeeze=False)
    cmap = plt.get_cmap("tab20")
    for ax, (model, step) in zip(axes.flat, keys):
        g = [r for r in rows if r["model"] == model and r["step"] == step]
        for i, (label_, pick, kind) in enumerate(PLOT_SERIES):
            pts = sorted((bits_of(r, kind), err(r, kind)) for r in g if pick(r))
            if not pts:
                continue
            ef = kind == "nerr_ef"
            ax.plot([p[0] for p in pts], [p[1] for p in pts], label=label_, ms=5,
                    lw=1.6 if i == 0 else 1, color="k" if i == 0 else cmap(i % 20),
                    marker="os^vD<>ph*"[i % 10], mfc="none" if ef else None,
                    linestyle=":" if ef else "-")
        ref, cgx = reference(g, "qsgd"), reference(g, "cgx")
        ax.axvline(TARGET_BITS, color="k", lw=0.8)
        ax.axhline(ref["nerr"], color="r", lw=0.8)
        ax.axhline(cgx["nerr"], color="b", lw=0.8)
        ax.plot([ref["bits"]], [ref["nerr"]], "r*", ms=14)
        ax.plot([cgx["bits"]], [cgx["nerr"]], "b*", ms=14)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlim(0.02, 20)
        ax.set_ylim(1e-4, 30)
        ax.set_title(f"{model}, gradient at step {step}")
        ax.set_xlabel("bits per coordinate on the wire (headers included)")
        ax.set_ylabel("||C(g) - g||^2 / ||g||^2")
        ax.grid(True, which="both", alpha=0.2)
    handles, labels = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=5, fontsize=9)
    fig.suptitle("Bits against error on real gradients. Red star/line: hvdcomp qsgd 4 bits "
                 "bucket 1024 (L2); blue: CGX max-min 4 bits bucket 1024; black line: 2.0 "
                 "bits.\nHollow/dotted: error feedback in its steady state (on g_t + e_t)")
    fig.tight_layout(rect=(0, 0.07, 1, 0.97))
    fig.savefig(path, dpi=64)


def label(r):
    """A short name for a row's setting."""
    if r["method"] == "powersgd":
        return r["setting"].split(":", 1)[1]
    if r["method"] in ("topk+quantized values", "powersgd fp16", "cgx-maxmin"):
        return r["setting"].replace(",bucket_size=1024", "")
    if r["method"].startswith("uniformef"):
        return "v=" + r["setting"].split("variance_target=")[1].replace(",step_scope=", " ")
    if r["method"] == "dqsg variance":
        return (f"{r['setting'].split('bits=')[1].split(',')[0]} bits v="
                + r["setting"].split("variance_target=")[1])
    if r["method"] in ("topk", "dgc", "signef", "terngrad"):
        return r["setting"].split(":", 1)[1].replace("density=", "d=").replace("values=", "")
    sp = dict(kv.split("=") for kv in r["setting"].split(":", 1)[1].split(","))
    return f"{sp['bits']} bits" + (" rANS" if r["entropy"] else "")


def _pt(r, kind="nerr"):
    return f"{err(r, kind):.3g} @ {bits_of(r, kind):.2f} b ({label(r)})" if r else "-"


def report_md(res) -> str:
    out = [f"Command: `{res['command']}` ({res['machine']}, {res['date']}, "
           f"{res['seconds']:.0f} s, {res['draws']} draws). Raw numbers: bits_variance.json; "
           f"plot: bits_variance.png. Cells: error @ bits/coord (setting).\n"]
    out.append("## References per gradient (normalized variance at 4 bits, bucket 1024)\n")
    out.append("| gradient | coords | exact zeros | hvdcomp qsgd 4b (bits, var) | "
               "CGX max-min 4b (bits, var) |")
    out.append("|---|---|---|---|---|")
    for v in res["verdict"]:
        ref, cgx = v["ref_qsgd4"], v["ref_cgx4"]
        out.append(f"| {v['model']} step {v['step']} | {ref['numel']:,} | "
                   f"{100 * v['zero_fraction']:.1f} % | {ref['bits']:.3f}, {ref['nerr']:.4g} | "
                   f"{cgx['bits']:.4f}, {cgx['nerr']:.4g} |")
    methods = [m for m in dict.fromkeys(r["method"] for r in res["rows"]) if m != "cgx-maxmin"]
    heads = [f"{v['model']} {v['step']}" for v in res["verdict"]]
    for title, cell in (
            ("Lowest error at <= 2.0 bits/coord, first step (each method's best setting)",
             lambda m: _pt(m["best_under_2bits"].get("nerr"))),
            ("Lowest error at <= 2.0 bits/coord, biased methods with error feedback in its "
             "steady state (error on g_t + e_t)",
             lambda m: _pt(m["best_under_2bits"].get("nerr_ef"), "nerr_ef")),
            ("Fewest bits/coord at error <= CGX max-min 4 bits, first step",
             lambda m: _pt(m["fewest_bits"].get("cgx"))),
            ("Fewest bits/coord at error <= CGX max-min 4 bits, error feedback steady state",
             lambda m: _pt(m["fewest_bits"].get("cgx_ef"), "nerr_ef")),
            ("Fewest bits/coord at error <= hvdcomp qsgd 4 bits (L2 norm), first step",
             lambda m: _pt(m["fewest_bits"].get("qsgd")))):
        out.append(f"\n## {title}\n")
        out.append("| method | " + " | ".join(heads) + " |")
        out.append("|---" * (len(heads) + 1) + "|")
        for m in methods:
            out.append(f"| {m} | " + " | ".join(cell(v["methods"][m]) if m in v["methods"]
                                                 else "-" for v in res["verdict"]) + " |")
    out.append("\n## All operating points (bits/coord, normalized error)\n")
    for v in res["verdict"]:
        model, step = v["model"], v["step"]
        out.append(f"\n### {model}, gradient at step {step}\n")
        out.append("| method | setting | bits/coord | error | kind |\n|---|---|---|---|---|")
        for r in [x for x in res["rows"] if x["model"] == model and x["step"] == step]:
            kind = "one step (biased)" if r["biased"] else "variance (unbiased)"
            extra = (f"; on g+e with error feedback: {r['nerr_ef']:.3g}"
                     + (f" at {r['bits_ef']:.4f} bits" if "bits_ef" in r else "")
                     if "nerr_ef" in r else "")
            out.append(f"| {r['method']} | `{r['setting']}` | {r['bits']:.4f} | "
                       f"{r['nerr']:.4g} | {kind}{extra} |")
    return "\n".join(out) + "\n"


#: The verdict's column groups: (heading, methods).  Top-k's values=int8 / int4 are
#: hvdcomp settings; "topk+quantized values" and "powersgd fp16" are this bench's compositions.
GROUPS = (("hvdcomp quantizers", ("qsgd", "qsgdinf", "nuqsgd", "alq", "alq-inf", "amq",
                                  "amq-inf", "terngrad")),
          ("hvdcomp DQSG rANS (paper's step / variance target)", ("dqsg", "dqsg variance")),
          ("hvdcomp uniformef (rANS, error feedback; bucket / model step)",
           ("uniformef", "uniformef model")),
          ("hvdcomp top-k (fp32/fp16/int8/int4 values) / DGC / EF-sign",
           ("topk", "dgc", "signef")),
          ("top-k + quantized values (bench)", ("topk+quantized values",)),
          ("hvdcomp PowerSGD (fp32 sums)", ("powersgd",)),
          ("PowerSGD, P and Q in fp16 (bench)", ("powersgd fp16",)))


def _short(r) -> str:
    """A row's setting in a few words: "qsgdinf 3b rANS", "top-k d=0.25 int4"."""
    m, st = r["method"], r["setting"]
    if m in ("topk", "dgc"):
        kv = dict(x.split("=") for x in st.split(":", 1)[1].split(","))
        return f"{'top-k' if m == 'topk' else 'DGC'} d={kv['density']} {kv['values']}"
    if m == "signef":
        return "EF-sign"
    if m == "terngrad":
        return "terngrad" + (" rANS" if "entropy=True" in st else "")
    if m == "powersgd":
        return "PowerSGD " + st.split(":", 1)[1].replace("=", " ")
    if m == "powersgd fp16":
        return "PowerSGD " + st.replace("=", " ").replace(",", " ")
    if m.startswith("uniformef"):
        return ("uniformef v=" + st.split("variance_target=")[1].split(",")[0]
                + m[len("uniformef"):])
    if m == "dqsg variance":
        return (f"dqsg {st.split('bits=')[1].split(',')[0]}b v="
                + st.split("variance_target=")[1])
    if m == "topk+quantized values":
        d, q = st.split(" + ")
        return (f"d={d.split('=')[1]} + {q.split(':')[0]} {q.split('bits=')[1].split(',')[0]}b"
                + (" rANS" if "entropy=True" in q else ""))
    bits = st.split("bits=")[1].split(",")[0]
    return f"{m} {bits}b" + (" rANS" if "entropy=True" in st else "")


def verdict_md(verdicts, steady: bool) -> str:
    """The verdict table of target (c): per gradient and column group, the lowest error at
    <= 2.0 bits (bits, setting), whether it is at most CGX 4 bits' error (else the ratio),
    and the fewest bits at which the group reaches CGX's error ("> tested": nowhere in its
    settings).  ``steady``: error feedback in its steady state (rows after step 0, the
    unbiased quantizers left out: their error is the same)."""
    kind, reading = ("nerr_ef", "cgx_ef") if steady else ("nerr", "cgx")
    groups = GROUPS[2:] if steady else GROUPS
    out = ["| gradient | CGX 4b error | " + " | ".join(g for g, _ in groups) + " |",
           "|---|---|" + "---|" * len(groups)]
    for v in verdicts:
        if steady and v["step"] == 0:
            continue
        ref = v["ref_cgx4"]["nerr"]
        cells = []
        for _, names in groups:
            ms = [v["methods"][m] for m in names if m in v["methods"]]
            best = [m["best_under_2bits"].get(kind) for m in ms]
            best = min((b for b in best if b), key=lambda b: err(b, kind), default=None)
            few = [m["fewest_bits"].get(reading) for m in ms]
            few = min((f for f in few if f), key=lambda f: bits_of(f, kind), default=None)
            if best is None:
                cells.append("-")
                continue
            e = err(best, kind)
            ok = "**yes**" if e <= ref else f"no ({e / ref:.2f}x)"
            need = f"needs {bits_of(few, kind):.2f}" if few else "> tested"
            cells.append(f"{e:.3g} @ {bits_of(best, kind):.2f} ({_short(best)}): {ok}; {need}")
        out.append(f"| {v['model']} {v['step']} | {ref:.3g} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def _brief(v):
    """A verdict entry for the JSON: its rows by method, setting, bits and errors."""
    def row(r):
        return r and {k: r[k] for k in ("method", "setting", "bits", "nerr", "nerr_ef",
                                        "bits_ef") if k in r}
    return dict(v, ref_qsgd4=row(v["ref_qsgd4"]), ref_cgx4=row(v["ref_cgx4"]),
                methods={m: {part: {k: row(r) for k, r in d[part].items()}
                             for part in ("best_under_2bits", "fewest_bits")}
                         for m, d in v["methods"].items()})


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--draws", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                  "results", "bits_variance"))
    ap.add_argument("--verdict", action="store_true",
                    help="print the verdict tables of <out>.json (bits_variance.md quotes "
                         "them), measure nothing")
    args = ap.parse_args()
    if args.verdict:
        with open(args.out + ".json") as f:
            ver = json.load(f)["verdict"]
        print("**First step:**\n\n" + verdict_md(ver, False) + "\n**Error feedback in its "
              "steady state**:\n\n" + verdict_md(ver, True))
        return
    torch.set_num_threads(1)
    t0 = time.time()
    rows = []
    points = sorted({s - k for s in STEPS for k in range(WARM + 1) if s - k >= 0})
    for model, fn, batch in MODELS:
        run = (fashion_gradients(points, batch) if fn is None else
               training_gradients(fn, points=points, batch=batch))
        for step in STEPS:
            hist = [compressible(run[s]) for s in range(max(0, step - WARM), step)]
            rows += gradient_rows(model, step, compressible(run[step]), hist, args.draws)
    res = {"command": " ".join(["nice -n 10 .venv/bin/python bench/bits_variance.py"]
                               + sys.argv[1:]),
           "machine": f"{platform.machine()} {os.cpu_count()} cores, torch {torch.__version__}",
           "date": time.strftime("%Y-%m-%d"), "draws": args.draws, "rows": rows}
    res["verdict"] = verdict(rows)
    res["seconds"] = time.time() - t0
    with open(args.out + ".json", "w") as f:           # the verdict names its rows
        json.dump(dict(res, verdict=[_brief(v) for v in res["verdict"]]), f,
                  separators=(",", ":"))
    plot(rows, args.out + ".png")
    with open(args.out + ".tables.md", "w") as f:
        f.write(report_md(res))
    print(f"wrote {args.out}.json, .png and .tables.md in {res['seconds']:.0f} s")


if __name__ == "__main__":
    main()
