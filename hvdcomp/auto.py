"""When does compressing a tensor pay, and over which collective?  A cost model, and
``Auto``, which uses it.

One exchange of a tensor of ``n`` float32 elements among ``N`` ranks costs, on each path:

    fp32 allreduce        t32(n) = a_ar + b_ar * 4n
    fp16 allreduce        t16(n) = a_ar + b_ar * 2n + c16 * n
    C over allgather      tAG(n) = E(n) + a_ag + b_ag * m(n) + N * D(n)
    C over reduce-scatter tRS(n) = N * E(s) + a_aa + b_aa * N m(s) + N * D(s)
                                   + E2(s) + a_ag + b_ag * m2(s) + N * D2(s),   s = n / N

with E(x) = e0 + e * x and D(x) = d0 + d * x one encode and one decode of x elements, and
m(x) = m0 + m1 * x the bytes of one message; E2, D2, m2 the same of the second stage.  The
reduce-scatter (hvdcomp.exchange.scatter) encodes N pieces, sends piece r to rank r (an
all-to-all), decodes the N contributions to its own piece, re-encodes their average with
the second-stage compressor (the bucketed quantizers with 2 more bits:
hvdcomp.exchange.shards.second_stage) and allgathers it; every rank then decodes the N
averaged pieces.  ``a``/``b`` are the latency and the seconds per byte of one collective *as
measured on this job's link* (Horovod's allreduce of a buffer of B bytes per rank; the
transport's allgather of B bytes from every rank; its all-to-all of B bytes from every
rank, B / N to each), so the algorithms, the link's bandwidth and how many ranks share it
are all inside the measurement.  ``e``/``d`` are the compressor's measured encode and decode
seconds per element, ``c16`` the fp16 cast.  A tensor's path is chosen without the
collectives' latencies ``a`` (:meth:`CostModel.choose`): the exchange fuses the tensors of a
bucket into one collective per path, so a small tensor does not pay a latency of its own
(counting it steered small tensors to whichever collective answered fastest to a 64 KiB
probe).  The model sums the phases: the exchange
pipeline overlaps them, so it overestimates every path, the compressed ones most (they have
three phases to overlap), i.e. it leans towards sending uncompressed.

``Auto(compressor)`` measures these numbers once, when the optimizer is built (a second or
two: each collective at 64 KiB and at L, L = the planned tensors' float32 bytes within
1 .. 8 MiB (the allgather at L / (N - 1) per rank, so that each rank receives about L),
and an encode/decode of a 2^22-element tensor by each stage), takes
the slowest rank's value of each, so that every rank computes the same plan, and sends each
tensor by the cheapest of fp32 allreduce, fp16 allreduce and the compressor over each
collective the exchange allows (its ``collective`` setting: "allgather", "reduce_scatter", or
"auto" for both, the default with Auto; never the reduce-scatter for a compressor that
refuses it, e.g. NDQSG and LAQ, nor on one rank).  Tensors that the exchange never
compresses (1-D, small, non-float) stay as they are.

    opt = hvdcomp.torch.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                             compression=hvdcomp.Auto("alq:bits=3"))
    opt.plan        # {name: "none" | "fp16" | "alq" ...}, opt.paths: by which collective;
                    # auto.model (a CostModel): the measured costs, once the optimizer is built

As a spec string (``--compression`` of the main job, ``$HVDCOMP_COMPRESSION``, the
optimizer's ``compression=``): ``[auto+][rs+|ag+]SPEC`` (:func:`from_spec`), e.g.
``"auto+alq:bits=3"`` (Auto, both collectives), ``"rs+alq:bits=3"`` (ALQ over the
reduce-scatter), ``"auto+ag+alq:bits=3"`` (Auto, allgather only).

There is no paper behind this: it is the "does it pay?" arithmetic of e.g. Agarwal et al.,
"On the utility of gradient compression in distributed training systems" (MLSys 2022), made
per tensor and measured instead of assumed.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from .compressors import Compressor, TensorKey, get, prefixes
from .errors import ConfigError

__all__ = ["Auto", "CostModel", "LinkCost", "CodecCost", "fit_line", "from_spec", "spec_collective",
           "merge_collective", "COLLECTIVES"]

AUTO_PREFIX = prefixes.AUTO
LAYER_PREFIX = prefixes.LAYER      # after "auto+": Auto(..., per_layer=True)
COLLECTIVES = ("allgather", "reduce_scatter", "auto")
_COLLECTIVE_PREFIXES = prefixes.COLLECTIVE


def from_spec(spec: str, *, whole: Optional[str] = None) -> Tuple[object, Optional[str]]:
    """``(compression, collective)`` of a spec string ``[auto+[layer+]][rs+|ag+]SPEC``:
    ``"auto+"`` gives ``Auto(SPEC)`` (``"auto+layer+"``: ``Auto(SPEC, per_layer=True)``),
    else the compressor ``hvdcomp.get(SPEC)``; ``"rs+"`` the collective "reduce_scatter",
    ``"ag+"`` "allgather", neither None (the exchange's default: "auto" with Auto, else
    "allgather").  ``whole``: the string ``spec`` is the rest of once the exchange has read
    its hierarchy prefix ("host+" / "flat+", :mod:`hvdcomp.compressors.prefixes`), quoted in
    errors; None: ``spec`` itself.  Raises ConfigError for a bad spec, and for an exchange
    prefix out of order or repeated (e.g. ``"auto+host+alq"``, ``"rs+auto+alq"``), naming
    it and the order ``[host+|flat+][auto+[layer+]][rs+|ag+]SPEC``."""
    s = spec.strip()
    # a prefix already read (here or, with ``whole``, the hierarchy's by the exchange)
    read = whole is not None and whole.strip().lower() != s.lower()
    auto = s.lower().startswith(AUTO_PREFIX)
    if auto:
        s = s[len(AUTO_PREFIX):]
    layer = auto and s.lower().startswith(LAYER_PREFIX)
    if layer:
        s = s[len(LAYER_PREFIX):]
    collective = _COLLECTIVE_PREFIXES.get(s[:3].lower())
    if collective is not None:
        s = s[3:]
    late = prefixes.leading(s)
    # A hierarchy prefix in front of everything is in order: the exchange reads it, and
    # hvdcomp.get's error says so (prefixes.prefix_error).
    if late is not None and (read or auto or collective is not None
                             or late not in prefixes.HIERARCHY):
        raise ConfigError(prefixes.order_error(spec if whole is None else whole, late))
    return (Auto(s, per_layer=layer) if auto else get(s)), collective


def spec_collective(spec: str) -> Optional[str]:
    """The collective a spec string's prefix names ('rs+', 'ag+', after an optional
    'auto+'), or None; never raises (the spec itself is not parsed)."""
    s = str(spec).strip().lower()
    if s.startswith(AUTO_PREFIX):
        s = s[len(AUTO_PREFIX):]
        s = s[len(LAYER_PREFIX):] if s.startswith(LAYER_PREFIX) else s
    return _COLLECTIVE_PREFIXES.get(s[:3])


def merge_collective(given: Optional[str], from_spec: Optional[str]) -> Optional[str]:
    """The collective of an exchange given both as a setting (``given``) and in the spec
    string (``from_spec``; either may be None).  Raises ConfigError for a name outside
    :data:`COLLECTIVES` or when the two differ."""
    if given is not None and given not in COLLECTIVES:
        raise ConfigError(f"collective must be one of {', '.join(COLLECTIVES)}; got {given!r}")
    if given is not None and from_spec is not None and given != from_spec:
        raise ConfigError(f"collective={given!r} contradicts the spec string's "
                          f"{from_spec!r} ('rs+' / 'ag+'); give one of them")
    return given if given is not None else from_spec


CHOICES = ("none", "fp16", "allgather", "reduce_scatter")
CALIBRATE_SMALL = 4096      # elements of the small calibration tensor (per-tensor costs)
SAMPLE = 1024               # coordinates per tensor of a per-layer Auto's error estimate
TRIAL = 2                   # timed exchanges per contender of a per-layer plan's trial
LINK_SMALL = 1 << 16        # bytes per rank of the small calibration collectives
LINK_LARGE_MIN, LINK_LARGE_MAX = 1 << 20, 8 << 20   # ... and the bounds of the large ones


def fit_line(x1: float, t1: float, x2: float, t2: float) -> Tuple[float, float]:
    """(intercept, slope) of the line through (x1, t1), (x2, t2), both clamped at >= 0."""
    slope = max(0.0, (t2 - t1) / (x2 - x1))
    return max(0.0, t1 - slope * x1), slope


@dataclass
class LinkCost:
    """Measured collective costs on this job's link (seconds; bytes contributed per rank).

    ar_latency + ar_per_byte * B: Horovod allreduce of a B-byte buffer;
    ag_latency + ag_per_byte * B: the transport's allgather of B bytes from every rank;
    aa_latency + aa_per_byte * B: the transport's all-to-all of B bytes from every rank
    (B / N to each; measured only when the reduce-scatter may be chosen).
    """
    ar_latency: float
    ar_per_byte: float
    ag_latency: float
    ag_per_byte: float
    aa_latency: float = 0.0
    aa_per_byte: float = 0.0


@dataclass
class CodecCost:
    """Measured compressor costs: seconds per element and fixed seconds per tensor, of one
    encode and of one message's decode; message bytes = bytes_fixed + bytes_per_elem * n;
    fp16_per_elem: the float32 -> float16 -> float32 casts around an fp16 allreduce."""
    encode_fixed: float
    encode_per_elem: float
    decode_fixed: float
    decode_per_elem: float
    bytes_fixed: float
    bytes_per_elem: float
    fp16_per_elem: float = 0.0

    def encode(self, n: float) -> float:
        return self.encode_fixed + self.encode_per_elem * n

    def decode(self, n: float) -> float:
        return self.decode_fixed + self.decode_per_elem * n

    def message(self, n: float) -> float:
        return self.bytes_fixed + self.bytes_per_elem * n


@dataclass
class CostModel:
    """Predicted seconds of one exchange of an n-element tensor on each path (module doc).
    stage2: the reduce-scatter's second-stage costs (None: the same as ``codec``)."""
    link: LinkCost
    codec: CodecCost
    world_size: int
    allreduce: bool = True      # False: no Horovod, fp32/fp16 go through the allgather too
    stage2: Optional[CodecCost] = None

    def seconds(self, n: int, fused: bool = False) -> Dict[str, float]:
        """Predicted seconds of each path of :data:`CHOICES` for ``n`` elements (module
        docstring; "allgather" and "reduce_scatter": the compressor over that collective).
        ``fused``: without the collectives' latencies (a tensor in a fusion bucket shares
        its bucket's collectives: their latency is the bucket's, not the tensor's)."""
        L, C, N = self.link, self.codec, self.world_size
        k = 0.0 if fused else 1.0
        if self.allreduce:
            t32 = k * L.ar_latency + L.ar_per_byte * 4 * n
            t16 = k * L.ar_latency + L.ar_per_byte * 2 * n + C.fp16_per_elem * n
        else:                    # uncompressed messages through the allgather path
            t32 = k * L.ag_latency + L.ag_per_byte * 4 * n
            t16 = k * L.ag_latency + L.ag_per_byte * 2 * n + C.fp16_per_elem * n

        C2 = self.stage2 or C
        tag = C.encode(n) + k * L.ag_latency + L.ag_per_byte * C.message(n) + N * C.decode(n)
        s = n / N
        trs = (N * C.encode(s) + k * L.aa_latency + L.aa_per_byte * N * C.message(s)
               + N * C.decode(s) + C2.encode(s) + k * L.ag_latency
               + L.ag_per_byte * C2.message(s) + N * C2.decode(s))
        return {"none": t32, "fp16": t16, "allgather": tag, "reduce_scatter": trs}

    def choose(self, n: int, allowed: Sequence[str] = CHOICES) -> str:
        """The cheapest allowed path of :data:`CHOICES` for a tensor of n elements in a
        fusion bucket (``seconds(n, fused=True)``: the per-byte and per-element costs and
        the compressor's per-tensor ones, not the collectives' latencies, which the bucket
        pays once per path; ties: the earlier in CHOICES)."""
        t = self.seconds(n, fused=True)
        return min((c for c in CHOICES if c in allowed), key=lambda c: t[c])

    def summary(self) -> str:
        """One line of the measured costs, for the log: each collective's bandwidth (bytes
        contributed per rank per second) and latency, the compressor's encode and decode
        seconds per element (the whole model: :meth:`as_dict`)."""
        L, C = self.link, self.codec

        def link(name, latency, per_byte):
            rate = f"{1e-9 / per_byte:.3g} GB/s" if per_byte > 0 else "no per-byte cost"
            return f"{name} ({latency * 1e3:.3g} ms, {rate})"

        parts = ([link("allreduce", L.ar_latency, L.ar_per_byte)] if self.allreduce else [])
        parts.append(link("allgather", L.ag_latency, L.ag_per_byte))
        if L.aa_latency or L.aa_per_byte:
            parts.append(link("all-to-all", L.aa_latency, L.aa_per_byte))
        parts.append(f"encode {C.encode_per_elem * 1e9:.3g} ns and decode "
                     f"{C.decode_per_elem * 1e9:.3g} ns per element")
        return ", ".join(parts)

    def as_dict(self) -> dict:
        return {"link": asdict(self.link), "codec": asdict(self.codec),
                "world_size": self.world_size, "allreduce": self.allreduce,
                "stage2": None if self.stage2 is None else asdict(self.stage2)}


class Auto:
    """Send each tensor by whichever of fp32 allreduce, fp16 allreduce and ``compressor``
    (over each collective the exchange allows) the measured cost model (module docstring)
    says is fastest on this job's link.

    compressor: an hvdcomp compressor or spec string (default "alq:bits=3").
    fallbacks: the uncompressed paths allowed, a subset of ("none", "fp16").
    link / codec: LinkCost / CodecCost to use instead of measuring (tests, or a plan made
      elsewhere); every rank must pass the same values.
    calibrate_numel: elements of the tensor encoded and decoded to measure the compressor.
    per_layer: choose per tensor among fp32/fp16 (``fallbacks``), the compressor's family
      at each of ``bits``, top-k at each of ``densities`` and PowerSGD at each of ``ranks``,
      the fastest plan whose total squared error (measured on the first step's gradients)
      is at most ``budget`` (a factor, >= 0) times that of ``compressor`` at its settings
      (:mod:`hvdcomp.exchange.layer_plan`; spec "auto+layer+SPEC").  ``codecs``: {candidate
      spec: CodecCost} given instead of measured; ``max_nodes``: the exact search's limit;
      ``sample``: coordinates per tensor (an integer >= 1) the squared error of the ranks'
      average is estimated from (all of a tensor with at most that many elements).
      ``trial``: after planning, time the plan against ``compressor`` on every planned tensor,
      end to end on the first step's gradients (this many timed exchanges each,
      after one untimed; :mod:`hvdcomp.exchange.plan_trial`) and keep the faster; 0: trust
      the cost model; None (default): 2, or 0 when ``link`` is given (costs fixed by hand).

    Used through ``hvdcomp.torch.DistributedOptimizer(..., compression=Auto(...))``; the
    optimizer's ``compression`` is then the inner compressor, ``plan`` the compressor per
    tensor and ``paths`` the collective per tensor.  Raises ValueError for an unknown
    fallback, budget, sample or trial, ConfigError for a bad spec.
    """

    def __init__(self, compressor="alq:bits=3", fallbacks: Sequence[str] = ("none", "fp16"),
                 *, link: Optional[LinkCost] = None, codec: Optional[CodecCost] = None,
                 calibrate_numel: int = 2**22, per_layer: bool = False, budget: float = 1.0,
                 bits: Sequence[int] = (2, 3, 4, 5), densities: Sequence[float] = (0.01, 0.001),
                 ranks: Sequence[int] = (1, 2, 4), codecs: Optional[Dict[str, CodecCost]] = None,
                 max_nodes: int = 200_000, sample: int = SAMPLE, trial: Optional[int] = None):
        self.compressor: Compressor = (get(compressor) if isinstance(compressor, str)
                                       else compressor)
        if not isinstance(self.compressor, Compressor):
            raise TypeError(f"compressor must be an hvdcomp compressor or spec, got "
                            f"{compressor!r}")
        bad = [f for f in fallbacks if f not in ("none", "fp16")]
        if bad:
            raise ValueError(f"fallbacks must be among 'none' and 'fp16', got {bad}")
        self.fallbacks = tuple(fallbacks)
        self.link, self.codec = link, codec
        self.calibrate_numel = int(calibrate_numel)
        if self.calibrate_numel <= CALIBRATE_SMALL:
            raise ValueError(f"calibrate_numel must be > {CALIBRATE_SMALL}, got {calibrate_numel}")
        self.model: Optional[CostModel] = None
        self.plan: Dict[str, str] = {}
        # per layer (hvdcomp.exchange.layer_plan): the candidates and the error budget
        self.per_layer = bool(per_layer)
        self.budget = float(budget)
        if not self.budget >= 0 or self.budget == float("inf"):
            raise ValueError(f"budget must be a finite number >= 0, got {budget!r}")
        self.bits, self.ranks = tuple(int(b) for b in bits), tuple(int(r) for r in ranks)
        self.densities = tuple(float(d) for d in densities)
        self.codecs, self.max_nodes = codecs, int(max_nodes)
        if isinstance(sample, bool) or not isinstance(sample, (int, np.integer)) or sample < 1:
            raise ValueError(f"sample must be an integer >= 1, got {sample!r}")
        self.sample = int(sample)
        if trial is None:
            trial = 0 if link is not None else TRIAL
        if isinstance(trial, bool) or not isinstance(trial, (int, np.integer)) or trial < 0:
            raise ValueError(f"trial must be an integer >= 0, got {trial!r}")
        self.trial = int(trial)

    def spec(self) -> str:
        layer = (f"; per_layer budget={self.budget!r} bits={self.bits} densities="
                 f"{self.densities} ranks={self.ranks} sample={self.sample} trial={self.trial}"
                 if self.per_layer else "")
        return f"auto({self.compressor.spec()}; fallbacks={','.join(self.fallbacks)}{layer})"

    def __repr__(self) -> str:
        layer = f", per_layer=True, budget={self.budget!r}" if self.per_layer else ""
        return f"hvdcomp.Auto({self.compressor.spec()!r}, fallbacks={self.fallbacks}{layer})"

    # --- planning (called by hvdcomp.exchange.plan.Plan, on every rank together) --------
    def settings(self) -> str:
        """What every rank must agree on before measuring (checked by the exchange)."""
        return (f"{self.spec()} link={self.link} codec={self.codec} "
                f"calibrate_numel={self.calibrate_numel}"
                + (f" codecs={self.codecs}" if self.per_layer else ""))

    def make_plan(self, sizes: Dict[str, int], transport, allreduce=None, device=None,
                  collectives: Sequence[str] = ("allgather",),
                  second_stage: Optional[Callable[[Compressor], Compressor]] = None,
                  ) -> Dict[str, Tuple[Compressor, bool]]:
        """{name: (compressor, scatter)} for the tensors of ``sizes`` ({name: numel}) that
        the exchange would compress: ``self.compressor``, a NoneCompressor or an FP16, and
        whether it goes over the reduce-scatter (all ranks agree: the measurements are the
        slowest rank's).  ``allreduce``: the exchange's carrier of summable tensors
        (hvdcomp.transport.Allreduce), or None (fp32 and fp16 then travel as messages too).
        ``device``: where the gradients live (the compressor and the allreduce are timed on
        tensors there).  ``collectives``: those the compressor may take, among "allgather"
        and "reduce_scatter" (the all-to-all is measured only when the latter is allowed).
        ``second_stage``: the reduce-scatter's second-stage compressor of a compressor
        (hvdcomp.exchange.shards.second_stage), measured when the reduce-scatter is allowed;
        None: priced as the first stage.  ``plan`` records each choice: "none", "fp16", the compressor's name (allgather) or
        "rs+" and its name (reduce-scatter)."""
        bad = [c for c in collectives if c not in ("allgather", "reduce_scatter")]
        if bad or not collectives:
            raise ValueError(f"collectives must be a non-empty subset of ('allgather', "
                             f"'reduce_scatter'), got {tuple(collectives)}")
        scatter = "reduce_scatter" in collectives
        large = min(max(4 * sum(sizes.values()), LINK_LARGE_MIN), LINK_LARGE_MAX)
        link = self.link or measure_link(transport, allreduce, device=device,
                                         alltoall=scatter, large=large)
        codec = self.codec or measure_codec(self.compressor, transport, self.calibrate_numel,
                                            device=device)
        stage2 = None
        if scatter and second_stage is not None and self.codec is None:
            stage2 = measure_codec(self.compressor, transport, self.calibrate_numel,
                                   device=device, second_stage=second_stage)
        self.model = CostModel(link, codec, transport.size, allreduce is not None, stage2)
        allowed = self.fallbacks + tuple(collectives)
        paths = {"none": (get("none"), False), "fp16": (get("fp16"), False),
                 "allgather": (self.compressor, False),
                 "reduce_scatter": (self.compressor, True)}
        names = {"none": "none", "fp16": "fp16", "allgather": self.compressor.name,
                 "reduce_scatter": "rs+" + self.compressor.name}
        out = {}
        for name, n in sizes.items():
            c = self.model.choose(n, allowed)
            self.plan[name] = names[c]
            out[name] = paths[c]
        return out


# --- measuring ---------------------------------------------------------------------------

def slowest_over_ranks(transport, values: List[float]) -> List[float]:
    """Each value's maximum over ranks (every rank gets the same list): ``values`` a list of
    floats (seconds, as measured on this rank), one allgather of float64 over ``transport``
    (collective: every rank calls it with a list of the same length)."""
    got = transport.allgather(np.asarray(values, dtype=np.float64).view(np.uint8))
    return np.max(np.stack([g.view(np.float64) for g in got]), axis=0).tolist()


def _best_of(fn: Callable[[], None], reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_link(transport, allreduce=None, large: int = LINK_LARGE_MIN, reps: int = 2,
                 device=None, alltoall: bool = False) -> LinkCost:
    """Time the ``allreduce`` carrier (if any; a float32 buffer on ``device``), the
    transport's allgather (host bytes, as the exchange sends messages) and, with
    ``alltoall``, its all-to-all (B / N bytes to each rank) at two buffer sizes B (bytes per
    rank): LINK_SMALL and ``large`` (the allgather's: large / (N - 1), at least twice
    LINK_SMALL, so that every collective moves about ``large`` bytes per rank: a link's
    sustained rate, not the burst a small transfer may ride), and fit latency + per-byte
    cost; slowest rank's values."""
    vals = []
    n = transport.size
    large = max(int(large), 2 * LINK_SMALL)
    sizes = [(LINK_SMALL, LINK_SMALL), (large, max(large // max(n - 1, 1), 2 * LINK_SMALL))]
    for i, (b, b_ag) in enumerate(sizes):
        if allreduce is not None:
            buf = torch.zeros(b // 4, device=device)
            allreduce.sum_(buf, f"hvdcomp.auto.warm.{i}")
            vals.append(_best_of(lambda: allreduce.sum_(buf, f"hvdcomp.auto.ar.{i}"), reps))
        else:
            vals.append(0.0)
        msg = np.zeros(b_ag, dtype=np.uint8)
        transport.allgather(msg)
        vals.append(_best_of(lambda: transport.allgather(msg), reps))
        if alltoall:
            parts = [np.zeros(b // n, dtype=np.uint8)] * n
            transport.alltoall(parts)
            vals.append(_best_of(lambda: transport.alltoall(parts), reps))
        else:
            vals.append(0.0)
    ar1, ag1, aa1, ar2, ag2, aa2 = slowest_over_ranks(transport, vals)
    (s1, g1), (s2, g2) = sizes
    a_ar, b_ar = fit_line(s1, ar1, s2, ar2)
    a_ag, b_ag = fit_line(g1, ag1, g2, ag2)
    a_aa, b_aa = fit_line(s1, aa1, s2, aa2)
    return LinkCost(a_ar, b_ar, a_ag, b_ag, a_aa, b_aa)


def measure_codec(compressor: Compressor, transport, numel: int = 2**22,
                  reps: int = 2, device=None,
                  second_stage: Optional[Callable[[Compressor], Compressor]] = None
                  ) -> CodecCost:
    """Encode and decode fresh copies of ``compressor`` (same settings; the real one's state
    is untouched) on N(0, 1e-6) tensors of 4096 and ``numel`` elements on ``device``; slowest
    rank's values.  Every repetition uses new copies, so compressors that keep state (LAQ's
    lazy skips, error feedback) are timed on a first, full upload.  NDQSG is timed as its
    DQSG group (rank 0): the nested ranks' decode, which needs every message, is not.
    ``second_stage``: time ``second_stage(copy)`` instead (the reduce-scatter's
    re-encoding of the averages, e.g. a finer quantizer)."""
    rank, size = transport.rank, transport.size
    gen = torch.Generator().manual_seed(12345 + rank)
    dev = torch.device(device) if device is not None else torch.device("cpu")
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    vals = []
    for n in (CALIBRATE_SMALL, numel):
        x = (torch.randn(n, generator=gen) * 1e-3).to(dev)
        # as rank 0 on every rank: a message any compressor decodes alone
        key = TensorKey(f"hvdcomp.auto.calibration.{n}", 2**31 - 1, 0, 0, size, 0)
        t_enc = t_dec = t16 = float("inf")
        nbytes = 0
        for rep in range(reps + 1):               # the first repetition warms up
            enc, dec = get(compressor.spec()), get(compressor.spec())
            if second_stage is not None:
                enc, dec = second_stage(enc), second_stage(dec)
            acc = torch.zeros(n, device=dev)
            sync()
            t0 = time.perf_counter()
            msg = enc.encode(x, key)
            sync()
            t1 = time.perf_counter()
            if msg is None:
                raise RuntimeError(f"hvdcomp.Auto: {compressor.name} sent nothing for a "
                                   f"first upload; cannot measure it")
            dec.decode(msg, key, acc)
            sync()
            t2 = time.perf_counter()
            x.to(torch.float16).to(torch.float32)
            sync()
            t3 = time.perf_counter()
            if rep:
                t_enc, t_dec, t16 = min(t_enc, t1 - t0), min(t_dec, t2 - t1), min(t16, t3 - t2)
            nbytes = len(msg.to_bytes())
        vals += [t_enc, t_dec, float(nbytes), t16]
    e1, d1, m1, c1, e2, d2, m2, c2 = slowest_over_ranks(transport, vals)
    n1, n2 = CALIBRATE_SMALL, numel
    # a noisy machine can make the small tensor look as slow as the large one: the per-
    # element cost is never taken below half the large tensor's average
    e0, e = fit_line(n1, e1, n2, e2)
    d0, d = fit_line(n1, d1, n2, d2)
    e, d = max(e, 0.5 * e2 / n2), max(d, 0.5 * d2 / n2)
    b0, b = fit_line(n1, m1, n2, m2)
    return CodecCost(e0, e, d0, d, b0, b, c2 / n2)
