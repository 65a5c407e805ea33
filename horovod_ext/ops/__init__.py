"""Reduction ops: the contract (``base.Op``), the registry, and one module per built-in op.

Layer 3 (with the engine): ops are written against ``backends.collectives`` and the papers'
math in ``algorithms``, and the engine finds them only through the registry.  Adding an op is
one module here with one ``register_op`` call (docs/architecture.md).
"""
# flake8: noqa: F401 - the package re-exports the ops and their contract
from .base import Layer, Op, average_, reduce_flat, scale_
from .registry import get_op, register_op, registered_ops, reset_all
from .elementwise import Average, AverageOp, ElementwiseOp, Max, Min, Product, Sum
from .adasum import Adasum
from .onebit import OneBit
from .randomk import RandomK
from .powersgd import PowerSGD
from .sparseloco import SparseLoCo
from .quantized import Quantized
