"""Golden training shared by the Horovod worker (under mpirun) and the DDP workers (under
torchrun): a model whose parameters have odd shapes and dtypes, and a loss whose gradient on
rank r at step k is a fixed tensor G(name, r, k), so both paths exchange the same gradients."""
from __future__ import annotations

import os
import sys
from typing import Dict

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from hvdcomp.compressors import examples, registry  # noqa: E402

# name -> (shape, dtype): sizes that are not multiples of the quantizers' buckets, half and
# bfloat16 and float64, all-zero, a 1-element and an empty tensor, a tensor that is NaN on rank 1 at the
# last step, 1-D tensors (sent uncompressed).
SPECS = {
    "conv.weight": ((7, 3, 5, 5), torch.float32),
    "fc1.weight": ((300, 41), torch.float32),
    "fc1.bias": ((300,), torch.float32),
    "fp16w.weight": ((33, 40), torch.float16),
    "bf16w.weight": ((40, 33), torch.bfloat16),
    "f64w.weight": ((50, 30), torch.float64),
    "zero.weight": ((64, 64), torch.float32),
    "nan.weight": ((40, 40), torch.float32),
    "one.weight": ((1, 1), torch.float32),
    "empty.weight": ((0, 5), torch.float32),
    "part.weight": ((24, 50), torch.float32),
}
# part.weight has no gradient on rank 1 at step ABSENT_STEP (unused there: absent)
ABSENT, ABSENT_STEP = "part.weight", 2

# every compressor of hvdcomp's registry, by its example spec (settings that make its state
# matter within STEPS steps); those registered from outside hvdcomp (other test modules)
# are left out
COMPRESSORS = [spec for name, spec in examples().items()
               if registry()[name].__module__.startswith("hvdcomp.")] + [
    # a step from every tensor's last step: both doors must number the steps alike
    "uniformef:bits=6,bucket_size=256,variance_target=0.03,step_scope=model"]
STEPS = 5
LR, MOMENTUM, WEIGHT_DECAY = 0.05, 0.9, 0.01


def golden_grad(name: str, rank: int, step: int) -> torch.Tensor:
    """G(name, rank, step): any process can rebuild any rank's gradient."""
    shape, dtype = SPECS[name]
    g = torch.Generator().manual_seed(1000 * step + 37 * rank + sum(map(ord, name)))
    x = torch.randn(shape, generator=g) * (1 + rank) * 0.1
    if name == "zero.weight":
        x.zero_()
    if name == "nan.weight" and rank == 1 and step == STEPS - 1:
        x.view(-1)[5] = float("nan")
    return x.to(dtype)


class Golden(torch.nn.Module):
    """Parameters named as in SPECS, zero-initialised; ``forward(grads)`` returns
    ``sum_p (p * grads[p]).sum()``, whose gradient with respect to p is grads[p] exactly."""

    def __init__(self, specs=SPECS):
        super().__init__()
        for name, (shape, dtype) in specs.items():
            mod, attr = name.split(".")
            if mod not in self._modules:
                self.add_module(mod, torch.nn.Module())
            getattr(self, mod).register_parameter(
                attr, torch.nn.Parameter(torch.zeros(shape, dtype=dtype)))

    def forward(self, grads: Dict[str, torch.Tensor]) -> torch.Tensor:
        return sum((p * grads[n]).double().sum() for n, p in self.named_parameters()
                   if n in grads)


def inputs(rank: int, step: int, absent: bool = False) -> Dict[str, torch.Tensor]:
    """Every parameter's gradient on ``rank`` at ``step``; with ``absent``, none for
    ABSENT on rank 1 at ABSENT_STEP (the model does not use it there)."""
    return {n: golden_grad(n, rank, step) for n in SPECS
            if not (absent and n == ABSENT and rank == 1 and step == ABSENT_STEP)}


def absent_ok(spec: str) -> bool:
    """Whether ``spec`` can leave a rank out (NDQSG needs every rank's message)."""
    return not spec.startswith("ndqsg")


def optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM,
                           weight_decay=WEIGHT_DECAY)


def out_path(outdir: str, path: str, spec: str, size: int, rank: int, tag: str = "") -> str:
    safe = "".join(c if c.isalnum() or c in "._" else "_" for c in spec)
    return os.path.join(outdir, f"{path}{tag}.{safe}.n{size}.r{rank}.pt")
