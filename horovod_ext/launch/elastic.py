"""hvdrun's elastic mode: workers that fail are dropped, hosts that appear are used, and the job
goes on (``--min-np``, ``--max-np``, ``--host-discovery-script``, as horovodrun has them).

The driver (this module, in hvdrun's process) starts one worker per host slot and forms
*generations*: each worker's ``hvd.init()`` asks the driver for its place (``join`` over a TCP
connection), and once every live worker has asked, the driver answers each with its rank, the
size and a key prefix for torch's rendezvous in the driver's own store, which outlives every
worker.  A worker that fails is dropped and its host blacklisted (for a random time in
``--blacklist-cooldown-range``, else for the rest of the job); its peers see a failed collective,
restore their last commit and ask again.  When the discovery script (polled every second) offers
slots, workers are started there and the others learn it at their next ``commit()`` (a counter in
the store).  The job ends when every worker has exited 0, or, exit status 1 with the reason, when
fewer than ``--min-np`` workers can be had for ``--elastic-timeout`` seconds or when more than
``--reset-limit`` re-formings were needed.
"""
import os
import queue
import random
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from . import hosts as hostlib
from . import netinfo, remote
from .supervise import GRACE_S, Output, Supervisor, describe_exit
from horovod_ext.config import ELASTIC_UPDATES_KEY as UPDATES_KEY

DISCOVERY_PERIOD_S = 1.0
DISCOVERY_TIMEOUT_S = 10.0


class ElasticError(RuntimeError):
    pass


def discover(o) -> List[Tuple[str, int]]:
    """The hosts and slots on offer now: the discovery script's ``HOST[:SLOTS]`` lines, or the
    fixed -H/--hostfile list."""
    if not o.host_discovery_script:
        return list(o.host_list)
    try:
        out = subprocess.run(shlex.split(o.host_discovery_script), capture_output=True,
                             text=True, timeout=DISCOVERY_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ElasticError(f"--host-discovery-script failed: {exc}") from None
    if out.returncode != 0:
        raise ElasticError(f"--host-discovery-script exited with {out.returncode}: "
                           f"{out.stderr.strip()[-300:]}")
    found = []
    for line in out.stdout.splitlines():
        line = line.strip()
        if not line:
            continue
        name, sep, slots = line.rpartition(":")
        if not sep:
            name, slots = line, str(o.slots_per_host or 1)
        if not slots.isdigit() or not name:
            raise ElasticError(f"--host-discovery-script printed {line!r}: expected HOST:SLOTS")
        found.append((name, int(slots)))
    return found


@dataclass(eq=False)
class Worker:
    wid: int
    host: str
    slot: int
    proc: object = None
    status: str = "running"            # running, done, failed
    rank: Optional[int] = None         # in the last generation it was part of
    leaving: bool = False              # its slot is no longer offered: out at the next forming
    conn: Optional[socket.socket] = None   # its join, waiting for the next generation
    killed: bool = False               # by the driver: its peers reported it stopped


@dataclass
class _Blacklist:
    cooldown: Optional[Tuple[float, float]]
    until: Dict[str, float] = field(default_factory=dict)

    def add(self, host: str) -> str:
        if self.cooldown is None:
            self.until[host] = float("inf")
            return "for the rest of the job"
        seconds = random.uniform(*self.cooldown)
        self.until[host] = time.monotonic() + seconds
        return f"for {seconds:.0f} s"

    def blocks(self, host: str) -> bool:
        return self.until.get(host, 0.0) > time.monotonic()


class ElasticDriver:
    def __init__(self, o, base_env: Dict[str, str], agent_path: str):
        import datetime
        import torch.distributed as dist   # the store must outlive every worker: it lives here
        self.o, self.base_env, self.agent_path = o, base_env, agent_path
        self.cap = o.max_np or o.np
        self.sup = Supervisor(Output(o.output_filename, 3), o.start_timeout, {}, o.verbose)
        self.remote_ok = bool(o.host_discovery_script) or any(
            not hostlib.is_local(h, netinfo.ipv4_addresses()) for h, _ in o.host_list)
        bind = "0.0.0.0" if self.remote_ok else "127.0.0.1"
        mine = [a for a in netinfo.ipv4_addresses() if not a.startswith("127.")]
        self.address = mine[0] if self.remote_ok and mine else "127.0.0.1"
        self.store = dist.TCPStore(bind, 0, None, True,
                                   timeout=datetime.timedelta(seconds=o.elastic_timeout),
                                   wait_for_workers=False)
        self.store.add(UPDATES_KEY, 0)
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind((bind, 0))
        self.listener.listen(256)
        threading.Thread(target=self._accept, daemon=True).start()
        self.workers: List[Worker] = []
        self._interfaces: Dict[str, Optional[str]] = {}
        self.blacklist = _Blacklist(o.blacklist_cooldown_range)
        self.generation = 0
        self.finishing = False           # a worker has exited 0: no more new workers
        self.short_since: Optional[float] = None

    # --- joins ------------------------------------------------------------------------------
    def _accept(self):
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._read_join, args=(conn,), daemon=True).start()

    def _read_join(self, conn):
        conn.settimeout(10.0)
        data = b""
        try:
            while not data.endswith(b"\n") and len(data) < 1024:
                chunk = conn.recv(1024)
                if not chunk:
                    break
                data += chunk
        except OSError:
            conn.close()
            return
        parts = data.decode(errors="replace").split()
        if len(parts) >= 3 and parts[0] == "join" and parts[1].isdigit():
            for word in parts[3:]:   # peers it reports as stopped (their heartbeats ended)
                if word.startswith("stopped:") and word[8:].isdigit():
                    self.sup.events.put(("stopped", int(word[8:]), int(parts[1])))
            self.sup.events.put(("join", int(parts[1]), conn))
        else:
            conn.close()

    # --- workers ----------------------------------------------------------------------------
    def _say(self, message: str):
        self.sup._say(message)

    def _start(self, host: str, slot: int):
        wid = len(self.workers)
        worker = Worker(wid, host, slot)
        env = dict(self.base_env, HOROVOD_CPU_OPERATIONS="gloo", HOROVOD_HOSTNAME=host,
                   HOROVOD_ELASTIC="1", HOROVOD_ELASTIC_WORKER=str(wid),
                   HOROVOD_ELASTIC_DRIVER=f"{self.address}:{self.listener.getsockname()[1]}",
                   HOROVOD_ELASTIC_TIMEOUT=f"{self.o.elastic_timeout:g}")
        iface = self._gloo_interface(host)
        if iface:
            env.update(GLOO_SOCKET_IFNAME=iface, HOROVOD_GLOO_IFACE=iface)
        name = f"worker {wid} (host {host})"
        if hostlib.is_local(host, netinfo.ipv4_addresses()):
            worker.proc = self.sup.start(name, [sys.executable, "-I", self.agent_path]
                                         + list(self.o.command), env, agent=True, rank=wid,
                                         shown=" ".join(self.o.command))
        else:
            argv = remote.rank_command(remote.ssh_prefix(self.o), host, self.o.command,
                                       remote.forwarded_env(env), os.getcwd())
            worker.proc = self.sup.start(name, argv, dict(os.environ), agent=True, rank=wid,
                                         shown=" ".join(argv[:-1] + ["..."]))
        self.workers.append(worker)
        if self.o.verbose:
            self._say(f"started {name}")

    def _gloo_interface(self, host: str) -> Optional[str]:
        """The interface ``host``'s workers give Gloo: the one nearest the driver's address
        (asked of the host once, as hvdrun's fixed mode does), unless --network-interfaces or
        GLOO_SOCKET_IFNAME sets it; None on a job of this machine alone."""
        if not self.remote_ok or self.o.interfaces or "GLOO_SOCKET_IFNAME" in os.environ:
            return None
        if host not in self._interfaces:
            if hostlib.is_local(host, netinfo.ipv4_addresses()):
                found = netinfo.interfaces()
            else:
                found = remote.check_hosts(remote.ssh_prefix(self.o), [host], [],
                                           self.o.start_timeout)[host][1]
            self._interfaces[host] = netinfo.nearest_interface(found, self.address)
        return self._interfaces[host]

    def _live(self) -> List[Worker]:
        return [w for w in self.workers if w.status == "running"]

    def _fill(self, offered: List[Tuple[str, int]]) -> int:
        """Start workers on free slots of hosts not blacklisted, up to the cap; how many."""
        if self.finishing:
            return 0
        taken = {(w.host, w.slot) for w in self._live()}
        started = 0
        for host, slots in offered:
            if self.blacklist.blocks(host):
                continue
            for slot in range(slots):
                if len(self._live()) >= self.cap:
                    return started
                if (host, slot) not in taken:
                    self._start(host, slot)
                    started += 1
        return started

    # --- generations ------------------------------------------------------------------------
    def _mark_leaving(self, offered: List[Tuple[str, int]]) -> int:
        """Workers whose host or slot the discovery script no longer offers leave at the next
        re-forming (told the job is over for them: they exit 0); how many were marked."""
        slots = dict(offered)
        marked = 0
        for w in self._live():
            if not w.leaving and w.slot >= slots.get(w.host, 0):
                w.leaving = True
                marked += 1
                self._say(f"host {w.host} slot {w.slot} is no longer offered: worker {w.wid} "
                          f"leaves at the next re-forming")
        return marked

    def _try_form(self):
        live = self._live()
        if not live or any(w.conn is None for w in live):
            return
        staying = [w for w in live if not w.leaving]
        if len(staying) < self.o.min_np:
            return
        for w in live:
            if w.leaving:
                self._dismiss(w, "its host is no longer offered")
        live = staying
        order = {}
        for w in self.workers:
            order.setdefault(w.host, len(order))
        # Workers of the last generation first, in their old order: the new rank 0 then holds
        # the job's progress (sync() sends rank 0's state), never a worker that just started.
        members = sorted(live, key=lambda w: (w.rank is None, w.rank or 0, order[w.host],
                                              w.slot))
        self.generation += 1
        if self.generation > 1 and self.o.reset_limit is not None \
                and self.generation - 1 > self.o.reset_limit:
            raise ElasticError(f"the job re-formed more than --reset-limit "
                               f"{self.o.reset_limit} times")
        updates = self.store.add(UPDATES_KEY, 0)
        for rank, w in enumerate(members):
            w.rank = rank
            reply = (f"member {self.generation} {rank} {len(members)} {updates} "
                     f"{self.store.port}\n")
            try:
                w.conn.sendall(reply.encode())
            except OSError:
                pass
            w.conn.close()
            w.conn = None
        self._say(f"generation {self.generation}: {len(members)} workers on "
                  f"{', '.join(dict.fromkeys(w.host for w in members))}")

    def _dismiss(self, worker: Worker, why: str = "the job has finished"):
        try:
            worker.conn.sendall(f"finished {why}\n".encode())
        except OSError:
            pass
        worker.conn.close()
        worker.conn = None

    def _on_exit(self, proc, code: int):
        worker = next((w for w in self.workers if w.proc is proc), None)
        if worker is None:
            return
        if worker.conn is not None:
            worker.conn.close()
            worker.conn = None
        if code == 0:
            worker.status = "left" if worker.leaving else "done"
            self.finishing = self.finishing or not worker.leaving
            return
        worker.status = "failed"
        how_long = self.blacklist.add(worker.host)
        self._say(f"worker {worker.wid} (host {worker.host}) {describe_exit(code)}; host "
                  f"{worker.host} blacklisted {how_long}; going on with "
                  f"{len(self._live())} workers")

    def _drop_stopped(self, wid: int, reporter: int):
        """Worker ``wid`` stopped answering its peers (hung, SIGSTOP): killed, so that it
        leaves like a dead one and the others form without it."""
        worker = next((w for w in self.workers if w.wid == wid), None)
        if (worker is None or worker.status != "running" or worker.proc.code is not None
                or worker.killed):   # each survivor reports it: kill it once
            return
        worker.killed = True
        self._say(f"worker {wid} (host {worker.host}) stopped answering its peers' heartbeats "
                  f"(reported by worker {reporter}): killing it")
        worker.proc.kill()

    def _check_enough(self, now: float):
        live = len(self._live())
        if live >= self.o.min_np or self.finishing:
            self.short_since = None
            return
        if self.short_since is None:
            self.short_since = now
            self._say(f"{live} workers, fewer than --min-np {self.o.min_np}: waiting up to "
                      f"--elastic-timeout {self.o.elastic_timeout:g} s for more hosts")
        elif now - self.short_since > self.o.elastic_timeout:
            raise ElasticError(f"only {live} workers for --elastic-timeout "
                               f"{self.o.elastic_timeout:g} s, fewer than --min-np "
                               f"{self.o.min_np}")

    def run(self) -> int:
        previous = {s: signal.signal(s, lambda num, _f: self.sup.events.put(("signal", num)))
                    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
        try:
            return self._loop()
        except ElasticError as exc:
            self._say(f"{exc}; stopping")
            self._stop_all()
            return 1
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
            self.listener.close()

    def _stop_all(self):
        self.sup.stop(signal.SIGTERM)
        deadline = time.monotonic() + GRACE_S
        for w in self.workers:
            if w.proc.code is None:
                try:
                    w.proc.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    w.proc.kill()

    def _loop(self) -> int:
        self._fill(discover(self.o))
        next_discovery = time.monotonic() + DISCOVERY_PERIOD_S
        while True:
            try:
                event = self.sup.events.get(timeout=0.2)
            except queue.Empty:
                event = None
            now = time.monotonic()
            if event and event[0] == "exit":
                event[1].code = event[2]
                self._on_exit(event[1], event[2])
            elif event and event[0] == "join":
                worker = next((w for w in self.workers if w.wid == event[1]), None)
                if worker is None or worker.status != "running":
                    event[2].close()
                else:
                    worker.conn = event[2]
            elif event and event[0] == "stopped":
                self._drop_stopped(event[1], event[2])
            elif event and event[0] == "signal":
                self._say(f"got {signal.Signals(event[1]).name}: stopping the workers")
                self._stop_all()
                return 128 + event[1]
            if self.finishing:
                # A worker that asks to join once the others have finished has nothing to do.
                for w in self._live():
                    if w.conn is not None:
                        self._dismiss(w)
            if not self._live() and self.workers and self.finishing:
                failed = [w for w in self.workers if w.status == "failed"]
                if failed:
                    self._say(f"done; {len(failed)} worker(s) failed along the way")
                return 0
            if now >= next_discovery:
                next_discovery = now + DISCOVERY_PERIOD_S
                offered = discover(self.o)
                changed = self._mark_leaving(offered) + self._fill(offered)
                if changed and self.generation > 0:
                    self.store.add(UPDATES_KEY, 1)
            self._check_enough(now)
            self._try_form()
