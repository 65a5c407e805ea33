"""SLAMB and sparse random-k synchronisation: the shared random-k mask
(``slamb.mask``), masked averaging with local error compensation (``slamb.sparse``) and the SLAMB
optimizer (``slamb.SLAMB``)."""
from .mask import random_k_indices
from .optimizer import SLAMB
from .sparse import SMALL_TENSOR_NUMEL, masked_average_, syncs_in_full

__all__ = ["SLAMB", "SMALL_TENSOR_NUMEL", "masked_average_", "random_k_indices", "syncs_in_full"]
