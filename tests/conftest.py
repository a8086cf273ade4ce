"""Shared test set-up: the repository root and examples/ on sys.path, a fixed seed, seeded
random generators (rng, gen) and a TensorKey factory (make_key) for every test folder."""
import os
import sys

import numpy as np
import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for p in (ROOT, os.path.join(ROOT, "examples")):
    if p not in sys.path:
        sys.path.insert(0, p)

import hvdcomp  # noqa: E402  (after the checkout is on sys.path)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)
    yield


@pytest.fixture
def rng():
    """A seeded NumPy generator (a fresh one per test)."""
    return np.random.default_rng(20240611)


@pytest.fixture
def gen():
    """A seeded torch.Generator (a fresh one per test)."""
    g = torch.Generator()
    g.manual_seed(97531)
    return g


@pytest.fixture
def make_key():
    """make_key(rank=0, world_size=1, tensor_id=3, step=7, seed=11, name='w') -> TensorKey."""
    def make(rank=0, world_size=1, tensor_id=3, step=7, seed=11, name="layer.weight"):
        return hvdcomp.TensorKey(name=name, tensor_id=tensor_id, step=step, rank=rank,
                                 world_size=world_size, seed=seed)
    return make
