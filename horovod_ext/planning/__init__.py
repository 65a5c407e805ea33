"""The scale model: predicted reduction and training-step times of every op on clusters of any
size, from calibrated local costs (profile.py) and SimGrid's network model (simulate.py).

    import horovod_ext
    print(horovod_ext.plan(model_size="340M", compute_ms=300, nodes=64, ranks_per_node=8,
                           link="25gbit").table())

or ``.venv/bin/hvdrun --plan --model-size 340M --compute-ms 300 --nodes 64 --ranks-per-node 8
--link 25gbit``.  Needs SimGrid's Python module (``apt-get install python3-simgrid``).
"""
from typing import Optional, Sequence

from .cluster import Cluster, parse_rate, parse_time
from .predict import OPS, Options, Plan, reduction_times, training_step
from .predict import plan as _plan
from .profile import Profile, load as load_profile
from .simulate import EngineMissing

__all__ = ["plan", "Cluster", "Plan", "Options", "Profile", "load_profile", "reduction_times",
           "training_step", "parse_size", "EngineMissing", "OPS"]

_SIZE_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "b": 1e9, "t": 1e12}


def parse_size(text) -> float:
    """A parameter count from "340M", "1.3B", "25e6" or a number."""
    if isinstance(text, (int, float)):
        value = float(text)
    else:
        t = str(text).strip().lower()
        unit = t[-1] if t and t[-1] in "kmgbt" else ""
        try:
            value = float(t[:-1] if unit else t) * _SIZE_UNITS[unit]
        except ValueError:
            raise ValueError(f"model size {text!r}: expected a parameter count such as 340M "
                             f"or 1.3B") from None
    if value <= 0:
        raise ValueError(f"model size {text!r} must be positive")
    return value


def plan(model_size=None, compute_ms: float = 0.0, nodes: int = 2, ranks_per_node: int = 1,
         link="10gbit", latency="25us", nodes_per_rack: int = 0, oversubscription: float = 1.0,
         model=None, ops: Sequence[str] = tuple(OPS), profile: Optional[str] = None,
         options: Optional[Options] = None, optimizer_ms: Optional[float] = None) -> Plan:
    """Predicted step time and bytes per step of each op, flat and hierarchical, for data-parallel
    training of a model (``model_size`` parameters, or a torch ``model`` whose trainable float
    parameters are counted) whose forward and backward take ``compute_ms`` per rank, on
    ``nodes`` x ``ranks_per_node`` ranks with ``link`` (e.g. "25gbit") between nodes.  The
    optimizer step takes ``optimizer_ms`` (default: the profile's per-core cost of Adam, or of
    LAMB for 1-bit LAMB and SLAMB, for the model's size)."""
    if model is not None:
        count = sum(p.numel() for p in model.parameters() if p.requires_grad)
    elif model_size is not None:
        count = parse_size(model_size)
    else:
        raise ValueError("plan needs model_size (a parameter count) or model")
    if compute_ms < 0 or (optimizer_ms is not None and optimizer_ms < 0):
        raise ValueError("compute_ms and optimizer_ms must not be negative")
    unknown = [op for op in ops if op not in OPS]
    if unknown:
        raise ValueError(f"unknown ops {unknown}: known are {', '.join(OPS)}")
    cluster = Cluster(nodes=int(nodes), ranks_per_node=int(ranks_per_node),
                      link_Bps=parse_rate(link), latency_s=parse_time(latency),
                      nodes_per_rack=int(nodes_per_rack), oversubscription=float(oversubscription))
    return _plan(cluster, 4.0 * count, compute_ms / 1e3, ops, load_profile(profile), options,
                 None if optimizer_ms is None else optimizer_ms / 1e3)
