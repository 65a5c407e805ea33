"""The engine and runtime: requests, negotiation across ranks, fusion, execution, and the
process-wide state that ``hvd.init()`` sets up.

Layer 3 (with ``ops``): it finds ops only through the registry and reaches the network only
through ``backends``.  The torch API (layer 4) submits requests here and waits on handles.

As in Horovod, API calls only enqueue a request and return a handle.  A background thread runs
cycles; in each cycle every rank sends what it has newly submitted (a cache id for a request seen
before with the same shape, its full description otherwise) over the control plane (wire.py), so
every rank holds the same table of who submitted what (negotiation.py).  A name becomes ready
when every (non-joined) rank has submitted it; ready requests are checked for agreement (kind,
op, dtype, shape, root, scaling), packed into fusion buffers up to HOROVOD_FUSION_THRESHOLD bytes
(fusion.py) and reduced with one op call per buffer (execution.py).  Ranks may submit in
different orders.  Disagreements fail on every rank with an error naming the tensor and the
ranks; a name left unmatched at shutdown fails the same way; a peer that dies or goes silent
fails every pending request within the communication timeout.
"""
# flake8: noqa: F401 - the names the torch API uses
from .requests import JOIN_NAME, NEXT_CYCLE, Handle, HorovodInternalError, Request
