"""Dithered and nested dithered quantization of stochastic gradients: DQSG and NDQSG.

Source: A. Abdi and F. Fekri, "Nested Dithered Quantization for Communication Reduction in
Distributed Training", arXiv 1904.01197 (2019).  DQSG is the paper's subtractive dithered
quantizer of the stochastic gradient, ``Q(v + u) - u`` with a dither ``u`` both sides can
generate; NDQSG is its nested-lattice variant, in which a group of workers sends only the
fine index modulo the coarse lattice and the receiver resolves the coset with side
information (the gradients it already decoded from the other group).  (Equation numbers are
not quoted here: the names follow the paper's description, not its numbering.)

The arithmetic (bucket steps Delta_b = max|x| / M, the Philox dither, the dithered indices
q in [-M, M], the reconstruction Delta * q - u, NDQSG's residues, bucket checks and coset
resolution) is specified in hvdcomp.ops.dithered, whose ops the compressors call (kernels/
dithered.cu where a kernel backend serves the device, the PyTorch reference otherwise: the
same bytes, sums and events either way).  In short: ``bits`` (2..8) is the whole code width,
sign included (M = 2**(bits-1) - 1 positive levels); the error x_hat - x is uniform on
[-Delta_b/2, Delta_b/2] and independent of x given Delta_b (unbiased, variance Delta_b**2/12).

Gradients of any shape and layout, in float32/float16/bfloat16/float64, are quantized from
their float32 values (float64 values beyond the float32 range are sent as NONFINITE: their
float32 average would be infinite anyway).  Non-floating tensors raise TypeError.  A tensor
holding NaN or Inf is sent as a payload-free NONFINITE message (docs/design.md).  The codes
are sent at fixed width by default; ``entropy=True`` rANS-codes them instead (hvdcomp.codecs
.sections.write_codes, flag ENTROPY, alphabet 2**width; the paper entropy-codes q).

Wire (sections of hvdcomp.wire.Message; nb = ceil(numel / bucket_size); see each class for
its header fields):
  dqsg / ndqsg's DQSG group:  0: Delta_b, float32 LE (nb values in [0, Delta_max(bits)])
                              1: codes q_i + M, ``bits`` each, packed LSB-first
                                 (hvdcomp.ops.bitpack); the code 2**bits - 1 is invalid
                              payload: 4*nb + ceil(numel*bits/8) bytes
  ndqsg's nested group:       0: Delta_b, float32 LE (as above)
                              1: residues q_i mod k (k = 2**nested_bits, 0..k-1),
                                 ``nested_bits`` each, packed LSB-first
                              2: per-bucket check, uint32 LE: S_b = sum_{i in b} q_i*w_i
                                 mod 2**32 with w_i = (Philox word at index 2**60 + i of the
                                 sender's key) | 1, an odd pseudo-random weight
                              payload: 8*nb + ceil(numel*nested_bits/8) bytes
E.g. bits=4, nested_bits=2, bucket_size=512: 4.0625 bits/coordinate for DQSG, 2.125 for a
nested message (47.7 % fewer) at the same step Delta, i.e. the same variance bound.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import List, Optional, Tuple

import numpy as np
import torch

from ..ops.bitpack import packed_size
from ..codecs.sections import read_codes, write_codes
from ..errors import WireFormatError
from ..ops import dithered
from ..wire import FLAG_NONFINITE, Message
from . import settings
from .base import ABSENT_REFUSE, Compressor, TensorKey, numel_of, register
from .protocols import ReportsEvents

__all__ = ["DQSG", "NDQSG", "NestedResult"]


def _nbuckets(n: int, bucket_size: int) -> int:
    return (n + bucket_size - 1) // bucket_size


def _f32_section(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().numpy().astype("<f4").view(np.uint8)


def _u32_section(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().numpy().astype("<u4").view(np.uint8)


def _read_f32(sec) -> torch.Tensor:
    return torch.from_numpy(np.frombuffer(bytes(sec), dtype="<f4").astype(np.float32))


def parse_steps(name: str, msg: Message, nb: int, bits: int) -> torch.Tensor:
    """Section 0 of a message of bucket steps (DQSG, uniformef) validated: Delta float32
    (nb,) on the CPU, each in [0, dithered.max_step(bits)] (larger steps, which no encoder
    writes, could decode beyond the float32 range).  Raises WireFormatError."""
    msg.section_size_check(0, 4 * nb, "bucket steps")
    delta = _read_f32(msg.sections[0])
    top = dithered.max_step(bits)
    if not bool(((delta >= 0) & (delta <= top)).all()):      # NaN fails both
        raise WireFormatError(f"{name}: bucket steps must be in [0, {top:.7g}] (finite, and "
                              f"small enough for a finite decode at {bits} bits)")
    return delta


def parse_steps_and_codes(name: str, msg: Message, bits: int, bucket_size: int,
                          device) -> Tuple[torch.Tensor, torch.Tensor]:
    """A message of two sections, bucket steps and codes q + M packed at ``bits`` (DQSG,
    uniformef), validated: (Delta float32 (nb,), packed codes uint8), both on ``device``.
    Raises WireFormatError for wrong sections, steps out of range, the code 2M + 1 (never
    sent) or a non-zero code in a bucket of step 0."""
    n = msg.numel
    M = (1 << (bits - 1)) - 1
    msg.expect(nsections=2)
    delta = parse_steps(name, msg, _nbuckets(n, bucket_size), bits).to(device)
    packed = read_codes(msg, 1, n, bits, device=device)
    invalid, nonzero = dithered.validate_codes(packed, n, delta, bucket_size, bits, M, 2 * M)
    if invalid:
        raise WireFormatError(f"{name}: code {2 * M + 1} is not a valid {bits}-bit code "
                              f"(codes are q + {M} <= {2 * M})")
    if nonzero:
        raise WireFormatError(f"{name}: non-zero code in a bucket with step 0")
    return delta, packed


def _read_u32(sec) -> torch.Tensor:
    return torch.from_numpy(np.frombuffer(bytes(sec), dtype="<u4").astype(np.int64))


# --- DQSG ------------------------------------------------------------------------------------

@register("dqsg", codec=19)
class DQSG(Compressor):
    """DQSG: per-bucket subtractive dithered uniform quantization (Abdi & Fekri 2019, DQSG).

    Args:
      bits: code width per coordinate, sign included (2..8): q in [-M, M], M = 2**(bits-1)-1,
            sent as the offset code q + M.
      bucket_size: coordinates per bucket (1..2**31); each bucket sends its step
            Delta (max|x| / M, or set by ``variance_target``) as one float32.
      entropy: rANS-code the codes (flag ENTROPY) instead of packing them at ``bits``.
      variance_target: 0 (default: the paper's step, the bucket max / M), or a normalized
            variance v > 0 (E||x_hat - x||^2 / ||x||^2 per bucket): each bucket's step is
            then set by v instead of by the bits, Delta_b = ||x_b|| sqrt(12 v / n_b)
            (hvdcomp.ops.dithered.variance_steps), and with ``entropy=True`` the bits follow
            the gradient: ``dqsg:bits=6,bucket_size=65536,entropy=True,variance_target=0.04``
            (v = 0.04).  At the variance of CGX's 4-bit quantizer (4.06 bits) it sent 0.83-2.0
            bits per coordinate on the real gradients after step 0 of training of
            bench/results/bits_variance.md (2.0-2.7 at step 0).
            A bucket whose maximum exceeds M Delta_b gets the step max / M instead,
            and more variance than v (more bits make that rarer, and cost 2**bits * 2 bytes
            of rANS model per message).  Receivers need nothing of it: the steps travel in
            the message.
    Settings are validated by hvdcomp.compressors.settings: ValueError out of range,
    TypeError for a value of the wrong type (hvdcomp.get: ConfigError).

    encode(grad, key): grad of any shape/layout, float32/16, bfloat16 or float64 (quantized
      from its float32 values); returns a Message with codec ``dqsg``, header bits=bits,
      bucket_size=bucket_size, level_version=0, sections (Delta float32 (nb,), packed codes):
      48 + 8*ndim + 16 + 4*nb + ceil(numel*bits/8) + 4 bytes on the wire (entropy: the
      codes section is the rANS section of the codes, alphabet 2**bits, and the flag ENTROPY
      is set).  TypeError for non-floating tensors; NaN/Inf -> NONFINITE message.
    decode(msg, key, out): adds float32 x_hat (numel,) to ``out``; the dither is regenerated
      from ``key`` (whose fields must equal the header's).  WireFormatError for header
      mismatches, wrong section sizes, steps outside [0, Delta_max] (non-finite, negative, or
      too large for a finite decode: hvdcomp.ops.dithered.max_step), the invalid code
      2**bits - 1, or a non-zero code in a bucket with Delta = 0.
    Error: x_hat - x uniform on [-Delta/2, Delta/2], independent of x given Delta (unbiased,
      variance Delta**2/12 per coordinate); the exact arithmetic: hvdcomp.ops.dithered.
    """
    example = "dqsg:bits=4"

    def __init__(self, bits: int = 4, bucket_size: int = 512, entropy: bool = False,
                 variance_target: float = 0.0):
        self.bits = settings.integer("bits", bits, 2, 8)
        self.bucket_size = settings.integer("bucket_size", bucket_size, 1, 2**31)
        self.entropy = settings.boolean("entropy", entropy)
        self.variance_target = settings.real("variance_target", variance_target, 0.0, 1e3)

    def _steps(self, x: torch.Tensor) -> torch.Tensor:
        """The bucket steps Delta float32 (nb,) of flat float32 ``x``: the paper's (bucket
        max / M), or set by ``variance_target``."""
        if self.variance_target > 0:
            return dithered.variance_steps(x, self.bits, self.bucket_size,
                                           self.variance_target)
        return dithered.bucket_steps(x, self.bits, self.bucket_size)

    @property
    def M(self) -> int:
        """Number of positive levels, 2**(bits-1) - 1."""
        return (1 << (self.bits - 1)) - 1

    def _header_fields(self):
        return {"bits": self.bits, "bucket_size": self.bucket_size, "level_version": 0}

    def shard_unit(self, shape) -> int:
        """A bucket (its step Delta is the bucket's own, hvdcomp.exchange.shards)."""
        return self.bucket_size

    def message_bytes(self, shape) -> int:
        """Payload bytes of a DQSG message for a tensor of ``shape`` (or ``numel``
        coordinates; header excluded; without entropy coding)."""
        numel = numel_of(shape)
        return 4 * _nbuckets(numel, self.bucket_size) + packed_size(numel, self.bits)

    # -- encode ---------------------------------------------------------------------------
    def _flat(self, grad: torch.Tensor) -> torch.Tensor:
        """grad's float32 values, flat and contiguous; TypeError for non-floating tensors."""
        if not grad.is_floating_point():
            raise TypeError(f"{self.name} quantizes floating-point gradients only, got "
                            f"{grad.dtype}")
        return grad.detach().reshape(-1).to(torch.float32).contiguous()

    def _encode(self, grad, key):
        x = self._flat(grad)
        delta = self._steps(x)
        packed = dithered.dqsg_encode(x, delta, self.bits, self.bucket_size, key)
        codes, flag = write_codes(packed, x.numel(), self.bits, self.entropy)
        return self._new_message(grad, key, (_f32_section(delta), codes), flag)

    # -- decode ---------------------------------------------------------------------------
    def _parse_steps(self, msg: Message, nb: int) -> torch.Tensor:
        return parse_steps(self.name, msg, nb, self.bits)

    def _parse_dqsg(self, msg: Message, device) -> Tuple[torch.Tensor, torch.Tensor]:
        return parse_steps_and_codes(self.name, msg, self.bits, self.bucket_size, device)

    def _decode(self, msg, key, out):
        delta, packed = self._parse_dqsg(msg, out.device)
        dithered.dqsg_decode_add(packed, msg.numel, delta, self.bits, self.bucket_size, out,
                                 key)


# --- NDQSG -----------------------------------------------------------------------------------

@dataclass
class NestedResult:
    """What :meth:`NDQSG.resolve` decoded for one tensor.

    values[r]: rank r's float32 (numel,) contribution (nested ranks: after coset resolution
      and fallback).  failed[r]: bool (nb,) buckets of nested rank r whose check failed
      (None for the DQSG group).  side_sum: float32 (numel,) sum of the DQSG group's values
      in rank order; side = side_sum / group is the side information.
    """
    values: List[torch.Tensor]
    failed: List[Optional[torch.Tensor]]
    side_sum: torch.Tensor
    group: int


# why NDQSG refuses the reduce-scatter (NDQSG.shard_unit)
_NO_SHARDS = ("NDQSG's nested ranks send residues that decode only with side information "
              "from the other ranks' messages of the same tensor (Abdi & Fekri 2019): the "
              "owner of a shard re-encodes one average, which has no other ranks to nest "
              "against, so the nested half of the ranks would have nothing to resolve with")


@register("ndqsg", codec=20)
class NDQSG(ReportsEvents, DQSG):
    """NDQSG: nested dithered quantization with side information (Abdi & Fekri 2019, NDQSG).

    Args:
      bits: fine-lattice code width (2..8), exactly as DQSG: step Delta = max|x| / M per
            bucket, M = 2**(bits-1) - 1.
      nested_bits: 1..bits-1; the coarse lattice has step k*Delta, k = 2**nested_bits.
      bucket_size: coordinates per bucket (1..2**31).
      dqsg_ranks: size G of the DQSG group; 0 (default) means ceil(N/2).  Values above N
            mean N.
      entropy: rANS-code the codes and the residues (flag ENTROPY) instead of packing them.
    Settings are validated by hvdcomp.compressors.settings: ValueError out of range,
    TypeError for a value of the wrong type (hvdcomp.get: ConfigError).

    Groups: with N ranks, ranks 0..G-1 (G = ceil(N/2), or min(dqsg_ranks, N)) send DQSG
    messages; ranks G..N-1 send nested messages.  G >= 1 always, so with N = 1 (or
    dqsg_ranks >= N) every rank is in the DQSG group and NDQSG is DQSG with codec ``ndqsg``.

    What is sent (codec ``ndqsg``, header bucket_size, level_version 0):
      DQSG group: header bits = bits; sections (Delta float32 (nb,), codes q + M at ``bits``)
        exactly as ``dqsg``: 4*nb + ceil(numel*bits/8) payload bytes.
      nested group: header bits = nested_bits; sections (Delta float32 (nb,), residues
        q mod k at ``nested_bits``, check S_b uint32 (nb,)): 8*nb + ceil(numel*nested_bits/8)
        payload bytes (entropy: codes and residues rANS-coded, alphabets 2**bits and k).
        q is the sender's DQSG index (same step, same dither as DQSG).

    Receiving (:meth:`combine`, which every rank runs on all N messages): decode the DQSG
    group, y = (their sum in rank order) / G in float32 is the side information; for each
    nested rank, z_i = float32(float32(y_i / D_b) + s_i) and q_hat_i = the member of the
    coset q_i mod k in [-M, M] nearest to z_i; x_hat = Delta*q_hat - u as DQSG.  This is
    exactly the DQSG value whenever |y_i - x_i| < (k - 1) * Delta_b / 2 for the whole
    bucket; then the variance bound is DQSG's, Delta**2/12, with nested_bits instead of bits
    per coordinate.  ``out`` receives (the DQSG group's sum) + each nested contribution in
    rank order.  The side information carries the DQSG group's own quantization error (up to
    Delta/2 each), so in practice the workers' gradients must agree to within about
    (k - 2) * Delta / 2 per coordinate: choose nested_bits from the spread between workers.
    (Measured: per-worker mini-batch gradients of FC-300-100 on MNIST, batch 64, differ by
    far more than that at bits=4, k=4: almost every bucket fails and falls back.)

    Side information too far off: the receiver recomputes S_b from q_hat and compares it
    with the sent check.  A wrong q_hat differs from q by non-zero multiples of k, which
    changes S_b except with probability at most about 2**-(32 - bits) per failed bucket
    (odd pseudo-random weights, new ones every step).  For each failed bucket the nested
    rank's contribution is replaced by the side information y (the DQSG group's mean; the
    average over that bucket then has the DQSG group's mean in place of that rank), and one
    event per (nested rank, tensor) with failures is appended to ``self._events``:
    "ndqsg: side information too far off in F of B buckets of rank r (step s, tensor t); ..."
    (the optimizer reports it in StepStats.events, prefixed with the parameter name).
    Nothing wrong is used silently, up to that check collision probability.

    Missing side information: if any rank's message is NONFINITE, the tensor is NaN on every
    rank (docs/design.md, NaN policy): combine validates every message but resolves none and
    returns False.  A nested message cannot be decoded on its own: :meth:`decode` raises
    WireFormatError for it (use combine).  A message whose header bits do not match the
    sender's group raises WireFormatError.
    """
    example = "ndqsg:bits=4"
    absent_rank = ABSENT_REFUSE         # the nested ranks resolve against every rank's message

    def __init__(self, bits: int = 4, nested_bits: int = 2, bucket_size: int = 512,
                 dqsg_ranks: int = 0, entropy: bool = False):
        super().__init__(bits, bucket_size, entropy)
        self.nested_bits = settings.integer("nested_bits", nested_bits, 1, self.bits - 1)
        self.dqsg_ranks = settings.integer("dqsg_ranks", dqsg_ranks, 0, 2**31)
        self._events: List[str] = []

    def shard_unit(self, shape) -> int:
        """Refused: TypeError (:data:`_NO_SHARDS`)."""
        raise TypeError(_NO_SHARDS)

    @property
    def k(self) -> int:
        """Coarse-to-fine step ratio 2**nested_bits."""
        return 1 << self.nested_bits

    def group_size(self, world_size: int) -> int:
        """G: ranks 0..G-1 send DQSG messages (G >= 1 for world_size >= 1)."""
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        g = (world_size + 1) // 2 if self.dqsg_ranks == 0 else self.dqsg_ranks
        return max(1, min(g, world_size))

    def is_nested(self, rank: int, world_size: int) -> bool:
        """Whether ``rank`` sends a nested message."""
        return rank >= self.group_size(world_size)

    def message_bytes(self, shape, nested: bool = False) -> int:
        """Payload bytes (header excluded, without entropy coding) of a DQSG-group or a
        nested message for a tensor of ``shape`` (or ``numel`` coordinates)."""
        if not nested:
            return super().message_bytes(shape)
        numel = numel_of(shape)
        return 8 * _nbuckets(numel, self.bucket_size) + packed_size(numel, self.nested_bits)

    def _bits_of(self, key: TensorKey) -> int:
        return self.nested_bits if self.is_nested(key.rank, key.world_size) else self.bits

    # -- encode ---------------------------------------------------------------------------
    def _new_message(self, grad, key, sections=(), flags=0) -> Message:
        """As :meth:`Compressor._new_message`, with header bits = the code width of the
        sender's group (``bits`` or ``nested_bits``), NONFINITE messages included."""
        msg = super()._new_message(grad, key, sections, flags)
        return dataclasses.replace(msg, bits=self._bits_of(key))

    def _encode(self, grad, key):
        if not self.is_nested(key.rank, key.world_size):
            return super()._encode(grad, key)
        x = self._flat(grad)
        delta = dithered.bucket_steps(x, self.bits, self.bucket_size)
        packed, check = dithered.nested_encode(x, delta, self.bits, self.nested_bits,
                                               self.bucket_size, key)
        residues, flag = write_codes(packed, x.numel(), self.nested_bits, self.entropy)
        return self._new_message(grad, key,
                                 (_f32_section(delta), residues, _u32_section(check)), flag)

    # -- decode ---------------------------------------------------------------------------
    def _validate(self, msg: Optional[Message], key: TensorKey, numel: int) -> None:
        """The header checks of :meth:`Compressor._expect_header` with the bits of the
        sender's group; a missing message (``None``: a zero-length entry) is a
        WireFormatError too."""
        self._require_message(msg, key)
        self._expect_header(msg, key, numel, bits=self._bits_of(key))

    def _parse_nested(self, msg: Message, device):
        """Validate a nested message's sections; returns (Delta float32 (nb,), residues
        packed at ``nested_bits``, uint8, S int64 (nb,)), all on ``device``."""
        n = msg.numel
        nb = _nbuckets(n, self.bucket_size)
        msg.expect(nsections=3)
        delta = self._parse_steps(msg, nb)
        msg.section_size_check(2, 4 * nb, "bucket checks")
        packed = read_codes(msg, 1, n, self.nested_bits, device=device, what="residues")
        check = _read_u32(msg.sections[2])
        delta_d = delta.to(device)
        _, nonzero = dithered.validate_codes(packed, n, delta_d, self.bucket_size,
                                             self.nested_bits, 0, self.k - 1)
        if nonzero:
            raise WireFormatError(f"{self.name}: non-zero residue in a bucket with step 0")
        if bool(((delta == 0) & (check != 0)).any()):
            raise WireFormatError(f"{self.name}: non-zero check in a bucket with step 0")
        return delta_d, packed, check.to(device)

    def _parse_all(self, msgs: List[Message], keys: List[TensorKey], n: int, device):
        """Every rank's message validated (all before anything is decoded): the parsed
        sections by rank, or None if any message is NONFINITE."""
        G = self.group_size(len(msgs))
        parsed = []
        for msg, key in zip(msgs, keys):
            self._validate(msg, key, n)
            if msg.flags & FLAG_NONFINITE:
                parsed.append(None)
            elif key.rank < G:
                parsed.append(self._parse_dqsg(msg, device))
            else:
                parsed.append(self._parse_nested(msg, device))
        return None if any(p is None for p in parsed) else parsed

    def decode(self, msg: Message, key: TensorKey, out: torch.Tensor) -> bool:
        """Decode one DQSG-group message (as :meth:`DQSG.decode`).

        A nested message needs the other ranks' messages as side information: it raises
        WireFormatError here (after the header checks); decode it with :meth:`combine`.
        NONFINITE messages return False.
        """
        self._validate(msg, key, out.numel())
        if msg.flags & FLAG_NONFINITE:
            return False
        if self.is_nested(key.rank, key.world_size):
            raise WireFormatError(
                f"{self.name}: rank {key.rank}'s message is nested (ranks >= "
                f"{self.group_size(key.world_size)} of {key.world_size}) and cannot be decoded "
                f"without side information; decode all ranks' messages with combine()")
        self._decode(msg, key, out)
        return True

    def resolve(self, msgs: List[Message], keys: List[TensorKey],
                numel: Optional[int] = None) -> Optional[NestedResult]:
        """Validate and decode every rank's message for one tensor (``msgs[r]`` from rank r,
        ``keys[r]`` its key; all N ranks), each rank's contribution apart (on the CPU).
        Returns None if any message is NONFINITE (the tensor is NaN, nothing is resolved),
        else a :class:`NestedResult`.

        Raises WireFormatError for any malformed, mismatched or missing (None: a zero-length
        entry) message (all are checked before anything is decoded); ValueError if ``keys``
        are not ranks 0..N-1 of one tensor and step.
        """
        world = _check_keys(msgs, keys)
        if numel is None:
            self._require_message(msgs[0], keys[0])
        n = msgs[0].numel if numel is None else numel
        parsed = self._parse_all(msgs, keys, n, torch.device("cpu"))
        if parsed is None:
            return None
        G = self.group_size(world)
        values: List[torch.Tensor] = []
        failed: List[Optional[torch.Tensor]] = [None] * G
        side_sum = torch.zeros(n, dtype=torch.float32)
        for r in range(G):
            delta, packed = parsed[r]
            values.append(dithered.dqsg_decode_add(packed, n, delta, self.bits,
                                                   self.bucket_size, torch.zeros(n), keys[r]))
            side_sum.add_(values[r])
        for r in range(G, world):
            delta, packed, check = parsed[r]
            values.append(torch.zeros(n))
            failed.append(dithered.nested_decode_add(
                packed, n, delta, check, side_sum, G, self.bits, self.nested_bits,
                self.bucket_size, values[r], keys[r]))
        return NestedResult(values, failed, side_sum, G)

    def combine(self, msgs: List[Message], keys: List[TensorKey], out: torch.Tensor) -> bool:
        """Decode all N ranks' messages for one tensor into ``out`` (float32 (numel,)):
        out += sum of the DQSG group (rank order), then += each nested rank's value in rank
        order.  Returns False (nothing added) if any message is NONFINITE.  Appends one event
        per nested rank with buckets whose side information was too far off (class
        docstring).  Raises WireFormatError / ValueError as :meth:`resolve`.
        """
        world = _check_keys(msgs, keys)
        n = out.numel()
        parsed = self._parse_all(msgs, keys, n, out.device)
        if parsed is None:
            return False
        G = self.group_size(world)
        side_sum = torch.zeros(n, dtype=torch.float32, device=out.device)
        for r in range(G):
            delta, packed = parsed[r]
            dithered.dqsg_decode_add(packed, n, delta, self.bits, self.bucket_size, side_sum,
                                     keys[r])
        out.add_(side_sum)
        for r in range(G, world):
            delta, packed, check = parsed[r]
            failed = dithered.nested_decode_add(packed, n, delta, check, side_sum, G,
                                                self.bits, self.nested_bits,
                                                self.bucket_size, out, keys[r])
            nf = int(failed.sum())
            if nf:
                k = keys[r]
                self._events.append(
                    f"ndqsg: side information too far off in {nf} of {failed.numel()} "
                    f"buckets of rank {r} (step {k.step}, tensor {k.tensor_id}); used the "
                    f"DQSG-group mean (ranks 0..{G - 1}) there")
        return True


def _check_keys(msgs: List[Message], keys: List[TensorKey]) -> int:
    """The number of ranks of NDQSG.combine's messages; ValueError unless ``keys[r]`` is rank
    r's key of one tensor and step."""
    n = len(msgs)
    if n == 0 or len(keys) != n:
        raise ValueError(f"combine needs one key per message, got {n} messages and "
                         f"{len(keys)} keys")
    for r, k in enumerate(keys):
        if (k.rank != r or k.world_size != n or k.tensor_id != keys[0].tensor_id
                or k.step != keys[0].step or k.seed != keys[0].seed):
            raise ValueError(f"combine expects keys[r] to be rank r's key of the same "
                             f"tensor and step, with world_size {n}; keys[{r}] = {k}")
    return n
