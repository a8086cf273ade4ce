"""Bucketed, normalized, unbiased stochastic quantizers: QSGD, QSGDinf, NUQSGD, ALQ, AMQ.

Source: Faghri et al., "Adaptive Gradient Quantization for Data-Parallel SGD", NeurIPS 2020
(arXiv 2010.12460), Sec. 2 (the family, Eq. 1-2) and Sec. 3 (ALQ, AMQ); QSGD: Alistarh et
al., NeurIPS 2017; NUQSGD: Ramezani-Kebrya et al., JMLR 2021.

Per bucket of ``bucket_size`` coordinates of the flattened gradient v:
    norm  = ||v||_2 (QSGDinf: ||v||_inf)
    r_i   = |v_i| / norm in [0, 1]
    r_i in [l_j, l_{j+1}] is sent as l_{j+1} with probability (r_i - l_j) / (l_{j+1} - l_j),
    else l_j; the uniform number is Philox(seed, rank | tensor_id, step, index i).
    E[Q(v_i)] = v_i;  Var[Q(v_i)] = norm^2 (l_{j+1} - r_i)(r_i - l_j).

Wire sections (see docs/wire-format.md):
    0: bucket norms, float32, ceil(numel / bucket_size) values
    1: codes, ``bits`` per coordinate packed LSB-first (hvdcomp.ops.bitpack):
       code = sign << (bits - 1) | level index; sign = 1 for v_i < 0.
So a message costs numel * bits / 8 + 4 * ceil(numel / bucket_size) bytes plus its header.
"""
from __future__ import annotations

from typing import Tuple

import numpy as np
import torch

from .. import levels as L
from ..backends import k_stats, kernel_backend
from .protocols import AdaptiveLevels
from ..codecs import decode_symbols, encode_symbols, pack_bits, packed_size, unpack_bits
from ..codecs.rans import decode_codes, encode_codes
from ..errors import WireFormatError
from ..random import uniform
from ..wire import CODECS, FLAG_ENTROPY, Message, dtype_code
from .base import Compressor, register

__all__ = ["BucketQuantizer", "QSGD", "QSGDInf", "NUQSGD", "ALQ", "AMQ",
           "quantize_reference", "dequantize_reference"]


def _check_float(grad: torch.Tensor, name: str) -> None:
    if not grad.is_floating_point():
        raise TypeError(f"{name} quantizes floating-point gradients only, got {grad.dtype}")


def bucket_norms(x: torch.Tensor, bucket_size: int, norm: str) -> torch.Tensor:
    """x: flat float32 padded to a multiple of bucket_size.  Returns float32 norms per bucket.

    The L2 norm is accumulated in float64 and rounded once to float32, so the result does not
    depend on the summation order to within float32 precision (CPU and GPU agree)."""
    b = x.view(-1, bucket_size)
    if norm == "l2":
        return b.to(torch.float64).pow(2).sum(dim=1).sqrt().to(torch.float32)
    return b.abs().amax(dim=1)


def quantize_reference(x: torch.Tensor, levels: torch.Tensor, bucket_size: int, norm: str,
                       u: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """The specification of the quantizer (PyTorch ops only).

    x: flat float32 (n,); levels: float32 (s+1,) increasing from 0 to 1; u: float32 (n,)
    uniform in [0, 1).  Returns (norms float32 (nb,), codes int64 (n,)) with
    code = sign << bits-1 | level index.
    """
    n = x.numel()
    nb = (n + bucket_size - 1) // bucket_size
    xp = torch.zeros(nb * bucket_size, dtype=torch.float32, device=x.device)
    xp[:n] = x
    norms = bucket_norms(xp, bucket_size, norm)
    safe = torch.where(norms > 0, norms, torch.ones_like(norms))
    r = (xp.view(nb, bucket_size).abs() / safe.unsqueeze(1)).reshape(-1)[:n]
    r = r.clamp_(max=1.0)            # |v_i| / ||v|| can round to just above 1
    s = levels.numel() - 1
    j = (torch.searchsorted(levels, r, right=True) - 1).clamp_(0, s - 1)
    lo, hi = levels[j], levels[j + 1]
    p = (r - lo) / (hi - lo)
    idx = j + (u < p).to(torch.int64)
    sign = (x < 0).to(torch.int64)
    bits_idx = max(int(s).bit_length(), 1)
    return norms, (sign << bits_idx) | idx


def dequantize_reference(norms: torch.Tensor, codes: torch.Tensor, levels: torch.Tensor,
                         bucket_size: int, index_bits: int) -> torch.Tensor:
    """Inverse map: float32 (n,) values sign * norm * levels[index]."""
    n = codes.numel()
    idx = codes & ((1 << index_bits) - 1)
    neg = (codes >> index_bits) != 0
    scale = norms.repeat_interleave(bucket_size)[:n] if n else norms[:0]
    v = levels[idx] * scale
    return torch.where(neg, -v, v)


class BucketQuantizer(Compressor):
    """Shared machinery of the family; subclasses choose the norm and the level table.

    Args:
      bits: bits per coordinate on the wire, sign included (2..8): 2**(bits-1) levels.
      bucket_size: coordinates per bucket (each bucket sends one float32 norm).
      entropy: rANS-code the codes with a model carried in the message (flag ENTROPY;
        hvdcomp.codecs.rans) instead of packing them at ``bits`` each.
    Raises ValueError for bits outside 2..8 or bucket_size < 1.
    """
    norm = "l2"

    def __init__(self, bits: int = 3, bucket_size: int = 8192, entropy: bool = False):
        L.num_levels(bits)
        self.entropy = bool(entropy)
        if not isinstance(bucket_size, int) or bucket_size < 1 or bucket_size > 2**31:
            raise ValueError(f"bucket_size must be an integer in 1..2**31, got {bucket_size}")
        self.bits = int(bits)
        self.bucket_size = int(bucket_size)
        self.levels = torch.tensor(self.initial_levels(), dtype=torch.float32)
        self.level_version = 0

    def initial_levels(self) -> np.ndarray:
        raise NotImplementedError

    def _header_fields(self):
        return {"bits": self.bits, "bucket_size": self.bucket_size,
                "level_version": self.level_version}

    def message_bytes(self, numel: int) -> int:
        """Payload bytes for ``numel`` coordinates (header excluded)."""
        nb = (numel + self.bucket_size - 1) // self.bucket_size
        return 4 * nb + packed_size(numel, self.bits)

    def _encode(self, grad, key):
        _check_float(grad, self.name)
        x = grad.detach().reshape(-1).to(torch.float32)
        n = x.numel()
        lv = self.levels.to(x.device)
        be = kernel_backend(x.device)
        if be is not None:      # kernels/quantize.cu: the same bytes as the reference below
            norms, packed = be.quantize(x, lv, self.bits, self.bucket_size, self.norm,
                                        seed=key.seed, rank=key.rank, tensor_id=key.tensor_id,
                                        step=key.step)
            codes = None
        else:
            u = uniform(n, seed=key.seed, step=key.step, rank=key.rank,
                        tensor_id=key.tensor_id, device=x.device)
            norms, codes = quantize_reference(x, lv, self.bucket_size, self.norm, u)
            packed = None
        if not bool(torch.isfinite(norms).all()):
            # finite values whose L2 norm overflows float32: the NaN policy, not an Inf norm
            return self._nonfinite(grad, key)
        return self._message(grad, key, norms, codes, packed)

    def _message(self, grad, key, norms, codes, packed=None) -> Message:
        """codes (int64) or packed (uint8, pack_bits of the codes): either may be None."""
        if self.entropy:
            # kernels/rans.cu straight from the packed codes (no int64 round trip); the
            # reference's int64 codes: encode_symbols (kernels too where a backend runs)
            sec = (encode_codes(packed, grad.numel(), self.bits) if packed is not None
                   else encode_symbols(codes, 1 << self.bits))
        else:
            sec = (packed if packed is not None else pack_bits(codes, self.bits)).cpu().numpy()
        return Message(codec=self.codec, dtype=dtype_code(grad.dtype), shape=tuple(grad.shape),
                       sections=(norms.cpu().numpy().view(np.uint8), sec),
                       flags=FLAG_ENTROPY if self.entropy else 0,
                       tensor_id=key.tensor_id, rank=key.rank, seed=key.seed, step=key.step,
                       **self._header_fields())

    def _codes(self, msg: Message, n: int) -> torch.Tensor:
        """The codes of a validated message: unpacked, or entropy-decoded (flag ENTROPY)."""
        if msg.flags & FLAG_ENTROPY:
            return torch.from_numpy(decode_symbols(msg.sections[1], n, 1 << self.bits))
        msg.section_size_check(1, packed_size(n, self.bits), "codes")
        return unpack_bits(torch.from_numpy(np.array(msg.sections[1])), n, self.bits)

    def _norms(self, msg: Message, n: int) -> torch.Tensor:
        nb = (n + self.bucket_size - 1) // self.bucket_size
        msg.expect(nsections=2)
        msg.section_size_check(0, 4 * nb, "norms")
        norms = torch.from_numpy(np.array(msg.sections[0]).view(np.float32))
        if not bool(torch.isfinite(norms).all()) or bool((norms < 0).any()):
            raise WireFormatError(f"{self.name}: bucket norms must be finite and >= 0")
        return norms

    @staticmethod
    def _kernel_out(be, out: torch.Tensor) -> bool:
        return (be is not None and out.dtype == torch.float32 and out.dim() == 1
                and out.is_contiguous())

    def _packed_on(self, msg: Message, n: int, dev) -> torch.Tensor:
        """The message's packed codes on ``dev`` (entropy sections decoded there by
        kernels/rans.cu)."""
        if msg.flags & FLAG_ENTROPY:
            return decode_codes(msg.sections[1], n, self.bits, device=dev)
        msg.section_size_check(1, packed_size(n, self.bits), "codes")
        return torch.from_numpy(np.array(msg.sections[1], dtype=np.uint8)).to(dev)

    def _decode(self, msg, key, out):
        n = msg.numel
        norms = self._norms(msg, n)
        be = kernel_backend(out.device)
        if self._kernel_out(be, out):
            # kernels/quantize.cu: out += the decoded values, bit for bit as below
            dev = out.device
            be.dequantize_add(self._packed_on(msg, n, dev), n, norms.to(dev),
                              self.levels.to(dev), self.bits, self.bucket_size, out)
            return
        codes = self._codes(msg, n)
        v = dequantize_reference(norms, codes, self.levels, self.bucket_size, self.bits - 1)
        out.add_(v.to(out.device))

    def combine(self, msgs, keys, out):
        """Every rank's message added in rank order, as the base class does, but in one
        kernel pass over ``out`` (hvd_dequantize_add_many) where the kernels run: the same
        additions in the same order, so the same bits."""
        be = kernel_backend(out.device)
        if (not self._kernel_out(be, out) or len(msgs) < 2
                or type(self)._decode is not BucketQuantizer._decode):   # a subclass decodes
            return super().combine(msgs, keys, out)                     # its own way
        finite, packed, norms = True, [], []
        dev = out.device
        for msg, key in zip(msgs, keys):
            self._require_message(msg, key)
            if not self._check_header(msg, key, out):
                finite = False
                continue
            n = msg.numel
            norms.append(self._norms(msg, n).to(dev))
            packed.append(self._packed_on(msg, n, dev))
        if packed:
            be.dequantize_add_many(packed, out.numel(), norms, self.levels.to(dev), self.bits,
                                   self.bucket_size, out)
        return finite

    def variance(self, grad: torch.Tensor) -> float:
        """The exact variance sum_i E|Q(v_i) - v_i|^2 of quantizing ``grad`` (Eq. 2)."""
        x = grad.detach().reshape(-1).to(torch.float32)
        n = x.numel()
        if n == 0:
            return 0.0
        nb = (n + self.bucket_size - 1) // self.bucket_size
        xp = torch.zeros(nb * self.bucket_size)
        xp[:n] = x
        norms = bucket_norms(xp, self.bucket_size, self.norm).double()
        r = (xp.view(nb, -1).abs().double() / torch.where(norms > 0, norms, 1).unsqueeze(1))
        w = (norms ** 2).unsqueeze(1).expand_as(r)
        return L.empirical_variance(r.reshape(-1)[:n].numpy(), w.reshape(-1)[:n].numpy(),
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


@register("qsgd")
class QSGD(BucketQuantizer):
    """QSGD: L2 bucket norm, uniform levels {0, 1/s, ..., 1} (Alistarh et al., 2017)."""
    codec = CODECS["qsgd"]

    def initial_levels(self):
        return L.uniform_levels(self.bits)


@register("qsgdinf")
class QSGDInf(BucketQuantizer):
    """QSGDinf: L-inf bucket norm, uniform levels (Faghri et al., 2020, Sec. 2)."""
    codec = CODECS["qsgdinf"]
    norm = "linf"

    def initial_levels(self):
        return L.uniform_levels(self.bits)


@register("nuqsgd")
class NUQSGD(BucketQuantizer):
    """NUQSGD: L2 bucket norm, exponential levels {0, 1/2^(s-1), ..., 1/2, 1}."""
    codec = CODECS["nuqsgd"]

    def initial_levels(self):
        return L.exponential_levels(self.bits, 0.5)


class _Adaptive(AdaptiveLevels, BucketQuantizer):
    """Levels fitted during training from the gradients themselves (ALQ / AMQ).

    refit_steps, refit_every: the table is refitted before the listed steps and before every
    multiple of ``refit_every`` (the authors' schedule: 100 and 2000, then every 10000).
    model: "hist" (binned statistics, default) or "normal" (the paper's truncated normal);
    see hvdcomp.levels.  norm: "l2" (the paper's setting) or "linf" (bucket max, as QSGDinf:
    with few bits it makes the top level usable).
    The statistics are those of the step just before; each rank computes them from its own
    gradients while encoding, the optimizer sums them across ranks, rank 0 fits, and the new
    table is broadcast, so every rank holds an identical table with a new version number.
    """

    def __init__(self, bits: int = 3, bucket_size: int = 8192, entropy: bool = False,
                 refit_steps: tuple = (100, 2000), refit_every: int = 10000,
                 model: str = "hist", norm: str = "l2"):
        super().__init__(bits, bucket_size, entropy)
        if norm not in ("l2", "linf"):
            raise ValueError(f"norm must be 'l2' or 'linf', got {norm!r}")
        self.norm = norm
        if refit_every < 0 or any(int(s) < 1 for s in refit_steps):
            raise ValueError("refit_steps must be >= 1 and refit_every >= 0 (0: never)")
        if model not in ("hist", "normal"):
            raise ValueError(f"model must be 'hist' or 'normal', got {model!r}")
        self.refit_steps = tuple(int(s) for s in refit_steps)
        self.refit_every = int(refit_every)
        self.model = model
        self._stats = self.empty_stats()
        self._observed = False

    def empty_stats(self) -> np.ndarray:
        """Zero statistics of the right size (3 for the normal model, 768 binned)."""
        return np.zeros(3 if self.model == "normal" else 3 * (len(L.HIST_EDGES) - 1))

    def statistics(self, grad: torch.Tensor) -> np.ndarray:
        """This gradient's contribution to the fit (summable across tensors and ranks):
        float64 NumPy (3,) for model "normal" (levels.bucket_stats), (768,) for "hist"
        (levels.histogram_stats).  With a kernel backend for the gradient's device
        (hvdcomp.backends.k_stats) the per-element terms are the reference's and the sums are
        in the kernels' fixed order (equal to a few float64 ulps; deterministic)."""
        x = grad.detach().reshape(-1).float()
        be = kernel_backend(x.device)
        if be is not None:      # kernels/stats.cu: the same statistics, sums in a fixed order
            fn = k_stats.bucket_stats if self.model == "normal" else k_stats.histogram_stats
            return fn(be.backend, x, self.bucket_size, self.norm).cpu().numpy()
        if self.model == "normal":
            return L.bucket_stats(x, self.bucket_size, self.norm)
        return L.histogram_stats(x, self.bucket_size, self.norm)

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

    def fit(self, stats) -> np.ndarray:
        raise NotImplementedError


@register("alq")
class ALQ(_Adaptive):
    """ALQ: levels fitted by coordinate descent on the expected variance (Faghri et al.,
    NeurIPS 2020, Sec. 3.1).  Starts from NUQSGD's table until the first refit."""
    codec = CODECS["alq"]

    def fit(self, stats):
        return L.fit_alq(stats, self.bits)


@register("amq")
class AMQ(_Adaptive):
    """AMQ: exponential levels whose multiplier p is fitted to the expected variance
    (Faghri et al., NeurIPS 2020, Sec. 3.2).  Starts from p = 0.5."""
    codec = CODECS["amq"]

    def fit(self, stats):
        return L.fit_amq(stats, self.bits)
