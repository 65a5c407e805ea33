"""``horovod.runner``: ``run`` (as ``horovod.run``) under Horovod's name."""
from horovod_ext.launch.api import RunError, run  # noqa: F401

__all__ = ["run", "RunError"]
