"""SLAMB and sparse random-k synchronisation: the shared random-k mask
(``slamb.mask``), masked averaging with local error compensation (``slamb.sparse``) and the SLAMB
optimizer (``slamb.SLAMB``: its steps in ``slamb.optimizer``, the per-tensor update in
``slamb.update``, the step's mask pieces and buckets in ``slamb.layout``)."""
from .mask import random_k_indices
from .optimizer import SLAMB
from .sparse import SMALL_TENSOR_NUMEL, masked_average_, syncs_in_full

__all__ = ["SLAMB", "SMALL_TENSOR_NUMEL", "masked_average_", "random_k_indices", "syncs_in_full"]
