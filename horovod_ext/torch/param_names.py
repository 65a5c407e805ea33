"""The ``named_parameters`` argument of DistributedOptimizer and DiLoCo, checked once for both:
the names key requests (and per-name op state) that must match on every rank."""
import collections
from typing import List, Sequence, Tuple

import torch


def name_parameters(params: Sequence[torch.Tensor],
                    named_parameters) -> List[Tuple[str, torch.Tensor]]:
    """``(name, parameter)`` for each of ``params`` (an optimizer's, in param_groups order):
    ``param.{i}`` by position without ``named_parameters``; else its names, in its order, after
    checking that it holds (name, parameter) pairs with unique names naming every one of
    ``params`` (it may name more, as ``model.named_parameters()`` of a bigger model does)."""
    if named_parameters is None:
        return [(f"param.{i}", p) for i, p in enumerate(params)]
    named = list(named_parameters)
    if any(not isinstance(x, tuple) or len(x) != 2 for x in named):
        raise ValueError("named_parameters should be a sequence of (name, parameter) "
                         "tuples, usually model.named_parameters()")
    counts = collections.Counter(n for n, _ in named)
    dups = sorted(n for n, c in counts.items() if c > 1)
    if dups:
        raise ValueError(f"named_parameters has duplicate names: {dups}")
    known = {id(p) for _, p in named}
    missing = [i for i, p in enumerate(params) if id(p) not in known]
    if missing:
        raise ValueError(f"named_parameters does not name {len(missing)} of the "
                         f"optimizer's parameters (positions {missing[:10]} in "
                         f"param_groups); pass model.named_parameters() of the whole "
                         f"model")
    ours = {id(p) for p in params}
    return [(n, p) for n, p in named if id(p) in ours]
