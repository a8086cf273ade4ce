"""Compressors: one module per family; all register themselves by name."""
from .base import Compressor, TensorKey, available, get, parse_spec, register
from .cast import BF16, FP16, NoneCompressor
from .quantizers import ALQ, AMQ, NUQSGD, QSGD, BucketQuantizer, QSGDInf

__all__ = ["Compressor", "TensorKey", "available", "get", "parse_spec", "register",
           "NoneCompressor", "FP16", "BF16", "BucketQuantizer", "QSGD", "QSGDInf", "NUQSGD",
           "ALQ", "AMQ"]
