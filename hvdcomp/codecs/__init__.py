"""The sections of a message that the compressors share: :mod:`.sections` (the code
section: packed or rANS-coded codes) and :mod:`.sparse_vectors` (sparse vectors:
Golomb-Rice coded index gaps and their values).

The coders they are made of, each with its kernels, live in the ops layer and are imported
from there: bit packing (:mod:`hvdcomp.ops.bitpack`), rANS (:mod:`hvdcomp.ops.rans`) and
Golomb-Rice (:mod:`hvdcomp.ops.rice`).
"""
