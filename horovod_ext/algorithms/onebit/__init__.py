"""1-bit compressed allreduce, 1-bit Adam and 1-bit LAMB.

``compression``: signs packed 8 per byte with per-segment scales; ``compressed_allreduce``: the
error-compensated three-phase compressed allreduce over any ``Communicator`` (1-bit Adam
section 6); ``OnebitAdam`` and ``OnebitLamb``: the papers' optimizers with DeepSpeed's argument
names.  Written against ``horovod_ext.backends`` only; the registry op ``hvd.OneBit`` wraps the
compressed allreduce.
"""
from .adam import OnebitAdam
from .compressed_allreduce import (ErrorFeedback, chunk_size, compressed_allreduce_,
                                   compressed_bytes, hierarchical_compressed_allreduce_)
from .compression import compress, decompress, pack_signs, unpack_signs
from .lamb import OnebitLamb

__all__ = ["OnebitAdam", "OnebitLamb", "ErrorFeedback", "chunk_size", "compressed_allreduce_",
           "compressed_bytes", "hierarchical_compressed_allreduce_", "compress", "decompress",
           "pack_signs", "unpack_signs"]
