"""Checkpoints without hvdcomp's part (issue #15 item 8), on every rank.

A state_dict saved by a plain torch optimizer (no "hvdcomp" entry) loaded into
hvd.DistributedOptimizer whose compressor keeps state (error feedback, fitted levels, DGC's
momentum, LAQ's records):

* raises ValueError on every rank, naming the rank, the missing entry, the compressor and
  each part of its state, and loads nothing (the wrapped optimizer's state stays empty);
* with ``allow_missing_hvdcomp=True``: loads the wrapped optimizer's state (its momentum
  buffers equal the checkpoint's, bit for bit) and warns once on every rank, saying what is
  missing; hvdcomp's step and the compressor's state stay as they were (fresh);
* the state_dict that hvdcomp's optimizer saved loads without any warning, hvdcomp's step
  and the compressor's state restored;
* a stateless compressor (qsgd, none) loads a plain checkpoint silently.
"""
import warnings

import torch
import torch.nn.functional as F

from common import say

import hvdcomp.torch as hvd

STATEFUL = ["topk:density=0.2", "randk:density=0.2", "signef:bucket_size=64",
            "dgc:density=0.2,sample_ratio=0",
            "alq:bits=3,bucket_size=64,refit_steps=2,refit_every=0",
            "laq:bits=3,t_max=2"]
STATELESS = ["qsgd:bits=4,bucket_size=64", "none", "topk:density=0.2,error_feedback=False"]
STEPS = 3


def model_fn():
    torch.manual_seed(5)
    return torch.nn.Sequential(torch.nn.Linear(20, 30), torch.nn.Tanh(), torch.nn.Linear(30, 4))


def make_opt(model, spec):
    return hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                    named_parameters=model.named_parameters(),
                                    compression=spec, min_compress_numel=16)


def train(model, opt, rank, steps):
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(8, 20, generator=g), torch.randint(0, 4, (8,), generator=g)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()


def plain_state(model, opt):
    """The checkpoint a plain torch SGD with the same state would save."""
    plain = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sd = opt.state_dict()
    del sd["hvdcomp"]
    plain.load_state_dict(sd)
    out = plain.state_dict()
    assert "hvdcomp" not in out and out["state"], sorted(out)
    return out


def same(a, b):
    """Equal state: dicts, lists and scalars equal, tensors bit for bit."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                and a.dtype == b.dtype and torch.equal(a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return (type(a) is type(b) and len(a) == len(b)
                and all(same(x, y) for x, y in zip(a, b)))
    return a == b


def hvdcomp_warnings(caught):
    return [str(w.message) for w in caught if "hvdcomp" in str(w.message)]


def check_stateful(spec, rank):
    model = model_fn()
    opt = make_opt(model, spec)
    train(model, opt, rank, STEPS)
    saved = opt.compression.state_dict()
    assert opt.compression.keeps_state and saved, (spec, saved)
    plain = plain_state(model, opt)

    opt2 = make_opt(model_fn(), spec)
    fresh = opt2.compression.state_dict()
    try:
        opt2.load_state_dict(plain)
    except ValueError as e:
        msg = str(e)
    else:
        raise AssertionError(f"{spec}: a checkpoint without hvdcomp's part loaded silently")
    for part in [f"rank {rank}", "'hvdcomp'", opt2.compression.spec(), "allow_missing_hvdcomp",
                 "step"] + [repr(k) for k in saved]:
        assert part in msg, (spec, part, msg)
    assert len(opt2.state) == 0, (spec, "the wrapped optimizer's state was loaded")

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt2.load_state_dict(plain, allow_missing_hvdcomp=True)
    got = hvdcomp_warnings(caught)
    assert len(got) == 1, (spec, got)
    for part in [f"rank {rank}", "'hvdcomp'", opt2.compression.spec(), "step stays at 0"] + [
            repr(k) for k in saved]:
        assert part in got[0], (spec, part, got[0])
    assert same(opt2.state_dict()["state"], plain["state"]), spec
    assert len(opt2.state) == len(plain["state"]) > 0, spec
    assert opt2._driver.step == 0
    assert same(opt2.compression.state_dict(), fresh), spec

    # the checkpoint hvdcomp saved: no warning, step and state restored
    opt3 = make_opt(model_fn(), spec)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt3.load_state_dict(opt.state_dict())
    assert not hvdcomp_warnings(caught), (spec, hvdcomp_warnings(caught))
    assert opt3._driver.step == STEPS
    assert same(opt3.compression.state_dict(), saved), spec
    assert not same(saved, fresh), spec


def check_stateless(spec, rank):
    model = model_fn()
    opt = make_opt(model, spec)
    train(model, opt, rank, 1)
    assert not opt.compression.keeps_state, spec
    opt2 = make_opt(model_fn(), spec)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt2.load_state_dict(plain_state(model, opt))
    assert not hvdcomp_warnings(caught), (spec, hvdcomp_warnings(caught))
    assert same(opt2.state_dict()["state"], opt.state_dict()["state"]), spec


def main():
    hvd.init()
    rank = hvd.rank()
    for spec in STATEFUL:
        check_stateful(spec, rank)
    for spec in STATELESS:
        check_stateless(spec, rank)
    say(rank, f"checkpoint OK ({len(STATEFUL)} stateful, {len(STATELESS)} stateless)")


if __name__ == "__main__":
    main()
