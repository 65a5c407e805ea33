"""1-bit compressed allreduce, 1-bit Adam and 1-bit LAMB.  See issue 6."""
