"""SLAMB and sparse random-k synchronisation.  See issue 7."""
