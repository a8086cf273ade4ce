"""``import hvdcomp.torch as hvd``: all of horovod.torch, with a DistributedOptimizer whose
``compression=`` takes any hvdcomp compressor and sends its real encoded bytes."""
from horovod.torch import *  # noqa: F401,F403  (the whole horovod.torch surface)
import horovod.torch as _hvd

from .exchange import Exchange, StepStats
from .optimizer import DistributedOptimizer, join  # join: hvdcomp's, over Horovod's


def __getattr__(name):
    # Anything horovod.torch has that the star import did not bring (private helpers).
    return getattr(_hvd, name)
