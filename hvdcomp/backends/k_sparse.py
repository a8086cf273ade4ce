"""Launchers of kernels/sparse.cu: the Golomb-Rice index section (hvdcomp/codecs/sparse.py)
on a kernel backend.

Every function takes the backend object first (``be``: ``host.backend`` or ``cuda.backend``)
and works on tensors of that backend's device.  The format's decisions (Rice parameter
choice, header, validation order and messages) are hvdcomp.codecs.sparse's functions, called
here; the kernels compute the gaps, the sums the parameter choice needs, the streams, and on
decoding the terminator positions and the gaps.

    encode(be, idx, numel, k=-1)  -> uint8 section (tensor on idx's device), bit for bit
                                     encode_indices_reference(idx, numel, k)
    decode(be, section, numel)    -> int64 indices (tensor on be's device), equal to
                                     decode_indices_reference(section, numel); same errors
"""
from __future__ import annotations


import numpy as np
import torch

from ._common import BLOCK, check_int, check_tensor, grid_for

__all__ = ["encode", "decode", "GROUP"]

GROUP = 256              # indices per thread in the per-index kernels


def _ngroups(m: int) -> int:
    return (m + GROUP - 1) // GROUP


def encode(be, idx: torch.Tensor, numel: int, k: int = -1) -> torch.Tensor:
    """The index section of ``idx`` (int64 (m,), strictly increasing, in [0, numel)) as a
    uint8 tensor on idx's device, equal byte for byte to ``encode_indices_reference``.
    numel: 0..2**63-1; k: -1 (choose, hvdcomp.codecs.sparse.rice_parameter's rule) or 0..62.
    Raises ValueError exactly as the reference (same checks, same order)."""
    from ..codecs import sparse as S
    numel = int(numel)
    if numel < 0 or numel >= 2**63:
        raise ValueError(f"numel must be in 0..2**63-1, got {numel}")
    k = check_int(k, "k", -2**31, 2**31 - 1)
    idx = check_tensor(be, idx, "indices", torch.int64)
    dev = idx.device
    m = idx.numel()
    if m:
        first, last = int(idx[0]), int(idx[-1])
        if first < 0 or last >= numel:
            raise ValueError(f"indices must lie in [0, {numel}), got {first}..{last}")
    gaps = torch.empty(m, dtype=torch.int64, device=dev)
    ng = _ngroups(m)
    if m:
        bad = torch.empty(ng, dtype=torch.int32, device=dev)
        be.launch("hvd_sparse_gaps", grid_for(ng, 64), 64, (idx, m, GROUP, gaps, bad))
        if m > 1 and bool(bad.any()):
            raise ValueError("indices must be strictly increasing (sorted, no duplicates)")
    if k < 0 and m:
        total = last + 1 - m                          # the exact sum of the gaps
        if total < 2**53:
            fsum = float(total)                       # what np.sum in float64 gives, exactly
        else:                                         # rounding depends on NumPy's order
            fsum = float(np.sum(gaps.cpu().numpy().astype(np.float64)))
        k0 = S.kiely_parameter(fsum / m)
        sums = torch.empty(3 * ng, dtype=torch.int64, device=dev)
        be.launch("hvd_sparse_rice_sums", grid_for(ng, 64), 64, (gaps, m, GROUP, k0, sums))
        qs = sums.view(ng, 3).sum(dim=0).tolist()
        k = S.best_rice_parameter(m, fsum, lambda kk: qs[kk - k0 + 1])
    elif k < 0:
        k = 0
    if not 0 <= k <= S.MAX_RICE_K:
        raise ValueError(f"Rice parameter must be in 0..{S.MAX_RICE_K}, got {k}")
    if m == 0:
        k = 0
    head = S.index_section_head(k, m, numel)
    head_t = torch.frombuffer(bytearray(head), dtype=torch.uint8)
    if m == 0:
        return head_t.to(dev)
    ends = torch.empty(m, dtype=torch.int64, device=dev)
    be.launch("hvd_sparse_unary_len", grid_for(m), BLOCK, (gaps, m, k, ends))
    torch.cumsum(ends, 0, out=ends)
    total_bits = int(ends[-1])
    ubytes = (total_bits + 7) // 8
    rbytes = (m * k + 7) // 8
    h = len(head)
    out = torch.empty(h + ubytes + rbytes, dtype=torch.uint8, device=dev)
    out[:h] = head_t.to(dev)
    be.launch("hvd_sparse_unary", grid_for((ubytes + 7) // 8), BLOCK,
              (ends, m, total_bits, out[h:h + ubytes], ubytes))
    if k:
        be.launch("hvd_sparse_remainders", grid_for((rbytes + 7) // 8), BLOCK,
                  (gaps, m, k, out[h + ubytes:], rbytes))
    return out


def decode(be, section, numel: int, device=None) -> torch.Tensor:
    """The int64 indices of an index section (bytes, uint8 numpy array or tensor), as a
    tensor on ``device`` (default: the section's device if a tensor, else the backend's),
    equal to ``decode_indices_reference(section, numel)``.  Raises WireFormatError where the
    reference does, with the same messages."""
    from ..codecs import sparse as S
    from ..errors import WireFormatError
    if isinstance(section, torch.Tensor):
        sec_t = section.detach().reshape(-1)
        if sec_t.dtype != torch.uint8:
            sec_t = sec_t.contiguous().view(torch.uint8)
        b = sec_t.cpu().numpy()
    else:
        b = S._as_bytes(section)
        sec_t = None
    dev = torch.device(device) if device is not None else (
        sec_t.device if sec_t is not None else torch.device(be.device_type))
    numel = int(numel)
    k, m = S.index_section_header(b, numel)
    off = 1 + S.count_width(numel)
    if m == 0:
        S.check_empty_section(b, k, off)
        return torch.zeros(0, dtype=torch.int64, device=dev)
    rbytes = (m * k + 7) // 8
    ubytes = b.size - off - rbytes
    S.check_unary_size(b.size, m, k, ubytes)
    if sec_t is None or sec_t.device != dev:
        sec_t = torch.from_numpy(b if b.flags.writeable else b.copy()).to(dev)
    sec_t = check_tensor(be, sec_t, "section", torch.uint8, b.size)
    u = sec_t[off:off + ubytes]
    nw = (ubytes + 7) // 8
    counts = torch.empty(nw, dtype=torch.int64, device=dev)
    be.launch("hvd_sparse_zero_count", grid_for(nw), BLOCK, (u, ubytes, counts))
    rank0 = torch.zeros(nw + 1, dtype=torch.int64, device=dev)
    torch.cumsum(counts, 0, out=rank0[1:])
    nzeros = int(rank0[-1])
    if nzeros < m:
        raise WireFormatError(f"unary stream holds {nzeros} terminators, expected {m}")
    z = torch.empty(m, dtype=torch.int64, device=dev)
    be.launch("hvd_sparse_zero_pos", grid_for(nw), BLOCK, (u, ubytes, rank0, m, z))
    last = int(z[-1])
    S.check_unary_end(b[off:off + ubytes], last, ubytes)
    ng = _ngroups(m)
    gp1 = torch.empty(m, dtype=torch.int64, device=dev)
    bad = torch.empty(ng, dtype=torch.int32, device=dev)
    rem = sec_t[off + ubytes:] if rbytes else sec_t[:1]      # a valid pointer when k = 0
    qmax = (numel - 1) >> k
    be.launch("hvd_sparse_decode_gaps", grid_for(ng, 64), 64,
              (z, m, rem, rbytes, k, qmax, GROUP, gp1, bad))
    if bool(bad.any()):
        raise WireFormatError(f"index gap out of range for a tensor of {numel} elements")
    if k:
        S.check_packed_padding(b[off + ubytes:], m, k)
    idx = torch.cumsum(gp1, 0)
    idx -= 1
    if (m > 1 and not bool((idx[1:] > idx[:-1]).all())) or int(idx[0]) < 0 \
            or int(idx[-1]) >= numel:
        raise WireFormatError(f"indices reach beyond the tensor's {numel} elements")
    return idx
