"""Per-parameter tensor state (residuals, momentum, accumulations): validation shared by the
compressors that keep it, so every one of them loads a checkpoint by the same rules; and the
residuals of the error-feedback quantizers (EF-SignSGD, uniformef) as a mixin."""
from __future__ import annotations

from typing import Any, ClassVar, Dict, Optional

import torch

from ..ops import finite

__all__ = ["finite", "load_tensors", "Residuals"]


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


class Residuals:
    """Mixin: one error-feedback residual per parameter name (``TensorKey.name``), float32 of
    the gradient's shape, on its device, in ``self._residuals`` (the compressor's encode
    writes it); ``state_dict()`` is ``{"residuals": {name: float32 CPU tensor}}``."""
    name: ClassVar[str]
    _residuals: Dict[str, torch.Tensor]

    def residual(self, name: str) -> Optional[torch.Tensor]:
        """A copy of the residual kept for parameter ``name`` (float32, its gradient's
        shape), or None before its first finite encode."""
        e = self._residuals.get(name)
        return None if e is None else e.detach().clone()

    def state_dict(self) -> Dict[str, Any]:
        """``{"residuals": {name: float32 CPU tensor}}`` (copies)."""
        return {"residuals": {k: v.detach().cpu().clone() for k, v in self._residuals.items()}}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Replace every residual with those of ``state`` (as produced by ``state_dict``).

        Raises ValueError (and changes nothing) for unknown keys, a residual that is not a
        finite float32 torch tensor, or one whose shape differs from the residual this
        compressor already holds for that name.  A residual for a name not yet seen is
        checked against the gradient's shape when that name is encoded next.
        """
        if not isinstance(state, dict):
            raise ValueError(f"{self.name}: state must be a dict, got {type(state).__name__}")
        extra = sorted(set(state) - {"residuals"})
        if extra:
            raise ValueError(f"{self.name}: unknown state keys {extra}; expected 'residuals'")
        self._residuals = load_tensors(self.name, "residual", state.get("residuals", {}),
                                       self._residuals)
