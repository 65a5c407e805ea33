"""The engine and runtime: requests, negotiation across ranks, fusion, execution, and the
process-wide state that ``hvd.init()`` sets up.

Layer 3 (with ``ops``): it finds ops only through the registry and reaches the network only
through ``backends``.  The torch API (layer 4) submits requests here and waits on handles.
"""
# flake8: noqa: F401 - the names the torch API uses
from .requests import JOIN_NAME, NEXT_CYCLE, Handle, HorovodInternalError, Request
