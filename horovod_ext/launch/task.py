"""One worker of ``horovod_ext.run``: fetch the function from the caller, run it, send back its
result or its exception (``python -m horovod_ext.launch.task``, started by hvdrun's machinery on
every rank).

The caller's address and the run's key come in HOROVOD_RUN_DRIVER (``ADDR[,ADDR...]:PORT``) and
HOROVOD_RUN_KEY; ``launch.driver`` describes the messages.
"""
import os
import sys
import traceback

from . import driver


def _rank() -> int:
    """This worker's rank: hvd.rank() while horovod_ext is initialised; in an elastic job,
    which learns ranks only at init, the rank of its last generation; else the one its launcher
    gave it."""
    hvd = sys.modules.get("horovod_ext.torch")
    if hvd is not None and hvd.is_initialized():
        return hvd.rank()
    from horovod_ext.backends import bootstrap
    launch = bootstrap.detect_launch(os.environ)
    if launch.kind == "elastic" and bootstrap.elastic_membership is not None:
        return bootstrap.elastic_membership.rank   # the last generation it was part of
    return launch.rank


def main() -> int:
    client = driver.Client(os.environ["HOROVOD_RUN_DRIVER"], os.environ["HOROVOD_RUN_KEY"])
    launch_rank = _rank()
    func, args, kwargs = driver.loads(client.request(("fetch", launch_rank)))
    try:
        result = func(*args, **kwargs)
    except BaseException as exc:  # noqa: B902 (SystemExit, KeyboardInterrupt: reported too)
        text = traceback.format_exc()
        try:
            payload = driver.dumps(exc)
        except Exception:  # an exception that cannot be pickled still reaches the caller as text
            payload = None
        client.request(("error", _rank(), payload, text))
        return 1
    client.request(("result", _rank(), driver.dumps(result)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
