"""Adasum (Maleki et al., "Scaling Distributed Training with Adaptive Summation").

``operator``: the per-layer Adasum operator with float64 dot products; ``rvh``: recursive
vector-halving over any number of ranks of a communicator (paper Algorithm 1); ``gather``: the
same tree for small messages, in one collective; ``shared_memory``: the same tree among the
ranks of one host, through their shared-memory segment.  Written against
``horovod_ext.backends.Communicator`` only; the registry op ``hvd.Adasum`` wraps it.
"""
from .gather import splits_into_blocks
from .operator import LayerMap, adasum_pair_
from .rvh import adasum_allreduce_, largest_power_of_two
from .shared_memory import in_node_adasum_

__all__ = ["LayerMap", "adasum_pair_", "adasum_allreduce_", "in_node_adasum_",
           "largest_power_of_two", "splits_into_blocks"]
