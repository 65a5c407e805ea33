"""Communicators (MPI, torch.distributed), the control plane, start-up and topology."""
from .base import CommunicationError, Communicator, ReduceOp, split_sizes

__all__ = ["CommunicationError", "Communicator", "ReduceOp", "split_sizes"]
