"""Who is blocked on the engine, and since when: the engine hurries its cycles while a caller
waits, and the deadlock check needs to know that every rank has been waiting for a while."""
import time
from typing import Optional


class Waiters:
    """Callers blocked in ``Engine.wait_for``; the engine updates it under its condition."""

    def __init__(self):
        self.count = 0
        self._since: Optional[float] = None

    def enter(self):
        self.count += 1
        if self._since is None:
            self._since = time.monotonic()

    def leave(self):
        self.count -= 1
        if self.count == 0:
            self._since = None

    def long_blocked(self, deadlock_s: float) -> bool:
        """Whether some caller has been blocked long enough to count towards a deadlock of
        ``deadlock_s``.  Short waits do not count, so that the steady state's messages stay
        equal on every rank.  Read without the lock: one attribute read, and a stale answer
        only delays the deadlock check by a cycle."""
        since = self._since
        return since is not None and time.monotonic() - since >= min(1.0, deadlock_s / 2)
