"""Adasum (Maleki et al.): adaptive summation by recursive vector-halving.  See issue 5."""
