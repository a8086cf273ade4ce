"""Per-parameter tensor state (residuals, momentum, accumulations): validation shared by the
compressors that keep it, so every one of them loads a checkpoint by the same rules."""
from __future__ import annotations

from typing import Any, Dict, Optional

import torch

from ..ops import finite

__all__ = ["finite", "load_tensors"]


def load_tensors(owner: str, kind: str, res: Any, held: Dict[str, torch.Tensor]
                  ) -> Dict[str, torch.Tensor]:
    """Validate a {name: float32 tensor} state mapping against the tensors ``held``."""
    if not isinstance(res, dict):
        raise ValueError(f"{owner}: {kind!r} must map parameter names to tensors, got "
                         f"{type(res).__name__}")
    new: Dict[str, torch.Tensor] = {}
    for name, t in res.items():
        if not isinstance(name, str):
            raise ValueError(f"{owner}: {kind} names must be strings, got {name!r}")
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{owner}: {kind} of {name!r} must be a torch.Tensor, got "
                             f"{type(t).__name__}")
        if t.dtype != torch.float32:
            raise ValueError(f"{owner}: {kind} of {name!r} has dtype {t.dtype}; the state "
                             f"is torch.float32")
        if not finite(t):
            raise ValueError(f"{owner}: {kind} of {name!r} holds NaN or Inf")
        cur = held.get(name)
        if cur is not None and tuple(cur.shape) != tuple(t.shape):
            raise ValueError(f"{owner}: {kind} of {name!r} has shape {tuple(t.shape)}, the "
                             f"one held for it has shape {tuple(cur.shape)}")
        new[name] = t.detach().to(cur.device if cur is not None else "cpu").clone()
    return new
