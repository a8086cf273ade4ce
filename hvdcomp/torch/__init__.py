"""``import hvdcomp.torch as hvd``: all of horovod.torch, with a DistributedOptimizer whose
``compression=`` takes any hvdcomp compressor and sends its real encoded bytes."""
try:
    import horovod.torch as _hvd
except ImportError as _e:
    raise ImportError(
        f"hvdcomp.torch needs Horovod built with PyTorch support (horovod.torch could not be "
        f"imported: {_e}). Install it with: HOROVOD_WITH_PYTORCH=1 pip install "
        f"'hvdcomp[horovod]' (Horovod 0.28.1 from source; see the README's 'Installing with "
        f"pip' and launch/setup, which builds it). The compressors (import hvdcomp) and "
        f"hvdcomp.exchange work without Horovod.") from _e
from horovod.torch import *  # noqa: F401,F403,E402  (the whole horovod.torch surface)

from .exchange import Exchange, StepStats
from .optimizer import DistributedOptimizer, join  # join: hvdcomp's, over Horovod's


def __getattr__(name):
    # Anything horovod.torch has that the star import did not bring (private helpers).
    return getattr(_hvd, name)
