"""Transfer times on a cluster from SimGrid's flow-level network model.

The network model is SimGrid's (CM02: links shared max-min among the flows crossing them);
what runs on it is ours (schedules.py).  The platform: one SimGrid host per
rank; a node's ranks reach each other through their loopback links and the world through the
node's full-duplex NIC; NICs meet at a switch, or at a rack switch whose uplink may be
oversubscribed.  Each transfer pattern of a schedule is simulated once, on its own, at 1 MiB
per unit of weight, with links of no latency: under this model the sharing of bandwidth makes
its time proportional to its size, so any size is read off from that one run, and the
pattern's longest route latency (known from the cluster) is added to it.

SimGrid keeps one platform per process, so each cluster is simulated in forked children (the
patterns dealt among up to one child per core, each on its own copy of the platform).  Its
Python module comes from Debian's ``python3-simgrid`` (PyPI has only the sources, which need
cmake and Boost to build); a virtual environment of the same Python finds it there.
"""
import glob
import importlib.util
import multiprocessing
import os
import sys
import time
from typing import Dict, Iterable, Tuple

from .cluster import Cluster
from .profile import Profile
from .schedules import Pattern

SIZE = 1 << 20                  # bytes per unit of weight in the run of a pattern
FLOWS_PER_CHILD = 4096          # a child builds the whole platform (about 1 s at 8192 ranks)
SYSTEM_FOLDERS = ("/usr/lib/python3/dist-packages",)


class EngineMissing(RuntimeError):
    """SimGrid's Python module cannot be loaded."""


def locate_simgrid():
    """The import spec of SimGrid's Python module: importable as is, or the system's build of it
    for this Python; EngineMissing, saying how to get it, otherwise."""
    try:
        spec = importlib.util.find_spec("simgrid")
    except ValueError:          # sys.modules["simgrid"] is None: taken as absent
        spec = None
    if spec is not None:
        return spec
    tag = f"cpython-{sys.version_info.major}{sys.version_info.minor}"
    found = [path for folder in SYSTEM_FOLDERS
             for path in glob.glob(os.path.join(folder, "simgrid*.so"))]
    for path in found:
        if tag in os.path.basename(path):
            return importlib.util.spec_from_file_location("simgrid", path)
    hint = (f" (found {', '.join(found)}, built for another Python than "
            f"{sys.version_info.major}.{sys.version_info.minor})" if found else "")
    raise EngineMissing("the scale model runs on SimGrid's Python module: apt-get install "
                        "python3-simgrid (Debian and Ubuntu; this environment then finds "
                        f"it){hint}")


def load_simgrid():
    """The ``simgrid`` module (importing it prints SimGrid's configuration on stderr)."""
    if sys.modules.get("simgrid") is not None:
        return sys.modules["simgrid"]
    spec = locate_simgrid()
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except ImportError as e:
        raise EngineMissing(f"SimGrid's module at {spec.origin} does not load: {e}") from None
    sys.modules["simgrid"] = module
    return module


def _build_platform(sg, cluster: Cluster, profile: Profile) -> list:
    """The cluster as SimGrid zones (links without latency: route_latency adds it); returns
    the host of each rank."""
    up = sg.LinkInRoute.Direction.UP
    loop_bw = cluster.loopback_Bps or profile.loopback_Bps
    nic_bw = cluster.link_Bps * profile.efficiency
    root = sg.NetZone.create_star_zone("cluster")
    racks = {}
    if cluster.nodes_per_rack and cluster.nodes > cluster.nodes_per_rack:
        for rack in range(-(-cluster.nodes // cluster.nodes_per_rack)):
            zone = sg.NetZone.create_star_zone(f"rack{rack}")
            zone.set_parent(root)
            racks[rack] = (zone, zone.create_router(f"rack{rack}-switch"))
    hosts = []
    for node in range(cluster.nodes):
        parent = racks[node // cluster.nodes_per_rack][0] if racks else root
        zone = sg.NetZone.create_star_zone(f"node{node}")
        zone.set_parent(parent)
        gateway = zone.create_router(f"node{node}-nic")
        for _ in range(cluster.ranks_per_node):
            host = zone.create_host(f"rank{len(hosts)}", 1e9).seal()
            loopback = zone.create_split_duplex_link(f"rank{len(hosts)}-lo", loop_bw).seal()
            zone.add_route(host.netpoint, None, None, None, [sg.LinkInRoute(loopback, up)], True)
            hosts.append(host)
        zone.seal()
        nic = parent.create_split_duplex_link(f"node{node}-nic", nic_bw).seal()
        parent.add_route(zone.netpoint, None, gateway, None, [sg.LinkInRoute(nic, up)], True)
    uplink_bw = cluster.nodes_per_rack * nic_bw / cluster.oversubscription
    for rack, (zone, switch) in racks.items():
        zone.seal()
        uplink = root.create_split_duplex_link(f"rack{rack}-uplink", uplink_bw).seal()
        root.add_route(zone.netpoint, None, switch, None, [sg.LinkInRoute(uplink, up)], True)
    root.seal()
    return hosts


def route_latency(cluster: Cluster, profile: Profile, pattern: Pattern) -> float:
    """The longest one-way latency of the pattern's routes: between nodes the cluster's, inside
    a node the loopback's."""
    per_node = cluster.ranks_per_node
    if any(s // per_node != d // per_node for s, d, _ in pattern.flows):
        return cluster.latency_s
    if any(s != d for s, d, _ in pattern.flows):
        return (cluster.loopback_latency_s if cluster.loopback_latency_s is not None
                else profile.loopback_latency_s)
    return 0.0


def _simulate(cluster: Cluster, profile: Profile, patterns) -> Dict[Pattern, Tuple[float, float]]:
    sg = load_simgrid()
    engine = sg.Engine(["horovod_ext-plan", "--cfg=network/model:CM02",
                        "--cfg=network/crosstraffic:0", "--log=root.thresh:critical",
                        "--log=xbt_cfg.thresh:critical"])
    hosts = _build_platform(sg, cluster, profile)
    result, failure = {}, []

    def driver():
        try:
            for pattern in patterns:
                latency = route_latency(cluster, profile, pattern)
                start = engine.clock
                comms = [sg.Comm.sendto_async(hosts[s], hosts[d], max(1, int(w * SIZE)))
                         for s, d, w in pattern.flows]
                if comms:
                    sg.Comm.wait_all(comms)
                result[pattern] = (latency, (engine.clock - start) / SIZE)
        except BaseException as e:  # noqa: B902 - an exception in an actor aborts SimGrid
            failure.append(repr(e))
    sg.Actor.create("schedule", hosts[0], driver)
    engine.run()
    if failure:
        raise RuntimeError(f"simulation failed: {failure[0]}")
    return result


def _child(conn, cluster, profile, patterns):
    # SimGrid prints its configuration on stderr; the outcome goes through the pipe
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        conn.send(("ok", _simulate(cluster, profile, patterns)))
    except BaseException as e:  # noqa: B902 - reported to the parent
        conn.send(("error", f"{type(e).__name__}: {e}"))
    finally:
        conn.close()


def _deal(patterns, parts: int):
    """``patterns`` in ``parts`` groups of about equal flows (the simulation's cost)."""
    groups = [[] for _ in range(parts)]
    loads = [0] * parts
    for pattern in sorted(patterns, key=lambda p: -len(p.flows)):
        least = loads.index(min(loads))
        groups[least].append(pattern)
        loads[least] += len(pattern.flows) + 1
    return [g for g in groups if g]


def pattern_times(cluster: Cluster, profile: Profile, patterns: Iterable[Pattern],
                  timeout: float = 600) -> Dict[Pattern, Tuple[float, float]]:
    """(latency, seconds per byte of weight) of each pattern on ``cluster``: the time of the
    pattern at ``b`` bytes per unit of weight is ``latency + b * per_byte``."""
    patterns = list(dict.fromkeys(p for p in patterns if p is not None))
    if not patterns:
        return {}
    locate_simgrid()    # a missing engine is reported here, not in the child
    ctx = multiprocessing.get_context("fork")
    flows = sum(len(p.flows) for p in patterns)
    parts = max(1, min(len(patterns), os.cpu_count() or 1, flows // FLOWS_PER_CHILD))
    children = []
    try:
        for group in _deal(patterns, parts):
            parent, child = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_child, args=(child, cluster, profile, group),
                               daemon=True)
            proc.start()
            child.close()
            children.append((parent, proc))
        result, deadline = {}, time.monotonic() + timeout
        for parent, proc in children:   # one deadline for them all: they run side by side
            result.update(_collect(cluster, parent, proc, deadline, timeout))
        return result
    finally:
        for _, proc in children:
            if proc.is_alive():
                proc.kill()
            proc.join()


def _collect(cluster: Cluster, parent, proc, deadline: float, timeout: float):
    try:
        if not parent.poll(max(0.0, deadline - time.monotonic())):
            raise TimeoutError(f"simulating {cluster.describe()} took over {timeout:.0f} s")
        status, value = parent.recv()
    except EOFError:
        proc.join()
        raise RuntimeError(f"the simulation of {cluster.describe()} died (exit code "
                           f"{proc.exitcode})") from None
    if status != "ok":
        raise RuntimeError(f"simulating {cluster.describe()}: {value}")
    return value
