"""What the doors ask the autograd engine about the backward pass they run in.

Both doors hand gradients to the exchange from inside a backward pass (the drop-in
optimizer from its post-accumulate-grad hooks and end-of-backward callback, the DDP hook
from DDP's reducer) and must tell that pass from others:

* :func:`graph_task`: which backward pass is running (the engine's graph task id), so that
  the DDP hook notices a second DDP wrapper calling it in the same pass;
* :func:`in_backward`: whether one is running at all (a DDP rank under Join calls the hook
  outside any backward pass; FSDP asks the engine the same);
* :func:`inside_function_backward`: whether the caller runs inside a custom autograd
  Function's backward, where a backward pass started there (``checkpoint(
  use_reentrant=True)``) is nested in another, so that the optimizer's end-of-backward
  callback of the inner pass does not end the outer one.
"""
from __future__ import annotations

import sys

import torch

__all__ = ["graph_task", "in_backward", "inside_function_backward"]

_FUNCTION_BACKWARD = torch.autograd.function.BackwardCFunction.apply.__code__


def graph_task() -> int:
    """The current backward pass's graph task id (-1 outside backward or unknown)."""
    task = getattr(torch._C, "_current_graph_task_id", None)
    return -1 if task is None else task()


def in_backward() -> bool:
    """Whether the caller runs inside a backward pass (the autograd engine's current graph
    task).  True where torch cannot tell."""
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is None or task() != -1


def inside_function_backward() -> bool:
    """Whether the caller runs inside a custom autograd Function's backward: a backward
    pass started there (``checkpoint(use_reentrant=True)``) is nested in another."""
    f = sys._getframe(1)
    while f is not None:
        if f.f_code is _FUNCTION_BACKWARD:
            return True
        f = f.f_back
    return False
