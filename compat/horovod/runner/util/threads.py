"""``horovod.runner.util.threads.in_thread``: start a function on a thread (Horovod's tests
import it)."""
import threading


def in_thread(target, args=(), name=None, daemon=True, silent=False):
    """Run ``target(*args)`` on a new thread and return the thread; an exception it raises is
    reported as threads report them, or dropped when ``silent``."""
    def run():
        try:
            target(*args)
        except Exception:
            if not silent:
                raise

    thread = threading.Thread(target=run, name=name, daemon=daemon)
    thread.start()
    return thread
