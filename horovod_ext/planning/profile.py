"""Calibrated costs of local work and of the software around each message, as measured on one
machine by ``benchmarks/calibrate.py`` and stored as JSON.

Costs are seconds per byte on one core (the ranks of a node each have their own), plus a few
per-call constants: ``message`` (the software time of one send/receive pair beyond the link's
latency), ``call`` (one collective's fixed cost in the engine), ``control_per_rank`` (rank 0's
share of one negotiation round per rank).  ``flops_per_s`` times the matrix products of
PowerSGD.  ``links`` holds what the network lab measured per link rate: the fraction of the
nominal rate that TCP achieves and the latency; a cluster's stated rate is scaled by that
``efficiency``.  ``per_op`` holds, for each op that runs its own cross-node step, the local
work that the primitives above do not account for (fusion copies, per-tensor bookkeeping, mask
drawing, orthogonalisation), fitted on two loopback ranks posing as two hosts as ``call +
per_byte * bytes + per_tensor * tensors``.  The file the package ships, ``profile_cpu.json``,
says the commit, date and machine that made it.
"""
import json
import os
from dataclasses import dataclass, field
from typing import Any, Dict, Optional

PROFILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "profile_cpu.json")

#: Per-byte costs a profile must have (seconds per byte of input, one core).
PER_BYTE = ("reduce", "copy", "shm_reduce", "adasum", "onebit_compress", "onebit_decompress",
            "randomk_gather", "randomk_scatter", "optimizer_adam", "optimizer_lamb")
#: Fixed costs (seconds).
PER_CALL = ("message", "call", "control_per_rank")


@dataclass
class Profile:
    per_byte: Dict[str, float]
    per_call: Dict[str, float]
    flops_per_s: float
    loopback_Bps: float
    loopback_latency_s: float
    efficiency: float = 0.95
    links: Dict[str, Dict[str, float]] = field(default_factory=dict)
    per_op: Dict[str, Dict[str, Any]] = field(default_factory=dict)
    meta: Dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        missing = [k for k in PER_BYTE if k not in self.per_byte] + \
                  [k for k in PER_CALL if k not in self.per_call]
        if missing:
            raise ValueError(f"profile lacks the costs {missing}: re-run benchmarks/calibrate.py")

    def cost(self, what: str, nbytes: float) -> float:
        """Seconds of ``what`` on ``nbytes`` (``message``: ``nbytes`` messages)."""
        if what in self.per_call:
            return self.per_call[what] * nbytes
        return self.per_byte[what] * nbytes

    def flops(self, count: float) -> float:
        return count / self.flops_per_s

    def op_work(self, op: str, nbytes: float, tensors: int) -> float:
        """Seconds of ``op``'s own local work on ``nbytes`` in ``tensors`` tensors (0 for an op
        the profile has no fit for)."""
        fit = self.per_op.get(op)
        if not fit:
            return 0.0
        return fit["call"] + fit["per_byte"] * nbytes + fit["per_tensor"] * tensors

    def to_json(self) -> Dict[str, Any]:
        return {"per_byte": self.per_byte, "per_call": self.per_call,
                "flops_per_s": self.flops_per_s, "loopback_Bps": self.loopback_Bps,
                "loopback_latency_s": self.loopback_latency_s, "efficiency": self.efficiency,
                "links": self.links, "per_op": self.per_op, "meta": self.meta}

    @classmethod
    def from_json(cls, data: Dict[str, Any]) -> "Profile":
        return cls(**{k: data[k] for k in ("per_byte", "per_call", "flops_per_s", "loopback_Bps",
                                            "loopback_latency_s")},
                   efficiency=data.get("efficiency", 0.95), links=data.get("links", {}),
                   per_op=data.get("per_op", {}), meta=data.get("meta", {}))

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_json(), f, indent=1, sort_keys=True)
            f.write("\n")


def load(path: Optional[str] = None) -> Profile:
    """The profile at ``path`` (default: the one this package ships)."""
    path = path or PROFILE
    try:
        with open(path) as f:
            return Profile.from_json(json.load(f))
    except FileNotFoundError:
        raise FileNotFoundError(f"no profile at {path}: make one with "
                                f".venv/bin/python benchmarks/calibrate.py") from None
