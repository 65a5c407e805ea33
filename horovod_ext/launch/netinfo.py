"""This host's IPv4 addresses and a free TCP port.

Self-contained (standard library only) because hvdrun also runs this file's source on every
remote host through ssh (``python -c``), where horovod_ext may not be importable by that
interpreter: run as a script it prints ``PORT NAME=ADDR...`` (``sys.argv[1]``: an interface
filter).
"""
import fcntl
import random
import socket
import struct
import sys


def interfaces(wanted=None):
    """[(interface, IPv4 address)] (only the interfaces named in ``wanted`` if given),
    loopback last."""
    found = []
    for _, name in socket.if_nameindex():
        if wanted and name not in wanted:
            continue
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                req = struct.pack("256s", name.encode()[:15])
                packed = fcntl.ioctl(s.fileno(), 0x8915, req)[20:24]  # SIOCGIFADDR
        except OSError:  # no IPv4 address on this interface
            continue
        found.append((name, socket.inet_ntoa(packed)))
    found.sort(key=lambda entry: entry[1].startswith("127."))
    return found


def ipv4_addresses(wanted=None):
    return [addr for _, addr in interfaces(wanted)]


def _distance(a, b):
    """Smaller when IPv4 addresses ``a`` and ``b`` share a longer prefix (same subnet)."""
    return int.from_bytes(socket.inet_aton(a), "big") ^ int.from_bytes(socket.inet_aton(b), "big")


def rendezvous_address(candidates, peers):
    """Of ``candidates`` (rank 0's host's addresses), the one closest to every other host
    (``peers``: each host's addresses); loopback only when there are no peers."""
    usable = [a for a in candidates if not a.startswith("127.")]
    if not peers:
        return "127.0.0.1"
    if not usable:
        return None
    def worst(addr):
        return max(min((_distance(addr, p) for p in host if not p.startswith("127.")),
                       default=1 << 32) for host in peers)
    return min(usable, key=worst)


def nearest_interface(interfaces_, target):
    """The interface whose address is ``target`` or closest to it: the one a host uses to
    reach ``target``."""
    usable = [(n, a) for n, a in interfaces_ if not a.startswith("127.")]
    return min(usable, key=lambda entry: _distance(entry[1], target))[0] if usable else None


def free_port(host=""):
    """A TCP port free now, for a rendezvous server started a moment later.  Taken below the
    kernel's ephemeral range: a port the kernel hands out (bind to 0) may go to any outgoing
    connection on the machine in between, and then the server fails with EADDRINUSE."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            ephemeral_low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 32768
    low = max(1024, ephemeral_low - 12000)
    for _ in range(200):
        port = random.randint(low, ephemeral_low - 1)
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # crowded: an ephemeral one, as before
        s.bind((host, 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    wanted = [i for i in sys.argv[1].split(",") if i] if len(sys.argv) > 1 else None
    print(free_port(), *(f"{name}={addr}" for name, addr in interfaces(wanted)))
