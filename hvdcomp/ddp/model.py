"""What the DDP hook reads of the model it is built on and of its process group: the
module whose parameters are named (DDP's wrapped module), the parameters that get sparse
gradients, and the backend their devices need (:func:`check_backend`)."""
from typing import List, Set, Tuple

import torch

__all__ = ["inner_module", "sparse_names", "check_backend"]


def inner_module(model) -> torch.nn.Module:
    """The module whose parameters are named: DDP's wrapped module, or ``model`` itself.
    TypeError for ``torch.nn.DataParallel`` or anything but a module."""
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return model.module
    if isinstance(model, torch.nn.DataParallel):
        raise TypeError("hvdcomp.ddp works with DistributedDataParallel (one process per "
                        "device); torch.nn.DataParallel has no communication hooks")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"HookState needs the model (a torch.nn.Module, or the "
                        f"DistributedDataParallel wrapping it); got {type(model).__name__}")
    return model


def sparse_names(module: torch.nn.Module, named: List[Tuple[str, torch.Tensor]]) -> List[str]:
    """Names of the trainable parameters that get sparse gradients: the weights of
    ``nn.Embedding`` / ``nn.EmbeddingBag`` modules with ``sparse=True`` (DDP's own rule)."""
    ids = {id(p): n for n, p in named}
    return sorted({ids[id(m.weight)] for m in module.modules()
                   if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag))
                   and m.sparse and id(m.weight) in ids})


def check_backend(devices: Set[str], backend: str) -> None:
    """ValueError unless ``backend`` carries parameters on ``devices`` (device types): Gloo
    for CPU parameters, NCCL for CUDA ones, one device type."""
    if len(devices) > 1:
        raise ValueError(f"hvdcomp.ddp: parameters on several device types {sorted(devices)}")
    if "cuda" in devices and backend != "nccl":
        raise ValueError(f"hvdcomp.ddp: CUDA parameters need the nccl backend; the process "
                         f"group uses {backend!r}")
    if "cpu" in devices and backend != "gloo":
        raise ValueError(f"hvdcomp.ddp: CPU parameters need the gloo backend; the process "
                         f"group uses {backend!r}")
