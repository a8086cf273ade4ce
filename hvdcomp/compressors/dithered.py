"""Dithered and nested dithered quantization of stochastic gradients: DQSG and NDQSG.

Source: A. Abdi and F. Fekri, "Nested Dithered Quantization for Communication Reduction in
Distributed Training", arXiv 1904.01197 (2019).  DQSG is the paper's subtractive dithered
quantizer of the stochastic gradient, ``Q(v + u) - u`` with a dither ``u`` both sides can
generate; NDQSG is its nested-lattice variant, in which a group of workers sends only the
fine index modulo the coarse lattice and the receiver resolves the coset with side
information (the gradients it already decoded from the other group).  Summary and claims:
../shared/docs/seeds.md, section 5.  (Equation numbers are not quoted here: the names below
follow the paper's description, not its numbering.)

Conventions shared by both codecs (everything below is float32 unless stated):

* ``bits`` (2..8) is the whole code width per coordinate, sign included, as for every
  quantizer in hvdcomp (docs/design.md, "Bits"):  M = 2**(bits-1) - 1 positive levels, so the
  fine lattice is ``Delta * {-M, ..., M}``: 2M + 1 = 2**bits - 1 points, i.e. the
  2**(bits-1) magnitudes {0, Delta, ..., M*Delta} with a sign.  3 bits: q in {-3..3}.
* Per bucket b of ``bucket_size`` consecutive coordinates of the flattened gradient x
  (the last bucket may be short):
      m_b     = max_{i in b} |x_i|
      Delta_b = float32(m_b / M)                               (the fine step)
* Dither (Philox, hvdcomp.random, keyed by the TensorKey: seed, step, rank, tensor id and
  the coordinate index i, so any receiver regenerates it bit-exactly from the header):
      s_i = hvdcomp.random.uniform(n, seed, step, rank, tensor_id)[i] - 1/2   in [-1/2, 1/2)
      u_i = float32(s_i * Delta_b)                              in [-Delta_b/2, Delta_b/2]
  (``s_i`` is exact in float32: the uniform numbers are multiples of 2**-24.)
* Encoding (``q = round((x + u) / Delta)``, computed as ``x / Delta + s`` so that nothing
  overflows next to the float32 maximum; D_b = Delta_b, or 1 where Delta_b = 0):
      q_i = clamp(floor(float32(float32(x_i / D_b) + s_i) + 0.5), -M, M)        (int)
  In exact arithmetic |x_i| <= M*Delta_b gives (x_i + u_i)/Delta_b in [-M-1/2, M+1/2), so
  q_i is already in [-M, M]; the clamp only acts when float32 rounding lands within a few
  ulps of +-(M + 1/2), where it moves the error by at most those ulps.
* Decoding:  x_hat_i = float32(float64(Delta_b) * q_i - float64(u_i)).
  Then x_hat - x = Delta*q - (x + u): the rounding error of x + u, which, u being uniform
  over a whole cell, is uniform on [-Delta_b/2, Delta_b/2] and independent of x (given the
  bucket's step): unbiased, variance Delta_b**2 / 12 per coordinate (the paper's "training
  with DQSG is SGD plus an independent bounded uniform noise").  All-zero buckets have
  Delta = 0 and decode to exactly 0; a bucket whose maximum is so small (< M * 2**-149)
  that m/M underflows to 0 also has Delta = 0, q = 0 and decodes to 0.
* Gradients of any shape and layout, in float32/float16/bfloat16/float64, are quantized from
  their float32 values (float64 values beyond the float32 range are sent as NONFINITE: their
  float32 average would be infinite anyway).  Non-floating tensors raise TypeError.  A
  tensor holding NaN or Inf is sent as a payload-free NONFINITE message (docs/design.md).
* The codes are sent at fixed width by default; ``entropy=True`` rANS-codes them instead
  (hvdcomp.codecs.rans, flag ENTROPY; the paper entropy-codes q), the section then holding
  encode_symbols(codes, alphabet 2**width) in place of the packed codes.

Wire (sections of hvdcomp.wire.Message; nb = ceil(numel / bucket_size); see each class for
its header fields):
  dqsg / ndqsg's DQSG group:  0: Delta_b, float32 LE (nb values, finite, >= 0)
                              1: codes q_i + M, ``bits`` each, packed LSB-first
                                 (hvdcomp.codecs.bitpack); the code 2**bits - 1 is invalid
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
Kernels: where ``hvdcomp.backends.kernel_backend(device)`` returns a backend (host build on
the CPU, CuPy on CUDA), encode, decode and NDQSG's combine run kernels/dithered.cu through
hvdcomp/backends/k_dithered.py (bucket maxima, dithered quantization with the Philox dither,
packing, the checks, validation of received codes, reconstruction, the nested-lattice decode
with its check and fallback, added straight into the accumulator).  The functions below stay
the specification: message bytes, decoded sums and NDQSG's events are the same bit for bit
either way (HVDCOMP_BACKEND=reference runs them).  Entropy-coded messages, and accumulators
that are not contiguous float32 (numel,), decode on the reference path.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import List, Optional, Tuple

import numpy as np
import torch

from ..backends import k_dithered, kernel_backend
from .protocols import ReportsEvents
from ..codecs import decode_symbols, encode_symbols, pack_bits, packed_size, unpack_bits
from ..errors import WireFormatError
from ..random import random_words, uniform
from ..wire import CODECS, FLAG_ENTROPY, FLAG_NONFINITE, Message, dtype_code
from .base import Compressor, TensorKey, register

__all__ = ["DQSG", "NDQSG", "NestedResult", "dither", "check_weights", "dqsg_quantize",
           "dqsg_reconstruct", "bucket_checksums", "nested_resolve", "CHECK_OFFSET"]

#: Philox index offset of the checksum weights (the dither uses indices 0 .. numel-1).
CHECK_OFFSET = 1 << 60
_MASK = 0xFFFFFFFF


# --- the specification, as functions ---------------------------------------------------------

def dither(n: int, key: TensorKey, device=None) -> torch.Tensor:
    """The normalized dither s = U - 1/2 of ``key``'s tensor: float32 (n,), in [-1/2, 1/2).

    U = hvdcomp.random.uniform(n, seed, step, rank, tensor_id); the dither proper is
    u = s * Delta of the coordinate's bucket.
    """
    return uniform(n, seed=key.seed, step=key.step, rank=key.rank, tensor_id=key.tensor_id,
                   device=device) - 0.5


def check_weights(n: int, key: TensorKey, device=None) -> torch.Tensor:
    """Odd 32-bit weights w_i of NDQSG's per-bucket check: int64 (n,) in [1, 2**32).

    w_i = (Philox word of ``key`` at index CHECK_OFFSET + i) | 1.
    """
    return random_words(n, seed=key.seed, step=key.step, rank=key.rank,
                        tensor_id=key.tensor_id, offset=CHECK_OFFSET, device=device) | 1


def _nbuckets(n: int, bucket_size: int) -> int:
    return (n + bucket_size - 1) // bucket_size


def _per_coord(vals: torch.Tensor, bucket_size: int, n: int) -> torch.Tensor:
    """Per-bucket values (nb,) -> per-coordinate values (n,)."""
    return vals.unsqueeze(1).expand(vals.numel(), bucket_size).reshape(-1)[:n]


def dqsg_quantize(x: torch.Tensor, bits: int, bucket_size: int,
                  s: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Dithered quantization (module docstring).

    x: flat finite float32 (n,); s: float32 (n,) dither in [-1/2, 1/2) (see :func:`dither`).
    Returns (Delta float32 (nb,), q int64 (n,) in [-M, M]), M = 2**(bits-1) - 1.
    """
    M = (1 << (bits - 1)) - 1
    n = x.numel()
    nb = _nbuckets(n, bucket_size)
    xp = torch.zeros(nb * bucket_size, dtype=torch.float32, device=x.device)
    xp[:n] = x.abs()
    delta = xp.view(nb, bucket_size).amax(dim=1) / M
    safe = _per_coord(torch.where(delta > 0, delta, torch.ones_like(delta)), bucket_size, n)
    y = x / safe + s
    q = torch.floor(y + 0.5).clamp_(-M, M).to(torch.int64)
    return delta, q


def dqsg_reconstruct(delta: torch.Tensor, q: torch.Tensor, s: torch.Tensor,
                     bucket_size: int) -> torch.Tensor:
    """x_hat = float32(float64(Delta) * q - float64(u)), u = float32(s * Delta): float32 (n,)."""
    n = q.numel()
    d = _per_coord(delta, bucket_size, n)
    u = s * d
    return (d.to(torch.float64) * q.to(torch.float64) - u.to(torch.float64)).to(torch.float32)


def bucket_checksums(q: torch.Tensor, w: torch.Tensor, bucket_size: int) -> torch.Tensor:
    """S_b = sum_{i in b} q_i * w_i mod 2**32 as int64 (nb,).

    q: int64 (n,) with |q| < 2**8; w: int64 (n,) < 2**32.  Each product is reduced mod 2**32
    before the sum, so a bucket of up to 2**31 coordinates cannot overflow int64.
    """
    n = q.numel()
    nb = _nbuckets(n, bucket_size)
    p = torch.zeros(nb * bucket_size, dtype=torch.int64, device=q.device)
    p[:n] = (q * w) & _MASK
    return p.view(nb, bucket_size).sum(dim=1) & _MASK


def nested_resolve(c: torch.Tensor, z: torch.Tensor, bits: int,
                   nested_bits: int) -> torch.Tensor:
    """Coset resolution: the q in [-M, M] with q = c (mod k) nearest to z (ties: the larger).

    c: int64 (n,) residues in [0, k); z: float32 (n,) the side information in lattice units,
    z = float32(float32(y / D) + s).  Returns int64 (n,).  Exact whenever |z - q_sent| < k/2,
    i.e. whenever |y - x| < (k - 1) * Delta / 2 (q_sent is within 1/2 of x/Delta + s).
    """
    M = (1 << (bits - 1)) - 1
    k = 1 << nested_bits
    zz = torch.nan_to_num(z.to(torch.float64), nan=0.0, posinf=M + k, neginf=-(M + k))
    zz = zz.clamp(-(M + k), M + k)
    t = torch.floor((zz - c.to(torch.float64)) / k + 0.5).to(torch.int64)
    qh = c + k * t
    lo = torch.remainder(c + M, k) - M            # smallest member of the coset >= -M
    hi = lo + k * torch.div(M - lo, k, rounding_mode="floor")   # largest <= M
    return torch.minimum(torch.maximum(qh, lo), hi)


# --- helpers ---------------------------------------------------------------------------------

def _check_int(name: str, v, lo: int, hi: int) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not lo <= v <= hi:
        raise ValueError(f"{name} must be an integer in {lo}..{hi}, got {v!r}")
    return int(v)


def _check_bool(name: str, v) -> bool:
    if not isinstance(v, (bool, np.bool_)) and v not in (0, 1):
        raise ValueError(f"{name} must be a bool, got {v!r}")
    return bool(v)


def _check_float(grad: torch.Tensor, name: str) -> None:
    if not grad.is_floating_point():
        raise TypeError(f"{name} quantizes floating-point gradients only, got {grad.dtype}")


def _f32_section(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().numpy().astype("<f4").view(np.uint8)


def _u32_section(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().numpy().astype("<u4").view(np.uint8)


def _read_f32(sec) -> torch.Tensor:
    return torch.from_numpy(np.frombuffer(bytes(sec), dtype="<f4").astype(np.float32))


def _read_u32(sec) -> torch.Tensor:
    return torch.from_numpy(np.frombuffer(bytes(sec), dtype="<u4").astype(np.int64))


def _key_args(key: TensorKey) -> dict:
    return dict(seed=key.seed, rank=key.rank, tensor_id=key.tensor_id, step=key.step)


# --- DQSG ------------------------------------------------------------------------------------

@register("dqsg")
class DQSG(Compressor):
    """DQSG: per-bucket subtractive dithered uniform quantization (Abdi & Fekri 2019, DQSG).

    Args:
      bits: code width per coordinate, sign included (2..8): q in [-M, M], M = 2**(bits-1)-1,
            sent as the offset code q + M.
      bucket_size: coordinates per bucket (1..2**31); each bucket sends its step
            Delta = max|x| / M as one float32.
      entropy: rANS-code the codes (flag ENTROPY) instead of packing them at ``bits``.
    Raises ValueError for settings out of range (hvdcomp.get: ConfigError).

    encode(grad, key): grad of any shape/layout, float32/16, bfloat16 or float64 (quantized
      from its float32 values); returns a Message with codec ``dqsg``, header bits=bits,
      bucket_size=bucket_size, level_version=0, sections (Delta float32 (nb,), packed codes):
      48 + 8*ndim + 16 + 4*nb + ceil(numel*bits/8) + 4 bytes on the wire (entropy: the
      codes section is the rANS section of the codes, alphabet 2**bits, and the flag ENTROPY
      is set).  TypeError for non-floating tensors; NaN/Inf -> NONFINITE message.
    decode(msg, key, out): adds float32 x_hat (numel,) to ``out``; the dither is regenerated
      from ``key`` (whose fields must equal the header's).  WireFormatError for header
      mismatches, wrong section sizes, non-finite or negative steps, the invalid code
      2**bits - 1, or a non-zero code in a bucket with Delta = 0.
    Error: x_hat - x uniform on [-Delta/2, Delta/2], independent of x given Delta (unbiased,
      variance Delta**2/12 per coordinate); see the module docstring for the exact arithmetic.
    """
    codec = CODECS["dqsg"]

    def __init__(self, bits: int = 4, bucket_size: int = 512, entropy: bool = False):
        self.bits = _check_int("bits", bits, 2, 8)
        self.bucket_size = _check_int("bucket_size", bucket_size, 1, 2**31)
        self.entropy = _check_bool("entropy", entropy)

    @property
    def M(self) -> int:
        """Number of positive levels, 2**(bits-1) - 1."""
        return (1 << (self.bits - 1)) - 1

    def _header_fields(self):
        return {"bits": self.bits, "bucket_size": self.bucket_size, "level_version": 0}

    def message_bytes(self, numel: int) -> int:
        """Payload bytes of a DQSG message of ``numel`` coordinates (header excluded;
        without entropy coding)."""
        return 4 * _nbuckets(numel, self.bucket_size) + packed_size(numel, self.bits)

    # -- encode ---------------------------------------------------------------------------
    def _flat(self, grad: torch.Tensor) -> torch.Tensor:
        _check_float(grad, self.name)
        return grad.detach().reshape(-1).to(torch.float32)

    def _message(self, grad, key, bits, sections, flags=0) -> Message:
        hf = dict(self._header_fields(), bits=bits)
        if self.entropy and not flags & FLAG_NONFINITE:
            flags |= FLAG_ENTROPY
        return Message(codec=self.codec, dtype=dtype_code(grad.dtype), shape=tuple(grad.shape),
                       sections=sections, flags=flags, tensor_id=key.tensor_id, rank=key.rank,
                       seed=key.seed, step=key.step, **hf)

    def _quantize(self, x: torch.Tensor, key: TensorKey):
        s = dither(x.numel(), key, device=x.device)
        return dqsg_quantize(x, self.bits, self.bucket_size, s)

    def _encode(self, grad, key):
        x = self._flat(grad)
        if x.numel() and not bool(torch.isfinite(x).all()):   # float64 beyond float32 range
            return self._message(grad, key, self.bits, (), FLAG_NONFINITE)
        be = kernel_backend(x.device)
        if be is not None:      # kernels/dithered.cu: the same bytes as below
            x = x.contiguous()
            delta = k_dithered.steps(be.backend, x, self.bits, self.bucket_size)
            packed = k_dithered.quantize_pack(be.backend, x, delta, self.bits,
                                              self.bucket_size, 0, **_key_args(key))
            return self._message(grad, key, self.bits,
                                 (_f32_section(delta),
                                  self._symbols_packed(packed, x.numel(), self.bits)))
        delta, q = self._quantize(x, key)
        return self._message(grad, key, self.bits,
                             (_f32_section(delta), self._symbols(q + self.M, self.bits)))

    def _symbols_packed(self, packed: torch.Tensor, n: int, width: int) -> np.ndarray:
        """The code section from kernel-packed codes (the same bytes as :meth:`_symbols`)."""
        if self.entropy:
            return encode_symbols(unpack_bits(packed, n, width).cpu().numpy(), 1 << width)
        return packed.cpu().numpy()

    def _symbols(self, codes: torch.Tensor, width: int) -> np.ndarray:
        """The code section: ``width``-bit packed codes, or rANS-coded (entropy)."""
        if self.entropy:
            return encode_symbols(codes, 1 << width)
        return pack_bits(codes, width).cpu().numpy()

    @staticmethod
    def _read_symbols(msg: Message, i: int, n: int, width: int, what: str) -> torch.Tensor:
        """Section ``i`` as n int64 codes in [0, 2**width): unpacked, or entropy-decoded."""
        if msg.flags & FLAG_ENTROPY:
            return torch.from_numpy(decode_symbols(msg.sections[i], n, 1 << width))
        msg.section_size_check(i, packed_size(n, width), what)
        return unpack_bits(torch.from_numpy(np.array(msg.sections[i])), n, width)

    # -- decode ---------------------------------------------------------------------------
    def _parse_steps(self, msg: Message, nb: int) -> torch.Tensor:
        msg.section_size_check(0, 4 * nb, "bucket steps")
        delta = _read_f32(msg.sections[0])
        if not bool(torch.isfinite(delta).all()) or bool((delta < 0).any()):
            raise WireFormatError(f"{self.name}: bucket steps must be finite and >= 0")
        return delta

    def _parse_dqsg(self, msg: Message) -> Tuple[torch.Tensor, torch.Tensor]:
        """Validate a full-code message's sections; returns (Delta (nb,), q int64 (n,))."""
        n = msg.numel
        nb = _nbuckets(n, self.bucket_size)
        msg.expect(nsections=2)
        delta = self._parse_steps(msg, nb)
        codes = self._read_symbols(msg, 1, n, self.bits, "codes")
        if n and bool((codes > 2 * self.M).any()):
            raise WireFormatError(f"{self.name}: code {2 * self.M + 1} is not a valid "
                                  f"{self.bits}-bit DQSG code (codes are q + {self.M} <= "
                                  f"{2 * self.M})")
        q = codes - self.M
        if n and bool(((_per_coord(delta, self.bucket_size, n) == 0) & (q != 0)).any()):
            raise WireFormatError(f"{self.name}: non-zero code in a bucket with step 0")
        return delta, q

    def _kernel_decode(self, msgs, out: torch.Tensor):
        """The kernel backend for decoding ``msgs`` into ``out``, or None (reference path):
        packed sections (no entropy coding) into a contiguous float32 (numel,) accumulator."""
        if (out.dtype != torch.float32 or out.dim() != 1 or not out.is_contiguous()
                or any(m is None or m.flags & FLAG_ENTROPY for m in msgs)):
            return None
        return kernel_backend(out.device)

    def _parse_dqsg_kernel(self, be, msg: Message, device):
        """:meth:`_parse_dqsg` with the codes validated by a kernel (the same checks, the same
        errors, in the same order); returns (Delta float32 (nb,), packed codes uint8), both
        on ``device``."""
        n = msg.numel
        nb = _nbuckets(n, self.bucket_size)
        msg.expect(nsections=2)
        delta = self._parse_steps(msg, nb).to(device)
        msg.section_size_check(1, packed_size(n, self.bits), "codes")
        packed = torch.from_numpy(np.array(msg.sections[1], dtype=np.uint8)).to(device)
        invalid, nonzero = k_dithered.validate(be.backend, packed, n, delta, self.bucket_size,
                                               self.bits, self.M, 2 * self.M)
        if invalid:
            raise WireFormatError(f"{self.name}: code {2 * self.M + 1} is not a valid "
                                  f"{self.bits}-bit DQSG code (codes are q + {self.M} <= "
                                  f"{2 * self.M})")
        if nonzero:
            raise WireFormatError(f"{self.name}: non-zero code in a bucket with step 0")
        return delta, packed

    def _decode(self, msg, key, out):
        be = self._kernel_decode([msg], out)
        if be is not None:      # kernels/dithered.cu: out += x_hat, bit for bit as below
            delta, packed = self._parse_dqsg_kernel(be, msg, out.device)
            k_dithered.decode_add(be.backend, packed, msg.numel, delta, self.bits,
                                  self.bucket_size, out, **_key_args(key))
            return
        delta, q = self._parse_dqsg(msg)
        s = dither(msg.numel, key)
        out.add_(dqsg_reconstruct(delta, q, s, self.bucket_size).to(out.device))


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


@register("ndqsg")
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
    Raises ValueError for settings out of range (hvdcomp.get: ConfigError).

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
    codec = CODECS["ndqsg"]

    def __init__(self, bits: int = 4, nested_bits: int = 2, bucket_size: int = 512,
                 dqsg_ranks: int = 0, entropy: bool = False):
        super().__init__(bits, bucket_size, entropy)
        self.nested_bits = _check_int("nested_bits", nested_bits, 1, self.bits - 1)
        self.dqsg_ranks = _check_int("dqsg_ranks", dqsg_ranks, 0, 2**31)
        self._events: List[str] = []

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

    def message_bytes(self, numel: int, nested: bool = False) -> int:
        """Payload bytes (header excluded, without entropy coding) of a DQSG-group or a
        nested message."""
        if not nested:
            return super().message_bytes(numel)
        return 8 * _nbuckets(numel, self.bucket_size) + packed_size(numel, self.nested_bits)

    def _bits_of(self, key: TensorKey) -> int:
        return self.nested_bits if self.is_nested(key.rank, key.world_size) else self.bits

    # -- encode ---------------------------------------------------------------------------
    def encode(self, grad, key):
        msg = super().encode(grad, key)
        if msg.flags & FLAG_NONFINITE and msg.bits != self._bits_of(key):
            msg = dataclasses.replace(msg, bits=self._bits_of(key))
        return msg

    def _encode(self, grad, key):
        if not self.is_nested(key.rank, key.world_size):
            return super()._encode(grad, key)
        x = self._flat(grad)
        nb_bits = self.nested_bits
        if x.numel() and not bool(torch.isfinite(x).all()):
            return self._message(grad, key, nb_bits, (), FLAG_NONFINITE)
        be = kernel_backend(x.device)
        if be is not None:      # kernels/dithered.cu: the same bytes as below
            x = x.contiguous()
            delta = k_dithered.steps(be.backend, x, self.bits, self.bucket_size)
            packed = k_dithered.quantize_pack(be.backend, x, delta, self.bits,
                                              self.bucket_size, nb_bits, **_key_args(key))
            check = k_dithered.checks(be.backend, x, delta, self.bits, self.bucket_size,
                                      **_key_args(key))
            return self._message(grad, key, nb_bits,
                                 (_f32_section(delta),
                                  self._symbols_packed(packed, x.numel(), nb_bits),
                                  _u32_section(check)))
        delta, q = self._quantize(x, key)
        resid = q & (self.k - 1)
        check = bucket_checksums(q, check_weights(q.numel(), key, device=q.device),
                                 self.bucket_size)
        return self._message(grad, key, nb_bits,
                             (_f32_section(delta), self._symbols(resid, nb_bits),
                              _u32_section(check)))

    # -- decode ---------------------------------------------------------------------------
    def _validate(self, msg: Message, key: TensorKey, numel: int) -> None:
        msg.expect(codec=self.codec, tensor_id=key.tensor_id, step=key.step, rank=key.rank,
                   seed=key.seed, bits=self._bits_of(key), bucket_size=self.bucket_size,
                   level_version=0)
        if msg.numel != numel:
            raise WireFormatError(f"numel mismatch: message has {msg.numel}, receiver "
                                  f"expects {numel}")

    def _parse_nested(self, msg: Message):
        """Validate a nested message's sections; returns (Delta (nb,), c (n,), S (nb,))."""
        n = msg.numel
        nb = _nbuckets(n, self.bucket_size)
        msg.expect(nsections=3)
        delta = self._parse_steps(msg, nb)
        msg.section_size_check(2, 4 * nb, "bucket checks")
        c = self._read_symbols(msg, 1, n, self.nested_bits, "residues")
        check = _read_u32(msg.sections[2])
        zero = delta == 0
        if n and bool(((_per_coord(zero, self.bucket_size, n)) & (c != 0)).any()):
            raise WireFormatError(f"{self.name}: non-zero residue in a bucket with step 0")
        if bool((zero & (check != 0)).any()):
            raise WireFormatError(f"{self.name}: non-zero check in a bucket with step 0")
        return delta, c, check

    def _parse_nested_kernel(self, be, msg: Message, device):
        """:meth:`_parse_nested` with the residues validated by a kernel (same checks, same
        errors, same order); returns (Delta float32 (nb,), packed residues uint8, S int64
        (nb,)), all on ``device``."""
        n = msg.numel
        nb = _nbuckets(n, self.bucket_size)
        msg.expect(nsections=3)
        delta = self._parse_steps(msg, nb)
        msg.section_size_check(2, 4 * nb, "bucket checks")
        msg.section_size_check(1, packed_size(n, self.nested_bits), "residues")
        packed = torch.from_numpy(np.array(msg.sections[1], dtype=np.uint8)).to(device)
        check = _read_u32(msg.sections[2])
        zero = delta == 0
        delta_d = delta.to(device)
        _, nonzero = k_dithered.validate(be.backend, packed, n, delta_d, self.bucket_size,
                                         self.nested_bits, 0, self.k - 1)
        if nonzero:
            raise WireFormatError(f"{self.name}: non-zero residue in a bucket with step 0")
        if bool((zero & (check != 0)).any()):
            raise WireFormatError(f"{self.name}: non-zero check in a bucket with step 0")
        return delta_d, packed, check.to(device)

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

    @staticmethod
    def _check_keys(msgs: List[Message], keys: List[TensorKey]) -> int:
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

    def resolve(self, msgs: List[Message], keys: List[TensorKey],
                numel: Optional[int] = None) -> Optional[NestedResult]:
        """Validate and decode every rank's message for one tensor (``msgs[r]`` from rank r,
        ``keys[r]`` its key; all N ranks).  Returns None if any message is NONFINITE (the
        tensor is NaN, nothing is resolved), else a :class:`NestedResult`.

        Raises WireFormatError for any malformed or mismatched message (all are checked
        before anything is decoded); ValueError if ``keys`` are not ranks 0..N-1 of one
        tensor and step.
        """
        world = self._check_keys(msgs, keys)
        n = msgs[0].numel if numel is None else numel
        G = self.group_size(world)
        parsed = []
        for msg, key in zip(msgs, keys):
            self._validate(msg, key, n)
            if msg.flags & FLAG_NONFINITE:
                parsed.append(None)
            elif key.rank < G:
                parsed.append(self._parse_dqsg(msg))
            else:
                parsed.append(self._parse_nested(msg))
        if any(p is None for p in parsed):
            return None
        bs = self.bucket_size
        values: List[torch.Tensor] = []
        failed: List[Optional[torch.Tensor]] = []
        side_sum = torch.zeros(n, dtype=torch.float32)
        for r in range(G):
            delta, q = parsed[r]
            v = dqsg_reconstruct(delta, q, dither(n, keys[r]), bs)
            side_sum.add_(v)
            values.append(v)
            failed.append(None)
        y = side_sum / G
        for r in range(G, world):
            delta, c, check = parsed[r]
            s = dither(n, keys[r])
            d = _per_coord(delta, bs, n)
            z = y / torch.where(d > 0, d, torch.ones_like(d)) + s
            qh = nested_resolve(c, z, self.bits, self.nested_bits)
            qh = torch.where(d > 0, qh, torch.zeros_like(qh))
            bad = bucket_checksums(qh, check_weights(n, keys[r]), bs) != check
            v = dqsg_reconstruct(delta, qh, s, bs)
            if bool(bad.any()):
                v = torch.where(_per_coord(bad, bs, n), y, v)
            values.append(v)
            failed.append(bad)
        return NestedResult(values, failed, side_sum, G)

    def combine(self, msgs: List[Message], keys: List[TensorKey], out: torch.Tensor) -> bool:
        """Decode all N ranks' messages for one tensor into ``out`` (float32 (numel,)):
        out += sum of the DQSG group (rank order), then += each nested rank's value in rank
        order.  Returns False (nothing added) if any message is NONFINITE.  Appends one event
        per nested rank with buckets whose side information was too far off (class
        docstring).  Raises WireFormatError / ValueError as :meth:`resolve`.
        """
        be = self._kernel_decode(msgs, out)
        if be is not None:
            return self._combine_kernels(be, msgs, keys, out)
        res = self.resolve(msgs, keys, out.numel())
        if res is None:
            return False
        out.add_(res.side_sum.to(out.device))
        for r in range(res.group, len(msgs)):
            out.add_(res.values[r].to(out.device))
            nf = int(res.failed[r].sum())
            if nf:
                k = keys[r]
                self._events.append(
                    f"ndqsg: side information too far off in {nf} of {res.failed[r].numel()} "
                    f"buckets of rank {r} (step {k.step}, tensor {k.tensor_id}); used the "
                    f"DQSG-group mean (ranks 0..{res.group - 1}) there")
        return True

    def _failure_event(self, nf: int, nb: int, r: int, k: TensorKey, group: int) -> str:
        return (f"ndqsg: side information too far off in {nf} of {nb} buckets of rank {r} "
                f"(step {k.step}, tensor {k.tensor_id}); used the DQSG-group mean "
                f"(ranks 0..{group - 1}) there")

    def _combine_kernels(self, be, msgs: List[Message], keys: List[TensorKey],
                         out: torch.Tensor) -> bool:
        """:meth:`combine` through kernels/dithered.cu: the same validation and errors in the
        same order, the same float32 sums into ``out``, bit for bit, and the same events.
        The side information, the coset resolution, the checks and the fallback are
        computed on ``out``'s device (the reference computes them on the CPU: the kernels'
        arithmetic, true division included, gives the same bits on either device)."""
        world = self._check_keys(msgs, keys)
        n = out.numel()
        G = self.group_size(world)
        dev = out.device
        parsed = []
        for msg, key in zip(msgs, keys):
            self._validate(msg, key, n)
            if msg.flags & FLAG_NONFINITE:
                parsed.append(None)
            elif key.rank < G:
                parsed.append(self._parse_dqsg_kernel(be, msg, dev))
            else:
                parsed.append(self._parse_nested_kernel(be, msg, dev))
        if any(p is None for p in parsed):
            return False
        side_sum = torch.zeros(n, dtype=torch.float32, device=dev)
        for r in range(G):
            delta, packed = parsed[r]
            k_dithered.decode_add(be.backend, packed, n, delta, self.bits, self.bucket_size,
                                  side_sum, **_key_args(keys[r]))
        out.add_(side_sum)
        for r in range(G, world):
            delta, packed, check = parsed[r]
            failed = k_dithered.resolve_add(be.backend, packed, n, delta, check, side_sum, G,
                                            self.bits, self.nested_bits, self.bucket_size,
                                            out, **_key_args(keys[r]))
            nf = int(failed.sum())
            if nf:
                self._events.append(self._failure_event(nf, failed.numel(), r, keys[r], G))
        return True
