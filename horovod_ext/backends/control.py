"""Control plane for the background engine: an allgather of small byte strings with deadlines.

Negotiation runs every cycle (about a millisecond), so it must be cheap whatever the data
transport is: Gloo's small-message latency here is 0.3-2 ms while a TCP round trip is ~40 us.
Ranks connect to rank 0 (a star); rank 0 collects every rank's message and sends the list back.
A peer that closes its socket is reported at once by name; one that stops answering is reported
after the timeout.  When rank 0 sees a failure it tells the others before closing, so every rank
raises an error that names the culprit.
"""
import fcntl
import socket
import struct
import time
from typing import List, Optional

from .base import CommunicationError, Communicator, PeerClosedError

_HEADER = struct.Struct("!Q")


class StarFrames:
    """The reply rank 0 sends in this channel's star-shaped allgather.  ``ok``: a status byte,
    the count, every payload's length, the payloads; ``error``: a status byte and a message that
    every rank raises.  Plain bytes, no pickle: it is built every cycle."""

    @staticmethod
    def ok(payloads: List[bytes]) -> bytes:
        lengths = struct.pack(f"!BI{len(payloads)}I", 0, len(payloads), *map(len, payloads))
        return lengths + b"".join(payloads)

    @staticmethod
    def error(message: str) -> bytes:
        return b"\x01" + message.encode()

    @staticmethod
    def unpack_reply(frame: bytes) -> List[bytes]:
        if frame[:1] != b"\x00":
            raise CommunicationError(frame[1:].decode(errors="replace"))
        (count,) = struct.unpack_from("!I", frame, 1)
        lengths = struct.unpack_from(f"!{count}I", frame, 5)
        out, pos = [], 5 + 4 * count
        for n in lengths:
            out.append(frame[pos:pos + n])
            pos += n
        return out


def local_ipv4_addresses(iface: Optional[str] = None) -> List[str]:
    """This host's IPv4 addresses, loopback last; only ``iface``'s when given."""
    found = []
    for _, name in socket.if_nameindex():
        if iface and name != iface:
            continue
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                req = struct.pack("256s", name.encode()[:15])
                addr = socket.inet_ntoa(fcntl.ioctl(s.fileno(), 0x8915, req)[20:24])  # SIOCGIFADDR
        except OSError:
            continue
        found.append(addr)
    found.sort(key=lambda a: a.startswith("127."))
    return found or ["127.0.0.1"]


class ControlChannel:
    def __init__(self, rank: int, size: int, timeout: float):
        self.rank, self.size, self.timeout = rank, size, timeout
        self._peers = {}   # rank 0: worker rank -> socket
        self._coord = None  # workers: socket to rank 0

    @classmethod
    def connect(cls, comm: Communicator, timeout: float,
                iface: Optional[str] = None) -> "ControlChannel":
        """Collective over ``comm``: rank 0 listens, the others connect to it."""
        chan = cls(comm.rank, comm.size, timeout)
        if comm.size > 1:
            links = connect_star(comm, timeout, iface, "control plane")
            if comm.rank == 0:
                chan._peers = links
            else:
                chan._coord = links[0]
        return chan

    # --- the one operation --------------------------------------------------------------------
    def allgather(self, payload: bytes, caller_blocked: bool = False) -> List[bytes]:
        """Every rank's payload, in rank order (``caller_blocked`` changes nothing here: a
        socket read sleeps until the data is there)."""
        if self.size == 1:
            return [payload]
        if self.rank != 0:
            _send_frame(self._coord, payload)
            return StarFrames.unpack_reply(_recv_frame(self._coord, "rank 0"))
        gathered = [payload]
        try:
            for peer in range(1, self.size):
                gathered.append(_recv_frame(self._peers[peer], f"rank {peer}"))
        except CommunicationError as exc:
            self._tell_all(StarFrames.error(f"{exc} (reported by rank 0)"), ok=False)
            raise
        self._tell_all(StarFrames.ok(gathered))
        return gathered

    def agree(self, payload: bytes, caller_blocked: bool = False) -> Optional[List[bytes]]:
        """None when every rank sent ``payload`` (the engine's steady state), otherwise every
        rank's payload in rank order."""
        messages = self.allgather(payload, caller_blocked)
        return None if all(m == payload for m in messages) else messages

    def _tell_all(self, frame: bytes, ok: bool = True):
        failed = []
        for peer, sock in self._peers.items():
            try:
                _send_frame(sock, frame, f"rank {peer}")
            except CommunicationError:
                failed.append(peer)
        if failed and ok:
            raise CommunicationError(f"control plane: lost the connection to ranks {failed}: "
                                     f"they have died or shut down")

    def abort(self):
        """End a wait in this channel at once (a peer has failed elsewhere, liveness.py): its
        sockets are shut down, so a blocked receive returns."""
        for sock in self._sockets():
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self):
        for sock in self._sockets():
            try:
                sock.close()
            except OSError:
                pass
        self._peers, self._coord = {}, None

    def _sockets(self):
        return [s for s in list(self._peers.values()) + [self._coord] if s is not None]


def connect_star(comm: Communicator, timeout: float, iface: Optional[str],
                 what: str) -> dict:
    """Collective over ``comm``: TCP connections between rank 0 and every other rank.  Rank 0
    gets {worker rank: socket}; the others {0: socket to rank 0}.  ``what`` names the channel
    in errors."""
    listener = None
    if comm.rank == 0:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.bind(("0.0.0.0", 0))
        listener.listen(comm.size)
        where = (local_ipv4_addresses(iface), listener.getsockname()[1])
    else:
        where = None
    addresses, port = comm.broadcast_object(where, root=0)
    if comm.rank != 0:
        return {0: _connect_to(comm.rank, addresses, port, timeout, what)}
    try:
        return _accept_all(listener, comm.size, timeout, what)
    finally:
        listener.close()


def _accept_all(listener, size: int, timeout: float, what: str) -> dict:
    peers = {}
    deadline = time.monotonic() + timeout
    while len(peers) < size - 1:
        listener.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            sock, _ = listener.accept()
        except socket.timeout:
            missing = sorted(set(range(1, size)) - set(peers))
            raise CommunicationError(f"{what}: ranks {missing} did not connect to rank 0 "
                                     f"within {timeout:.0f} s") from None
        _tune(sock)
        sock.settimeout(timeout)
        (peer,) = struct.unpack("!I", _recv_exact(sock, 4, "a new peer"))
        peers[peer] = sock
    return peers


def _connect_to(rank: int, addresses, port: int, timeout: float, what: str):
    errors = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for addr in addresses:
            try:
                sock = socket.create_connection((addr, port), timeout=2.0)
            except OSError as exc:
                errors.append(f"{addr}:{port}: {exc}")
                continue
            _tune(sock)
            sock.settimeout(timeout)
            sock.sendall(struct.pack("!I", rank))
            return sock
        time.sleep(0.1)
    raise CommunicationError(f"{what}: rank {rank} could not reach rank 0 at {addresses} "
                             f"port {port}: {errors[-3:]}")


def _tune(sock):
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _send_frame(sock, data: bytes, who: str = "rank 0"):
    try:
        sock.sendall(_HEADER.pack(len(data)) + data)
    except OSError as exc:
        raise PeerClosedError(f"sending to {who} failed ({exc}): it has died or shut "
                              f"down") from None


def _recv_frame(sock, who: str) -> bytes:
    # One frame at most is in flight per direction (each reply answers one message), so the
    # first read may take the header and the body together: one system call in the usual case.
    buf = _recv_some(sock, 65536, who)
    while len(buf) < _HEADER.size:
        buf += _recv_some(sock, _HEADER.size - len(buf), who)
    (length,) = _HEADER.unpack_from(buf)
    end = _HEADER.size + length
    while len(buf) < end:
        buf += _recv_some(sock, end - len(buf), who)
    return bytes(buf[_HEADER.size:end])


def _recv_exact(sock, n: int, who: str) -> bytes:
    buf = b""
    while len(buf) < n:
        buf += _recv_some(sock, n - len(buf), who)
    return buf


def _recv_some(sock, n: int, who: str) -> bytes:
    try:
        chunk = sock.recv(n)
    except socket.timeout:
        raise CommunicationError(f"{who} did not answer within {sock.gettimeout():.0f} s: it "
                                 f"has stopped or is stuck") from None
    except (ConnectionResetError, BrokenPipeError):
        chunk = b""
    except OSError as exc:
        raise CommunicationError(f"connection to {who} failed: {exc}") from None
    if not chunk:
        raise PeerClosedError(f"{who} closed its connection: it has died or shut down")
    return chunk
