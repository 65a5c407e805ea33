"""Liveness: heartbeats and failure notices on a channel of their own, beside the control plane.

The engine's control plane speaks only when the engine negotiates, and a rank blocked in a data
transfer negotiates nothing: a peer that has failed or stopped would be found only by that
transfer's timeout (a minute by default).  Here one thread per rank keeps a TCP star to rank 0
busy whatever the engine does.  Every rank sends a beat each ``interval`` seconds and rank 0
sends its own to every rank; a rank silent for ``MISSED_BEATS`` intervals (stopped, hung in a
driver, cut off) is reported to every rank by name, and so is one whose connection closes
without a goodbye (it has died).  A rank whose own work fails says so at once (``report``) and
rank 0 passes it on, so its peers stop waiting for it within a round trip.

Beats also carry each rank's progress: a count of the transfers it has started that every rank
starts in the same order (the bucket lane's sums), which no agreement round tracks.  Rank 0
keeps every rank's and, while some rank is behind the most advanced, lists those in its beats,
so that a rank whose transfer waits long can say which ranks had not started it (``behind``).

Every rank learns of each culprit once, through ``on_failure(notice)``, called on the channel's
thread.  A slow rank is never reported: its thread beats while its training computes.  Under
hvdrun's elastic mode the worker ids of ranks that stopped answering are kept until the next
join, which asks the driver to drop them as it drops dead ones (``take_stopped_workers``).
"""
import logging
import os
import select
import socket
import threading
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Set

from .base import CommunicationError, Communicator
from .control import connect_star

log = logging.getLogger("horovod_ext")

MISSED_BEATS = 2
EVERY_SET = -1   # a notice's scope when the rank itself is gone: every process set it is in

_stopped_workers: List[str] = []
_stopped_lock = threading.Lock()


def take_stopped_workers() -> List[str]:
    """The elastic worker ids of ranks reported as stopped since the last call."""
    with _stopped_lock:
        taken = list(_stopped_workers)
        _stopped_workers.clear()
    return taken


@dataclass(frozen=True)
class Notice:
    """A failure somewhere: ``scope`` is the process set whose work failed (EVERY_SET: the rank
    itself has died or stopped), ``rank`` the culprit's world rank, ``reason`` a sentence that
    names it, ``stopped`` whether it stopped answering (alive but hung), ``worker`` its elastic
    worker id ("" outside elastic runs)."""
    scope: int
    rank: int
    reason: str
    stopped: bool = False
    worker: str = ""


@dataclass
class _Link:
    sock: socket.socket
    label: str = ""          # "pid P on host H"
    worker: str = ""
    last_heard: float = 0.0
    pending: bytes = b""


class Liveness:
    """This rank's end of the heartbeat channel of a world of ``size`` ranks."""

    def __init__(self, rank: int, interval: float, links: Dict[int, _Link],
                 on_failure: Callable[[Notice], None]):
        self.rank, self.interval = rank, interval
        self._links = links                  # rank 0: every worker; a worker: {0: rank 0}
        self._on_failure = on_failure
        self._workers = {k: link.worker for k, link in links.items()}
        self._told: Set[int] = set()         # culprits already delivered here
        self._progress = 0                   # this rank's (advance())
        # rank -> its progress as last heard: rank 0 every rank's; a worker rank 0's and those
        # rank 0 last listed as behind (any other was at ``_most``)
        self._heard: Dict[int, int] = {}
        self._most = 0
        self._send_lock = threading.Lock()
        self._wake_r, self._wake_w = os.pipe()
        self._closing = False
        self._thread = threading.Thread(target=self._serve, name="horovod_ext-liveness",
                                        daemon=True)
        self._thread.start()

    @classmethod
    def connect(cls, comm: Communicator, interval: float, timeout: float, iface: Optional[str],
                identity: str, worker: str,
                on_failure: Callable[[Notice], None]) -> Optional["Liveness"]:
        """Collective over ``comm``; None when there is nothing to watch (one rank, or
        ``interval`` 0).  ``identity`` ("pid P on host H") and ``worker`` name this rank in
        its peers' notices."""
        if comm.size == 1 or interval <= 0:
            return None
        socks = connect_star(comm, timeout, iface, "heartbeat channel")
        links = {k: _Link(s) for k, s in socks.items()}
        hello = f"H {worker or '-'} {identity}\n".encode()
        for link in links.values():
            link.sock.sendall(hello)
        for k, link in links.items():   # every hello is the first line on its link
            line = _read_line(link.sock, timeout, f"rank {k}")
            _, wid, link.label = line.split(" ", 2)
            link.worker = "" if wid == "-" else wid
            link.last_heard = time.monotonic()
            link.sock.settimeout(max(interval, 1.0))   # sends only; reads wait in select()
        return cls(comm.rank, interval, links, on_failure)

    # --- called from other threads ------------------------------------------------------------
    def report(self, scope: int, reason: str):
        """This rank's work in process set ``scope`` has failed with ``reason``: tell every
        rank (through rank 0), at once."""
        self._send_all(_failure_line(scope, self.rank, reason, False, ""))

    def advance(self) -> int:
        """This rank has started one more ordered transfer: its number (from 1), which its
        peers hear with the next beat."""
        self._progress += 1
        return self._progress

    def behind(self, number: int) -> Optional[List[int]]:
        """The ranks that, as last heard, had not started this rank's ordered transfer
        ``number`` (a beat or two out of date), or None where that is not known yet."""
        heard = dict(self._heard)
        if self.rank != 0 and self._most < number:
            return None        # rank 0's last word predates this transfer
        return sorted(k for k, p in heard.items() if p < number and k != self.rank)

    def close(self):
        """Stop the thread and say goodbye: peers stop watching this rank.  Each link is
        drained until the peer closes its end (a second at most), so that closing with its
        beats unread does not reset the connection before the goodbye is read."""
        if self._closing:
            return
        self._closing = True
        os.write(self._wake_w, b"x")
        self._thread.join(timeout=5.0)
        self._send_all(b"X\n")
        deadline = time.monotonic() + 1.0
        for link in self._links.values():
            try:
                link.sock.shutdown(socket.SHUT_WR)
                while time.monotonic() < deadline:
                    link.sock.settimeout(max(0.01, deadline - time.monotonic()))
                    if not link.sock.recv(4096):
                        break
            except OSError:
                pass
            link.sock.close()
        os.close(self._wake_r)
        os.close(self._wake_w)

    # --- the channel's thread -----------------------------------------------------------------
    def _serve(self):
        next_beat = time.monotonic()
        while not self._closing:
            now = time.monotonic()
            if now >= next_beat:
                self._beat()
                next_beat = now + self.interval
            self._check_silence(now)
            by_fd = {link.sock.fileno(): k for k, link in self._links.items()}
            # awake at least four times a beat: silence is found within a quarter of one
            wait = min(next_beat - time.monotonic(), self.interval / 4)
            try:
                readable, _, _ = select.select(list(by_fd) + [self._wake_r], [], [],
                                               max(0.0, wait))
            except (OSError, ValueError):   # a socket closed under us: close() is running
                return
            for fd in readable:
                if fd != self._wake_r:
                    self._read(by_fd[fd])

    def _read(self, k: int):
        link = self._links[k]
        try:
            data = link.sock.recv(4096)
        except OSError:
            data = b""
        if not data:
            self._drop(k)
            self._fail(k, f"rank {k} ({link.label}) has died: its heartbeat connection "
                          f"closed without a goodbye", False)
            return
        link.last_heard = time.monotonic()
        link.pending += data
        while b"\n" in link.pending:
            line, link.pending = link.pending.split(b"\n", 1)
            self._handle(k, line.decode(errors="replace"))

    def _beat(self):
        """``B <progress>`` from a worker; from rank 0 ``B <progress> <most> <k:p,...>``, the
        ranks behind the most advanced."""
        if self.rank != 0:
            self._send_all(f"B {self._progress}\n".encode())
            return
        heard = {**self._heard, 0: self._progress}
        most = max(heard.values())
        late = ",".join(f"{k}:{p}" for k, p in heard.items() if p < most)
        self._send_all(f"B {self._progress} {most} {late or '-'}\n".encode())

    def _heard_beat(self, k: int, fields: List[str]):
        try:
            if self.rank == 0:
                self._heard[k] = int(fields[0])
            elif len(fields) >= 3:
                heard = {0: int(fields[0])}
                if fields[2] != "-":
                    heard.update((int(a), int(b)) for a, b in
                                 (item.split(":") for item in fields[2].split(",")))
                self._heard, self._most = heard, int(fields[1])
        except (IndexError, ValueError):
            pass               # a beat from an older peer: a liveness sign all the same

    def _handle(self, k: int, line: str):
        if line.startswith("B"):
            self._heard_beat(k, line.split()[1:])
        elif line == "X":      # a clean shutdown: nothing more to watch on this link
            self._drop(k)
        elif line.startswith("F "):
            _, scope, culprit, stopped, wid, reason = line.split(" ", 5)
            notice = Notice(int(scope), int(culprit), reason, stopped == "1",
                            "" if wid == "-" else wid)
            if self.rank == 0:   # pass it on to everyone but the sender
                self._send_all(line.encode() + b"\n", but=k)
            self._deliver(notice)

    def _check_silence(self, now: float):
        for k, link in list(self._links.items()):
            silent = now - link.last_heard
            if silent > MISSED_BEATS * self.interval:
                self._drop(k)
                self._fail(k, f"rank {k} ({link.label}) has stopped answering: no heartbeat "
                              f"for {silent:.1f} s (HOROVOD_HEARTBEAT_SECONDS="
                              f"{self.interval:g}); it is stopped, hung or cut off", True)

    def _fail(self, k: int, reason: str, stopped: bool):
        """Rank ``k`` has died or stopped: rank 0 tells everyone; every rank tells itself."""
        worker = self._workers.get(k, "")
        notice = Notice(EVERY_SET, k, reason, stopped, worker)
        if self.rank == 0:
            self._send_all(_failure_line(EVERY_SET, k, reason, stopped, worker))
        self._deliver(notice)

    def _deliver(self, notice: Notice):
        if notice.rank in self._told:
            return
        self._told.add(notice.rank)
        log.error("%s", notice.reason)
        if notice.stopped and notice.worker:
            with _stopped_lock:
                _stopped_workers.append(notice.worker)
        try:
            self._on_failure(notice)
        except Exception:   # noqa: BLE001 - the channel must keep serving the others
            log.exception("handling a failure notice failed")

    def _drop(self, k: int):
        link = self._links.pop(k, None)
        if link is not None:
            link.sock.close()

    def _send_all(self, data: bytes, but: Optional[int] = None):
        with self._send_lock:
            for k, link in list(self._links.items()):
                if k == but:
                    continue
                try:
                    link.sock.sendall(data)
                except OSError:   # found by the reader (closed) or the silence check
                    pass


def _failure_line(scope: int, rank: int, reason: str, stopped: bool, worker: str) -> bytes:
    flat = " ".join(reason.split())
    return f"F {scope} {rank} {int(stopped)} {worker or '-'} {flat}\n".encode()


def _read_line(sock: socket.socket, timeout: float, who: str) -> str:
    sock.settimeout(timeout)
    data = b""
    while not data.endswith(b"\n"):
        try:
            chunk = sock.recv(1)
        except OSError as exc:
            raise CommunicationError(f"heartbeat channel: {who} did not say hello: {exc}") \
                from None
        if not chunk:
            raise CommunicationError(f"heartbeat channel: {who} closed its connection")
        data += chunk
    return data[:-1].decode(errors="replace")
