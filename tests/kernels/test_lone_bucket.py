"""The references' bucket layouts for a tensor smaller than one bucket: the same values as
a short bucket_size would give (hand-worked: one bucket holds every element), in memory
proportional to the tensor, not to bucket_size (a 2^31 bucket once padded a 100-element
tensor to 16 GiB of float64 zeros)."""
import resource

import torch

from hvdcomp.ops import bucket_width, padded_buckets
from hvdcomp.ops import dithered as D
from hvdcomp.ops import quantize as Q
from hvdcomp.ops import level_stats as S
from hvdcomp.ops import ternary as T

HUGE = 2**31


def test_bucket_width():
    assert bucket_width(100, HUGE) == 100
    assert bucket_width(100, 100) == 100
    assert bucket_width(101, 100) == 100
    assert bucket_width(0, HUGE) == HUGE          # no bucket: nothing is allocated


def test_padded_buckets_hand_worked():
    v = torch.tensor([1, 2, 3])
    assert torch.equal(padded_buckets(v, 2), torch.tensor([[1, 2], [3, 0]]))
    assert torch.equal(padded_buckets(v, 3), torch.tensor([[1, 2, 3]]))
    assert torch.equal(padded_buckets(v, HUGE), torch.tensor([[1, 2, 3]]))
    assert padded_buckets(v[:0], 5).shape == (0, 5)
    assert padded_buckets(v.double(), 2).dtype == torch.float64


def test_lone_bucket_references_equal_their_hand_worked_values_without_padding():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    g = torch.randn(100, generator=torch.Generator().manual_seed(3))
    a64 = g.double().abs()
    # one bucket: the scale is the mean |g| (float64 sum, one rounding)
    assert torch.equal(T.signef_scales.reference(g, None, HUGE),
                       (a64.sum() / 100).float().reshape(1))
    s, t = T.terngrad_scales.reference(g, 0.0, HUGE)
    assert torch.equal(s, g.abs().max().reshape(1))
    assert torch.equal(Q.bucket_norms.reference(g, HUGE, "linf"), g.abs().max().reshape(1))
    assert torch.equal(Q.bucket_norms.reference(g, HUGE, "l2"),
                       a64.pow(2).sum().sqrt().float().reshape(1))
    assert torch.equal(S.bucket_norms64.reference(g, HUGE, "l2"), a64.pow(2).sum().sqrt().reshape(1))
    st = S.bucket_stats.reference(g, HUGE, "l2")
    nrm2 = a64.pow(2).sum()
    # w = ||b||^2 for every coordinate, v = x / ||b||: [n w, ||b|| sum x, sum x^2]
    assert torch.allclose(st, torch.stack([nrm2 * 100, nrm2.sqrt() * g.double().sum(), nrm2]),
                          rtol=1e-12)
    assert torch.equal(D.bucket_steps.reference(g, 3, HUGE),
                       (g.abs().max() / D._levels(3)).clamp(max=D.max_step(3)).reshape(1))
    q = torch.randint(-100, 100, (100,))
    w = torch.randint(0, 2**32, (100,))
    assert int(D.bucket_checksums(q, w, HUGE)) == \
        sum(((int(a) * int(b)) & 0xFFFFFFFF) for a, b in zip(q, w)) & 0xFFFFFFFF
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert grown_kib < 512 * 1024, grown_kib       # not a padded 2^31 row (8-16 GiB)
