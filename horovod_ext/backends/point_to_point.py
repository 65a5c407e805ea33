"""Gloo's send and receive works, waited for whole by a helper thread while callers wait in slices.

A Gloo send or receive cannot be waited for in slices, as its collectives are: a wait that runs
out ends it (Gloo closes the pair), so a long exchange would fail.  A daemon thread waits for each
batch of works whole, one batch at a time in the order they were submitted, and sets the batch's
event; the caller waits for that event in slices, so that an abort still ends its wait at once
(the thread then stays blocked until the group's timeout, in a group that is abandoned).
"""
import queue
import threading
from typing import Callable, List


class Batch:
    """Send and receive works submitted together: ``done`` is set once every one has ended,
    and ``errors`` then holds the first one's error, if any."""

    __slots__ = ("works", "done", "errors")

    def __init__(self, works: List):
        self.works = works
        self.done = threading.Event()
        self.errors: List[RuntimeError] = []


class PointToPointWaiter:
    """The helper thread of one communicator's Gloo sends and receives."""

    def __init__(self):
        self._batches = queue.SimpleQueue()
        threading.Thread(target=self._serve, name="horovod_ext-p2p-wait", daemon=True).start()

    def _serve(self):
        while True:
            batch = self._batches.get()
            try:
                for work in batch.works:
                    work.wait()
            except RuntimeError as exc:
                batch.errors.append(exc)
            batch.done.set()

    def submit(self, works: List) -> Batch:
        """Have the thread wait for ``works`` after every batch submitted before them."""
        batch = Batch(works)
        self._batches.put(batch)
        return batch

    def wait(self, works: List, aborted: Callable[[], None], slice_s: float) -> None:
        """Wait for every work; raise the first one's error, or ``aborted()``'s (a callable
        that raises when the communicator has been aborted) as soon as it raises, looking every
        ``slice_s`` seconds."""
        batch = self.submit(works)
        while not batch.done.wait(slice_s):
            aborted()
        if batch.errors:
            raise batch.errors[0]
