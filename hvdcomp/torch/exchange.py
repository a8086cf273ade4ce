"""The gradient exchange behind the drop-in optimizer: fusion buckets, routing, overlap.

One :class:`Exchange` per optimizer.  It owns
  * the fixed order: parameters sorted by name give the tensor ids; fusion buckets are
    filled in reverse registration order (the order backward produces gradients) and are
    always communicated in bucket order, so every rank issues the same collectives in the
    same order whatever order its hooks fire in;
  * the routing: which compressor each tensor uses (non-float, 1-D and small tensors go
    uncompressed by default);
  * three worker threads in a pipeline: as soon as all gradients of a bucket are ready, the
    encoder encodes it, while the communicator has the bucket before on the wire and the
    decoder decodes the one before that, and backward goes on computing earlier layers;
  * per-step statistics (:class:`StepStats`).

Summable tensors (``none``, ``fp16``) travel through Horovod's allreduce when Horovod is
initialized; all others travel as wire messages through the transport's allgather, are
decoded on every rank in rank order and averaged in float32.
"""
from __future__ import annotations

import hashlib
import json
import queue
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from ..auto import Auto
from ..compressors import Compressor, NoneCompressor, TensorKey
from ..compressors.state import finite as all_finite
from ..transport import Transport, error_frame, frame_error, join_frames, split_frames
from ..wire import Message

__all__ = ["Exchange", "StepStats"]

_HVD_ALLREDUCE_DTYPES = (torch.float32, torch.float64, torch.float16)


@dataclass
class StepStats:
    """What one rank sent in one step.

    bytes_sent:   bytes of this rank's encoded payload (wire messages with their headers,
                  plus allreduced buffers), i.e. what it contributes to the collectives.
    fp32_bytes:   4 * elements of every gradient exchanged: the uncompressed fp32 payload.
    ratio:        fp32_bytes / bytes_sent.
    traffic_bytes: estimate of bytes this rank puts on the network with ring algorithms:
                  allgather (N-1)/N of all ranks' messages, allreduce 2(N-1)/N of the buffer.
    compressors:  parameter name -> name of the compressor applied to it.
    nonfinite:    names of tensors that held NaN/Inf on some rank (their average is NaN).
    events:       notable events reported by compressors (e.g. side information too far).
    encode_s, comm_s, decode_s: seconds spent in each phase (summed over buckets; the
                  phases of different buckets overlap in the pipeline).
    """
    step: int = 0
    bytes_sent: int = 0
    fp32_bytes: int = 0
    traffic_bytes: float = 0.0
    compressors: Dict[str, str] = field(default_factory=dict)
    nonfinite: List[str] = field(default_factory=list)
    events: List[str] = field(default_factory=list)
    encode_s: float = 0.0
    comm_s: float = 0.0
    decode_s: float = 0.0

    @property
    def ratio(self) -> float:
        return self.fp32_bytes / self.bytes_sent if self.bytes_sent else float("inf")


@dataclass
class _Entry:
    name: str
    param: torch.Tensor
    tensor_id: int
    compressor: Compressor
    allreduce: bool          # summable and carried by Horovod's allreduce


class Exchange:
    """Averages gradients across ranks with real encoded bytes (see module docstring).

    named_params: [(name, parameter)] in registration order; names unique.
    compression: the compressor for tensors that qualify; ``none`` for the rest; or an
      :class:`hvdcomp.Auto`, which picks fp32, fp16 or its compressor per qualifying tensor
      from measured costs (collectives on every rank: all ranks construct together).
    transport: carrier of the allgather path; hvd: the horovod.torch module or None.
    """

    def __init__(self, named_params: Sequence[Tuple[str, torch.Tensor]],
                 compression: Compressor, transport: Transport, *, hvd=None,
                 fusion_bytes: int = 25 * 2**20, min_compress_numel: int = 1024,
                 compress_1d: bool = False, seed: int = 0, average: bool = True,
                 predivide: float = 1.0, allreduce_summable: bool = True):
        names = [n for n, _ in named_params]
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})
            raise ValueError(f"parameter names must be unique, repeated: {dup}")
        if fusion_bytes < 1:
            raise ValueError("fusion_bytes must be >= 1")
        auto = None
        if isinstance(compression, Auto):
            auto, compression = compression, compression.compressor
        self.compression = compression
        self.auto = auto
        self.transport = transport
        self.hvd = hvd
        self.rank, self.size = transport.rank, transport.size
        self.seed = int(seed) & 0xFFFFFFFF
        self.average = average
        self.predivide = float(predivide)
        self._none = NoneCompressor()
        order = {n: i for i, n in enumerate(sorted(names))}
        plan = {}
        if auto is not None:     # the cost model's choice for every tensor we would compress
            sizes = {n: p.numel() for n, p in named_params
                     if self._route(p, compression, min_compress_numel, compress_1d)
                     is compression}
            # agree on the settings before measuring: the measurements are collectives
            self._agree(json.dumps([auto.settings(), hvd is not None, allreduce_summable,
                                    sorted(sizes.items())]), "the Auto settings")
            dev = next((p.device for n, p in named_params if n in sizes), None)
            plan = auto.make_plan(sizes, transport, hvd if allreduce_summable else None,
                                  device=dev)
        self.entries: Dict[str, _Entry] = {}
        for name, p in named_params:
            comp = plan.get(name) or self._route(p, compression, min_compress_numel,
                                                 compress_1d)
            ar = (allreduce_summable and hvd is not None and comp.summable
                  and _wire_dtype(comp, p.dtype) in _HVD_ALLREDUCE_DTYPES)
            self.entries[name] = _Entry(name, p, order[name], comp, ar)
        # Fusion buckets in backward order.
        self.buckets: List[List[str]] = []
        cur, cur_bytes = [], 0
        for name, p in reversed(list(named_params)):
            cur.append(name)
            cur_bytes += p.numel() * p.element_size()
            if cur_bytes >= fusion_bytes:
                self.buckets.append(cur)
                cur, cur_bytes = [], 0
        if cur:
            self.buckets.append(cur)
        self.bucket_of = {n: k for k, b in enumerate(self.buckets) for n in b}
        self._handshake()
        # CUDA parameters: encoded and decoded by the GPU kernels on the parameter's device;
        # the messages (compressed bytes) cross to the host for the collective.
        self.cuda_aware = None
        if any(p.is_cuda for _, p in named_params):
            from ..transport.mpi import cuda_aware
            self.cuda_aware = cuda_aware()
            if self.rank == 0:
                print(f"hvdcomp: CUDA parameters; MPI CUDA-aware: "
                      f"{ {True: 'yes', False: 'no', None: 'unknown'}[self.cuda_aware] }; "
                      f"compressed messages are staged through host memory", file=sys.stderr,
                      flush=True)
        self._accs: Dict[str, torch.Tensor] = {}
        self._error_lock = threading.Lock()
        self._q: "queue.Queue" = queue.Queue()
        self._cq: "queue.Queue" = queue.Queue()
        self._dq: "queue.Queue" = queue.Queue()
        self._threads: List[threading.Thread] = []
        self._reset(0)

    # --- set-up ---------------------------------------------------------------------
    @staticmethod
    def _route(p, compression, min_numel, compress_1d) -> Compressor:
        if not p.is_floating_point():
            return NoneCompressor()
        if p.dim() <= 1 and not compress_1d:
            return NoneCompressor()
        if p.numel() < min_numel:
            return NoneCompressor()
        return compression

    def _handshake(self) -> None:
        """Refuse to start if ranks disagree on the model, the routing or the settings
        (they would otherwise issue mismatched collectives or decode garbage)."""
        desc = json.dumps([self.seed, self.average, self.predivide, self.compression.spec(),
                           self.buckets,
                           [(e.name, list(e.param.shape), str(e.param.dtype), e.compressor.spec(),
                             e.allreduce) for e in self.entries.values()]])
        self._agree(desc, "the parameters (names, shapes, dtypes), the compressor settings "
                          "or the seed")

    def _agree(self, desc: str, what: str) -> None:
        """Allgather a digest of ``desc``; every rank raises RuntimeError if any differs."""
        digest = np.frombuffer(hashlib.sha256(desc.encode()).digest(), dtype=np.uint8)
        got = self.transport.allgather(digest)
        bad = [r for r, d in enumerate(got) if not np.array_equal(d, digest)]
        if bad:
            raise RuntimeError(
                f"hvdcomp: ranks {bad} disagree with rank {self.rank} on {what}; every rank "
                f"must build the same model and optimizer. This rank has: {desc[:2000]}")

    def _start(self) -> None:
        if not self._threads:
            self._threads = [threading.Thread(target=fn, name=f"hvdcomp-{name}", daemon=True)
                             for fn, name in ((self._worker, "encode"),
                                              (self._comm_worker, "communicate"),
                                              (self._decode_worker, "decode"))]
            for t in self._threads:
                t.start()

    # --- per step -------------------------------------------------------------------
    def _reset(self, step: int) -> None:
        self.step = step
        self._pending = {k: len(b) for k, b in enumerate(self.buckets)}
        self._submitted = set()
        self._results: Dict[str, torch.Tensor] = {}
        self._done = threading.Event()
        self._error: Optional[BaseException] = None
        self._stats = StepStats(step=step)
        self._active = False

    def begin(self, step: int) -> None:
        """Start a step (called on the first ready gradient or by ``finish``)."""
        self._reset(step)
        self._active = True
        if not self.buckets:                  # no trainable parameters: nothing to exchange
            self._done.set()
        self._start()
        self._q.put(("step", step))

    def ready(self, name: str) -> None:
        """The gradient of ``name`` is final for this step; submit its bucket when complete."""
        if not self._active:
            raise RuntimeError("ready() outside a step: call begin(step) first")
        k = self.bucket_of[name]
        self._pending[k] -= 1
        if self._pending[k] == 0:
            self._submit(k)

    def _submit(self, k: int) -> None:
        if k not in self._submitted:
            self._submitted.add(k)
            self._q.put(("bucket", k))

    def finish(self) -> Tuple[Dict[str, torch.Tensor], StepStats]:
        """Submit what is left (gradients never produced count as zeros), wait, and return
        {name: averaged gradient (float32, flat)} and the step's statistics.  The averaged
        gradients of compressed tensors live in buffers that the next step reuses: copy
        what you keep (the optimizer copies them into ``p.grad``).
        Re-raises any error of the worker (e.g. WireFormatError) on the calling thread."""
        if not self._active:
            raise RuntimeError("finish() outside a step")
        for k in range(len(self.buckets)):
            self._submit(k)
        self._done.wait()
        self._active = False
        if self._error is not None:
            err, self._error = self._error, None
            raise err
        return self._results, self._stats

    def close(self) -> None:
        """Stop the worker threads (they hold this exchange, its buffers and its compressors'
        state until then).  Call between steps; the exchange cannot be used afterwards."""
        if self._active:
            raise RuntimeError("close() during a step: call finish() first")
        if self._threads:
            self._q.put(("stop", None))     # passed down the pipeline, each thread exits
            for t in self._threads:
                t.join()
            self._threads = []
        self._accs.clear()
        self._results = {}

    # --- workers --------------------------------------------------------------------
    # Three threads form a pipeline: the encoder takes buckets in the fixed order as they
    # become ready and encodes them; the communicator puts bucket k on the wire while the
    # encoder works on bucket k+1 (and backward on the layers before) and the decoder decodes
    # and averages bucket k-1.  Kernels, MPI and PyTorch release the GIL while they work.
    def _worker(self) -> None:
        ready, nxt, step = set(), 0, 0
        while True:
            kind, val = self._q.get()
            if kind == "step":
                ready, nxt, step = set(), 0, val
                continue
            if kind == "stop":
                self._cq.put((None, "stop"))
                return
            ready.add(val)
            # Fixed bucket order on every rank: wait for bucket `nxt` even if later ones
            # are ready first.
            while nxt in ready:
                # Always encode, even after an error elsewhere: whether this rank joins the
                # bucket's collectives must never depend on another thread's timing (an
                # encoder error inside the bucket becomes an error frame, so every rank
                # still takes part and every rank raises it).
                job = None
                try:
                    job = self._encode_bucket(nxt, step)
                except BaseException as e:      # surfaced by finish()
                    self._set_error(e)
                self._cq.put((nxt, job))
                nxt += 1

    def _comm_worker(self) -> None:
        while True:
            k, job = self._cq.get()
            if k is None:
                self._dq.put((None, None, None))
                return
            frames = None
            if job is not None:                 # every bucket goes on the wire (see above)
                try:
                    frames = self._communicate(k, job)
                except BaseException as e:      # surfaced by finish()
                    self._set_error(e)
                    job = None                  # nothing to decode
            self._dq.put((k, job, frames))

    def _decode_worker(self) -> None:
        while True:
            k, job, frames = self._dq.get()
            if k is None:
                return
            if job is not None and self._error is None:
                try:                            # local work only: may stop after an error
                    self._decode(k, job, frames)
                except BaseException as e:      # surfaced by finish()
                    self._set_error(e)
            if k == len(self.buckets) - 1:
                self._done.set()

    def _set_error(self, e: BaseException) -> None:
        """Keep the first error of the step (the one finish() raises)."""
        with self._error_lock:
            if self._error is None:
                self._error = e

    def _grad(self, e: _Entry) -> torch.Tensor:
        g = e.param.grad
        if g is None:
            g = torch.zeros_like(e.param)
        if g.is_sparse:
            g = g.to_dense()
        if self.predivide != 1.0:
            g = g / self.predivide
        return g

    def _key(self, e: _Entry, rank: int) -> TensorKey:
        return TensorKey(e.name, e.tensor_id, self.step, rank, self.size, self.seed)

    def _encode_bucket(self, k: int, step: int) -> dict:
        """Encoder stage: launch the allreduce of summable tensors, encode the others into
        one frame.  An encoder error still becomes a frame (an error frame), so every rank
        takes part in the allgather and every rank raises it instead of waiting forever."""
        st = self._stats
        ents = [self.entries[n] for n in self.buckets[k]]
        ar = [e for e in ents if e.allreduce]
        ag = [e for e in ents if not e.allreduce]
        for e in ents:
            st.compressors[e.name] = e.compressor.name
            st.fp32_bytes += 4 * e.param.numel()
        t0 = time.perf_counter()
        handles = []
        by_dtype: Dict[torch.dtype, List[_Entry]] = {}
        for e in ar:
            by_dtype.setdefault(_wire_dtype(e.compressor, e.param.dtype), []).append(e)
        for dt, es in by_dtype.items():
            flat, groups = self._flatten_summable(es, dt)
            h = self.hvd.allreduce_async_(flat, name=f"hvdcomp.ar.{k}.{str(dt)[6:]}",
                                          op=self.hvd.Sum)
            handles.append((h, flat, groups))
        frame, failed = None, None
        if ag:
            try:
                msgs = []
                for e in ag:
                    g = self._grad(e)
                    comp = e.compressor
                    if (comp.wants_stats(step) and g.is_floating_point()
                            and all_finite(g)):
                        comp.observe(g)
                    m = comp.encode(g, self._key(e, self.rank))
                    msgs.append(b"" if m is None else m.to_bytes())   # None: skipped upload
                frame = join_frames(msgs)
            except Exception as exc:          # noqa: BLE001 - re-raised on all ranks
                failed = exc
                frame = error_frame(f"{type(exc).__name__}: {exc}")
        st.encode_s += time.perf_counter() - t0
        return {"ag": ag, "frame": frame, "failed": failed, "handles": handles}

    def _communicate(self, k: int, job: dict):
        """Communicator stage: allgather the frame and wait for the allreduce; returns every
        rank's frame (None without an allgather part)."""
        st = self._stats
        ag, frame, handles = job["ag"], job["frame"], job["handles"]
        t1 = time.perf_counter()
        for _, flat, _ in handles:
            nbytes = flat.numel() * flat.element_size()
            st.bytes_sent += nbytes
            st.traffic_bytes += 2 * (self.size - 1) / self.size * nbytes
        frames = None
        if ag:
            frames = self.transport.allgather(frame)
            st.bytes_sent += len(frame)
            st.traffic_bytes += (self.size - 1) / self.size * sum(len(f) for f in frames)
        for h, _, _ in handles:
            self.hvd.synchronize(h)
        if ag:
            errors = [(r, frame_error(f)) for r, f in enumerate(frames)]
            errors = [(r, t) for r, t in errors if t is not None]
            if errors:
                if job["failed"] is not None:
                    raise job["failed"]
                r, text = errors[0]
                raise RuntimeError(f"hvdcomp: rank {r} failed to encode bucket {k} "
                                   f"(tensors {[e.name for e in ag]}): {text}")
        st.comm_s += time.perf_counter() - t1
        return frames

    def _decode(self, k: int, job: dict, frames) -> None:
        """Decoder stage: decode every rank's messages in rank order and average."""
        st = self._stats
        ag, handles = job["ag"], job["handles"]
        t2 = time.perf_counter()
        for _, flat, groups in handles:
            self._unflatten_summable(flat, groups)
        if ag:
            per_rank = [split_frames(f, len(ag)) for f in frames]
            for i, e in enumerate(ag):
                acc = self._accumulator(e)
                msgs = [Message.from_bytes(per_rank[r][i]) if len(per_rank[r][i]) else None
                        for r in range(self.size)]
                keys = [self._key(e, r) for r in range(self.size)]
                finite = e.compressor.combine(msgs, keys, acc)
                st.events.extend(f"{e.name}: {ev}" for ev in e.compressor.drain_events())
                self._finish_tensor(e, acc, finite)
        st.decode_s += time.perf_counter() - t2

    def _accumulator(self, e: _Entry) -> torch.Tensor:
        """A zeroed float32 accumulator for ``e``, reused from step to step: a fresh
        gradient-sized allocation every step costs a page fault per 4 KiB."""
        acc = self._accs.get(e.name)
        if acc is None or acc.device != e.param.device:
            acc = torch.zeros(e.param.numel(), dtype=torch.float32, device=e.param.device)
            self._accs[e.name] = acc
        else:
            acc.zero_()
        return acc

    def _finish_tensor(self, e: _Entry, acc: torch.Tensor, finite: bool) -> None:
        if finite:
            e.compressor.finalize(acc, self._key(e, self.rank))
            if not self.average:
                acc.mul_(self.size)
            if self.predivide != 1.0:
                acc.mul_(self.predivide)
            finite = all_finite(acc)
        if not finite:
            # NaN policy: a tensor that was non-finite on any rank is NaN on every rank.
            acc.fill_(float("nan"))
            self._stats.nonfinite.append(e.name)
        self._results[e.name] = acc

    def _flatten_summable(self, ents: List[_Entry], dt: torch.dtype):
        parts, groups = [], []
        for e in ents:
            x = self._grad(e).reshape(-1).to(torch.float32)
            if e.compressor.prescaled:
                x = x / self.size           # divide before the cast so sums cannot overflow
            parts.append(x.to(dt))
            groups.append((e, x.numel()))
        return torch.cat(parts), groups

    def _unflatten_summable(self, flat: torch.Tensor, groups) -> None:
        off = 0
        for e, n in groups:
            acc = flat[off:off + n].to(torch.float32).clone()
            off += n
            self._finish_tensor(e, acc, True)


def _wire_dtype(comp: Compressor, dtype: torch.dtype) -> torch.dtype:
    # none is allreduced in float32 (averages are float32 everywhere in hvdcomp)
    return getattr(comp, "wire_dtype", torch.float32)
