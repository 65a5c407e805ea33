"""The Horovod timeline: a Chrome trace of where each tensor's time goes, written as the run goes.

The file is in the Chrome trace event format (a JSON array) that Perfetto and chrome://tracing
open.  One track (a "process" of the format) per tensor name, as in Horovod.  Each activity is a
complete event (``"ph": "X"``) with the bytes it moved in ``args``; while a tensor is negotiated,
each rank's submission is an instant event named by the rank, so stragglers show; with
``mark_cycles`` every engine cycle is a global instant ``CYCLE_START``.

A writer thread appends the recorded events a few times a second, one per line, each line
complete.  A job that crashes therefore leaves a file whose every line but possibly the last is
an event: the viewers read an array without its closing bracket, and ``load`` does the same.
``stop`` (or shutdown) writes the rest and closes the array.

Timestamps are microseconds on the job's clock: zero at rank 0's init, each rank corrected by
its clock's offset from rank 0's measured at init, so files written by all ranks line up.
"""
import json
import os
import statistics
import threading
import time
from collections import deque
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from horovod_ext.backends import trace

FLUSH_INTERVAL_S = 0.2
OTHER_TRACK = "(outside a request)"
_perf_ns = time.perf_counter_ns


def path_for_rank(path: str, rank: int, all_ranks: bool) -> Optional[str]:
    """Where ``rank`` writes: rank 0 writes ``path``; with all ranks, each writes
    ``<stem>.rank<N><ext>``; None where this rank writes nothing."""
    if not all_ranks:
        return path if rank == 0 else None
    stem, ext = os.path.splitext(path)
    return f"{stem}.rank{rank}{ext or '.json'}"


class _Activity:
    """One activity being timed; recorded when it ends."""

    __slots__ = ("_timeline", "_name", "_nbytes", "_args", "_tracks", "_start")

    def __init__(self, timeline: "Timeline", name: str, nbytes: int, args: Optional[dict],
                 tracks: Tuple[str, ...]):
        self._timeline, self._name, self._nbytes, self._args = timeline, name, nbytes, args
        self._tracks = tracks

    def __enter__(self):
        self._start = _perf_ns()
        return self

    def __exit__(self, *exc_info):
        args = self._args
        if self._nbytes:
            args = dict(args or (), bytes=self._nbytes)
        self._timeline._records.append(("X", self._tracks, self._name, self._start, _perf_ns(),
                                        args))
        return False


class _Execution:
    """A batch of requests being executed: their tracks are current on this thread, a QUEUE
    activity covers the wait since they were negotiated, and the whole is one activity named
    after the operation."""

    __slots__ = ("_timeline", "_tracks", "_name", "_since", "_nbytes", "_previous")

    def __init__(self, timeline, tracks, name, since, nbytes):
        self._timeline, self._tracks, self._name = timeline, tracks, name
        self._since, self._nbytes = since, nbytes

    def __enter__(self):
        tl = self._timeline
        now = _perf_ns()
        if self._since is None:
            self._since = now
        elif now > self._since:
            tl._records.append(("X", self._tracks, "QUEUE", self._since, now, None))
        self._previous = getattr(tl._local, "tracks", None)
        tl._local.tracks = self._tracks
        return self

    def __exit__(self, *exc_info):
        tl = self._timeline
        tl._local.tracks = self._previous
        args = {"bytes": self._nbytes} if self._nbytes else None
        tl._records.append(("X", self._tracks, self._name, self._since, _perf_ns(), args))
        return False


class Timeline:
    """Records activities from any thread and writes them to ``path`` from a thread of its own.

    ``clock_zero_ns``: this process's ``time.time_ns()`` at the job clock's zero."""

    def __init__(self, path: str, rank: int, mark_cycles: bool = False,
                 clock_zero_ns: Optional[int] = None):
        self.path = path
        self.rank = rank
        self.mark_cycles = mark_cycles
        wall, perf = time.time_ns(), _perf_ns()
        zero = wall if clock_zero_ns is None else clock_zero_ns
        self._shift_ns = wall - perf - zero   # perf_counter_ns -> job clock
        self._records: deque = deque()        # appended by any thread, drained by the writer
        self._local = threading.local()
        self._negotiating: Dict[Tuple[str, ...], int] = {}   # tracks -> first submission seen
        self._pids: Dict[str, int] = {}
        self._lines_written = 0
        parent = os.path.dirname(os.path.abspath(path))
        os.makedirs(parent, exist_ok=True)
        self._file = open(path, "w", encoding="utf-8")
        self._file.write("[\n")
        self._write_line(json.dumps({
            "name": "horovod_ext", "ph": "M", "pid": 0,
            "args": {"rank": rank, "start_time_since_epoch_in_micros": zero // 1000}}))
        self._file.flush()
        self._stop = threading.Event()
        self._lock = threading.Lock()          # one drain at a time
        self._thread = threading.Thread(target=self._write_loop, name="horovod_ext-timeline",
                                        daemon=True)
        self._thread.start()

    # --- recording (any thread) ---------------------------------------------------------------
    def tracks(self) -> Tuple[str, ...]:
        return getattr(self._local, "tracks", None) or (OTHER_TRACK,)

    def activity(self, name: str, nbytes: int = 0, args: Optional[dict] = None,
                 tracks: Optional[Tuple[str, ...]] = None) -> _Activity:
        """``tracks``: where, when not this thread's current ones (work handed to a helper
        thread, such as the pipelined hierarchical allreduce's cross-node steps)."""
        return _Activity(self, name, nbytes, args, tracks or self.tracks())

    def executing(self, tracks: Sequence[str], name: str, since: Optional[int],
                  nbytes: int = 0) -> _Execution:
        return _Execution(self, tuple(tracks), name, since, nbytes)

    def submitted(self, tracks: Tuple[str, ...], rank: int):
        """Rank ``rank``'s submission of the request with these tensors' ``tracks`` reached
        this rank's negotiation."""
        at = _perf_ns()
        self._negotiating.setdefault(tracks, at)
        self._records.append(("i", tracks, str(rank), at, None, None))

    def negotiated(self, tracks: Tuple[str, ...], kind: str):
        """Every rank has submitted the request: its negotiation ends now."""
        end = _perf_ns()
        start = self._negotiating.pop(tracks, end)
        self._records.append(("X", tracks, f"NEGOTIATE_{kind.upper()}", start, end, None))

    def abandoned(self, tracks: Tuple[str, ...]):
        """A request failed before every rank submitted it: its negotiation never ends."""
        self._negotiating.pop(tracks, None)

    def negotiated_together(self, requests: Sequence[Tuple[Tuple[str, ...], str]], size: int,
                            since: int):
        """Requests (their tracks, their kind) that every rank submitted in the same round,
        which started at ``since``."""
        end = _perf_ns()
        for tracks, kind in requests:
            for rank in range(size):
                self._records.append(("i", tracks, str(rank), since, None, None))
            self._records.append(("X", tracks, f"NEGOTIATE_{kind.upper()}", since, end, None))

    def cycle_start(self):
        self._records.append(("g", (), "CYCLE_START", _perf_ns(), None, None))

    # --- writing ------------------------------------------------------------------------------
    def _write_loop(self):
        while not self._stop.wait(FLUSH_INTERVAL_S):
            self.flush()

    def flush(self):
        """Write what has been recorded so far."""
        with self._lock:
            if self._file.closed:
                return
            records = self._records
            lines: List[str] = []
            while records:
                self._format(records.popleft(), lines)
            if lines:
                for line in lines:
                    self._write_line(line)
                self._file.flush()

    def _write_line(self, line: str):
        self._file.write(("," if self._lines_written else "") + line + "\n")
        self._lines_written += 1

    def _pid(self, track: str, lines: List[str]) -> int:
        pid = self._pids.get(track)
        if pid is None:
            pid = self._pids[track] = len(self._pids) + 1
            lines.append(json.dumps({"name": "process_name", "ph": "M", "pid": pid,
                                     "args": {"name": track}}))
            lines.append(json.dumps({"name": "process_sort_index", "ph": "M", "pid": pid,
                                     "args": {"sort_index": pid}}))
        return pid

    def _format(self, record, lines: List[str]):
        kind, tracks, name, start, end, args = record
        ts = (start + self._shift_ns) / 1000.0
        tail = f',"args":{json.dumps(args)}}}' if args else "}"
        if kind == "g":
            lines.append(f'{{"name":"{name}","ph":"i","s":"g","ts":{ts:.3f},"pid":0,"tid":0'
                         + tail)
            return
        for track in tracks:
            pid = self._pid(track, lines)
            if kind == "X":
                lines.append(f'{{"name":"{name}","ph":"X","ts":{ts:.3f},'
                             f'"dur":{(end - start) / 1000.0:.3f},"pid":{pid},"tid":0' + tail)
            else:
                lines.append(f'{{"name":"{name}","ph":"i","s":"p","ts":{ts:.3f},"pid":{pid},'
                             f'"tid":0' + tail)

    def stop(self):
        """Write everything recorded and close the file as a complete JSON array."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join()
        self.flush()
        with self._lock:
            if not self._file.closed:
                self._file.write("]\n")
                self._file.close()


def start(path: str, rank: int, mark_cycles: bool = False,
          clock_zero_ns: Optional[int] = None) -> Timeline:
    """Start recording into ``path`` (stopping any timeline recording now)."""
    stop()
    timeline = Timeline(path, rank, mark_cycles, clock_zero_ns)
    trace.recorder = timeline
    return timeline


def stop():
    """Stop the recording timeline, if any, and complete its file."""
    timeline, trace.recorder = trace.recorder, None
    if timeline is not None:
        timeline.stop()


def load(path: str) -> list:
    """The events of a timeline file, complete or cut short by a crash (its last, partial line
    is dropped)."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    lines = text.split("\n")
    if not text.endswith("\n"):
        lines = lines[:-1]          # a line the writer did not finish
    body = "\n".join(line for line in lines if line.strip() not in ("", "]"))
    return json.loads(body + "\n]")


def clock_zero(world) -> int:
    """This process's ``time.time_ns()`` at rank 0's, now: right after a barrier every rank
    reads its clock, and the median over a few rounds of the difference to rank 0's reading is
    this clock's offset (within about one latency of the barrier's release)."""
    if world.size == 1:
        return time.time_ns()
    offsets, zero = [], None
    for _ in range(3):
        world.barrier()
        now = torch.tensor([time.time_ns()], dtype=torch.int64)
        readings = world.allgather(now)
        offsets.append(int(readings[world.rank]) - int(readings[0]))
        zero = int(readings[0]) if zero is None else zero
    return zero + int(statistics.median(offsets))
