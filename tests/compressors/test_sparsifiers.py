"""Top-k, random-k and DGC (hvdcomp.compressors.sparsifiers) against hand-worked cases and an
independent NumPy reference written here from Lin et al., ICLR 2018 (arXiv 1712.01887):

    clip (Sec. 3.2):     g <- g * f32(T / ||g||)  if ||g|| > T = clip_norm / sqrt(N)
    momentum (Sec. 3.2): u <- m u + g;  v <- v + u          (without correction: v <- v + g)
    select:              exact top-k of |v| among nonzeros, ties by the lower index,
                         k = max(1, ceil(density * n))
    send v[idx];         v[idx] <- v[idx] - decoded;  masking (Sec. 3.3): u[idx] <- 0
    warm-up (Sec. 3.3):  density max(d, 0.25 ** (stage + 1)) in stages 0..3, then d

The hand-worked cases use dyadic numbers, so every float32 operation is exact.
"""
import io
import math

import numpy as np
import pytest
import torch

import hvdcomp
from hvdcomp import ConfigError, WireFormatError
from hvdcomp.compressors.protocols import MomentumCorrection
from hvdcomp.compressors.sparsifiers import DGC, RandK, TopK
from hvdcomp.philox import random_words
from hvdcomp.wire import FLAG_NONFINITE, Message

F32 = np.float32



def set_momentum(c, factors):
    """Momentum factors for the compressors that apply momentum themselves (DGC); the
    others (top-k, random-k) do not take any."""
    if isinstance(c, MomentumCorrection):
        c.set_momentum(factors)

def key(name="layer.weight", step=0, rank=0, tensor_id=2, seed=5, world_size=4):
    return hvdcomp.TensorKey(name=name, tensor_id=tensor_id, step=step, rank=rank,
                             world_size=world_size, seed=seed)


def roundtrip(c, msg, k):
    """What a separate receiver adds into a zero accumulator for this message."""
    out = torch.zeros(msg.numel)
    assert c.decode(Message.from_bytes(msg.to_bytes()), k, out)
    return out


def sent(c, msg, k):
    """(indices, values) of a top-k / DGC message, decoded by a fresh receiver."""
    m = Message.from_bytes(msg.to_bytes())
    m.expect(codec=c.codec, bits=c.value_bits)
    idx, vals = hvdcomp.get(c.spec()).decode_sparse(m)      # a receiver with no state
    return idx.tolist(), vals.tolist()


# --------------------------------------------------------------------------------------------
# independent NumPy reference
# --------------------------------------------------------------------------------------------

def np_k(density, n):
    return 0 if n == 0 else min(n, max(1, math.ceil(round(density * n, 6))))


def np_topk(x, k):
    """Exact top-k of |x| among nonzeros, ties by lower index; indices ascending."""
    mag = np.abs(np.asarray(x, F32))
    nz = np.flatnonzero(mag > 0)
    order = nz[np.lexsort((nz, -mag[nz]))][:k]
    return np.sort(order)


def np_values(vals, fp16):
    """What the receivers decode of the sent values; ``fp16``: False / True (fp32 / fp16)
    or a ``values`` setting ("int8", "int4": blocks of 256, scale = the block's largest
    magnitude, q = round-half-even((v / s) * Q), decoded (q / Q) * s, float32)."""
    mode = {False: "fp32", True: "fp16"}.get(fp16, fp16)
    vals = np.asarray(vals, F32)
    if mode == "fp32":
        return vals.copy()
    if mode == "fp16":
        return np.clip(vals, -65504, 65504).astype(np.float16).astype(F32)
    Q = F32({"int8": 127, "int4": 7}[mode])
    out = np.zeros_like(vals)
    for i in range(0, vals.size, 256):
        v = vals[i:i + 256]
        s = F32(np.abs(v).max())
        q = np.round((v / s) * Q) if s > 0 else np.zeros_like(v)
        out[i:i + 256] = (q / Q) * s
    return out


def np_dgc_step(g, u, v, *, m, k, clip=0.0, N=4, masking=True, accumulate=True,
                correction=True, fp16=False):
    """One DGC step of one rank: returns (idx, decoded values, new u, new v)."""
    g = np.asarray(g, F32).reshape(-1).copy()
    if clip > 0:
        norm = math.sqrt(float(np.sum(g.astype(np.float64) ** 2)))
        thr = clip / math.sqrt(N)
        if norm > thr:
            g = (g * F32(thr / norm)).astype(F32)
    mm = m if correction else 0.0
    if mm > 0:
        u = g.copy() if u is None else (u * F32(mm) + g).astype(F32)
        add = u
    else:
        u, add = None, g
    v = add.copy() if (v is None or not accumulate) else (v + add).astype(F32)
    idx = np_topk(v, k)
    dec = np_values(v[idx], fp16)
    if u is not None and masking:
        u = u.copy()
        u[idx] = 0
    v = v.copy()
    v[idx] = v[idx] - dec
    return idx, dec, u, (v if accumulate else None)


# --------------------------------------------------------------------------------------------
# DGC: momentum correction and masking by hand
# --------------------------------------------------------------------------------------------

def test_momentum_correction_and_masking_by_hand():
    c = DGC(density=0.25, sample_ratio=0.0)          # k = 1 of 4
    c.set_momentum({"w": 0.5})
    g = [[1, -2, .5, .25], [.5, 1, -1, 0], [0, 0, 0, 0], [0, 0, -.1875, .53125]]
    # step 0: u = g = [1,-2,.5,.25]; v = u; top-1: index 1 (-2).  mask: u = v = [1,0,.5,.25]
    # step 1: u = .5 u + g = [1, 1, -.75, .125]; v = v + u = [2, 1, -.25, .375]: index 0 (2)
    #         u = [0, 1, -.75, .125]; v = [0, 1, -.25, .375]
    # step 2: u = .5 u = [0, .5, -.375, .0625]; v = [0, 1.5, -.625, .4375]: index 1 (1.5)
    #         u = [0, 0, -.375, .0625]; v = [0, 0, -.625, .4375]
    # step 3: u = .5 u + g = [0, 0, -.375, .5625]; v = [0, 0, -1, 1]: a tie, the lower index
    #         2 (-1) goes;  u = [0, 0, 0, .5625]; v = [0, 0, 0, 1]
    want_sent = [([1], [-2.0]), ([0], [2.0]), ([1], [1.5]), ([2], [-1.0])]
    want_u = [[1, 0, .5, .25], [0, 1, -.75, .125], [0, 0, -.375, .0625], [0, 0, 0, .5625]]
    want_v = [[1, 0, .5, .25], [0, 1, -.25, .375], [0, 0, -.625, .4375], [0, 0, 0, 1]]
    for step in range(4):
        k = key("w", step)
        msg = c.encode(torch.tensor(g[step], dtype=torch.float32), k)
        assert sent(c, msg, k) == want_sent[step], step
        assert c.momentum_buffer("w").tolist() == want_u[step], step
        assert c.accumulation("w").tolist() == want_v[step], step


def test_without_masking_by_hand():
    c = DGC(density=0.25, sample_ratio=0.0, masking=False)
    c.set_momentum({"w": 0.5})
    # step 0 as above but u keeps -2: u = [1, -2, .5, .25], v = [1, 0, .5, .25]
    # step 1: u = [.5+.5, -1+1, .25-1, .125] = [1, 0, -.75, .125]; v = [2, 0, -.25, .375]
    c.encode(torch.tensor([1, -2, .5, .25]), key("w", 0))
    assert c.momentum_buffer("w").tolist() == [1, -2, .5, .25]
    msg = c.encode(torch.tensor([.5, 1, -1, 0]), key("w", 1))
    assert sent(c, msg, key("w", 1)) == ([0], [2.0])
    assert c.momentum_buffer("w").tolist() == [1, 0, -.75, .125]
    assert c.accumulation("w").tolist() == [0, 0, -.25, .375]


@pytest.mark.parametrize("masking", [True, False])
def test_dense_masking_removes_momentum(masking):
    """At density 1 every coordinate is sent every step, so masking (u[idx] <- 0) clears
    the whole momentum: DGC sends the plain gradient g_t (SGD without momentum, an update
    1 - m times momentum SGD's in steady state).  Without masking it sends
    u_t = m u_{t-1} + g_t, momentum SGD's update.  This is why DGC's dense warm-up
    stages (density 0.25, 0.0625, ...) train slower per step than momentum SGD."""
    m = 0.5
    c = DGC(density=1.0, sample_ratio=0.0, masking=masking)
    c.set_momentum({"w": m})
    g = [[1, -2, .5, .25], [.5, 1, -1, 0], [.25, .25, .5, -1]]
    u = np.zeros(4)
    for step, gt in enumerate(g):
        u = m * u + np.asarray(gt)                 # momentum SGD's buffer, by hand
        want = gt if masking else u.tolist()
        k = key("w", step)
        idx, vals = sent(c, c.encode(torch.tensor(gt, dtype=torch.float32), k), k)
        full = np.zeros(4)
        full[idx] = vals
        assert full.tolist() == list(map(float, want)), step


def test_without_correction_accumulates_gradients_by_hand():
    c = DGC(density=0.25, sample_ratio=0.0, momentum_correction=False, momentum=0.9)
    assert c.handles_momentum is False and DGC().handles_momentum is True
    # v = g = [1,-2,.5,.25] -> send -2, v = [1,0,.5,.25]; v += [.5,1,-1,0] = [1.5,1,-.5,.25]
    c.encode(torch.tensor([1, -2, .5, .25]), key("w", 0))
    msg = c.encode(torch.tensor([.5, 1, -1, 0]), key("w", 1))
    assert sent(c, msg, key("w", 1)) == ([0], [1.5])
    assert c.momentum_buffer("w") is None
    assert c.accumulation("w").tolist() == [0, 1, -.5, .25]


def test_without_accumulation_drops_the_rest():
    c = DGC(density=0.25, sample_ratio=0.0, accumulate=False)
    c.set_momentum({"w": 0.5})
    c.encode(torch.tensor([1, -2, .5, .25]), key("w", 0))
    # u = [1, 0, .5, .25] (masked); v is not kept: v = u = .5 u + g = [1, 1, -.75, .125]
    msg = c.encode(torch.tensor([.5, 1, -1, 0]), key("w", 1))
    assert sent(c, msg, key("w", 1)) == ([0], [1.0])
    assert c.accumulation("w") is None


@pytest.mark.parametrize("opts", [
    dict(), dict(masking=False), dict(accumulate=False), dict(correction=False),
    dict(clip=0.05), dict(fp16=True), dict(clip=1.0, fp16=True, masking=False),
    dict(fp16="int8"), dict(fp16="int4", masking=False)])
def test_dgc_matches_numpy_over_steps(opts):
    n, m, density, N = 3000, 0.9, 0.01, 4
    spec = dict(density=density, sample_ratio=0.01, masking=opts.get("masking", True),
                accumulate=opts.get("accumulate", True),
                momentum_correction=opts.get("correction", True),
                clip_norm=opts.get("clip", 0.0),
                values={False: "fp32", True: "fp16"}.get(opts.get("fp16", False),
                                                         opts.get("fp16")))
    c = DGC(**spec)
    c.set_momentum({"w": m})
    gen = torch.Generator().manual_seed(3)
    u = v = None
    for step in range(8):
        g = torch.randn(30, 100, generator=gen) * (1 + step)
        k = key("w", step, world_size=N)
        msg = c.encode(g, k)
        idx, dec, u, v = np_dgc_step(g.numpy(), u, v, m=m, k=np_k(density, n), N=N, **opts)
        got_idx, got_vals = sent(c, msg, k)
        assert got_idx == idx.tolist(), step
        assert np.array_equal(np.array(got_vals, F32), dec), step
        mu, mv = c.momentum_buffer("w"), c.accumulation("w")
        assert (mu is None) == (u is None) and (mv is None) == (v is None)
        if u is not None:
            assert np.array_equal(mu.numpy().reshape(-1), u), step
        if v is not None:
            assert np.array_equal(mv.numpy().reshape(-1), v), step


# --------------------------------------------------------------------------------------------
# DGC: clipping, warm-up, threshold sampling
# --------------------------------------------------------------------------------------------

def test_local_clipping_by_hand():
    # ||[3, 4]|| = 5 > T = 2 / sqrt(4) = 1: g <- g * f32(1/5) = [f32(3*f32(.2)), f32(4*f32(.2))]
    c = DGC(density=1.0, clip_norm=2.0)
    k = key("w", 0, world_size=4)
    out = roundtrip(c, c.encode(torch.tensor([3.0, 4.0, 0.0]), k), k)
    want = [float(F32(3) * F32(0.2)), float(F32(4) * F32(0.2)), 0.0]
    assert out.tolist() == want
    assert abs(math.hypot(*want[:2]) - 1.0) < 1e-7
    # below the threshold nothing changes: ||[.3, .4]|| = .5 <= 1
    out = roundtrip(c, c.encode(torch.tensor([0.3, 0.4, 0.0]), key("x", 0)), key("x", 0))
    assert out.tolist() == [float(F32(0.3)), float(F32(0.4)), 0.0]
    # the threshold scales with N^-1/2: with N = 16, T = 2 / 4 = .5: [3, 4] * f32(.5 / 5)
    k16 = key("y", 0, world_size=16)
    out = roundtrip(c, c.encode(torch.tensor([3.0, 4.0, 0.0]), k16), k16)
    assert out.tolist() == [float(F32(3) * F32(0.1)), float(F32(4) * F32(0.1)), 0.0]
    assert abs(float(out.norm()) - 0.5) < 1e-7


def test_clipping_happens_before_accumulation():
    # T = 2 / sqrt(4) = 1, k = 1 of 2, no momentum: each step adds the CLIPPED gradient
    # [f32(30 * f32(.02)), f32(40 * f32(.02))] = [.6, .8] to v.
    # step 0: v = [.6, .8] -> sends index 1 (.8), keeps v = [.6, 0]
    # step 1: v = [.6 + .6, .8] -> sends index 0 (1.2)   (unclipped it would be 30 + 30)
    c = DGC(density=0.5, clip_norm=2.0, sample_ratio=0.0)
    a, b = F32(30) * F32(1 / 50), F32(40) * F32(1 / 50)
    msg = c.encode(torch.tensor([30.0, 40.0]), key("w", 0, world_size=4))
    assert sent(c, msg, key("w", 0)) == ([1], [float(b)])
    assert c.accumulation("w").tolist() == [float(a), 0.0]
    msg = c.encode(torch.tensor([30.0, 40.0]), key("w", 1, world_size=4))
    assert sent(c, msg, key("w", 1)) == ([0], [float(F32(a + a))])
    assert c.accumulation("w").tolist() == [0.0, float(b)]


def test_warmup_schedule_values():
    c = DGC(density=0.001, warmup_epochs=4, steps_per_epoch=10)
    dens = [c.density_at(s) for s in range(60)]
    # the paper's sparsities 75 %, 93.75 %, 98.4375 %, 99.6 %, then 99.9 %
    assert dens[:10] == [0.25] * 10 and dens[10:20] == [0.0625] * 10
    assert dens[20:30] == [0.015625] * 10 and dens[30:40] == [0.00390625] * 10
    assert dens[40:] == [0.001] * 20
    assert [round(100 * (1 - dens[s]), 4) for s in (0, 10, 20, 30, 40)] == \
        [75.0, 93.75, 98.4375, 99.6094, 99.9]
    # by step: 8 warm-up steps in 4 stages of 2
    c = DGC(density=0.001, warmup_epochs=4, warmup_steps=8)
    assert [c.density_at(s) for s in range(10)] == [.25, .25, .0625, .0625, .015625,
                                                     .015625, .00390625, .00390625, .001, .001]
    # a final density above the schedule's value wins; no warm-up by default
    assert DGC(density=0.1, warmup_epochs=4, steps_per_epoch=1).density_at(1) == 0.1
    assert DGC(density=0.001).density_at(0) == 0.001


def test_warmup_sets_the_number_sent():
    n = 4096
    c = DGC(density=0.001, warmup_epochs=4, steps_per_epoch=2, accumulate=False)
    counts = []
    for step in range(10):
        g = torch.randn(64, 64)
        k = key("w", step)
        counts.append(len(sent(c, c.encode(g, k), k)[0]))
    # ceil(d * 4096): 1024, 256, 64, 16, then ceil(4.096) = 5
    assert counts == [1024, 1024, 256, 256, 64, 64, 16, 16, 5, 5]


@pytest.mark.parametrize("ratio", [0.001, 0.01, 0.1])
def test_sampled_threshold_selects_exact_topk(real_grad, ratio):
    """With exact_k (default) sampling only makes selection cheap: the result is the exact
    top-k of |v| (numpy), on the real gradient, on Gaussian noise and on a tensor of few
    distinct magnitudes (many ties at the threshold)."""
    gen = torch.Generator().manual_seed(5)
    ties = (torch.randint(-3, 4, (200, 50), generator=gen) * 0.5).float()
    sparse = torch.zeros(100, 100)
    sparse.view(-1)[::997] = 1.0                          # 11 nonzeros, fewer than k = 100
    for density in (0.001, 0.01):
        for name, g in (("real", real_grad), ("noise", torch.randn(100, 300, generator=gen)),
                        ("ties", ties), ("sparse", sparse)):
            c = DGC(density=density, sample_ratio=ratio, accumulate=False)
            for step in range(3):
                k = key(name, step)
                got = sent(c, c.encode(g, k), k)[0]
                want = np_topk(g.numpy().reshape(-1), np_k(density, g.numel()))
                assert got == want.tolist(), (name, density, step)
    assert len(want) == 11


def test_sampled_threshold_density_paper_mode():
    """exact_k=False (the paper's single pass): the number sent is min(count, k), count the
    coordinates above the k_s-th largest of s sampled magnitudes.  For continuous values
    count / n ~ Beta(k_s, s - k_s + 1) (order statistic of s uniforms); the mean over 300
    steps must lie within 4 standard errors of that model's mean (computed here from numpy
    Beta draws), and no step may send more than k."""
    n, density, ratio, steps = 235200, 0.001, 0.01, 300
    g = torch.randn(300, 784, generator=torch.Generator().manual_seed(9))
    c = DGC(density=density, sample_ratio=ratio, exact_k=False, accumulate=False)
    k = np_k(density, n)
    s = math.ceil(ratio * n)
    ks = math.ceil(s * k / n)
    got = np.array([len(sent(c, c.encode(g, key("w", t)), key("w", t))[0])
                    for t in range(steps)], dtype=np.float64) / k
    model = np.minimum(np.random.default_rng(0).beta(ks, s - ks + 1, 400_000) * n, k) / k
    se = model.std() / math.sqrt(steps)
    print(f"\n  paper-mode DGC density: mean {got.mean():.3f} of requested (model "
          f"{model.mean():.3f} +- {4 * se:.3f}), min {got.min():.3f}, max {got.max():.3f}")
    assert got.max() <= 1.0
    assert abs(got.mean() - model.mean()) <= 4 * se
    # the stated tolerance in plain words: on average at least 75 % of the requested density
    assert got.mean() >= 0.75


# --------------------------------------------------------------------------------------------
# top-k
# --------------------------------------------------------------------------------------------

def test_topk_ties_and_minimum_one():
    c = TopK(density=2 / 6)
    k = key()
    # |x| = 1, 2, 2, 2, 1, 0: three tie at 2, the two lowest indices (1, 2) go
    assert sent(c, c.encode(torch.tensor([1., -2, 2, 2, -1, 0]), k), k) == ([1, 2], [-2., 2.])
    # 10 elements at density 0.001 still send one: the largest
    c = TopK(density=0.001, error_feedback=False)
    x = torch.tensor([0.1, -0.7, 0.3, 0.7, 0, 0, 0, 0, 0, 0.2])
    assert sent(c, c.encode(x, k), k) == ([1], [float(F32(-0.7))])


@pytest.mark.parametrize("values", ["fp32", "fp16", "int8", "int4"])
def test_topk_error_feedback_matches_numpy(values):
    c = TopK(density=0.02, values=values)
    gen = torch.Generator().manual_seed(1)
    e = np.zeros(2000, F32)
    total_sent = np.zeros(2000, np.float64)
    total_g = np.zeros(2000, np.float64)
    for step in range(6):
        g = torch.randn(40, 50, generator=gen)
        k = key("t", step)
        out = roundtrip(c, c.encode(g, k), k).numpy()
        p = (g.numpy().reshape(-1) + e).astype(F32)
        idx = np_topk(p, 40)
        want = np.zeros(2000, F32)
        want[idx] = np_values(p[idx], values)
        assert np.array_equal(out, want), step
        e = p - want
        assert np.array_equal(c.residual("t").numpy().reshape(-1), e)
        total_sent += out
        total_g += g.numpy().reshape(-1)
    # error feedback loses nothing: sum of what was sent = sum of gradients - residual
    assert np.allclose(total_sent, total_g - e, atol=1e-5)


def test_fp16_values_clamp_and_keep_the_rest():
    c = TopK(density=0.5, values="fp16")
    k = key()
    msg = c.encode(torch.tensor([1e5, -3.0, 0.0, 1 / 3]), k)
    assert msg.bits == 16
    assert sent(c, msg, k) == ([0, 1], [65504.0, -3.0])
    assert c.residual("layer.weight").tolist() == [1e5 - 65504.0, 0.0, 0.0, float(F32(1 / 3))]


# --------------------------------------------------------------------------------------------
# random-k
# --------------------------------------------------------------------------------------------

def ref_random_indices(n, k, kk):
    """First k distinct values of ((w_2j >> 1) << 32 | w_2j+1) mod n; or, when 4k > n, the
    k indices with the smallest word (stable); written from the docstring."""
    if k >= n:
        return list(range(n))
    kw = dict(seed=kk.seed, step=kk.step, rank=kk.rank, tensor_id=kk.tensor_id)
    if 4 * k > n:
        w = random_words(n, **kw).numpy()
        return sorted(np.argsort(w, kind="stable")[:k].tolist())
    seen, order, j = set(), [], 0
    while len(order) < k:
        w = random_words(2 * 256, offset=2 * j, **kw).tolist()
        for a, b in zip(w[0::2], w[1::2]):
            x = (((a >> 1) << 32) | b) % n
            if x not in seen and len(order) < k:
                seen.add(x)
                order.append(x)
        j += 256
    return sorted(order)


@pytest.mark.parametrize("n,density", [(1000, 0.01), (5000, 0.05), (100, 0.3), (64, 0.5),
                                       (10, 1.0), (7, 0.001)])
def test_randk_indices_regenerate_on_the_receiver(n, density):
    sender = RandK(density=density)
    receiver = RandK(density=density)             # another instance: no shared state
    g = torch.randn(n, generator=torch.Generator().manual_seed(n)) + 3.0   # no zeros
    seen = []
    for rank, step in [(0, 0), (1, 0), (0, 1), (3, 17)]:
        k = key("r", step, rank=rank)
        msg = sender.encode(g, k)
        assert msg.sections[0].size == 4 * np_k(density, n)   # values only: no indices
        out = torch.zeros(n)
        receiver.decode(Message.from_bytes(msg.to_bytes()), k, out)
        idx = np.flatnonzero(out.numpy())
        assert idx.tolist() == ref_random_indices(n, np_k(density, n), k)
        seen.append(tuple(idx))
    if math.comb(n, np_k(density, n)) > 10**6:
        assert len(set(seen)) == len(seen)          # rank and step change the draw


def test_randk_unbiased_scaling():
    """unbiased: E[decoded] = p (each coordinate is kept with probability k/n and scaled by
    n/k; variance p^2 (n/k - 1)).  Mean over 1000 steps within 5 standard errors."""
    n, T = 64, 1000
    c = RandK(density=0.25, unbiased=True, error_feedback=False)
    assert c.scale(n) == 4.0
    p = torch.linspace(-2, 2, n)
    acc = np.zeros(n)
    picks = np.zeros(n)
    for t in range(T):
        k = key("u", t)
        out = roundtrip(c, c.encode(p, k), k).numpy()
        acc += out
        picks += out != 0
    se = np.abs(p.numpy()) * math.sqrt(3 / T)
    assert np.all(np.abs(acc / T - p.numpy()) <= 5 * se + 1e-12)
    # every index is picked about T k / n = 250 times (binomial, 5 sigma = 68)
    nz = p.numpy() != 0
    assert np.all(np.abs(picks[nz] - 250) <= 5 * math.sqrt(T * 0.25 * 0.75))


def test_randk_error_feedback_residual():
    c = RandK(density=0.1, unbiased=True)
    g = torch.randn(50, generator=torch.Generator().manual_seed(2))
    k = key("e", 3)
    out = roundtrip(c, c.encode(g, k), k)
    # e = p - decoded, decoded = 10 * p on the 5 chosen indices
    idx = ref_random_indices(50, 5, k)
    want = g.clone()
    want[idx] = g[idx] - g[idx] * torch.tensor(10.0)
    assert torch.equal(c.residual("e"), want)
    assert torch.equal(out[idx], g[idx] * torch.tensor(10.0))


# --------------------------------------------------------------------------------------------
# all three: zeros, combine, NaN, state, bad input
# --------------------------------------------------------------------------------------------

SPECS = ["topk:density=0.01", "randk:density=0.01", "dgc:density=0.01,momentum=0.9",
         "topk:density=0.01,values=fp16", "randk:density=0.01,values=fp16,unbiased=true",
         "dgc:density=0.01,values=fp16,momentum=0.9,clip_norm=1,warmup_epochs=2,"
         "steps_per_epoch=2", "topk:density=0.01,values=int4", "randk:density=0.05,values=int8",
         "dgc:density=0.01,values=int8,momentum=0.9"]


@pytest.mark.parametrize("spec", SPECS)
def test_all_zero_gradient_sends_a_minimal_message(spec):
    c = hvdcomp.get(spec)
    k = key()
    msg = c.encode(torch.zeros(40, 50), k)
    buf = msg.to_bytes()
    # header 48 + shape 16 + section lengths + CRC 4; topk/dgc: 5-byte index section (k = 0,
    # m = 0) and no values; randk: one empty section
    assert len(buf) == (48 + 16 + 8 + 4 if c.name == "randk" else 48 + 16 + 16 + 5 + 4)
    assert not roundtrip(c, msg, k).any()
    st = c.state_dict()
    assert all(bool(torch.isfinite(t).all()) for d in st.values() for t in d.values())


@pytest.mark.parametrize("spec", SPECS[:3])
def test_rank_with_nothing_selected_combines(spec):
    """combine (the base class: decode in rank order): rank 0 sends nothing, ranks 1 and 2
    overlap; duplicates add up.  Expected from numpy's np.add.at of each rank's pairs."""
    n = 1000
    grads = [torch.zeros(n), torch.linspace(-1, 1, n), torch.linspace(-1, 1, n) ** 3]
    comps = [hvdcomp.get(spec) for _ in range(3)]
    msgs, keys, want = [], [], np.zeros(n, F32)
    for r in range(3):
        k = key("c", 4, rank=r, world_size=3)
        msg = Message.from_bytes(comps[r].encode(grads[r], k).to_bytes())
        single = roundtrip(hvdcomp.get(spec), msg, k).numpy()
        if r == 0:
            assert not single.any()
        np.add.at(want, np.flatnonzero(single), single[single != 0])
        msgs.append(msg)
        keys.append(k)
    out = torch.zeros(n)
    assert hvdcomp.get(spec).combine(msgs, keys, out)
    assert np.array_equal(out.numpy(), want)
    if comps[0].name != "randk":     # top-k: ranks 1 and 2 both pick the two ends
        assert out[0] == -2.0 and out[-1] == 2.0


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_nonfinite_keeps_the_state(spec, bad):
    c = hvdcomp.get(spec)
    set_momentum(c, {"w": 0.9})
    gen = torch.Generator().manual_seed(4)
    for step in range(2):
        c.encode(torch.randn(20, 60, generator=gen), key("w", step))
    before = c.state_dict()
    g = torch.randn(20, 60, generator=gen)
    g[3, 7] = bad
    msg = c.encode(g, key("w", 2))
    assert msg.flags & FLAG_NONFINITE and msg.sections == ()
    assert not c.decode(Message.from_bytes(msg.to_bytes()), key("w", 2), torch.zeros(1200))
    after = c.state_dict()
    for part in before:
        for name in before[part]:
            assert torch.equal(before[part][name], after[part][name])


@pytest.mark.parametrize("spec", ["topk:density=0.5", "randk:density=0.5", "dgc:density=0.5"])
def test_overflow_of_the_state_is_nonfinite(spec):
    c = hvdcomp.get(spec)
    set_momentum(c, {"w": 0.5})
    big = torch.full((4,), 3e38)
    c.encode(big, key("w", 0))                  # half is kept (3e38 each)
    before = c.state_dict()
    msg = c.encode(big, key("w", 1))            # 3e38 + 3e38 overflows float32
    assert msg.flags & FLAG_NONFINITE
    for part in before:
        for name in before[part]:
            assert torch.equal(before[part][name], c.state_dict()[part][name])


@pytest.mark.parametrize("spec", SPECS)
def test_state_dict_round_trip(spec):
    a, b = hvdcomp.get(spec), hvdcomp.get(spec)
    set_momentum(a, {"w": 0.9, "x": 0.9})
    set_momentum(b, {"w": 0.9, "x": 0.9})
    gen = torch.Generator().manual_seed(8)
    grads = [torch.randn(30, 40, generator=gen) for _ in range(6)]
    for step in range(3):
        for name in ("w", "x"):
            a.encode(grads[step], key(name, step))
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    buf.seek(0)
    b.load_state_dict(torch.load(buf))
    fresh = hvdcomp.get(spec)
    set_momentum(fresh, {"w": 0.9, "x": 0.9})
    differs = False
    for step in range(3, 6):
        for name in ("w", "x"):
            ma = a.encode(grads[step], key(name, step)).to_bytes()
            assert b.encode(grads[step], key(name, step)).to_bytes() == ma
            differs |= fresh.encode(grads[step], key(name, step)).to_bytes() != ma
    assert differs                                # the state mattered
    # state_dict holds copies
    sd = a.state_dict()
    part = next(iter(sd))
    sd[part]["w"].fill_(7.0)
    assert not torch.equal(a.state_dict()[part]["w"], sd[part]["w"])


@pytest.mark.parametrize("spec", ["topk", "randk", "dgc:momentum=0.9"])
def test_bad_state_raises(spec):
    c = hvdcomp.get(spec)
    c.encode(torch.randn(8, 8), key("w", 0))
    good = c.state_dict()
    part = next(iter(good))
    for bad in [{"nope": {}}, {part: {"w": torch.zeros(8, 8, dtype=torch.float64)}},
                {part: {"w": torch.zeros(4, 4)}}, {part: {"w": torch.full((8, 8), math.nan)}},
                {part: {"w": [0.0] * 64}}, {part: {3: torch.zeros(8, 8)}}, {part: []}, []]:
        with pytest.raises(ValueError):
            c.load_state_dict(bad)
        assert all(torch.equal(good[p][n], c.state_dict()[p][n]) for p in good for n in good[p])
    # a state loaded for a name not seen yet is checked at its next encode
    c2 = hvdcomp.get(spec)
    c2.load_state_dict({part: {"w": torch.zeros(4, 4)}})
    with pytest.raises(ValueError, match="shape"):
        c2.encode(torch.randn(8, 8), key("w", 1))


@pytest.mark.parametrize("spec", [
    "topk:density=0", "topk:density=1.5", "topk:density=nan", "topk:values=bf16",
    "randk:density=-0.1", "randk:unbiased=maybe", "dgc:sample_ratio=2", "dgc:momentum=1",
    "dgc:clip_norm=-1", "dgc:clip_norm=inf", "dgc:warmup_epochs=4", "dgc:warmup_epochs=-1",
    "dgc:warmup_epochs=4,steps_per_epoch=5,warmup_steps=10", "dgc:warmup_coeff=1",
    "dgc:warmup_coeff=0", "dgc:nonsense=1"])
def test_bad_settings(spec):
    with pytest.raises(ConfigError):
        hvdcomp.get(spec)


def test_bad_inputs():
    with pytest.raises(ValueError):
        TopK(density="0.1")
    with pytest.raises(ValueError):
        DGC(exact_k=1)
    with pytest.raises(ValueError):
        DGC().set_momentum({"w": 1.5})
    for c in (TopK(), RandK(), DGC()):
        with pytest.raises(TypeError):
            c.encode(torch.ones(4, 4, dtype=torch.int32), key())
        with pytest.raises(WireFormatError):
            c.combine([None], [key()], torch.zeros(16))


def test_specs_round_trip_and_registry():
    for spec in SPECS:
        c = hvdcomp.get(spec)
        assert hvdcomp.get(c.spec()).spec() == c.spec()
    assert {"topk", "randk", "dgc"} <= set(hvdcomp.available())
    assert hvdcomp.get("dgc:density=0.001,warmup_epochs=4,steps_per_epoch=31").density_at(31) \
        == 0.0625


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_other_dtypes_use_float32_values(dtype):
    x = torch.randn(10, 30, generator=torch.Generator().manual_seed(1)).to(dtype)
    for c in (TopK(density=0.1), DGC(density=0.1)):
        k = key()
        out = roundtrip(c, c.encode(x, k), k).numpy()
        xf = x.float().numpy().reshape(-1)
        idx = np_topk(xf, 30)
        want = np.zeros(300, F32)
        want[idx] = xf[idx]
        assert np.array_equal(out, want)


def test_non_contiguous_and_empty():
    x = torch.randn(30, 20).t()                    # non-contiguous
    c = TopK(density=0.05)
    k = key()
    out = roundtrip(c, c.encode(x, k), k)
    assert torch.equal(out[torch.from_numpy(np_topk(x.reshape(-1).numpy(), 30))],
                       x.reshape(-1)[torch.from_numpy(np_topk(x.reshape(-1).numpy(), 30))])
    for c in (TopK(), RandK(), DGC(), TopK(values="int4"), RandK(values="int8"),
              DGC(values="int4")):
        msg = c.encode(torch.zeros(0, 5), key("e"))
        assert roundtrip(c, msg, key("e")).numel() == 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("values", ["int8", "int4"])
def test_quantized_values_of_other_dtypes_and_layouts(dtype, values):
    # a half-precision / double, non-contiguous gradient: its float32 values, selected and
    # quantized as the NumPy reference does; a 1-element tensor sends its one value exactly
    x = torch.randn(30, 20, generator=torch.Generator().manual_seed(2)).t().to(dtype)
    c = TopK(density=0.1, values=values)
    k = key()
    out = roundtrip(c, c.encode(x, k), k).numpy()
    xf = x.float().reshape(-1).numpy()
    idx = np_topk(xf, 60)
    want = np.zeros(600, F32)
    want[idx] = np_values(xf[idx], values)
    assert np.array_equal(out, want)
    one = torch.tensor([-3.25], dtype=dtype)
    assert roundtrip(c, c.encode(one, key("one")), key("one")).tolist() == [-3.25]
