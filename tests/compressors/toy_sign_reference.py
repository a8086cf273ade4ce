"""Single-process references for the toy compressor's multi-rank tests (toy_sign_worker.py,
toy_sign_ddp_worker.py): toy_sign's closed form, over the allgather and the reduce-scatter,
in float64."""
import torch


def closed_form(grads):
    """mean over ranks of mean(|g|) * (+1 where g >= 0 else -1), in float64."""
    acc = 0
    for g in grads:
        g = g.double()
        acc = acc + g.abs().mean() * torch.where(g >= 0, 1.0, -1.0).double()
    return acc / len(grads)


def cuts(n, size):
    """Where the reduce-scatter cuts a tensor of ``n`` elements alone in its fusion bucket
    among ``size`` ranks, for a unit of one element: cut j at the integer nearest to
    ``j * n / size`` (half-way: up); shard j is ``[cuts[j], cuts[j + 1])``, rank j's."""
    return [(j * n + size // 2) // size for j in range(size + 1)]


def closed_form_rs(grads):
    """The reduce-scatter's average, in float64: in each shard, the owner's average ``a``
    of the ranks' pieces (closed_form of the pieces: each piece has a scale of its own),
    re-encoded by the same rule: ``mean(|a|) * (+1 where a >= 0 else -1)``."""
    flat = [g.double().reshape(-1) for g in grads]
    n = flat[0].numel()
    c = cuts(n, len(grads))
    out = torch.zeros(n, dtype=torch.float64)
    for lo, hi in zip(c, c[1:]):
        if hi > lo:
            a = closed_form([f[lo:hi] for f in flat])
            out[lo:hi] = a.abs().mean() * torch.where(a >= 0, 1.0, -1.0).double()
    return out


def close(got, want):
    """Equal up to float32 rounding of the scales (the average of +-s_r cancels)."""
    return torch.allclose(got.double().reshape(-1), want.reshape(-1), rtol=0,
                          atol=1e-6 * float(want.abs().max()) + 1e-12)
