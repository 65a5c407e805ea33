"""Hosts and slots: ``-H host1:2,host2:2`` or a hostfile, and the rank layout over them.

Ranks fill the hosts in the order given (host1's slots first), as horovodrun does; local and cross
ranks follow Horovod's definitions (cross rank: the host's index among the hosts that have a rank
with the same local rank).
"""
import socket
from dataclasses import dataclass
from typing import List, Sequence, Tuple


class HostError(ValueError):
    """A host list or hostfile that cannot be used (hvdrun exits 2 with this message)."""


@dataclass(frozen=True)
class Slot:
    rank: int
    size: int
    host: str
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int

    def env(self) -> dict:
        return {"HOROVOD_RANK": str(self.rank), "HOROVOD_SIZE": str(self.size),
                "HOROVOD_LOCAL_RANK": str(self.local_rank),
                "HOROVOD_LOCAL_SIZE": str(self.local_size),
                "HOROVOD_CROSS_RANK": str(self.cross_rank),
                "HOROVOD_CROSS_SIZE": str(self.cross_size),
                "HOROVOD_HOSTNAME": self.host}


def _host_entry(entry: str, where: str) -> Tuple[str, int]:
    name, sep, slots = entry.strip().rpartition(":")
    if not sep:
        name, slots = slots, "1"
    if not name or any(c.isspace() for c in name):
        raise HostError(f"{where}: bad host {entry!r}: expected NAME or NAME:SLOTS")
    try:
        count = int(slots)
    except ValueError:
        count = 0
    if count < 1:
        raise HostError(f"{where}: bad slot count in {entry!r}: expected a positive integer")
    return name, count


def parse_hosts(spec: str) -> List[Tuple[str, int]]:
    """``"a:2,b:2"`` -> [("a", 2), ("b", 2)]; a host without ``:N`` has one slot."""
    entries = [e for e in spec.split(",") if e.strip()]
    if not entries:
        raise HostError(f"-H/--hosts {spec!r} names no host")
    return _merge([_host_entry(e, "-H/--hosts") for e in entries])


def read_hostfile(path: str) -> List[Tuple[str, int]]:
    """horovodrun's hostfile: one ``NAME slots=N`` (or ``NAME:N``, or ``NAME``) per line, '#'
    comments."""
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError as exc:
        raise HostError(f"--hostfile {path}: {exc.strerror}") from None
    hosts = []
    for number, line in enumerate(lines, 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"--hostfile {path} line {number}"
        parts = line.split()
        if len(parts) == 2 and parts[1].startswith("slots="):
            hosts.append(_host_entry(f"{parts[0]}:{parts[1][len('slots='):]}", where))
        elif len(parts) == 1:
            hosts.append(_host_entry(parts[0], where))
        else:
            raise HostError(f"{where}: expected 'NAME slots=N', got {line!r}")
    if not hosts:
        raise HostError(f"--hostfile {path} names no host")
    return _merge(hosts)


def _merge(hosts):
    merged = {}
    for name, slots in hosts:  # a host named twice adds up, in first-seen order
        merged[name] = merged.get(name, 0) + slots
    return list(merged.items())


def assign(hosts: Sequence[Tuple[str, int]], np: int) -> List[Slot]:
    """One Slot per rank, filling ``hosts`` in order."""
    total = sum(s for _, s in hosts)
    if np > total:
        raise HostError(f"-np {np} asks for more processes than the {total} slots of the hosts "
                        f"({', '.join(f'{h}:{s}' for h, s in hosts)})")
    placed = []
    left = np
    for host, slots in hosts:
        n = min(slots, left)
        if n:
            placed.append((host, n))
        left -= n
    slots = []
    rank = 0
    for host_index, (host, n) in enumerate(placed):
        for local in range(n):
            with_local = [i for i, (_, m) in enumerate(placed) if m > local]
            slots.append(Slot(rank, np, host, local, n, with_local.index(host_index),
                              len(with_local)))
            rank += 1
    return slots


def is_local(host: str, local_addresses: Sequence[str] = ()) -> bool:
    """Whether ``host`` names this machine (then its ranks start without ssh)."""
    name = socket.gethostname()
    return host in ("localhost", "::1", name, name.split(".")[0]) \
        or host.startswith("127.") or host in local_addresses
