"""The registry of reduction ops: every op is registered under a unique name on every rank; the
engine sends only the name across ranks during negotiation and looks the op up here, so a
user's own op works everywhere a built-in one does."""
from typing import Dict, Union

from .base import Op


_REGISTRY: Dict[str, Op] = {}


def register_op(op: Op, replace: bool = False) -> Op:
    """Register ``op`` under ``op.name`` on this rank; every rank must register it."""
    if not isinstance(op, Op) or not op.name:
        raise TypeError(f"register_op needs an Op instance with a name, got {op!r}")
    existing = _REGISTRY.get(op.name)
    if existing is not None and existing is not op and not replace:
        raise ValueError(f"an op named {op.name!r} is registered already; pass replace=True")
    _REGISTRY[op.name] = op
    return op


def configured_op(op: Op) -> Op:
    """The op registered under ``op.name`` when it is of ``op``'s type (made by the same
    factory with the same settings, whose values the name holds), else ``op`` registered now:
    so a factory such as ``hvd.RandomK(ratio)`` returns the same object wherever a rank calls
    it."""
    existing = _REGISTRY.get(op.name)
    if existing is None:
        return register_op(op)
    if type(existing) is not type(op):
        raise ValueError(f"an op named {op.name!r} is registered already and is not a "
                         f"{type(op).__name__}")
    return existing


def get_op(op: Union[str, Op]) -> Op:
    if isinstance(op, Op):
        if _REGISTRY.get(op.name) is not op:
            raise ValueError(f"op {op.name!r} is not registered: call hvd.register_op(op) on "
                             f"every rank first")
        return op
    try:
        return _REGISTRY[op]
    except (KeyError, TypeError):
        raise ValueError(f"unknown reduction op {op!r}; registered ops: "
                         f"{sorted(_REGISTRY)}") from None


def registered_ops() -> Dict[str, Op]:
    """Every op ``op=`` accepts, by name (built-in and ``register_op``-ed)."""
    return dict(_REGISTRY)


def reset_all() -> None:
    """``reset()`` every registered op (a new world)."""
    for op in _REGISTRY.values():
        op.reset()
