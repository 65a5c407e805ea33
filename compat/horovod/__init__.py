"""Horovod's module names over horovod_ext (the horovod-ext-compat package).

``horovod.torch`` and everything under it, and ``horovod.ray``, are horovod_ext's own modules
under Horovod's names (aliases, not copies: ``horovod.torch.allreduce is
horovod_ext.torch.allreduce``); ``horovod.run`` is ``horovod_ext.run``; ``horovod.common.exceptions``
and ``horovod.runner`` hold the few other names Horovod scripts and tests import.
"""
import importlib
import importlib.abc
import importlib.metadata
import importlib.util
import sys

HOROVOD_API_VERSION = "0.28.1"
#: Horovod's API level, then ours: scripts comparing versions see Horovod 0.28.1.
__version__ = f"{HOROVOD_API_VERSION}+horovod.ext.{importlib.import_module('horovod_ext').__version__}"


def _refuse_beside_real_horovod():
    try:
        real = importlib.metadata.distribution("horovod")
    except importlib.metadata.PackageNotFoundError:
        return
    raise ImportError(
        f"both the real Horovod {real.version} and horovod-ext-compat are installed, and they "
        f"share the 'horovod' package: its files are now a mix of the two. Uninstall both "
        f"(pip uninstall horovod horovod-ext-compat) and install the one you want.")


_refuse_beside_real_horovod()

# horovod.<prefix>... -> horovod_ext.<prefix>...
_ALIASED = ("torch", "ray")


def _target(fullname: str):
    parts = fullname.split(".")
    if len(parts) >= 2 and parts[0] == __name__ and parts[1] in _ALIASED:
        return ".".join(["horovod_ext"] + parts[1:])
    return None


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports ``horovod.torch.x`` as the module ``horovod_ext.torch.x`` itself."""

    def find_spec(self, fullname, path, target=None):
        name = _target(fullname)
        if name is None or importlib.util.find_spec(name) is None:
            return None
        spec = importlib.util.spec_from_loader(fullname, self)
        spec.loader_state = name
        return spec

    def create_module(self, spec):
        return importlib.import_module(spec.loader_state)

    def exec_module(self, module):
        pass  # imported already, under its own name


if not any(isinstance(f, _Alias) for f in sys.meta_path):
    sys.meta_path.insert(0, _Alias())


def __getattr__(name):
    if name == "run":
        from horovod_ext.launch.api import run
        return run
    if name in _ALIASED:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module 'horovod' has no attribute {name!r}")
