"""The scaling model of bench/scaling.py: what one exchange costs a rank, as a function of the
number of hosts N, fitted to the measurements of 2 to 16 hosts and used to predict up to 1024.

Accounting (:func:`account`, exact, from hvdcomp's own fusion, routing, shard layout and
message sizes; no measurement): for each method and N, the collective calls of one
exchange with the bytes each rank sends and the steps (messages in sequence) of the
algorithm MPI runs, and the CPU work of a rank:

    allreduce of B bytes (Horovod: MPI's)   sends 2 (N-1)/N B in 2 log2 N steps
    allgather, frames of F_r bytes (ring)   sends (N-1)/N sum_r F_r in N-1 steps
    all-to-all, parts of F_r bytes          sends (N-1)/N sum_r F_r in N-1 steps
    the byte counts before each              log2 N steps (recursive doubling), no bytes
    CPU: encoded elements, decoded elements (for DGC, decoded values), encoded and decoded
    messages (pieces), fp16 casts

Message sizes: ALQ's exactly (``Compressor.message_bytes``: header, a norm per bucket, 3 bits
per element; frames 9 + 8 per message + the presence bitmap); DGC's estimated from its
encoding, k values of 32 bits and Golomb-Rice coded gaps of about log2(n/k) + 1.5 bits
(hvdcomp.compressors.sparsifiers); the tables compare both with the measured payload bytes.

Cost (:func:`predict`), with parameters fitted by :func:`fit`:

    wire  W = alpha * steps + 8 / rate * (bytes + ar_bytes)          the link, by its rate
              + beta_ar_rate * ar_bytes                              Horovod's allreduce
              + gamma * kappa * (bytes + ar_bytes)                   TCP's CPU work per byte
    CPU   C = kappa * (e * encoded + d * decoded + e0 * encoded messages + d0 * decoded
              messages + c16 * cast elements)
    time  T = W + C

The link's cost per byte is not fitted: it is the shaped rate itself (8 / rate seconds per
byte; tbf lets nothing through faster).  ``alpha`` (latency per message step) is fitted to
the replayed collectives; ``beta_ar`` (what Horovod's allreduce costs per byte beyond the
link: it copies through its fusion buffer on its background thread, and MPI's allreduce
need not run the ring the count assumes), ``gamma`` (the CPU work of moving a byte through
TCP and the veth pair, which the ranks share with everything else), ``e``/``d`` (seconds
per element, one pair per compressor), ``e0``/``d0`` (per message) and ``c16`` (per
element cast to and from fp16) are fitted to the measured times per exchange.  Each fit is
a non-negative least-squares fit of relative errors (every measurement weighs by its own
size).  ``kappa`` is the CPU contention of the measurement: N ranks and a background of B
busy threads of other jobs sharing this machine's cores (``kappa = max(1, (N + B) /
cores)``; B, one number for all cells, is chosen by :func:`fit_rows` from 0 to 16, the
machine being shared).  The stages add, W + C: on a machine whose cores are all busy
nothing overlaps (a model with the pipeline's overlap, max(W, C) + min(W, C) / K for K
fusion buckets, fitted these cells worse: 37 of 48 within 25 %).  The predictions for 16
to 1024 hosts are for hosts with their own cores (``kappa = 1``), where the pipeline
would hide part of the smaller of W and C: for them the model is an upper bound.

Several ranks per host (bench/scaling_hier.py; ``account(model, method, n, k)``: n hosts of
k ranks): the link carries the host's bytes (``nic``: a ring over all N = n k ranks,
numbered host by host, crosses each host's link once each way; an all-to-all's parts to
other hosts' ranks all cross it; the hierarchical exchange's cross-host collectives run
among one rank per host, k at once), so W's link term is 8 / rate * nic, and gamma prices
the bytes a rank sends across hosts (nic / k).  What stays inside the host (the ring's
in-host hops, the hierarchical exchange's float32 stages) costs ``beta_host`` per byte,
CPU-contended (it is memory copying through shared memory).  kappa counts all N ranks.
The cells of bench/scaling_hier.py, measured at another time under another load, get a
background of their own (``background_k``).  For k = 1 every term is as before.
"""
from __future__ import annotations

import math
from functools import lru_cache
from typing import Dict, List, Tuple

import numpy as np

FUSION = 25 * 2**20
HEADER = 48 + 4          # fixed header + CRC (hvdcomp.wire)


@lru_cache(maxsize=None)
def _msg_alq(shape) -> int:
    from hvdcomp.compressors import get
    return get("alq:bits=3").message_bytes(tuple(shape))      # exact (fixed length)


def _msg_alq2(shape) -> int:
    """The reduce-scatter's second-stage message of an averaged ALQ shard (2 bits finer)."""
    from hvdcomp.compressors import get
    from hvdcomp.exchange.shards import second_stage
    return second_stage(get("alq:bits=3")).message_bytes(tuple(shape))


def _msg_dgc(shape, density=0.001) -> int:
    from hvdcomp.compressors.sparsifiers import num_selected
    n = math.prod(shape)
    k = num_selected(density, n)
    return HEADER + 8 * len(shape) + 16 + 5 + math.ceil(k * (32 + math.log2(n / k) + 1.5) / 8)


def _frame(count: int) -> int:
    """Bytes of a frame's head (hvdcomp.transport.framing)."""
    return 8 + 8 * count + 1 + (count + 7) // 8


def _method(method: str):
    """(compressor family or None, collective) of a method spec ("host+" stripped)."""
    if method.startswith("host+"):
        method = method[len("host+"):]
    if method in ("none", "fp16"):
        return None, "allreduce"
    coll = "reduce_scatter" if method.startswith("rs+") else "allgather"
    return ("alq" if "alq" in method else "dgc"), coll


class _P:
    """A parameter stand-in: what hvdcomp's fusion and layout read."""

    requires_grad = True
    dtype = None           # (the layout only carries it into the pieces)

    def __init__(self, shape):
        self.shape = tuple(shape)

    def numel(self):
        return math.prod(self.shape)

    def element_size(self):
        return 4

    def dim(self):
        return len(self.shape)


def _compressed(acc: Dict[str, float], shapes: Dict[str, tuple], n: int, coll: str,
                fam: str) -> Tuple[float, float]:
    """Add to ``acc`` one bucket of compressed tensors ``shapes`` ({name: shape}) among
    ``n`` ranks over ``coll`` (steps, bytes, CPU work); returns the bytes a rank sent by
    rings (allgathers) and by all-to-alls."""
    from hvdcomp.compressors import get
    from hvdcomp.compressors.sparsifiers import num_selected
    from hvdcomp.exchange.shards import layout
    log = math.log2(n) if n > 1 else 0.0
    msg = _msg_alq if fam == "alq" else _msg_dgc
    comp = get("alq:bits=3") if fam == "alq" else get("dgc:density=0.001")
    big = list(shapes)
    sent = [0.0, 0.0]

    def ring(frames, a2a=False):
        acc["steps"] += (n - 1) + log            # counts first
        acc["bytes"] += (n - 1) / n * sum(frames)
        sent[int(a2a)] += (n - 1) / n * sum(frames)

    class _E:
        def __init__(self, name, shape):
            self.name, self.param, self.compressor, self.scatter = name, _P(shape), comp, True
    if coll == "allgather":
        f = _frame(len(big)) + sum(msg(shapes[m]) for m in big)
        ring([f] * n)
        acc["enc"] += sum(math.prod(shapes[m]) for m in big)
        acc["enc_msgs"] += len(big)
        acc["dec_msgs"] += n * len(big)
        acc["dec"] += n * sum(math.prod(shapes[m]) if fam == "alq" else
                              num_selected(0.001, math.prod(shapes[m])) for m in big)
        return sent[0], sent[1]
    lay = layout([big], {m: _E(m, shapes[m]) for m in big}, n, 0)[0]
    frames = [_frame(len(mine)) + sum(msg(p.shape) for p in mine) for mine in lay]
    ring(frames, a2a=True)                    # the all-to-all (same bytes and steps)
    msg2 = _msg_alq2 if fam == "alq" else msg
    ring([_frame(len(mine)) + sum(msg2(p.shape) for p in mine) for mine in lay])
    #                                           the allgather of the averaged pieces
    pieces = sum(len(m) for m in lay)
    elems = sum(math.prod(shapes[m]) for m in big)
    acc["enc"] += elems + elems / n           # stage 1, and the owner's re-encoding
    acc["enc_msgs"] += pieces + pieces / n
    acc["dec_msgs"] += 2 * pieces             # N contributions of its pieces, every piece
    sel = (elems if fam == "alq" else
           sum(num_selected(0.001, p.numel) for m in lay for p in m))
    acc["dec"] += 2 * sel
    return sent[0], sent[1]


@lru_cache(maxsize=None)
def account(model: str, method: str, n: int, k: int = 1) -> Dict[str, float]:
    """Per-rank work of one exchange of ``model``'s gradients with ``method`` on ``n`` hosts
    of ``k`` ranks each (module docstring): steps, bytes (sent by hvdcomp's collectives),
    ar_bytes (sent by Horovod's allreduce), host_bytes (the hierarchical exchange's float32
    bytes inside the host), nic (bytes through each host's link, each way), tcp / shm
    (bytes a rank sends across hosts / inside its host), encoded / decoded elements,
    encoded / decoded messages, cast elements, buckets.

    With ``k`` > 1 the ranks are numbered host by host.  Open MPI's allreduce of these
    sizes halves and doubles recursively (Rabenseifner: 2 log2 N steps; its first log2 k
    exchanges stay in the host), so the link carries 2 (n - 1) / n of the buffer, as a
    hierarchical allreduce's would; its allgatherv and alltoallv send every rank's bytes to
    every other rank directly, so the parts for the other hosts' ranks all cross it (the
    link counters of bench/scaling_hier.py measured both: fp32 allreduce 153.6 MB per host
    at 4 x 2 against 178.9 for a ring in rank order; ALQ's allgather 125 MB against 69).  "host+" methods (hvdcomp/exchange/hier.py): inside
    the host an all-to-all of float32 pieces and an allgather of the averaged pieces
    (host_bytes), across hosts the compressor over the collective among the n ranks of one
    local rank, on pieces of 1/k of each tensor (k such groups share the link)."""
    import shapes as S
    from hvdcomp.exchange.buckets import fuse
    shapes = dict({"resnet50": S.resnet50, "bert_base": S.bert_base}[model]())
    params = [(name, _P(s)) for name, s in shapes.items()]
    buckets = fuse(params, FUSION)
    fam, coll = _method(method)
    hier = method.startswith("host+") and k > 1 and n > 1
    N = n * k
    acc = dict(steps=0.0, bytes=0.0, ar_bytes=0.0, host_bytes=0.0, nic=0.0, enc=0.0,
               dec=0.0, enc_msgs=0.0, dec_msgs=0.0, cast=0.0, buckets=len(buckets))

    def allreduce(b):       # recursive halving / doubling (Rabenseifner): see the docstring
        acc["steps"] += 2 * math.log2(N)
        acc["ar_bytes"] += 2 * (N - 1) / N * b
        acc["nic"] += 2 * (n - 1) / n * b

    for names in buckets:
        big = [m for m in names if len(shapes[m]) > 1 and math.prod(shapes[m]) >= 1024]
        small = [m for m in names if m not in big]
        if fam is None:
            b = sum(math.prod(shapes[m]) for m in names)
            nbytes = (4 if "none" in method else 2) * b
            if hier:        # a hierarchical allreduce: reduce-scatter and allgather in the
                #             host, a ring across hosts of 1/k per rank (k rings at once)
                acc["host_bytes"] += 2 * (k - 1) / k * nbytes
                acc["steps"] += 2 * (k - 1) + 2 * math.log2(n)
                acc["ar_bytes"] += 2 * (n - 1) / n * nbytes / k
                acc["nic"] += 2 * (n - 1) / n * nbytes
            else:
                allreduce(nbytes)
            if "fp16" in method:
                acc["cast"] += 2 * b
            continue
        if small:
            allreduce(4 * sum(math.prod(shapes[m]) for m in small))
        if not big:
            continue
        if not hier:
            ring, a2a = _compressed(acc, {m: shapes[m] for m in big}, N, coll, fam)
            # MPI's allgatherv and alltoallv send each rank's bytes to every other rank
            # directly: k ranks' parts to the other hosts' ranks, (N - k) / (N - 1) of what
            # each sends, cross the link
            acc["nic"] += k * (N - k) / (N - 1) * (ring + a2a)
            continue
        elems = sum(math.prod(shapes[m]) for m in big)
        pieces = {f"{m}[{k}]": (math.ceil(math.prod(shapes[m]) / k),) for m in big}
        f32 = _frame(len(big)) + 4 * elems / k     # one owner's float32 frame
        acc["host_bytes"] += 2 * (k - 1) * f32      # stage 1 (all-to-all), stage 3 (ring)
        acc["steps"] += 2 * (k - 1) + math.log2(k) + 2 * math.log2(n)   # + joined counts
        acc["nic"] += k * sum(_compressed(acc, pieces, n, coll, fam))
    acc["tcp"] = acc["nic"] / k
    acc["shm"] = acc["bytes"] + acc["ar_bytes"] + acc["host_bytes"] - acc["tcp"]
    return acc


PARAMS = ("alpha", "beta_ar_1gbit", "beta_ar_10gbit", "gamma", "e_alq", "d_alq", "e_dgc",
          "d_dgc", "e0", "d0", "c16", "beta_host")
RATE_BITS = {"100mbit": 1e8, "1gbit": 1e9, "10gbit": 1e10}


def _link(a: Dict[str, float], rate: str) -> float:
    """Seconds the shaped link alone takes for its host's bytes."""
    return 8.0 / RATE_BITS[rate] * a["nic"]


WIRE = 4        # PARAMS[:WIRE] price the wire, the rest the CPU


def _features(a: Dict[str, float], method: str, rate: str, kappa: float) -> np.ndarray:
    """What each parameter multiplies in one exchange (PARAMS' order): the cost beyond the
    link is ``_features(...) @ [p[k] for k in PARAMS]``."""
    fam, _ = _method(method)
    x = np.zeros(len(PARAMS))
    x[0] = a["steps"]
    x[2 if rate == "10gbit" else 1] = a["ar_bytes"]     # 100 Mbit/s: 1 Gbit/s's beta_ar
    x[3] = kappa * a["tcp"]
    if fam is not None:
        off = 4 if fam == "alq" else 6
        x[off], x[off + 1] = kappa * a["enc"], kappa * a["dec"]
    x[8], x[9], x[10] = kappa * a["enc_msgs"], kappa * a["dec_msgs"], kappa * a["cast"]
    x[11] = kappa * a["shm"]
    return x


def predict(p: Dict[str, float], model: str, method: str, n: int, rate: str,
            kappa: float = 1.0, k: int = 1) -> Dict[str, float]:
    """{"wire", "cpu", "total"} seconds of one exchange on ``n`` hosts of ``k`` ranks
    (module docstring); ``p``: the fitted parameters (a missing ``beta_host``: 0);
    ``kappa``: CPU contention (1: every rank its own core)."""
    a = account(model, method, n, k)
    terms = _features(a, method, rate, kappa) * np.array([p.get(x, 0.0) for x in PARAMS])
    wire = _link(a, rate) + float(terms[:WIRE].sum())
    cpu = float(terms[WIRE:].sum())
    return dict(wire=wire, cpu=cpu, total=wire + cpu)


def contention(n: int, cores: int, background: float = 0.0) -> float:
    """CPU slow-down of a measurement: ``n`` ranks and ``background`` other busy threads
    sharing ``cores`` cores."""
    return max(1.0, (n + background) / cores)


def _nnls(A: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Non-negative least squares: scipy's if present, else an active-set solve on the
    column-normalized system (the columns differ by many orders of magnitude)."""
    scale = np.linalg.norm(A, axis=0)
    scale[scale == 0] = 1.0
    As = A / scale
    try:
        from scipy.optimize import nnls
        return nnls(As, b)[0] / scale
    except ImportError:
        pass
    free = list(range(A.shape[1]))
    x = np.zeros(A.shape[1])
    while free:                     # drop the most negative coefficient until none is
        sol = np.linalg.lstsq(As[:, free], b, rcond=None)[0]
        if (sol >= 0).all():
            x[:] = 0
            x[free] = sol
            break
        free.pop(int(np.argmin(sol)))
    return x / scale


def _bg(r: dict, background) -> float:
    """The background load of row ``r``: ``background``, or with a pair (one rank per
    host, several ranks per host) the one of its bench (measured on other days, under
    other loads)."""
    if isinstance(background, (tuple, list)):
        return float(background[1] if "ranks_per_host" in r else background[0])
    return float(background)


def fit_rows(rows: List[dict], cores: int) -> Dict[str, float]:
    """:func:`fit_at` for the background load (busy threads of other jobs on the shared
    machine, 0 to 16 in steps of 0.5; with rows of bench/scaling_hier.py, a second one for
    them, 0 to 24 in steps of 1) whose fit predicts the measured totals best (median
    relative error; with two benches, the mean of their medians)."""
    best = None
    hier = any("ranks_per_host" in r for r in rows)
    grid = [(float(b), float(b2)) for b in np.arange(0.0, 16.01, 0.5)
            for b2 in (np.arange(0.0, 24.01, 1.0) if hier else [0.0])]
    for b in grid:
        bg = b if hier else b[0]
        try:
            p = fit_at(rows, cores, bg)
        except (ValueError, np.linalg.LinAlgError):
            continue
        errs = {False: [], True: []}
        for r in rows:
            if r["method"] in FIXED_ALL:
                errs["ranks_per_host" in r].append(abs(predict(
                    p, r["model"], r["method"], r["hosts"], r["rate"],
                    contention(_ranks(r), cores, _bg(r, bg)), _k(r))["total"]
                    / r["median_s"] - 1))
        score = float(np.mean([np.median(e) for e in errs.values() if e] or [0.0]))
        if best is None or score < best[0]:
            best = (score, p)
    return best[1]


def fit_at(rows: List[dict], cores: int, background: float) -> Dict[str, float]:
    """The parameters from measured rows (dicts with model, method, hosts, rate, replay_s,
    median_s) at a given background load: ``alpha`` from the replayed collectives (with
    the other wire terms, which this fit then drops), the rest from the times per
    exchange less the link and the latency (module docstring)."""
    fixed = [r for r in rows if r["method"] in FIXED_ALL]
    feats = []                              # (features, link seconds, row)
    for r in fixed:
        a = account(r["model"], r["method"], r["hosts"], _k(r))
        kap = contention(_ranks(r), cores, _bg(r, background))
        feats.append((_features(a, r["method"], r["rate"], kap), _link(a, r["rate"]), r))
    # alpha: the replays (cells of one rank per host), fitted with the other wire terms
    # (dropped here)
    rep = [(x, link, r) for x, link, r in feats if r.get("replay_s")]
    alpha = float(_nnls(np.array([x[:WIRE] / r["replay_s"] for x, _, r in rep]),
                        np.array([1.0 - link / r["replay_s"] for _, link, r in rep]))[0])
    # the rest: the times per exchange less the link and the latency
    rows_a = [x[1:] / r["median_s"] for x, _, r in feats]
    b = [1.0 - (link + alpha * x[0]) / r["median_s"] for x, link, r in feats]
    sol = _nnls(np.array(rows_a), np.array(b))
    p = dict(zip(PARAMS, [alpha] + [float(v) for v in sol]))
    if isinstance(background, (tuple, list)):
        p["background"], p["background_k"] = float(background[0]), float(background[1])
    else:
        p["background"] = float(background)
    return p


# --- glue for bench/scaling.py: rows, report, plot ---------------------------------------------

LABELS = {"none": "fp32 allreduce", "fp16": "fp16 allreduce",
          "ag+alq:bits=3": "ALQ 3b allgather", "rs+alq:bits=3": "ALQ 3b reduce-scatter",
          "ag+dgc:density=0.001": "DGC 0.1% allgather",
          "rs+dgc:density=0.001": "DGC 0.1% reduce-scatter", "auto+alq:bits=3": "Auto(ALQ 3b)",
          "auto+layer+alq:bits=3": "Auto per layer (ALQ 3b)",
          "auto+layer+powersgd:rank=1": "Auto per layer (PowerSGD r1)",
          **{f"powersgd:rank={r}": f"hvdcomp PowerSGD r{r}" for r in (1, 2, 4)},
          **{f"torch-powersgd:rank={r}": f"PyTorch PowerSGD hook r{r}" for r in (1, 2, 4)}}
FIXED = ["none", "fp16", "ag+alq:bits=3", "rs+alq:bits=3", "ag+dgc:density=0.001",
         "rs+dgc:density=0.001"]
#: The hierarchical methods of bench/scaling_hier.py ("host+": hvdcomp/exchange/hier.py).
HIER = ["host+ag+alq:bits=3", "host+rs+alq:bits=3", "host+ag+dgc:density=0.001",
        "host+rs+dgc:density=0.001"]
FIXED_ALL = FIXED + HIER
LABELS.update({"host+ag+alq:bits=3": "hier. ALQ 3b, allgather across",
               "host+rs+alq:bits=3": "hier. ALQ 3b, reduce-scatter across",
               "host+ag+dgc:density=0.001": "hier. DGC 0.1%, allgather across",
               "host+rs+dgc:density=0.001": "hier. DGC 0.1%, reduce-scatter across"})


def _k(r: dict) -> int:
    """Ranks per host of a measured row (1 for bench/scaling.py's)."""
    return int(r.get("ranks_per_host") or 1)


def _ranks(r: dict) -> int:
    return r["hosts"] * _k(r)
#: What Auto(ALQ 3b) chooses from, per tensor (hvdcomp.exchange.plan).
AUTO_CHOICES = ["none", "fp16", "ag+alq:bits=3", "rs+alq:bits=3"]
PREDICT_HOSTS = [2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]


def rows_of(res: dict) -> List[dict]:
    """One flat row per (cell, method): the summary of bench/scaling.py plus model, hosts,
    rate."""
    from scaling import summarize
    out = []
    for cell, rows in sorted(res["cells"].items()):
        model, hosts, rate = cell.split("/")
        for r in rows:
            s = summarize(r)
            s.update(model=model, hosts=int(hosts), rate=rate, measured=r.get("measured"))
            out.append(s)
    return out


def fit(res: dict, cores: int = 0) -> Dict[str, float]:
    import os
    cores = cores or res.get("cores") or os.cpu_count() or 1
    p = fit_rows(rows_of(res), cores)
    p["cores"] = cores
    return p


def _order(method):
    order = FIXED + ["auto+alq:bits=3"] + [m for m in LABELS if m not in FIXED
                                            and m != "auto+alq:bits=3"]
    return order.index(method) if method in order else 99


def render(res: dict, p: Dict[str, float]) -> str:
    """bench/results/scaling.md: conditions, measured cells with the model's predictions,
    the targets of issue 11, predictions to 1024 hosts."""
    cores = p["cores"]
    rows = rows_of(res)
    L = ["# Scaling: allgather vs reduce-scatter, 2 to 16 emulated hosts, model to 1024", ""]
    L += ["Commands (each cell: `launch/cluster HOSTS RATE -- launch/run -np HOSTS python "
          "bench/scaling.py --worker ...`, one rank per host, own network namespace and link "
          "shaped both ways, MPI over TCP):", ""]
    for stamp, cmd in sorted(res.get("runs", {}).items()):
        L.append(f"    {stamp}  {cmd}")
    L += ["", f"Conditions: {res.get('conditions', '')}", "",
          "Columns: time per exchange = the slowest rank's, median of 3 after a warm-up "
          "(min-max); wire = the same collective calls replayed back to back with nothing "
          "else running (no encoding or decoding beside it; the ranks' TCP work still shares "
          "the cores); tx / rx = "
          "bytes per rank on its link (its interface counters: everything, TCP/IP headers "
          "included), mean over ranks, exact per rep; payload = hvdcomp's own count of the "
          "bytes it sent (StepStats.bytes_sent, allreduced buffers included) / received "
          "(frames of the other ranks); encode / comm / decode = the pipeline stages (seconds "
          "summed over buckets, mean over ranks; comm includes the reduce-scatter's local "
          "re-encoding, reduce); model = `predict` with the CPU contention of the "
          f"measurement (N ranks and a fitted background of {p['background']:g} busy threads "
          f"of other jobs on {cores} cores: CPU x max(1, (N + background) / {cores})).", ""]
    for cell in sorted({(r["model"], r["hosts"], r["rate"]) for r in rows},
                       key=lambda c: (c[0], c[2], c[1])):
        model, n, rate = cell
        cr = sorted([r for r in rows if (r["model"], r["hosts"], r["rate"]) == cell],
                    key=lambda r: _order(r["method"]))
        L += [f"## {model}, {n} hosts x {rate}", "",
              "| method | time s (min-max) | wire s | tx MB | rx MB | payload sent / recv MB "
              "| encode s | comm s | decode s | model s | model err |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in cr:
            if r["method"] in FIXED:
                pr = predict(p, model, r["method"], n, rate,
                             contention(n, cores, p["background"]))["total"]
                err = f"{100 * (pr / r['median_s'] - 1):+.0f} %"
                prs = f"{pr:.3f}"
            else:
                prs, err = "", ""
            L.append(f"| {LABELS.get(r['method'], r['method'])} | {r['median_s']:.3f} "
                     f"({r['min_s']:.3f}-{r['max_s']:.3f}) | {r['replay_s']:.3f} | "
                     f"{r['tx'] / 1e6:.2f} | {r['rx'] / 1e6:.2f} | {r['sent'] / 1e6:.2f} / "
                     f"{r['recv'] / 1e6:.2f} | {r['encode']:.3f} | {r['comm']:.3f} | "
                     f"{r['decode']:.3f} | {prs} | {err} |")
        auto = [r for r in cr if r["method"].startswith("auto")
                and not r["method"].startswith("auto+layer")]
        fixed = [r for r in cr if r["method"] in AUTO_CHOICES]
        if auto and fixed:
            best = min(fixed, key=lambda r: r["median_s"])
            a = auto[0]
            L += ["", f"Auto: {a['median_s']:.3f} s against the best fixed choice among its "
                      f"own (fp32, fp16, ALQ 3b over either collective: "
                      f"{LABELS[best['method']]}) {best['median_s']:.3f} s: "
                      f"{100 * (a['median_s'] / best['median_s'] - 1):+.0f} % "
                      f"(target: at most +10 %); its plan (elements per path): "
                      f"{a['elements']}"]
            dgc = [r for r in cr if "dgc" in r["method"]]
            if dgc:
                d = min(dgc, key=lambda r: r["median_s"])
                L += [f"(DGC, another compressor that Auto(ALQ 3b) does not choose: "
                      f"{LABELS[d['method']]} {d['median_s']:.3f} s.)"]
        layer = [r for r in cr if r["method"].startswith("auto+layer")]
        every = [r for r in cr if not r["method"].startswith("auto")]
        for a in (layer if every else []):
            best = min(every, key=lambda r: r["median_s"])
            beats = all(a["median_s"] < r["median_s"] for r in every)
            L += ["", f"{LABELS.get(a['method'], a['method'])}: {a['median_s']:.3f} s "
                      f"(error budget: {a['method'][len('auto+layer+'):]}'s) against the best fixed "
                      f"choice of this cell (every row but Auto's: "
                      f"{LABELS.get(best['method'], best['method'])}) "
                      f"{best['median_s']:.3f} s: "
                      f"{100 * (a['median_s'] / best['median_s'] - 1):+.0f} % (#22 (d): "
                      f"at most +10 %; faster than every fixed choice here: "
                      f"{'yes' if beats else 'no'}); its plan (elements per "
                      f"compressor and path): {a['elements']}"]
        L.append("")
    # targets
    L += ["## Targets (issue 11)", ""]
    L += targets(rows)
    # model
    L += ["", "## The model", "",
          "Fitted parameters (bench/scaling_model.py, module docstring): " +
          ", ".join(f"{k} = {v:.3g}" for k, v in p.items() if k != "cores"), "",
          "alpha: seconds per message step; the link: 8 / rate seconds per byte (not "
          "fitted); beta_ar: what Horovod's allreduce costs per byte beyond the link "
          "(its whole cost per byte: "
          + " and ".join(f"{8 / (p[f'beta_ar_{r}'] + 8 / bits) / 1e9:.2f}"
                         for r, bits in RATE_BITS.items() if f"beta_ar_{r}" in p) +
          " Gbit/s effective, before "
          "gamma); gamma: CPU seconds per byte sent through TCP (times the contention); "
          "e, d: seconds per encoded / decoded element; e0, d0: per encoded / decoded message; "
          "c16: per element cast to and from fp16.", ""]
    errs = []
    for r in rows:
        if r["method"] in FIXED:
            pr = predict(p, r["model"], r["method"], r["hosts"], r["rate"],
                         contention(r["hosts"], cores, p["background"]))["total"]
            errs.append(abs(pr / r["median_s"] - 1))
    if errs:
        L.append(f"Measured cells: the model is within 25 % in {sum(e <= 0.25 for e in errs)} "
                 f"of {len(errs)} (median error {100 * float(np.median(errs)):.0f} %, "
                 f"largest {100 * max(errs):.0f} %).")
        L.append("")
    for model in sorted({r["model"] for r in rows}):
        for rate in ("1gbit", "10gbit"):
            L += [f"### Predicted time per exchange, {model}, {rate} per host, hosts with "
                  f"their own cores (seconds)", "",
                  "| method | " + " | ".join(map(str, PREDICT_HOSTS)) + " |",
                  "|---|" + "---|" * len(PREDICT_HOSTS)]
            for m in FIXED:
                L.append(f"| {LABELS[m]} | " + " | ".join(
                    f"{predict(p, model, m, n, rate)['total']:.3g}" for n in PREDICT_HOSTS)
                    + " |")
            L += [""]
            for n in (64, 1024):
                f32 = predict(p, model, "none", n, rate)["total"]
                L.append(f"* {n} hosts: ALQ 3b reduce-scatter "
                         f"{f32 / predict(p, model, 'rs+alq:bits=3', n, rate)['total']:.2f}x "
                         f"the speed of fp32 allreduce, ALQ 3b allgather "
                         f"{f32 / predict(p, model, 'ag+alq:bits=3', n, rate)['total']:.2f}x; "
                         f"DGC 0.1 % reduce-scatter "
                         f"{f32 / predict(p, model, 'rs+dgc:density=0.001', n, rate)['total']:.2f}x"
                         f", allgather "
                         f"{f32 / predict(p, model, 'ag+dgc:density=0.001', n, rate)['total']:.2f}x")
            L.append("")
    # how much the 1024-host figures lean on the fitted cost per message
    pc = piece_costs()
    q = dict(p, e0=pc["encode"], d0=pc["decode"])
    f32 = {n: predict(q, "resnet50", "none", n, "1gbit")["total"] for n in (64, 1024)}
    L += ["### How much these lean on the cost per message", "",
          f"The fitted cost per message (e0 = {1e6 * p['e0']:.0f} us encoded, d0 = "
          f"{1e6 * p['d0']:.0f} us decoded) includes the exchange's own work per piece "
          "(framing, slicing, bookkeeping) and what contention the fit did not separate. "
          "The compressor alone, timed in one process on this machine (ALQ 3 bits, 2^22 "
          "elements as 1 message and as 1024 pieces, `piece_costs`), costs "
          f"{1e6 * pc['encode']:.0f} us per encoded and {1e6 * pc['decode']:.0f} us per "
          "decoded piece. With those in place of e0 and d0, ResNet-50 at 1 Gbit/s: ALQ 3b "
          "reduce-scatter " + ", ".join(
              f"{f32[n] / predict(q, 'resnet50', 'rs+alq:bits=3', n, '1gbit')['total']:.2f}x "
              f"the speed of fp32 allreduce at {n} hosts" for n in (64, 1024)) +
          ". Either way the advantage shrinks from tens to a thousand hosts, where the "
          "reduce-scatter's N pieces per bucket cost, per message, about what its bytes "
          "save: encoding a bucket's pieces in one call would move that limit.", ""]
    return "\n".join(L) + "\n"


@lru_cache(maxsize=None)
def piece_costs(numel: int = 2**22, pieces: int = 1024) -> Dict[str, float]:
    """Seconds per encoded and per decoded message of ALQ 3 bits beyond its per-element
    cost: ``numel`` elements encoded and decoded as 1 message and as ``pieces`` messages
    (one thread, best of 3), the difference divided by ``pieces - 1``."""
    import time
    import torch
    from hvdcomp.compressors import get
    from hvdcomp.compressors.base import TensorKey
    comp = get("alq:bits=3")
    g = torch.randn(numel, generator=torch.Generator().manual_seed(0))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        def run(k):
            m = numel // k
            keys = [TensorKey(name=f"t{i}", tensor_id=i, step=1, rank=0, world_size=4)
                    for i in range(k)]
            best_e = best_d = float("inf")
            for _ in range(3):
                t = time.perf_counter()
                msgs = [comp.encode(g[i * m:(i + 1) * m], keys[i]) for i in range(k)]
                t1 = time.perf_counter()
                out = torch.zeros(m)
                for msg, key in zip(msgs, keys):
                    comp.decode(msg, key, out)
                t2 = time.perf_counter()
                best_e, best_d = min(best_e, t1 - t), min(best_d, t2 - t1)
            return best_e, best_d
        e1, d1 = run(1)
        ek, dk = run(pieces)
    finally:
        torch.set_num_threads(threads)
    return dict(encode=max(0.0, (ek - e1) / (pieces - 1)),
                decode=max(0.0, (dk - d1) / (pieces - 1)))


@lru_cache(maxsize=None)
def piece_costs_one_call(numel: int = 2**23, pieces: int = 1024) -> Dict[str, float]:
    """:func:`piece_costs` through the reduce-scatter's one-call path (issue 23 item 3:
    ``encode_pieces`` / ``decode_pieces``, one kernel launch for all pieces): seconds per
    extra piece of ALQ 3 bits (pieces of one 8192-element bucket: the one call needs bucket
    boundaries), the compressor alone (not the exchange's framing), CPU time."""
    import time
    import torch
    from hvdcomp.compressors import get
    from hvdcomp.compressors.base import TensorKey
    comp = get("alq:bits=3")
    g = torch.randn(numel, generator=torch.Generator().manual_seed(0))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        def run(k):
            m = numel // k
            spans = [(i * m, (i + 1) * m) for i in range(k)]
            keys = [TensorKey(name="t", tensor_id=i, step=1, rank=0, world_size=4)
                    for i in range(k)]
            best_e = best_d = float("inf")
            for _ in range(3):
                t = time.process_time()
                msgs = comp.encode_pieces(g, spans, keys)
                t1 = time.process_time()
                comp.decode_pieces(msgs, keys, spans, torch.zeros(numel))
                t2 = time.process_time()
                best_e, best_d = min(best_e, t1 - t), min(best_d, t2 - t1)
            return best_e, best_d
        e1, d1 = run(1)
        ek, dk = run(pieces)
    finally:
        torch.set_num_threads(threads)
    return dict(encode=max(0.0, (ek - e1) / (pieces - 1)),
                decode=max(0.0, (dk - d1) / (pieces - 1)))


def targets(rows: List[dict]) -> List[str]:
    """Targets (a)-(c) of issue 11 from the measured rows (ResNet-50 shapes, 1 Gbit/s)."""
    def get(n, m, model="resnet50", rate="1gbit"):
        for r in rows:
            if (r["model"], r["hosts"], r["rate"], r["method"]) == (model, n, rate, m):
                return r
        return None
    L = []
    rs, f32, f16 = (get(8, m) for m in ("rs+alq:bits=3", "none", "fp16"))
    if rs and f32 and f16:
        a1, a2 = f32["replay_s"] / rs["replay_s"], f16["replay_s"] / rs["replay_s"]
        L.append(f"* (a) wire alone, 8 hosts x 1 Gbit/s, ResNet-50: ALQ 3b reduce-scatter "
                 f"{rs['replay_s']:.3f} s, fp32 {f32['replay_s']:.3f} s ({a1:.1f}x, target 5x: "
                 f"{'met' if a1 >= 5 else 'NOT met'}), fp16 {f16['replay_s']:.3f} s ({a2:.1f}x, "
                 f"target 2.5x: {'met' if a2 >= 2.5 else 'NOT met'}).")
    else:
        L.append("* (a) not measured (8 hosts x 1 Gbit/s, ResNet-50 missing).")
    rs, f32, f16, ag = (get(4, m) for m in ("rs+alq:bits=3", "none", "fp16", "ag+alq:bits=3"))
    if rs and f32 and f16 and ag:
        b1, b2 = f32["median_s"] / rs["median_s"], f16["median_s"] / rs["median_s"]
        L.append(f"* (b) whole exchange, 4 hosts x 1 Gbit/s, ResNet-50: ALQ 3b reduce-scatter "
                 f"{rs['median_s']:.3f} s against fp32 {f32['median_s']:.3f} s ({b1:.2f}x, "
                 f"target 3x: {'met' if b1 >= 3 else 'NOT met'}), fp16 {f16['median_s']:.3f} s "
                 f"({b2:.2f}x, target 1.5x: {'met' if b2 >= 1.5 else 'NOT met'}), ALQ over the "
                 f"allgather {ag['median_s']:.3f} s ("
                 f"{'faster: met' if rs['median_s'] < ag['median_s'] else 'NOT faster: not met'}"
                 f"); encode + decode of the reduce-scatter {rs['encode'] + rs['decode']:.3f} s "
                 f"on 4 ranks sharing the cores.")
    else:
        L.append("* (b) not measured (4 hosts x 1 Gbit/s, ResNet-50 missing).")
    for m in ("rs+alq:bits=3", "ag+alq:bits=3", "rs+dgc:density=0.001", "ag+dgc:density=0.001"):
        r4, r8 = get(4, m), get(8, m)
        if r4 and r8:
            c = r8["tx"] / r4["tx"]
            tgt = (f" (target at most 1.25x: {'met' if c <= 1.25 else 'NOT met'})"
                   if m == "rs+alq:bits=3" else "")
            L.append(f"* (c) bytes sent per rank (link counters), 8 hosts / 4 hosts, "
                     f"{LABELS[m]}: {r8['tx'] / 1e6:.2f} / {r4['tx'] / 1e6:.2f} MB = {c:.2f}x"
                     f"{tgt}; payload {r8['sent'] / r4['sent']:.2f}x.")
    return L


def plot(res: dict, p: Dict[str, float], path: str) -> None:
    """Predicted time per exchange against hosts, each method, per model and rate (hosts
    with their own cores), with the measured wire times (replays) as markers."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = rows_of(res)
    models = sorted({r["model"] for r in rows}) or ["resnet50"]
    fig, axes = plt.subplots(len(models), 2, figsize=(12, 4.5 * len(models)), squeeze=False)
    for i, model in enumerate(models):
        for j, rate in enumerate(("1gbit", "10gbit")):
            ax = axes[i][j]
            for k, m in enumerate(FIXED):
                ys = [predict(p, model, m, n, rate)["total"] for n in PREDICT_HOSTS]
                line, = ax.plot(PREDICT_HOSTS, ys, label=LABELS[m], marker=".")
                meas = [(r["hosts"], r["replay_s"]) for r in rows
                        if (r["model"], r["rate"], r["method"]) == (model, rate, m)]
                if meas:
                    ax.scatter(*zip(*meas), color=line.get_color(), marker="x")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("hosts (one rank each)")
            ax.set_ylabel("seconds per exchange")
            ax.set_title(f"{model}, {rate} per host: model (lines), measured wire (x)")
            ax.grid(True, which="both", alpha=0.3)
            if i == 0 and j == 0:
                ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# --- several ranks per host: bench/scaling_hier.py ----------------------------------------

#: Methods the model prices for the predictions at 8 ranks per host ("host+none",
#: "host+fp16": a hierarchical allreduce, as Horovod's with NCCL or BytePS would run it;
#: modelled only: Horovod's CPU allreduce has none to measure).
PREDICT_K = 8
PREDICT_HIER = ["none", "fp16", "host+fp16", "ag+alq:bits=3", "rs+alq:bits=3",
                "host+ag+alq:bits=3", "host+rs+alq:bits=3", "rs+dgc:density=0.001",
                "host+rs+dgc:density=0.001"]
LABELS.update({"host+fp16": "fp16 hierarchical allreduce (modelled)",
               "host+none": "fp32 hierarchical allreduce (modelled)"})
#: bytes per second inside a host assumed for the "shared memory at 10 GB/s" variant
SHM_RATE = 10e9


def fit_all(hier_rows: List[dict]) -> Dict[str, float]:
    """The model refitted on bench/results/scaling.json's cells (one rank per host) and the
    summaries of bench/scaling_hier.py (``hier_rows``)."""
    import json
    import os
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "scaling.json")
    with open(path) as f:
        res = json.load(f)
    cores = res.get("cores") or os.cpu_count() or 1
    rows = rows_of(res) + [r for r in hier_rows]
    p = fit_rows(rows, cores)
    p["cores"] = cores
    return p, rows


def render_hier(hier_rows: List[dict]) -> str:
    """bench/results/scaling_hier.md: the measured cells of bench/scaling_hier.py with the
    refitted model's error per cell, targets (a) and (b) of issue 23, predictions for 8
    ranks per host at 8 to 1024 hosts."""
    p, rows = fit_all(hier_rows)
    cores = p["cores"]
    L = ["# Several ranks per host: flat against hierarchical, emulated hosts, model to "
         "1024 x 8", ""]
    L += ["Commands (bench/scaling_hier.py; each cell: `launch/cluster --ranks-per-host K "
          "HOSTS RATE -- launch/run -np HOSTS*K python bench/scaling_hier.py --worker ...`: "
          "a network namespace per host behind its own link shaped both ways, MPI over TCP "
          "between hosts and over shared memory (Open MPI's vader) inside a host):", ""]
    seen = []
    for r in hier_rows:
        key = (r["model"], r["hosts"], r["ranks_per_host"], r["rate"])
        if key not in seen:
            seen.append(key)
    for key in seen:
        cr = [r for r in hier_rows if (r["model"], r["hosts"], r["ranks_per_host"],
                                       r["rate"]) == key]
        loads = [x for r in cr for x in r["load"] if x is not None]
        L.append(f"    {cr[0]['measured']}  {cr[0].get('command', '')}  # load average "
                 f"(1 min) {min(loads):.1f} to {max(loads):.1f} during the cell")
    L += ["", f"Conditions: {cores} cores shared with other jobs (load averages above), "
          "so 4 to 8 ranks are CPU-bound: the encode, decode and the in-host copies of "
          "every rank share 2 cores, where real hosts give each rank its own.  Compare "
          "methods by their ratios within one cell (measured side by side in one run).", "",
          "Columns: time = the slowest rank's time per exchange, median of 3 after a warm-up "
          "(min-max); NIC tx / rx = bytes through each host's link per exchange (its "
          "interface counters, TCP/IP headers included), mean over hosts; in-host = bytes a "
          "rank sent to its host's other ranks (the hierarchical stages, StepStats."
          "host_bytes); encode / comm / decode = the pipeline stages (seconds summed over "
          "buckets, mean over ranks); model = the refitted model with this cell's CPU "
          f"contention (N ranks and a fitted background of {p.get('background_k', 0):g} busy "
          f"threads on {cores} cores; bench/scaling.py's cells, measured on another day, "
          f"their own: {p['background']:g}).", ""]
    errs = []
    for key in seen:
        model, n, k, rate = key
        cr = [r for r in hier_rows if (r["model"], r["hosts"], r["ranks_per_host"],
                                       r["rate"]) == key]
        L += [f"## {model}, {n} hosts x {k} ranks, {rate} per host", "",
              "| method | path | time s (min-max) | NIC tx MB | NIC rx MB | in-host MB | "
              "encode s | comm s | decode s | model s | model err |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in cr:
            prs = err = ""
            if r["method"] in FIXED_ALL:
                pr = predict(p, model, r["method"], n, rate,
                             contention(n * k, cores, p.get("background_k", 0.0)), k)["total"]
                e = pr / r["median_s"] - 1
                errs.append((key, r["method"], e))
                prs, err = f"{pr:.3f}", f"{100 * e:+.0f} %"
            L.append(f"| {LABELS.get(r['method'], r['method'])} | "
                     f"{'hierarchical' if r['hierarchical'] else 'flat'} | "
                     f"{r['median_s']:.3f} ({r['min_s']:.3f}-{r['max_s']:.3f}) | "
                     f"{r['nic_tx'] / 1e6:.2f} | {r['nic_rx'] / 1e6:.2f} | "
                     f"{r['host_bytes'] / 1e6:.2f} | {r['encode']:.3f} | {r['comm']:.3f} | "
                     f"{r['decode']:.3f} | {prs} | {err} |")
        for r in cr:
            if r.get("choice"):
                c = r["choice"]
                L += ["", f"Auto (hierarchy=\"auto\"): {c['reason']}; it ran "
                      f"{'hierarchical' if r['hierarchical'] else 'flat'}, its plan "
                      f"(elements per path): {r['elements']}."]
        L.append("")
    L += ["## Targets (issue 23)", ""] + targets_hier(hier_rows, p)
    L += ["", "## The model, refitted", "",
          "bench/scaling_model.py (`account` with k ranks per host: Open MPI's allreduce "
          "halves and doubles recursively, so each host's link carries 2 (H - 1) / H of the "
          "buffer; its allgatherv and alltoallv send every part directly, so the parts for "
          "other hosts' ranks all cross it; the hierarchical stages inside the host cost "
          "beta_host per byte, CPU-contended; `fit_all`), fitted on "
          "bench/results/scaling.json (one rank per host) and the cells above: " +
          ", ".join(f"{x} = {v:.3g}" for x, v in p.items() if x != "cores") + ".", ""]
    allerr = [abs(predict(p, r["model"], r["method"], r["hosts"], r["rate"],
                          contention(_ranks(r), cores,
                                     _bg(r, (p["background"], p.get("background_k", 0.0)))),
                          _k(r))["total"]
                  / r["median_s"] - 1) for r in rows if r["method"] in FIXED_ALL]
    L.append(f"Every measured cell (both benches, {len(allerr)} method cells): within 25 % "
             f"in {sum(e <= 0.25 for e in allerr)}; median error "
             f"{100 * float(np.median(allerr)):.0f} %, largest {100 * max(allerr):.0f} %. "
             f"The cells of several ranks per host: " + ", ".join(
                 f"{LABELS.get(m, m)} at {key[1]}x{key[2]} {100 * e:+.0f} %"
                 for key, m, e in errs) + ".")
    L.append("")
    for rate in ("1gbit", "10gbit"):
        for name, pp in _variants(p):
            L += [f"### Predicted seconds per exchange, resnet50, {PREDICT_K} ranks per host, "
                  f"{rate} per host, every rank its own core; {name}", "",
                  "| method | " + " | ".join(map(str, PREDICT_HOSTS[2:])) + " |",
                  "|---|" + "---|" * len(PREDICT_HOSTS[2:])]
            for m in PREDICT_HIER:
                L.append(f"| {LABELS.get(m, m)} | " + " | ".join(
                    f"{predict(pp, 'resnet50', m, n, rate, 1.0, PREDICT_K)['total']:.3g}"
                    for n in PREDICT_HOSTS[2:]) + " |")
            L.append("")
    return "\n".join(L) + "\n"


def _variants(p: Dict[str, float]) -> List[Tuple[str, Dict[str, float]]]:
    """The parameter sets the predictions are given for: as fitted; in-host copies at
    SHM_RATE; and also e0 / d0 the one-call codec's cost per piece
    (:func:`piece_costs_one_call`: a lower bound, without the exchange's own framing)."""
    q = dict(p, beta_host=1.0 / SHM_RATE)
    pc = piece_costs_one_call()
    return [("as fitted (beta_host: this machine's shared memory, contended; e0, d0: "
             "per piece, the exchange's framing and whatever else grows with the pieces "
             "in 2 to 4 hosts' cells)", p),
            (f"in-host copies at {SHM_RATE / 1e9:g} GB/s per rank", q),
            (f"in-host at {SHM_RATE / 1e9:g} GB/s and e0 = {1e6 * pc['encode']:.1f} us, "
             f"d0 = {1e6 * pc['decode']:.1f} us per piece (the one-call codec alone, CPU "
             f"time: a lower bound)", dict(q, e0=pc["encode"], d0=pc["decode"]))]


def _best_hier(pp, n, rate, k=PREDICT_K, model="resnet50"):
    return min((predict(pp, model, m, n, rate, 1.0, k)["total"], m)
               for m in ("host+ag+alq:bits=3", "host+rs+alq:bits=3"))


def targets_hier(hier_rows: List[dict], p: Dict[str, float]) -> List[str]:
    """Targets (a) and (b) of issue 23 (module docstring of bench/scaling_hier.py)."""
    L = []

    def get(m, n=4, k=2, model="resnet50", rate="1gbit"):
        for r in hier_rows:
            if (r["model"], r["hosts"], r["ranks_per_host"], r["rate"], r["method"]) == (
                    model, n, k, rate, m):
                return r
        return None
    flat = [r for r in (get("ag+alq:bits=3"), get("rs+alq:bits=3")) if r]
    hier = [r for r in (get("host+ag+alq:bits=3"), get("host+rs+alq:bits=3")) if r]
    if flat and hier:
        bf = min(flat, key=lambda r: r["median_s"])
        bh = min(hier, key=lambda r: r["median_s"])
        nic = bh["nic_tx"] / bf["nic_tx"]
        sp = bf["median_s"] / bh["median_s"]
        L.append(f"* (a) 4 hosts x 2 ranks x 1 Gbit/s, ResNet-50, ALQ 3 bits, each over its "
                 f"best collective: hierarchical ({LABELS[bh['method']]}) "
                 f"{bh['median_s']:.3f} s and {bh['nic_tx'] / 1e6:.2f} MB per host, flat "
                 f"({LABELS[bf['method']]}) {bf['median_s']:.3f} s and "
                 f"{bf['nic_tx'] / 1e6:.2f} MB: NIC bytes {nic:.2f}x (target at most 0.55x: "
                 f"{'met' if nic <= 0.55 else 'NOT met'}), speed {sp:.2f}x (target at least "
                 f"1.3x: {'met' if sp >= 1.3 else 'NOT met'}).  Same collective side by side: "
                 + "; ".join(
                     f"{c}: NIC {h['nic_tx'] / f['nic_tx']:.2f}x, speed "
                     f"{f['median_s'] / h['median_s']:.2f}x"
                     for c, f, h in (("allgather", get("ag+alq:bits=3"),
                                      get("host+ag+alq:bits=3")),
                                     ("reduce-scatter", get("rs+alq:bits=3"),
                                      get("host+rs+alq:bits=3"))) if f and h) + ".")
    else:
        L.append("* (a) not measured (4 hosts x 2 ranks x 1 Gbit/s, ResNet-50, ALQ missing).")
    for name, pp in _variants(p):
        t, m = _best_hier(pp, 1024, "1gbit")
        f32 = predict(pp, "resnet50", "none", 1024, "1gbit", 1.0, PREDICT_K)["total"]
        f16 = predict(pp, "resnet50", "host+fp16", 1024, "1gbit", 1.0, PREDICT_K)["total"]
        t64, m64 = _best_hier(pp, 64, "10gbit")
        f16_64 = predict(pp, "resnet50", "host+fp16", 64, "10gbit", 1.0, PREDICT_K)["total"]
        L.append(f"* (b), model {name.split(' (')[0]}: 1024 hosts x 8 ranks x 1 Gbit/s: "
                 f"hierarchical ALQ "
                 f"({LABELS[m]}) {t:.3g} s, fp32 allreduce {f32:.3g} s ({f32 / t:.2f}x, target "
                 f"4x: {'met' if f32 / t >= 4 else 'NOT met'}), fp16 hierarchical allreduce "
                 f"{f16:.3g} s ({f16 / t:.2f}x, target 2x: "
                 f"{'met' if f16 / t >= 2 else 'NOT met'}); 64 hosts x 8 x 10 Gbit/s: "
                 f"{LABELS[m64]} {t64:.3g} s against fp16 hierarchical {f16_64:.3g} s "
                 f"({f16_64 / t64:.2f}x, target 2x: "
                 f"{'met' if f16_64 / t64 >= 2 else 'NOT met'}).")
    return L
