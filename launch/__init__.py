"""hvdrun, the horovodrun-compatible launcher.  See issue 4."""
