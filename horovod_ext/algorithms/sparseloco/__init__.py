"""SparseLoCo's compressor (Sarfi et al., 2025, "Communication Efficient LLM Pre-training with
SparseLoCo", https://arxiv.org/abs/2508.15706): top-k of each chunk of a tensor, the chosen values
quantised to a few bits, with error feedback; the ranks' compressed tensors are gathered and
averaged.

``compress``: the chunked top-k and its quantiser, as bytes (``ChunkTopK``); the error-fed
average over the ranks of a communicator is ``algorithms.compressed_average``.  Written against
``horovod_ext.backends.Communicator`` only; the registry op ``hvd.SparseLoCo`` wraps it.
"""
from .compress import ChunkTopK

__all__ = ["ChunkTopK"]
