"""Cluster descriptions for the step-time model: nodes, ranks per node and the links between them.

Rates and times are read as people write them: ``25gbit``, ``100mbit``, ``10Gbit/s`` (bits per
second, turned into bytes per second), ``20us``, ``1.5ms``.
"""
import re
from dataclasses import dataclass, replace
from typing import Optional

_RATE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(bit|b)?(?:/s|ps)?\s*$", re.IGNORECASE)
_TIME = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(ns|us|ms|s)?\s*$", re.IGNORECASE)
_PREFIX = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_TIME_UNIT = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0, None: 1.0}


def parse_rate(text) -> float:
    """Bytes per second from a link rate in bits per second ("25gbit", "100Mbit/s")."""
    if isinstance(text, (int, float)):
        return float(text)
    m = _RATE.match(str(text))
    if not m or (m.group(3) or "").lower() == "b" and m.group(2) == "":
        raise ValueError(f"link rate {text!r}: expected a number and a unit such as "
                         f"100mbit, 10gbit or 25Gbit/s")
    value = float(m.group(1)) * _PREFIX[m.group(2).lower()]
    if value <= 0:
        raise ValueError(f"link rate {text!r} must be positive")
    return value / 8.0


def parse_time(text) -> float:
    """Seconds from "20us", "1.5ms", "0.2s" (a bare number is seconds)."""
    if isinstance(text, (int, float)):
        return float(text)
    m = _TIME.match(str(text))
    if not m:
        raise ValueError(f"time {text!r}: expected a number and a unit such as 20us or 1ms")
    return float(m.group(1)) * _TIME_UNIT[m.group(2).lower() if m.group(2) else None]


def format_rate(bytes_per_s: float) -> str:
    bits = bytes_per_s * 8
    for unit, scale in (("Tbit/s", 1e12), ("Gbit/s", 1e9), ("Mbit/s", 1e6)):
        if bits >= scale:
            return f"{bits / scale:g} {unit}"
    return f"{bits / 1e3:g} kbit/s"


@dataclass(frozen=True)
class Cluster:
    """``nodes`` hosts of ``ranks_per_node`` ranks, each host on one full-duplex link of
    ``link_Bps`` bytes per second each way to a switch, ``latency_s`` one way between hosts.
    Racks: ``nodes_per_rack`` hosts share a top-of-rack switch whose uplink carries
    ``nodes_per_rack * link_Bps / oversubscription`` (0: one non-blocking switch).  Ranks of a
    host reach each other over loopback TCP (flat collectives) or shared memory (the in-node
    steps of the hierarchical ones), at the rates of the profile unless given here.

    ``shared_cores``: all ranks of all nodes share this many cores, as on a cluster emulated on
    one machine (the network lab); local work that every rank does at once then takes
    ``ranks / shared_cores`` times as long.  0: each rank has a core of its own."""

    nodes: int
    ranks_per_node: int
    link_Bps: float
    latency_s: float = 25e-6
    nodes_per_rack: int = 0
    oversubscription: float = 1.0
    loopback_Bps: Optional[float] = None
    loopback_latency_s: Optional[float] = None
    shared_cores: int = 0

    def __post_init__(self):
        if self.nodes < 1 or self.ranks_per_node < 1:
            raise ValueError(f"a cluster needs at least one node and one rank per node, got "
                             f"{self.nodes} nodes x {self.ranks_per_node}")
        if self.link_Bps <= 0 or self.latency_s < 0:
            raise ValueError("link rate must be positive and latency not negative")
        if self.nodes_per_rack < 0 or self.oversubscription < 1:
            raise ValueError("nodes_per_rack must be >= 0 and oversubscription >= 1")
        if self.shared_cores < 0:
            raise ValueError("shared_cores must be >= 0 (0: a core per rank)")

    @property
    def ranks(self) -> int:
        return self.nodes * self.ranks_per_node

    @property
    def cpu_share(self) -> float:
        """How many times longer local work takes than on a core of its own."""
        return max(1.0, self.ranks / self.shared_cores) if self.shared_cores else 1.0

    def with_nodes(self, nodes: int) -> "Cluster":
        return replace(self, nodes=nodes)

    def describe(self) -> str:
        text = (f"{self.nodes} nodes x {self.ranks_per_node} ranks, {format_rate(self.link_Bps)} "
                f"links, {self.latency_s * 1e6:g} us")
        if self.nodes_per_rack and self.nodes > self.nodes_per_rack:
            text += (f", racks of {self.nodes_per_rack} with {self.oversubscription:g}:1 "
                     f"oversubscribed uplinks")
        if self.shared_cores:
            text += f", all ranks on {self.shared_cores} shared cores"
        return text
