"""horovod_ext: Horovod-style data-parallel training for PyTorch on slow networks.

Kept light on purpose: ``import horovod_ext.torch as hvd`` is the public entry point.
``horovod_ext.run`` (Horovod's ``horovod.run``) is the launcher's and ``horovod_ext.plan`` the
scale model's (horovod_ext/planning), both imported on first use: the package root is only a
facade over them, and importing ``horovod_ext`` starts nothing.
"""
__version__ = "0.1.0"


def __getattr__(name):
    if name == "run":
        from horovod_ext.launch.api import run
        return run
    if name == "plan":
        from .planning import plan
        return plan
    if name == "RunError":
        from horovod_ext.launch.api import RunError
        return RunError
    raise AttributeError(f"module 'horovod_ext' has no attribute {name!r}")
