"""Running the ranks: their output, their start-up, failures and signals.

Every process hvdrun starts (a rank's agent, locally or through ssh, or mpirun) is one ``Proc`` in
its own session, so a Ctrl-C on the terminal reaches hvdrun only and hvdrun decides what the ranks
get: an agent (agent.py) takes signals as lines on its stdin, mpirun's process group gets them
directly.  One thread per process waits for its exit and one per output stream copies lines with the
``[rank]<stdout>:`` prefix; all events go through one queue that the main thread reads, so the
first failure seen is the first that happened.

Start-up: the runtime (``horovod_ext.backends.bootstrap``) reports ``start`` when a rank enters
hvd.init() and ``ready`` once it is connected to the others, over a TCP connection to the address
in HOROVOD_HVDRUN_NOTIFY.  Once the first rank has started, every rank must be ready within the
start timeout, else the job stops with the ranks that never arrived named.  A program that never
calls hvd.init() is not timed.
"""
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

GRACE_S = 3.0          # after a forwarded signal, before SIGKILL
AGENT_EXIT_S = 2.0     # for an agent (and ssh) to end once told to kill its rank
_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def describe_exit(code: int) -> str:
    if code < 0 or code > 128:
        num = -code if code < 0 else code - 128
        try:
            return f"was killed by signal {num} ({signal.Signals(num).name})"
        except ValueError:
            pass
    return f"exited with code {code}"


def exit_status(code: int) -> int:
    return 128 - code if code < 0 else code


@dataclass(frozen=True)
class Failure:
    """What ended a job: the rank whose process failed (None: mpirun, or ranks that never
    started) and the message hvdrun prints."""
    rank: Optional[int]
    message: str


@dataclass(eq=False)
class Proc:
    name: str                     # how messages name it: "rank 1 (host b)", "mpirun"
    popen: subprocess.Popen
    agent: bool                   # signals travel as lines to an agent's stdin
    rank: Optional[int] = None    # None for mpirun, which stands for all ranks
    code: Optional[int] = None
    threads: List[threading.Thread] = field(default_factory=list)

    def send(self, signum: int):
        if self.code is not None:
            return
        if self.agent:
            try:
                self.popen.stdin.write(f"{signal.Signals(signum).name[3:]}\n".encode())
                self.popen.stdin.flush()
            except (OSError, ValueError):
                pass
        else:
            _killpg(self.popen.pid, signum)

    def kill(self):
        if self.code is not None:
            return
        if not self.agent:
            _killpg(self.popen.pid, signal.SIGKILL)
            return
        self.send(signal.SIGKILL)
        try:
            self.popen.stdin.close()
        except OSError:
            pass
        # The agent (and ssh) end once the rank has; force them only if they hang.
        timer = threading.Timer(AGENT_EXIT_S, _killpg, (self.popen.pid, signal.SIGKILL))
        timer.daemon = True
        timer.start()


def _killpg(pid, signum):
    try:
        os.killpg(pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


class _TextTarget:
    """A text stream without a binary buffer (a Jupyter kernel's sys.stdout), written bytes."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, data: bytes):
        self.stream.write(data.decode("utf-8", "replace"))

    def flush(self):
        self.stream.flush()


def _binary(stream):
    buffer = getattr(stream, "buffer", None)
    return buffer if buffer is not None else _TextTarget(stream)


class Output:
    """Copies a rank's stdout/stderr to ours, each line prefixed, and to per-rank files."""

    def __init__(self, directory: Optional[str], width: int):
        self.directory, self.width = directory, width
        self.lock = threading.Lock()

    def pump(self, stream, rank: Optional[int], tag: str) -> threading.Thread:
        target = _binary(sys.stdout if tag == "stdout" else sys.stderr)
        prefix = f"[{rank}]<{tag}>:".encode() if rank is not None else b""
        copy = None
        if self.directory and rank is not None:
            rank_dir = os.path.join(self.directory, f"rank.{rank:0{self.width}d}")
            os.makedirs(rank_dir, exist_ok=True)
            copy = open(os.path.join(rank_dir, tag), "wb")
        thread = threading.Thread(target=self._copy, args=(stream, target, prefix, copy),
                                  daemon=True)
        thread.start()
        return thread

    def _copy(self, stream, target, prefix, copy):
        fd = stream.fileno()
        at_line_start = True
        pending = b""
        while True:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            if copy is not None:
                copy.write(chunk)
                copy.flush()
            # Whole lines only (a '\r' ends one too, so progress bars redraw), so that ranks'
            # lines never interleave mid-line.
            data = pending + chunk
            cut = max(data.rfind(b"\n"), data.rfind(b"\r")) + 1
            pending, data = data[cut:], data[:cut]
            if data:
                at_line_start = self._emit(target, prefix, data, at_line_start)
        if pending:
            self._emit(target, prefix, pending + b"\n", at_line_start)
        stream.close()
        if copy is not None:
            copy.close()

    def _emit(self, target, prefix, data, at_line_start):
        out = bytearray()
        for piece in data.splitlines(keepends=True):
            if at_line_start and piece not in (b"\r", b"\n", b"\r\n"):
                out += prefix
            out += piece
            at_line_start = piece.endswith((b"\n", b"\r"))
        with self.lock:
            try:
                target.write(bytes(out))
                target.flush()
            except (BrokenPipeError, ValueError):
                pass  # our own output is gone (hvdrun ... | head): keep draining the rank's
        return at_line_start


class NotifyServer:
    """Receives the ranks' ``start``/``ready`` messages (one line per connection)."""

    def __init__(self, events: "queue.SimpleQueue", bind: str):
        self.events = events
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind((bind, 0))
        self.sock.listen(256)
        self.port = self.sock.getsockname()[1]
        self.closed = False
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(2.0)
                data = b""
                try:
                    while b"\n" not in data and len(data) < 1024:
                        chunk = conn.recv(1024)
                        if not chunk:
                            break
                        data += chunk
                except OSError:
                    continue
            parts = data.decode(errors="replace").split()
            if len(parts) >= 2 and parts[0] in ("start", "ready") and parts[1].isdigit():
                self.events.put(("notify", parts[0], int(parts[1]),
                                 parts[2] if len(parts) > 2 else "?"))

    def close(self):
        self.sock.close()


class Supervisor:
    def __init__(self, output: Output, start_timeout: float, rank_hosts: Dict[int, str],
                 verbose: bool = False, failures: Optional[List[Failure]] = None):
        self.output = output
        self.failures = failures if failures is not None else []
        self.start_timeout = start_timeout
        self.rank_hosts = rank_hosts
        self.verbose = verbose
        self.events: "queue.SimpleQueue" = queue.SimpleQueue()
        self.procs: List[Proc] = []
        self.notify: Optional[NotifyServer] = None

    def listen(self, bind: str) -> int:
        """Start the start-up notification server; its port."""
        self.notify = NotifyServer(self.events, bind)
        return self.notify.port

    def start(self, name: str, argv: List[str], env: Dict[str, str], agent: bool,
              rank: Optional[int] = None, pipe_output: bool = True, shown: str = "") -> Proc:
        """Start ``argv``; ``shown`` is what --verbose prints (default: argv)."""
        if self.verbose:
            self._say(f"{name}: {shown or ' '.join(argv)}")
        popen = subprocess.Popen(
            argv, env=env, start_new_session=True,
            stdin=subprocess.PIPE if agent else subprocess.DEVNULL,
            stdout=subprocess.PIPE if pipe_output else None,
            stderr=subprocess.PIPE if pipe_output else None)
        proc = Proc(name, popen, agent, rank)
        if pipe_output:
            proc.threads = [self.output.pump(popen.stdout, rank, "stdout"),
                            self.output.pump(popen.stderr, rank, "stderr")]
        threading.Thread(target=lambda: self.events.put(("exit", proc, popen.wait())),
                         daemon=True).start()
        self.procs.append(proc)
        return proc

    def _say(self, message: str):
        with self.output.lock:
            print(f"hvdrun: {message}", file=sys.stderr, flush=True)

    def run(self) -> int:
        """Wait for every process; the job's exit status."""
        # Signal handlers can only be set from the main thread (horovod_ext.run may be called
        # from another): elsewhere the caller's own handling stays.
        previous = {}
        if threading.current_thread() is threading.main_thread():
            previous = {s: signal.signal(s, lambda num, _f: self.events.put(("signal", num)))
                        for s in _SIGNALS}
        try:
            return self._loop()
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
            if self.notify:
                self.notify.close()
            for proc in self.procs:
                for t in proc.threads:
                    t.join(timeout=2.0)

    def stop(self, signum: int):
        """Forward ``signum`` to every live process (SIGKILL follows after GRACE_S)."""
        for proc in self.procs:
            proc.send(signum)

    def _loop(self) -> int:
        live = set(self.procs)
        started: Dict[int, str] = {}
        ready = set()
        status = None           # exit status once the job is failing or interrupted
        kill_at = None
        start_deadline = None
        while live:
            try:
                event = self.events.get(timeout=0.2)
            except queue.Empty:
                event = None
            now = time.monotonic()
            if event and event[0] == "exit":
                proc, code = event[1], event[2]
                proc.code = code
                live.discard(proc)
                if code != 0 and status is None:
                    status = exit_status(code)
                    failure = f"{proc.name} {describe_exit(code)}" + self._missing_note(started)
                    self.failures.append(Failure(proc.rank, failure))
                    self._say(failure + ("; stopping the other ranks" if live else ""))
                    self.stop(signal.SIGTERM)
                    kill_at = now + GRACE_S
            elif event and event[0] == "signal":
                signum = event[1]
                if status is None:
                    status = 128 + signum
                    self._say(f"got {signal.Signals(signum).name}: passing it to the ranks")
                    self.stop(signum)
                    kill_at = now + GRACE_S
                else:       # a second Ctrl-C: no more waiting
                    kill_at = now
            elif event and event[0] == "notify" and event[2] in self.rank_hosts:
                _, stage, rank, host = event
                if stage == "start":
                    started.setdefault(rank, host)
                    if start_deadline is None:
                        start_deadline = now + self.start_timeout
                else:
                    ready.add(rank)
            if (status is None and start_deadline is not None and now > start_deadline
                    and len(ready) < len(self.rank_hosts)):
                status = 1
                self.failures.append(Failure(None, self._timeout_message(started, ready)))
                self._say(self.failures[-1].message + "; stopping all ranks "
                          "(a larger --start-timeout helps if they are only slow to start)")
                self.stop(signal.SIGTERM)
                kill_at = now + GRACE_S
            if kill_at is not None and now >= kill_at:
                for proc in live:
                    proc.kill()
                kill_at = float("inf")
        return status or 0

    def _ranks(self, ranks) -> str:
        return ", ".join(f"{r} (host {self.rank_hosts.get(r, '?')})" for r in sorted(ranks))

    def _missing_note(self, started) -> str:
        missing = set(self.rank_hosts) - set(started)
        if not started or not missing:
            return ""
        return f" while rank(s) {self._ranks(missing)} had not reached hvd.init()"

    def _timeout_message(self, started, ready) -> str:
        never = set(self.rank_hosts) - set(started)
        if never:
            return (f"rank(s) {self._ranks(never)} did not reach hvd.init() within "
                    f"--start-timeout {self.start_timeout:g} s of the first rank that did")
        return (f"rank(s) {self._ranks(set(self.rank_hosts) - ready)} entered hvd.init() but "
                f"did not connect to the others within --start-timeout "
                f"{self.start_timeout:g} s")
