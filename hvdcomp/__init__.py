"""hvdcomp: gradient compression for data-parallel PyTorch over Horovod and MPI.

    import hvdcomp
    c = hvdcomp.get("alq:bits=3,bucket_size=8192")     # or hvdcomp.ALQ(bits=3)

    import hvdcomp.torch as hvd                         # all of horovod.torch, plus
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                   compression=c)       # real encoded bytes on the wire
"""
from .compressors import (ALQ, AMQ, BF16, BHQ, DGC, DQSG, FP16, LAQ, NDQSG, NUQSGD, PSQ,
                          QSGD, Compressor, NoneCompressor, PowerSGD, QSGDInf, RandK, SignEF,
                          TensorKey, TernGrad, TopK, UniformEF, available, get, parse_spec,
                          register)
from . import levels, wire
from .auto import Auto, CostModel
from .errors import ConfigError, Mismatch, OutOfStep, RankFailure, WireFormatError
from .wire import Message

__version__ = "0.1.0"

__all__ = ["ALQ", "AMQ", "BF16", "FP16", "NUQSGD", "QSGD", "QSGDInf", "NoneCompressor",
           "TernGrad", "SignEF", "PSQ", "BHQ", "DQSG", "NDQSG", "TopK", "RandK", "DGC", "LAQ",
           "PowerSGD", "UniformEF", "Compressor", "TensorKey", "available", "get", "parse_spec", "register",
           "ConfigError", "WireFormatError", "RankFailure", "OutOfStep", "Mismatch", "Message", "Auto", "CostModel", "__version__"]
