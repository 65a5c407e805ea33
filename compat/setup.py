"""horovod-ext-compat: the top-level ``horovod`` package and the ``horovodrun`` command as thin
aliases of horovod_ext, so that Horovod scripts, job files and tests run without an edit.

Install with ``.venv/bin/pip install ./compat`` after horovod_ext itself.  It refuses to install
where the real Horovod is installed: both own the ``horovod`` package, and one would silently
shadow the other.
"""
import glob
import os
import sysconfig

from setuptools import setup

HOROVOD_API = "0.28.1"
HOROVOD_EXT = "0.1.0"


def _real_horovod():
    """The real Horovod's metadata in the environment being installed into, if any (the build
    may run in an isolated environment, but the interpreter's own site-packages are where the
    package goes)."""
    found = []
    for key in ("purelib", "platlib"):
        found += glob.glob(os.path.join(sysconfig.get_paths()[key], "horovod-*.dist-info"))
        found += glob.glob(os.path.join(sysconfig.get_paths()[key], "horovod-*.egg-info"))
    return sorted(set(found))


real = _real_horovod()
if real:
    raise SystemExit(
        "horovod-ext-compat: the real Horovod is installed here (" + ", ".join(
            os.path.basename(p) for p in real) + "); both provide the 'horovod' package and "
        "one would shadow the other. Uninstall it first (pip uninstall horovod), or keep Horovod "
        "and use horovod_ext under its own name (import horovod_ext.torch as hvd).")

setup(
    name="horovod-ext-compat",
    version=f"{HOROVOD_API}+horovod.ext.{HOROVOD_EXT}",
    description="Horovod's module names and horovodrun over horovod_ext (opt-in compatibility)",
    packages=["horovod", "horovod.common", "horovod.runner", "horovod.runner.util"],
    python_requires=">=3.9",
    install_requires=["horovod_ext"],
    entry_points={"console_scripts": ["horovodrun = horovod.runner.launch:main"]},
)
