"""``keeps_state`` (issue #15 item 8): a compressor declares it exactly when training changes
what its ``state_dict`` returns, so that the drop-in optimizer refuses checkpoints that lack
hvdcomp's part for every compressor that would lose something (and only for those)."""
import numpy as np
import pytest
import torch

import hvdcomp
import hvdcomp.compressors
from hvdcomp.compressors.protocols import (AdaptiveLevels, MomentumCorrection, ParamDeltas,
                                          SummedRounds)
from hvdcomp.exchange.rounds import simulate

# every registered compressor by its example spec (settings that exercise its state: ALQ/AMQ
# refit within the 4 steps of train()), plus settings that switch state off
SPECS = list(hvdcomp.compressors.examples().values()) + [
    "topk:error_feedback=False", "randk:error_feedback=False", "laq:t_max=0"]


def same(a, b):
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                and a.shape == b.shape and torch.equal(a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def train(comp, gen, steps=4):
    """Use ``comp`` as the exchange does for one rank of one: encode, decode (or the rounds
    of a SummedRounds compressor), and the protocols' hooks (statistics summed and adopted, momentum factors, parameter deltas)."""
    if isinstance(comp, MomentumCorrection):
        comp.set_momentum({"w": 0.9})
    for step in range(steps):
        key = hvdcomp.TensorKey("w", 0, step, 0, 1, seed=3, shape=(64, 32),
                                dtype=torch.float32)
        grad = torch.randn(64, 32, generator=gen)
        if isinstance(comp, SummedRounds):        # no wire message: the rounds, one rank
            simulate([comp], [grad], [key])
            continue
        if isinstance(comp, AdaptiveLevels) and comp.wants_stats(step):
            comp.observe(grad)
        msg = comp.encode(grad, key)
        comp.combine([msg], [key], torch.zeros(grad.numel()))
        if isinstance(comp, AdaptiveLevels):
            stats = comp.pending_stats()
            if stats is not None and np.any(stats):
                comp.adopt(comp.update(stats, step + 1))
        if isinstance(comp, ParamDeltas):
            comp.after_step(step, 0.01)


@pytest.mark.parametrize("spec", SPECS)
def test_keeps_state_iff_training_changes_the_state(spec, gen):
    comp = hvdcomp.get(spec)
    fresh = comp.state_dict()
    train(comp, gen)
    changed = not same(comp.state_dict(), fresh)
    assert comp.keeps_state == changed, (spec, comp.keeps_state, sorted(comp.state_dict()))
