"""horovod_ext: Horovod-style data-parallel training for PyTorch on slow networks.

Kept light on purpose: ``import horovod_ext.torch as hvd`` is the public entry point.
"""
__version__ = "0.1.0"
