"""The papers' math, written against the communicator interface (``backends.base``).

Layer 2: these modules import only ``horovod_ext.backends``; the ops in ``horovod_ext.ops`` and
the optimizers in ``horovod_ext.torch`` wrap them.

- ``adasum``: Adasum's pairwise combine and its recursive vector-halving tree;
- ``onebit``: 1-bit compression with error feedback, 1-bit Adam and 1-bit LAMB;
- ``slamb``: random-k masks, sparse averaging and the SLAMB optimizer;
- ``powersgd``: PowerSGD's low-rank compression with error feedback;
- ``sparseloco``: SparseLoCo's chunked top-k; ``quantize``: the chunked uniform quantiser;
  ``compressed_average``: the error-fed average of either over a communicator (``codes``
  holds what they share);
- ``lamb``: LAMB, the base of 1-bit LAMB and SLAMB.
"""
