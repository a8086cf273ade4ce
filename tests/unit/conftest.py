"""Fixtures for the unit tests: seeded random generators and a TensorKey factory.

Everything random in tests/unit comes from these seeded generators (or the autouse
torch.manual_seed in tests/conftest.py), so every run sees the same inputs.
"""
import numpy as np
import pytest
import torch

import hvdcomp


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
