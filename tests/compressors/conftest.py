"""Fixtures for the quantizer tests: fixed seeds, one intra-op thread, and a real gradient.

``real_grad`` is the gradient of the first Linear weight (300 x 784) of the FC-300-100 network
of examples/mnist.py after a few SGD steps on the real MNIST digits (fixed seeds), so the level
fitting and the variance claims are checked on a gradient with the sparsity and heavy tails of a
real one, not on Gaussian noise.
"""
import os
import sys

import numpy as np
import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
for _p in (ROOT, os.path.join(ROOT, "examples")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

SEED = 20201020          # the global torch / numpy seed of every test in tests/compressors
MODEL_SEED = 0           # initial weights of FC300100
DATA_SEED = 0            # train/test split of load_digits
BATCH_SEED = 1           # mini-batch sampling
SGD_STEPS = 5            # steps taken before the gradient is recorded
BATCH = 64
LR = 0.1


@pytest.fixture(autouse=True)
def _quant_seed_and_threads():
    """Seed torch and numpy; run on one intra-op thread.

    One thread keeps the suite fast and deterministic on a small shared machine: with two
    intra-op threads torch.searchsorted on a few thousand elements was measured ~200x slower
    here (thread start-up and contention), which would dominate the Monte-Carlo tests."""
    nthreads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(SEED)
    np.random.seed(SEED)
    yield
    torch.set_num_threads(nthreads)


@pytest.fixture(scope="session")
def real_grad():
    """float32 (300, 784): grad of FC300100[0].weight on the 6th mini-batch, after 5 SGD steps."""
    from mnist import FC300100, load_digits

    x, y, _, _ = load_digits(seed=DATA_SEED)
    nthreads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(MODEL_SEED)
            model = FC300100()
            opt = torch.optim.SGD(model.parameters(), lr=LR)
            gen = torch.Generator().manual_seed(BATCH_SEED)
            for step in range(SGD_STEPS + 1):
                idx = torch.randint(0, len(x), (BATCH,), generator=gen)
                opt.zero_grad()
                loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx])
                loss.backward()
                if step < SGD_STEPS:
                    opt.step()
    finally:
        torch.set_num_threads(nthreads)
    grad = model[0].weight.grad.detach().clone()
    grad.requires_grad_(False)
    return grad


@pytest.fixture(scope="session")
def real_stats(real_grad):
    """ALQ sufficient statistics of the real gradient at bucket size 8192."""
    from hvdcomp.ops import level_stats
    return level_stats.bucket_stats.reference(real_grad.reshape(-1), 8192, "l2").numpy()


@pytest.fixture(scope="session")
def fitted_tables(real_stats):
    """{(name, bits): float64 table} of ALQ / AMQ levels fitted to the real gradient."""
    from hvdcomp import levels as L
    out = {}
    for bits in (2, 3, 4):
        out["alq", bits] = L.fit_alq(real_stats, bits)
        out["amq", bits] = L.fit_amq(real_stats, bits)
    return out
