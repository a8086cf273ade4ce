"""uniformef (hvdcomp.compressors.uniformef): uniform quantization with error feedback.

Checked against an independent NumPy reference of the module docstring (steps, codes, decoded
values and residuals, bit for bit, over several steps of error feedback), the telescoping sum
of error feedback, the error bounds, the wire format's validation, the NaN policy and the
state's round trip."""
import math

import numpy as np
import pytest
import torch

import hvdcomp
from hvdcomp import ConfigError, Message, TensorKey, WireFormatError
from hvdcomp.compressors.base import REGISTRY
from hvdcomp.ops.bitpack import pack_bits
from hvdcomp.wire import CODECS, FLAG_ENTROPY, FLAG_NONFINITE

F32 = np.float32


def key(step=0, name="w", rank=0):
    return TensorKey(name=name, tensor_id=3, step=step, rank=rank, world_size=2, seed=5)


def reference_step(p32, bits, bs, v):
    """(steps float32 (nb,), q int64 (n,), x_hat float32 (n,)) by hand: the step of each
    bucket is max(float32(||p_b|| from a float64 sum) * float32(sqrt(12 v / n_b)),
    float32(max|p_b| / M)), 0 for a zero bucket; q = clamp(floor(float32(p / step) + 1/2))."""
    M = 2 ** (bits - 1) - 1
    steps = []
    for lo in range(0, p32.size, bs):
        b = p32[lo:lo + bs]
        norm = F32(np.sqrt(np.sum(b.astype(np.float64) ** 2)))
        star = F32(norm * F32(np.sqrt(12.0 * v / b.size)))
        by_max = F32(np.max(np.abs(b)) / F32(M))
        steps.append(F32(0) if by_max == 0 else max(star, by_max))
    return reference_codes(p32, np.array(steps, dtype=F32), bits, bs)


def reference_codes(p32, steps, bits, bs):
    """(steps, q int64 (n,), x_hat float32 (n,)) of ``p32`` with its bucket ``steps``:
    q = clamp(floor(float32(p / step) + 1/2), -M, M), 0 where the step is 0."""
    M = 2 ** (bits - 1) - 1
    d = np.repeat(steps, bs)[:p32.size]
    safe = np.where(d > 0, d, F32(1)).astype(F32)
    q = np.clip(np.floor(((p32 / safe).astype(F32) + F32(0.5)).astype(F32)), -M, M)
    return steps, q.astype(np.int64), (q.astype(F32) * d).astype(F32)


def trip(comp, x, k):
    return Message.from_bytes(comp.encode(x, k).to_bytes())


def decode(comp, msg, k, n):
    out = torch.zeros(n)
    assert comp.decode(msg, k, out) is True
    return out


def gradient(shape, seed):
    g = torch.Generator().manual_seed(seed)
    n = int(np.prod(shape))
    x = torch.randn(n, generator=g) * torch.exp(1.5 * torch.randn(n, generator=g))
    x[::9] = 0.0
    return x.reshape(shape).float()


def test_settings_and_registry():
    c = hvdcomp.get("uniformef")
    assert c.settings() == {"bits": 6, "bucket_size": 65536, "variance_target": 0.03,
                            "entropy": True, "step_scope": "bucket"}
    assert c.codec == CODECS["uniformef"] == 27 and c.biased and c.keeps_state
    assert hvdcomp.get(c.spec()).settings() == c.settings()
    for kw in (dict(bits=1), dict(bits=9), dict(bucket_size=0), dict(variance_target=0.0),
               dict(variance_target=-1.0), dict(variance_target=float("inf")),
               dict(entropy="maybe"), dict(step_scope="layer"), dict(step_scope=None)):
        with pytest.raises(ValueError):
            REGISTRY["uniformef"](**kw)
        with pytest.raises(ConfigError):
            hvdcomp.get("uniformef", **kw)


@pytest.mark.parametrize("bits,bs,v,entropy", [(6, 1000, 0.03, True), (8, 64, 0.001, False),
                                               (3, 7, 0.5, True), (2, 100, 0.1, False)])
def test_bit_exact_with_error_feedback(bits, bs, v, entropy):
    """Four steps of error feedback: the message's steps and codes, the decoded values and
    the residual equal the NumPy reference's; sum of decoded = sum of gradients - residual."""
    spec = f"uniformef:bits={bits},bucket_size={bs},variance_target={v},entropy={entropy}"
    comp = hvdcomp.get(spec)
    shape = (37, 61)
    e = np.zeros(int(np.prod(shape)), dtype=F32)
    sent = np.zeros_like(e, dtype=np.float64)
    total = np.zeros_like(sent)
    M = 2 ** (bits - 1) - 1
    for step in range(4):
        g = gradient(shape, step)
        p = (g.numpy().reshape(-1) + e).astype(F32)
        steps, q, x_hat = reference_step(p, bits, bs, v)
        msg = trip(comp, g, key(step))
        assert bool(msg.flags & FLAG_ENTROPY) == entropy
        assert np.array_equal(np.frombuffer(bytes(msg.sections[0]), "<f4"), steps)
        if not entropy:
            assert bytes(msg.sections[1]) == pack_bits(torch.from_numpy(q + M), bits).numpy(
            ).tobytes()
            assert len(msg.to_bytes()) - len(comp.encode(g, key(99, "other")).to_bytes()) == 0
        out = decode(hvdcomp.get(spec), msg, key(step), p.size)
        assert np.array_equal(out.numpy(), x_hat)
        e = (p - x_hat).astype(F32)
        assert np.array_equal(comp.residual("w").numpy().reshape(-1), e)
        sent += x_hat
        total += g.numpy().reshape(-1)
    assert np.allclose(sent, total - e, rtol=0, atol=1e-4 * np.abs(total).max())


def test_error_bounds():
    """|p - x_hat| <= min(|p|, step / 2) per coordinate, so the error is at most ||p||^2 and
    at most 3 v ||p_b||^2 in a bucket whose step v sets; on a Gaussian the error is close to
    step^2 / 12 (high resolution)."""
    v = 0.02
    g = torch.randn(50_000, generator=torch.Generator().manual_seed(1))
    comp = hvdcomp.get(f"uniformef:bits=8,bucket_size=5000,variance_target={v}")
    k = key()
    x_hat = decode(comp, trip(comp, g, k), k, g.numel())
    err = (x_hat - g).abs()
    steps = torch.from_numpy(np.frombuffer(bytes(comp.encode(g, key(1, "x")).sections[0]),
                                           "<f4").copy()).repeat_interleave(5000)
    assert bool((err <= torch.minimum(g.abs(), steps / 2) * (1 + 1e-6)).all())
    rel = float(err.double().pow(2).sum() / g.double().pow(2).sum())
    assert rel <= 3 * v
    assert rel == pytest.approx(v, rel=0.05)


def test_zero_small_and_odd_tensors():
    comp = hvdcomp.get("uniformef:bits=6,bucket_size=64,variance_target=0.05")
    cases = [torch.zeros(0), torch.zeros(0, 5), torch.tensor(-2.5), torch.zeros(300),
             torch.randn(7, 3).half(), torch.randn(5, 9).bfloat16(), torch.randn(40, 30).t(),
             torch.randn(65).double()]
    for i, x in enumerate(cases):
        k = key(name=f"t{i}")
        out = decode(comp, trip(comp, x, k), k, x.numel())
        p = x.float().reshape(-1)
        assert torch.equal(comp.residual(f"t{i}").reshape(-1), p - out)
        if not bool((x != 0).any()):
            assert bool((out == 0).all())
    assert tuple(comp.residual("t2").shape) == ()


def test_nonfinite_leaves_the_residual():
    comp = hvdcomp.get("uniformef:bits=6,bucket_size=64")
    comp.encode(gradient((10, 10), 0), key(0))
    before = comp.residual("w")
    bad = gradient((10, 10), 1)
    bad[3, 3] = float("nan")
    msg = comp.encode(bad, key(1))
    assert msg.flags & FLAG_NONFINITE and not msg.sections
    assert torch.equal(comp.residual("w"), before)
    out = torch.zeros(100)
    assert comp.decode(Message.from_bytes(msg.to_bytes()), key(1), out) is False
    # p = g + e overflowing float32 is non-finite too
    comp.load_state_dict({"residuals": {"w": torch.full((10, 10), 3e38)}})
    assert comp.encode(torch.full((10, 10), 3e38), key(2)).flags & FLAG_NONFINITE
    with pytest.raises(ValueError):                       # a residual of another shape
        comp.encode(torch.ones(5, 5), key(3))


def test_state_round_trip_and_refusals():
    a = hvdcomp.get("uniformef:bits=5,bucket_size=32")
    for step in range(3):
        a.encode(gradient((20, 7), step), key(step))
    b = hvdcomp.get("uniformef:bits=5,bucket_size=32")
    b.load_state_dict(a.state_dict())
    g = gradient((20, 7), 9)
    assert a.encode(g, key(3)).to_bytes() == b.encode(g, key(3)).to_bytes()
    for bad in ({"residuals": {"w": torch.ones(3)}}, {"other": {}},
                {"residuals": {"w": torch.full((20, 7), float("nan"))}},
                {"residuals": {"w": torch.ones(20, 7, dtype=torch.float64)}}):
        with pytest.raises(ValueError):
            b.load_state_dict(bad)


def test_malformed_messages():
    comp = hvdcomp.get("uniformef:bits=4,bucket_size=10,entropy=False")
    x = gradient((3, 10), 2)
    x[1] = 0.0                                              # bucket 1: step 0
    k = key()
    msg = trip(comp, x, k)
    steps = np.frombuffer(bytes(msg.sections[0]), "<f4").copy()
    assert steps[1] == 0

    def with_sections(s0, s1):
        return Message(codec=msg.codec, dtype=msg.dtype, shape=msg.shape, sections=(s0, s1),
                       flags=msg.flags, tensor_id=msg.tensor_id, rank=msg.rank, seed=msg.seed,
                       step=msg.step, bits=msg.bits, bucket_size=msg.bucket_size,
                       level_version=msg.level_version)

    codes = bytearray(msg.sections[1])
    bad = []
    for v in (-1.0, float("inf"), float("nan"), 3e38):
        s = steps.copy()
        s[0] = v
        bad.append(with_sections(s.astype("<f4").tobytes(), bytes(codes)))
    bad.append(with_sections(steps.astype("<f4").tobytes()[:-4], bytes(codes)))
    bad.append(with_sections(steps.astype("<f4").tobytes(), bytes(codes[:-1])))
    c = bytearray(codes)
    c[0] = 0xFF                                             # code 15: invalid at 4 bits
    bad.append(with_sections(steps.astype("<f4").tobytes(), bytes(c)))
    c = bytearray(codes)
    c[6] ^= 0x10                                            # a non-zero code in bucket 1
    bad.append(with_sections(steps.astype("<f4").tobytes(), bytes(c)))
    for m in bad:
        with pytest.raises(WireFormatError):
            comp.decode(Message.from_bytes(m.to_bytes()), k, torch.zeros(30))


def test_hand_worked_bucket():
    """bits 2 (M = 1), a tiny variance target: the step is the bucket max / M = 4; p / 4 =
    [1, 1/2, -1/2, 1/4, 0] rounds half up (floor(x + 1/2)) to [1, 1, 0, 0, 0]."""
    comp = hvdcomp.get("uniformef:bits=2,bucket_size=5,variance_target=1e-6,entropy=False")
    g = torch.tensor([4.0, 2.0, -2.0, 1.0, 0.0])
    k = key()
    msg = trip(comp, g, k)
    assert np.frombuffer(bytes(msg.sections[0]), "<f4").tolist() == [4.0]
    assert decode(comp, msg, k, 5).tolist() == [4.0, 4.0, 0.0, 0.0, 0.0]
    assert comp.residual("w").tolist() == [0.0, -2.0, -2.0, 1.0, 0.0]
    # the next step sends p = g + e = [4, 0, -4, 2, 0]: step 4, codes [1, 0, -1, 1, 0]
    assert decode(comp, trip(comp, g, key(1)), key(1), 5).tolist() == [4.0, 0.0, -4.0, 4.0,
                                                                         0.0]
    assert comp.residual("w").tolist() == [0.0, 0.0, 0.0, -2.0, 0.0]


def test_one_bucket_per_tensor_allocates_per_coordinate():
    """bucket_size 2**31 on a small tensor: per-coordinate steps are n values (a bucket's
    worth, 2**31 floats, would not fit)."""
    from hvdcomp.ops.dithered import per_coordinate
    assert per_coordinate(torch.tensor([2.0, 3.0]), 4, 6).tolist() == [2.0] * 4 + [3.0] * 2
    comp = hvdcomp.get(f"uniformef:bucket_size={2 ** 31},variance_target=0.05")
    x = gradient((30, 33), 4)
    k = key()
    out = decode(comp, trip(comp, x, k), k, x.numel())
    assert torch.equal(comp.residual("w").reshape(-1), x.reshape(-1) - out)


# --- step_scope "model": one step for every tensor from the previous step's mean square ---

def model_reference(ps, bits, bs, v, m):
    """The steps, codes and decoded values of every tensor of one step with step_scope
    "model", by hand: ``m`` None (no previous step): each tensor's "bucket" steps
    (reference_step); else s = float32(sqrt(12 v m)) and each bucket's step max(s,
    float32(max|p_b| / M)) (0 for a zero bucket).  Also returns this step's m: the float64
    sum over buckets of float32 norms squared, tensors in name order, / the coordinates."""
    M = 2 ** (bits - 1) - 1
    out, sq, count = {}, [], 0
    for name in sorted(ps):
        p32 = ps[name]
        if m is None:
            out[name] = reference_step(p32, bits, bs, v)
        else:
            s = F32(np.sqrt(12.0 * v * m))
            steps = []
            for lo in range(0, p32.size, bs):
                by_max = F32(np.max(np.abs(p32[lo:lo + bs])) / F32(M))
                steps.append(F32(0) if by_max == 0 else max(s, by_max))
            out[name] = reference_codes(p32, np.array(steps, dtype=F32), bits, bs)
        norms = [F32(np.sqrt(np.sum(p32[lo:lo + bs].astype(np.float64) ** 2)))
                 for lo in range(0, p32.size, bs)]
        sq.append(float(np.sum(np.array(norms, dtype=np.float64) ** 2)))
        count += p32.size
    return out, math.fsum(sq) / count


@pytest.mark.parametrize("bits,bs,entropy", [(6, 50, True), (4, 64, False)])
def test_model_scope_bit_exact_over_steps(bits, bs, entropy):
    """Three tensors whose scales differ 100x, encoded out of name order over four steps of
    error feedback: step 0 has the "bucket" steps; every later step one step for all the
    tensors, sqrt(12 v m) of the previous step's mean square (the NumPy reference), and the
    steps, decoded values and residuals are those of the reference, bit for bit."""
    v = 0.05
    spec = f"uniformef:bits={bits},bucket_size={bs},variance_target={v},entropy={entropy}"
    comp = hvdcomp.get(spec + ",step_scope=model")
    shapes = {"c": (7, 13), "a": (120,), "b": (3, 5, 11)}
    scales = {"a": 1.0, "b": 0.01, "c": 0.1}
    e = {n: np.zeros(int(np.prod(sh)), dtype=F32) for n, sh in shapes.items()}
    m = None
    for step in range(4):
        gs = {n: gradient(sh, 10 * step + i) * scales[n] for i, (n, sh) in
              enumerate(shapes.items())}
        ps = {n: (gs[n].numpy().reshape(-1) + e[n]).astype(F32) for n in shapes}
        ref, m_next = model_reference(ps, bits, bs, v, m)
        for n in shapes:                                  # c, a, b: not the name order
            k = key(step, n)
            msg = trip(comp, gs[n], k)
            steps, _, x_hat = ref[n]
            assert np.array_equal(np.frombuffer(bytes(msg.sections[0]), "<f4"), steps)
            out = decode(hvdcomp.get(spec), msg, k, ps[n].size)
            assert np.array_equal(out.numpy(), x_hat)
            assert np.array_equal(comp.residual(n).numpy().reshape(-1), ps[n] - x_hat)
            e[n] = ps[n] - x_hat
        if step:                             # one step for every bucket below M steps
            s = F32(np.sqrt(12.0 * v * m))
            assert all((ref[n][0] == s).any() for n in shapes)
        m = m_next
        assert comp.state_dict()["mean_square"] == {"gradients": m}


def test_model_scope_equals_bucket_scope_at_the_first_step():
    x = gradient((40, 30), 1)
    a = hvdcomp.get("uniformef:bucket_size=100,variance_target=0.02")
    b = hvdcomp.get("uniformef:bucket_size=100,variance_target=0.02,step_scope=model")
    assert a.encode(x, key()).to_bytes() == b.encode(x, key()).to_bytes()


def test_model_scope_spends_bits_where_the_energy_is():
    """Two tensors whose root mean squares differ 30x, from the second step on: the model's
    step is one for both (an equal error per coordinate), and at the same bytes on the wire
    the total error is lower than with each bucket's own step (equal distortion per
    coordinate minimizes the total at a given entropy: Gish & Pierce 1968)."""
    g = {"big": gradient((64, 64), 7), "small": gradient((64, 64), 8) / 30}

    def run(scope, v):
        comp = hvdcomp.get(f"uniformef:bucket_size=4096,variance_target={v},step_scope={scope}")
        err = nbytes = 0.0
        for step in range(2):
            for n in sorted(g):
                e = comp.residual(n)
                p = g[n].reshape(-1) + (0 if e is None else e.reshape(-1))
                msg = comp.encode(g[n], key(step, n))
                out = decode(comp, msg, key(step, n), p.numel())
                if step == 1:
                    err += float((out.double() - p.double()).pow(2).sum())
                    nbytes += len(msg.to_bytes())
        return err, nbytes

    e_model, b_model = run("model", 0.05)
    # the bucket scope's smallest variance target (finest steps) that sends no more bytes
    for v in (0.05 * 1.1 ** i for i in range(60)):
        e_bucket, b_bucket = run("bucket", v)
        if b_bucket <= b_model:
            break
    assert b_bucket <= b_model and e_model < 0.5 * e_bucket


def test_model_scope_nonfinite_and_averages_keep_apart():
    """A NaN gradient does not count in the mean square; the reduce-scatter's averages
    (names ending "/avg") keep a mean square of their own."""
    comp = hvdcomp.get("uniformef:bucket_size=8,variance_target=0.1,step_scope=model")
    x = torch.arange(16, dtype=torch.float32)
    comp.encode(x, key(0, "w"))
    bad = x.clone()
    bad[3] = float("nan")
    assert comp.encode(bad, key(0, "v")).flags & FLAG_NONFINITE
    comp.encode(x / 10, key(0, "w[0:16]/avg"))
    ms = comp.state_dict()["mean_square"]
    assert ms == pytest.approx({"gradients": float((x.double() ** 2).mean()),
                                "averages": float(((x / 10).double() ** 2).mean())},
                               rel=1e-6)
    # the next step's steps: from each group's own m
    s_w = np.frombuffer(bytes(comp.encode(x, key(1, "w")).sections[0]), "<f4")
    s_avg = np.frombuffer(bytes(comp.encode(x, key(1, "w[0:16]/avg")).sections[0]), "<f4")
    assert s_w[1] == F32(np.sqrt(12 * 0.1 * ms["gradients"]))
    assert s_avg[1] == max(F32(np.sqrt(12 * 0.1 * ms["averages"])), F32(F32(15) / F32(31)))


def test_model_scope_state_round_trip_and_refusals():
    spec = "uniformef:bucket_size=32,variance_target=0.04,step_scope=model"
    a = hvdcomp.get(spec)
    for step in range(2):
        for n, seed in (("u", 1), ("w", 2)):
            a.encode(gradient((9, 11), seed + 10 * step), key(step, n))
    state = a.state_dict()
    assert set(state) == {"residuals", "mean_square"} and set(state["mean_square"]) == {
        "gradients"}
    b = hvdcomp.get(spec)
    b.load_state_dict(state)
    for n, seed in (("u", 5), ("w", 6)):       # the step after the checkpoint: the same bytes
        g = gradient((9, 11), seed)
        assert a.encode(g, key(2, n)).to_bytes() == b.encode(g, key(2, n)).to_bytes()
    before = b.state_dict()
    for ms in ({"gradients": -1.0}, {"gradients": float("nan")}, {"gradients": True},
               {"layers": 1.0}, 3.0):
        with pytest.raises(ValueError, match="mean_square"):
            b.load_state_dict(dict(state, mean_square=ms))
        after = b.state_dict()                          # nothing changed
        assert after["mean_square"] == before["mean_square"]
        assert all(torch.equal(after["residuals"][k], before["residuals"][k])
                   for k in before["residuals"])
    # the bucket scope loads such a checkpoint (its residuals) and ignores the mean square
    c = hvdcomp.get("uniformef:bucket_size=32,variance_target=0.04")
    c.load_state_dict(state)
    assert "mean_square" not in c.state_dict()
    assert all(torch.equal(c.state_dict()["residuals"][k], state["residuals"][k])
               for k in state["residuals"])
    # a mean square whose step would overflow float32: the largest step, no error
    from hvdcomp.ops.dithered import max_step
    b.load_state_dict(dict(state, mean_square={"gradients": 1e300}))
    steps = np.frombuffer(bytes(b.encode(gradient((9, 11), 7), key(3, "u")).sections[0]), "<f4")
    assert steps.tolist() == [max_step(6)] * len(steps)
    assert "mean_square" not in hvdcomp.get("uniformef").state_dict()


def test_floor_steps():
    from hvdcomp.ops.dithered import floor_steps, max_step
    x = torch.tensor([0.0, 0.0, 1.0, -62.0, 0.5, 0.25])
    # bits 6 (M = 31), buckets of 2: [0, 0] -> 0; [1, -62] -> max(0.5, 2) = 2; [.5, .25] -> .5
    assert floor_steps(x, 6, 2, 0.5).tolist() == [0.0, 2.0, 0.5]
    assert floor_steps(x, 6, 2, 1e38).tolist() == [0.0, max_step(6), max_step(6)]
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError):
            floor_steps(x, 6, 2, bad)


def test_model_scope_steps_without_a_usable_mean_square():
    """After a step whose every p was zero (m = 0) the next step has the "bucket" steps; a
    step whose every gradient was NaN leaves m as it was; a tensor whose bucket norm
    overflows float32 does not count in m."""
    spec = "uniformef:bucket_size=16,variance_target=0.05"
    model = hvdcomp.get(spec + ",step_scope=model")
    x = gradient((8, 8), 3)
    model.encode(torch.zeros(8, 8), key(0, "w"))
    assert model.state_dict()["mean_square"] == {"gradients": 0.0}
    assert model.encode(x, key(1, "v")).to_bytes() == hvdcomp.get(spec).encode(
        x, key(1, "v")).to_bytes()
    m1 = model.state_dict()["mean_square"]
    nan = x.clone()
    nan[0, 0] = float("nan")
    for n in ("v", "w"):
        assert model.encode(nan, key(2, n)).flags & FLAG_NONFINITE
    assert model.state_dict()["mean_square"] == m1
    huge = torch.full((4, 8), 3e38)                    # finite, ||p_b|| > float32's maximum
    model.encode(huge, key(3, "h"))
    p = x + model.residual("v")                         # p = g + e, what m is taken of
    model.encode(x, key(3, "v"))
    want = float((p.double() ** 2).mean())
    assert model.state_dict()["mean_square"]["gradients"] == pytest.approx(want, rel=1e-6)
