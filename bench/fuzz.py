"""Fuzz every compressor's decoder with mutated wire messages (issue #15, items 1-4 and 9).

    .venv/bin/python bench/fuzz.py [--messages 1000000 | --minutes 15] [--seed 0]
                                   [--backends reference,kernels] [--out bench/results/fuzz.md]

Each trial takes the honest messages of one tensor from two ranks (every registered
compressor, entropy coding on and off where the compressor has it, tensors of several shapes
and dtypes: empty, scalar, vector, matrix, 4-D), mutates one of them, and decodes both the
way the exchange does (``Message.from_bytes`` of each rank's bytes, a zero-length entry
meaning a skipped upload, then ``compressor.combine(msgs, keys, out)`` into a zeroed float32
accumulator) with a fresh receiver, on one backend (``hvdcomp.backends.use``).  Mutations:
bit flips and random bytes anywhere, a header field set to a boundary value, a 4- or 8-byte
word of a section set to a boundary integer or float (0, 1, 2**31, 2**32 - 1, Inf, NaN,
1e-45, 3.4e38, ...), the fields of an rANS section (alphabet, chunk size, count, model,
chunk table, states), sections resized, added or dropped, the shape replaced by another of
the same numel (or any entries beside a 0 for an empty tensor), truncation, a zero-length
message, another case's message.  The CRC is recomputed after half of the mutations so that
they reach the decoders.

A trial fails when the decode

* raises anything but ``hvdcomp.WireFormatError`` (``crash``);
* takes more than ``slow_s`` (1 s) of CPU time (``slow``), or more than ``hang_s`` of wall
  time (interrupted by SIGALRM: ``hang``);
* raises the process's peak resident memory by more than 64 MiB (``memory``; the peak is
  monotone, so this catches the first large allocation of a run, which is what matters);
* leaves the accumulator with another shape or dtype (``shape``);
* reports a finite result (``combine`` returned True) whose accumulator holds Inf or NaN
  (``nonfinite``) although some rank's contribution alone is not finite.  Where every
  contribution is finite and only their float32 sum overflows (a mutated message near the
  float32 maximum whose values NDQSG's nested rank also takes as its fallback, say), the
  outcome is ``overflow``: counted, not a failure (honest messages can do that too: the
  sum of two float32 values of 3e38 is Inf; the exchange's NaN policy handles it).

:func:`fuzz` is the shared engine (tests/unit/test_fuzz.py runs about 20,000 trials of it);
``main`` is the long run and writes the per-compressor tables.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import resource
import signal
import struct
import sys
import time
import traceback
import zlib
from collections import Counter, defaultdict
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import hvdcomp  # noqa: E402
from hvdcomp.backends import use  # noqa: E402
from hvdcomp.compressors import TensorKey  # noqa: E402
from hvdcomp.compressors.protocols import SummedRounds  # noqa: E402
from hvdcomp.errors import WireFormatError  # noqa: E402
from hvdcomp.wire import FLAG_ENTROPY, Message  # noqa: E402

# The compressors under test: every registered name with small buckets (several per
# tensor), entropy coding on and off where the compressor has the setting.
BASE_SPECS = {
    "none": "none", "fp16": "fp16", "bf16": "bf16",
    "qsgd": "qsgd:bits=3,bucket_size=16", "qsgdinf": "qsgdinf:bits=4,bucket_size=16",
    "nuqsgd": "nuqsgd:bits=3,bucket_size=16", "alq": "alq:bits=3,bucket_size=16",
    "amq": "amq:bits=2,bucket_size=16", "terngrad": "terngrad:bucket_size=16",
    "signef": "signef:bucket_size=16", "psq": "psq:bits=3", "bhq": "bhq:bits=3,block_size=3",
    "dqsg": "dqsg:bits=4,bucket_size=16", "ndqsg": "ndqsg:bits=4,nested_bits=2,bucket_size=16",
    "topk": "topk:density=0.2", "randk": "randk:density=0.2", "dgc": "dgc:density=0.2",
    "laq": "laq:bits=3,t_max=0",
}
SHAPES = [(), (0,), (3, 0, 2), (37,), (9, 11), (5, 1, 2, 3)]
DTYPES = [torch.float32, torch.float32, torch.float16, torch.float64]
WORLD = 2
HEAD = struct.Struct("<4sBBBBBBBBIIIIIQQ")       # hvdcomp.wire's fixed header
_FIELDS = ("magic", "version", "codec", "dtype", "flags", "bits", "ndim", "nsec", "reserved",
           "bucket_size", "level_version", "tensor_id", "rank", "seed", "step", "numel")
_WIDTH = dict(zip(_FIELDS, (0, 8, 8, 8, 8, 8, 8, 8, 8, 32, 32, 32, 32, 32, 64, 64)))
FAILURES = ("crash", "slow", "hang", "memory", "shape", "nonfinite")


def specs(names: Optional[Sequence[str]] = None) -> List[str]:
    """Every spec under test: each compressor that sends wire messages (not those summed in
    rounds: powersgd), with ``entropy=True`` too where it has it."""
    out = []
    for name in names or sorted(hvdcomp.available()):
        if isinstance(hvdcomp.get(name), SummedRounds):
            continue        # no wire messages to decode: summed by allreduces (powersgd)
        spec = BASE_SPECS.get(name, name)
        out.append(spec)
        if "entropy" in hvdcomp.get(spec).settings():
            out.append(spec + ("," if ":" in spec else ":") + "entropy=True")
    return out


@dataclasses.dataclass
class Case:
    """The honest messages of one tensor from every rank, and the receivers' keys."""
    spec: str
    shape: Tuple[int, ...]
    dtype: torch.dtype
    frames: List[bytes]            # per rank; b"" for a skipped upload
    keys: List[TensorKey]

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) if self.shape else 1


def make_cases(spec_list: Sequence[str], seed: int) -> List[Case]:
    """Honest messages for every spec x shape, from gradients with varied scales (and a
    few exact zeros), encoded by one sender instance per rank."""
    g = torch.Generator().manual_seed(seed)
    cases = []
    for spec in spec_list:
        for i, shape in enumerate(SHAPES):
            dtype = DTYPES[i % len(DTYPES)]
            keys = [TensorKey("w", 3, 5, r, WORLD, seed=77, shape=shape, dtype=dtype)
                    for r in range(WORLD)]
            base = torch.randn(shape, generator=g) * 10.0 ** float(torch.randint(-3, 3, (1,),
                                                                                  generator=g))
            frames = []
            for r in range(WORLD):
                grad = base + 0.1 * base.abs().mean().nan_to_num() * torch.randn(shape,
                                                                                  generator=g)
                if grad.numel() > 4:
                    grad.view(-1)[::7] = 0.0
                sender = hvdcomp.get(spec)
                if hasattr(sender, "set_momentum"):
                    sender.set_momentum({"w": 0.9})
                m = sender.encode(grad.to(dtype), keys[r])
                frames.append(b"" if m is None else m.to_bytes())
            cases.append(Case(spec, shape, dtype, frames, keys))
    return cases


# ---- mutations ---------------------------------------------------------------------------

_U32 = [0, 1, 2, 3, 7, 8, 15, 16, 255, 256, 4096, 65535, 65536, 2**24, 2**31 - 1, 2**31,
        2**32 - 2, 2**32 - 1]
_U64 = _U32 + [2**32, 2**40, 2**62, 2**63 - 1, 2**63, 2**64 - 1]
_F32 = [0.0, -0.0, 1.0, -1.0, 0.5, 1e-45, -1e-45, 1e-40, 1.1754944e-38, 1e-30, 1e-10, 1e10,
        1e30, 3.4e38, -3.4e38, 3.4028235e38, float("inf"), float("-inf"), float("nan")]


def _interesting(rng, bits: int, orig: int) -> int:
    pool = [v for v in (_U64 if bits == 64 else _U32) if v < 1 << bits]
    r = rng.random()
    if r < 0.5:
        v = pool[rng.integers(len(pool))]
    elif r < 0.8:
        v = orig + int(rng.integers(-3, 4))
    else:
        v = int(rng.integers(0, 1 << min(bits, 62)))
    return v % (1 << bits)


def _parse(buf: bytes):
    """(header dict, shape, sections) of a structurally valid message, or None."""
    if len(buf) < HEAD.size + 4:
        return None
    h = dict(zip(_FIELDS, HEAD.unpack_from(buf, 0)))
    off = HEAD.size
    if len(buf) < off + 8 * (h["ndim"] + h["nsec"]) + 4:
        return None
    shape = list(struct.unpack_from(f"<{h['ndim']}Q", buf, off))
    off += 8 * h["ndim"]
    lengths = struct.unpack_from(f"<{h['nsec']}Q", buf, off)
    off += 8 * h["nsec"]
    if off + sum(lengths) + 4 != len(buf):
        return None
    secs = []
    for n in lengths:
        secs.append(bytearray(buf[off:off + n]))
        off += n
    return h, shape, secs


def _pack(h: dict, shape, secs, lengths=None) -> bytes:
    """Serialize without any check (the fields as given), CRC appended."""
    lengths = [len(s) for s in secs] if lengths is None else lengths
    head = HEAD.pack(*(h[f] for f in _FIELDS))
    head += struct.pack(f"<{len(shape)}Q", *shape) + struct.pack(f"<{len(lengths)}Q", *lengths)
    body = head + b"".join(bytes(s) for s in secs)
    return body + struct.pack("<I", zlib.crc32(body))


def _set_word(rng, sec: bytearray) -> None:
    """Overwrite one aligned 4- or 8-byte word of ``sec`` with a boundary value."""
    if rng.random() < 0.75 and len(sec) >= 4:
        off = 4 * int(rng.integers(len(sec) // 4))
        if rng.random() < 0.5:
            struct.pack_into("<f", sec, off, _F32[rng.integers(len(_F32))])
        else:
            orig = struct.unpack_from("<I", sec, off)[0]
            struct.pack_into("<I", sec, off, _interesting(rng, 32, orig))
    elif len(sec) >= 8:
        off = 8 * int(rng.integers(len(sec) // 8))
        orig = struct.unpack_from("<Q", sec, off)[0]
        struct.pack_into("<Q", sec, off, _interesting(rng, 64, orig))
    elif sec:
        sec[int(rng.integers(len(sec)))] = int(rng.integers(256))


def _rans(rng, sec: bytearray) -> None:
    """Mutate a field of an rANS section (hvdcomp.ops.rans: u8 precision, u8 reserved,
    u16 alphabet, u32 chunk size, u64 count, u16 model, u32 chunk lengths, chunks)."""
    if len(sec) < 16:
        _set_word(rng, sec)
        return
    A = struct.unpack_from("<H", sec, 2)[0] or 65536
    what = rng.integers(7)
    if what == 0:       # chunk size: the case (raised: loops or huge allocations)
        C = struct.unpack_from("<I", sec, 4)[0]
        v = [C * 2, C * 16, C + 1, C - 1, 2**24, 2**31, 2**32 - 1, 1, 2, 0][rng.integers(10)]
        struct.pack_into("<I", sec, 4, v % 2**32)
    elif what == 1:
        struct.pack_into("<Q", sec, 8, _interesting(rng, 64, struct.unpack_from("<Q", sec, 8)[0]))
    elif what == 2:
        struct.pack_into("<H", sec, 2, _interesting(rng, 16, A))
    elif what == 3:
        sec[int(rng.integers(2))] = int(rng.integers(256))
    elif what == 4 and len(sec) >= 16 + 2 * A:     # one model entry
        off = 16 + 2 * int(rng.integers(A))
        orig = struct.unpack_from("<H", sec, off)[0]
        struct.pack_into("<H", sec, off, _interesting(rng, 16, orig))
    elif what == 5 and len(sec) >= 16 + 2 * A + 4:  # the chunk table or a state
        off = 16 + 2 * A + 4 * int(rng.integers((len(sec) - 16 - 2 * A) // 4))
        orig = struct.unpack_from("<I", sec, off)[0]
        struct.pack_into("<I", sec, off, _interesting(rng, 32, orig))
    else:
        _set_word(rng, sec)


def _other_shape(rng, shape: List[int], numel: int) -> List[int]:
    if numel == 0:        # any entries beside a zero: the unchecked case
        nd = int(rng.integers(1, 5))
        out = [_interesting(rng, 64, 3) for _ in range(nd)]
        out[int(rng.integers(nd))] = 0
        return out
    if len(shape) >= 2 and rng.random() < 0.5:
        return list(rng.permutation(shape))
    return [numel] if rng.random() < 0.5 else [1, numel] if shape != [1, numel] else [numel, 1]


def mutate(rng, buf: bytes, donors: Sequence[bytes]) -> Tuple[bytes, str]:
    """One mutation of message ``buf``: (new bytes, kind).  ``donors`` are other messages
    (spliced in whole or in part)."""
    parsed = _parse(buf)
    kinds = ["flip", "bytes", "truncate", "empty", "splice"]
    if parsed is not None:
        kinds += ["header"] * 5 + ["word"] * 5 + ["resize", "sections", "reshape"] * 2
        if parsed[0]["flags"] & FLAG_ENTROPY:
            kinds += ["rans"] * 6
    kind = kinds[rng.integers(len(kinds))]
    b = bytearray(buf)
    if kind == "flip" and b:
        for _ in range(int(rng.integers(1, 5))):
            i = int(rng.integers(len(b) * 8))
            b[i // 8] ^= 1 << (i % 8)
        return bytes(b), kind
    if kind == "bytes" and b:
        for _ in range(int(rng.integers(1, 5))):
            b[int(rng.integers(len(b)))] = int(rng.integers(256))
        return bytes(b), kind
    if kind == "truncate":
        return bytes(b[:int(rng.integers(len(b) + 1))]), kind
    if kind == "empty":
        return b"", kind
    if kind == "splice" or parsed is None:
        d = donors[rng.integers(len(donors))]
        return (d if rng.random() < 0.5 else d[:len(d) // 2] + bytes(b[len(d) // 2:])), "splice"
    h, shape, secs = parsed
    if kind == "header":
        f = _FIELDS[1 + int(rng.integers(len(_FIELDS) - 1))]
        h[f] = _interesting(rng, _WIDTH[f], h[f])
        if f in ("ndim", "nsec"):
            return _raw_header(h, buf), kind
        if f == "numel" or rng.random() < 0.3:     # shape entries / section lengths too
            shape = [_interesting(rng, 64, s) for s in shape]
        return _pack(h, shape, secs), kind
    if kind == "word" and secs:
        _set_word(rng, secs[int(rng.integers(len(secs)))])
        return _pack(h, shape, secs), kind
    if kind == "rans" and len(secs) >= 2:    # the code section (1; NDQSG's residues: 1 or 2)
        i = 1 if len(secs[1]) >= 16 or len(secs) < 3 else int(rng.integers(1, 3))
        _rans(rng, secs[i])
        return _pack(h, shape, secs), kind
    if kind == "resize" and secs:
        s = secs[int(rng.integers(len(secs)))]
        d = int(rng.choice([-8, -4, -2, -1, 1, 2, 4, 8, 64]))
        if d < 0:
            del s[d:]
        else:
            s.extend(bytes(int(rng.integers(256)) if rng.random() < 0.5 else 0 for _ in range(d)))
        return _pack(h, shape, secs), kind
    if kind == "sections":
        if secs and rng.random() < 0.5:
            del secs[int(rng.integers(len(secs)))]
        else:
            at = int(rng.integers(len(secs) + 1))
            secs.insert(at, bytearray(rng.bytes(int(rng.integers(0, 17)))))
        h["nsec"] = len(secs)
        return _pack(h, shape, secs), kind
    if kind == "reshape":
        numel = int(np.prod(shape, dtype=object)) if shape else 1
        shape = _other_shape(rng, shape, numel)
        h["ndim"], h["numel"] = len(shape), int(np.prod(shape, dtype=object)) % 2**64
        return _pack(h, shape, secs), kind
    return bytes(b), "none"


def _raw_header(h: dict, buf: bytes) -> bytes:
    """``buf`` with its fixed header replaced by ``h`` (the rest as is), CRC recomputed."""
    body = HEAD.pack(*(h[f] for f in _FIELDS)) + buf[HEAD.size:-4]
    return body + struct.pack("<I", zlib.crc32(body))


def _recrc(b: bytes) -> bytes:
    if len(b) < 4:
        return b
    return b[:-4] + struct.pack("<I", zlib.crc32(b[:-4]))


# ---- one decode --------------------------------------------------------------------------

class _Hang(Exception):
    pass


def _alarm(signum, frame):
    raise _Hang()


@contextlib.contextmanager
def _wall_limit(seconds: float):
    """Raise _Hang in the main thread after ``seconds`` of wall time inside."""
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _usage() -> Tuple[float, int]:
    """(CPU seconds of the process, its peak resident bytes): one getrusage call."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime, ru.ru_maxrss * 1024


_RECEIVERS: Dict[str, tuple] = {}


def _receiver(spec: str):
    """A fresh compressor of ``spec`` (the spec parsed once)."""
    if spec not in _RECEIVERS:
        name, kwargs = hvdcomp.compressors.parse_spec(spec)
        _RECEIVERS[spec] = (type(hvdcomp.get(name)), kwargs)
    cls, kwargs = _RECEIVERS[spec]
    return cls(**kwargs)


def _contributions_finite(spec: str, msgs, keys, n: int, device) -> bool:
    """Whether every rank's own contribution decodes to finite values (NDQSG: its resolved
    values, nested ranks included; the others: each message decoded alone)."""
    comp = _receiver(spec)
    if hasattr(comp, "resolve"):
        res = comp.resolve(msgs, keys, n)
        return res is None or all(bool(torch.isfinite(v).all()) for v in res.values)
    for m, k in zip(msgs, keys):
        o = torch.zeros(n, device=device)
        if m is not None and comp.decode(m, k, o) and not bool(torch.isfinite(o).all()):
            return False
    return True


def decode(case: Case, frames: Sequence[bytes], hang_s: float = 10.0, device="cpu"):
    """Decode ``frames`` as the exchange does into a float32 accumulator on ``device``;
    returns (outcome, detail, cpu seconds, peak RSS increase in bytes).  outcome:
    "accepted", "nonfinite-flag" (a NONFINITE message: nothing to check), "rejected"
    (WireFormatError), "overflow" (module docstring), "crash", "hang", "shape", "nonfinite".
    Call it from the main thread (the hang alarm is SIGALRM)."""
    n = case.numel
    out = torch.zeros(n, dtype=torch.float32, device=device)
    cpu0, rss0 = _usage()
    msgs = None
    try:
        with _wall_limit(hang_s):
            msgs = [Message.from_bytes(f) if len(f) else None for f in frames]
            finite = _receiver(case.spec).combine(msgs, case.keys, out)
        outcome, detail = "accepted" if finite else "nonfinite-flag", ""
    except WireFormatError as e:
        outcome, detail = "rejected", str(e)
    except _Hang:
        outcome, detail = "hang", f"over {hang_s} s of wall time"
    except Exception as e:  # noqa: BLE001 - what the fuzzer looks for
        tb = traceback.extract_tb(e.__traceback__)[-1]
        outcome = "crash"
        detail = (f"{type(e).__name__}: {str(e)[:160]} "
                  f"({os.path.relpath(tb.filename, ROOT)}:{tb.lineno})")
    cpu1, rss1 = _usage()
    cpu, grew = cpu1 - cpu0, rss1 - rss0
    decoded = outcome in ("accepted", "nonfinite-flag")
    if decoded and (out.shape != (n,) or out.dtype != torch.float32):
        outcome, detail = "shape", f"accumulator became {tuple(out.shape)} {out.dtype}"
    elif outcome == "accepted" and not bool(torch.isfinite(out).all()):
        bad = int((~torch.isfinite(out)).sum())
        if _contributions_finite(case.spec, msgs, case.keys, n, device):
            outcome, detail = "overflow", f"{bad} of {n} sums overflow float32"
        else:
            outcome, detail = "nonfinite", f"{bad} of {n} outputs not finite"
    return outcome, detail, cpu, grew


# ---- the engine --------------------------------------------------------------------------

@dataclasses.dataclass
class Report:
    """Counts per (spec, backend): trials, accepted, rejected, failures by kind with up to
    ``keep`` examples each; the largest CPU time of one decode per (spec, backend), and the
    largest wall time of one trial overall."""
    trials: Counter = dataclasses.field(default_factory=Counter)
    outcomes: Dict[Tuple[str, str], Counter] = dataclasses.field(
        default_factory=lambda: defaultdict(Counter))
    kinds: Counter = dataclasses.field(default_factory=Counter)
    max_cpu: Dict[Tuple[str, str], float] = dataclasses.field(
        default_factory=lambda: defaultdict(float))
    max_wall: float = 0.0
    examples: List[dict] = dataclasses.field(default_factory=list)
    seconds: float = 0.0

    def failures(self) -> List[dict]:
        return [e for e in self.examples if e["outcome"] in FAILURES]

    def failure_count(self) -> int:
        return sum(c[k] for c in self.outcomes.values() for k in FAILURES)


def fuzz(n: int, seed: int = 0, backends: Sequence[str] = ("reference", "kernels"),
         spec_list: Optional[Sequence[str]] = None, cases: Optional[Sequence[Case]] = None,
         slow_s: float = 1.0, memory_bytes: int = 64 << 20, hang_s: float = 10.0,
         keep: int = 3, minutes: Optional[float] = None, device="cpu",
         progress=None) -> Report:
    """Run ``n`` trials (or until ``minutes`` have passed) round-robin over the specs
    (default: :func:`specs`), each on one of ``backends`` in turn, seeded by ``seed``.
    ``cases``: the honest messages (default: :func:`make_cases` of the specs); every case's
    messages are donors for splices, so cases of other specs bring other codecs in.
    ``device``: where the accumulators live ("cuda": the GPU kernels, or the reference on
    CUDA tensors).  Returns a :class:`Report`."""
    rng = np.random.default_rng(seed)
    spec_list = list(spec_list or specs())
    cases = list(cases) if cases is not None else make_cases(spec_list, seed)
    by_spec = defaultdict(list)
    for c in cases:
        by_spec[c.spec].append(c)
    donors = [f for c in cases for f in c.frames if f]
    rep = Report()
    shown = Counter()
    start = time.perf_counter()
    for t in range(n):
        if minutes is not None and time.perf_counter() - start > 60 * minutes:
            break
        spec = spec_list[t % len(spec_list)]
        backend = backends[(t // len(spec_list)) % len(backends)]
        case = by_spec[spec][rng.integers(len(by_spec[spec]))]
        frames = list(case.frames)
        r = int(rng.integers(WORLD))
        frames[r], kind = mutate(rng, frames[r], donors)
        if rng.random() < 0.5:
            frames[r] = _recrc(frames[r])
        t0 = time.perf_counter()
        with use(backend):
            outcome, detail, cpu, grew = decode(case, frames, hang_s, device)
        rep.max_wall = max(rep.max_wall, time.perf_counter() - t0)
        if outcome not in FAILURES and cpu > slow_s:
            outcome, detail = "slow", f"{cpu:.2f} s of CPU time"
        if outcome not in FAILURES and grew > memory_bytes:
            outcome, detail = "memory", f"peak RSS +{grew >> 20} MiB"
        key = (spec, backend)
        rep.trials[key] += 1
        rep.outcomes[key][outcome] += 1
        rep.kinds[kind] += 1
        rep.max_cpu[key] = max(rep.max_cpu[key], cpu)
        if outcome in FAILURES and shown[(spec, outcome, detail[:40])] < keep:
            shown[(spec, outcome, detail[:40])] += 1
            rep.examples.append(dict(spec=spec, backend=backend, shape=case.shape,
                                     dtype=str(case.dtype), kind=kind, rank=r,
                                     outcome=outcome, detail=detail, trial=t))
        if progress is not None and t % 1000 == 999:
            progress(t + 1, rep)
    rep.seconds = time.perf_counter() - start
    return rep


# ---- the long run ------------------------------------------------------------------------

def table(rep: Report) -> str:
    """The per-compressor markdown table of a report."""
    lines = ["| compressor | backend | trials | accepted | rejected | NONFINITE | overflow | "
             + " | ".join(FAILURES) + " | max CPU s |",
             "|---|---|---:|---:|---:|---:|---:|" + "---:|" * len(FAILURES) + "---:|"]
    for key in sorted(rep.trials):
        c = rep.outcomes[key]
        lines.append(f"| `{key[0]}` | {key[1]} | {rep.trials[key]} | {c['accepted']} | "
                     f"{c['rejected']} | {c['nonfinite-flag']} | {c['overflow']} | "
                     + " | ".join(str(c[k]) for k in FAILURES) + f" | {rep.max_cpu[key]:.3f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--messages", type=int, default=1_000_000)
    ap.add_argument("--minutes", type=float, default=None,
                    help="stop after this many minutes even if --messages are not done")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--backends", default="reference,kernels")
    ap.add_argument("--only", default="", help="comma-separated compressor names")
    ap.add_argument("--device", default="cpu", help="where the accumulators live (cpu, cuda)")
    ap.add_argument("--out", default=None, help="markdown report (e.g. bench/results/fuzz.md)")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    spec_list = specs([s for s in a.only.split(",") if s] or None)
    backends = [b for b in a.backends.split(",") if b]

    def progress(done, rep):
        if done % 20000 == 0:
            print(f"{done} trials, {rep.failure_count()} failures, "
                  f"{time.perf_counter() - t0:.0f} s", flush=True)

    t0 = time.perf_counter()
    rep = fuzz(a.messages, a.seed, backends, spec_list, minutes=a.minutes, device=a.device,
               progress=progress)
    total = sum(rep.trials.values())
    fails = rep.failure_count()
    args = argv if argv is not None else sys.argv[1:]
    cmd = ".venv/bin/python bench/fuzz.py " + " ".join(args)
    totals = Counter()
    for c in rep.outcomes.values():
        totals.update(c)
    by_spec = Counter()
    for (spec, _), c in rep.outcomes.items():
        by_spec[spec] += sum(c[k] for k in FAILURES)
    text = ["# Decoder fuzzing (issue #15)", "",
            f"Command: `{cmd.strip()}` ({total} trials in {rep.seconds:.0f} s, one thread, "
            f"torch {torch.__version__}, {os.cpu_count()} cores, accumulators on "
            f"{a.device}).", "",
            f"Outcome: {fails} failures (exceptions other than WireFormatError, decodes over "
            f"1 s of CPU time, hangs, peak memory +64 MiB, wrong accumulator shapes, "
            f"non-finite results of accepted messages); "
            + ", ".join(f"{k} {totals[k]}" for k in ("accepted", "rejected", "nonfinite-flag",
                                                      "overflow") + FAILURES)
            + f".  Longest trial: {rep.max_wall:.3f} s of wall time.", "",
            "Failures by compressor: " + (", ".join(f"`{k}` {v}" for k, v in
                                                    sorted(by_spec.items()) if v) or "none")
            + ".", "",
            "Mutations: " + ", ".join(f"{k} {v}" for k, v in rep.kinds.most_common()) + ".", "",
            table(rep), ""]
    if rep.failures():
        text += ["## Failures (examples)", ""]
        text += [f"* `{e['spec']}` {e['backend']} {e['shape']} {e['dtype']} ({e['kind']} of "
                 f"rank {e['rank']}): {e['outcome']}: {e['detail']}" for e in rep.failures()]
    out = "\n".join(text) + "\n"
    print(out)
    if a.out:
        with open(a.out, "w") as f:
            f.write(out)
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
