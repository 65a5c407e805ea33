"""Adasum's whole tree over k vectors from one Gram matrix of them, per layer.

Every node of the tree is a linear combination of the inputs, sum_j w_j x_j, so the dot products
a level needs are w_a^T G w_b, with G the inputs' matrix of dot products: one pass over the
data computes G, and the tree's coefficients follow from G alone (``tree_weights``, float64, a
few operations per layer and pair), down to the root's weights, applied in one more pass
(``mix_``).  The level by level tree reads its shards twice per level (products, then the
weighted sum) and waits once per level for the others' products; this reads them twice in all
and waits once.  The in-node Adasum (shared_memory.py) computes G over each rank's shard and
sums the shards' tables.

A node whose vector is zero weighs 1 in its pair (operator.coefficients): an input is zero
when its G entry is exactly 0, as there; a combined node when w^T G w is within float64's
rounding of the terms it sums (exactly cancelling inputs), where the level by level tree, which
forms the node's vector first, also finds zeros.

CPU tensors only (the shared-memory path's); the torch/numpy code stands in for the C kernels
where they are not built, or for 16-bit types.  Sums run in float64 whatever the input type,
and for three vectors or more so do the products (the later levels' coefficients come from
differences of the entries, which float32 products would leave 1e-9 of |x|^2 off); two vectors
take operator.partial_dots itself, and their weights and weighted sum give the bits of
operator.coefficients and combine_.
"""
import ctypes
import functools
from typing import List, Optional, Sequence

import numpy as np
import torch

from horovod_ext.backends import native

from .. import compiled
from . import operator
from .gather import tree_levels
from .operator import CHUNK, Piece, Run

_VECTORS_ARGS = (ctypes.c_void_p, ctypes.c_int64)
_LIB = native.load("horovod_ext.algorithms.adasum._kernels", {
    **{f"hx_adasum_gram_{t}": _VECTORS_ARGS + (ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p)
       for t in ("f32", "f64")},
    **{f"hx_adasum_mix_{t}": _VECTORS_ARGS + (ctypes.c_void_p,) * 3
       + (ctypes.c_int64, ctypes.c_void_p) for t in ("f32", "f64")},
    "hx_adasum_tree_weights": (ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                               ctypes.c_void_p, ctypes.c_int64, ctypes.c_double,
                               ctypes.c_void_p)})
_SUFFIX = {torch.float32: "f32", torch.float64: "f64"}

# A pair's [a.b, a.a, b.b] (operator.partial_dots, the dots kernel) as the packed Gram row
# [a.a, a.b, b.b].
PAIR_AS_PACKED = [1, 0, 2]

# Relative size, against the terms it sums, below which w^T G w counts as zero: float64's
# rounding of a sum of k^2 terms stays far below it.
ZERO_SIDE = 1e-12


def pair_count(k: int) -> int:
    return k * (k + 1) // 2


def _kernel(what: str, tensors: Sequence[torch.Tensor]):
    suffix = _SUFFIX.get(tensors[0].dtype)
    if _LIB is None or suffix is None or not operator.HOST_CODE:
        return None
    if not native.takes(tensors[0].dtype, *tensors):
        return None
    return getattr(_LIB, f"hx_adasum_{what}_{suffix}")


def _addresses(tensors: Sequence[torch.Tensor]):
    return (ctypes.c_void_p * len(tensors))(*[t.data_ptr() for t in tensors])


def gram(vectors: List[torch.Tensor], piece: Piece) -> np.ndarray:
    """(layer_count, k (k + 1) / 2) float64: per layer, the dot products of the k 1-D
    ``vectors`` over the segments of ``piece``, the packed upper triangle row by row."""
    k = len(vectors)
    if k == 2:   # the pair's [a.b, a.a, b.b], as the tree level by level computes them
        return operator.partial_dots(vectors[0], vectors[1], piece).numpy()[:, PAIR_AS_PACKED]
    out = np.zeros((piece.layer_count, pair_count(k)))
    if not piece.count:
        return out
    kernel = _kernel("gram", vectors)
    if kernel is not None:
        kernel(_addresses(vectors), k, piece.address, piece.count, out.ctypes.data)
        return out
    rows_of, cols_of = np.triu_indices(k)
    for item in piece.items:
        if isinstance(item, Run):   # many small layers: every pair's products, summed per layer
            rows = torch.stack([v[item.start:item.end] for v in vectors]).double().numpy()
            products = rows[rows_of] * rows[cols_of]
            starts = (item.lengths.cumsum(0) - item.lengths).numpy()
            out[item.layers.numpy()] += np.add.reduceat(products, starts, axis=1).T
            continue
        for start in range(item.start, item.end, CHUNK):
            end = min(item.end, start + CHUNK)
            rows = torch.stack([v[start:end] for v in vectors]).double()
            out[item.layer] += (rows @ rows.t()).numpy()[rows_of, cols_of]
    return out


@functools.lru_cache(maxsize=None)
def _flat_tree(k: int):
    """The tree's pairs as the C code takes them: (a, b) and (d_a, d_b) per pair, in order."""
    pairs = [pair for level in tree_levels(k) for pair in level]
    return (np.array([(a, b) for a, b, _ in pairs], dtype=np.int64).reshape(-1, 2),
            np.array([d for _, _, d in pairs], dtype=np.float64).reshape(-1, 2))


def tree_weights(packed: np.ndarray, k: int) -> np.ndarray:
    """(layer_count, k) float64: per layer, the weight of each input in the root of Adasum's
    tree over ``k`` inputs, from their packed Gram matrices (``gram``, summed over shards)."""
    if _LIB is not None and operator.HOST_CODE:
        packed = np.ascontiguousarray(packed, dtype=np.float64)
        weights = np.empty((packed.shape[0], k))
        pairs, divisors = _flat_tree(k)
        _LIB.hx_adasum_tree_weights(packed.ctypes.data, packed.shape[0], k, pairs.ctypes.data,
                                    divisors.ctypes.data, len(pairs), ZERO_SIDE,
                                    weights.ctypes.data)
        return weights
    return tree_weights_numpy(packed, k)


def tree_weights_numpy(packed: np.ndarray, k: int) -> np.ndarray:
    """``tree_weights`` in numpy, where the C kernels are not built or are switched off."""
    layers = packed.shape[0]
    g = np.zeros((layers, k, k))
    rows, cols = np.triu_indices(k)
    g[:, rows, cols] = packed
    g[:, cols, rows] = packed
    scale = np.sqrt(np.maximum(np.diagonal(g, axis1=1, axis2=2), 0.0))   # |x_j| per layer
    w = np.broadcast_to(np.eye(k), (layers, k, k)).copy()   # w[:, node]: the node's weights
    for pairs in tree_levels(k):
        for a, b, (div_a, div_b) in pairs:
            wa, wb = w[:, a], w[:, b]
            ga, gb = np.einsum("lij,lj->li", g, wa), np.einsum("lij,lj->li", g, wb)
            ab = np.einsum("li,li->l", wa, gb)
            aa, bb = np.einsum("li,li->l", wa, ga), np.einsum("li,li->l", wb, gb)
            a_zero = aa <= ZERO_SIDE * np.einsum("li,li->l", np.abs(wa), scale) ** 2
            b_zero = bb <= ZERO_SIDE * np.einsum("li,li->l", np.abs(wb), scale) ** 2
            ab = np.where(a_zero | b_zero, 0.0, ab)
            with np.errstate(divide="ignore", invalid="ignore"):
                ca = np.where(a_zero, 1.0, 1.0 - ab / (div_a * aa))
                cb = np.where(b_zero, 1.0, 1.0 - ab / (div_b * bb))
            w[:, a] = ca[:, None] * wa + cb[:, None] * wb
    return np.ascontiguousarray(w[:, 0])


def mix_(out: torch.Tensor, vectors: List[torch.Tensor], weights: np.ndarray, piece: Piece,
         copy: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``out`` = sum_j weights[layer, j] * vectors[j] on the segments of ``piece`` (weights
    rounded to the vectors' type, float32 for 16-bit ones, terms added in order), also into
    ``copy`` when given; ``out`` and ``copy`` may each be one of ``vectors``."""
    if not piece.count:
        return out
    k = len(vectors)
    kernel = _kernel("mix", list(vectors) + [out] + ([] if copy is None else [copy]))
    if kernel is not None:
        weights = np.ascontiguousarray(weights, dtype=np.float64)
        kernel(_addresses(vectors), k, out.data_ptr(), None if copy is None else copy.data_ptr(),
               piece.address, piece.count, weights.ctypes.data)
        return out
    work = torch.float32 if out.dtype in (torch.float16, torch.bfloat16) else out.dtype
    table = torch.from_numpy(np.ascontiguousarray(weights)).to(work)
    for item in piece.items:
        if isinstance(item, Run):   # many small layers: the weights repeated per element
            start, end = item.start, item.end
            w = torch.repeat_interleave(table[item.layers], item.lengths, dim=0)
        else:
            start, end, w = item.start, item.end, table[item.layer]
        total = w[..., 0] * vectors[0][start:end].to(work)
        for j in range(1, k):
            total = total + w[..., j] * vectors[j][start:end].to(work)
        out[start:end] = total
        if copy is not None:
            copy[start:end] = total
    return out


class HostTree:
    """``gram`` and ``mix_`` of k CPU vectors given by address, through the C kernels, for one
    layout that recurs every step (shared_memory.py keeps one per buffer): on small buffers the
    slices, tables and checks around the kernels cost more than the kernels.  The same kernels
    as those functions call, so the same bits."""

    def __init__(self, kernels: "operator.Kernels", suffix: str, k: int, layer_count: int):
        self.k, self.itemsize = k, kernels.itemsize
        self.vectors = (ctypes.c_void_p * k)()      # set by the caller before each pass
        self._dots = kernels.dots                   # two vectors: [a.b, a.a, b.b] per layer
        self._gram = getattr(_LIB, f"hx_adasum_gram_{suffix}")
        self._mix = getattr(_LIB, f"hx_adasum_mix_{suffix}")
        self._table = np.zeros((layer_count, 3 if k == 2 else pair_count(k)))
        self._table_at = self._table.ctypes.data

    @staticmethod
    def for_tensor(x: torch.Tensor, k: int, layer_count: int) -> Optional["HostTree"]:
        """A HostTree for vectors like ``x``, or None where the C kernels do not take them."""
        kernels = operator.kernels_for(x)
        suffix = _SUFFIX.get(x.dtype)
        if _LIB is None or kernels is None or suffix is None or compiled.used_for(x):
            return None
        return HostTree(kernels, suffix, k, layer_count)

    def gram(self, piece: Piece) -> np.ndarray:
        """This piece's table of ``self.vectors``, in the layout ``packed`` takes (a table
        summed over shards first, then packed: the sum of packed tables, bit for bit)."""
        self._table.fill(0.0)
        if self.k == 2:
            self._dots(self.vectors[0], self.vectors[1], piece, self._table_at)
        elif piece.count:
            self._gram(self.vectors, self.k, piece.address, piece.count, self._table_at)
        return self._table

    def packed(self, table: np.ndarray) -> np.ndarray:
        """A table from ``gram`` (or a sum of them) as ``gram()`` gives it."""
        return table[:, PAIR_AS_PACKED] if self.k == 2 else table

    def mix(self, out: int, copy: Optional[int], piece: Piece, weights: np.ndarray):
        """``mix_`` on ``self.vectors`` into the vectors at ``out`` and ``copy`` (or None)."""
        if piece.count:
            weights = np.ascontiguousarray(weights, dtype=np.float64)   # alive for the call
            self._mix(self.vectors, self.k, out, copy, piece.address, piece.count,
                      weights.ctypes.data)
