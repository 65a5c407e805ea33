"""The caller's side of ``horovod_ext.run`` and the wire between it and its workers.

A small TCP server in the calling process hands every worker the pickled function and collects
what each returns or raises.  Each message is one request and one reply on its own connection,
each a length-prefixed pickle preceded by an HMAC-SHA256 of it under the run's random key, so
that nothing but this run's workers can fetch the function or post a result (and nothing is
unpickled before its MAC checks out).  Functions and results go through cloudpickle, as in
Horovod, so that functions defined in ``__main__`` or a notebook cell travel by value.
"""
import hashlib
import hmac
import pickle
import secrets
import socket
import struct
import threading
from typing import Dict, List, Optional, Tuple

try:
    import cloudpickle as _pickler
except ImportError:  # plain pickle: functions must then be importable on the workers
    _pickler = pickle

_HEADER = struct.Struct("!Q")
_MAC_BYTES = 32
# Longest a worker waits for the caller's answer: the caller answers at once, so this only
# bounds a connection to a caller that has gone.
REQUEST_TIMEOUT_S = 60.0


def dumps(obj) -> bytes:
    return _pickler.dumps(obj)


def loads(data: bytes):
    return pickle.loads(data)


def _mac(key: bytes, data: bytes) -> bytes:
    return hmac.new(key, data, hashlib.sha256).digest()


def _recv_exact(sock, n: int) -> bytes:
    chunks, left = [], n
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise ConnectionError("connection closed mid-message")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def send_message(sock, key: bytes, obj) -> None:
    data = dumps(obj)
    sock.sendall(_mac(key, data) + _HEADER.pack(len(data)) + data)


def recv_message(sock, key: bytes):
    mac = _recv_exact(sock, _MAC_BYTES)
    (length,) = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
    data = _recv_exact(sock, length)
    if not hmac.compare_digest(mac, _mac(key, data)):
        raise PermissionError("message with a wrong key")
    return loads(data)


class Client:
    """A worker's connection to the caller (``where`` = ``ADDR[,ADDR...]:PORT``: the first
    address that answers is used)."""

    def __init__(self, where: str, key_hex: str):
        addrs, _, port = where.rpartition(":")
        self.addrs, self.port = addrs.split(","), int(port)
        self.key = bytes.fromhex(key_hex)

    def request(self, message):
        last = None
        for addr in self.addrs:
            try:
                sock = socket.create_connection((addr, self.port), timeout=REQUEST_TIMEOUT_S)
            except OSError as exc:
                last = exc
                continue
            with sock:
                send_message(sock, self.key, message)
                return recv_message(sock, self.key)
        raise ConnectionError(f"cannot reach the caller of horovod_ext.run at "
                              f"{','.join(self.addrs)}:{self.port}: {last}")


class Server:
    """Serves ``payload`` (the pickled function and arguments) and gathers the workers'
    outcomes: ``results`` {rank: value} and ``errors`` [(rank, exception or None, traceback
    text)] in the order they came."""

    def __init__(self, payload: bytes, bind: str):
        self.key = secrets.token_bytes(32)
        self.payload = payload
        self.results: Dict[int, object] = {}
        self.errors: List[Tuple[int, Optional[BaseException], str]] = []
        self._lock = threading.Lock()
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((bind, 0))
        self._sock.listen(128)
        self.port = self._sock.getsockname()[1]
        self._closed = False
        threading.Thread(target=self._serve, daemon=True, name="horovod_ext.run driver").start()

    @property
    def key_hex(self) -> str:
        return self.key.hex()

    def _serve(self):
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn):
        with conn:
            conn.settimeout(REQUEST_TIMEOUT_S)
            try:
                message = recv_message(conn, self.key)
            except (OSError, ConnectionError, PermissionError, pickle.UnpicklingError, EOFError):
                return  # not one of ours, or a worker that died mid-message
            kind, rank = message[0], message[1]
            with self._lock:
                if kind == "fetch":
                    reply = self.payload
                elif kind == "result":
                    self.results[rank] = loads(message[2])
                    reply = True
                else:
                    exc = None
                    if message[2] is not None:
                        try:
                            exc = loads(message[2])
                        except Exception:  # a class the caller cannot import: text only
                            exc = None
                    self.errors.append((rank, exc, message[3]))
                    reply = True
            try:
                send_message(conn, self.key, reply)
            except OSError:
                pass

    def close(self):
        self._closed = True
        self._sock.close()


def caller_addresses(remote: bool) -> Tuple[str, List[str]]:
    """(address to bind, addresses the workers try): loopback when every worker is local."""
    if not remote:
        return "127.0.0.1", ["127.0.0.1"]
    from .netinfo import ipv4_addresses
    addrs = [a for a in ipv4_addresses() if not a.startswith("127.")]
    return "0.0.0.0", addrs + ["127.0.0.1"]


def describe(where: List[str], port: int) -> str:
    return f"{','.join(where)}:{port}"

