"""PowerSGD (Vogels et al., 2019): rank-r gradient compression with error feedback, the
algorithm of torch's ``powerSGD_hook``, written against the communicator interface."""
from .compress import PowerSGDState, orthogonalize_, powersgd_allreduce_, should_compress

__all__ = ["PowerSGDState", "orthogonalize_", "powersgd_allreduce_", "should_compress"]
