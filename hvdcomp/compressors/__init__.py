"""Compressors: one module per method family; each registers its classes by name.

Every module in this package is imported here, so adding a family means adding a file.
"""
import importlib as _importlib
import pkgutil as _pkgutil

from .base import (ABSENT_LAST, ABSENT_REFUSE, ABSENT_ZEROS, AVERAGE_SUFFIX, Compressor,
                   TensorKey, available, examples, get, parse_spec, register, registry)
from .cast import BF16, FP16, NoneCompressor
from .quantizers import ALQ, AMQ, NUQSGD, QSGD, BucketQuantizer, QSGDInf
from .terngrad import TernGrad
from .signef import SignEF
from .psq import BHQ, PSQ
from .dithered import DQSG, NDQSG
from .sparsifiers import DGC, RandK, TopK
from .laq import LAQ
from .powersgd import PowerSGD
from .uniformef import UniformEF

for _m in _pkgutil.iter_modules(__path__):
    _importlib.import_module(f"{__name__}.{_m.name}")

__all__ = ["Compressor", "TensorKey", "available", "get", "parse_spec", "register",
           "registry", "examples", "ABSENT_ZEROS", "ABSENT_LAST", "ABSENT_REFUSE", "AVERAGE_SUFFIX",
           "NoneCompressor", "FP16", "BF16", "BucketQuantizer", "QSGD", "QSGDInf", "NUQSGD",
           "ALQ", "AMQ", "TernGrad", "SignEF", "PSQ", "BHQ", "DQSG", "NDQSG", "TopK", "RandK", "DGC", "LAQ",
           "PowerSGD", "UniformEF"]
