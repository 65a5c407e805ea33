"""``horovod.common.exceptions``: horovod_ext's exception classes under Horovod's names."""
from horovod_ext.torch import HorovodInternalError, HostsUpdatedInterrupt  # noqa: F401

__all__ = ["HorovodInternalError", "HostsUpdatedInterrupt"]
