"""Shared pieces of the benchmarks: real gradients of the main job's models."""
from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
sys.path.insert(0, ROOT)
from mnist import FC300100, load_digits  # noqa: E402


class SmallCNN(nn.Sequential):
    """conv5x5(16) - pool - conv5x5(32) - pool - fc(10) on 28x28 digits (21,834 params)."""

    def __init__(self):
        super().__init__(nn.Unflatten(1, (1, 28, 28)), nn.Conv2d(1, 16, 5), nn.ReLU(),
                         nn.MaxPool2d(2), nn.Conv2d(16, 32, 5), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Flatten(), nn.Linear(512, 10))


def training_gradients(model_fn, points=(0, 100, 400), batch=32, lr=0.05, seed=0, data=None):
    """Train ``model_fn()`` with SGD (momentum 0.9) on the MNIST digits (one process) and
    return {step: {name: gradient}} at the given steps: real gradients at several points of
    a real training run.  ``data``: another training set, ``(x, y, prepare)`` with
    ``prepare(x[idx])`` the model's input (e.g. Fashion-MNIST's images and its normalize)."""
    torch.manual_seed(seed)
    x, y, prepare = data or (*load_digits(seed)[:2], lambda b: b)
    model = model_fn()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    g = torch.Generator().manual_seed(seed)
    out = {}
    for step in range(max(points) + 1):
        idx = torch.randint(0, len(x), (batch,), generator=g)
        opt.zero_grad()
        F.cross_entropy(model(prepare(x[idx])), y[idx]).backward()
        if step in points:
            out[step] = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        opt.step()
    return out


def per_sample_gradients(n=64, seed=0, steps=200):
    """Per-sample gradients of the last Linear layer of FC-300-100 after ``steps`` of
    training: a (n, 100*10) matrix whose rows are samples (the setting of PSQ/BHQ)."""
    torch.manual_seed(seed)
    x, y, _, _ = load_digits(seed)
    model = FC300100()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        idx = torch.randint(0, len(x), (32,), generator=g)
        opt.zero_grad()
        F.cross_entropy(model(x[idx]), y[idx]).backward()
        opt.step()
    rows = []
    for i in range(n):
        model.zero_grad()
        F.cross_entropy(model(x[i:i + 1]), y[i:i + 1]).backward()
        rows.append(model[4].weight.grad.reshape(-1).clone())
    return torch.stack(rows)


def worker_gradients(model_fn=FC300100, step=100, workers=4, batch=64, seed=0):
    """Gradients of ``workers`` different minibatches at the same point of a training run
    (what the ranks of one data-parallel step hold): a list of {name: gradient}."""
    torch.manual_seed(seed)
    x, y, _, _ = load_digits(seed)
    model = model_fn()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(seed)
    for _ in range(step):
        idx = torch.randint(0, len(x), (32,), generator=g)
        opt.zero_grad()
        F.cross_entropy(model(x[idx]), y[idx]).backward()
        opt.step()
    out = []
    for w in range(workers):
        idx = torch.randint(0, len(x), (batch,), generator=g)
        model.zero_grad()
        F.cross_entropy(model(x[idx]), y[idx]).backward()
        out.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
    return out
