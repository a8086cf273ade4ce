"""Bucketed, normalized, unbiased stochastic quantizers: QSGD, QSGDinf, NUQSGD, ALQ, AMQ.

Source: Faghri et al., "Adaptive Gradient Quantization for Data-Parallel SGD", NeurIPS 2020
(arXiv 2010.12460), Sec. 2 (the family, Eq. 1-2) and Sec. 3 (ALQ, AMQ); QSGD: Alistarh et
al., NeurIPS 2017; NUQSGD: Ramezani-Kebrya et al., JMLR 2021.

Per bucket of ``bucket_size`` coordinates of the flattened gradient v (hvdcomp.ops.quantize
computes it, on the kernels or in PyTorch):
    norm  = ||v||_2 (QSGDinf: ||v||_inf)
    r_i   = |v_i| / norm in [0, 1]
    r_i in [l_j, l_{j+1}] is sent as l_{j+1} with probability (r_i - l_j) / (l_{j+1} - l_j),
    else l_j; the uniform number is Philox(seed, rank | tensor_id, step, index i).
    E[Q(v_i)] = v_i;  Var[Q(v_i)] = norm^2 (l_{j+1} - r_i)(r_i - l_j).

Wire sections (see docs/wire-format.md):
    0: bucket norms, float32, ceil(numel / bucket_size) values
    1: codes, ``bits`` per coordinate packed LSB-first (hvdcomp.ops.bitpack), or
       rANS-coded with flag ENTROPY (hvdcomp.codecs.sections):
       code = sign << (bits - 1) | level index; sign = 1 for v_i < 0.
So a message costs numel * bits / 8 + 4 * ceil(numel / bucket_size) bytes plus its header.
"""
from __future__ import annotations

import threading

import numpy as np
import torch

from .. import levels as L
from ..ops.bitpack import packed_size
from ..codecs.sections import read_codes, write_codes
from ..errors import WireFormatError
from ..ops import level_stats, quantize
from ..wire import FLAG_NONFINITE, Message, dtype_code
from . import settings
from .base import Compressor, numel_of, register
from .protocols import AdaptiveLevels
from .state import finite

__all__ = ["BucketQuantizer", "QSGD", "QSGDInf", "NUQSGD", "ALQ", "AMQ", "Finer", "FINER_BITS"]

FINER_BITS = 2      # extra bits of the reduce-scatter's second stage (BucketQuantizer.second_stage)


def _check_float(grad: torch.Tensor, name: str) -> None:
    if not grad.is_floating_point():
        raise TypeError(f"{name} quantizes floating-point gradients only, got {grad.dtype}")


class BucketQuantizer(Compressor):
    """Shared machinery of the family; subclasses choose the norm and the level table.

    Args:
      bits: bits per coordinate on the wire, sign included (int, 2..8): 2**(bits-1) levels.
      bucket_size: coordinates per bucket (int, 1..2**31; each bucket sends one float32 norm).
      entropy: rANS-code the codes with a model carried in the message (flag ENTROPY;
        hvdcomp.ops.rans) instead of packing them at ``bits`` each.
    Raises ValueError for values out of range, TypeError for bits or bucket_size that are
    not ints (a spec string's values are converted by hvdcomp.get).

    encode(grad, key): grad of any shape and layout, floating dtype (quantized from its
      float32 values); TypeError for other dtypes.  A gradient holding NaN/Inf, or whose L2
      norm overflows float32, is sent as a NONFINITE message.
    decode / combine: add ``sign * norm * levels[index]`` (float32) into ``out``, every
      rank's message in rank order; WireFormatError for a wrong header, wrong section sizes
      or norms that are negative or not finite.
    """
    norm = "l2"

    def __init__(self, bits: int = 3, bucket_size: int = 8192, entropy: bool = False):
        self.bits = settings.integer("bits", bits, 2, 8)
        self.bucket_size = settings.integer("bucket_size", bucket_size, 1, 2**31)
        self.entropy = settings.boolean("entropy", entropy)
        self.levels = torch.tensor(self.initial_levels(), dtype=torch.float32)
        self.level_version = 0

    def initial_levels(self) -> np.ndarray:
        raise NotImplementedError

    def shard_unit(self, shape) -> int:
        """A quantization bucket: every bucket of a piece quantizes exactly the coordinates
        it would in the whole tensor (hvdcomp.exchange.shards)."""
        return self.bucket_size

    def second_stage(self) -> Compressor:
        """Below 8 bits, a :class:`Finer` of this quantizer at ``min(bits + FINER_BITS, 8)``
        (hvdcomp.exchange.shards explains why); at 8 bits this quantizer itself."""
        return Finer(self, min(self.bits + FINER_BITS, 8)) if self.bits < 8 else self

    def _header_fields(self):
        return {"bits": self.bits, "bucket_size": self.bucket_size,
                "level_version": self.level_version}

    def message_bytes(self, shape) -> int:
        """Payload bytes (header excluded) for a tensor of ``shape`` (or ``numel``
        coordinates), fixed-length codes."""
        numel = numel_of(shape)
        nb = (numel + self.bucket_size - 1) // self.bucket_size
        return 4 * nb + packed_size(numel, self.bits)

    def _encode(self, grad, key):
        _check_float(grad, self.name)
        x = grad.detach().reshape(-1).to(torch.float32)
        norms, packed = quantize.quantize(x, self.levels.to(x.device), self.bits,
                                          self.bucket_size, self.norm, seed=key.seed,
                                          rank=key.rank, tensor_id=key.tensor_id, step=key.step)
        if not finite(norms):
            # finite values whose L2 norm overflows float32: the NaN policy, not an Inf norm
            return self._nonfinite(grad, key)
        return self._message(grad, key, norms, packed)

    def encode_pieces(self, grad, spans, keys):
        """All pieces in one call (``Compressor.encode_pieces``, the same bytes as one
        ``encode`` each): the bucket norms of the whole gradient and one
        ``quantize_pack_pieces`` launch (each piece starts on a bucket boundary, as the
        reduce-scatter cuts them, so its norms are the whole tensor's).  Falls back to one
        ``encode`` per piece for a subclass that encodes its own way (TernGrad), where a
        piece starts off a bucket boundary, where the keys differ in seed, rank or step,
        and where the gradient is not finite or a norm overflows (the NaN policy is per
        piece)."""
        if len(spans) != len(keys):
            raise ValueError(f"{len(spans)} pieces but {len(keys)} keys")
        if (type(self)._encode is not BucketQuantizer._encode
                or type(self).encode is not Compressor.encode):  # a subclass's own encoding
            return super().encode_pieces(grad, spans, keys)
        _check_float(grad, self.name)
        bs = self.bucket_size
        spans = [(int(lo), int(hi)) for lo, hi in spans]
        if (not keys or any(hi > lo and lo % bs for lo, hi in spans)
                or any((k.seed, k.rank, k.step) != (keys[0].seed, keys[0].rank, keys[0].step)
                       for k in keys)):
            return super().encode_pieces(grad, spans, keys)
        x = grad.detach().reshape(-1).to(torch.float32)
        if not finite(x):
            return super().encode_pieces(grad, spans, keys)
        norms = quantize.bucket_norms(x, bs, self.norm)
        if not finite(norms):
            return super().encode_pieces(grad, spans, keys)
        k0 = keys[0]
        packed = quantize.quantize_pack_pieces(
            x, norms, self.levels.to(x.device), self.bits, bs, spans,
            [k.tensor_id for k in keys], seed=k0.seed, rank=k0.rank, step=k0.step)
        offsets, _ = quantize.piece_offsets(spans, self.bits, bs)
        norm_bytes = norms.cpu().numpy().view(np.uint8)
        codes_np = None if self.entropy else packed.cpu().numpy()
        dtype, fields = dtype_code(grad.dtype), self._header_fields()
        msgs = []
        for j, ((lo, hi), k) in enumerate(zip(spans, keys)):
            if codes_np is None:
                codes, flags = write_codes(packed[offsets[j]:offsets[j + 1]], hi - lo,
                                           self.bits, True)
            else:
                codes, flags = codes_np[offsets[j]:offsets[j + 1]], 0
            first = lo // bs                    # lo is on a bucket boundary (or hi == lo)
            nm = norm_bytes[4 * first:4 * (first + (hi - lo + bs - 1) // bs)]
            shape = (hi - lo,) if k.shape is None else tuple(k.shape)
            msgs.append(Message(codec=self.codec, dtype=dtype, shape=shape,
                                sections=(nm, codes), flags=flags, tensor_id=k.tensor_id,
                                rank=k.rank, seed=k.seed, step=k.step, **fields))
        return msgs

    def decode_pieces(self, msgs, keys, spans, out):
        """All pieces in one call (``Compressor.decode_pieces``, the same bits as one
        ``decode`` each): every header checked, the norms of all pieces checked at once,
        one ``dequantize_add_pieces`` launch.  Falls back to one ``decode`` per piece for
        a subclass that decodes its own way, entropy-coded messages, and an accumulator
        that is not a contiguous 1-D float32 tensor."""
        if not len(msgs) == len(keys) == len(spans):
            raise ValueError(f"{len(msgs)} messages, {len(keys)} keys, {len(spans)} spans")
        if (type(self)._decode is not BucketQuantizer._decode or self.entropy
                or out.dtype != torch.float32 or out.dim() != 1 or not out.is_contiguous()):
            return super().decode_pieces(msgs, keys, spans, out)
        all_finite, kept, norms, codes = self._read_many(msgs, keys,
                                                         [hi - lo for lo, hi in spans])
        if kept:
            dev = out.device
            quantize.dequantize_add_pieces(codes.to(dev), norms.to(dev), self.levels.to(dev),
                                           self.bits, self.bucket_size,
                                           [spans[j] for j in kept], out)
        return all_finite

    def _read_many(self, msgs, keys, numels):
        """(all finite, kept, norms, codes) of several fixed-length messages (``numels[j]``
        coordinates each), every header and section size checked (``_expect_header``, as
        ``decode`` does): ``kept`` the indices of the messages that are not NONFINITE,
        ``norms`` (float32) and ``codes`` (uint8) their sections end to end on the CPU, the
        norms checked once for all (finite, >= 0).  Raises WireFormatError."""
        bs, bits = self.bucket_size, self.bits
        all_finite, norms, codes, kept = True, [], [], []
        for j, (msg, key, n) in enumerate(zip(msgs, keys, numels)):
            self._require_message(msg, key)
            self._expect_header(msg, key, n)
            if msg.flags & FLAG_NONFINITE:
                all_finite = False
                continue
            msg.expect(nsections=2)
            msg.section_size_check(0, 4 * ((n + bs - 1) // bs), "norms")
            msg.section_size_check(1, packed_size(n, bits), "codes")
            norms.append(msg.sections[0])
            codes.append(msg.sections[1])
            kept.append(j)
        if not kept:
            return all_finite, kept, None, None
        nm = torch.from_numpy(np.concatenate(norms).view(np.float32))
        if not finite(nm) or bool((nm < 0).any()):
            raise WireFormatError(f"{self.name}: bucket norms must be finite and >= 0")
        return all_finite, kept, nm, torch.from_numpy(np.concatenate(codes))

    def _message(self, grad, key, norms: torch.Tensor, packed: torch.Tensor) -> Message:
        """The message of the float32 bucket ``norms`` and the codes ``packed`` at ``bits``
        each (uint8), on any device."""
        codes, flags = write_codes(packed, grad.numel(), self.bits, self.entropy)
        return self._new_message(grad, key, (norms.cpu().numpy().view(np.uint8), codes), flags)

    def _read(self, msg: Message, device):
        """(norms, packed codes) of a message whose header is validated, on ``device``."""
        n = msg.numel
        nb = (n + self.bucket_size - 1) // self.bucket_size
        msg.expect(nsections=2)
        msg.section_size_check(0, 4 * nb, "norms")
        norms = torch.from_numpy(np.array(msg.sections[0]).view(np.float32))
        if not finite(norms) or bool((norms < 0).any()):
            raise WireFormatError(f"{self.name}: bucket norms must be finite and >= 0")
        return norms.to(device), read_codes(msg, 1, n, self.bits, device=device)

    def _decode(self, msg, key, out):
        norms, packed = self._read(msg, out.device)
        quantize.dequantize_add(packed, msg.numel, norms, self.levels.to(out.device), self.bits,
                                self.bucket_size, out)

    def combine(self, msgs, keys, out):
        """Every rank's message added in rank order, as the base class does, in one pass
        over ``out`` (quantize.dequantize_add_many): the same additions in the same order,
        so the same bits.  A subclass that decodes its own way keeps the base class's
        message-by-message combine."""
        if type(self)._decode is not BucketQuantizer._decode:
            return super().combine(msgs, keys, out)
        n, dev = out.numel(), out.device
        if self.entropy:                        # codes rANS-decoded message by message
            all_finite, norms, packed = True, [], []
            for msg, key in zip(msgs, keys):
                self._require_message(msg, key)
                if self._check_header(msg, key, out):
                    nm, pk = self._read(msg, dev)
                    norms.append(nm)
                    packed.append(pk)
                else:
                    all_finite = False
        else:                                   # the sections of all, checked at once
            all_finite, kept, nm, pk = self._read_many(msgs, keys, [n] * len(msgs))
            nb, m = (n + self.bucket_size - 1) // self.bucket_size, packed_size(n, self.bits)
            nm = None if nm is None else nm.to(dev)
            pk = None if pk is None else pk.to(dev)
            norms = [nm[j * nb:(j + 1) * nb] for j in range(len(kept))]
            packed = [pk[j * m:(j + 1) * m] for j in range(len(kept))]
        quantize.dequantize_add_many(packed, n, norms, self.levels.to(dev), self.bits,
                                     self.bucket_size, out)
        return all_finite

    def variance(self, grad: torch.Tensor) -> float:
        """The exact variance sum_i E|Q(v_i) - v_i|^2 of quantizing ``grad`` (Eq. 2), given
        the bucket norms encode computes."""
        x = grad.detach().reshape(-1).to(torch.float32).cpu()
        n = x.numel()
        if n == 0:
            return 0.0
        norms = quantize.bucket_norms(x, self.bucket_size, self.norm).double()
        per_coord = norms.repeat_interleave(self.bucket_size)[:n]
        r = x.abs().double() / torch.where(per_coord > 0, per_coord, 1)
        return L.empirical_variance(r.numpy(), (per_coord ** 2).numpy(),
                                    self.levels.double().numpy())

    def state_dict(self):
        return {"levels": [float(v) for v in self.levels], "level_version": self.level_version}

    def load_state_dict(self, state):
        lv = torch.tensor(state["levels"], dtype=torch.float32)
        if lv.numel() != L.num_levels(self.bits):
            raise ValueError(f"{self.name}: saved table has {lv.numel()} levels, "
                             f"{self.bits} bits need {L.num_levels(self.bits)}")
        self.levels = lv
        self.level_version = int(state["level_version"])


@register("qsgd", codec=10)
class QSGD(BucketQuantizer):
    """QSGD: L2 bucket norm, uniform levels {0, 1/s, ..., 1} (Alistarh et al., 2017)."""
    example = "qsgd:bits=4,bucket_size=512"

    def initial_levels(self):
        return L.uniform_levels(self.bits)


@register("qsgdinf", codec=11)
class QSGDInf(BucketQuantizer):
    """QSGDinf: L-inf bucket norm, uniform levels (Faghri et al., 2020, Sec. 2)."""
    example = "qsgdinf:bits=3,bucket_size=100"
    norm = "linf"

    def initial_levels(self):
        return L.uniform_levels(self.bits)


@register("nuqsgd", codec=12)
class NUQSGD(BucketQuantizer):
    """NUQSGD: L2 bucket norm, exponential levels {0, 1/2^(s-1), ..., 1/2, 1}."""
    example = "nuqsgd:bits=2,bucket_size=1000"

    def initial_levels(self):
        return L.exponential_levels(self.bits, 0.5)


class _Adaptive(AdaptiveLevels, BucketQuantizer):
    """Levels fitted during training from the gradients themselves (ALQ / AMQ).

    refit_steps, refit_every: the table is refitted before the listed steps (ints >= 1) and
    before every multiple of ``refit_every`` (int >= 0, 0: never; the authors' schedule: 100
    and 2000, then every 10000).
    model: "hist" (binned statistics, default) or "normal" (the paper's truncated normal);
    see hvdcomp.levels.  norm: "l2" (the paper's setting) or "linf" (bucket max, as QSGDinf:
    with few bits it makes the top level usable).
    The statistics are those of the step just before; each rank computes them from its own
    gradients while encoding (hvdcomp.ops.level_stats), the optimizer sums them across ranks,
    rank 0 fits, and the new table is broadcast, so every rank holds an identical table with
    a new version number.
    """
    keeps_state = True          # the fitted levels and their version
    shared_state = ("levels", "level_version")   # one table, broadcast by rank 0

    def __init__(self, bits: int = 3, bucket_size: int = 8192, entropy: bool = False,
                 refit_steps: tuple = (100, 2000), refit_every: int = 10000,
                 model: str = "hist", norm: str = "l2"):
        super().__init__(bits, bucket_size, entropy)
        self.refit_steps = settings.int_tuple("refit_steps", refit_steps, 1)
        self.refit_every = settings.integer("refit_every", refit_every, 0)
        self.model = settings.choice("model", model, ("hist", "normal"))
        self.norm = settings.choice("norm", norm, ("l2", "linf"))
        self._stats = self.empty_stats()
        self._observed = False

    def empty_stats(self) -> np.ndarray:
        """Zero statistics of the right size (3 for the normal model, 768 binned)."""
        return np.zeros(3 if self.model == "normal" else 3 * level_stats.HIST_BINS)

    def statistics(self, grad: torch.Tensor) -> np.ndarray:
        """This gradient's contribution to the fit (summable across tensors and ranks):
        float64 NumPy (3,) for model "normal" (hvdcomp.ops.level_stats.bucket_stats),
        (768,) for "hist" (hvdcomp.ops.level_stats.histogram_stats)."""
        x = grad.detach().reshape(-1).float()
        fn = (level_stats.bucket_stats if self.model == "normal"
              else level_stats.histogram_stats)
        return fn(x, self.bucket_size, self.norm).cpu().numpy()

    def initial_levels(self):
        return L.exponential_levels(self.bits, 0.5)

    def is_refit_step(self, step: int) -> bool:
        return step in self.refit_steps or (self.refit_every > 0 and step > 0
                                            and step % self.refit_every == 0)

    def wants_stats(self, step: int) -> bool:
        return self.is_refit_step(step + 1)

    def observe(self, grad):
        self._stats = self._stats + self.statistics(grad)
        self._observed = True

    def pending_stats(self):
        if not self._observed:
            return None
        s, self._stats, self._observed = self._stats, self.empty_stats(), False
        return s

    def update(self, summed_stats, step):
        return self.fit(summed_stats).astype(np.float32)

    def fit_size(self) -> int:
        return L.num_levels(self.bits)

    def adopt(self, payload):
        lv = torch.from_numpy(np.asarray(payload, dtype=np.float32).copy())
        if lv.numel() != L.num_levels(self.bits) or not bool((lv[1:] > lv[:-1]).all()):
            raise ValueError(f"{self.name}: invalid level table {lv.tolist()}")
        self.levels = lv
        self.level_version += 1

    def fit(self, summed_stats) -> np.ndarray:
        """The level table (float64) fitted to the rank-summed statistics."""
        raise NotImplementedError


@register("alq", codec=13)
class ALQ(_Adaptive):
    """ALQ: levels fitted by coordinate descent on the expected variance (Faghri et al.,
    NeurIPS 2020, Sec. 3.1).  Starts from NUQSGD's table until the first refit."""
    example = "alq:bits=3,bucket_size=512,refit_steps=2,refit_every=3"

    def fit(self, summed_stats):
        return L.fit_alq(summed_stats, self.bits)


@register("amq", codec=14)
class AMQ(_Adaptive):
    """AMQ: exponential levels whose multiplier p is fitted to the expected variance
    (Faghri et al., NeurIPS 2020, Sec. 3.2).  Starts from p = 0.5."""
    example = "amq:bits=3,bucket_size=512,refit_steps=1,refit_every=0"

    def fit(self, summed_stats):
        return L.fit_amq(summed_stats, self.bits)


class Finer(Compressor):
    """``base`` (QSGD, QSGDinf, NUQSGD, ALQ or AMQ) at ``bits`` > base's: the
    reduce-scatter's second stage (:meth:`BucketQuantizer.second_stage`).  Its
    table, with base's level version:

    * while base holds its initial table (QSGD, QSGDinf and NUQSGD always; ALQ and AMQ
      before their first refit): the family's own table at ``bits`` (uniform, or
      exponential with p = 1/2), which holds base's table;
    * once base holds another one (fitted, or loaded from a checkpoint): base's table
      refined (:func:`hvdcomp.levels.refine`: each interval cut into equal parts,
      ``2**(bits-1)`` levels in all).

    Either way every level of base's table is in it, so each coordinate's variance is at
    most base's (Eq. 2), and it is unbiased as base is.  Why two rules: on real FC-300-100
    gradients (bench/second_stage.py: 4 and 8 ranks of batch 32, the second stage
    quantizing the average of the first stage's ALQ 3-bit messages), NUQSGD's 5-bit table
    gave the second stage 0.30-0.74 ||mean g||^2 of variance against 0.77-3.2 for the
    refined {0, 1/4, 1/2, 1} (normalized magnitudes crowd below 1/20, where the
    exponential table has 10 levels and the refined one a single interval), and once ALQ
    had fitted its 3-bit table, the refined table gave 0.026-0.035 against 0.023-0.068 for
    an ALQ table fitted at 5 bits to the ranks' statistics (with no fit of its own to
    broadcast or checkpoint).

    It follows base's table whenever base refits (``adopt``) or loads a checkpoint, so it
    has no state of its own (``state_dict()`` is ``{}``, ``keeps_state`` False: base's
    checkpoint holds the table).  Messages: base's codec, bucket size, norm and entropy
    setting, ``bits`` per coordinate, the version of base's table in the header, so a
    receiver whose base holds another version refuses them (WireFormatError).

    base: a :class:`BucketQuantizer` of that family; bits: int in base.bits + 1 .. 8.
    Raises TypeError for another compressor, ValueError for bits out of range.
    """
    keeps_state = False

    def __init__(self, base: BucketQuantizer, bits: int):
        if not isinstance(base, (QSGD, QSGDInf, NUQSGD, _Adaptive)):
            raise TypeError(f"Finer refines QSGD, QSGDinf, NUQSGD, ALQ and AMQ level tables, "
                            f"got {base!r}")
        self.base = base
        self.bits = settings.integer("bits", bits, base.bits + 1, 8)
        self.inner = type(base)(**dict(base.settings(), bits=self.bits))
        self.name, self.codec, self.entropy = base.name, base.codec, base.entropy
        self.bucket_size = base.bucket_size
        self._initial = (torch.tensor(base.initial_levels(), dtype=torch.float32),
                         self.inner.levels.clone())    # base's initial table, this one's
        self._source = None                 # the base table the inner one follows
        self._lock = threading.Lock()

    def follow(self) -> BucketQuantizer:
        """The quantizer at ``bits`` with the table that base's current one gives (class
        docstring) and its version."""
        with self._lock:
            src = self.base.levels
            if src is not self._source or self.inner.level_version != self.base.level_version:
                if torch.equal(src.cpu(), self._initial[0]):
                    self.inner.levels = self._initial[1].clone()
                else:
                    self.inner.levels = torch.from_numpy(L.refine(src.double().cpu().numpy(),
                                                                  self.bits))
                self.inner.level_version = self.base.level_version
                self._source = src
            return self.inner

    @property
    def levels(self) -> torch.Tensor:
        """The refined table now (float32, ``2**(bits-1)`` levels)."""
        return self.follow().levels

    @property
    def level_version(self) -> int:
        return self.follow().level_version

    def encode(self, grad, key):
        return self.follow().encode(grad, key)

    def decode(self, msg, key, out):
        return self.follow().decode(msg, key, out)

    def combine(self, msgs, keys, out):
        return self.follow().combine(msgs, keys, out)

    def encode_pieces(self, grad, spans, keys):
        return self.follow().encode_pieces(grad, spans, keys)

    def decode_pieces(self, msgs, keys, spans, out):
        return self.follow().decode_pieces(msgs, keys, spans, out)

    def finalize(self, acc, key):
        return self.inner.finalize(acc, key)

    def variance(self, grad: torch.Tensor) -> float:
        """The exact variance of quantizing ``grad`` with the refined table (Eq. 2)."""
        return self.follow().variance(grad)

    def message_bytes(self, shape) -> int:
        return self.inner.message_bytes(shape)

    def settings(self):
        return self.inner.settings()

    def spec(self) -> str:
        return self.inner.spec()

    def __repr__(self) -> str:
        return f"hvdcomp.compressors.Finer({self.base!r}, bits={self.bits})"
